"""Everything that talks to Horovod: the only module of the library that imports it.

`Comm` holds one optimizer's collectives over its process set, named apart from
every other optimizer's, and counts what it sends. `Collective` adds a deadline
to the collectives of a call that every rank must make (the checkpoints).
Horovod's names that the rest of the library needs (ops, compression, the
process set, the elastic state handlers) are re-exported here.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import time

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch import optimizer as _hvd_optimizer
from horovod.torch.compression import FP16Compressor, NoneCompressor
from horovod.torch.elastic import state as _elastic_state

from .config import COMM_DTYPES

Average, Sum, Adasum = hvd.Average, hvd.Sum, hvd.Adasum
Compression, ProcessSet, global_process_set = (
    hvd.Compression,
    hvd.ProcessSet,
    hvd.global_process_set,
)
# hvd.broadcast_optimizer_state initialises an empty optimizer with the wrapped
# optimizer's plain step (no collective) only when `optimizer.__module__` is that of
# horovod.torch.optimizer's DistributedOptimizer: read it there. hvd.DistributedOptimizer
# may by now be a user's wrapper put in its place (the one-line swap, made by a function).
HOROVOD_OPTIMIZER_MODULE = _hvd_optimizer.DistributedOptimizer.__module__
OptimizerStateHandler = _elastic_state.OptimizerStateHandler
# What Horovod says of a process set it does not hold (or no longer): its collectives,
# and ProcessSet.size() / rank().
_SET_GONE = ("Process set provided does not exist", "Process set does not exist")
# Dtypes Horovod 0.28 can broadcast; others (bfloat16, bool) travel as their bytes.
_BROADCASTABLE = (*COMM_DTYPES, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# The ctx of a gradient cast to comm_dtype for the wire (not the user's compression).
_CAST = object()
# Each optimizer gets its own collective names: a count per process set, since
# the ranks of a process set build their optimizers in the same order.
_instances: dict = collections.defaultdict(itertools.count)

# hvd.synchronize() waits by spinning on sched_yield, which keeps a core busy
# for as long as the collective takes. Where ranks share cores with each other
# or with Horovod's background threads (the other ranks' backward pass, the
# negotiation that completes the collective), that core is taken from the very
# work being waited for. Our waits poll and sleep instead; the added latency is
# at most about one interval per round.
_POLL_INTERVAL_S = 100e-6


def _translated(owner, name: str):
    """`owner.name` (looked up at each call, as a test may replace it), raising
    HorovodInternalError where Horovod lost a process set.

    Once Horovod has stopped (a rank ended or failed), it clears its process sets
    before it checks whether it stopped, so a call over any set but the global one
    fails with a ValueError that says the set does not exist. Horovod's own
    collectives raise HorovodInternalError then, which elastic training and user
    code catch to recover: so do ours. (Every set of an optimizer was there when
    it was built: its first collective ran over it.)
    """

    def call(*args, **kwargs):
        try:
            return getattr(owner, name)(*args, **kwargs)
        except ValueError as error:
            raise _gone(error)  # noqa: B904 (the original, or one whose cause it is)

    return call


def _gone(error: ValueError) -> Exception:
    if not any(text in str(error) for text in _SET_GONE):
        return error
    internal = HorovodInternalError(
        f"{error}: Horovod has stopped (a rank ended or failed), or the process set was "
        "removed while an optimizer used it"
    )
    internal.__cause__ = error
    return internal


# The Horovod calls of an optimizer's process set (see `_translated`).
_grouped_allreduce_async_ = _translated(hvd, "grouped_allreduce_async_")
_grouped_reducescatter_async = _translated(hvd, "grouped_reducescatter_async")
_grouped_allgather_async = _translated(hvd, "grouped_allgather_async")
_allgather_async = _translated(hvd, "allgather_async")
_allgather = _translated(hvd, "allgather")
_allreduce = _translated(hvd, "allreduce")
_broadcast_object = _translated(hvd, "broadcast_object")
_broadcast_async_ = _translated(hvd, "broadcast_async_")
_set_size = _translated(hvd.ProcessSet, "size")
_set_rank = _translated(hvd.ProcessSet, "rank")


class _Done:
    """The handle of an every-step collective over a set of one rank: complete at once,
    its result the input (`Comm.alone`)."""

    __slots__ = ("result",)

    def __init__(self, result):
        self.result = result


def poll(handle) -> bool:
    """hvd.poll(handle); True at once for a set of one rank's (`_Done`)."""
    return isinstance(handle, _Done) or hvd.poll(handle)


