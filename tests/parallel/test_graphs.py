"""`cuda_graphs=True` through the recording runner (graphs.py): the optimizer's contract with
its local work captured and replayed, under real Horovod collectives, on every rank.

The recording runner is the CPU's stand-in for CUDA graphs: it refuses what a capture
refuses (host reads, tensors that are not held from step to step, unregistered random
draws) and replays the recorded operations without the segments' Python, so a step that
still equals the eager one bit for bit has no Python state a real graph would freeze.
"""

import helpers
import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_on_every_rank, batch, local_gradients, make_model, powersgd

from horovod_powersgd import graphs

STEPS = 9  # eager (warm-up of the memories), eager (first of its key), capture, replays


@pytest.fixture(autouse=True)
def record(monkeypatch):
    """The recording runner on the CPU; on CUDA (`pytest --device cuda`, the GPU kit's
    contract phase) real CUDA graphs, compared with the eager step on the device."""
    if helpers.DEVICE.type != "cuda":
        monkeypatch.setenv(graphs.ENV, "record")


def _train(model, opt, steps, first=0, nan_at=None):
    for step in range(first, first + steps):
        x, y = batch(step)
        if step == nan_at and hvd.rank() == hvd.size() - 1:
            x[0, 0] = float("nan")  # an overflow on one rank: every rank skips the step
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            with opt.skip_synchronize():
                opt.step()


@pytest.mark.parametrize("rounds", [2, 1])
@pytest.mark.parametrize("comm_dtype", [None, torch.float16], ids=["fp32", "fp16wire"])
def test_graphed_training_equals_eager_bitwise_on_every_rank(rounds, comm_dtype):
    """The same steps with graphs on and off give the same parameters bit for bit (an
    overflow step on one rank among them), the same on every rank, and the graphs were
    replayed; the PowerSGD state stays finite."""
    models = {}
    for graphed in (False, True):
        model = models[graphed] = make_model()
        opt = powersgd(model, rank=2, rounds=rounds, comm_dtype=comm_dtype, cuda_graphs=graphed)
        _train(model, opt, STEPS, nan_at=5)
        runner = opt.compressor.graphs
        if graphed:
            assert runner.graphed and runner.replays > runner.captures > 0
        state = opt.compressor.state_dict()
        for kind in ("error_buffers", "q_memory"):
            assert all(torch.isfinite(t).all() for t in state[kind].values()), kind
    for (name, eager), graphed in zip(models[False].named_parameters(), models[True].parameters()):
        assert torch.equal(eager, graphed), f"{name}: graphed training differs from eager"
        assert_same_on_every_rank(graphed, name)


def test_graphed_full_rank_steps_are_horovods_average():
    model = make_model()
    opt = powersgd(model, rank=64, min_compression_rate=0, cuda_graphs=True)
    _train(model, opt, 3)  # through the capture
    for step in (3, 4):  # replayed
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        raw = local_gradients(model, loss)
        loss.backward()
        expected = {n: hvd.allreduce(g, name=f"graphs.{step}.{n}") for n, g in raw.items()}
        opt.synchronize()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6)
        with opt.skip_synchronize():
            opt.step()
    assert opt.compressor.graphs.replays > 0


def test_graphed_resume_continues_exactly():
    """A graphed run saved after its capture and resumed by a new graphed optimizer ends
    where the uninterrupted run ends, bit for bit."""
    whole = make_model()
    _train(whole, powersgd(whole, rank=2, cuda_graphs=True), 2 * STEPS)
    first = make_model()
    opt = powersgd(first, rank=2, cuda_graphs=True)
    _train(first, opt, STEPS)
    saved = {"model": first.state_dict(), "opt": opt.state_dict()}
    resumed = make_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt = powersgd(resumed, rank=2, cuda_graphs=True)
    opt.load_state_dict(saved["opt"])
    _train(resumed, opt, STEPS, first=STEPS)
    assert opt.compressor.graphs.replays > 0
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name}: the resumed graphed run differs"


def test_auto_captures_its_settled_plan_only_and_trains_as_eager_auto():
    """rank="auto" with graphs: its measuring and trial steps run eagerly (nothing captured
    while the plan can change), its settled plan is captured and replayed, and the run
    equals the eager auto run bit for bit (a link pinned at 1 Mbit/s: the plan is the
    lowest rank whatever the timings, so both runs take the same)."""
    models, plans = {}, {}
    for graphed in (False, True):
        model = models[graphed] = make_model()
        opt = powersgd(model, rank="auto", auto_link="1mbit", cuda_graphs=graphed)
        tuner, runner = opt.powersgd_state.tuner, opt.compressor.graphs
        for step in range(20):
            _train(model, opt, 1, first=step)
            if tuner.phase != "settled":
                assert runner.captures == 0, f"captured at step {step}, before auto settled"
        plans[graphed] = [(b["name"], b["rank"]) for b in opt.compression_stats()["plan"]]
        assert tuner.phase == "settled"
        if graphed:
            assert runner.replays > runner.captures > 0
    assert plans[False] == plans[True]
    for (name, eager), graphed in zip(models[False].named_parameters(), models[True].parameters()):
        assert torch.equal(eager, graphed), f"{name}: graphed auto differs from eager auto"
        assert_same_on_every_rank(graphed, name)


def test_auto_trials_run_eagerly_and_the_settled_plan_is_captured():
    """With the link measured (not pinned), auto tries its candidates, compressed ones among
    them: those steps run eagerly (each plan would be captured anew, and the trials time
    the step as it runs); graphs come once the plan is settled."""
    model = make_model()
    opt = powersgd(model, rank="auto", cuda_graphs=True)
    tuner, runner = opt.powersgd_state.tuner, opt.compressor.graphs
    phases = set()
    for step in range(40):
        _train(model, opt, 1, first=step)
        phases.add(tuner.phase)
        if tuner.phase != "settled":
            assert runner.captures == 0, f"captured at step {step}, in phase {tuner.phase}"
    assert {"try", "settled"} <= phases, phases
    if any(b["rank"] for b in opt.compression_stats()["plan"]):  # a compressed plan
        assert runner.replays > runner.captures > 0
    for name, p in model.named_parameters():
        assert_same_on_every_rank(p, name)


def test_a_step_inside_the_users_own_capture_raises_a_clear_error(monkeypatch):
    """The optimizer's step inside a CUDA graph the user captures (Horovod's collectives
    cannot be): the step's first gradient raises, naming the cause and what to do. (The
    CPU has no capture: a CUDA parameter and a capture in progress are stood in for.)"""
    from types import SimpleNamespace

    from horovod_powersgd import optimizer

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*cuda_graphs=True"):
        optimizer._refuse_capture(SimpleNamespace(is_cuda=True))
    optimizer._refuse_capture(SimpleNamespace(is_cuda=False))  # a CPU step: nothing to refuse
