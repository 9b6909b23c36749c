"""What PowerSGD's local work costs next to a step's forward and backward pass.

    python scripts/gpu/gpu_timing.py local --json t.json --size full      # no Horovod needed
    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_timing.py e2e --json e.json
    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_timing.py profile --json p.json

``local``, per model (horovod_powersgd/bench/models.py) and precision (float32, bfloat16 autocast):

* forward+backward of the model alone;
* PowerSGD's local work at each rank, both schedules: the compressor driven the
  way DistributedOptimizer drives it (its buckets, in backward order) for one
  worker, so each "sum" is the buffer itself: orthogonalise the memory
  (begin_step), M = g + e and P = M·Q̂ (compress), orthogonalise P and Q = Mᵀ·P̂
  (project), e = M − P̂·Qᵀ (error), P̂·Qᵀ (decompress), and the per-layer norms the
  statistics take every step (``layer_stats=True``, the default). Gradients are
  float32 either way (bfloat16 autocast keeps float32 parameters), so this is
  measured once per model, on the float32 pass's gradients;
* torch's ``powerSGD_hook`` on a 1-rank DDP (NCCL; Gloo on the CPU): forward+backward
  with DDP's own all-reduce and with the hook at each rank (its default, and with
  ``batch_tensors_with_same_shape=True``); the hook's cost is the difference.

``e2e`` (under horovodrun, 1 rank): whole steps of ``hvd.DistributedOptimizer``
against ``horovod_powersgd.DistributedOptimizer``, Horovod's collectives included.

``profile`` (under horovodrun, 1 rank): a ``rank="auto"`` job of each model in one
precision (ResNet-50 fp32, GPT-2 bf16 autocast), run until auto has measured and
written its profile (``HOROVOD_POWERSGD_PROFILE``): the device's own profile for
``python -m horovod_powersgd.bench.scale`` (docs/scale.md), kept in the JSON.

On CUDA, times come from CUDA events around the work, after warm-up iterations;
on the CPU from the wall clock. Each number is the median of the timed iterations.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import tempfile
import time
import traceback

import torch

from horovod_powersgd import linalg
from horovod_powersgd.bench import models

MODELS = ("resnet50", "gpt2")
PRECISIONS = ("fp32", "bf16")
# Per size: warm-up and timed iterations. Torch's hook compresses from its 3rd call
# (start_powerSGD_iter=2, the least it allows with error feedback), so warm-up >= 4.
ITERATIONS = {"full": (5, 10), "tiny": (4, 3)}


class Clock:
    """Marks on the device's timeline: CUDA events, or the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0

    def wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def median(values) -> float:
    return float(statistics.median(values))


def forward_backward(workload, device, precision, clock, warmup, iters, model=None) -> float:
    """Median ms of forward+backward (the loss under autocast, backward outside it)."""
    model = workload.model if model is None else model
    g = torch.Generator().manual_seed(0)
    batch = workload.batch(g)
    times = []
    for i in range(warmup + iters):
        model.zero_grad(set_to_none=False)
        start = clock.mark()
        with autocast(device, precision):
            loss = workload.loss(model, batch)
        loss.backward()
        end = clock.mark()
        clock.wait()
        if i >= warmup:
            times.append(clock.ms(start, end))
    return median(times)


# --- PowerSGD's local work ------------------------------------------------------------------
def _compressor(model, rank: int, rounds: int):
    """The compressor and bucket order DistributedOptimizer would build for `model`.

    Internal API (horovod_powersgd.compressor/reducer/monitor): if it changes, this
    measurement reports the error and the kit goes on.
    """
    from horovod_powersgd.compressor import PowerSGDCompressor
    from horovod_powersgd.config import PowerSGDConfig
    from horovod_powersgd.monitor import LayerMonitor
    from horovod_powersgd.reducer import make_buckets

    params = [p for p in model.parameters() if p.requires_grad]
    names = {p: n for n, p in model.named_parameters()}
    buckets = make_buckets(params)
    bucket_of = {names[p]: b.index for b in buckets for p in b.params}
    config = PowerSGDConfig(rank=rank, rounds=rounds)
    compressor = PowerSGDCompressor([(names[p], p) for p in params], config, bucket_of=bucket_of)
    order = [
        (b.index, [names[p] for p in b.params if compressor.is_compressed(names[p])])
        for b in buckets
    ]
    order = [(index, layer_names) for index, layer_names in order if layer_names]
    monitor = LayerMonitor(compressor, lambda t, name: t, workers=1, reporter=False)
    return compressor, order, monitor