def wait(handle):
    """hvd.synchronize(handle), without keeping a core busy while it is pending."""
    if isinstance(handle, _Done):
        return handle.result
    while not hvd.poll(handle):
        time.sleep(_POLL_INTERVAL_S)
    return hvd.synchronize(handle)


def wait_until(handle, timeout: float | None, late):
    """`wait`, but raise `late()` once it has been pending `timeout` s (None: never)."""
    deadline = None if not timeout else time.monotonic() + timeout
    while not hvd.poll(handle):
        if deadline is not None and time.monotonic() > deadline:
            raise late()
        time.sleep(_POLL_INTERVAL_S)
    return hvd.synchronize(handle)


def rank() -> int:
    """This process's global rank."""
    return hvd.rank()


def node_layout() -> list[int]:
    """This rank's [local_rank, local_size, cross_rank, cross_size] and whether
    process sets may be added now (1/0), as Horovod sees them."""
    try:  # Horovod reads it as a number: positive is on
        dynamic = int(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0")) > 0
    except ValueError:
        dynamic = False
    return [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), int(dynamic)]


def process_sets(rank_lists: list[list[int]]) -> list:
    """A Horovod process set for each list of global ranks; every rank must call it alike.

    One that exists already (the user's, or an earlier optimizer's) is reused:
    Horovod refuses a second set of the same ranks. New ones are added
    (HOROVOD_DYNAMIC_PROCESS_SETS=1), in the order given, on every rank.
    """
    from horovod.common.process_sets import _temp_process_set_object
    from horovod.torch.mpi_ops import _basics

    existing = {
        tuple(sorted(ranks)): set_id
        for set_id, ranks in _basics._get_process_set_ids_and_ranks().items()
    }
    out = []
    for ranks in rank_lists:
        key = tuple(sorted(ranks))
        if key in existing:
            out.append(_temp_process_set_object(existing[key]))
        else:
            out.append(hvd.add_process_set(list(key)))
            existing[key] = out[-1].process_set_id
    return out


def first_rank(process_set) -> int:
    """The global rank of `process_set`'s first member (Horovod's root ranks are global)."""
    return 0 if process_set.ranks is None else process_set.ranks[0]


def members(process_set) -> list[int]:
    """The global ranks of `process_set`'s members, in set-rank order."""
    return list(range(hvd.size())) if process_set.ranks is None else list(process_set.ranks)


def is_fp16(compression) -> bool:
    """Whether `compression` is Horovod's float16 compressor (class or instance)."""
    return (
        isinstance(compression, type) and issubclass(compression, FP16Compressor)
    ) or isinstance(compression, FP16Compressor)


def is_elementwise(compression) -> bool:
    """Whether `compression` is one of Horovod's own (none, float16), which act on each
    element alone: a flat tensor of several gradients compresses as they would alone."""
    kind = compression if isinstance(compression, type) else type(compression)
    return kind in (NoneCompressor, FP16Compressor)  # a subclass may do otherwise


def register_state_handler(optimizer_type: type, handler: type) -> None:
    """Make hvd.elastic.TorchState sync optimizers of `optimizer_type` with `handler`."""
    # TorchState picks the first handler whose type matches: ours first.
    _elastic_state.set_handler_registry(
        [(optimizer_type, handler), *_elastic_state.get_handler_registry()]
    )


