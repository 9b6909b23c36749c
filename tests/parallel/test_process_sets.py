"""An optimizer on a process set that does not hold global rank 0.

Horovod's root ranks are global ranks: every broadcast of the drift repair, of
the first-step agreement and of the checkpoints must name the set's own
member, never set rank 0 or global rank 0. `make test` runs this file with 3
processes too (the set {1, 2}); with 2, the set {1}.
"""

import os
import warnings

import horovod.torch as hvd
import pytest
import torch
from helpers import make_model, train

import horovod_powersgd as hps


@pytest.fixture
def upper():
    """The process set of every rank but global rank 0."""
    process_set = hvd.add_process_set(list(range(1, hvd.size())))
    yield process_set
    hvd.remove_process_set(process_set)


def powersgd(model, process_set, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hps.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), process_set=process_set, **kwargs
    )


def assert_same_in(process_set, tensor, name):
    """Bitwise equal on every member of `process_set` (a no-op outside it)."""
    if not process_set.included():
        return
    gathered = hvd.allgather(
        tensor.detach().reshape(1, -1).float(), name=f"in.{name}", process_set=process_set
    )
    for r in range(1, process_set.size()):
        assert torch.equal(gathered[r], gathered[0]), f"{name} differs inside the set"


def recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


@pytest.mark.world_size(3)
def test_drift_inside_the_set_is_repaired_from_its_first_member(upper):
    model = make_model()
    opt = powersgd(model, upper, drift_check_every=2)
    train(model, opt, steps=1)
    if hvd.rank() == 2:
        with torch.no_grad():
            model[0].weight[0, 0] += 1e-6
    messages = recorded(lambda: train(model, opt, steps=1, first_step=1))
    if upper.included():
        drifted = [m for m in messages if "parameters differed across ranks" in m]
        assert len(drifted) == 1 and "reset to rank 1's" in drifted[0], messages
    for n, p in model.named_parameters():
        assert_same_in(upper, p, n)


@pytest.mark.world_size(3)
def test_the_agreement_takes_the_state_of_the_member_that_loaded_one(upper):
    model = make_model()
    opt = powersgd(model, upper, start_iter=2)
    train(model, opt, steps=4)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    resumed = make_model(seed=7)
    resumed_opt = powersgd(resumed, upper, start_iter=2)
    if hvd.rank() == 2:  # set rank 1 loads, set rank 0 (global 1) starts fresh
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
    if upper.included():  # hvd.broadcast_parameters, inside the set
        for i, p in enumerate(resumed.parameters()):
            hvd.broadcast_(p.data, root_rank=2, name=f"set.param{i}", process_set=upper)
    messages = recorded(lambda: train(resumed, resumed_opt, steps=2, first_step=4))
    if upper.included():
        assert resumed_opt.powersgd_step == 6  # global rank 2's 4 steps, then 2
        took = [m for m in messages if "took the PowerSGD state of rank 2" in m]
        assert len(took) == 1 and "rank(s) [1]" in took[0], messages
    for n, p in resumed.named_parameters():
        assert_same_in(upper, p, n)


def test_checkpoints_of_a_set_without_global_rank_0_resume_exactly(upper, shared_dir):
    path = os.path.join(shared_dir, "ckpt.pt")
    model = make_model()
    opt = powersgd(model, upper)
    train(model, opt, steps=3)
    if upper.included():
        hps.save_checkpoint(path, model, opt, step=3)
    train(model, opt, steps=2, first_step=3)

    resumed = make_model(seed=7)
    resumed_opt = powersgd(resumed, upper)
    if upper.included():
        assert hps.load_checkpoint(path, resumed, resumed_opt) == {"step": 3}
    train(resumed, resumed_opt, steps=2, first_step=3)
    if upper.included():
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b), "the resumed run differs from the uninterrupted one"


def test_a_process_set_gone_mid_training_raises_horovods_internal_error():
    # Once Horovod stops (a rank of the job ended), it clears its process sets before
    # it checks whether it stopped: a collective over a set of ours then failed with
    # "ValueError: ... Process set provided does not exist" instead of the
    # HorovodInternalError that elastic training and user code catch to recover.
    # Taking the set out of Horovod's table, as its shutdown does (the Python object
    # left as it is, unlike hvd.remove_process_set), is the same lookup failure.
    from horovod.torch.mpi_ops import _basics

    process_set = hvd.add_process_set(list(range(1, hvd.size())))
    model = make_model()
    opt = powersgd(model, process_set, rank=2)
    train(model, opt, steps=1)
    assert _basics._remove_process_set_impl(process_set.process_set_id) is not None
    if process_set.included():
        with pytest.raises(hvd.HorovodInternalError, match="Horovod has stopped") as raised:
            train(model, opt, steps=1, first_step=1)
        assert "does not exist" in str(raised.value)
        # A collective of the step's own, enqueued after the set is gone: the same.
        with pytest.raises(hvd.HorovodInternalError, match="does not exist"):
            opt.powersgd_state.comm.allreduce_async([torch.zeros(4)], "gone")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("rounds", [2, 1])
def test_a_set_of_one_rank_steps_without_horovod_requests_as_horovod_would(
    upper, monkeypatch, rounds
):
    # The set {1} at 2 processes. The sum over one rank is the tensor itself, so its
    # every-step collectives are done at once (as Horovod's own optimizer at size 1
    # waits for nothing): no request, and the step Horovod's one-rank all-reduces give,
    # bit for bit, warm-up steps and compressed ones (start_iter=2, 5 steps).
    if not upper.included():
        return
    from horovod_powersgd import comm

    assert comm.Comm(upper).alone  # the set's own size says so
    real = comm._grouped_allreduce_async_
    runs = []
    for alone in (False, True):
        monkeypatch.setattr(comm.Comm, "alone", property(lambda self, on=alone: on))
        requests = []

        def counted(*args, requests=requests, **kwargs):
            requests.append(kwargs["name"])
            return real(*args, **kwargs)

        monkeypatch.setattr(comm, "_grouped_allreduce_async_", counted)
        model = make_model()
        train(model, powersgd(model, upper, rank=2, rounds=rounds, start_iter=2), steps=5)
        runs.append((model, requests))
    (through_horovod, requests), (alone, none) = runs
    assert requests and not none, (len(requests), none)
    for (name, p), q in zip(through_horovod.named_parameters(), alone.parameters()):
        assert torch.equal(p, q), name