def _method_key(method: str) -> str:
    return "" if method == "householder" else f", {method}"


@contextlib.contextmanager
def _method(method: str):
    """Orthogonalise with `method` (linalg.METHODS) inside, the default after."""
    linalg.METHOD = method
    try:
        yield
    finally:
        linalg.METHOD = linalg.parse_method(None)


def local_work(model, rank, rounds, clock, warmup, iters, graph=False) -> dict:
    """Median ms of one worker's PowerSGD step on the model's current gradients.

    `graph` (CUDA): the same step captured once as a CUDA graph and replayed (what
    issue 57's item 3 would gain; the library does not capture graphs itself). The
    compressor's Python state (step counters) advances only at the capture, which is
    what a replayed step of fixed shapes does too.
    """
    from horovod_powersgd.compressor import local_step  # internal API, as _compressor's

    compressor, order, monitor = _compressor(model, rank, rounds)
    grads = {
        n: p.grad.detach().float().clone()
        for n, p in model.named_parameters()
        if p.grad is not None and compressor.is_compressed(n)
    }
    out = {n: torch.empty_like(g) for n, g in grads.items()}
    phases = ("orthogonalise memory", "compress", "project", "error", "decompress", "statistics")

    def one_step(marks):
        """The step; with `marks`, a clock mark after each phase of each bucket."""

        def mark(phase):
            if marks is not None:
                marks.append((phase, clock.mark()))

        mark("start")
        compressor.begin_step(workers=1, done=1)  # a steady-state step: warm memories
        mark("orthogonalise memory")
        for index, layer_names in order:
            # The reducer's segments, nothing sent (the package's one local-step driver).
            local_step(compressor, index, grads, out, done=1, partners=False, mark=mark)
            if marks is not None:  # the statistics, timed apart from the rest
                for name in layer_names:
                    monitor.compressed(name, grads[name])
                mark("statistics")
        if marks is not None:
            monitor.end_step(1, True, dict)  # step 1: no periodic check, only the norms
            mark("statistics")

    totals = _medians_of(lambda: one_step(None), clock, warmup, iters)
    if graph:
        generators = list(compressor._generators.values())
        return {
            "eager_ms": totals,
            "graph_ms": _graphed(one_step, clock, warmup, iters, generators),
        }
    breakdown = {phase: [] for phase in phases}
    # A second pass with a mark between phases (the marks themselves cost a little,
    # so the total above comes from a pass without them).
    for i in range(warmup + iters):
        marks = []
        one_step(marks)
        clock.wait()
        if i >= warmup:
            spent = dict.fromkeys(phases, 0.0)
            for (_, before), (phase, after) in zip(marks, marks[1:]):
                spent[phase] += clock.ms(before, after)
            for phase in phases:
                breakdown[phase].append(spent[phase])
    p, q = compressor.elements_per_step()
    result = {
        "ms": totals,
        "phases_ms": {phase: median(v) for phase, v in breakdown.items()},
        "compressed_tensors": len(grads),
        "elements_compressed": sum(g.numel() for g in grads.values()),
        "elements_sent": p + q if rounds == 2 else None,
        "buckets": len(order),
    }
    result["with_statistics_ms"] = result["ms"] + result["phases_ms"]["statistics"]
    return result


def _medians_of(run, clock, warmup, iters) -> float:
    """Median ms of `run()` on the device's timeline, after `warmup` untimed calls."""
    times = []
    for i in range(warmup + iters):
        start = clock.mark()
        run()
        end = clock.mark()
        clock.wait()
        if i >= warmup:
            times.append(clock.ms(start, end))
    return median(times)


