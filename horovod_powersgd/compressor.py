"""The PowerSGD math on local tensors: no communication, testable in one process.

`PowerSGDCompressor` owns, for every compressed parameter, an n x m matrix view
of its gradient plus error (M), a rank-r P (n x r) and Q (m x r), and the Q
memory that warm-starts the next step. All of it is allocated once:

* matrices of the same shape, dtype and device form a *group*; their M, P, Q
  and Q memory are stacked (k, n, m) / (k, n, r) / (k, m, r) tensors, so every
  power-iteration half is one batched matmul per group;
* groups of the same dtype and device form a *bucket*; the P and Q of all its
  groups are views into one flat buffer each, so the communication layer can
  send all P (and later all Q) of a step in one collective.

One step, as the caller drives it (W workers; "sum" is an all-reduce that the
caller performs between the calls):

    begin_step()                   # this step's Q: memory or fresh draw, orthonormalised
    compress(param, grad)          # 1-2. M = grad + e;  P = M·Q        (per layer)
    p_buffers()                    # 3.   -> caller sums all P
    project(p_sums)                # 4-5. P̂ = orth(P);  Q_w = Mᵀ·P̂     -> caller averages Q
    update_error()                 # 6b.  e = M − P̂·Q_wᵀ (overlaps the Q collective)
    decompress(q_avgs)             # 6a.  grad = P̂·Q_avgᵀ;  Q memory = Q_avg

Non-finite gradients (an AMP overflow step) make the summed P non-finite on
every rank alike; for those matrices the error buffer is reset to zero and the
Q memory keeps its last finite value, so later steps never see NaN/Inf. The
decompressed gradient is left non-finite so that `GradScaler` skips the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
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
    """Compressed matrices of one shape (n, m), rank r, dtype and device."""

    n: int
    m: int
    rank: int
    names: list[str] = field(default_factory=list)
    # Filled in by _Bucket.allocate(). P and Q are stored transposed, (k, r, n)
    # and (k, r, m): then both power-iteration halves read M row by row
    # (Pᵀ = Qᵀ·Mᵀ and Qᵀ = P̂ᵀ·M), which on the CPU is 2-3x faster than
    # Mᵀ·P̂ with its strided reads of M.
    matrices: torch.Tensor | None = None  # (k, n, m): M during a step, error buffer between steps
    pt: torch.Tensor | None = None  # (k, r, n) in the compute dtype
    qt_local: torch.Tensor | None = None  # (k, r, m): this worker's Q_wᵀ = P̂ᵀ·M
    qt_memory: torch.Tensor | None = None  # (k, r, m): warm start, identical on every rank
    finite: torch.Tensor | None = None  # (k, 1, 1) bool: summed P finite this step
    pt_comm: torch.Tensor | None = None  # (k, r, n) view into the bucket's P comm buffer
    qt_comm: torch.Tensor | None = None  # (k, r, m) view into the bucket's Q comm buffer
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


class _Bucket:
    """All groups of one (device, compute dtype): one flat P and one flat Q buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, comm_dtype, seed: int):
        self.device = device
        self.dtype = dtype
        self.comm_dtype = comm_dtype or dtype
        # Scaling buys range only where the wire is narrower than the math.
        self.scaled = self.comm_dtype == torch.float16 and dtype != torch.float16
        self.groups: OrderedDict[tuple[int, int, int], _Group] = OrderedDict()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def allocate(self):
        def flat(total_per_group, dtype):
            return torch.zeros(sum(total_per_group), dtype=dtype, device=self.device)

        p_sizes = [g.count * g.n * g.rank for g in self.groups.values()]
        q_sizes = [g.count * g.m * g.rank for g in self.groups.values()]
        self.p = flat(p_sizes, self.dtype)
        self.q_local = flat(q_sizes, self.dtype)
        self.q_memory = flat(q_sizes, self.dtype)
        separate = self.comm_dtype != self.dtype
        # P is summed in place, so it may share storage with its compute copy;
        # Q_w must survive its collective (the error update needs it): own buffer.
        self.p_comm = flat(p_sizes, self.comm_dtype) if separate else self.p
        self.q_comm = flat(q_sizes, self.comm_dtype)
        p_off = q_off = 0
        for g, p_size, q_size in zip(self.groups.values(), p_sizes, q_sizes):
            g.matrices = torch.zeros(g.count, g.n, g.m, dtype=self.dtype, device=self.device)
            g.pt = self.p[p_off : p_off + p_size].view(g.count, g.rank, g.n)
            g.qt_local = self.q_local[q_off : q_off + q_size].view(g.count, g.rank, g.m)
            g.qt_memory = self.q_memory[q_off : q_off + q_size].view(g.count, g.rank, g.m)
            g.pt_comm = self.p_comm[p_off : p_off + p_size].view(g.count, g.rank, g.n)
            g.qt_comm = self.q_comm[q_off : q_off + q_size].view(g.count, g.rank, g.m)
            p_off += p_size
            q_off += q_size
        self.q_memory.normal_(generator=self.generator)


