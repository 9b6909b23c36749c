"""The PowerSGD math on local tensors: no communication, testable in one process.

`PowerSGDCompressor` owns, for every compressed parameter, an n x m matrix view
of its gradient plus error (M), a rank-r P (n x r) and Q (m x r), and the
memories that warm-start the next step. All of it is allocated once:

* matrices of the same shape, dtype and device in one *bucket* form a *group*;
  their M, P, Q and memories are stacked (k, n, m) / (k, n, r) / (k, m, r)
  tensors, so every power-iteration half is one batched matmul per group;
* a bucket is the caller's unit of communication (layers whose gradients are
  ready at about the same time in the backward pass). The P and Q of all its
  groups are views into one flat buffer each, so each of its messages is one
  collective.

Two schedules (`PowerSGDConfig.rounds`). One step, as the caller drives it
(W workers; "sum" is an all-reduce the caller performs between the calls; every
call but begin_step/end_step can be made per bucket, as its gradients arrive):

rounds=2, the paper's step (P, then Q):

    begin_step()                  # Q̂ = orth(Q memory)  (or a fresh draw)
    compress(param, grad)         # 1-2. M = grad + e;  P = M·Q̂            (per layer)
    send_buffers()                # 3.   -> caller sums all P
    project(p_sums)               # 4-5. P̂ = orth(P);  Q_w = Mᵀ·P̂         -> caller averages Q
    update_error()                # 6b.  e = M − P̂·Q_wᵀ (overlaps the Q collective)
    decompress(q_avgs)            # 6a.  grad = P̂·Q_avgᵀ;  Q memory = Q_avg
    end_step()

rounds=1, alternating (the authors' current code): even steps send only Q,
odd steps only P, so every message depends only on its layer's gradient and
on state from before the step:

    begin_step()                  # even: P̂ = orth(P memory); odd: Q̂ = orth(Q memory)
    compress(param, grad)         # M = grad + e; even: Q_w = Mᵀ·P̂, e = M − P̂·Q_wᵀ
                                  #               odd:  P_w = M·Q̂,  e = M − P_w·Q̂ᵀ
    send_buffers()                # -> caller averages them (the step's only round)
    decompress(avgs)              # even: grad = P̂·Q_avgᵀ, Q memory = Q_avg
                                  # odd:  grad = P_avg·Q̂ᵀ, P memory = P_avg
    end_step()

Either way the factor that is sent is computed against an orthonormal partner,
so it has the gradient's scale (float16 on the wire keeps it), and the sum over
workers of the error buffers is the sum of what was not delivered. At full
rank (r = min(n, m)) rounds=1 always sends the factor whose partner is square,
so the step stays exact.

Non-finite gradients (an AMP overflow step) make the summed factor non-finite
on every rank alike; for those matrices the error buffer is reset to zero and
the memories keep their last finite value, so later steps never see NaN/Inf.
The decompressed gradient is left non-finite so that `GradScaler` skips the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .config import PowerSGDConfig


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(n, m) of the matrix view of a tensor: first dimension by all the others.

    A conv weight (out, in, kh, kw) becomes (out, in·kh·kw).
    """
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return n, m


