"""Shared by the mpi4py tests: a small model, per-member data, and comparisons across groups."""

import warnings

import torch
import torch.nn.functional as F
from conftest import GROUP, MEMBERS
from torch import nn

import horovod_powersgd as hps


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)
    )


def powersgd(model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def train(model, opt, steps, seed, first_step=0):
    """`steps` steps on data of this member's `seed` and this rank's place in its group."""
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(100_000 * seed + 1000 * step + GROUP.rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def train_with_drift_on_group_rank_1(model, opt, seed):
    """Two steps, a nudge to one weight on group rank 1, then step 3; its drift warnings.

    The nudge is what a processor that rounds differently does; `opt` checks every 3 steps.
    """
    train(model, opt, 2, seed)
    if GROUP.rank == 1:
        with torch.no_grad():
            model[2].weight[0, 0] += 1e-6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, 1, seed, first_step=2)
    return [str(w.message) for w in caught if "parameters differed" in str(w.message)]


def shared_state(model, opt):
    """What must be equal on every rank of a group: parameters and the PowerSGD Q memory."""
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, q in opt.compressor.state_dict()["q_memory"].items():
        state[f"q_memory.{n}"] = q.clone()
    return state


def same_in_group_different_across(states):
    """Assert on `states` (name -> tensor, of every world rank, see `Across.check`):
    bitwise equal within each group, every tensor different between the groups."""
    first = {m: MEMBERS.index(m) for m in set(MEMBERS)}
    for rank, theirs in enumerate(states):
        ours = states[first[MEMBERS[rank]]]
        for name, tensor in theirs.items():
            assert torch.equal(tensor, ours[name]), f"{name} differs within group {MEMBERS[rank]}"
    for name, tensor in states[first[0]].items():
        assert not torch.equal(tensor, states[first[1]][name]), f"{name} equal across groups"
