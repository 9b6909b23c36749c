"""The GPU kit's measurements: its timing, e2e and syncs phases (docs/gpu.md says what each
measures; the models are horovod_powersgd/bench/models.py's).

    python scripts/gpu/gpu_timing.py local --json t.json --size full    # no Horovod needed
    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_timing.py e2e --json e.json
    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_timing.py profile --json p.json
    horovodrun -np 1 -H localhost:1 --gloo python scripts/gpu/gpu_timing.py syncs --json s.json

``local``: per model, forward+backward in float32 and under bfloat16 autocast, against
PowerSGD's local work (`local_work`: each rank, both schedules, both orthogonalisations) and
torch's ``powerSGD_hook`` on a 1-rank DDP (`ddp_times`); last, on CUDA, the local work as one
CUDA graph. ``e2e``: whole steps of Horovod's optimizer and this library's. ``profile``:
auto's profile of each model (`run_profile`). ``syncs``: the host reads and syncs of
steady-state steps (`run_syncs`). Times: CUDA events on CUDA (whole steps: the wall clock,
waited for), else the wall clock; the median of the timed iterations after warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from unittest import mock

import torch
import torch.distributed as dist

import horovod_powersgd as hps  # its optimizer imports Horovod on first use only
from horovod_powersgd import linalg
from horovod_powersgd.bench import models

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "parallel"))
from host_reads import HostReads, repo_path

MODELS = ("resnet50", "gpt2")
PRECISIONS = ("fp32", "bf16")
RANKS = (4, 16, 32)  # the local work's; whole steps and the graph at the first
# Per size: warm-up and timed iterations. Torch's hook compresses from its 3rd call
# (start_powerSGD_iter=2, the least it allows with error feedback), so warm-up >= 4.
ITERATIONS = {"full": (5, 10), "tiny": (4, 3)}


class Clock:
    """Marks on the device's timeline (CUDA events, else the wall clock); warm-up, timed calls."""

    def __init__(self, device: torch.device, size: str):
        self.device, self.cuda = device, device.type == "cuda"
        self.warmup, self.iters = ITERATIONS[size]

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000.0

    def wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, run) -> float:
        """Median ms of `run()` on the device's timeline, after the warm-up calls."""
        times = []
        for _ in range(self.warmup + self.iters):
            start = self.mark()
            run()
            end = self.mark()
            self.wait()
            times.append(self.ms(start, end))
        return float(statistics.median(times[self.warmup :]))


