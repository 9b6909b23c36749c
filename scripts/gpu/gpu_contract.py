"""The parallel contract on the device's tensors: what users rely on, checked on every rank.

    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_contract.py --json c.jsonl
    horovodrun -np 2 -H localhost:2 --gloo python scripts/gpu/gpu_contract.py --json c.jsonl

The checks are those of tests/parallel (its helpers' model and data, moved to the
device) for what users rely on, on CUDA tensors where there is a GPU (every rank
on GPU local_rank modulo the GPUs there: two ranks share one GPU), else on the CPU:

* full rank equals Horovod's averaged all-reduce, both schedules;
* parameters bitwise identical on every rank after training, both schedules,
  float32 and float16 on the wire;
* a state_dict resume continues bit for bit;
* a non-finite gradient on one rank leaves the PowerSGD state finite;
* float16 on the wire stays within 1 % of float32 for tiny and large gradients;
* the AMP pattern (GradScaler, synchronize, clip, skip_synchronize) trains.

After every check the ranks exchange their outcomes (one all-gather), so a check
fails when it failed on any rank, and rank 0 appends one JSON line per check to
`--json` at once: a later hang (the caller's time limit ends it) keeps the
lines of the checks before.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps

# The parallel tests' model, data and checks, moved to this run's device.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "parallel"))  # fmt: skip
import helpers

DEVICE = torch.device("cpu")
powersgd = helpers.powersgd
same_on_every_rank = helpers.assert_same_on_every_rank


def make_model(seed=0):
    return helpers.make_model(seed).to(DEVICE)


def batch(step, rank=None, **kwargs):
    """The tests' data (different on every rank and step), on this run's device."""
    x, y = _cpu_batch(step, rank, **kwargs)
    return x.to(DEVICE), y.to(DEVICE)


# helpers.train draws its data through helpers.batch: in this process, on DEVICE.
_cpu_batch, helpers.batch = helpers.batch, batch
train = helpers.train


def powersgd_tensors(opt):
    """Every tensor of this rank's PowerSGD state, through the public state_dict()."""
    found = []

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append((path, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    walk(opt.state_dict()["powersgd"], "powersgd")
    return found


# --- the checks ---------------------------------------------------------------------------
def full_rank_equals_plain_average(rounds):
    model, reference = make_model(), make_model()
    opt = powersgd(model, rank=64, min_compression_rate=0, rounds=rounds)
    for step in range(3):  # rounds=1: a Q-step, a P-step, a Q-step
        x, y = batch(step)
        for m in (model, reference):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        opt.synchronize()
        for (n, p), ref in zip(model.named_parameters(), reference.parameters()):
            expected = hvd.allreduce(ref.grad, name=f"expected.{rounds}.{step}.{n}")
            error = float((p.grad - expected).norm() / expected.norm())
            # The bounds of tests/parallel/test_rounds.py (float32 orthogonalisation).
            assert error < (1e-3 if rounds == 2 else 1e-4), (step, n, error)
        with opt.skip_synchronize():
            opt.step()
        for p, ref in zip(model.parameters(), reference.parameters()):
            ref.data.copy_(p.data)


def bitwise_identical_on_every_rank(rounds, wire):
    model = make_model(seed=hvd.rank())  # different on purpose: the broadcast must fix it
    comm_dtype = torch.float16 if wire == "fp16" else None
    opt = powersgd(model, rank=2, rounds=rounds, comm_dtype=comm_dtype)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, steps=12)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        same_on_every_rank(p, f"{rounds}.{wire}.{n}")


def resume_is_exact(rounds):
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds)
    train(model, opt, steps=3)  # rounds=1: the next step is a P-step
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, steps=4, first_step=3)

    resumed = make_model(seed=5)
    resumed_opt = powersgd(resumed, rank=2, rounds=rounds)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, steps=4, first_step=3)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{n}: max difference {float((a - b).abs().max()):.3g}"


def non_finite_gradient_leaves_state_finite(rounds):
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds)
    train(model, opt, steps=3)
    x, y = batch(3)
    if hvd.rank() == hvd.size() - 1:
        x[0, 0] = float("inf")  # an overflow on one rank only
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    # every rank sees it, so GradScaler would skip the step everywhere ...
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    # ... and nothing non-finite stays in the PowerSGD state
    for path, tensor in powersgd_tensors(opt):
        assert torch.isfinite(tensor).all(), path
    opt.zero_grad()  # the skipped step
    train(model, opt, steps=4, first_step=4)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        same_on_every_rank(p, f"nonfinite.{rounds}.{n}")


