"""When each message of a step leaves: buckets, rounds, overlap with backward.

No Horovod here: `DistributedOptimizer` hands in its collectives (an
asynchronous grouped all-reduce, a poll, a wait) and the conversion of
uncompressed gradients to and from the wire. The math is the compressor's.

A step, as the optimizer drives it:

    begin(compressing)     # a new step: plain all-reduce (warm-up) or PowerSGD
    ready(p)               # from the hook of each final gradient: once a bucket
                           # is complete, its first round leaves; rounds=2 also
                           # starts the Q round of every bucket whose P is back
    finish()               # the rest of the rounds; p.grad holds the aggregates
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compressor import PowerSGDCompressor
from .config import PowerSGDConfig

# Gradients are sent in buckets of about this many bytes, in the order the
# backward pass produces them (the reverse of the parameters' order, as DDP
# assumes), so that the first buckets leave while backward still runs and
# small tensors still travel fused.
BUCKET_BYTES = 4 * 2**20


class Bucket:
    """Parameters whose gradients leave together, and that message's progress in a step."""

    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.compressed: list[torch.Tensor] = []  # filled in once the compressor decided
        self.uncompressed: list[torch.Tensor] = []
        self.clear()

    def clear(self) -> None:
        self.ready = 0  # gradients final this step
        self.handles: list = []  # round 1, then (rounds=2) round 2 (None: nothing to send)
        # Uncompressed tensors of round 1: (parameter, tensor sent, wire ctx).
        self.sent: list = []
        self.factor_count = 0  # leading tensors of round 1 that are P/Q buffers
        self.received: list = []  # rounds=2: round 1's uncompressed results, once back


def make_buckets(params: list[torch.Tensor]) -> list[Bucket]:
    """`params` in reverse order, cut into buckets of about `BUCKET_BYTES`."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets


class Schedule:
    """The communication of a step, bucket by bucket, for one optimizer.

    Args:
        params: the parameters that get gradients, in the optimizer's order.
        names: parameter -> its name (as the compressor knows it).
        config: the settings (`rounds`, `comm_dtype`).
        allreduce_async: (tensors, name) -> handle of a grouped all-reduce in place.
        poll: handle -> whether it is done. wait: handle -> the reduced tensors.
        to_wire: (gradient, comm_dtype or None) -> (tensor to send, ctx).
        from_wire: (received tensor, ctx) -> the aggregated gradient.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        names: dict[torch.Tensor, str],
        config: PowerSGDConfig,
        *,
        allreduce_async: Callable,
        poll: Callable,
        wait: Callable,
        to_wire: Callable,
        from_wire: Callable,
    ):
        self.config = config
        self.names = names
        self.allreduce_async, self.poll, self.wait = allreduce_async, poll, wait
        self.to_wire, self.from_wire = to_wire, from_wire
        self.buckets = make_buckets(params)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.compressor = PowerSGDCompressor(
            [(names[p], p) for p in params],
            config,
            bucket_of={names[p]: b.index for p, b in self._bucket_of.items()},
        )
        for b in self.buckets:
            for p in b.params:
                compressed = self.compressor.is_compressed(names[p])
                (b.compressed if compressed else b.uncompressed).append(p)
        self.launched: list[Bucket] = []  # buckets whose first round is in flight
        self.compressing = False

    def begin(self, compressing: bool) -> None:
        """A new step: PowerSGD (`compressing`) or Horovod's plain all-reduce."""
        self.compressing = compressing

    def ready(self, p: torch.Tensor) -> None:
        """`p.grad` is final for this step (compressed already, where it is compressed)."""
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
        self._progress()

    def finish(self) -> None:
        """Complete every round; afterwards each `p.grad` holds its aggregate."""
        two_rounds = self.compressing and self.config.rounds == 2
        for bucket in self.buckets:
            if two_rounds and len(bucket.handles) == 1:
                self._second_round(bucket)
        for bucket in self.buckets:
            if two_rounds:
                self._receive_uncompressed(bucket, bucket.received)
                if bucket.handles[1] is not None:
                    self._decompress(bucket, self.wait(bucket.handles[1]))
                continue
            outputs = self.wait(bucket.handles[0])
            self._receive_uncompressed(bucket, outputs[bucket.factor_count :])
            if bucket.factor_count:
                self._decompress(bucket, outputs[: bucket.factor_count])
        if self.compressing:
            self.compressor.end_step()
        self.reset()

    def reset(self) -> None:
        """Forget the step in progress (after it, or when the optimizer loads a state)."""
        self.launched = []
        for bucket in self.buckets:
            bucket.clear()

    def _launch(self, bucket: Bucket) -> None:
        """The bucket's first (rounds=1: only) round: its factors and uncompressed gradients.

        Called from the hook of the bucket's last gradient, so it leaves while
        backward still runs for the layers before.
        """
        for p in bucket.params:
            if p.grad is None:
                # Unused on this rank; another rank may have a gradient, so send zeros.
                p.grad = torch.zeros_like(p)
        # Warm-up steps are plain Horovod; compressed steps send everything in
        # comm_dtype (where one is set), the uncompressed gradients included.
        plain = bucket.uncompressed if self.compressing else bucket.params
        comm_dtype = self.config.comm_dtype if self.compressing else None
        bucket.sent = [(p, *self.to_wire(p.grad, comm_dtype)) for p in plain]
        factors = self.compressor.send_buffers(bucket.index) if self.compressing else []
        bucket.factor_count = len(factors)
        tensors = factors + [t for _, t, _ in bucket.sent]
        bucket.handles = [self.allreduce_async(tensors, f"b{bucket.index}.r1")]
        self.launched.append(bucket)

    def _progress(self) -> None:
        """rounds=2: start the Q round of every bucket whose P round is back, without waiting."""
        if self.config.rounds == 1 or not self.compressing:
            return
        for bucket in self.launched:
            if len(bucket.handles) == 1 and self.poll(bucket.handles[0]):
                self._second_round(bucket)

    def _second_round(self, bucket: Bucket) -> None:
        outputs = self.wait(bucket.handles[0])
        # The uncompressed results go into p.grad in finish(), as Horovod's do.
        bucket.received = outputs[bucket.factor_count :]
        if not bucket.factor_count:
            bucket.handles.append(None)
            return
        q_buffers = self.compressor.project(outputs[: bucket.factor_count], bucket.index)
        bucket.handles.append(self.allreduce_async(q_buffers, f"b{bucket.index}.r2"))
        self.compressor.update_error(bucket.index)  # overlapping the Q collective

    def _receive_uncompressed(self, bucket: Bucket, outputs) -> None:
        """Write the bucket's aggregated uncompressed gradients into `p.grad`.

        Into the gradient as it is now, like Horovod: code that assigned a new
        tensor to `p.grad` after backward (e.g. a clamp) gets the result there.
        """
        for (p, _, ctx), out in zip(bucket.sent, outputs):
            out = self.from_wire(out, ctx)
            if p.grad is None:
                p.grad = out.to(p.dtype)
            elif out is not p.grad:
                p.grad.copy_(out)
        bucket.sent = []

    def _decompress(self, bucket: Bucket, factors) -> None:
        """The bucket's compressed gradients, written into `p.grad` as it is now."""
        out = {self.names[p]: p.grad for p in bucket.compressed if p.grad is not None}
        grads = self.compressor.decompress(list(factors), out=out, bucket=bucket.index)
        for p in bucket.compressed:
            if p.grad is None:
                p.grad = grads[self.names[p]]
