"""Two trainings in one MPI job: hvd.init(comm=group) on each half of COMM_WORLD.

Each group is a Horovod world of its own, so everything PowerSGD does (P and Q
all-reduces, the agreement on shared state, the drift check and its repair,
checkpoints) must stay inside the group. Every rank runs every test (conftest.py).
"""

import glob
import os

import horovod.torch as hvd
import pytest
import torch
from conftest import GROUP, MEMBER, MEMBERS, WORLD
from mpi_helpers import (
    make_model,
    powersgd,
    same_in_group_different_across,
    shared_state,
    train,
    train_with_drift_on_group_rank_1,
)

import horovod_powersgd as hps

pytestmark = pytest.mark.usefixtures("horovod_per_group")


def test_each_group_is_a_horovod_world_of_its_own():
    # What a script scales its learning rate and shards its data by.
    assert (hvd.rank(), hvd.size()) == (GROUP.rank, GROUP.size)
    total = hvd.allreduce(torch.tensor([WORLD.rank]), op=hvd.Sum, name="world_ranks")
    assert total.item() == sum(GROUP.allgather(WORLD.rank))  # this group's ranks only


def _run(seed, steps=6):
    model = make_model(seed)
    opt = powersgd(model, rank=2)
    train(model, opt, steps, seed)
    return shared_state(model, opt)


def test_two_trainings_in_one_job_stay_inside_their_groups(across):
    # Group 0 trains the same member twice while group 1 changes its member: group
    # 0's result must not move, bit for bit (nothing of group 1 reached it), and be
    # bitwise equal on its ranks; the groups' results differ.
    first = _run(seed=1 if MEMBER == 0 else 2)
    second = _run(seed=1 if MEMBER == 0 else 3)
    across.check(first, same_in_group_different_across)
    across.check(second, same_in_group_different_across)
    unchanged = all(torch.equal(first[n], second[n]) for n in first)
    across.check(unchanged, _only_group_0_unchanged)


def _only_group_0_unchanged(unchanged):
    assert unchanged == [member == 0 for member in MEMBERS], unchanged


def test_drift_is_repaired_from_the_groups_own_first_rank(across):
    seed = 11 + MEMBER
    model = make_model(seed)
    opt = powersgd(model, rank=2, drift_check_every=3)
    drifted = train_with_drift_on_group_rank_1(model, opt, seed)
    assert len(drifted) == 1 and "'2.weight'" in drifted[0], drifted
    # Repaired from group 1's own first rank, not from world rank 0 (group 0's).
    across.check(shared_state(model, opt), same_in_group_different_across)


def test_a_checkpoint_per_group_resumes_exactly(shared_dir, across):
    # Both groups save side by side in one directory, as members of an ensemble
    # would: each resumes its own bit for bit, and neither removes the other's files.
    seed = 21 + MEMBER
    path = os.path.join(shared_dir, f"member{MEMBER}.pt")
    model = make_model(seed)
    opt = powersgd(model, rank=2)
    train(model, opt, 3, seed)
    hps.save_checkpoint(path, model, opt, member=MEMBER)
    train(model, opt, 3, seed, first_step=3)
    expected = shared_state(model, opt)
    saved_errors = opt.compressor.state_dict()["error_buffers"]
    expected_errors = {n: e.clone() for n, e in saved_errors.items()}

    resumed = make_model(seed=99)
    resumed_opt = powersgd(resumed, rank=2)
    assert hps.load_checkpoint(path, resumed, resumed_opt) == {"member": MEMBER}
    train(resumed, resumed_opt, 3, seed, first_step=3)
    now = shared_state(resumed, resumed_opt)
    assert all(torch.equal(now[n], expected[n]) for n in expected)
    errors = resumed_opt.compressor.state_dict()["error_buffers"]
    assert all(torch.equal(errors[n], expected_errors[n]) for n in expected_errors)
    assert resumed_opt.compression_stats() == opt.compression_stats()
    across.check(now, same_in_group_different_across)
    # Once both groups have saved: every rank file of both is still there.
    across.check(None, lambda _: _rank_files_of_both_groups(shared_dir))


def _rank_files_of_both_groups(directory):
    for member in range(2):
        files = glob.glob(os.path.join(directory, f"member{member}.pt.powersgd-*"))
        assert len(files) == MEMBERS.count(member), (member, files)