def orthogonalize_(matrices: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of a (k, n, r) batch, in place.

    Modified Gram-Schmidt with re-orthogonalisation, batched over k: every
    matrix is normalised by its own column norms (never one norm for the whole
    batch). A column that is zero, or numerically dependent on the columns
    before it, becomes zero instead of NaN or noise, so P̂·P̂ᵀ is always an
    orthogonal projection.

    Example:
        >>> p = torch.randn(3, 10, 2)
        >>> q = orthogonalize_(p)
        >>> torch.allclose(q.transpose(1, 2) @ q, torch.eye(2).expand(3, 2, 2), atol=1e-5)
        True
    """
    finfo = torch.finfo(matrices.dtype)
    # The result does not depend on the columns' scale, but their norms do: in
    # float32 a column of entries near 1e19 (a gradient under a huge loss
    # scale) has an infinite norm, one near 1e-20 a zero norm. Dividing each
    # column by its largest entry first keeps every norm between 1 and sqrt(n).
    peak = matrices.abs().amax(dim=1, keepdim=True)  # (k, 1, r)
    usable = (peak > 0) & torch.isfinite(peak)
    matrices.div_(torch.where(usable, peak, torch.ones_like(peak)))
    # A column left with less than this fraction of its norm after removing the
    # columns before it is rounding noise, not a new direction: it counts as
    # zero. (Normalising it would add a spurious, non-orthogonal direction;
    # with exact-zero rows in P it cannot even be made orthogonal.)
    relative_floor = 1000 * finfo.eps
    initial = torch.linalg.vector_norm(matrices, dim=1, keepdim=True)  # (k, 1, r)
    rank = matrices.shape[-1]
    for i in range(rank):
        col = matrices[:, :, i : i + 1]
        if i > 0:
            # Second projection against the columns before ("twice is enough"):
            # one pass leaves the remainder of a nearly dependent column
            # pointing partly along them.
            done = matrices[:, :, :i]
            col.sub_(done @ (done.transpose(1, 2) @ col))
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        alive = (norm > finfo.tiny) & (norm > relative_floor * initial[:, :, i : i + 1])
        # where() instead of a clamp: a zero column must give zeros, never NaN/Inf.
        col.mul_(torch.where(alive, norm.reciprocal(), torch.zeros_like(norm)))
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest.sub_(col @ (col.transpose(1, 2) @ rest))
    return matrices


# What P and Q of one matrix may reach on a float16 wire, summed over workers:
# 2^10 leaves 64x headroom below float16's largest number (65504) for a gradient
# that grows between steps, and 2^24 below it before float16 goes subnormal.
_WIRE_TARGET = 2.0**10


def _wire_scale(bound: torch.Tensor, workers: int) -> torch.Tensor:
    """The power of two that brings numbers up to `bound` to about 2^10 / workers.

    Powers of two scale exactly, and the scale only needs `bound`, computed
    from state identical on every rank, so every rank picks the same scale
    without a collective. Where `bound` is 0 or not finite the scale is 1.
    """
    exponent = torch.floor(torch.log2(_WIRE_TARGET / workers / bound)).clamp_(-60, 60)
    usable = torch.isfinite(exponent) & (bound > 0)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(bound))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype PowerSGD state and math use for parameters of `dtype`.

    16-bit parameters get float32 state: the error buffer accumulates small
    residuals that bfloat16 would round away, and Gram-Schmidt needs the range.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class _Group:
    """Compressed matrices of one shape (n, m), rank r, dtype and device, in one bucket."""

    n: int
    m: int
    rank: int
    names: list[str] = field(default_factory=list)
    # rounds=1: the factor sent on even and on odd steps. Alternating, except
    # at full rank, where the factor whose orthonormal partner is square goes
    # every step (P̂·P̂ᵀ = I, or Q̂·Q̂ᵀ = I, makes that step exact).
    sends: tuple[str, str] = ("q", "p")
    # Filled in by _Bucket.allocate(). P and Q are stored transposed, (k, r, n)
    # and (k, r, m): then both power-iteration halves read M row by row
    # (Pᵀ = Qᵀ·Mᵀ and Qᵀ = P̂ᵀ·M), which on the CPU is 2-3x faster than
    # Mᵀ·P̂ with its strided reads of M.
    matrices: torch.Tensor | None = None  # (k, n, m): M during a step, error buffer between steps
    pt: torch.Tensor | None = None  # (k, r, n): P (rounds=2: P, then P̂; rounds=1: P_w)
    qt_local: torch.Tensor | None = None  # (k, r, m): this worker's Q_wᵀ = P̂ᵀ·M
    qt_memory: torch.Tensor | None = None  # (k, r, m): warm start, identical on every rank
    pt_memory: torch.Tensor | None = None  # (k, r, n): rounds=1 only, like qt_memory
    pt_comm: torch.Tensor | None = None  # (k, r, n) view into the bucket's P comm buffer
    qt_comm: torch.Tensor | None = None  # (k, r, m) view into the bucket's Q comm buffer
    p_offset: int = 0  # where this group's P and Q start in the flat buffers
    q_offset: int = 0
    first: int = 0  # index of its first matrix among the bucket's (groups in order)
    # float16 on the wire only: P and Q leave multiplied by these powers of two
    # (k, 1, 1), so that they sit well inside float16's range (see `_wire_scale`).
    p_scale: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def p(self) -> torch.Tensor:
        """(k, n, r) view of P."""
        return self.pt.transpose(1, 2)

    @property
    def q_local(self) -> torch.Tensor:
        """(k, m, r) view of this worker's Q_w."""
        return self.qt_local.transpose(1, 2)

    @property
    def q_memory(self) -> torch.Tensor:
        """(k, m, r) view of the Q memory."""
        return self.qt_memory.transpose(1, 2)

    @property
    def p_memory(self) -> torch.Tensor:
        """(k, n, r) view of the P memory (rounds=1)."""
        return self.pt_memory.transpose(1, 2)


class _Padded:
    """Same-side factors of several groups, orthogonalised as one zero-padded batch.

    `orthogonalize_` costs about 40 small operations per call, whatever the
    batch: called once per shape, it dominated the step of a model with
    hundreds of shapes (issue 23), and on an accelerator each is a kernel
    launch. Zero rows and zero columns change neither the norms nor the
    projections of the real ones, and `orthogonalize_` keeps a zero column
    zero, so each matrix comes out as it would alone (up to rounding, which is
    the same on every rank). A batch holds groups at most twice as long as its
    shortest, so padding at most doubles that work. Factors move between the
    bucket's flat buffers and the batch with one indexed copy each way; a
    batch of one group works on the flat buffer's view, without copies.

    Tensors are in the groups' transposed layout, (k, r, x); `side` "p" pads
    P-shaped factors (x = n, flat buffers in P's layout), "q" Q-shaped ones
    (x = m, Q's layout).
    """

    def __init__(self, groups: list[_Group], side: str, dtype, device, draws: bool):
        self.groups = groups
        self.side = side
        lengths = [g.n if side == "p" else g.m for g in groups]
        offsets = [g.p_offset if side == "p" else g.q_offset for g in groups]
        self.spans = []  # (first matrix, end) of each group in the batch
        for g in groups:
            start = self.spans[-1][1] if self.spans else 0
            self.spans.append((start, start + g.count))
        self.single = (offsets[0], groups[0].count, groups[0].rank, lengths[0])
        self.rows = self.draw = None
        if len(groups) == 1:
            return
        count, rank, length = self.spans[-1][1], max(g.rank for g in groups), max(lengths)
        self.rows = torch.zeros(count, rank, length, dtype=dtype, device=device)
        if draws:
            self.draw = torch.zeros_like(self.rows)
        src, dst = [], []
        for g, (a, _), x, offset in zip(groups, self.spans, lengths, offsets):
            src.append(offset + torch.arange(g.count * g.rank * x))
            i = torch.arange(a, a + g.count).view(-1, 1, 1)
            j = torch.arange(g.rank).view(1, -1, 1)
            place = (i * rank + j) * length + torch.arange(x).view(1, 1, -1)
            dst.append(place.reshape(-1))
        self.src = torch.cat(src).to(device)  # element of the flat buffer ...
        self.dst = torch.cat(dst).to(device)  # ... and its place in the batch

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        offset, count, rank, length = self.single
        return flat[offset : offset + count * rank * length].view(count, rank, length)

    def gather(self, flat: torch.Tensor, draw_flat: torch.Tensor | None = None):
        """(batch, draws' batch): the groups' factors of `flat` (and `draw_flat`), padded."""
        if self.rows is None:
            return self._view(flat), (None if draw_flat is None else self._view(draw_flat))
        # Zero first: a non-finite matrix leaves NaN in its padding, which
        # must not reach the next step's norms.
        self.rows.zero_()
        self.rows.view(-1).index_copy_(0, self.dst, flat.index_select(0, self.src))
        if draw_flat is not None:
            self.draw.view(-1).index_copy_(0, self.dst, draw_flat.index_select(0, self.src))
        return self.rows, self.draw

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy the batch's results back into `flat`."""
        if self.rows is not None:
            flat.index_copy_(0, self.src, self.rows.view(-1).index_select(0, self.dst))

    def split(self, per_matrix):
        """A (K, 1, 1) tensor of the batch as per-group (k, 1, 1) views (None: Nones)."""
        return [None if per_matrix is None else per_matrix[a:b] for a, b in self.spans]


def _padded_batches(groups, side: str, dtype, device, draws: bool) -> list[_Padded]:
    """`groups` by length (n for side "p", m for "q"), cut where a length doubles."""
    length = (lambda g: g.n) if side == "p" else (lambda g: g.m)
    batches, current = [], []
    for g in sorted(groups, key=length):  # stable: the same batches on every rank
        if current and length(g) > 2 * length(current[0]):
            batches.append(current)
            current = []
        current.append(g)
    if current:
        batches.append(current)
    return [_Padded(b, side, dtype, device, draws) for b in batches]


class _Bucket:
    """The groups of one caller's bucket, device and compute dtype: one flat P and Q buffer."""

    def __init__(self, index, device, dtype, comm_dtype, seed: int, rounds: int):
        self.index = index
        self.device = device
        self.dtype = dtype
        self.comm_dtype = comm_dtype or dtype
        self.rounds = rounds
        # Scaling buys range only where the wire is narrower than the math.
        self.scaled = self.comm_dtype == torch.float16 and dtype != torch.float16
        self.groups: OrderedDict[tuple[int, int, int], _Group] = OrderedDict()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.sent: list[str] = []  # rounds=1: "p"/"q", what send_buffers() returned

    def _matrix_ids(self, order, sizes) -> torch.Tensor:
        parts = [
            torch.arange(g.first, g.first + g.count).repeat_interleave(size // g.count)
            for g, size in zip(order, sizes)
        ]
        return torch.cat(parts).to(self.device) if parts else torch.zeros(0, dtype=torch.long)

    def finite_matrices(self, parts) -> torch.Tensor:
        """(K,) bool: whether every element of each matrix in `parts` is finite.

        `parts`: (flat tensor, its matrix ids) pairs; a tensor may be a prefix
        of a flat buffer. Matrices in none of them count as finite.
        """
        if self.device.type == "cpu" and all(bool(torch.isfinite(t).all()) for t, _ in parts):
            # The usual case, seen from the host at no cost on the CPU.
            return self.all_finite
        bad = torch.zeros(self.matrix_count, dtype=torch.int32, device=self.device)
        for tensor, ids in parts:
            bad.index_add_(0, ids[: tensor.numel()], (~torch.isfinite(tensor)).to(torch.int32))
        return bad == 0

    def drop_non_finite_error(self, finite: torch.Tensor) -> None:
        """Zero the error buffers of the matrices whose flag in `finite` (K,) is False."""
        # On the CPU a host-side look at the flags costs nothing and saves a
        # pass over every error buffer; on an accelerator it would stall the
        # stream, so there the fill runs unconditionally.
        if self.device.type == "cpu" and bool(finite.all()):
            return
        for g in self.groups.values():
            g.matrices.masked_fill_(~finite[g.first : g.first + g.count].view(-1, 1, 1), 0)

    def allocate(self):
        groups = list(self.groups.values())

        def flat(sizes, dtype):
            return torch.zeros(sum(sizes), dtype=dtype, device=self.device)

        # rounds=1 sends a prefix of each flat buffer, so each buffer orders its
        # groups by how often they send it: P holds the groups that always send
        # P first, then the alternating ones, then those that never send P
        # (always Q); the Q buffer the other way round. (A stable sort keeps
        # the groups' order within each kind, the same on every rank.)
        sends_p = {("p", "p"): 0, ("q", "p"): 1, ("q", "q"): 2}
        p_order = sorted(groups, key=lambda g: sends_p[g.sends])
        q_order = sorted(groups, key=lambda g: 2 - sends_p[g.sends])
        p_sizes = [g.count * g.n * g.rank for g in p_order]
        q_sizes = [g.count * g.m * g.rank for g in q_order]
        self.p = flat(p_sizes, self.dtype)
        self.q_local = flat(q_sizes, self.dtype)
        self.q_memory = flat(q_sizes, self.dtype)
        self.p_memory = flat(p_sizes, self.dtype) if self.rounds == 1 else None
        # P is summed in place, so it may share storage with its compute copy;
        # Q_w must survive its collective (the error update needs it): own buffer.
        separate = self.comm_dtype != self.dtype
        self.p_comm = flat(p_sizes, self.comm_dtype) if separate else self.p
        self.q_comm = flat(q_sizes, self.comm_dtype)
        offset = 0
        for g, size in zip(p_order, p_sizes):
            g.p_offset = offset
            g.pt = self.p[offset : offset + size].view(g.count, g.rank, g.n)
            g.pt_comm = self.p_comm[offset : offset + size].view(g.count, g.rank, g.n)
            if self.p_memory is not None:
                g.pt_memory = self.p_memory[offset : offset + size].view(g.count, g.rank, g.n)
            offset += size
        offset = 0
        for g, size in zip(q_order, q_sizes):
            g.q_offset = offset
            g.qt_local = self.q_local[offset : offset + size].view(g.count, g.rank, g.m)
            g.qt_memory = self.q_memory[offset : offset + size].view(g.count, g.rank, g.m)
            g.qt_comm = self.q_comm[offset : offset + size].view(g.count, g.rank, g.m)
            offset += size
        first = 0
        for g in groups:
            g.matrices = torch.zeros(g.count, g.n, g.m, dtype=self.dtype, device=self.device)
            g.first = first
            first += g.count
        # Which matrix each element of the flat buffers belongs to: per-matrix
        # flags (finite or not) for the whole bucket come from one indexed sum.
        self.matrix_count = first
        self.p_matrix = self._matrix_ids(p_order, p_sizes)
        self.q_matrix = self._matrix_ids(q_order, q_sizes)
        self.all_finite = torch.ones(first, dtype=torch.bool, device=self.device)
        self.p_finite = self.all_finite  # rounds=2: per matrix, the summed P of this step
        # How much of each buffer a rounds=1 step sends, by step parity.
        self.p_sent = [
            sum(s for g, s in zip(p_order, p_sizes) if g.sends[phase] == "p") for phase in (0, 1)
        ]
        self.q_sent = [
            sum(s for g, s in zip(q_order, q_sizes) if g.sends[phase] == "q") for phase in (0, 1)
        ]
        self.q_memory.normal_(generator=self.generator)
        if self.p_memory is not None:
            self.p_memory.normal_(generator=self.generator)
        # What is orthogonalised together (built last: it needs the offsets):
        # per step parity, the partners
        # (rounds=2: every Q̂; rounds=1: P̂ for groups sending Q, Q̂ for those
        # sending P), and (rounds=2) the summed P of every group.
        args = (self.dtype, self.device)
        if self.rounds == 2:
            partners = _padded_batches(groups, "q", *args, draws=True)
            self.partner_batches = [partners, partners]
            self.project_batches = _padded_batches(groups, "p", *args, draws=False)
        else:
            self.partner_batches = [
                _padded_batches([g for g in groups if g.sends[phase] == "q"], "p", *args, True)
                + _padded_batches([g for g in groups if g.sends[phase] == "p"], "q", *args, True)
                for phase in (0, 1)
            ]
            self.project_batches = []


class PowerSGDCompressor:
    """Rank-r PowerSGD compression with warm start and error feedback, local part.

    Args:
        named_tensors: (name, tensor) pairs whose gradients may be compressed;
            the tensor fixes shape, dtype and device.
        config: the PowerSGDConfig; `rank`, `rounds`, `min_compression_rate`,
            `error_feedback`, `warm_start`, `seed` and `comm_dtype` apply here.
        bucket_of: name -> the caller's bucket (any hashable); every call that
            takes `bucket=` then works on that bucket alone. Default: one bucket.

    Memory added per compressed parameter of n x m elements (compute dtype):
    n·m for M/error buffer, plus 3·r·(n+m) for P, Q_w, Q memory (rounds=1: and
    the P memory), plus the comm_dtype copies when it differs.

    Example:
        >>> w = torch.zeros(64, 32)
        >>> c = PowerSGDCompressor([("w", w)], PowerSGDConfig(rank=2))
        >>> c.compressed_names
        ['w']
        >>> c.begin_step(); c.compress("w", torch.randn(64, 32))
        >>> q = c.project(c.send_buffers())  # one worker: the "sum" is the tensor itself
        >>> c.update_error(); c.decompress(q)["w"].shape
        torch.Size([64, 32])
        >>> c.end_step()
    """

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        config: PowerSGDConfig,
        bucket_of: Mapping[str, object] | None = None,
    ):
        self.config = config
        self.buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._where: dict[str, tuple[_Group, int]] = {}
        self._shapes: dict[str, torch.Size] = {}
        for name, tensor in named_tensors:
            if not config.compresses(tensor.shape):
                continue
            n, m = matrix_shape(tensor.shape)
            dtype = compute_dtype(tensor.dtype)
            index = None if bucket_of is None else bucket_of[name]
            key = (index, tensor.device, dtype)
            if key not in self.buckets:
                # Seed per bucket so that buckets draw independent, rank-identical streams.
                seed = config.seed + len(self.buckets)
                self.buckets[key] = _Bucket(
                    index, tensor.device, dtype, config.comm_dtype, seed, config.rounds
                )
            bucket = self.buckets[key]
            r = config.matrix_rank(n, m)
            group = bucket.groups.setdefault((n, m, r), _Group(n, m, r))
            if r == n:
                group.sends = ("q", "q")  # P̂ is n x n: P̂·P̂ᵀ·M = M
            elif r == m:
                group.sends = ("p", "p")  # Q̂ is m x m: M·Q̂·Q̂ᵀ = M
            self._where[name] = (group, group.count)
            self._shapes[name] = tensor.shape
            group.names.append(name)
        for bucket in self.buckets.values():
            bucket.allocate()
        self.workers = 1
        self.steps = 0  # compressed steps completed (end_step() counts them)

    # --- structure ----------------------------------------------------------------
    @property
    def compressed_names(self) -> list[str]:
        return list(self._where)

    def is_compressed(self, name: str) -> bool:
        return name in self._where

    def _groups(self):
        for bucket in self.buckets.values():
            yield from bucket.groups.values()

    def _select(self, bucket) -> list[_Bucket]:
        """The buckets a call works on: all, or those of the caller's bucket `bucket`."""
        if bucket is None:
            return list(self.buckets.values())
        return [b for b in self.buckets.values() if b.index == bucket]

    def elements_per_step(self) -> tuple[int, int]:
        """(elements of P, elements of Q) of all matrices, over all buckets."""
        p = sum(b.p_comm.numel() for b in self.buckets.values())
        q = sum(b.q_comm.numel() for b in self.buckets.values())
        return p, q

    def bytes_per_step(self) -> int:
        """Bytes of P plus Q of all matrices, at the dtype they travel in."""
        return sum(
            (b.p_comm.numel() + b.q_comm.numel()) * b.p_comm.element_size()
            for b in self.buckets.values()
        )

    @property
    def phase(self) -> int:
        """rounds=1: 0 on steps that send Q (of alternating matrices), 1 on those that send P."""
        return self.steps % 2

    # --- one step -----------------------------------------------------------------
    def begin_step(self, workers: int = 1) -> None:
        """Prepare this step's orthonormal partners: from memory (warm start) or fresh.

        rounds=2: Q̂ = orth(Q memory). rounds=1: the partner of the factor each
        matrix sends this step (P̂ = orth(P memory) or Q̂ = orth(Q memory)).
        A memory column that is all zero (its layer's M was zero everywhere,
        e.g. a frozen or unused layer) would stay zero forever; such columns
        are redrawn. The draw is made every step, on every rank alike, so
        generators stay in step; it costs r·(n+m) numbers per layer, small next
        to the n·m of the gradient.

        Args:
            workers: how many workers sum P and Q (sets the float16 wire scale).
        """
        self.workers = workers
        for bucket in self.buckets.values():
            # q_local (and, for rounds=1, p) are free until used: scratch for the draws.
            bucket.q_local.normal_(generator=bucket.generator)
            if bucket.rounds == 1:
                bucket.p.normal_(generator=bucket.generator)
            for g in bucket.groups.values():
                g.p_scale = g.q_scale = None
            for batch in bucket.partner_batches[self.phase]:
                # A Q̂ partner goes with a P that is sent, and the other way round.
                if batch.side == "q":
                    memory, draw = bucket.q_memory, bucket.q_local
                else:
                    memory, draw = bucket.p_memory, bucket.p
                scales = batch.split(self._partner(bucket, batch, memory, draw))
                for g, scale in zip(batch.groups, scales):
                    if bucket.rounds == 1 and g.sends[0] == g.sends[1]:
                        scale = None  # its partner was never averaged: a random draw
                    if batch.side == "q":
                        g.p_scale = scale
                    else:
                        g.q_scale = scale

    def _partner(self, bucket, batch: _Padded, memory, draw):
        """Orthonormalise the batch's part of the flat `memory` in place; returns its wire scale.

        Memory columns that are all zero take the draw's (from `draw`, same layout).

        P = M·Q̂ against an orthonormal Q̂ has the magnitude of M; the memory
        itself (last step's average of Mᵀ·P̂ or M·Q̂) has the magnitude of M too,
        and its column norms, M's singular values, bound the factor computed
        against it. That bound sets the float16 wire scale ((K, 1, 1) over
        the batch's matrices; None: scale 1).
        """
        rows, draw = batch.gather(memory, draw)
        scale = None
        if not self.config.warm_start:
            rows.copy_(draw)
        else:
            norms = torch.linalg.vector_norm(rows, dim=2, keepdim=True)
            torch.where(norms == 0, draw, rows, out=rows)
            if bucket.scaled and self.steps > 0:  # warm: the memory was averaged last step
                scale = _wire_scale(norms.amax(dim=1, keepdim=True), self.workers)
        orthogonalize_(rows.transpose(1, 2))
        batch.scatter(memory)
        return scale

    def compress(self, name: str, grad: torch.Tensor | None) -> None:
        """This parameter's part of the step that needs only its gradient.

        rounds=2: M = grad (+ error), P = M·Q̂. rounds=1: M = grad (+ error),
        the factor it sends, and the new error. `grad` None counts as a zero
        gradient (a parameter unused this step).
        """
        group, i = self._where[name]
        matrix = group.matrices[i]
        if grad is not None:
            grad = grad.reshape(group.n, group.m)
            if self.config.error_feedback:
                matrix.add_(grad)
            else:
                matrix.copy_(grad)
        elif not self.config.error_feedback:
            matrix.zero_()
        if self.config.rounds == 2 or group.sends[self.phase] == "p":
            torch.mm(group.qt_memory[i], matrix.T, out=group.pt[i])  # Pᵀ = Q̂ᵀ·Mᵀ
            if self.config.rounds == 1 and self.config.error_feedback:
                matrix.addmm_(group.pt[i].T, group.qt_memory[i], alpha=-1)  # e = M − P_w·Q̂ᵀ
        else:
            torch.mm(group.pt_memory[i], matrix, out=group.qt_local[i])  # Q_wᵀ = P̂ᵀ·M
            if self.config.error_feedback:
                matrix.addmm_(group.pt_memory[i].T, group.qt_local[i], alpha=-1)  # e = M − P̂·Q_wᵀ

    def send_buffers(self, bucket=None) -> list[torch.Tensor]:
        """The flat buffers of the step's first (rounds=1: only) round, to sum in place.

        rounds=2: one P buffer per bucket. rounds=1: per bucket, the part of
        the P and/or Q buffer this step sends (empty parts left out).
        """
        out = []
        for b in self._select(bucket):
            for g in b.groups.values():
                sends = "p" if b.rounds == 2 else g.sends[self.phase]
                if sends == "p" and b.p_comm is not b.p:
                    g.pt_comm.copy_(g.pt if g.p_scale is None else g.pt * g.p_scale)
                elif sends == "q":
                    g.qt_comm.copy_(g.qt_local if g.q_scale is None else g.qt_local * g.q_scale)
            if b.rounds == 2:
                out.append(b.p_comm)
                continue
            b.sent = []
            for kind, buffer, size in (
                ("p", b.p_comm, b.p_sent[self.phase]),
                ("q", b.q_comm, b.q_sent[self.phase]),
            ):
                if size:
                    b.sent.append(kind)
                    out.append(buffer[:size])
        return out

    def project(self, p_sums: list[torch.Tensor], bucket=None) -> list[torch.Tensor]:
        """rounds=2, steps 4-5: orthogonalise the summed P, then Q_w = Mᵀ·P̂.

        Args:
            p_sums: the buffers returned by `send_buffers`, now summed (or
                averaged) over workers.
            bucket: the caller's bucket they belong to (None: all).

        Returns:
            The flat Q buffers (one per bucket) for the caller to average in place.
        """
        out = []
        for b, p_sum in zip(self._select(bucket), p_sums):
            if b.p_comm is not b.p:
                b.p.copy_(p_sum)
            b.p_finite = b.finite_matrices([(b.p, b.p_matrix)])
            for batch in b.project_batches:
                rows, _ = batch.gather(b.p)
                norms = None
                if b.scaled:
                    # Column norms of the summed P estimate M's singular values,
                    # which bound Q_w = Mᵀ·P̂ (P's own wire scale divided out).
                    norms = torch.linalg.vector_norm(rows, dim=2, keepdim=True)
                    norms = norms.amax(dim=1, keepdim=True)
                orthogonalize_(rows.transpose(1, 2))
                batch.scatter(b.p)
                for g, g_norms in zip(batch.groups, batch.split(norms)):
                    if b.scaled:
                        if g.p_scale is not None:
                            g_norms = g_norms / g.p_scale
                        g.q_scale = _wire_scale(g_norms, self.workers)
                    torch.bmm(g.pt, g.matrices, out=g.qt_local)  # Q_wᵀ = P̂ᵀ·M
                    if b.scaled:
                        g.qt_comm.copy_(g.qt_local * g.q_scale)
            if not b.scaled:
                b.q_comm.copy_(b.q_local)  # one copy for the whole bucket
            out.append(b.q_comm)
        return out

    def update_error(self, bucket=None) -> None:
        """rounds=2, step 6b: e = M − P̂·Q_wᵀ (what this worker's compression dropped).

        Only needs this worker's Q_w, so it can run while the Q collective is in
        flight. Without error feedback there is nothing to keep. (rounds=1
        keeps the error in `compress`.)
        """
        if not self.config.error_feedback or self.config.rounds == 1:
            return
        for b in self._select(bucket):
            for g in b.groups.values():
                g.matrices.baddbmm_(g.p, g.qt_local, alpha=-1)
            b.drop_non_finite_error(b.p_finite)

    def decompress(
        self, avgs: list[torch.Tensor], out: dict[str, torch.Tensor] | None = None, bucket=None
    ) -> dict[str, torch.Tensor]:
        """The aggregated gradient of every compressed parameter (of `bucket`).

        rounds=2 (step 6a): `avgs` are the Q buffers of `project`, averaged;
        grad = P̂·Q_avgᵀ, and Q_avg becomes the Q memory. rounds=1: `avgs` are
        the buffers of `send_buffers`, averaged; grad = P̂·Q_avgᵀ or P_avg·Q̂ᵀ,
        and the averaged factor becomes its memory. Memories keep their last
        finite value.

        Args:
            avgs: the buffers, now averaged (or summed) over workers.
            out: optional name -> tensor (e.g. the parameters' `.grad`) to write
                the gradients into, saving an allocation per step; names not in
                it get a new tensor.
            bucket: the caller's bucket they belong to (None: all).

        Returns:
            name -> gradient, shaped like the parameter.
        """
        grads: dict[str, torch.Tensor] = {}
        received = iter(avgs)
        for b in self._select(bucket):
            kinds = ["q"] if b.rounds == 2 else b.sent
            # Flat, in the compute dtype (a copy only where the wire's differs).
            factors = {kind: next(received).to(b.dtype) for kind in kinds}
            for g in b.groups.values() if b.scaled else ():
                # float16 wire: divide the powers of two out, exactly
                sends = "q" if b.rounds == 2 else g.sends[self.phase]
                scale = g.q_scale if sends == "q" else g.p_scale
                if scale is not None:
                    self._factor(g, sends, factors[sends]).div_(scale)
            ids = {"p": b.p_matrix, "q": b.q_matrix}
            finite = b.finite_matrices([(factors[k], ids[k]) for k in kinds])
            if b.rounds == 2:
                finite = finite & b.p_finite
            elif self.config.error_feedback:
                b.drop_non_finite_error(finite)
            # The averaged factor becomes its memory where finite; memories
            # keep their last finite value.
            memories = {"p": b.p_memory, "q": b.q_memory}
            for kind, factor in factors.items():
                memory = memories[kind][: factor.numel()]
                torch.where(finite[ids[kind][: factor.numel()]], factor, memory, out=memory)
            # The gradient uses the factor that was sent, finite or not: a
            # non-finite gradient must reach the optimizer (GradScaler skips it).
            for g in b.groups.values():
                sends = "q" if b.rounds == 2 else g.sends[self.phase]
                factor = self._factor(g, sends, factors[sends])
                for i, name in enumerate(g.names):
                    # grad = P̂·Q_avgᵀ or P_avg·Q̂ᵀ, both (n x r)·(r x m)
                    if sends == "q":
                        a, c = (g.pt if b.rounds == 2 else g.pt_memory)[i].T, factor[i]
                    else:
                        a, c = factor[i].T, g.qt_memory[i]
                    grads[name] = self._write(a, c, g, name, None if out is None else out.get(name))
        return grads

    @staticmethod
    def _factor(g: _Group, kind: str, flat: torch.Tensor) -> torch.Tensor:
        """The group's (k, r, x) view of a flat P ("p") or Q ("q") buffer."""
        if kind == "q":
            return flat[g.q_offset : g.q_offset + g.count * g.rank * g.m].view(g.count, g.rank, g.m)
        return flat[g.p_offset : g.p_offset + g.count * g.rank * g.n].view(g.count, g.rank, g.n)

    def _write(self, a, c, g: _Group, name: str, target) -> torch.Tensor:
        """a·c into `target` (or a new tensor), shaped like the parameter."""
        if target is not None and target.is_contiguous() and target.dtype == a.dtype:
            torch.mm(a, c, out=target.view(g.n, g.m))
            return target
        grad = (a @ c).view(self._shapes[name])
        return grad if target is None else target.copy_(grad)

    def end_step(self) -> None:
        """Close the step (rounds=1: the next one sends the other factor)."""
        self.steps += 1

    # --- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's compressor state: error buffers, memories, RNG states, step count.

        Tensors are detached views (like `nn.Module.state_dict`); save them
        before the next step.
        """
        state = {key: {} for key in self._tensor_keys()}
        for name in self._where:
            for key in state:
                state[key][name] = self._state_tensor(key, name).detach()
        state["rng_states"] = [b.generator.get_state() for b in self.buckets.values()]
        state["steps"] = self.steps
        return state

    def _tensor_keys(self) -> tuple[str, ...]:
        memories = ("q_memory", "p_memory") if self.config.rounds == 1 else ("q_memory",)
        return ("error_buffers", *memories)

    def check_state_dict(self, state: dict, tensor_keys=None) -> None:
        """Raise ValueError, naming the cause, if `state` does not fit this model."""
        if not isinstance(state, dict):
            raise ValueError("PowerSGD state must be a dict from state_dict()")
        tensor_keys = self._tensor_keys() if tensor_keys is None else tensor_keys
        # A checkpoint of the other schedule has no P memory: it starts fresh.
        required = [k for k in tensor_keys if k != "p_memory"]
        for key in (*required, "rng_states"):
            if key not in state:
                raise ValueError(
                    f"PowerSGD state has no '{key}': not a horovod_powersgd checkpoint"
                )
        for key in tensor_keys:
            saved = state.get(key)
            if saved is None:
                continue
            if set(saved) != set(self._where):
                missing = sorted(set(self._where) - set(saved))
                extra = sorted(set(saved) - set(self._where))
                raise ValueError(
                    f"PowerSGD checkpoint does not match this model's compressed parameters "
                    f"({key}): missing {missing[:5]}, unexpected {extra[:5]}"
                )
            for name, tensor in saved.items():
                expected = self._state_tensor(key, name)
                if tuple(tensor.shape) != tuple(expected.shape):
                    raise ValueError(
                        f"PowerSGD checkpoint: {key}[{name!r}] has shape {tuple(tensor.shape)}, "
                        f"this model needs {tuple(expected.shape)} (a different model or rank?)"
                    )
        if len(state["rng_states"]) != len(self.buckets):
            raise ValueError(
                f"PowerSGD checkpoint has {len(state['rng_states'])} RNG states, "
                f"this model needs {len(self.buckets)}"
            )

    def _state_tensor(self, key: str, name: str) -> torch.Tensor:
        """The live tensor behind `state_dict()[key][name]`."""
        group, i = self._where[name]
        if key == "error_buffers":
            return group.matrices[i]
        if key == "p_memory":
            return group.p_memory[i]
        return group.q_memory[i]

    def _load(self, state: dict, tensor_keys) -> None:
        """Validate `state` (its `tensor_keys` and RNG states), then copy it in."""
        self.check_state_dict(state, tensor_keys)
        for key in tensor_keys:
            for name, tensor in state.get(key, {}).items():
                self._state_tensor(key, name).copy_(tensor)
        for bucket, rng in zip(self.buckets.values(), state["rng_states"]):
            bucket.generator.set_state(rng.cpu() if hasattr(rng, "cpu") else rng)
        # Checkpoints from before the counter existed: a warm memory if any step ran.
        self.steps = state.get("steps", self.steps)

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; validates everything before changing anything."""
        self._load(state, self._tensor_keys())

    def check_shared_state(self, shared: dict) -> None:
        """Raise ValueError, naming the cause, if `shared` does not fit this model."""
        self.check_state_dict(shared, self._tensor_keys()[1:])

    def load_shared_state(self, shared: dict) -> None:
        """Set the state equal on every rank: `shared_state()` of another worker."""
        self._load(shared, self._tensor_keys()[1:])

    def shared_state(self) -> dict:
        """The part of `state_dict()` that is equal on every rank (all but the errors)."""
        state = self.state_dict()
        del state["error_buffers"]
        return state

    def reset_error(self, names: Iterable[str] | None = None) -> None:
        """Forget the residuals (e.g. after the set of workers changed), or those of `names`."""
        if names is None:
            for g in self._groups():
                g.matrices.zero_()
            return
        for name in names:
            if name in self._where:
                group, i = self._where[name]
                group.matrices[i].zero_()

    # --- statistics (read by monitor.py; nothing here changes the step) -----------------
    def layer_info(self, name: str) -> dict:
        """Parameter shape, matrix shape (n, m), rank and P/Q elements sent per step.

        rounds=1 alternates between r·m and r·n elements (at full rank it sends
        the same factor every step); the value is the mean over two steps.
        """
        group, _ = self._where[name]
        if self.config.rounds == 2:
            per_step = group.rank * (group.n + group.m)
        else:
            sizes = {"p": group.rank * group.n, "q": group.rank * group.m}
            per_step = (sizes[group.sends[0]] + sizes[group.sends[1]]) / 2
        return {
            "shape": tuple(self._shapes[name]),
            "matrix": (group.n, group.m),
            "rank": group.rank,
            "elements_per_step": per_step,
        }

    def step_views(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(error buffer, factor this worker computed) of `name` in the current step.

        The factor is the one computed against an orthonormal partner (rounds=2:
        Q_w = Mᵀ·P̂; rounds=1: Q_w or P_w = M·Q̂), so M − (its product with the
        partner) is the residual and ‖M‖² = ‖residual‖² + ‖factor‖². The buffer
        holds that residual once it is computed (with error feedback), else M.
        Valid for rounds=1 right after `compress(name)` (P is then summed in
        place), for rounds=2 from `update_error` until the next `begin_step`.
        """
        group, i = self._where[name]
        sends = "q" if self.config.rounds == 2 else group.sends[self.phase]
        factor = group.qt_local[i] if sends == "q" else group.pt[i]
        return group.matrices[i], factor