class PowerSGDCompressor:
    """Rank-r PowerSGD compression with warm start and error feedback, local part.

    Args:
        named_tensors: (name, tensor) pairs whose gradients may be compressed;
            the tensor fixes shape, dtype and device.
        config: the PowerSGDConfig; `rank`, `min_compression_rate`,
            `error_feedback`, `warm_start`, `seed` and `comm_dtype` apply here.

    Memory added per compressed parameter of n x m elements (compute dtype):
    n·m for M/error buffer, plus 3·r·(n+m) for P, Q_w, Q memory (and the
    comm_dtype copies when it differs).

    Example:
        >>> w = torch.zeros(64, 32)
        >>> c = PowerSGDCompressor([("w", w)], PowerSGDConfig(rank=2))
        >>> c.compressed_names
        ['w']
        >>> c.begin_step(); c.compress("w", torch.randn(64, 32))
        >>> q = c.project(c.p_buffers())     # one worker: the "sum" is the tensor itself
        >>> c.update_error(); c.decompress(q)["w"].shape
        torch.Size([64, 32])
    """

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: PowerSGDConfig):
        self.config = config
        self.buckets: OrderedDict[tuple[torch.device, torch.dtype], _Bucket] = OrderedDict()
        self._where: dict[str, tuple[_Group, int]] = {}
        self._shapes: dict[str, torch.Size] = {}
        for name, tensor in named_tensors:
            if not config.compresses(tensor.shape):
                continue
            n, m = matrix_shape(tensor.shape)
            dtype = compute_dtype(tensor.dtype)
            key = (tensor.device, dtype)
            if key not in self.buckets:
                # Seed per bucket so that buckets draw independent, rank-identical streams.
                self.buckets[key] = _Bucket(
                    tensor.device, dtype, config.comm_dtype, config.seed + len(self.buckets)
                )
            bucket = self.buckets[key]
            shape_key = (n, m, config.matrix_rank(n, m))
            group = bucket.groups.setdefault(shape_key, _Group(*shape_key))
            self._where[name] = (group, group.count)
            self._shapes[name] = tensor.shape
            group.names.append(name)
        for bucket in self.buckets.values():
            bucket.allocate()
        self.workers = 1
        self.steps = 0  # compressed steps completed (decompress() counts them)

    # --- structure ----------------------------------------------------------------
    @property
    def compressed_names(self) -> list[str]:
        return list(self._where)

    def is_compressed(self, name: str) -> bool:
        return name in self._where

    def _groups(self):
        for bucket in self.buckets.values():
            yield from bucket.groups.values()

    def elements_per_step(self) -> tuple[int, int]:
        """(elements of P, elements of Q) that one step sends, over all buckets."""
        p = sum(b.p_comm.numel() for b in self.buckets.values())
        q = sum(b.q_comm.numel() for b in self.buckets.values())
        return p, q

    def bytes_per_step(self) -> int:
        """Bytes of P plus Q that one step sends, at the dtype they travel in."""
        return sum(
            (b.p_comm.numel() + b.q_comm.numel()) * b.p_comm.element_size()
            for b in self.buckets.values()
        )

    # --- one step -----------------------------------------------------------------
    def begin_step(self, workers: int = 1) -> None:
        """Choose this step's Q: the memory (warm start) or a fresh random draw, orthonormalised.

        A Q memory column that is all zero (its layer's M was zero everywhere,
        e.g. a frozen or unused layer) would keep P = M·Q zero forever; such
        columns are redrawn. The draw is made every step, on every rank alike,
        so generators stay in step; it costs r·m numbers per layer, small next
        to the n·m of the gradient.

        Args:
            workers: how many workers sum P and Q (sets the float16 wire scale).
        """
        self.workers = workers
        warm = self.config.warm_start and self.steps > 0
        for bucket in self.buckets.values():
            # q_local is free until project(): use it as scratch for the draw.
            bucket.q_local.normal_(generator=bucket.generator)
            if not self.config.warm_start:
                bucket.q_memory.copy_(bucket.q_local)
            for g in bucket.groups.values():
                g.p_scale = g.q_scale = None
                if self.config.warm_start:
                    norms = torch.linalg.vector_norm(g.qt_memory, dim=2, keepdim=True)
                    torch.where(norms == 0, g.qt_local, g.qt_memory, out=g.qt_memory)
                    if bucket.scaled and warm:
                        # The Q memory is last step's Q_avg = Mᵀ·P̂: its column
                        # norms are M's singular values, which bound P = M·Q̂.
                        g.p_scale = _wire_scale(norms.amax(dim=1, keepdim=True), workers)
                # P = M·Q against an orthonormal Q has the magnitude of M. The Q
                # memory (last step's averaged Q) has the magnitude of M too, so
                # M·Q_memory would scale with |M|², underflowing or overflowing
                # float16 on the wire. P̂ = orth(P) is the same either way.
                orthogonalize_(g.q_memory)

    def compress(self, name: str, grad: torch.Tensor | None) -> None:
        """Steps 1-2 for one parameter: M = grad (+ error), P = M·Q.

        `grad` None counts as a zero gradient (a parameter unused this step).
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
        torch.mm(group.qt_memory[i], matrix.T, out=group.pt[i])  # Pᵀ = Qᵀ·Mᵀ

    def p_buffers(self) -> list[torch.Tensor]:
        """Step 3: the flat P buffers (one per bucket) for the caller to sum in place."""
        for bucket in self.buckets.values():
            if bucket.p_comm is bucket.p:
                continue
            for g in bucket.groups.values():
                g.pt_comm.copy_(g.pt if g.p_scale is None else g.pt * g.p_scale)
        return [bucket.p_comm for bucket in self.buckets.values()]

    def project(self, p_sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """Steps 4-5: orthogonalise the summed P, then Q_w = Mᵀ·P̂.

        Args:
            p_sums: the buffers returned by `p_buffers`, now summed (or
                averaged) over workers.

        Returns:
            The flat Q buffers (one per bucket) for the caller to average in place.
        """
        for bucket, p_sum in zip(self.buckets.values(), p_sums):
            if bucket.p_comm is not bucket.p:
                bucket.p.copy_(p_sum)
            for g in bucket.groups.values():
                g.finite = torch.isfinite(g.p).all(dim=2, keepdim=True).all(dim=1, keepdim=True)
                if bucket.scaled:
                    # Column norms of the summed P estimate M's singular values,
                    # which bound Q_w = Mᵀ·P̂ (P's own wire scale divided out).
                    norms = torch.linalg.vector_norm(g.pt, dim=2, keepdim=True).amax(dim=1)
                    norms = norms.view(g.count, 1, 1)
                    if g.p_scale is not None:
                        norms = norms / g.p_scale
                    g.q_scale = _wire_scale(norms, self.workers)
                orthogonalize_(g.p)
                torch.bmm(g.pt, g.matrices, out=g.qt_local)  # Q_wᵀ = P̂ᵀ·M
                g.qt_comm.copy_(g.qt_local if g.q_scale is None else g.qt_local * g.q_scale)
        return [bucket.q_comm for bucket in self.buckets.values()]

    def update_error(self) -> None:
        """Step 6b: e = M − P̂·Q_wᵀ (what this worker's compression dropped).

        Only needs this worker's Q_w, so it can run while the Q collective is in
        flight. Without error feedback there is nothing to keep.
        """
        if not self.config.error_feedback:
            return
        for g in self._groups():
            g.matrices.baddbmm_(g.p, g.qt_local, alpha=-1)
            # On the CPU a host-side look at the flags costs nothing and saves a
            # pass over every error buffer; on an accelerator it would stall
            # the stream, so there the fill runs unconditionally.
            if g.matrices.device.type != "cpu" or not bool(g.finite.all()):
                g.matrices.masked_fill_(~g.finite, 0)

    def decompress(
        self, q_avgs: list[torch.Tensor], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Step 6a: the aggregated gradient P̂·Q_avgᵀ of every compressed parameter.

        Also stores Q_avg as next step's Q memory (where it is finite).

        Args:
            q_avgs: the buffers returned by `project`, now averaged over workers.
            out: optional name -> tensor (e.g. the parameters' `.grad`) to write
                the gradients into, saving an allocation per step; names not in
                it get a new tensor.

        Returns:
            name -> gradient, shaped like the parameter.
        """
        grads: dict[str, torch.Tensor] = {}
        for bucket, q_avg in zip(self.buckets.values(), q_avgs):
            q_off = 0
            for g in bucket.groups.values():
                size = g.count * g.m * g.rank
                qt = q_avg[q_off : q_off + size].view(g.count, g.rank, g.m).to(bucket.dtype)
                if g.q_scale is not None:
                    qt = qt / g.q_scale  # a power of two: exact
                q_off += size
                finite_q = torch.isfinite(qt).all(dim=2, keepdim=True).all(dim=1, keepdim=True)
                torch.where(g.finite & finite_q, qt, g.qt_memory, out=g.qt_memory)
                # The gradient uses the Q that was sent, finite or not: a
                # non-finite gradient must reach the optimizer (GradScaler skips it).
                for i, name in enumerate(g.names):
                    target = None if out is None else out.get(name)
                    if (
                        target is not None
                        and target.is_contiguous()
                        and target.dtype == bucket.dtype
                    ):
                        torch.mm(g.p[i], qt[i], out=target.view(g.n, g.m))
                    else:
                        grad = (g.p[i] @ qt[i]).view(self._shapes[name])
                        target = grad if target is None else target.copy_(grad)
                    grads[name] = target
        self.steps += 1
        return grads

    # --- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's compressor state: error buffers, Q memory, RNG states.

        Tensors are detached views (like `nn.Module.state_dict`); save them
        before the next step.
        """
        error, memory = {}, {}
        for g in self._groups():
            for i, name in enumerate(g.names):
                error[name] = g.matrices[i].detach()
                memory[name] = g.q_memory[i].detach()
        return {
            "error_buffers": error,
            "q_memory": memory,
            "rng_states": [b.generator.get_state() for b in self.buckets.values()],
            "steps": self.steps,
        }

    def check_state_dict(self, state: dict, tensor_keys=("error_buffers", "q_memory")) -> None:
        """Raise ValueError, naming the cause, if `state` does not fit this model."""
        if not isinstance(state, dict):
            raise ValueError("PowerSGD state must be a dict from state_dict()")
        for key in (*tensor_keys, "rng_states"):
            if key not in state:
                raise ValueError(
                    f"PowerSGD state has no '{key}': not a horovod_powersgd checkpoint"
                )
        for key in tensor_keys:
            saved = state[key]
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
        return group.matrices[i] if key == "error_buffers" else group.q_memory[i]

    def _load(self, state: dict, tensor_keys) -> None:
        """Validate `state` (its `tensor_keys` and RNG states), then copy it in."""
        self.check_state_dict(state, tensor_keys)
        for key in tensor_keys:
            for name, tensor in state[key].items():
                self._state_tensor(key, name).copy_(tensor)
        for bucket, rng in zip(self.buckets.values(), state["rng_states"]):
            bucket.generator.set_state(rng.cpu() if hasattr(rng, "cpu") else rng)
        # Checkpoints from before the counter existed: a warm Q memory if any step ran.
        self.steps = state.get("steps", self.steps)

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; validates everything before changing anything."""
        self._load(state, ("error_buffers", "q_memory"))

    def load_shared_state(self, shared: dict) -> None:
        """Set the state equal on every rank: `shared_state()` of another worker."""
        self._load(shared, ("q_memory",))

    def shared_state(self) -> dict:
        """The part of `state_dict()` that is equal on every rank (all but the errors)."""
        state = self.state_dict()
        del state["error_buffers"]
        return state

    def reset_error(self) -> None:
        """Forget the residuals (e.g. after the set of workers changed)."""
        for g in self._groups():
            g.matrices.zero_()
