"""The PowerSGD math on local tensors: no communication, testable in one process.

`PowerSGDCompressor` owns, for every compressed parameter, an n x m matrix view
of its gradient plus error (M), a rank-r P (n x r) and Q (m x r), and the
memories that warm-start the next step, all allocated once (layout.py). Its
schedule, chosen at construction, is one of two objects:

`TwoRounds` (rounds=2, the paper's step: P, then Q). W workers; "sum" is an
all-reduce the caller performs between the calls; every call but `begin_step`
can be made per bucket, as its gradients arrive:

    begin_step(workers, done)     # Q̂ = orth(Q memory)  (or a fresh draw)
    compress(name, grad)          # 1-2. M = grad + e;  P = M·Q̂            (per layer)
    send_buffers(bucket)          # 3.   -> caller sums all P
    project(p_sums, bucket)       # 4-5. P̂ = orth(P);  Q_w = Mᵀ·P̂         -> caller averages Q
    update_error(bucket)          # 6b.  e = M − P̂·Q_wᵀ (overlaps the Q collective)
    decompress(q_avgs, bucket)    # 6a.  grad = P̂·Q_avgᵀ;  Q memory = Q_avg

`Alternating` (rounds=1, the authors' current code): even steps send only Q,
odd steps only P, so every message depends only on its layer's gradient and
on state from before the step:

    begin_step(workers, done)     # even: P̂ = orth(P memory); odd: Q̂ = orth(Q memory)
    compress(name, grad)          # M = grad + e; even: Q_w = Mᵀ·P̂, e = M − P̂·Q_wᵀ
                                  #               odd:  P_w = M·Q̂,  e = M − P_w·Q̂ᵀ
    send_buffers(bucket)          # -> caller averages them (the step's only round)
    decompress(avgs, bucket)      # even: grad = P̂·Q_avgᵀ, Q memory = Q_avg
                                  # odd:  grad = P_avg·Q̂ᵀ, P memory = P_avg

`done` is the number of compressed steps before this one (it sets the
alternation, and whether the memories were averaged yet). Either way the factor
that is sent is computed against an orthonormal partner, so it has the
gradient's scale (float16 on the wire keeps it), and the sum over workers of the
error buffers is the sum of what was not delivered. At full rank (r = min(n, m))
rounds=1 always sends the factor whose partner is square, so the step stays exact.

Non-finite gradients (an AMP overflow step) make the summed factor non-finite
on every rank alike; for those matrices the error buffer is reset to zero and
the memories keep their last finite value, so later steps never see NaN/Inf.
The decompressed gradient is left non-finite so that `GradScaler` skips the step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from functools import partial

import torch

from . import graphs
from .config import PowerSGDConfig
from .layout import Concatenation, Factors, JointFactors, PaddedBatch, ShapeGroup
from .linalg import compute_dtype, held, matrix_shape, orthogonalize_, wire_scale
from .stepmodel import per_round


def _accumulate(group: ShapeGroup, index: int, grad, error_feedback: bool) -> None:
    """M = grad + e (or grad alone); a missing `grad` counts as zero."""
    if grad is not None:
        # A conv weight's gradient goes into M's view in the parameter's shape.
        matrix = group.rows["matrices" if grad.dim() == 2 else "shaped"][index]
        (matrix.add_ if error_feedback else matrix.copy_)(grad)
    elif not error_feedback:
        group.rows["matrices"][index].zero_()


def _accumulate_all(factors: Factors, grads: Mapping, error_feedback: bool) -> None:
    """`_accumulate` of every matrix of `factors` (name -> its gradient, every one), in one
    fused add (or copy) over them all."""
    pairs = [(g, i, grads[name]) for g in factors.groups.values() for i, name in enumerate(g.names)]
    targets = [g.rows["matrices" if grad.dim() == 2 else "shaped"][i] for g, i, grad in pairs]
    (torch._foreach_add_ if error_feedback else torch._foreach_copy_)(
        targets, [grad for _, _, grad in pairs]
    )


class _Schedule:
    """What the two schedules share; see `TwoRounds` and `Alternating`."""

    rounds: int

    def __init__(self, config: PowerSGDConfig):
        self.error_feedback = config.error_feedback
        self.warm_start = config.warm_start
        # A partner column whose memory's norm is at most this takes the random draw:
        # a zero column (its layer's M was zero), or, without warm start, every one.
        self.fresh_below = 0.0 if config.warm_start else math.inf
        self.phase = 0  # step parity (Alternating: 0 sends Q, 1 sends P)
        self.warm = False  # the memories were averaged by an earlier step
        self.workers = 1

    def begin_step(self, factors: list[Factors], joins: list[Concatenation]) -> None:
        """This step's partners of `factors`, from memory (warm start) or fresh: `joins`,
        the `Concatenation`s of their memories (and draws), one a side."""
        for f in factors:
            self.draw(f)  # every step, on every rank alike: the generators stay in step
            if f.scaled:
                _clear_scales(f)
        for joined in joins:
            joined.open()
            for batch in joined.batches:
                self._partner(batch, factors[0].scaled)
            joined.close()

    def _partner(self, batch: PaddedBatch, scaled: bool) -> None:
        """Orthonormalise the batch's memories in place.

        A memory column that is all zero (its layer's M was zero everywhere,
        e.g. a frozen or unused layer) would stay zero for ever: it takes the
        draw's (same layout).
        """
        rows, draw = batch.gather()
        norms = torch.linalg.vector_norm(rows, dim=2, keepdim=True)
        torch.where(norms <= self.fresh_below, draw, rows, out=rows)  # a norm is never NaN <= 0
        if scaled and self.warm and self.warm_start:
            self._partner_scales(batch, norms)
        orthogonalize_(rows.transpose(1, 2), batch.floor)
        batch.scatter()

    def _partner_scales(self, batch: PaddedBatch, norms: torch.Tensor) -> None:
        """float16 wire: the scale of the factors sent against this batch's partners.

        P = M·Q̂ against an orthonormal Q̂ has the magnitude of M; the memory
        itself (last step's average of Mᵀ·P̂ or M·Q̂) has the magnitude of M too,
        and its column norms, M's singular values, bound the factor computed
        against it. That bound sets the scale ((k, 1, 1) per group).
        """
        bound = norms.amax(dim=1, keepdim=True)
        scales = batch.split(wire_scale(bound, self.workers, out=batch.scales))
        for g, scale in zip(batch.groups, scales):
            setattr(g, "p_scale" if batch.side == "q" else "q_scale", self.partner_scale(g, scale))

    def _unscale(self, factors: Factors, flat: dict) -> None:
        """float16 wire: divide the powers of two out of the received factors, exactly."""
        for g in factors.groups.values():
            kind = self.sends(g)
            scale = g.q_scale if kind == "q" else g.p_scale
            if scale is not None:
                g.factor(kind, flat[kind]).div_(scale)

    def decompress(self, factors: Factors, received, out: dict, grads: dict) -> None:
        """The aggregated gradients of `factors`' matrices, into `grads` (and `out`)."""
        flat = {kind: next(received).to(factors.dtype) for kind in self.kinds(factors)}
        if factors.scaled:
            self._unscale(factors, flat)
        ids, memories = factors.matrix_ids, factors.memories
        finite = factors.finite_matrices([(t, ids[k]) for k, t in flat.items()])
        finite = self.settle(factors, finite)
        # The averaged factor becomes its memory where finite; memories keep
        # their last finite value.
        for kind, factor in flat.items():
            size = factor.numel()  # rounds=1 sends a prefix
            memory = memories[kind] if size == memories[kind].numel() else memories[kind][:size]
            if finite is not factors.all_finite:
                factor = torch.where(finite[ids[kind][:size]], factor, memory)
            memory.copy_(factor)
        self._gradients(factors, flat, out, grads)

    def decompress_joint(self, joint: JointFactors, received: list, out: dict, grads: dict):
        """`decompress` of every owner of `joint` at once (rounds=2: after `project_joint`):
        `received`, each owner's averaged buffers in `send_buffers`' order; the checks and
        the memories of all in a few operations (`JointFactors.wire`)."""
        owners, flats = joint.owners, []
        for factors, tensors in zip(owners, received):
            flats.append({k: t.to(factors.dtype) for k, t in zip(self.kinds(factors), tensors)})
            if factors.scaled:
                self._unscale(factors, flats[-1])
        wire = [(k, joint.wire[self.phase, k]) for k in "pq" if (self.phase, k) in joint.wire]
        sent = {k: torch.cat([flats[i][k] for i, _ in w[0]], out=w[2]) for k, w in wire}
        finite = self.settle_joint(joint, joint.finite([(sent[k], w[1]) for k, w in wire]))
        # The averaged factor becomes its memory where finite; memories keep
        # their last finite value.
        for kind, (parts, ids, _, kept) in wire:
            memories = [owners[i].memories[kind][:n] for i, n in parts]
            factors = [flats[i][kind] for i, _ in parts]
            if finite is not joint.all_finite:
                torch.cat(memories, out=kept)
                factors = torch.where(finite[ids], sent[kind], kept, out=kept).split(
                    [n for _, n in parts]
                )
            torch._foreach_copy_(memories, factors)
        for factors, flat in zip(owners, flats):
            self._gradients(factors, flat, out, grads)

    def _gradients(self, factors: Factors, flat: dict, out: dict, grads: dict) -> None:
        """grad = P̂·Q_avgᵀ or P_avg·Q̂ᵀ of each matrix, into `grads` (and `out`)."""
        # The gradient uses the factor that was sent, finite or not: a
        # non-finite gradient must reach the optimizer (GradScaler skips it).
        for g in factors.groups.values():
            kind = self.sends(g)
            factor = g.factor_rows(kind, flat[kind])  # P_avg (n x r) or Q_avgᵀ (r x m) each
            # grad = P̂·Q_avgᵀ or P_avg·Q̂ᵀ, both (n x r)·(r x m)
            lefts, rights = (
                (g.rows[self.left_rows], factor) if kind == "q" else (factor, g.rows["qt_memory"])
            )
            for i, name in enumerate(g.names):
                grads[name] = _write(lefts[i], rights[i], g, i, out.get(name))


def _drop_non_finite_errors(joint: JointFactors, finite: torch.Tensor) -> None:
    """Zero the error buffers of every owner's matrices whose flag in `finite` is False."""
    if finite is joint.all_finite:  # seen on the host
        return
    for factors, mine, dropped in zip(joint.owners, joint.split(finite), joint.split(~finite)):
        factors.drop_non_finite_error(mine, dropped)


def _clear_scales(factors: Factors) -> None:
    """float16 wire: no scale until this step's partners and P set them."""
    for g in factors.groups.values():
        g.p_scale = g.q_scale = None


def _scaled(factor: torch.Tensor, scale) -> torch.Tensor:
    return factor if scale is None else factor * scale


def _write(a, c, g: ShapeGroup, i: int, target) -> torch.Tensor:
    """a·c into `target` (or a new tensor), shaped like matrix i's parameter."""
    if target is None or not target.is_contiguous() or target.dtype != a.dtype:
        return _write_new(a, c, g.shapes[i], target)
    torch.mm(a, c, out=target if target.dim() == 2 else target.view(g.n, g.m))
    return target


def _write_new(a, c, shape: torch.Size, target) -> torch.Tensor:
    """a·c as a new tensor of `shape`, copied into `target` if there is one."""
    grad = (a @ c).view(shape)
    return grad if target is None else target.copy_(grad)


class TwoRounds(_Schedule):
    """rounds=2, the paper's step: P = M·Q̂ summed, orthogonalised, then Q_w = Mᵀ·P̂ averaged."""

    rounds = 2
    # Q̂ = orth(Q memory), though in exact arithmetic P̂ = orth(M·Q) is the same
    # for Q and for Q·R⁻¹ with any upper-triangular R: the memory is last step's
    # Mᵀ·P̂, so P = M·Q would square M's condition number. With unit columns
    # only, a full-rank step (8 x 8 at rank 8) was off by 1.6e-3 relative, not
    # the 1e-5 of float32 (tests/parallel/test_auto.py, test_transformer.py).
    left_rows = "p"

    def prepare(self, factors: Factors) -> None:
        """Build what a step orthogonalises together: every Q̂, and every summed P."""
        groups = [list(factors.groups.values())]
        partners = [Concatenation([factors.q_memory], [factors.q_local], groups, "q")]
        factors.partners = [partners, partners]
        factors.projection = Concatenation([factors.p], None, groups, "p")

    def draw(self, factors: Factors) -> None:
        factors.q_local.normal_(generator=factors.generator)  # free until used: scratch

    def partner_scale(self, g: ShapeGroup, scale):
        return scale

    def compress(self, group: ShapeGroup, i: int, grad) -> None:
        """Steps 1-2: M = grad + e; Pᵀ = Q̂ᵀ·Mᵀ."""
        rows = group.rows
        _accumulate(group, i, grad, self.error_feedback)
        torch.mm(rows["qt_memory"][i], rows["matrices_t"][i], out=rows["pt"][i])

    def products(self, factors: list[Factors]) -> None:
        """`compress` of every matrix of `factors` once M holds grad + e: one product a group."""
        for g in (g for f in factors for g in f.groups.values()):
            torch.bmm(g.qt_memory, g.matrices.transpose(1, 2), out=g.pt)

    def wire(self, factors: list[Factors]) -> None:
        """The factors this step sends, into the comm buffers (a wire dtype of their own)."""
        for g in (g for f in factors for g in f.groups.values()):
            g.pt_comm.copy_(_scaled(g.pt, g.p_scale))

    def send_buffers(self, factors: Factors) -> list[torch.Tensor]:
        """Step 3: the flat P buffer, to sum in place (after `wire`)."""
        return [factors.p_comm]

    def project(self, factors: Factors, p_sum: torch.Tensor) -> torch.Tensor:
        """Steps 4-5: P̂ = orth(summed P); Q_w = Mᵀ·P̂. Returns the Q buffer to average."""
        self._summed(factors, p_sum)
        factors.projection.open()
        self._orthogonal(factors.projection, factors.scaled)
        self._local_q(factors)
        if not factors.scaled:
            factors.q_comm.copy_(factors.q_local)  # one copy for the whole bucket
        return factors.q_comm

    def project_joint(self, joint: JointFactors, p_sums, joined: Concatenation):
        """`project` of several buckets' factors (`joint.owners`) at once, their P̂ on the
        `joined` concatenation of all their P; returns each one's Q buffer."""
        owners = joint.owners
        for factors, p_sum in zip(owners, p_sums):
            if factors.p_comm is not factors.p:
                factors.p.copy_(p_sum)
        joined.open()
        joint.p_finite = joint.finite([(joined.buffer[: joined.zero], joint.p_ids)])
        for factors, finite in zip(owners, joint.split(joint.p_finite)):
            factors.p_finite = finite  # for a bucket decompressed alone
        self._orthogonal(joined, owners[0].scaled)
        for factors in owners:
            self._local_q(factors)
        if not owners[0].scaled:  # one copy for every bucket
            torch._foreach_copy_([f.q_comm for f in owners], [f.q_local for f in owners])
        return [f.q_comm for f in owners]

    def _summed(self, factors: Factors, p_sum: torch.Tensor) -> None:
        """The summed P in place, and which of its matrices are finite."""
        if factors.p_comm is not factors.p:
            factors.p.copy_(p_sum)
        factors.p_finite = factors.finite_matrices([(factors.p, factors.p_matrix)])

    def _orthogonal(self, joined: Concatenation, scaled: bool) -> None:
        """P̂ = orth(P) of the opened `joined`, then closed (float16 wire: Q's scales first)."""
        for batch in joined.batches:
            rows, _ = batch.gather()
            if scaled:
                self._q_scales(batch, rows)
            orthogonalize_(rows.transpose(1, 2), batch.floor)
            batch.scatter()
        joined.close()

    def _local_q(self, factors: Factors) -> None:
        """Q_wᵀ = P̂ᵀ·M per group (float16 wire: into the Q buffer, scaled)."""
        for g in factors.groups.values():
            torch.bmm(g.pt, g.matrices, out=g.qt_local)
            if factors.scaled:
                g.qt_comm.copy_(g.qt_local * g.q_scale)

    def _q_scales(self, batch: PaddedBatch, rows: torch.Tensor) -> None:
        """float16 wire: column norms of the summed P estimate M's singular values,
        which bound Q_w = Mᵀ·P̂ (P's own wire scale divided out)."""
        norms = torch.linalg.vector_norm(rows, dim=2, keepdim=True).amax(dim=1, keepdim=True)
        for g, g_norms in zip(batch.groups, batch.split(norms)):
            if g.p_scale is not None:
                g_norms = g_norms / g.p_scale
            g.q_scale = wire_scale(g_norms, self.workers, out=g.q_scales)

    def update_error(self, factors: Factors) -> None:
        """Step 6b: e = M − P̂·Q_wᵀ; needs only this worker's Q_w (overlaps its collective)."""
        if not self.error_feedback:
            return
        for g in factors.groups.values():
            g.matrices.baddbmm_(g.p_batch, g.qt_local, alpha=-1)
        factors.drop_non_finite_error(factors.p_finite)

    def update_error_joint(self, joint: JointFactors) -> None:
        """`update_error` of every owner of `joint` (after `project_joint`)."""
        if not self.error_feedback:
            return
        for factors in joint.owners:
            for g in factors.groups.values():
                g.matrices.baddbmm_(g.p_batch, g.qt_local, alpha=-1)
        _drop_non_finite_errors(joint, joint.p_finite)

    def settle_joint(self, joint: JointFactors, finite: torch.Tensor) -> torch.Tensor:
        return finite if joint.p_finite is joint.all_finite else finite & joint.p_finite

    def kinds(self, factors: Factors) -> list[str]:
        return ["q"]

    def sends(self, g: ShapeGroup) -> str:
        return "q"

    def settle(self, factors: Factors, finite: torch.Tensor) -> torch.Tensor:
        return finite if factors.p_finite is factors.all_finite else finite & factors.p_finite


class Alternating(_Schedule):
    """rounds=1: even steps average Q_w = Mᵀ·P̂, odd steps P_w = M·Q̂ (one round per step)."""

    rounds = 1
    # The partner is the basis the averaged factor is decompressed in
    # (grad = P̂·Q_avgᵀ): it must be orthonormal for that to be a projection.
    left_rows = "p_memory"

    def prepare(self, factors: Factors) -> None:
        """Build, per step parity, the partners: P̂ for groups sending Q, Q̂ for those sending P."""
        factors.partners = [[], []]
        for phase, (side, sent) in itertools.product((0, 1), (("p", "q"), ("q", "p"))):
            groups = [g for g in factors.groups.values() if g.sends[phase] == sent]
            if groups:  # the memories of that side, and the draws' scratch
                memory, draw = factors.partner_flats[side]
                factors.partners[phase].append(Concatenation([memory], [draw], [groups], side))

    def draw(self, factors: Factors) -> None:
        factors.q_local.normal_(generator=factors.generator)  # free until used: scratch
        factors.p.normal_(generator=factors.generator)

    def partner_scale(self, g: ShapeGroup, scale):
        # A group that sends the same factor every step never averages its
        # partner's memory: its partner is a random draw, no scale to learn.
        return None if g.sends[0] == g.sends[1] else scale

    def compress(self, group: ShapeGroup, i: int, grad) -> None:
        """M = grad + e; the factor this step sends, against its orthonormal partner; new e."""
        rows = group.rows
        matrix = rows["matrices"][i]
        _accumulate(group, i, grad, self.error_feedback)
        if group.sends[self.phase] == "p":
            torch.mm(rows["qt_memory"][i], rows["matrices_t"][i], out=rows["pt"][i])  # Pᵀ = Q̂ᵀ·Mᵀ
            if self.error_feedback:
                matrix.addmm_(rows["p"][i], rows["qt_memory"][i], alpha=-1)  # e = M − P_w·Q̂ᵀ
        else:
            torch.mm(rows["pt_memory"][i], matrix, out=rows["qt_local"][i])  # Q_wᵀ = P̂ᵀ·M
            if self.error_feedback:
                matrix.addmm_(rows["p_memory"][i], rows["qt_local"][i], alpha=-1)  # e = M − P̂·Q_wᵀ

    def products(self, factors: list[Factors]) -> None:
        """`compress` of every matrix of `factors` once M holds grad + e: two products a
        group."""
        for g in (g for f in factors for g in f.groups.values()):
            if g.sends[self.phase] == "p":
                torch.bmm(g.qt_memory, g.matrices.transpose(1, 2), out=g.pt)  # Pᵀ = Q̂ᵀ·Mᵀ
                if self.error_feedback:
                    g.matrices.baddbmm_(g.p_batch, g.qt_memory, alpha=-1)  # e = M − P_w·Q̂ᵀ
            else:
                torch.bmm(g.pt_memory, g.matrices, out=g.qt_local)  # Q_wᵀ = P̂ᵀ·M
                if self.error_feedback:
                    g.matrices.baddbmm_(g.pt_memory.transpose(1, 2), g.qt_local, alpha=-1)

    def wire(self, factors: list[Factors]) -> None:
        """The factors this step sends, into the comm buffers (a wire dtype of their own)."""
        for g in (g for f in factors for g in f.groups.values()):
            if g.sends[self.phase] == "q":
                g.qt_comm.copy_(_scaled(g.qt_local, g.q_scale))
            else:
                g.pt_comm.copy_(_scaled(g.pt, g.p_scale))

    def send_buffers(self, factors: Factors) -> list[torch.Tensor]:
        """The part of the P and/or Q buffer this step sends (after `wire`; empty parts
        left out)."""
        factors.sent, out = [], []
        for kind, buffer, size in (
            ("p", factors.p_comm, factors.p_sent[self.phase]),
            ("q", factors.q_comm, factors.q_sent[self.phase]),
        ):
            if size:
                factors.sent.append(kind)
                out.append(buffer[:size])
        return out

    def kinds(self, factors: Factors) -> list[str]:
        return factors.sent

    def sends(self, g: ShapeGroup) -> str:
        return g.sends[self.phase]

    def settle(self, factors: Factors, finite: torch.Tensor) -> torch.Tensor:
        if self.error_feedback:
            factors.drop_non_finite_error(finite)
        return finite

    def settle_joint(self, joint: JointFactors, finite: torch.Tensor) -> torch.Tensor:
        if self.error_feedback:
            _drop_non_finite_errors(joint, finite)
        return finite


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
    """

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        config: PowerSGDConfig,
        bucket_of: Mapping[str, object] | None = None,
    ):
        self.config = config
        self.schedule = TwoRounds(config) if config.rounds == 2 else Alternating(config)
        self._tensors = list(named_tensors)
        self._bucket_of = {
            name: None if bucket_of is None else bucket_of[name] for name, _ in self._tensors
        }
        # The rank of each bucket (0: sent as it is); rank="auto" starts plain.
        first = 0 if config.auto else config.rank
        self.ranks: dict[object, int] = {b: first for b in self._bucket_of.values()}
        self.factors: list[Factors] = []  # by key, in the order of first use
        self._by_bucket: dict[object, list[Factors]] = {}
        self._where: dict[str, tuple[ShapeGroup, int]] = {}
        self._shapes: dict[str, torch.Size] = {}
        # A generator per (bucket, device, dtype), seeded apart in the order of
        # first use, kept across rank changes: independent, rank-identical streams.
        self._generators: dict[tuple, torch.Generator] = {}
        lowest = min(config.ladder()) if config.auto else config.rank
        for name, tensor in self._tensors:  # every buffer any rank may need
            if config.compresses(tensor.shape, lowest):
                key = (self._bucket_of[name], tensor.device, compute_dtype(tensor.dtype))
                if key not in self._generators:
                    self._generators[key] = torch.Generator(device=tensor.device)
                    self._generators[key].manual_seed(config.seed + len(self._generators) - 1)
        self._keyed: dict[tuple, Factors] = {}
        # The step's segments, eager or as captured graphs (graphs.py); the static
        # outputs a graphed step decompresses into (name -> tensor, as the parameter).
        device = next((key[1] for key in self._generators), None)
        self.graphs = graphs.runner_for(config.cuda_graphs, device, self._generators.values())
        self._outputs: dict[str, torch.Tensor] = {}
        self._held: list = []  # see `hold`
        # What a segment may read: every tensor held from step to step (graphs.py).
        self.statics = lambda: graphs.static_tensors(self, held(), self._held)
        self._build(set(self.ranks))

    def _build(self, buckets: set) -> None:
        """(Re)allocate the factor buffers of `buckets` at their ranks in `self.ranks`."""
        for key in [k for k in self._keyed if k[0] in buckets]:
            for name in self._keyed.pop(key).names():
                del self._where[name], self._shapes[name]
        for name, tensor in self._tensors:
            bucket = self._bucket_of[name]
            if bucket not in buckets or not self.config.compresses(
                tensor.shape, self.ranks[bucket]
            ):
                continue
            key = (bucket, tensor.device, compute_dtype(tensor.dtype))
            if key not in self._keyed:
                self._keyed[key] = Factors(*key[1:], self.config.comm_dtype, self._generators[key])
            n, m = matrix_shape(tensor.shape)
            rank = self.config.matrix_rank(n, m, self.ranks[bucket])
            self._where[name] = self._keyed[key].add(name, tensor.shape, rank)
            self._shapes[name] = tensor.shape
        for key, factors in self._keyed.items():
            if key[0] in buckets:
                factors.allocate(p_memory=self.config.rounds == 1)
                self.schedule.prepare(factors)
        self.factors = [self._keyed[k] for k in self._generators if k in self._keyed]
        self._by_bucket = {}
        for key in self._generators:
            if key in self._keyed:
                self._by_bucket.setdefault(key[0], []).append(self._keyed[key])
        self._joint = JointStep(self.factors, self.schedule.rounds)
        self._bucketed = [(b, f) for b, factors in self._by_bucket.items() for f in factors]
        self.graphs.drop()
        # Graphed: static outputs (a graph writes where it was captured), as the parameters.
        self._outputs = {
            n: g.matrices.new_empty(self._shapes[n]) for n, (g, _) in self._where.items()
        } if self.graphs.graphed else {}  # fmt: skip

    def set_ranks(self, ranks: Mapping[object, int]) -> dict[str, torch.Tensor]:
        """Send each bucket of `ranks` at its new rank (0: as it is) from the next step on.

        Nothing is lost: a matrix that stays compressed keeps its error buffer,
        and its Q (and P) memory keeps its first min(old, new) columns (the
        others start from the shared random draw, as at the start); the error
        buffers of matrices that are no longer compressed are returned, for the
        caller to send.

        Returns:
            name -> the residual of each matrix that leaves compression.
        """
        changed = {b for b, r in ranks.items() if self.ranks[b] != r}
        if not changed:
            return {}
        old = {n: self._matrix_state(n) for n in self._where if self._bucket_of[n] in changed}
        self.ranks.update(ranks)
        self._build(changed)
        self._restore(old)
        for factors in self.of_buckets(changed):
            factors.warm = False  # its memories were not averaged at this rank yet
        return {name: error for name, (error, _) in old.items() if name not in self._where}

    def _restore(self, old: dict) -> None:
        """Copy `_matrix_state`s back into the matrices still compressed (leading columns)."""
        for name, (error, memories) in old.items():
            if name in self._where:
                group, i = self._where[name]
                group.matrices[i].copy_(error)
                for key, memory in memories.items():
                    now = self._state_tensor(key, name)
                    columns = min(now.shape[1], memory.shape[1])
                    now[:, :columns].copy_(memory[:, :columns])

    def exclude(self, names: Iterable[str]) -> None:
        """Never compress `names` again (their gradients travel elsewhere, e.g. sparse).

        Their state is dropped; the other matrices of their buckets keep theirs.
        """
        names = set(names) & {name for name, _ in self._tensors}
        if not names:
            return
        buckets = {self._bucket_of[n] for n in names}
        old = {
            n: self._matrix_state(n)
            for n in self._where
            if self._bucket_of[n] in buckets and n not in names
        }
        self._tensors = [(n, t) for n, t in self._tensors if n not in names]
        self._build(buckets)
        self._restore(old)

    def _matrix_state(self, name: str):
        """(error buffer, {memory key: memory}) of `name`, copied."""
        keys = ("q_memory", "p_memory") if self.config.rounds == 1 else ("q_memory",)
        group, i = self._where[name]
        return group.matrices[i].clone(), {k: self._state_tensor(k, name).clone() for k in keys}

    def of_buckets(self, buckets) -> list[Factors]:
        return [f for b in buckets for f in self._by_bucket.get(b, [])]

    def layout(self, ranks: Mapping[object, int]) -> dict[str, tuple[int, int, int]]:
        """name -> (n, m, r) of every matrix compressed when the buckets have `ranks`."""
        out = {}
        for name, tensor in self._tensors:
            rank = ranks.get(self._bucket_of[name], 0)
            if self.config.compresses(tensor.shape, rank):
                n, m = matrix_shape(tensor.shape)
                out[name] = (n, m, self.config.matrix_rank(n, m, rank))
        return out

    # --- structure ----------------------------------------------------------------
    @property
    def compressed_names(self) -> list[str]:
        return list(self._where)

    def is_compressed(self, name: str) -> bool:
        return name in self._where

    def bucket_of(self, name: str):
        """The caller's bucket of parameter `name`."""
        return self._bucket_of[name]

    def _groups(self):
        for factors in self.factors:
            yield from factors.groups.values()

    def of(self, bucket=None) -> list[Factors]:
        """The factor buffers of the caller's bucket `bucket` (None: all)."""
        return self.factors if bucket is None else self._by_bucket.get(bucket, [])

    def elements_per_step(self) -> tuple[int, int]:
        """(elements of P, elements of Q) of all matrices, over all buckets."""
        return sum(f.p_comm.numel() for f in self.factors), sum(
            f.q_comm.numel() for f in self.factors
        )

    def bytes_per_step(self) -> int:
        """Bytes of P plus Q of all matrices, at the dtype they travel in."""
        return sum(
            (f.p_comm.numel() + f.q_comm.numel()) * f.p_comm.element_size() for f in self.factors
        )

    @property
    def phase(self) -> int:
        """rounds=1: 0 on steps that send Q (of alternating matrices), 1 on those that send P."""
        return self.schedule.phase

    # --- one step (the caller's buckets; see the module docstring) -----------------
    def begin_step(self, workers: int = 1, done: int = 0) -> None:
        """Prepare this step's orthonormal partners: from memory (warm start) or fresh.

        Every bucket's at once, in as few batches as `padded_batches` allows
        across buckets (`JointStep`): on a GPU each batch is a few dozen launches.

        Args:
            workers: how many workers sum P and Q (sets the float16 wire scale).
            done: compressed steps before this one (the alternation; warm memories).
        """
        schedule = self.schedule
        schedule.workers, schedule.phase, schedule.warm = workers, done % 2, done > 0
        # What the segments' Python decides from: their graphs are kept per this (rounds=2
        # does the same on steps of either parity).
        phase = schedule.phase if schedule.rounds == 1 else 0
        self.graphs.begin((phase, schedule.warm, workers))

        def partners():
            for owners, joins in self._joint.partners[schedule.phase]:
                schedule.begin_step(owners, joins)

        self.graphs.run("partners", partners, self.statics)

    def project_all(self, p_sums: Mapping) -> dict:
        """rounds=2: `project` of several buckets, bucket -> its summed P buffers (as
        `project` takes them), every bucket's at once where they are all (`JointStep`);
        returns bucket -> its Q buffers."""
        sums = {id(f): p for b, ps in p_sums.items() for f, p in zip(self.of(b), ps)}
        whole = len(sums) == len(self.factors)

        def project():
            if whole:
                self._joint.project(self.schedule, sums)
            for b, ps in {} if whole else p_sums.items():
                _each(self.schedule.project, list(zip(self.of(b), ps)))

        self._joint.projected = whole
        self.graphs.run("project", project, self.statics)
        return {b: [f.q_comm for f in self.of(b)] for b in p_sums}

    def compress(self, name: str, grad: torch.Tensor | None) -> None:
        """This parameter's part of the step that needs only its gradient (None: zero)."""
        self.schedule.compress(*self._where[name], grad)

    def compress_bucket(self, bucket, grads: Mapping, then=None) -> None:
        """`compress` of every compressed matrix of `bucket` at once (name -> its gradient,
        every one): a few launches a bucket on a GPU, not a few a matrix; then `then()`,
        if given, in the same segment (its tensors `hold`)."""
        factors = self.of(bucket)
        for f in factors:  # eager: each step's gradients are new tensors
            _accumulate_all(f, grads, self.schedule.error_feedback)

        def compress():
            self.schedule.products(factors)
            if then is not None:
                then()

        self.graphs.run(("compress", bucket), compress, self.statics)

    def hold(self, *objects) -> None:
        """Objects whose tensors a segment may read too (the statistics, `then` of
        `compress_bucket`): static for the graphs, which start again."""
        self._held = list(objects)
        self.graphs.drop()

    def send_buffers(self, bucket=None) -> list[torch.Tensor]:
        """The flat buffers of the step's first (rounds=1: only) round, to sum in place."""
        factors = self.of(bucket)
        if any(f.p_comm is not f.p for f in factors):  # a wire dtype of its own: copies
            self.graphs.run(("wire", bucket), partial(self.schedule.wire, factors), self.statics)
        return [t for f in factors for t in self.schedule.send_buffers(f)]

    def project(self, p_sums: list[torch.Tensor], bucket=None) -> list[torch.Tensor]:
        """rounds=2: the Q buffers to average in place, from the summed P buffers (bucket
        None: every bucket's, projected at once as `project_all` does)."""
        if bucket is None:
            qs = self._joint.project(self.schedule, dict(zip(map(id, self.factors), p_sums)))
            return [qs[id(f)] for f in self.factors]
        self._joint.projected, factors = False, self.of(bucket)
        segment = partial(_each, self.schedule.project, list(zip(factors, p_sums)))
        self.graphs.run(("project", bucket), segment, self.statics)
        return [f.q_comm for f in factors]

    def update_error(self, bucket=None) -> None:
        """rounds=2: keep what this worker's compression dropped (rounds=1 did in compress);
        bucket None: every bucket's, after `project` of every bucket."""
        if bucket is None and self._joint.projected:
            self.graphs.run("error", lambda: self._joint.update_error(self.schedule), self.statics)
            return
        segment = partial(_each, self.schedule.update_error, [(f,) for f in self.of(bucket)])
        self.graphs.run(("error", bucket), segment, self.statics)

    def decompress(self, avgs, out=None, bucket=None) -> dict[str, torch.Tensor]:
        """name -> the aggregated gradient, from the averaged (or summed) buffers.

        Args:
            avgs: rounds=2: the Q buffers of `project`; rounds=1: those of
                `send_buffers`; averaged or summed over workers.
            out: optional name -> tensor (e.g. the parameters' `.grad`) to write
                the gradients into; names not in it get a new tensor.
            bucket: the caller's bucket they belong to (None: all).
        """
        if not self.graphs.graphed:
            return self._decompress(avgs, out, bucket)
        static = {n: self._outputs[n] for f in self.of(bucket) for n in f.names()}
        segment = partial(self._decompress, list(avgs), static, bucket)
        self.graphs.run(("decompress", bucket), segment, self.statics)
        return graphs.copy_out(static, out or {})

    def _decompress(self, avgs, out, bucket) -> dict[str, torch.Tensor]:
        grads, received = {}, iter(avgs)
        if bucket is None and self._joint.whole:  # every bucket's at once
            kinds = self.schedule.kinds
            mine = {id(f): [next(received) for _ in kinds(f)] for f in self.factors}
            self._joint.decompress(self.schedule, mine, out or {}, grads)
            return grads
        for factors in self.of(bucket):
            self.schedule.decompress(factors, received, out or {}, grads)
        return grads

    def decompress_all(self, avgs: Mapping, out=None) -> dict[str, torch.Tensor]:
        """`decompress` of several buckets, bucket -> its averaged buffers; every bucket's at
        once where they are all (`JointStep.whole`)."""
        whole = self._joint.whole and set(avgs) >= set(self._by_bucket)
        if not self.graphs.graphed:
            return self._decompress_all(avgs, out, whole)
        static = {n: self._outputs[n] for b in avgs for f in self.of(b) for n in f.names()}
        self.graphs.run(
            "decompress", lambda: self._decompress_all(avgs, static, whole), self.statics
        )
        return graphs.copy_out(static, out or {})

    def _decompress_all(self, avgs: Mapping, out, whole: bool) -> dict[str, torch.Tensor]:
        grads = {}
        if not whole:
            for b, a in avgs.items():
                grads.update(self._decompress(list(a), out, b))
            return grads
        tensors, kinds = {b: iter(a) for b, a in avgs.items()}, self.schedule.kinds
        received = {id(f): [next(tensors[b]) for _ in kinds(f)] for b, f in self._bucketed}
        self._joint.decompress(self.schedule, received, out or {}, grads)
        return grads

    # --- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's compressor state: error buffers, memories, RNG states.

        Tensors are detached views (like `nn.Module.state_dict`); save them
        before the next step.
        """
        state = {key: {} for key in self._tensor_keys()}
        for name in self._where:
            for key in state:
                state[key][name] = self._state_tensor(key, name).detach()
        state["rng_states"] = [g.get_state() for g in self._generators.values()]
        state["ranks"] = [[bucket, rank] for bucket, rank in self.ranks.items()]
        return state

    def _tensor_keys(self) -> tuple[str, ...]:
        memories = ("q_memory", "p_memory") if self.config.rounds == 1 else ("q_memory",)
        return ("error_buffers", *memories)

    def check_state_dict(self, state: dict, tensor_keys=None, leaving: Iterable[str] = ()) -> None:
        """Raise ValueError, naming the cause, if `state` does not fit this model.

        `leaving`: names that loading `state` takes out of PowerSGD (its sparse
        parameters, see `exclude`): the state holds no matrices of theirs.
        """
        _check_state(
            self, state, self._tensor_keys() if tensor_keys is None else tensor_keys, leaving
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
        saved = _saved_ranks(self, state)
        if saved != self.ranks:  # rank="auto" resumes the plan it saved
            changed = {b for b, r in saved.items() if self.ranks[b] != r}
            self.ranks.update(saved)
            self._build(changed)
        for key in tensor_keys:
            for name, tensor in state.get(key, {}).items():
                self._state_tensor(key, name).copy_(tensor)
        for generator, rng in zip(self._generators.values(), state["rng_states"]):
            generator.set_state(rng.cpu() if hasattr(rng, "cpu") else rng)
        self.graphs.drop()  # captured against the generators' and buffers' old state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; validates everything before changing anything."""
        self._load(state, self._tensor_keys())

    def check_shared_state(self, shared: dict, leaving: Iterable[str] = ()) -> None:
        """Raise ValueError, naming the cause, if `shared` does not fit this model."""
        self.check_state_dict(shared, self._tensor_keys()[1:], leaving)

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
        the same factor every step); the value is the mean over two steps
        (`stepmodel.per_round`, the model's bytes of a step).
        """
        return _layer_info(self._where[name][0], self._shapes[name], self.schedule.rounds)

    def step_views(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(error buffer, factor this worker computed) of `name` in the current step.

        The factor is the one computed against an orthonormal partner (rounds=2:
        Q_w = Mᵀ·P̂; rounds=1: Q_w or P_w = M·Q̂), so M − (its product with the
        partner) is the residual and ‖M‖² = ‖residual‖² + ‖factor‖². The buffer
        holds that residual once it is computed (with error feedback), else M.
        Valid for rounds=1 right after `compress(name)` (the factor is then summed
        in place; the error buffer holds until the next `begin_step`), for rounds=2
        from `update_error` until the next `begin_step`.
        """
        group, i = self._where[name]
        factor = group.qt_local[i] if self.schedule.sends(group) == "q" else group.pt[i]
        return group.matrices[i], factor

    def group_views(self, bucket=None):
        """(names, error buffers, factors) of each group, as `step_views`, a view per matrix.

        The views are made once, so the statistics can take all their norms in
        one fused operation (`torch._foreach_norm`). Same validity as `step_views`.
        """
        for factors in self.of(bucket):
            for g in factors.groups.values():
                sent = "qt_local" if self.schedule.sends(g) == "q" else "pt"
                yield g.names, g.rows["matrices"], g.rows[sent]


def _layer_info(group: ShapeGroup, shape: torch.Size, rounds: int) -> dict:
    """`PowerSGDCompressor.layer_info` of a matrix of `group`, shaped `shape` as a parameter."""
    sizes = {"p": group.rank * group.n, "q": group.rank * group.m}
    first, second = ("p", "q") if rounds == 2 else group.sends  # by step parity
    per_step = sum(per_round(sizes[first], sizes[second], 0, rounds))
    return {
        "shape": tuple(shape),
        "matrix": (group.n, group.m),
        "rank": group.rank,
        "elements_per_step": per_step,
    }


def _each(method, arguments) -> None:
    """`method(*a)` for each `a` of `arguments` (a segment of several calls)."""
    for a in arguments:
        method(*a)


def _check_state(compressor, state: dict, tensor_keys, leaving) -> None:
    """`PowerSGDCompressor.check_state_dict`, with its `tensor_keys` given."""
    if not isinstance(state, dict):
        raise ValueError("PowerSGD state must be a dict from state_dict()")
    # A checkpoint of the other schedule has no P memory: it starts fresh.
    required = [k for k in tensor_keys if k != "p_memory"]
    for key in (*required, "rng_states"):
        if key not in state:
            raise ValueError(f"PowerSGD state has no '{key}': not a horovod_powersgd checkpoint")
    leaving = set(leaving)
    layout = compressor.layout(_saved_ranks(compressor, state))
    layout = {name: shape for name, shape in layout.items() if name not in leaving}
    for key in tensor_keys:
        saved = state.get(key)
        if saved is None:
            continue
        if set(saved) != set(layout):
            missing = sorted(set(layout) - set(saved))
            extra = sorted(set(saved) - set(layout))
            raise ValueError(
                f"PowerSGD checkpoint does not match this model's compressed parameters "
                f"({key}): missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, tensor in saved.items():
            n, m, r = layout[name]
            expected = {"error_buffers": (n, m), "q_memory": (m, r), "p_memory": (n, r)}[key]
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"PowerSGD checkpoint: {key}[{name!r}] has shape {tuple(tensor.shape)}, "
                    f"this model needs {expected} (a different model or rank?)"
                )
    if len(state["rng_states"]) != len(compressor._generators):
        raise ValueError(
            f"PowerSGD checkpoint has {len(state['rng_states'])} RNG states, "
            f"this model needs {len(compressor._generators)}"
        )


def _saved_ranks(compressor, state: dict) -> dict:
    """The bucket ranks a state was saved with (checkpoints before ranks: today's)."""
    try:  # [[bucket, rank], ...]
        ranks = dict(state["ranks"]) if "ranks" in state else dict(compressor.ranks)
    except (TypeError, ValueError):
        ranks = None
    if ranks is None or set(ranks) != set(compressor.ranks):
        raise ValueError("PowerSGD checkpoint has ranks for other buckets: saved by another model")
    allowed = (
        {0, *compressor.config.ladder()} if compressor.config.auto else {compressor.config.rank}
    )
    bad = {b: r for b, r in ranks.items() if r not in allowed}
    if bad:
        raise ValueError(
            f"PowerSGD checkpoint was saved with bucket ranks {sorted(set(bad.values()))}; "
            f"this optimizer uses {sorted(allowed)} (rank={compressor.config.rank!r})"
        )
    return ranks


class JointStep:
    """What a step does for every bucket at once (per device and dtype): the partners'
    orthogonalisation of each step parity, and rounds=2's projection, its error update and
    its decompression (`project` of all buckets), each padded together across buckets on
    a `Concatenation` of their buffers, their finiteness checked at once (`JointFactors`).

    Each bucket's own (`Factors.partners`, which the schedule chose the sides and groups
    of, and `Factors.projection`) stay for one bucket's step (auto's probe, hierarchical
    PowerSGD).
    """

    def __init__(self, factors: list[Factors], rounds: int):
        kinds: dict[tuple, list[Factors]] = {}
        for f in factors:
            kinds.setdefault((f.device, f.dtype), []).append(f)
        self.partners: list[list] = [[], []]  # by step parity: (owners, joins)
        for phase in (0, 1):
            if phase and all(f.partners[0] is f.partners[1] for f in factors):
                self.partners[1] = self.partners[0]  # rounds=2: the same partners every step
                break
            for owners in kinds.values():
                joins = []
                for side in ("p", "q"):
                    groups = [
                        [g for j in f.partners[phase] if j.side == side for g in j.groups[0]]
                        for f in owners
                    ]
                    if any(groups):
                        memories, draws = zip(*(f.partner_flats[side] for f in owners))
                        joins.append(Concatenation(list(memories), list(draws), groups, side))
                self.partners[phase].append((owners, joins))
        # Per device and dtype, every bucket's checks at once; rounds=2, the projections.
        self.joints = [JointFactors(owners, _sent) for owners in kinds.values()]
        self.projections = []  # rounds=2: (JointFactors, concatenation)
        for joint in self.joints if rounds == 2 else ():
            groups = [list(f.groups.values()) for f in joint.owners]
            joined = Concatenation([f.p for f in joint.owners], None, groups, "p")
            self.projections.append((joint, joined))
        self.rounds = rounds
        self.projected = False  # this step's P were projected here (not bucket by bucket)

    @property
    def whole(self) -> bool:
        """Whether the step may be decompressed here, every bucket at once (rounds=2: its
        P were projected here)."""
        return self.rounds == 1 or self.projected

    def project(self, schedule: TwoRounds, p_sums: dict) -> dict:
        """id(factors) -> its Q buffer, from id(factors) -> its summed P, of every bucket."""
        qs = {}
        for joint, joined in self.projections:
            mine = [p_sums[id(f)] for f in joint.owners]
            qs.update(zip(map(id, joint.owners), schedule.project_joint(joint, mine, joined)))
        self.projected = True
        return qs

    def update_error(self, schedule: TwoRounds) -> None:
        for joint, _ in self.projections:
            schedule.update_error_joint(joint)

    def decompress(self, schedule: _Schedule, received: dict, out: dict, grads: dict) -> None:
        """Every bucket's gradients from id(factors) -> its averaged buffers (a list)."""
        for joint in self.joints:
            mine = [received[id(f)] for f in joint.owners]
            schedule.decompress_joint(joint, mine, out, grads)


def _sent(factors: Factors, phase: int, kind: str) -> int:
    """Elements of its `kind` buffer a bucket sends on steps of parity `phase` (rounds=2:
    its P, then its Q, every step; rounds=1: a prefix of one or both)."""
    if factors.p_memory is None:  # rounds=2: the Q round is the one decompressed
        return factors.q_memory.numel() if kind == "q" else 0
    return (factors.p_sent if kind == "p" else factors.q_sent)[phase]


def local_step(
    compressor: PowerSGDCompressor, bucket: int, grads: Mapping, out: dict, *, workers: int = 1,
    done: int = 2, partners: bool = True, mark=None,
) -> list[str]:  # fmt: skip
    """One worker's PowerSGD work on bucket `bucket`, nothing sent: the segments the
    reducer runs between its collectives, in its order (the protocol above), with each
    "sum" the buffer itself. The one driver of the local step outside the reducer:
    auto's probe times it, the GPU kit and the benchmarks' scripts run it.

    Args:
        grads: name -> gradient of each of the bucket's compressed matrices.
        out: name -> tensor each aggregated gradient is written into (as the reducer's
            `p.grad`).
        workers, done: as `begin_step`'s (the float16 wire scale; the alternation and
            warm memories: the default is a steady even step).
        partners: orthogonalise this bucket's partners first, alone (`begin_step`
            does every bucket's at once: pass False after calling it).
        mark: called with each segment's name once it is queued: "partners",
            "compress", "project" and "error" (rounds=2), "decompress".

    Returns:
        The names of the bucket's matrices (none: nothing was run).
    """
    mark = mark or (lambda segment: None)
    factors = compressor.of(bucket)
    names = [name for f in factors for name in f.names()]
    if not names:
        return []
    schedule = compressor.schedule
    schedule.workers, schedule.phase, schedule.warm = workers, done % 2, done > 0
    if partners:
        for f in factors:
            schedule.begin_step([f], f.partners[schedule.phase])
        mark("partners")
    compressor.compress_bucket(bucket, grads)
    sent = compressor.send_buffers(bucket)
    mark("compress")
    if schedule.rounds == 2:
        sent = compressor.project(sent, bucket)
        mark("project")
        compressor.update_error(bucket)
        mark("error")
    compressor.decompress(sent, out={n: out[n] for n in names}, bucket=bucket)
    mark("decompress")
    return names