def _graphed(one_step, clock, warmup, iters, generators) -> float:
    """Median ms of `one_step(None)` captured once as a CUDA graph and replayed (warm-up on a
    side stream).

    The compressor's generators (its random draws) are registered with the graph:
    a CUDA generator of one's own may not advance in a capture otherwise.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one_step(None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:  # torch >= 2.5 (the device has 2.11)
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        one_step(None)
    return _medians_of(graph.replay, clock, warmup, iters)


# --- torch's powerSGD_hook on a 1-rank DDP ---------------------------------------------------
@contextlib.contextmanager
def one_rank_process_group(device):
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def ddp_times(name, size, device, clock, warmup, iters, rank=None, batched=False) -> dict:
    """Median ms of forward+backward through DDP per precision: plain, or with the hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel

    workload = models.workload(name, size, device)
    cuda = device.type == "cuda"
    # On Gloo the hook's P and Q all-reduces of several buckets can deadlock, even on one
    # rank (seen here: two callbacks each waiting in its own all-reduce); one bucket, as
    # horovod_powersgd/bench does. Over NCCL, DDP's own buckets.
    one_bucket_mb = 4 * sum(p.numel() for p in workload.model.parameters()) / 2**20 + 1
    ddp = DistributedDataParallel(
        workload.model,
        device_ids=[device.index or 0] if cuda else None,
        bucket_cap_mb=None if cuda else one_bucket_mb,
    )
    if rank is not None:
        state = hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            orthogonalization_epsilon=0,
            random_seed=0,
            batch_tensors_with_same_shape=batched,
        )
        ddp.register_comm_hook(state, hook.powerSGD_hook)
    out = {}
    for precision in PRECISIONS:
        out[precision] = forward_backward(
            workload, device, precision, clock, warmup, iters, model=ddp
        )
    del ddp, workload
    return out


def run_local(args) -> dict:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    clock = Clock(device)
    warmup, iters = ITERATIONS[args.size]
    ranks = [int(r) for r in args.ranks.split(",")]
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "size": args.size,
        "warmup": warmup,
        "iterations": iters,
        "clock": "CUDA events" if cuda else "wall clock",
        "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "models": {},
    }
    for name in args.models.split(","):
        started = time.perf_counter()
        entry = result["models"].setdefault(name, {"errors": {}})
        try:
            workload = models.workload(name, args.size, device)
            entry["description"] = workload.description
            entry["forward_backward_ms"] = {
                precision: forward_backward(workload, device, precision, clock, warmup, iters)
                for precision in reversed(PRECISIONS)  # float32 last: its gradients stay
            }
            entry["local_work"] = {}
            # Both orthogonalisations (linalg.METHODS): which is faster on CUDA is
            # what this run decides; CholeskyQR's rows have ", cholesky" in their key.
            for method, rounds, rank in itertools.product(linalg.METHODS, (2, 1), ranks):
                key = f"rank {rank}, rounds={rounds}" + _method_key(method)
                try:
                    with _method(method):
                        entry["local_work"][key] = {"rank": rank, "rounds": rounds} | (
                            local_work(workload.model, rank, rounds, clock, warmup, iters)
                        )
                except Exception:
                    entry["errors"][key] = traceback.format_exc()[-2000:]
            with one_rank_process_group(device):
                entry["ddp_ms"] = ddp_times(name, args.size, device, clock, warmup, iters)
                entry["hook"] = {}
                for batched in (False, True):
                    for rank in ranks:
                        key = f"rank {rank}{', batched' if batched else ''}"
                        try:
                            times = ddp_times(
                                name, args.size, device, clock, warmup, iters, rank, batched
                            )
                            entry["hook"][key] = {
                                "rank": rank,
                                "batch_tensors_with_same_shape": batched,
                                "ddp_ms": times,
                                "overhead_ms": {
                                    p: times[p] - entry["ddp_ms"][p] for p in PRECISIONS
                                },
                            }
                        except Exception:
                            entry["errors"][f"hook {key}"] = traceback.format_exc()[-2000:]
                        gc.collect()
            del workload
            gc.collect()
        except Exception:
            entry["errors"]["model"] = traceback.format_exc()[-3000:]
        entry["seconds"] = time.perf_counter() - started
        if cuda:
            entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _write(args.json, result)  # after each model: a later failure keeps this one
    if cuda:  # last, every model: a capture that fails must not disturb the numbers above
        for name in args.models.split(","):
            entry = result["models"][name]
            entry["graphed"] = {}
            for method, rounds in itertools.product(linalg.METHODS, (2, 1)):
                key = f"rank {ranks[0]}, rounds={rounds}" + _method_key(method)
                try:
                    workload = models.workload(name, args.size, device)
                    forward_backward(workload, device, "fp32", clock, 1, 1)  # its gradients
                    with _method(method):
                        entry["graphed"][key] = local_work(
                            workload.model, ranks[0], rounds, clock, warmup, iters, graph=True
                        )
                except Exception:
                    entry["errors"][f"graphed {key}"] = traceback.format_exc()[-2000:]
                workload = None
                gc.collect()
                torch.cuda.empty_cache()
            _write(args.json, result)
    return result


# --- whole steps through Horovod ------------------------------------------------------------
def _horovod_device(hvd, args) -> tuple[torch.device, bool]:
    """hvd.init(), and this rank's device: its GPU (local rank) if any, else the CPU."""
    hvd.init()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, cuda


