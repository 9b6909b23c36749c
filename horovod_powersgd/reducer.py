"""When each message of a step leaves: buckets, rounds, overlap with backward.

The only caller of the compressor's step protocol. It sends each bucket of
gradients as soon as backward has produced all of it: one fused (grouped)
all-reduce per bucket and round (rounds=2: P with the uncompressed gradients,
then Q; rounds=1: the factors with them). No Horovod here: the collectives are
those of a `comm.Comm`. A step, as the optimizer drives it:

    begin(done)                # a new step: PowerSGD after `done` >= 0 compressed
                               # steps, else a plain all-reduce (warm-up)
    ready(p)                   # p.grad is final; once its bucket is complete, the
                               # bucket is compressed (all its matrices at once) and
                               # its first round leaves
    finish()                   # the rest: every first round back (one round trip:
                               # all left during backward); rounds=2 then every
                               # bucket's P projected at once and every Q in one
                               # grouped all-reduce, one wait; p.grad holds the
                               # aggregates

How a bucket's gradients travel is decided per bucket: `Bucket.compressed`
(sent as P and Q) and `Bucket.uncompressed` (sent as they are, in the step's
comm dtype). A warm-up step sends every gradient as it is.
"""

from __future__ import annotations

from functools import partial

import torch

from .compressor import PowerSGDCompressor

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
        self.names: list[str] = []  # of the compressed ones
        self.uncompressed: list[torch.Tensor] = []
        self.dense: list[torch.Tensor] = []  # all but those that travel elsewhere (sparse)
        self.plain = False  # rank="auto" sends the whole bucket plain (its rank is 0)
        self.clear()

    def clear(self) -> None:
        self.ready = 0  # gradients final this step
        self.handles: list = []  # round 1's (hierarchical: each stage's in turn)
        # Round 1's uncompressed gradients: their parameters, and them packed for the wire.
        self.sent, self.packed = [], None
        self.factor_count = 0  # leading tensors of round 1 that are P/Q buffers
        self.received = []  # round 1's uncompressed results, once back


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