class Comm:
    """One optimizer's collectives over `process_set`, counting the elements it sends.

    Args:
        process_set: the Horovod process set.
        op: hvd.Average or hvd.Sum, for the gradients' all-reduces.
        compression: Horovod's compressor of the tensors that travel uncompressed.
        predivide: Horovod's gradient_predivide_factor (with Average).
    """

    def __init__(
        self, process_set, op=hvd.Average, compression=hvd.Compression.none, predivide=1.0
    ):
        self.process_set, self.op, self.compression = process_set, op, compression
        self.predivide = predivide
        set_id = process_set.process_set_id
        self.name = f"powersgd.{set_id}.{next(_instances[set_id])}"
        scale = {}
        if op == hvd.Average:  # divide before the sum and after, as Horovod does
            scale = {"prescale_factor": 1.0 / predivide, "postscale_factor": predivide}
        self._reduce = {"op": op, "process_set": process_set, **scale}  # the gradients'
        self.elements_sent = 0  # handed to all-reduces of gradients, P and Q so far
        self.bytes_sent = 0
        self.tally = self  # whose counters this one's collectives add to

    @property
    def size(self) -> int:
        return _set_size(self.process_set)

    @property
    def set_rank(self) -> int:
        return _set_rank(self.process_set)

    @property
    def alone(self) -> bool:
        """Whether the set has one rank. Its every-step collectives then make no Horovod
        request: the sum over one rank is the tensor itself (scaled as Horovod scales
        it), so a step waits for nothing, as Horovod's own optimizer at size 1 (which
        registers no hooks). Counted as sent all the same (what a step hands over)."""
        return self.size == 1

    def included(self) -> bool:
        return self.process_set.included()

    def counters(self) -> dict:
        """What this rank sent so far (saved with the optimizer's state)."""
        return {"elements_sent": self.elements_sent, "bytes_sent": self.bytes_sent}

    def set_counters(self, counters: dict) -> None:
        self.elements_sent, self.bytes_sent = counters["elements_sent"], counters["bytes_sent"]

    # --- every step -----------------------------------------------------------------
    def allreduce_async(self, tensors: list[torch.Tensor], name: str):
        """One grouped all-reduce of `tensors` in place (op, scaling as set), counted."""
        self._count(tensors)
        if self.alone:
            for key in ("prescale_factor", "postscale_factor"):
                if self._reduce.get(key, 1.0) != 1.0:
                    torch._foreach_mul_(tensors, self._reduce[key])
            return _Done(list(tensors))
        return _grouped_allreduce_async_(tensors, name=f"{self.name}.{name}", **self._reduce)

    def _count(self, tensors: list[torch.Tensor]) -> None:
        self.tally.elements_sent += sum(t.numel() for t in tensors)
        self.tally.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def sum_async(self, tensors: list[torch.Tensor], name: str):
        """One grouped all-reduce of `tensors` in place, summed (whatever `op`), counted."""
        self._count(tensors)
        if self.alone:
            return _Done(list(tensors))
        return _grouped_allreduce_async_(
            tensors, name=f"{self.name}.{name}", op=hvd.Sum, process_set=self.process_set
        )

    def reducescatter_async(self, tensors: list[torch.Tensor], name: str):
        """One grouped reduce-scatter (op, no scaling): set rank i gets row i of each
        (set size, L) tensor; counted. `wait` gives the (1, L) results."""
        self._count(tensors)
        return _grouped_reducescatter_async(
            tensors, name=f"{self.name}.{name}", op=self.op, process_set=self.process_set
        )

    def allgather_async(self, tensors: list[torch.Tensor], name: str):
        """One grouped all-gather of (1, L) tensors: `wait` gives the (set size, L) ones."""
        self._count(tensors)
        return _grouped_allgather_async(
            tensors, name=f"{self.name}.{name}", process_set=self.process_set
        )

    def sparse_allreduce_async(self, grad: torch.Tensor, name: str):
        """Start summing sparse `grad` over the ranks by all-gathering its indices and values.

        As Horovod sends a sparse gradient without sparse_as_dense: every rank's
        (coalesced) rows travel as they are, and the result holds all of them,
        averaged with op=Average. Counted like an uncompressed gradient. Returns
        a function that waits and gives the aggregate (sparse, equal on every rank).
        """
        grad = grad.coalesce()
        indices, values = grad.indices().t().contiguous(), grad.values()
        self.elements_sent += indices.numel() + values.numel()
        self.bytes_sent += indices.numel() * 8 + values.numel() * values.element_size()
        name = f"{self.name}.{name}"
        handles = [
            _Done(t) if self.alone else
            _allgather_async(t, name=f"{name}.{part}", process_set=self.process_set)
            for part, t in (("values", values), ("indices", indices))
        ]  # fmt: skip
        size, average = self.size, self.op == hvd.Average

        def result() -> torch.Tensor:
            values, indices = (wait(h) for h in handles)
            if average:
                values = values / size
            # Valid by construction (every rank's indices of a tensor of this shape).
            return torch.sparse_coo_tensor(indices.t(), values, grad.shape, check_invariants=False)

        return result

    poll = staticmethod(poll)
    wait = staticmethod(wait)

    def to_wire(self, grad: torch.Tensor, comm_dtype: torch.dtype | None):
        """(tensor to all-reduce, ctx) for a gradient that travels uncompressed.

        Compressed steps send everything in `comm_dtype` where one is set;
        otherwise the user's Horovod `compression` applies, as in Horovod.
        """
        if comm_dtype is not None:
            return (grad if grad.dtype == comm_dtype else grad.to(comm_dtype)), _CAST
        tensor, ctx = self.compression.compress(grad)
        if tensor.is_floating_point() and tensor.dtype not in COMM_DTYPES:
            tensor = tensor.float()  # bfloat16: Horovod 0.28 cannot reduce it
        return tensor, ctx

    def from_wire(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        """The aggregate of a `to_wire` tensor (the caller copies it into p.grad)."""
        return tensor if ctx is _CAST else self.compression.decompress(tensor, ctx)

    def pack(self, grads: list[torch.Tensor], comm_dtype: torch.dtype | None) -> Packed:
        """`grads` that travel uncompressed, ready for the wire: one flat tensor per dtype."""
        return Packed(self, grads, comm_dtype)

    # --- now and then ---------------------------------------------------------------
    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's `tensor`, stacked along the first dimension in set-rank order."""
        return _allgather(tensor, name=f"{self.name}.{name}", process_set=self.process_set)

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The sum of `tensor` over the ranks, the same on every rank (not counted)."""
        return _allreduce(
            tensor, op=hvd.Sum, name=f"{self.name}.{name}", process_set=self.process_set
        )

    def broadcast_object(self, obj, root_rank: int, name: str):
        """Global rank `root_rank`'s `obj`, on every rank of the set."""
        return _broadcast_object(
            obj, root_rank=root_rank, name=f"{self.name}.{name}", process_set=self.process_set
        )

    def allgather_bytes(self, blob: bytes, name: str) -> list[bytes]:
        """Every rank's `blob`, in set-rank order."""
        return Collective("", self.process_set, None).allgather_bytes(blob, f"{self.name}.{name}")

    def broadcast_(self, tensors: list[torch.Tensor], name: str) -> None:
        """Overwrite `tensors` with those of the process set's first rank."""
        root = first_rank(self.process_set)
        handles, copies = [], []
        for i, t in enumerate(tensors):
            wire = t
            if t.dtype not in _BROADCASTABLE:
                # bfloat16, bool: Horovod 0.28 cannot broadcast them, but their bytes.
                wire = t.detach().contiguous().reshape(-1).view(torch.uint8)
                if wire.data_ptr() != t.data_ptr():
                    copies.append((t, wire))
            handles.append(
                _broadcast_async_(wire, root_rank=root, name=f"{self.name}.{name}.{i}",
                    process_set=self.process_set,
                )
            )  # fmt: skip
        for handle in handles:
            wait(handle)
        for t, wire in copies:  # a non-contiguous tensor travelled as a copy
            t.copy_(wire.view(t.dtype).view(t.shape))


class Packed:
    """Gradients that travel as they are: one flat tensor on the wire, where they can.

    A bucket's uncompressed gradients (a ResNet-50's 107 biases and norms) leave
    as one Horovod request instead of one a tensor: one copy in (`torch.cat`)
    and one out (`torch._foreach_copy_`), the wire's cast or the user's
    compression once. Each travels alone, as in Horovod, where they differ in
    dtype or device, and where the user's own Horovod compressor may look at a
    tensor as a whole (a scale per tensor): Horovod's none and float16 act
    element by element, so they pack.

    Args:
        comm: the `Comm` whose wire format (`to_wire`) they take.
        grads: the gradients, in the bucket's order (the same on every rank).
        comm_dtype: the compressed step's wire dtype, or None (the user's compression).
    """

    def __init__(self, comm: Comm, grads: list[torch.Tensor], comm_dtype: torch.dtype | None):
        self.comm, self.grads = comm, grads
        alike = len({(g.dtype, g.device) for g in grads}) == 1
        self.flat = len(grads) > 1 and alike and (comm_dtype or is_elementwise(comm.compression))
        sent = grads
        if self.flat:  # a vector as it is; other shapes flattened
            sent = [torch.cat([g if g.dim() == 1 else g.reshape(-1) for g in grads])]
        wired = [comm.to_wire(t, comm_dtype) for t in sent]
        self.tensors, self.ctxs = [t for t, _ in wired], [c for _, c in wired]

    def write(self, outputs: list[torch.Tensor], targets: list, copies=None) -> list:
        """The aggregates (`outputs`: the all-reduced `tensors`) into `targets`, the
        gradients as they are now (a None target gets a new tensor); returns them.
        `copies`: a list to add the (target, aggregate) pairs to, for the caller to copy
        in one fused copy with others' (None: copied here)."""
        results = [self.comm.from_wire(t, ctx) for t, ctx in zip(outputs, self.ctxs)]
        if self.flat:  # one cast back, if any, and views of it
            flat = results[0].to(self.grads[0].dtype).split([g.numel() for g in self.grads])
            results = [t if t.shape == g.shape else t.view_as(g) for t, g in zip(flat, self.grads)]
        pairs = [(t, r) for t, r in zip(targets, results) if t is not None and t is not r]
        if copies is not None:
            copies += pairs
        elif pairs:
            torch._foreach_copy_([t for t, _ in pairs], [r for _, r in pairs])
        return [t if t is not None else r.to(g.dtype, copy=True)
                for t, r, g in zip(targets, results, self.grads)]  # fmt: skip


class Collective:
    """Collectives of a call that every rank of `process_set` must make, with a deadline.

    A Horovod collective waits for ever for a rank that never joins it (say, a
    function called under `if hvd.rank() == 0:`); these raise `TimeoutError`,
    naming `what`, after `timeout` seconds instead (None or 0: wait for ever).
    """

    def __init__(self, what: str, process_set, timeout: float | None, hint: str = ""):
        self.what, self.process_set, self.timeout, self.hint = what, process_set, timeout, hint

    def _late(self):
        return TimeoutError(
            f"{self.what} waited {self.timeout:g} s on rank {hvd.rank()} for the other ranks "
            f"of its process set {members(self.process_set)}: it is collective, so every one "
            f"of them must call it{self.hint}"
        )

    def _wait(self, handle):
        return wait_until(handle, self.timeout, self._late)

    def allgather_bytes(self, blob: bytes, name: str) -> list[bytes]:
        """Every rank's `blob`, in set-rank order."""
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        sizes = self._wait(
            _allgather_async(
                torch.tensor([data.numel()]),
                name=f"{name}.sizes",
                process_set=self.process_set,
            )
        )
        gathered = self._wait(
            _allgather_async(data, name=f"{name}.data", process_set=self.process_set)
        )
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(gathered[offset : offset + size].numpy().tobytes())
            offset += size
        return out

    def allgather_object(self, obj, name: str) -> list:
        """`obj` of every rank of the process set, in rank order."""
        return [pickle.loads(b) for b in self.allgather_bytes(pickle.dumps(obj), name)]

    def broadcast_object(self, obj, name: str):
        """The process set's first rank's `obj`, on every rank of the set."""
        root = first_rank(self.process_set)
        data = pickle.dumps(obj) if hvd.rank() == root else b""
        size = torch.tensor([len(data)])
        self._wait(_broadcast_async_(size, root, name=f"{name}.size", process_set=self.process_set))
        buffer = torch.zeros(int(size), dtype=torch.uint8)
        if hvd.rank() == root:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._wait(
            _broadcast_async_(
                buffer,
                root,
                name=f"{name}.data",
                process_set=self.process_set,
            )
        )
        return pickle.loads(buffer.numpy().tobytes())
