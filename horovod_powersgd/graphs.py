"""The compressor's local work as captured graphs: each segment recorded once, replayed after.

A step's local work runs in segments between Horovod's calls (Horovod cannot be
captured: its requests go through a host queue and a thread of its own):

    "partners"             begin_step: every bucket's partners orthogonalised
    ("compress", bucket)   the bucket's products and wire copies (M += grad stays eager:
                           `p.grad` is a new tensor each step)
    "project", "error"     rounds=2: every P̂ and Q_w at once, then the error update
    "decompress"           every gradient, into static outputs (copied into `p.grad`)

Every tensor a segment reads from outside itself must be *static*: held by the
compressor from one step to the next, written in place. What Python decides inside
a segment (a phase, a scale being set or not, which matrices a branch skips) is
frozen into the graph, so the graphs of a step are kept per `key`: everything of
the step's Python state the segments depend on. Layout changes (new ranks, an
excluded parameter, a loaded state) drop them all (`drop`).

A step runs its segments in one of three modes (`begin`): eagerly (the first step of
a key, so lazy handles and allocations exist), capturing (the next one: each segment
is captured and then replayed, so the step's work is done once), or replaying. The
eager path is the same functions, uncaptured.

Runners:

* `Eager`: every segment as it is (the default; graphs off, or no accelerator).
* `CudaGraphs`: CUDA graphs (`torch.cuda.CUDAGraph`, the compressor's generators
  registered, captured on a side stream with `capture_error_mode="thread_local"`,
  as Horovod's threads keep calling CUDA). Not yet run on a GPU: the GPU kit checks it.
* `Recording`: the CPU's stand-in for a capture, for tests (``HOROVOD_POWERSGD_GRAPHS=
  record``): "capture" runs the segment once under a dispatch mode that records every
  operation and refuses what a real capture refuses (a host read, a tensor that is not
  static, a random draw from a generator not registered); "replay" runs the recorded
  operations again, on the same tensors, without any Python of the segment, fresh
  results copied into the captured outputs (a graph's fixed addresses). A test that
  passes through it catches Python state a real graph would freeze.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import layout

# How many eager steps of a key come before its capture: one, so that every lazily
# made handle (cuBLAS, cuSOLVER) and buffer exists before the capture.
EAGER_STEPS = 1

ENV = "HOROVOD_POWERSGD_GRAPHS"  # "record": the recording runner, on any device (tests)


# Set while the recording runner replays: bench.dispatch counts a replay as one launch,
# not its operations (as a CUDA graph's replay is one launch).
REPLAYING = False


class CaptureError(RuntimeError):
    """A segment did something a captured graph cannot replay."""


def runner_for(enabled: bool, device: torch.device | None, generators: Iterable) -> Eager:
    """The runner for `enabled` (the `cuda_graphs` setting) on `device` (the compressed
    matrices'; None: nothing compressed)."""
    if not enabled or device is None:
        return Eager()
    if os.environ.get(ENV, "") == "record":
        return Recording(generators)
    if device.type == "cuda":
        return CudaGraphs(generators, device)
    return Eager()  # nothing to capture on the CPU: the same functions, eagerly


class Eager:
    """Every segment as it is: no capture."""

    graphed = False

    def __init__(self):
        self.mode = "eager"  # of the step in progress: "eager", "capture" or "replay"
        self.captures = 0  # segments captured so far (tests count recaptures)
        self.replays = 0

    def begin(self, key) -> None:
        """A new step, whose Python state the segments depend on is `key`."""

    def run(self, name, segment: Callable[[], None], statics: Callable[[], Iterable]) -> None:
        """Segment `name` of this step: `segment()` eagerly, captured or replayed.

        `statics()`: the tensors held from one step to the next that the segment may read
        (views of them count as theirs).
        """
        segment()

    def end(self) -> None:
        """The step's last segment ran."""

    def drop(self) -> None:
        """The layout changed: forget every graph."""


class _Graphs(Eager):
    """What the graph runners share: which mode a step runs in, graphs by key."""

    graphed = True

    def __init__(self, generators: Iterable[torch.Generator]):
        super().__init__()
        self.generators = list(generators)
        self.graphs: dict = {}  # key -> {segment name -> graph}, complete steps only
        self.seen: dict = {}  # key -> eager steps run
        self.failed: set = set()  # keys that could not be captured: eager for good
        self.key, self._taking = None, None
        self.paused = False  # every step eager, uncounted (rank="auto" measuring, trying)

    def begin(self, key) -> None:
        self.key, self._taking = key, None
        if self.paused:
            self.mode = "eager"
        elif key in self.graphs:
            self.mode = "replay"
        elif key in self.failed or self.seen.get(key, 0) < EAGER_STEPS:
            self.mode = "eager"
            self.seen[key] = self.seen.get(key, 0) + 1
        else:
            self.mode, self._taking = "capture", {}

    def run(self, name, segment, statics) -> None:
        if self.mode == "eager":
            segment()
        elif self.mode == "replay":
            graph = self.graphs[self.key].get(name)
            if graph is None:  # a segment the captured step did not run: layout changed
                raise CaptureError(
                    f"segment {name!r} has no graph of this step's state {self.key!r}; "
                    "the layout changed without the graphs being dropped"
                )
            self._replay(name, graph, statics)
            self.replays += 1
        else:
            if name in self._taking:
                raise CaptureError(f"segment {name!r} ran twice in one step")
            graph = self._capture(name, segment, statics)
            if self.mode == "capture":  # else it failed, and the step went on eagerly
                self._taking[name] = graph
                self.captures += 1

    def end(self) -> None:
        if self.mode == "capture" and self._taking is not None:
            self.graphs[self.key] = self._taking
        self.mode, self._taking = "eager", None

    def drop(self) -> None:
        self.graphs, self.seen, self.failed = {}, {}, set()
        self.mode, self._taking = "eager", None

    def _capture(self, name, segment, statics):
        raise NotImplementedError

    def _replay(self, name, graph, statics) -> None:
        raise NotImplementedError


class CudaGraphs(_Graphs):
    """Each segment a `torch.cuda.CUDAGraph`, replayed on the current stream."""

    def __init__(self, generators, device: torch.device):
        super().__init__(generators)
        self.device, self.stream = device, None

    def _side_stream(self):
        """The stream captures run on, its lazily made handles and workspaces (cuBLAS,
        cuSOLVER) made first by a few small operations: a capture cannot make them."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
            a = torch.eye(4, device=self.device).expand(2, 4, 4).contiguous()
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                torch.linalg.solve_triangular(torch.bmm(a, a), a, upper=True)
                torch.linalg.cholesky_ex(a.double())
                torch.linalg.qr(a)
            torch.cuda.current_stream().wait_stream(self.stream)
        return self.stream

    def _capture(self, name, segment, statics):
        stream = self._side_stream()
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            graph.register_generator_state(generator)
        stream.wait_stream(torch.cuda.current_stream())
        saved = set(layout.HOST_READS_FREE)
        layout.HOST_READS_FREE.clear()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                segment()
        except Exception as error:  # any failure to capture falls back to eager
            self.failed.add(self.key)
            warnings.warn(
                f"horovod_powersgd: segment {name!r} could not be captured as a CUDA graph "
                f"({error}); this step state runs eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
            self._taking = None
            self.mode = "eager"
            segment()
            return None
        finally:
            layout.HOST_READS_FREE.update(saved)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()  # the capture ran nothing: this step's work
        return graph

    def run(self, name, segment, statics) -> None:
        if self.mode == "capture" and self.key in self.failed:
            segment()
            return
        super().run(name, segment, statics)

    def _replay(self, name, graph, statics) -> None:
        graph.replay()


# Operations that hand a value to the host (the stream would drain; a capture fails).
_HOST_READS = {
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::item", "aten::allclose", "aten::masked_select", "aten::lift_fresh",
}  # fmt: skip


# Operations that draw random numbers (from the default generator unless given one).
_RANDOM = {
    "normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "rand", "randn", "randint",
    "randperm", "multinomial", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "random_", "rand_like", "randn_like", "randint_like", "native_dropout",
}  # fmt: skip


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Record(TorchDispatchMode):
    """Runs a segment's operations, recording them; refuses what a capture refuses."""

    def __init__(self, name, statics: set[int], generators: list[torch.Generator]):
        super().__init__()
        self.name, self.statics, self.generators = name, statics, generators
        self.ops: list = []
        self.made: set[int] = set()  # storages the segment allocated
        self.inputs: dict[int, str] = {}  # static storages it read -> an op that read one

    def _registered(self, generator) -> bool:
        """Whether `generator` is one of the registered ones. The dispatcher hands over
        a new Python object for the same generator, so they are told apart by state
        (the compressor seeds its generators apart)."""
        if generator is None:
            return False
        state = generator.get_state()
        return any(
            g.device == generator.device and torch.equal(g.get_state(), state)
            for g in self.generators
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.name()
        if op in _HOST_READS:
            raise CaptureError(f"segment {self.name!r} reads a tensor on the host ({op})")
        draws = op.split("::")[-1] in _RANDOM or "generator" in kwargs
        if draws and not self._registered(kwargs.get("generator")):
            raise CaptureError(
                f"segment {self.name!r} draws random numbers ({op}) from a generator "
                "the graph does not register"
            )
        for t in _tensors((args, kwargs)):
            storage = _storage(t)
            if storage in self.made or t.numel() == 0:
                continue
            if storage not in self.statics:
                raise CaptureError(
                    f"segment {self.name!r} reads a {tuple(t.shape)} {t.dtype} tensor ({op}) "
                    "that is neither static nor made in the segment: a graph would read "
                    "wherever it was"
                )
            self.inputs.setdefault(storage, op)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if _storage(t) not in self.statics:
                self.made.add(_storage(t))
        self.ops.append((func, args, kwargs, out))
        return out


class Recording(_Graphs):
    """The CPU's stand-in for CUDA graphs (module docstring): record, then replay without
    Python."""

    def _capture(self, name, segment, statics):
        held = {_storage(t) for t in statics() if isinstance(t, torch.Tensor)}
        saved = set(layout.HOST_READS_FREE)
        layout.HOST_READS_FREE.clear()  # the accelerator's path: no look on the host
        try:
            with _Record(name, held, self.generators) as record:
                segment()
        finally:
            layout.HOST_READS_FREE.update(saved)
        return record

    def _replay(self, name, record: _Record, statics) -> None:
        held = {_storage(t) for t in statics() if isinstance(t, torch.Tensor)}
        gone = set(record.inputs) - held - record.made
        if gone:
            ops = sorted({record.inputs[s] for s in gone})
            raise CaptureError(
                f"segment {name!r} was captured reading tensors the step no longer holds "
                f"(read by {ops}): a graph would read freed memory"
            )
        global REPLAYING
        REPLAYING = True
        try:
            for func, args, kwargs, out in record.ops:
                fresh = func(*args, **kwargs)
                for kept, new in zip(_tensors(out), _tensors(fresh)):
                    if kept is not new and _storage(kept) != _storage(new):
                        kept.copy_(new)  # the graph's output stays where it was
        finally:
            REPLAYING = False


def copy_out(static: dict, out: dict) -> dict:
    """A graphed step's gradients (name -> its static output) into `out`'s tensors (the
    gradients as they are now) in one fused copy; names without one get a copy."""
    pairs = [(out[n], t) for n, t in static.items() if out.get(n) is not None]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [t for _, t in pairs])
    return {n: out[n] if out.get(n) is not None else t.clone() for n, t in static.items()}


def static_tensors(*roots) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` through attributes, lists, tuples and dicts
    (the objects of this package), each once."""
    out, seen, stack = [], set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, Eager):  # a runner's records are not state
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(__package__ or "horovod_powersgd"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
    return out
