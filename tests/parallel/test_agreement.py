"""Ranks agree on what must be equal: the shared PowerSGD state after a rank-local
load, and the parameters themselves when ranks round differently.

Every rank runs every test (see conftest.py).
"""

import warnings

import horovod.torch as hvd
import pytest
import torch
from helpers import assert_same_on_every_rank, make_model, train
from torch import nn

import horovod_powersgd as hps

TOOK_OVER = "took the PowerSGD state of rank 0"
DRIFTED = "parameters differed across ranks"


def sgd(model, momentum=0.0, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def train_recording_warnings(model, opt, steps, first_step=0):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, steps=steps, first_step=first_step)
    return [str(w.message) for w in caught]


# --- rank-0 resume without hvd.broadcast_optimizer_state (issue 23, item 2) -----------------
@pytest.mark.parametrize(
    "kwargs", [{"start_iter": 3}, {"rounds": 1}, {}], ids=["start_iter3", "rounds1", "default"]
)
def test_rank0_load_then_only_broadcast_parameters_agrees_before_the_next_step(kwargs):
    # SGD without momentum has no optimizer state, so Horovod's scripts often load on
    # rank 0 and broadcast only the parameters. Ranks then disagree on the step counter
    # (warm-up or not, the rounds=1 phase), Q memory and RNG until the first step agrees.
    model = make_model()
    opt = sgd(model, **kwargs)
    train(model, opt, steps=5)  # start_iter=3: steps 3-4 compressed; rounds=1: next is odd
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    resumed = make_model(seed=7)
    resumed_opt = sgd(resumed, **kwargs)
    if hvd.rank() == 0:
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    messages = train_recording_warnings(resumed, resumed_opt, steps=4, first_step=5)

    assert resumed_opt.powersgd_step == 9
    assert_same_on_every_rank(torch.tensor([resumed_opt.powersgd_step]), "step")
    for n, p in resumed.named_parameters():
        assert torch.isfinite(p).all(), n
        assert_same_on_every_rank(p, n)
    for kind in ("q_memory", "p_memory") if kwargs.get("rounds") == 1 else ("q_memory",):
        for n, t in resumed_opt.compressor.state_dict()[kind].items():
            assert_same_on_every_rank(t, f"{kind}.{n}")
    # Every rank warns alike, once, which ranks dropped their residuals.
    took_over = [m for m in messages if TOOK_OVER in m]
    assert len(took_over) == 1, messages
    assert f"rank(s) {list(range(1, hvd.size()))} took" in took_over[0]
    # Rank 0 kept its own restored state: its residuals equal the saved ones.
    if hvd.rank() == 0:
        assert resumed_opt.compression_stats()["steps"] == 9


def test_a_fresh_optimizer_agrees_silently_and_costs_one_small_collective_once():
    model = make_model()
    opt = sgd(model)
    calls = []
    real = hvd.allgather

    def counting(tensor, *args, **kwargs):
        calls.append(kwargs.get("name", ""))
        return real(tensor, *args, **kwargs)

    hvd_allgather, hvd.allgather = hvd.allgather, counting
    try:
        messages = train_recording_warnings(model, opt, steps=3)
    finally:
        hvd.allgather = hvd_allgather
    assert not messages
    assert [c for c in calls if c.endswith(".agree")] == [f"{opt._name}.agree"]


# --- parameters that drift apart (issue 23, item 3) -----------------------------------------
@pytest.mark.world_size(2)
def test_drift_between_ranks_is_found_and_repaired_with_a_warning_on_every_rank():
    model = make_model()
    opt = sgd(model, momentum=0.9, drift_check_every=4)
    train(model, opt, steps=2)
    if hvd.rank() == 1:  # what a processor that rounds differently does, in one step
        with torch.no_grad():
            model[2].weight[0, 0] = torch.nextafter(model[2].weight[0, 0], torch.tensor(1.0))
            opt.state[model[0].weight]["momentum_buffer"][3, 3] += 1e-7
    messages = train_recording_warnings(model, opt, steps=1, first_step=2)  # step 3: no check
    assert not messages
    if hvd.rank() == 1:  # still different: the check has not run
        assert not torch.equal(model[2].weight, hvd.broadcast(model[2].weight, 0, name="w0"))
    else:
        hvd.broadcast(model[2].weight, 0, name="w0")
    messages = train_recording_warnings(model, opt, steps=1, first_step=3)  # step 4: check
    drifted = [m for m in messages if DRIFTED in m]
    assert len(drifted) == 1, messages
    assert "'2.weight'" in drifted[0] and "'0.weight'" in drifted[0]
    for n, p in model.named_parameters():
        assert_same_on_every_rank(p, n)
        assert_same_on_every_rank(opt.state[p]["momentum_buffer"], f"momentum.{n}")
    assert opt._guard.repairs == 1


@pytest.mark.world_size(2)
def test_ranks_with_different_thread_counts_are_identical_after_every_check():
    # Rank 0 with one BLAS thread, rank 1 with two: matrix products may round
    # differently, so the ranks' rebuilt gradients may differ in their last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if hvd.rank() == 0 else 2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        opt = hps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            rank=4,
            drift_check_every=5,
        )
        for step in range(10):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            x = torch.randn(64, 256, generator=g)
            opt.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", DRIFTED)
                opt.step()
            if (step + 1) % 5 == 0:  # after a check: identical, whatever the rounding did
                for n, p in model.named_parameters():
                    assert_same_on_every_rank(p, f"{step}.{n}")
        assert opt._guard.checks == 3  # after the first step, then steps 5 and 10
    finally:
        torch.set_num_threads(threads)


def test_drift_check_every_zero_never_checks_and_bad_values_raise():
    model = make_model()
    opt = sgd(model, drift_check_every=0)
    train(model, opt, steps=3)
    assert opt._guard.checks == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="drift_check_every"):
            sgd(model, drift_check_every=bad)
