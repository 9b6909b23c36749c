"""Where PowerSGD's state lives: buffers allocated once, and views into them.

* `ShapeGroup`: the compressed matrices of one shape (n, m) and rank r; their M,
  P, Q and memories are stacked (k, n, m) / (k, r, n) / (k, r, m) tensors, so
  every power-iteration half is one batched matmul per group.
* `Factors`: the groups of one bucket (the unit of communication) that share a
  device and dtype. The P and Q of all its groups are views into one flat
  buffer each, so each of the bucket's messages is one collective.
* `PaddedBatch`: same-side factors of several groups, orthogonalised together.

No math of a step here (that is compressor.py), and no communication.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .linalg import dependence_floor, matrix_shape, method_for

# Device types where reading a tensor on the host costs nothing worth avoiding (no
# stream to stall): there a step may look at a flag instead of computing both ways.
# bench.dispatch empties it to count the ops a step dispatches on an accelerator.
HOST_READS_FREE = {"cpu"}


@dataclass
class ShapeGroup:
    """Compressed matrices of one shape (n, m), rank r, dtype and device, in one bucket."""

    n: int
    m: int
    rank: int
    names: list[str] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)  # of the parameters, by name
    # rounds=1: the factor sent on even and on odd steps. Alternating, except
    # at full rank, where the factor whose orthonormal partner is square goes
    # every step (P̂·P̂ᵀ = I, or Q̂·Q̂ᵀ = I, makes that step exact).
    sends: tuple[str, str] = ("q", "p")
    # Filled in by Factors.allocate(). P and Q are stored transposed, (k, r, n)
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
    # (k, 1, 1), so that they sit well inside float16's range (linalg.wire_scale).
    p_scale: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None
    # Where rounds=2's Q scales are written each step (allocated once; the partners'
    # are views of their batch's `PaddedBatch.scales`): a captured graph reads them
    # where they were (graphs.py).
    q_scales: torch.Tensor | None = None
    # Per-matrix views of the buffers above, made once (`cache_views`): taking
    # `matrices[i]` or a transpose is itself an operation, and on a GPU each
    # operation is a kernel launch or more; a step should not pay for them per
    # matrix. By buffer name: "matrices", "matrices_t" (m x n), "pt", "p" (n x r),
    # "qt_local", "qt_memory", "pt_memory", "p_memory" (n x r), "shaped" (as the parameter).
    rows: dict = field(default_factory=dict)

    def cache_views(self) -> None:
        """Make the per-matrix views (after the buffers are allocated)."""
        rows = {
            "matrices": self.matrices.unbind(0),
            "pt": self.pt.unbind(0),
            "qt_local": self.qt_local.unbind(0),
            "qt_memory": self.qt_memory.unbind(0),
        }
        rows["matrices_t"] = [m.T for m in rows["matrices"]]
        rows["shaped"] = [m.view(shape) for m, shape in zip(rows["matrices"], self.shapes)]
        rows["p"] = [x.T for x in rows["pt"]]
        if self.pt_memory is not None:
            rows["pt_memory"] = self.pt_memory.unbind(0)
            rows["p_memory"] = [x.T for x in rows["pt_memory"]]
        self.rows = rows
        self.p_batch = self.pt.transpose(1, 2)  # (k, n, r), for the batched error update

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

    def factor(self, kind: str, flat: torch.Tensor) -> torch.Tensor:
        """This group's (k, r, x) view of a flat P ("p") or Q ("q") buffer."""
        offset, length = (self.q_offset, self.m) if kind == "q" else (self.p_offset, self.n)
        size = self.count * self.rank * length
        return flat[offset : offset + size].view(self.count, self.rank, length)

    def factor_rows(self, kind: str, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per matrix, P_avg (n x r, kind "p") or Q_avgᵀ (r x m, "q") of a flat buffer.

        The buffers a step receives are the bucket's own, summed in place, so
        the same from step to step: their views are kept for the same `flat`.
        """
        kept = self.rows.get(kind + "_received")
        if kept is None or kept[0] is not flat:
            kept = self.rows[kind + "_received"] = (flat, self._factor_rows(kind, flat))
        return kept[1]

    def _factor_rows(self, kind: str, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = self.factor(kind, flat).unbind(0)
        return rows if kind == "q" else tuple(row.T for row in rows)


class PaddedBatch:
    """Same-side factors of several groups, orthogonalised as one zero-padded batch.

    `orthogonalize_` costs about 40 small operations per call, whatever the
    batch: called once per shape, it dominated the step of a model with
    hundreds of shapes, and on an accelerator each is a kernel launch. Zero
    rows and zero columns change neither the norms nor the projections of the
    real ones, and `orthogonalize_` keeps a zero column zero, so each matrix
    comes out as it would alone (up to rounding, which is the same on every
    rank). A batch holds groups at most twice as long as its shortest, so
    padding at most doubles that work. Factors move between the `Concatenation`
    the batch belongs to and the batch with one indexed read in (the padding
    reads the zero that ends it) and one indexed copy out; a batch of one group
    works on a view of the concatenation, without copies.

    Tensors are in the groups' transposed layout, (k, r, x); `side` "p" pads
    P-shaped factors (x = n, flat buffers in P's layout), "q" Q-shaped ones
    (x = m, Q's layout). `shifts`: per group, where its bucket's flat buffer
    starts in the concatenation.
    """

    def __init__(self, groups: list[ShapeGroup], side: str, joined, draws: bool, shifts):
        self.groups, self.side, self.joined = groups, side, joined
        lengths = [g.n if side == "p" else g.m for g in groups]
        offsets = [s + (g.p_offset if side == "p" else g.q_offset) for g, s in zip(groups, shifts)]
        self.spans = []  # (first matrix, end) of each group in the batch
        for g in groups:
            start = self.spans[-1][1] if self.spans else 0
            self.spans.append((start, start + g.count))
        # orthogonalize_'s floor: lower for matrices at full rank (one per matrix
        # where the batch mixes them).
        buffer = joined.buffer
        full = [g.rank == min(g.n, g.m) for g in groups for _ in range(g.count)]
        self.floor = dependence_floor(
            buffer.dtype,
            full[0] if len(set(full)) == 1 else torch.tensor(full, device=buffer.device),
        )
        # float16 wire: the scales of the factors sent against these partners, per matrix
        # (k, 1, 1), written in place each step (`wire_scale(out=)`).
        self.scales = joined.buffer.new_ones(self.spans[-1][1], 1, 1)
        self.index = None  # where each of the batch's elements is read (none: a view)
        if len(groups) == 1:
            g, offset, length = groups[0], offsets[0], lengths[0]
            shape, end = (g.count, g.rank, length), offset + g.count * g.rank * length
            self.rows = buffer[offset:end].view(shape)
            self.draw = joined.draw[offset:end].view(shape) if draws else None
            return
        count, rank, length = self.spans[-1][1], max(g.rank for g in groups), max(lengths)
        self.rows = buffer.new_zeros(count, rank, length)
        self.draw = torch.zeros_like(self.rows) if draws else None
        src, dst = [], []
        for g, (a, _), x, offset in zip(groups, self.spans, lengths, offsets):
            src.append(offset + torch.arange(g.count * g.rank * x))
            i = torch.arange(a, a + g.count).view(-1, 1, 1)
            j = torch.arange(g.rank).view(1, -1, 1)
            place = (i * rank + j) * length + torch.arange(x).view(1, 1, -1)
            dst.append(place.reshape(-1))
        # Elements of the concatenation, and their places in the batch.
        src, dst = torch.cat(src), torch.cat(dst)
        index = torch.full((self.rows.numel(),), joined.zero, dtype=torch.long)
        index[dst] = src
        self.src, self.dst, self.index = (t.to(buffer.device) for t in (src, dst, index))

    def gather(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(batch, draws' batch): the groups' factors (and draws) of the concatenation, padded."""
        if self.index is not None:
            torch.index_select(self.joined.buffer, 0, self.index, out=self.rows.view(-1))
            if self.draw is not None:
                torch.index_select(self.joined.draw, 0, self.index, out=self.draw.view(-1))
        return self.rows, self.draw

    def scatter(self) -> None:
        """Copy the batch's results back into the concatenation."""
        if self.index is not None:
            rows = self.rows.view(-1).index_select(0, self.dst)
            self.joined.buffer.index_copy_(0, self.src, rows)

    def split(self, per_matrix):
        """A (K, 1, 1) tensor of the batch as per-group (k, 1, 1) views (None: Nones)."""
        return [None if per_matrix is None else per_matrix[a:b] for a, b in self.spans]


class Concatenation:
    """One side's factors of one or several buckets, orthogonalised in padded batches.

    The buckets' flat buffers of that kind (`flats`, and their draws' `draws`) are
    copied into one flat tensor that ends in a zero (`open`), each batch reads from
    and writes to it, and the results go back (`close`): a few launches a step on a
    GPU, whatever the buckets, in place of indexed copies per bucket and batch.
    `groups`: per bucket, the groups to orthogonalise (`padded_batches` batches them).
    """

    def __init__(self, flats: list, draws: list | None, groups: list[list], side: str):
        self.flats, self.draws, self.groups, self.side = flats, draws, groups, side
        self.sizes = [f.numel() for f in flats]
        self.shifts = [sum(self.sizes[:i]) for i in range(len(flats))]
        self.zero = sum(self.sizes)
        self.buffer = flats[0].new_zeros(self.zero + 1)
        self.draw = None if draws is None else torch.zeros_like(self.buffer)
        self.parts = list(self.buffer[: self.zero].split(self.sizes))
        shifted = [(g, shift) for gs, shift in zip(groups, self.shifts) for g in gs]
        self.batches = padded_batches(shifted, side, self, draws is not None)

    def open(self) -> None:
        """Copy the buckets' buffers (and draws) in."""
        torch.cat(self.flats, out=self.buffer[: self.zero])
        if self.draws is not None:
            torch.cat(self.draws, out=self.draw[: self.zero])

    def close(self) -> None:
        """Copy the results back into the buckets' buffers."""
        torch._foreach_copy_(self.flats, self.parts)


# CholeskyQR's batch of up to this many elements (padding included) is not cut: its
# launches are a fixed ~25 whatever the batch, and padding costs it memory traffic only
# (32 MB a pass in float64 at the limit, against the ~25 launches a cut adds).
CHOLESKY_BATCH = 1 << 22


def padded_batches(shifted, side: str, joined: Concatenation, draws: bool) -> list[PaddedBatch]:
    """(group, shift) pairs by length (n for side "p", m for "q"), cut where padding would
    double the work (CholeskyQR: and the batch would pass `CHOLESKY_BATCH` elements).

    Each batch costs a fixed number of operations (kernel launches on a GPU),
    so the fewer the better; the padded batch's elements, which Householder's
    QR works through, stay at most twice the groups' own. The cut depends on the
    shapes and the device type alone: the same on every rank.
    """
    length = (lambda g: g.n) if side == "p" else (lambda g: g.m)
    generous = method_for(joined.buffer.device) == "cholesky"
    batches, current, own = [], [], 0
    for g, shift in sorted(shifted, key=lambda pair: length(pair[0])):  # stable: same everywhere
        size = g.count * g.rank * length(g)
        if current:
            count = sum(c.count for c, _ in current) + g.count
            padded = count * max(g.rank, *(c.rank for c, _ in current)) * length(g)
            if padded > 2 * (own + size) and not (generous and padded <= CHOLESKY_BATCH):
                batches.append(current)
                current, own = [], 0
        current.append((g, shift))
        own += size
    if current:
        batches.append(current)
    return [PaddedBatch([g for g, _ in b], side, joined, draws, [s for _, s in b]) for b in batches]


class Factors:
    """The compressed matrices of one bucket, device and compute dtype: one flat P and Q buffer.

    Args:
        device, dtype: of the matrices' state (the compute dtype).
        comm_dtype: what P and Q travel in (None: `dtype`).
        generator: of this buffer's random draws, in the same state on every rank.
    """

    def __init__(self, device, dtype, comm_dtype, generator: torch.Generator):
        self.device = device
        self.dtype = dtype
        self.comm_dtype = comm_dtype or dtype
        # Scaling buys range only where the wire is narrower than the math.
        self.scaled = self.comm_dtype == torch.float16 and dtype != torch.float16
        self.groups: OrderedDict[tuple[int, int, int], ShapeGroup] = OrderedDict()
        self.generator = generator
        # False until a step averaged memories at this layout (a rank change
        # keeps columns of another rank): no float16 wire scale from them yet.
        self.warm = True
        # --- the schedule's own, per step (compressor.py) ----------------------------
        self.partners: list[list[Concatenation]] = [[], []]  # by step parity, per side
        self.projection: Concatenation | None = None  # rounds=2: the summed P
        self.p_finite: torch.Tensor | None = None  # rounds=2: per matrix, P of this step
        self.sent: list[str] = []  # rounds=1: "p"/"q", what this step sends

    def names(self) -> list[str]:
        return [name for g in self.groups.values() for name in g.names]

    def add(self, name: str, shape: torch.Size, rank: int) -> tuple[ShapeGroup, int]:
        """Place the matrix of parameter `name` (at rank r); returns its group and index."""
        n, m = matrix_shape(shape)
        group = self.groups.setdefault((n, m, rank), ShapeGroup(n, m, rank))
        if rank == n:
            group.sends = ("q", "q")  # P̂ is n x n: P̂·P̂ᵀ·M = M
        elif rank == m:
            group.sends = ("p", "p")  # Q̂ is m x m: M·Q̂·Q̂ᵀ = M
        group.names.append(name)
        group.shapes.append(shape)
        return group, group.count - 1

    def _matrix_ids(self, order, sizes) -> torch.Tensor:
        parts = [
            torch.arange(g.first, g.first + g.count).repeat_interleave(size // g.count)
            for g, size in zip(order, sizes)
        ]
        return torch.cat(parts).to(self.device) if parts else torch.zeros(0, dtype=torch.long)

    def allocate(self, p_memory: bool) -> None:
        """Allocate every buffer and view (once all matrices are added).

        Args:
            p_memory: keep a P memory too (the alternating schedule warm-starts both).
        """
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
        self.p_memory = flat(p_sizes, self.dtype) if p_memory else None
        # P is summed in place, so it may share storage with its compute copy; so may
        # rounds=1's Q_w (its error is updated before it leaves). rounds=2's Q_w must
        # survive its collective (the error update overlaps it): own buffer.
        separate = self.comm_dtype != self.dtype
        self.p_comm = flat(p_sizes, self.comm_dtype) if separate else self.p
        in_place = p_memory and not separate
        self.q_comm = self.q_local if in_place else flat(q_sizes, self.comm_dtype)
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
            if self.scaled:
                g.q_scales = self.p.new_ones(g.count, 1, 1)
            g.first = first
            first += g.count
            g.cache_views()
        # Which matrix each element of the flat buffers belongs to: per-matrix
        # flags (finite or not) for the whole bucket come from one indexed sum.
        self.matrix_count = first
        self.p_matrix = self._matrix_ids(p_order, p_sizes)
        self.q_matrix = self._matrix_ids(q_order, q_sizes)
        self.matrix_ids = {"p": self.p_matrix, "q": self.q_matrix}
        self.memories = {"p": self.p_memory, "q": self.q_memory}
        # A partner batch's side -> (its memory, the scratch its random draw goes to):
        # a Q̂ partner goes with a P that is sent, and the other way round.
        self.partner_flats = {"q": (self.q_memory, self.q_local), "p": (self.p_memory, self.p)}
        self.all_finite = torch.ones(first, dtype=torch.bool, device=self.device)
        self.p_finite = self.all_finite
        # How much of each buffer an alternating step sends, by step parity.
        self.p_sent = [
            sum(s for g, s in zip(p_order, p_sizes) if g.sends[phase] == "p") for phase in (0, 1)
        ]
        self.q_sent = [
            sum(s for g, s in zip(q_order, q_sizes) if g.sends[phase] == "q") for phase in (0, 1)
        ]
        self.q_memory.normal_(generator=self.generator)
        if self.p_memory is not None:
            self.p_memory.normal_(generator=self.generator)

    def finite_matrices(self, parts) -> torch.Tensor:
        """(K,) bool: whether every element of each matrix in `parts` is finite.

        `parts`: (flat tensor, its matrix ids) pairs; a tensor may be a prefix
        of a flat buffer. Matrices in none of them count as finite. A sum is
        finite where every term is, and NaN or infinite where one is not (or,
        harmlessly, where finite entries near float's largest overflow it).
        """
        if self.device.type in HOST_READS_FREE and all(math.isfinite(t.sum()) for t, _ in parts):
            # The usual case, seen from the host at no cost on the CPU.
            return self.all_finite
        sums = torch.zeros(self.matrix_count, dtype=self.dtype, device=self.device)
        for tensor, ids in parts:
            sums.index_add_(0, ids[: tensor.numel()], tensor)
        return (sums - sums) == 0  # NaN wherever the sum is not finite

    def drop_non_finite_error(self, finite: torch.Tensor, dropped=None) -> None:
        """Zero the error buffers of the matrices whose flag in `finite` (K,) is False
        (`dropped`: ~finite, where the caller has it)."""
        # On the CPU a host-side look at the flags costs nothing and saves a
        # pass over every error buffer; on an accelerator it would stall the
        # stream, so there the fill runs unconditionally.
        if self.device.type in HOST_READS_FREE and finite is self.all_finite:
            return
        dropped = ~finite if dropped is None else dropped
        for g in self.groups.values():
            g.matrices.masked_fill_(dropped[g.first : g.first + g.count].view(-1, 1, 1), 0)


class JointFactors:
    """Several buckets' `Factors` of one device and dtype (`owners`), for the checks a step
    makes on all of them at once: which matrices are finite, in a few operations on a
    concatenation of their buffers, not a few per bucket.

    `sent(factors, phase, kind)`: how many elements of its `kind` ("p", "q") buffer a
    bucket sends on steps of that parity (a prefix); per (phase, kind) sent by any,
    `wire` holds the senders (owner index, elements), which matrix each element of
    their concatenation is, and scratch for it and for the memories it updates.
    """

    def __init__(self, owners: list[Factors], sent):
        self.owners = owners
        firsts = [0]
        for f in owners:
            firsts.append(firsts[-1] + f.matrix_count)
        self.spans = list(zip(firsts, firsts[1:]))
        self.count = firsts[-1]
        # Which matrix (of all owners') each element of the concatenated P buffers is.
        self.p_ids = torch.cat([f.p_matrix + first for f, first in zip(owners, firsts)])
        self.all_finite = owners[0].all_finite.new_ones(self.count)
        self.p_finite = self.all_finite  # rounds=2: of this step's summed P
        self.wire = {}
        for phase, kind in ((0, "p"), (0, "q"), (1, "p"), (1, "q")):
            parts = [(i, sent(f, phase, kind)) for i, f in enumerate(owners)]
            parts = [(i, n) for i, n in parts if n]
            if parts:
                ids = [owners[i].matrix_ids[kind][:n] + firsts[i] for i, n in parts]
                scratch = owners[0].p.new_empty(sum(n for _, n in parts))
                self.wire[phase, kind] = (parts, torch.cat(ids), scratch, torch.empty_like(scratch))

    def finite(self, parts) -> torch.Tensor:
        """(K,) bool over every owner's matrices: whether each is finite in `parts`, (tensor,
        its elements' matrix ids) pairs (`all_finite` itself where the host sees that all
        are)."""
        f = self.owners[0]
        if f.device.type in HOST_READS_FREE and all(math.isfinite(t.sum()) for t, _ in parts):
            return self.all_finite
        sums = torch.zeros(self.count, dtype=f.dtype, device=f.device)
        for tensor, ids in parts:
            sums.index_add_(0, ids, tensor)
        return (sums - sums) == 0  # NaN wherever the sum is not finite

    def split(self, flags: torch.Tensor) -> list[torch.Tensor]:
        """Each owner's part of per-matrix `flags` (`all_finite`: each owner's own)."""
        if flags is self.all_finite:
            return [f.all_finite for f in self.owners]
        return [flags[a:b] for a, b in self.spans]