def _timed_step(opt, workload, model, batch, device, precision, clock) -> float:
    """One training step through `opt`, waited for; its wall-clock ms."""
    start = time.perf_counter()
    opt.zero_grad()
    with autocast(device, precision):
        loss = workload.loss(model, batch)
    loss.backward()
    opt.step()
    clock.wait()
    return (time.perf_counter() - start) * 1000.0


def run_e2e(args) -> dict:
    import horovod.torch as hvd

    import horovod_powersgd as hps

    device, cuda = _horovod_device(hvd, args)
    clock = Clock(device)
    warmup, iters = ITERATIONS[args.size]
    ranks = [int(r) for r in args.ranks.split(",")]
    configs = [("horovod", None, None)] + [
        (f"powersgd rank {r}, rounds={rounds}", r, rounds) for r in ranks for rounds in (2, 1)
    ]
    result = {"ranks": hvd.size(), "nccl_built": bool(hvd.nccl_built()), "models": {}}
    for name in args.models.split(","):
        entry = result["models"].setdefault(name, {"step_ms": {}, "errors": {}})
        for label, rank, rounds in configs:
            try:
                # A fresh model each time: Horovod's optimizer leaves its hooks behind.
                workload = models.workload(name, args.size, device)
                model = workload.model
                sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
                if rank is None:
                    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
                else:
                    opt = hps.DistributedOptimizer(
                        sgd, named_parameters=model.named_parameters(), rank=rank, rounds=rounds
                    )
                batch = workload.batch(torch.Generator().manual_seed(0))
                entry["description"] = workload.description
                entry["step_ms"][label] = {}
                for precision in PRECISIONS:
                    times = []
                    for i in range(warmup + iters):
                        ms = _timed_step(opt, workload, model, batch, device, precision, clock)
                        if i >= warmup:
                            times.append(ms)
                    entry["step_ms"][label][precision] = median(times)
                del opt, sgd, model, workload
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            except Exception:
                entry["errors"][label] = traceback.format_exc()[-2000:]
        if hvd.rank() == 0:
            _write(args.json, result)
    return result


# The precision each model's profile is taken in: what a user of that model trains in.
PROFILE_PRECISION = {"resnet50": "fp32", "gpt2": "bf16"}
PROFILE_MAX_STEPS = 60  # auto writes its profile after its measuring steps (about 8)


def run_profile(args) -> dict:
    """rank="auto" on each model until it writes its profile; the profiles in the JSON."""
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd.tuner import PROFILE_VARIABLE

    device, cuda = _horovod_device(hvd, args)
    clock = Clock(device)
    result = {"ranks": hvd.size(), "device": str(device), "models": {}}
    for name in args.models.split(","):
        precision = PROFILE_PRECISION.get(name, "fp32")
        entry = result["models"].setdefault(name, {"precision": precision})
        path = os.path.join(tempfile.mkdtemp(), f"{name}-profile.json")
        os.environ[PROFILE_VARIABLE] = path
        try:
            workload = models.workload(name, args.size, device)
            model = workload.model
            sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
            opt = hps.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(), rank="auto"
            )
            batch = workload.batch(torch.Generator().manual_seed(0))
            entry["description"] = workload.description
            times = []
            for _ in range(PROFILE_MAX_STEPS):
                times.append(_timed_step(opt, workload, model, batch, device, precision, clock))
                if os.path.exists(path):
                    break
            entry["steps_ms"] = times
            if os.path.exists(path):
                with open(path) as f:
                    entry["profile"] = json.load(f)
            else:
                entry["error"] = f"no profile written in {len(times)} steps"
            del opt, sgd, model, workload
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        except Exception:
            entry["error"] = traceback.format_exc()[-2000:]
        finally:
            os.environ.pop(PROFILE_VARIABLE, None)
        if hvd.rank() == 0:
            _write(args.json, result)
    return result


def _write(path, result) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("local", "e2e", "profile"):
        p = sub.add_parser(command)
        p.add_argument("--json", required=True)
        p.add_argument("--size", default="tiny", choices=["tiny", "full"])
        p.add_argument("--device", default="auto", choices=["auto", "cpu"])
        p.add_argument("--models", default=",".join(MODELS))
        p.add_argument("--ranks", default="4,16,32" if command == "local" else "4")
    args = parser.parse_args(argv)
    {"local": run_local, "e2e": run_e2e, "profile": run_profile}[args.command](args)


if __name__ == "__main__":
    main()
