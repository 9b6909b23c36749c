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
bool(...)``, or ``device.type in HOST_READS_FREE and ...``: a fast path that is
free on the CPU) never runs on an accelerator: it is marked `cpu_only`.

Used by test_host_syncs.py and by the GPU kit's syncs phase (scripts/gpu/gpu_timing.py syncs).
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import os
import re
import sys
import threading
from dataclasses import dataclass

import torch

# Tensor methods that hand a value to the host, and the `.to()` that moves it there.
READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
_CPU_GUARD = re.compile(r"""\.type\s*==\s*["']cpu["']|\.type in HOST_READS_FREE""")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


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
            return f"{repo_path(path)}:{frame.f_lineno}", frame.f_code.co_name, line
        frame = frame.f_back
    return "?", "?", ""


def repo_path(path: str) -> str:
    """A path relative to the repository (or to site-packages) when it lies there."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))) + os.sep
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
