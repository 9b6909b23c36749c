"""Host reads of tensors in training steps: where the host would wait for the device.

On an accelerator, reading a tensor's value on the host (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(t)``, ...) or building a device tensor from host data
(``torch.tensor(data, device=...)``) makes the host wait for the device: the
stream drains, and the work queued behind it stops overlapping. `HostReads`
counts these calls by patching them on ``torch.Tensor`` (and ``torch.tensor``),
so the count works on the CPU as well, where nothing actually waits: a CPU test
then shows what a GPU step would do. Each read is attributed to the innermost
caller outside torch, with that line's source.

A read whose line first tests for a CPU device (``device.type == "cpu" and
bool(...)``, a fast path that is free on the CPU) never runs on an accelerator:
it is marked `cpu_only`.

On CUDA, ``torch.cuda.set_sync_debug_mode`` catches every synchronising torch
call, those of C++ code too; `probe` (``python scripts/gpu/gpu_syncs.py probe``,
the kit's "syncs" phase, under horovodrun) uses both.

Used by tests/parallel/test_host_syncs.py and scripts/gpu/gpu_check.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import linecache
import os
import re
import sys
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch

# Tensor methods that hand a value to the host, and the `.to()` that moves it there.
READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
_CPU_GUARD = re.compile(r"""\.type\s*==\s*["']cpu["']""")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_WARNINGS_FILE = os.path.abspath(warnings.__file__)


@dataclass(frozen=True)
class Read:
    """One host read: what was called, on which device's tensor, and from where."""

    method: str  # "item", "tolist", ..., "to(cpu)", "torch.tensor(device=)"
    device: str  # device type of the tensor read (or made)
    site: str  # "path:line" of the innermost caller outside torch and this module
    function: str
    code: str  # that line's source
    cpu_only: bool  # the line tests for a CPU device first: never reached on an accelerator


def _caller() -> tuple[str, str, str]:
    """(path:line, function, source) of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR):
            line = linecache.getline(path, frame.f_lineno).strip()
            return f"{_short(path)}:{frame.f_lineno}", frame.f_code.co_name, line
        frame = frame.f_back
    return "?", "?", ""


def _short(path: str) -> str:
    """A path relative to the repository (or to site-packages) when it lies there."""
    root = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep
    if path.startswith(root):
        return path[len(root) :]
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _moves_to_host(tensor, args, kwargs) -> bool:
    """Whether `tensor.to(*args, **kwargs)` would copy an accelerator's tensor to the host.

    On the CPU a move to the tensor's own device (``.to(param.device)``) cannot be told
    from a move to the host, so there only the spelled-out ``.to("cpu")`` counts.
    """
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if not isinstance(target, (str, torch.device)) or torch.device(target).type != "cpu":
        return False
    return tensor.device.type != "cpu" or isinstance(target, str)


class HostReads:
    """Records every host read made while recording is on, from any thread.

    Example:
        >>> with HostReads() as reads:
        ...     with reads.recording("step 1"):
        ...         float(torch.ones(1).sum())
        ...     [r.method for r in reads.by_label["step 1"]]
        ['__float__']
    """

    def __init__(self):
        self.by_label: dict[str, list[Read]] = collections.defaultdict(list)
        self._label: str | None = None
        self._lock = threading.Lock()
        self._saved: dict[str, object] = {}
        self._patched_tensor_factory = None

    # --- patching ----------------------------------------------------------------------
    def __enter__(self):
        for name in READ_METHODS:
            self._patch(name, self._read_wrapper(name))
        original_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            if self._label is not None and _moves_to_host(tensor, args, kwargs):
                self._record("to(cpu)", tensor.device.type)
            return original_to(tensor, *args, **kwargs)

        self._patch("to", to)
        factory = torch.tensor

        def tensor(data, *args, **kwargs):
            if self._label is not None and kwargs.get("device") is not None:
                self._record("torch.tensor(device=)", torch.device(kwargs["device"]).type)
            return factory(data, *args, **kwargs)

        torch.tensor = tensor
        self._patched_tensor_factory = factory
        return self

    def __exit__(self, *exc):
        torch.tensor = self._patched_tensor_factory
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()
        return False

    def _patch(self, name, wrapper):
        self._saved[name] = torch.Tensor.__dict__.get(name)
        setattr(torch.Tensor, name, wrapper)

    def _read_wrapper(self, name):
        original = getattr(torch.Tensor, name)

        def wrapper(tensor, *args, **kwargs):
            if self._label is not None:
                self._record(name, tensor.device.type)
            return original(tensor, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper

    def _record(self, method: str, device: str) -> None:
        site, function, code = _caller()
        read = Read(method, device, site, function, code, bool(_CPU_GUARD.search(code)))
        with self._lock:
            label = self._label
            if label is not None:
                self.by_label[label].append(read)

    # --- use ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, label: str):
        """Record the reads made inside this block under `label`."""
        self._label = label
        try:
            yield
        finally:
            self._label = None

    def accelerator_reads(self, label: str) -> list[Read]:
        """The reads of `label` that an accelerator would make (CPU-only fast paths left out)."""
        return [r for r in self.by_label.get(label, []) if not r.cpu_only]


@contextlib.contextmanager
def cuda_sync_reports(mode: str = "warn"):
    """Inside: torch.cuda's sync debug mode; yields the list of (site, message) it reported.

    In "warn" mode every synchronising CUDA call of torch becomes a warning,
    caught here with the innermost caller outside torch; in "error" mode it
    raises instead (and nothing is collected).
    """
    found: list[dict] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def capture(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return show(message, category, filename, lineno, file, line)
            site = "?"
            for entry in reversed(traceback.extract_stack()[:-1]):
                path = os.path.abspath(entry.filename)
                if path not in (_THIS_FILE, _WARNINGS_FILE) and not path.startswith(_TORCH_DIR):
                    site = f"{_short(path)}:{entry.lineno}"
                    code = (entry.line or "").strip()
                    break
            else:
                code = ""
            found.append({"site": site, "code": code, "message": str(message).splitlines()[0]})

        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = show


def collective_waits():
    """Context manager counting hvd.synchronize() calls (the host waiting for a collective)."""
    import horovod.torch as hvd

    counter = {"waits": 0}
    original = hvd.synchronize

    def synchronize(handle):
        counter["waits"] += 1
        return original(handle)

    @contextlib.contextmanager
    def patched():
        hvd.synchronize = synchronize
        try:
            yield counter
        finally:
            hvd.synchronize = original

    return patched()


# --- the kit's probe ------------------------------------------------------------------------
def _summary(steps: dict[int, list[dict]]) -> list[dict]:
    """Per (site, method): the steps where it happened and how many times in all."""
    where: dict[tuple, dict] = {}
    for step, reads in sorted(steps.items()):
        for read in reads:
            key = (read["site"], read["method"])
            entry = where.setdefault(key, {**read, "steps": [], "count": 0})
            entry["count"] += 1
            if step not in entry["steps"]:
                entry["steps"].append(step)
    return sorted(where.values(), key=lambda e: (e["steps"][0], e["site"]))


def probe(args) -> dict:
    """Train `args.steps` steps per configuration; per step, every host read and sync."""
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd.bench import models

    hvd.init()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    workload = models.workload(args.model, args.size, device)
    model = workload.model
    out = {"device": str(device), "model": workload.description, "ranks": hvd.size()}
    out["drift_check_every"] = args.drift_every
    configs = []
    for rounds in (2, 1):
        for wire in ("fp32", "fp16"):
            configs.append((rounds, wire))
    out["configs"] = []
    g = torch.Generator().manual_seed(hvd.rank())
    for rounds, wire in configs:
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        opt = hps.DistributedOptimizer(
            sgd,
            named_parameters=model.named_parameters(),
            rank=args.rank,
            rounds=rounds,
            comm_dtype=torch.float16 if wire == "fp16" else None,
            drift_check_every=args.drift_every,
        )
        batch = workload.batch(g)
        counted: dict[int, list[dict]] = {}
        synced: dict[int, list[dict]] = {}
        waits: dict[int, int] = {}
        started = time.perf_counter()
        with HostReads() as reads, collective_waits() as counter:
            for step in range(1, args.steps + 1):
                opt.zero_grad()
                before = counter["waits"]
                with contextlib.ExitStack() as stack:
                    sync = stack.enter_context(cuda_sync_reports("warn")) if cuda else []
                    stack.enter_context(reads.recording(str(step)))
                    workload.loss(model, batch).backward()
                    opt.step()
                if cuda:
                    torch.cuda.synchronize()
                counted[step] = [asdict(r) for r in reads.by_label[str(step)]]
                synced[step] = sync
                waits[step] = counter["waits"] - before
        config = {
            "rounds": rounds,
            "wire": wire,
            "seconds": time.perf_counter() - started,
            "counted": _summary(counted),
            "cuda_sync_debug": _summary(
                {
                    s: [{**r, "method": "sync", "device": "cuda"} for r in v]
                    for s, v in synced.items()
                }
            ),
            "collective_waits_per_step": waits,
        }
        # One more step with sync debug mode "error": on a step that is no multiple of
        # a periodic check, any synchronising call raises here.
        step = args.steps + 1
        config["error_mode_step"] = step
        if cuda:
            opt.zero_grad()
            try:
                with cuda_sync_reports("error"):
                    workload.loss(model, batch).backward()
                    opt.step()
                torch.cuda.synchronize()
                config["error_mode"] = "passed"
            except RuntimeError as exc:
                config["error_mode"] = (
                    "raised: "
                    + "".join(traceback.format_exception_only(type(exc), exc))
                    .strip()
                    .splitlines()[0]
                )
                config["error_mode_traceback"] = traceback.format_exc()[-3000:]
        else:
            config["error_mode"] = "not run (no CUDA: sync debug mode is CUDA's)"
        out["configs"].append(config)
        del opt, sgd
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="host reads and syncs of steady-state steps (horovodrun)")
    p.add_argument("--json", required=True, help="where rank 0 writes the result")
    p.add_argument("--size", default="tiny", choices=["tiny", "full"])
    p.add_argument("--model", default="resnet50", choices=["resnet50", "gpt2"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    p.add_argument("--steps", type=int, default=21, help="steps per configuration (default 21)")
    p.add_argument(
        "--drift-every", type=int, default=20, help="drift_check_every (default 20: one check)"
    )
    args = parser.parse_args(argv)
    result = probe(args)
    import horovod.torch as hvd

    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