class Reducer:
    """The communication of a step, bucket by bucket, for one optimizer.

    Args:
        buckets: the parameters that get gradients, in buckets (`make_buckets`).
        names: parameter -> its name.
        compressor: the PowerSGD state and math of the compressed parameters.
        comm: the optimizer's collectives (`comm.Comm`).
        monitor: the per-layer statistics (`monitor.LayerMonitor`), or None.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        names: dict[torch.Tensor, str],
        compressor: PowerSGDCompressor,
        comm,
        monitor=None,
    ):
        self.names, self.compressor, self.comm, self.monitor = names, compressor, comm, monitor
        self.comm_dtype = compressor.config.comm_dtype
        self.two_rounds = compressor.schedule.rounds == 2
        self.buckets = buckets
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.skip: set[torch.Tensor] = set()  # sent by the optimizer (all-gathered, sparse)
        self.refresh()
        self.launched: list[Bucket] = []  # buckets whose first round is in flight
        self.done: set[torch.Tensor] = set()  # parameters whose gradient is final this step
        self.in_step = False
        self.compressing = False

    def refresh(self) -> None:
        """Read which parameters the compressor compresses (at construction, after a plan)."""
        self._compressed = {
            p for p in self._bucket_of if self.compressor.is_compressed(self.names[p])
        }
        for b in self.buckets:
            b.compressed = [p for p in b.params if p in self._compressed]
            b.names = [self.names[p] for p in b.compressed]
            b.dense = [p for p in b.params if p not in self.skip]
            b.uncompressed = [p for p in b.dense if p not in self._compressed]
            # Hierarchical: a bucket none of whose tensors are this worker's share has
            # no rank here (its compressor holds only the share's buckets).
            b.plain = self.compressor.ranks.get(b.index) == 0
        self.sending = [b for b in self.buckets if b.dense]  # buckets with a collective

    def begin(self, done: int) -> None:
        """A new step: PowerSGD after `done` >= 0 compressed steps, else (warm-up) plain."""
        self.in_step, self.compressing = True, done >= 0
        if self.compressing:
            self.compressor.begin_step(self.comm.size, done)

    def ready(self, p: torch.Tensor) -> None:
        """`p.grad` is final for this step: once its bucket is complete, compress and send it."""
        bucket = self._bucket_of[p]
        self.done.add(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and bucket.dense:  # else all sent elsewhere
            self._launch(bucket)

    def finish(self) -> None:
        """Complete every round; afterwards each `p.grad` holds its aggregate (then `reset`).

        Two dependent rounds at most after backward, whatever the number of buckets:
        every first round left during backward, so waiting for those not back yet is
        one round trip; rounds=2 then projects every bucket's P at once and sends every
        bucket's Q in one grouped all-reduce, waited for once (`_q_round`). Not Q by Q
        as each P comes back: each would be a wait of its own, and a request alone in a
        cycle of Horovod's; nor P by P: each bucket's orthogonalisation would be a
        few dozen kernel launches of its own on a GPU.
        """
        factors = [self._first_back(b) for b in self.sending]
        if self.compressing and self.two_rounds and any(factors):
            factors = self._q_round(factors)
        copies = []  # every bucket's uncompressed aggregates, copied in one fused copy
        for bucket in self.sending:
            self._receive_uncompressed(bucket, bucket.received, copies)
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [r for _, r in copies])
        self._decompress(
            {b.index: last for b, last in zip(self.sending, factors) if b.factor_count}
        )

    def _first_back(self, bucket: Bucket) -> list:
        """Wait for the bucket's first round: its factors lead (returned), its uncompressed
        results follow (kept)."""
        first = self.comm.wait(bucket.handles[0])
        bucket.received = first[bucket.factor_count :]
        return first[: bucket.factor_count]

    def _q_round(self, ps: list) -> list:
        """rounds=2: from every bucket's summed P (`ps`, [] for a bucket without factors:
        the same on every rank), P̂ = orth(ΣP) and Q_w = Mᵀ·P̂ of all buckets at once
        (`PowerSGDCompressor.project_all`), every Q in one grouped all-reduce, and while
        it runs e = M − P̂·Q_wᵀ; returns them averaged, bucket by bucket."""
        projected = self.compressor.project_all({b.index: p for b, p in zip(self.sending, ps) if p})
        qs = [projected.get(b.index, []) for b in self.sending]
        handle = self.comm.allreduce_async([t for q in qs for t in q], "q")
        self.compressor.update_error()  # while the Q round runs (it reads this worker's Q_w)
        averaged = iter(self.comm.wait(handle))
        return [[next(averaged) for _ in q] for q in qs]

    def reset(self) -> None:
        """Forget the step in progress (after it, or when the optimizer loads a state)."""
        self.launched, self.done, self.in_step = [], set(), False
        for bucket in self.buckets:
            bucket.clear()

    def _launch(self, bucket: Bucket) -> None:
        """The bucket's first (rounds=1: only) round: its factors and uncompressed gradients.

        Called from the hook of the bucket's last gradient, so it leaves while
        backward still runs for the layers before.
        """
        for p in bucket.dense:
            if p.grad is None:
                # Unused on this rank; another rank may have a gradient, so send zeros.
                p.grad = torch.zeros_like(p)
        if self.compressing and bucket.compressed:  # M = grad + e; the factor it sends
            grads = {name: p.grad for name, p in zip(bucket.names, bucket.compressed)}
            notes = None  # rounds=1: the factors' norms, before they are summed in place
            if self.monitor is not None and not self.two_rounds:
                notes = partial(self.monitor.residuals, bucket.index)
            self.compressor.compress_bucket(bucket.index, grads, notes)
        # Warm-up steps, and buckets that rank="auto" sends plain, are plain Horovod
        # (the user's compression); compressed steps send everything else in
        # comm_dtype (where one is set), the uncompressed gradients included.
        plain = bucket.uncompressed if self.compressing else bucket.dense
        comm_dtype = self.comm_dtype if self.compressing and not bucket.plain else None
        bucket.sent = plain
        bucket.packed = self.comm.pack([p.grad for p in plain], comm_dtype)
        factors = self.compressor.send_buffers(bucket.index) if self.compressing else []
        bucket.factor_count = len(factors)
        tensors = factors + bucket.packed.tensors
        bucket.handles = [self.comm.allreduce_async(tensors, f"b{bucket.index}.r1")]
        self.launched.append(bucket)

    def _receive_uncompressed(self, bucket: Bucket, outputs, copies) -> None:
        """Write the bucket's aggregated uncompressed gradients into `p.grad`.

        Into the gradient as it is now, like Horovod: code that assigned a new
        tensor to `p.grad` after backward (e.g. a clamp) gets the result there.
        """
        grads = bucket.packed.write(outputs, [p.grad for p in bucket.sent], copies)
        for p, grad in zip(bucket.sent, grads):
            p.grad = grad  # itself, or a new tensor where it was None

    def _decompress(self, factors: dict) -> None:
        """The compressed gradients of the buckets of `factors` (bucket -> its averaged
        factors), all at once, written into `p.grad` as it is now."""
        if not factors:
            return
        compressed = [p for b in self.sending if b.index in factors for p in b.compressed]
        out = {self.names[p]: p.grad for p in compressed if p.grad is not None}
        if self.monitor is not None:  # every local gradient's norm, in one fused op
            self.monitor.gradients(list(out), list(out.values()))
        grads = self.compressor.decompress_all(factors, out=out)
        for p in compressed:
            if p.grad is None:
                p.grad = grads[self.names[p]]
