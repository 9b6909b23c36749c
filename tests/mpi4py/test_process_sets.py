"""The same two trainings in one Horovod world: each group a process set made from its
mpi4py communicator (`hvd.ProcessSet(group)`, given to `hvd.init`), passed to the
optimizer as `process_set=`.

Horovod takes process sets from communicators only at `hvd.init(comm=<communicator>,
process_sets=[...])`; `hvd.add_process_set` refuses them. Horovod's broadcasts name
their root by its global rank, and group 1 lacks global rank 0: the drift repair and
the checkpoint must name the set's own first member. Every rank runs every test
(conftest.py).
"""

import os

import horovod.torch as hvd
import torch
from conftest import GROUP, MEMBER, WORLD
from mpi_helpers import (
    make_model,
    same_in_group_different_across,
    shared_state,
    train,
    train_with_drift_on_group_rank_1,
)

import horovod_powersgd as hps


def powersgd(model, process_set, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hps.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), process_set=process_set, **kwargs
    )


def start(seed, process_set, **kwargs):
    """Model and optimizer of this rank's member, its parameters from the set's first rank."""
    model = make_model(seed + GROUP.rank)  # differs within the group until the broadcast
    root = process_set.ranks[0]  # Horovod's broadcasts take the root's global rank
    for name, p in model.state_dict().items():
        hvd.broadcast_(p, root_rank=root, name=f"init.{name}", process_set=process_set)
    return model, powersgd(model, process_set, **kwargs)


def test_the_process_set_is_this_ranks_group(group_process_set):
    assert hvd.size() == WORLD.size
    assert group_process_set.ranks == GROUP.allgather(WORLD.rank)
    assert (group_process_set.rank(), group_process_set.size()) == (GROUP.rank, GROUP.size)


def test_two_trainings_on_process_sets_stay_inside_their_sets(group_process_set, across):
    seed = 31 + 10 * MEMBER
    model, opt = start(seed, group_process_set, rank=2)
    train(model, opt, 6, seed)
    assert opt.compression_stats()["ratio"] > 1  # P and Q went through the set
    across.check(shared_state(model, opt), same_in_group_different_across)


def test_drift_is_repaired_inside_the_process_set(group_process_set, across):
    seed = 51 + 10 * MEMBER
    model, opt = start(seed, group_process_set, rank=2, drift_check_every=3)
    drifted = train_with_drift_on_group_rank_1(model, opt, seed)
    assert len(drifted) == 1 and "'2.weight'" in drifted[0], drifted
    across.check(shared_state(model, opt), same_in_group_different_across)


def test_a_checkpoint_per_process_set_resumes_exactly(group_process_set, shared_dir, across):
    seed = 71 + 10 * MEMBER
    path = os.path.join(shared_dir, f"member{MEMBER}.pt")
    model, opt = start(seed, group_process_set, rank=2)
    train(model, opt, 3, seed)
    hps.save_checkpoint(path, model, opt)
    train(model, opt, 3, seed, first_step=3)
    expected = shared_state(model, opt)

    resumed, resumed_opt = start(seed + 1000, group_process_set, rank=2)
    hps.load_checkpoint(path, resumed, resumed_opt)
    train(resumed, resumed_opt, 3, seed, first_step=3)
    now = shared_state(resumed, resumed_opt)
    assert all(torch.equal(now[n], expected[n]) for n in expected)
    across.check(now, same_in_group_different_across)