def fp16_wire_keeps_the_scale(rounds):
    errors = {}
    for scale in (1e-5, 1e3):  # where float16 alone would underflow, and near its top
        torch.manual_seed(0)
        layers = {d: nn.Linear(128, 64, bias=False).to(DEVICE) for d in (None, torch.float16)}
        opts = {
            d: hps.DistributedOptimizer(
                torch.optim.SGD(layer.parameters(), lr=0.1),
                named_parameters=layer.named_parameters(),
                rank=4,
                rounds=rounds,
                comm_dtype=d,
            )
            for d, layer in layers.items()
        }
        g = torch.Generator().manual_seed(hvd.rank())
        # A few strong directions plus noise, like a real layer's gradient.
        u, v = torch.randn(64, 3, generator=g), torch.randn(3, 128, generator=g)
        for step in range(6):  # warm-started steps are where a scale could be lost
            grad = scale * (u @ v + 0.3 * torch.randn(64, 128, generator=g))
            result = {}
            for d, layer in layers.items():
                layer.weight.grad = grad.to(DEVICE)
                opts[d].synchronize()
                result[d] = layer.weight.grad.clone()
            reference = result[None]
            assert torch.isfinite(result[torch.float16]).all(), (scale, step)
            error = float((result[torch.float16] - reference).norm() / reference.norm())
            assert error < 0.01, (scale, step, error)
            errors[f"{scale:g}"] = max(errors.get(f"{scale:g}", 0.0), error)
            for opt in opts.values():
                opt.zero_grad()
    return {"largest relative error vs float32 wire": errors}


def amp_grad_scaler_pattern(rounds):
    model = make_model()
    opt = powersgd(model, rank=2, rounds=rounds)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        x, y = batch(step)
        if step == 1 and hvd.rank() == 0:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        if step == 0:
            first = [p.detach().clone() for p in model.parameters()]
        if step == 1:  # skipped on every rank: parameters unchanged
            assert all(torch.equal(a, b) for a, b in zip(first, model.parameters()))
    assert scaler.get_scale() < 1024.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        same_on_every_rank(p, f"amp.{rounds}.{n}")


CHECKS = [
    *((f"full rank equals the plain average, rounds={r}", full_rank_equals_plain_average, (r,))
      for r in (2, 1)),
    *((f"bitwise identical on every rank, rounds={r}, {w} wire",
       bitwise_identical_on_every_rank, (r, w))
      for r in (2, 1) for w in ("fp32", "fp16")),
    *((f"resume is exact, rounds={r}", resume_is_exact, (r,)) for r in (2, 1)),
    *((f"non-finite gradient leaves the state finite, rounds={r}",
       non_finite_gradient_leaves_state_finite, (r,))
      for r in (2, 1)),
    *((f"fp16 wire keeps the scale, rounds={r}", fp16_wire_keeps_the_scale, (r,))
      for r in (2, 1)),
    *((f"AMP GradScaler pattern, rounds={r}", amp_grad_scaler_pattern, (r,)) for r in (2, 1)),
]  # fmt: skip


def main(argv=None) -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="rank 0 appends one JSON line per check")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"])
    args = parser.parse_args(argv)
    hvd.init()
    if torch.cuda.is_available() and args.device == "auto":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    header = {
        "ranks": hvd.size(),
        "device": str(DEVICE),
        "nccl_built": bool(hvd.nccl_built()),
        "gloo": bool(hvd.gloo_enabled()),
        "mpi": bool(hvd.mpi_enabled()),
    }
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            f.write(json.dumps({"header": header}) + "\n")
    for name, check, check_args in CHECKS:
        start = time.perf_counter()
        try:
            detail = check(*check_args)
            outcome = {"status": "passed", "detail": detail}
        except Exception as exc:  # reported, then the next check: each stands alone
            outcome = {
                "status": "failed",
                "error": "".join(traceback.format_exception_only(type(exc), exc)).strip(),
                "traceback": traceback.format_exc()[-2000:],
            }
        outcome["seconds"] = round(time.perf_counter() - start, 3)
        everyone = hvd.allgather_object(outcome, name=f"contract.{name}")
        if hvd.rank() == 0:
            failed = [r for r, o in enumerate(everyone) if o["status"] != "passed"]
            line = {
                "check": name,
                "status": "failed" if failed else "passed",
                "failed_ranks": failed,
                "seconds": max(o["seconds"] for o in everyone),
                "detail": everyone[0].get("detail"),
                "errors": {r: everyone[r]["error"] for r in failed},
                "traceback": everyone[failed[0]]["traceback"] if failed else None,
            }
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