def forward_backward(workload, precision, clock, model=None) -> float:
    """Median ms of forward+backward (the loss under autocast, backward outside it)."""
    model = workload.model if model is None else model
    batch = workload.batch(torch.Generator().manual_seed(0))

    def run():
        model.zero_grad(set_to_none=False)
        with torch.autocast(clock.device.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = workload.loss(model, batch)
        loss.backward()

    return clock.median_ms(run)


# --- PowerSGD's local work ------------------------------------------------------------------
def _compressor(model, rank: int, rounds: int):
    """The compressor, buckets and monitor DistributedOptimizer would build for `model`
    (internal API: should it change, this measurement reports the error, the kit goes on)."""
    from horovod_powersgd.monitor import LayerMonitor
    from horovod_powersgd.reducer import make_buckets

    names = {p: n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = make_buckets(params)
    bucket_of = {names[p]: b.index for b in buckets for p in b.params}
    config = hps.PowerSGDConfig(rank=rank, rounds=rounds)
    named = [(names[p], p) for p in params]
    compressor = hps.PowerSGDCompressor(named, config, bucket_of=bucket_of)
    monitor = LayerMonitor(compressor, lambda t, name: t, workers=1, reporter=False)
    return compressor, [b.index for b in buckets], monitor


@contextlib.contextmanager
def _method(method: str):
    """Orthogonalise with `method` (linalg.METHODS) inside, the default after."""
    linalg.METHOD = method
    try:
        yield
    finally:
        linalg.METHOD = linalg.parse_method(None)


def local_work(model, rank, rounds, clock, graph=False) -> dict:
    """Median ms of one worker's PowerSGD step on the model's current gradients (float32
    under autocast too, so timed once, on the float32 pass's): begin_step (orthogonalise the
    memory), compressor.local_step per bucket (the reducer's segments: M = g + e and P = M·Q̂,
    orthogonalise P and Q = Mᵀ·P̂, e = M − P̂·Qᵀ, P̂·Qᵀ), the statistics' norms timed apart.

    `graph` (CUDA): the same step captured once as a CUDA graph and replayed (the library
    does not capture graphs itself); the compressor's Python state (step counters) advances
    only at the capture, as in a replayed step of fixed shapes.
    """
    from horovod_powersgd.compressor import local_step  # internal API, as _compressor's

    compressor, buckets, monitor = _compressor(model, rank, rounds)
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
        for index in buckets:
            # The reducer's segments, nothing sent (the package's one local-step driver).
            names = local_step(compressor, index, grads, out, done=1, partners=False, mark=mark)
            if marks is not None and names:  # the statistics, timed apart from the rest
                for name in names:
                    monitor.compressed(name, grads[name])
                mark("statistics")
        if marks is not None:
            monitor.end_step(1, True, dict)  # step 1: no periodic check, only the norms
            mark("statistics")

    totals = clock.median_ms(lambda: one_step(None))
    if graph:
        graphed = _graphed(one_step, list(compressor._generators.values()))
        return {"eager_ms": totals, "graph_ms": clock.median_ms(graphed.replay)}
    # A second pass with a mark between phases (the marks themselves cost a little,
    # so the total above comes from a pass without them).
    passes = []
    for _ in range(clock.warmup + clock.iters):
        marks, spent = [], dict.fromkeys(phases, 0.0)
        one_step(marks)
        clock.wait()
        for (_, before), (phase, after) in zip(marks, marks[1:]):
            spent[phase] += clock.ms(before, after)
        passes.append(spent)
    timed = passes[clock.warmup :]
    phases_ms = {phase: float(statistics.median(t[phase] for t in timed)) for phase in phases}
    p, q = compressor.elements_per_step()
    return {
        "ms": totals,
        "with_statistics_ms": totals + phases_ms["statistics"],
        "phases_ms": phases_ms,
        "compressed_tensors": len(grads),
        "elements_compressed": sum(g.numel() for g in grads.values()),
        "elements_sent": p + q if rounds == 2 else None,
        "buckets": sum(1 for index in buckets if compressor.of(index)),
    }


def _graphed(one_step, generators):
    """`one_step(None)` captured once as a CUDA graph (warm-up on a side stream), with the
    compressor's generators (its random draws) registered: else they may not advance in it."""
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
    return graph


# --- torch's powerSGD_hook on a 1-rank DDP ---------------------------------------------------
@contextlib.contextmanager
def one_rank_process_group(device):
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def ddp_times(name, size, clock, rank=None, batched=False) -> dict:
    """Median ms of forward+backward through DDP per precision: plain, or with the hook
    (NCCL; Gloo on the CPU), its default or ``batch_tensors_with_same_shape=True``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel

    workload = models.workload(name, size, clock.device)
    # On Gloo the hook's P and Q all-reduces of several buckets can deadlock, even on one
    # rank (seen here: two callbacks each waiting in its own all-reduce); one bucket, as
    # horovod_powersgd/bench does. Over NCCL, DDP's own buckets.
    one_bucket_mb = 4 * sum(p.numel() for p in workload.model.parameters()) / 2**20 + 1
    ddp = DistributedDataParallel(
        workload.model,
        device_ids=[clock.device.index or 0] if clock.cuda else None,
        bucket_cap_mb=None if clock.cuda else one_bucket_mb,
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
    return {p: forward_backward(workload, p, clock, ddp) for p in PRECISIONS}


def _guarded(errors: dict, key: str, measure, *args):
    """`measure(*args)`, or None with its traceback in `errors[key]`: one failure, one number."""
    try:
        return measure(*args)
    except Exception:
        errors[key] = traceback.format_exc()[-2000:]
    finally:
        gc.collect()


def run_local(args) -> dict:
    cuda = torch.cuda.is_available()
    clock = Clock(torch.device("cuda", 0) if cuda else torch.device("cpu"), args.size)
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "size": args.size,
        "warmup": clock.warmup,
        "iterations": clock.iters,
        "clock": "CUDA events" if cuda else "wall clock",
        "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "models": {},
    }
    for name in MODELS:
        started = time.perf_counter()
        entry = result["models"][name] = {"errors": {}, "local_work": {}, "hook": {}}
        errors = entry["errors"]
        try:
            workload = models.workload(name, args.size, clock.device)
            entry["description"] = workload.description
            entry["forward_backward_ms"] = {
                precision: forward_backward(workload, precision, clock)
                for precision in reversed(PRECISIONS)  # float32 last: its gradients stay
            }
            # Both orthogonalisations (linalg.METHODS): which is faster on CUDA is
            # what this run decides; CholeskyQR's rows have ", cholesky" in their key.
            for method, rounds, rank in itertools.product(linalg.METHODS, (2, 1), RANKS):
                key = f"rank {rank}, rounds={rounds}" + _method_key(method)
                with _method(method):
                    work = _guarded(errors, key, local_work, workload.model, rank, rounds, clock)
                if work:
                    entry["local_work"][key] = {"rank": rank, "rounds": rounds, **work}
            del workload
            with one_rank_process_group(clock.device):
                entry["ddp_ms"] = ddp_times(name, args.size, clock)
                for batched, rank in itertools.product((False, True), RANKS):
                    key = f"rank {rank}{', batched' if batched else ''}"
                    hook = (name, args.size, clock, rank, batched)
                    times = _guarded(errors, f"hook {key}", ddp_times, *hook)
                    if times:  # the hook's cost: over DDP's own all-reduce
                        overhead = {p: times[p] - entry["ddp_ms"][p] for p in PRECISIONS}
                        entry["hook"][key] = {"ddp_ms": times, "overhead_ms": overhead}
        except Exception:
            errors["model"] = traceback.format_exc()[-3000:]
        entry["seconds"] = time.perf_counter() - started
        if cuda:
            entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        write_json(args.json, result)  # after each model: a later failure keeps this one
    if cuda:  # last, every model: a capture that fails must not disturb the numbers above
        for name, method, rounds in itertools.product(MODELS, linalg.METHODS, (2, 1)):
            entry = result["models"][name]
            key = f"rank {RANKS[0]}, rounds={rounds}" + _method_key(method)
            graph = (name, args.size, method, rounds, clock)
            work = _guarded(entry["errors"], f"graphed {key}", _graphed_work, *graph)
            if work:
                entry.setdefault("graphed", {})[key] = work
            torch.cuda.empty_cache()
            write_json(args.json, result)
    return result


def _graphed_work(name, size, method, rounds, clock) -> dict:
    """The local work at the first rank of a fresh model, eager and as one CUDA graph."""
    workload = models.workload(name, size, clock.device)
    workload.loss(workload.model, workload.batch(torch.Generator().manual_seed(0))).backward()
    with _method(method):
        return local_work(workload.model, RANKS[0], rounds, clock, graph=True)


def _method_key(method: str) -> str:
    return "" if method == "householder" else f", {method}"


# --- whole steps through Horovod ------------------------------------------------------------
def horovod_device(hvd) -> torch.device:
    """hvd.init(), and this rank's device: its GPU (local rank) if any, else the CPU."""
    hvd.init()
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _training(name, size, device, **powersgd):
    """(workload, optimizer, batch): this library's optimizer with the arguments `powersgd`,
    or Horovod's without any. A fresh model each time: Horovod's leaves its hooks behind."""
    import horovod.torch as hvd

    workload = models.workload(name, size, device)
    sgd = torch.optim.SGD(workload.model.parameters(), lr=1e-4, momentum=0.9)
    named = workload.model.named_parameters()
    if powersgd:
        opt = hps.DistributedOptimizer(sgd, named_parameters=named, **powersgd)
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=named)
    return workload, opt, workload.batch(torch.Generator().manual_seed(0))


def _timed_step(opt, workload, batch, precision, clock) -> float:
    """One training step through `opt`, waited for; its wall-clock ms."""
    start = time.perf_counter()
    opt.zero_grad()
    with torch.autocast(clock.device.type, torch.bfloat16, enabled=precision == "bf16"):
        loss = workload.loss(workload.model, batch)
    loss.backward()
    opt.step()
    clock.wait()
    return (time.perf_counter() - start) * 1000.0


def run_e2e(args) -> dict:
    import horovod.torch as hvd

    clock, rank = Clock(horovod_device(hvd), args.size), RANKS[0]
    configs = {"horovod": {}}  # Horovod's optimizer, then this library's
    configs.update({f"powersgd rank {rank}, rounds={r}": dict(rank=rank, rounds=r) for r in (2, 1)})
    # The same with the local work in CUDA graphs (cuda_graphs=True; eager on the CPU).
    configs.update(
        {
            f"powersgd rank {rank}, rounds={r}, graphs": dict(rank=rank, rounds=r, cuda_graphs=True)
            for r in (2, 1)
        }
    )
    # The library with nothing compressed (every step a warm-up step): its hooks and its
    # packed plain all-reduces alone, so the gap to Horovod's splits into theirs and
    # compression's (at 1 rank Horovod's optimizer registers no hooks at all).
    configs["powersgd, nothing compressed"] = dict(rank=rank, start_iter=10**9)
    result = {"ranks": hvd.size(), "nccl_built": bool(hvd.nccl_built()), "models": {}}
    for name, (label, powersgd) in itertools.product(MODELS, configs.items()):
        entry = result["models"].setdefault(name, {"step_ms": {}, "errors": {}})
        steps = (entry, name, args.size, clock, powersgd)
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = _guarded(entry["errors"], label, _whole_steps, *steps)
        if times:
            entry["step_ms"][label] = times
        if clock.cuda:  # with and without graphs (their pools, the static outputs)
            entry.setdefault("peak_mb", {})[label] = torch.cuda.max_memory_allocated() / 2**20
        if clock.cuda:
            torch.cuda.empty_cache()
        if hvd.rank() == 0:
            write_json(args.json, result)
    return result


def _whole_steps(entry, name, size, clock, powersgd) -> dict:
    """Median ms of a whole training step per precision (as _training's `powersgd`)."""
    workload, opt, batch = _training(name, size, clock.device, **powersgd)
    entry["description"] = workload.description
    times, steps = {}, clock.warmup + clock.iters
    for precision in PRECISIONS:
        ms = [_timed_step(opt, workload, batch, precision, clock) for _ in range(steps)]
        times[precision] = float(statistics.median(ms[clock.warmup :]))
    return times


# The precision each model's profile is taken in: what a user of that model trains in.
PROFILE_PRECISION = {"resnet50": "fp32", "gpt2": "bf16"}
PROFILE_MAX_STEPS = 60  # auto writes its profile after its measuring steps (about 8)


def run_profile(args) -> dict:
    """rank="auto" on each model (in PROFILE_PRECISION) until it writes its profile
    (HOROVOD_POWERSGD_PROFILE: for python -m horovod_powersgd.bench.scale, docs/scale.md)."""
    import horovod.torch as hvd

    from horovod_powersgd.tuner import PROFILE_VARIABLE

    clock = Clock(horovod_device(hvd), args.size)
    result = {"ranks": hvd.size(), "device": str(clock.device), "models": {}}
    for name in MODELS:
        entry = result["models"][name] = {"precision": PROFILE_PRECISION[name]}
        path = os.environ[PROFILE_VARIABLE] = os.path.join(tempfile.mkdtemp(), "profile.json")
        profile = _guarded(entry, "error", _profile, entry, name, args.size, clock, path)
        if profile:
            entry["profile"] = profile
        if clock.cuda:
            torch.cuda.empty_cache()
        if hvd.rank() == 0:
            write_json(args.json, result)
    return result


def _profile(entry, name, size, clock, path) -> dict:
    """Steps of a rank="auto" job until auto writes its profile at `path`; the profile."""
    workload, opt, batch = _training(name, size, clock.device, rank="auto")
    entry["description"], times = workload.description, entry.setdefault("steps_ms", [])
    while len(times) < PROFILE_MAX_STEPS and not os.path.exists(path):
        times.append(_timed_step(opt, workload, batch, entry["precision"], clock))
    if not os.path.exists(path):
        raise RuntimeError(f"no profile written in {len(times)} steps")
    with open(path) as f:
        return json.load(f)


# --- host reads and syncs of steady-state steps ---------------------------------------------
SYNC_STEPS = 21  # steps per configuration: the statistics twice, the drift check once
DRIFT_EVERY = 20  # drift_check_every: one check (step 20), and the one after the first
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_FILES = (os.path.abspath(__file__), os.path.abspath(warnings.__file__))


@contextlib.contextmanager
def cuda_sync_reports(mode: str = "warn"):
    """Inside: torch.cuda's sync debug mode; yields the list of (site, message) it reported:
    in "warn" mode every synchronising CUDA call of torch is a warning, caught here with the
    innermost caller outside torch; in "error" mode it raises (and nothing is collected)."""
    found: list[dict] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning  # catch_warnings puts it back

        def capture(message, *where):
            if "synchroniz" not in str(message):
                return show(message, *where)
            site, code = "?", ""
            for entry in reversed(traceback.extract_stack()[:-1]):
                path = os.path.abspath(entry.filename)
                if path not in _SKIP_FILES and not path.startswith(_TORCH_DIR):
                    site, code = f"{repo_path(path)}:{entry.lineno}", (entry.line or "").strip()
                    break
            found.append({"site": site, "code": code, "message": str(message).splitlines()[0]})

        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _summary(steps: dict[int, list[dict]]) -> list[dict]:
    """Per (site, method): the steps where it happened and how many times in all."""
    where: dict[tuple, dict] = {}
    for step, reads in sorted(steps.items()):
        for read in reads:
            entry = where.setdefault((read["site"], read["method"]), {**read, "steps": []})
            entry["count"] = entry.get("count", 0) + 1
            if step not in entry["steps"]:
                entry["steps"].append(step)
    return sorted(where.values(), key=lambda e: (e["steps"][0], e["site"]))


def run_syncs(args) -> dict:
    """SYNC_STEPS steps per configuration (both schedules, float32 and float16 on the wire;
    and both schedules with `cuda_graphs=True`, whose "error" step is a replayed one):
    each step's host reads (`HostReads`, tests/parallel/host_reads.py), waits for Horovod's
    collectives and, on CUDA, what ``torch.cuda.set_sync_debug_mode`` reports (it catches
    C++ code's synchronising calls too); then one step in its "error" mode."""
    import horovod.torch as hvd

    clock = Clock(horovod_device(hvd), args.size)
    out = {"device": str(clock.device), "ranks": hvd.size(), "drift_check_every": DRIFT_EVERY}
    out["configs"] = []
    configs = [(r, dtype, False) for r, dtype in itertools.product((2, 1), (None, torch.float16))]
    for rounds, comm_dtype, graphed in [*configs, (2, None, True), (1, None, True)]:
        # A fresh model per configuration, as for the whole steps.
        options = dict(rank=4, rounds=rounds, comm_dtype=comm_dtype, drift_check_every=DRIFT_EVERY)
        options["cuda_graphs"] = graphed
        workload, opt, batch = _training("resnet50", args.size, clock.device, **options)
        out["model"] = workload.description
        counted, synced, waits = {}, {}, {}
        # Each hvd.synchronize is the host waiting for a collective's result.
        sync = mock.patch.object(hvd, "synchronize", wraps=hvd.synchronize)
        with HostReads() as reads, sync as collective_waits:
            for step in range(1, SYNC_STEPS + 1):
                opt.zero_grad()
                before = collective_waits.call_count
                with contextlib.ExitStack() as stack:
                    syncs = stack.enter_context(cuda_sync_reports("warn")) if clock.cuda else []
                    stack.enter_context(reads.recording(str(step)))
                    workload.loss(workload.model, batch).backward()
                    opt.step()
                clock.wait()
                counted[step] = [vars(r) for r in reads.by_label[str(step)]]  # Read's fields
                synced[step] = [{**r, "method": "sync", "device": "cuda"} for r in syncs]
                waits[step] = collective_waits.call_count - before
        config = {
            "rounds": rounds,
            "wire": "fp16" if comm_dtype else "fp32",
            "graphs": graphed,
            "counted": _summary(counted),
            "cuda_sync_debug": _summary(synced),
            "collective_waits_per_step": waits,
            # One more step with sync debug mode "error": on a step that is no multiple of
            # a periodic check, any synchronising call raises here.
            "error_mode_step": SYNC_STEPS + 1,
            "error_mode": "not run (no CUDA: sync debug mode is CUDA's)",
        }
        if clock.cuda:
            opt.zero_grad()
            try:
                with cuda_sync_reports("error"):
                    workload.loss(workload.model, batch).backward()
                    opt.step()
                torch.cuda.synchronize()
                config["error_mode"] = "passed"
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0]
                config["error_mode"] = f"raised: {type(exc).__name__}: {first}"
                config["error_mode_traceback"] = traceback.format_exc()[-3000:]
        out["configs"].append(config)
        del opt, workload
    if hvd.rank() == 0:
        write_json(args.json, out)
    return out


def write_json(path, result) -> None:
    """`result` into `path` at once: a run stopped from outside leaves the last whole one."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


COMMANDS = {"local": run_local, "e2e": run_e2e, "profile": run_profile, "syncs": run_syncs}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--json", required=True, help="where rank 0 writes the result")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"])
    args = parser.parse_args()
    COMMANDS[args.command](args)
