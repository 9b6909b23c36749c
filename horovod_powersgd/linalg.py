"""Pure functions on tensors: matrix views, orthogonalisation, the float16 wire scale."""

from __future__ import annotations

import os

import torch

from . import shares


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(n, m) of the matrix view of a tensor: first dimension by all the others.

    A conv weight (out, in, kh, kw) becomes (out, in·kh·kw) (`shares.matrix`, pure).
    """
    return shares.matrix(shape)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype PowerSGD state and math use for parameters of `dtype`.

    16-bit parameters get float32 state: the error buffer accumulates small
    residuals that bfloat16 would round away, and the QR needs the range.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _peak_scaled_(matrices: torch.Tensor, dim: int) -> torch.Tensor:
    """Divide each vector along `dim` by its largest entry, in place; returns `matrices`.

    The results below do not depend on a vector's scale, but its norm does: in
    float32 a vector of entries near 1e19 (a gradient under a huge loss scale)
    has an infinite norm, one near 1e-20 a zero norm. Scaled, every norm lies
    between 1 and sqrt(length). A zero vector stays zero (divided by the
    smallest normal number); a non-finite one stays non-finite.
    """
    peak = matrices.abs().amax(dim=dim, keepdim=True)
    return matrices.div_(peak.clamp_(min=torch.finfo(matrices.dtype).tiny))


# How `orthogonalize_` works: "householder" or "cholesky" (see there), or "auto" (the
# default): Householder on the CPU, CholeskyQR on an accelerator (`method_for`). The
# optimizer sets it from HOROVOD_POWERSGD_ORTHOGONALIZE once every rank has the same.
METHOD_ENV = "HOROVOD_POWERSGD_ORTHOGONALIZE"
METHODS = ("householder", "cholesky")
SETTINGS = ("auto", *METHODS)
METHOD = "auto"


def method_for(device: torch.device) -> str:
    """The orthogonalisation `orthogonalize_` uses for matrices on `device` (`METHOD`,
    "auto" resolved by `default_method`)."""
    return default_method(device) if METHOD == "auto" else METHOD


def default_method(device: torch.device) -> str:
    """ "auto"'s method on `device`: LAPACK's Householder loop is fast on the CPU, while
    on CUDA it is a cuSOLVER call per matrix and CholeskyQR a fixed set of batched
    launches (docs/gpu.md)."""
    return "householder" if device.type == "cpu" else "cholesky"


def method_setting() -> str | None:
    """HOROVOD_POWERSGD_ORTHOGONALIZE's text, unparsed (compared across ranks first)."""
    return os.environ.get(METHOD_ENV) or None


def parse_method(text: str | None) -> str:
    """The method `text` names (None: the default), or ValueError naming the variable."""
    if text is None:
        return "auto"
    if text not in SETTINGS:
        raise ValueError(f"{METHOD_ENV}={text!r}: expected one of {', '.join(SETTINGS)}")
    return text


# A column left with less than DEPENDENT eps of its norm once the columns before it
# are removed is rounding noise, not a new direction; in a complete (full-rank)
# matrix only what float64 cannot tell from zero is (`orthogonalize_`).
DEPENDENT = 1000
COMPLETE_FLOOR = 1000 * torch.finfo(torch.float64).eps


def dependence_floor(dtype: torch.dtype, complete=False):
    """`orthogonalize_`'s `floor` for matrices of `dtype`, `complete` a bool or one per matrix."""
    floor = DEPENDENT * torch.finfo(dtype).eps
    if isinstance(complete, torch.Tensor):
        return torch.where(complete.view(-1, 1), COMPLETE_FLOOR, floor)
    return COMPLETE_FLOOR if complete else floor


def orthogonalize_(matrices: torch.Tensor, floor=None) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of a (k, n, r) batch, in place.

    Every matrix is handled by its own norms, never one norm for the whole
    batch, and the result does not depend on a column's scale. A column that is
    zero, or numerically dependent on the columns before it (less than `floor`
    of its norm left once they are removed; default 1000 eps), becomes zero
    instead of noise, so P̂·P̂ᵀ is an orthogonal projection onto (a subspace of)
    the columns' span. (A later, independent column keeps its component along
    a dropped one only where Gram-Schmidt would have: the direction is lost from
    the span when a dependent column comes before an independent one, which
    needs a rank-deficient gradient meeting a particular partner.) With n < r
    only the first n columns can be independent; the rest become zero. Signs
    may differ from Gram-Schmidt's; PowerSGD's products do not depend on them.
    Non-finite input gives non-finite output for that matrix only.

    A matrix at full rank (r = min(n, m) of its gradient) takes a far lower
    floor, `dependence_floor(dtype, complete=True)` (a (k, 1) tensor sets one
    per matrix): there the projection must keep every direction, however small
    against the largest (a gradient's singular values can span 1e6 and more),
    or full rank is not the plain average on the step it matters. Only a zero
    column, or one float64 cannot tell from dependent, becomes zero; a direction
    that rounding made up is harmless there, as the columns then span the whole
    space the gradient lives in.

    Two methods, the same guarantees (tests/unit/test_compressor.py holds
    both), chosen by `method_for` the batch's device: a batched Householder QR
    (`torch.linalg.qr`: one op, LAPACK's loop inside on the CPU; on CUDA a
    cuSOLVER `orgqr` call per matrix, and a `geqrf` per matrix too past n =
    256), the default on the CPU; or a batched shifted CholeskyQR3 in float64
    (`_cholesky_qr_`), a fixed set of batched products, Cholesky
    factorisations and triangular solves whatever the batch, more ops a call
    (about 25 against 15) but none per matrix, the default elsewhere
    (docs/gpu.md). HOROVOD_POWERSGD_ORTHOGONALIZE=householder or cholesky
    chooses one everywhere, the same on every rank.

    Example:
        >>> p = torch.randn(3, 10, 2)
        >>> q = orthogonalize_(p)
        >>> torch.allclose(q.transpose(1, 2) @ q, torch.eye(2).expand(3, 2, 2), atol=1e-5)
        True
    """
    floor = DEPENDENT * torch.finfo(matrices.dtype).eps if floor is None else floor
    method = method_for(matrices.device)
    return (_cholesky_qr_ if method == "cholesky" else _householder_qr_)(matrices, floor)


def _householder_qr_(matrices: torch.Tensor, floor) -> torch.Tensor:
    """`orthogonalize_` by one batched Householder QR.

    Householder gives a dependent column an arbitrary direction, orthogonal to
    the others; below the floor it is zeroed, which drops that direction.
    """
    _peak_scaled_(matrices, dim=1)  # a non-zero column's norm is now at least 1
    initial = torch.linalg.vector_norm(matrices, dim=1)  # (k, r)
    q, r = torch.linalg.qr(matrices)  # q: (k, n, min(n, r))
    columns = q.shape[-1]
    alive = r.diagonal(dim1=1, dim2=2).abs() > floor * initial[:, :columns]  # zero: 0 > 0 false
    if columns < matrices.shape[-1]:
        matrices[:, :, columns:].zero_()
    torch.mul(q, alive.unsqueeze(1), out=matrices[:, :, :columns])
    return matrices


def _cholesky_qr_(matrices: torch.Tensor, floor) -> torch.Tensor:
    """`orthogonalize_` by batched shifted CholeskyQR3, in float64.

    Q = A·R⁻¹ with RᵀR = AᵀA + s·I, three times over (Fukaya et al., "Shifted
    Cholesky QR for computing the QR factorization of ill-conditioned
    matrices", SIAM J. Sci. Comput. 42(1), 2020): the shift s keeps the
    factorisation defined for dependent and zero columns and bounds the
    condition of the first Q, which the next two passes make orthonormal to
    float64's rounding. The first pass's Gram matrix is float64 too, so a
    float32 batch of condition 1e8 still resolves every direction that float32
    holds (squared it would be 1e16: float32 could not). The product of the
    passes' R is A's own R factor, whose diagonal says how much of each column
    was new: the same dependence test as Householder's. Columns are first
    scaled to unit norm (float64 squares float32's whole range without
    overflow; float64 input is scaled by its peak first). No step reads
    anything on the host (`cholesky_ex`); a matrix whose factorisation still
    failed gives zeros (nothing lost: its error buffer keeps the step), one
    with non-finite entries gives non-finite output.
    """
    _, n, r = matrices.shape
    if matrices.dtype == torch.float64:
        _peak_scaled_(matrices, dim=1)
    a = matrices.to(torch.float64)
    norms = torch.linalg.vector_norm(a, dim=1, keepdim=True)  # (k, 1, r)
    q = a / norms.clamp(min=torch.finfo(torch.float64).tiny)
    eps, eye = torch.finfo(torch.float64).eps, _identity(r, a.device)
    kept = failed = None
    for shift in (11 * (n * r + r * (r + 1)) * r * eps, (n + r) * eps, (n + r) * eps):
        # The first shift bounds the Gram matrix's rounding error for any r
        # unit columns; the others only keep a vanished column defined.
        low, info = torch.linalg.cholesky_ex(torch.baddbmm(eye, q.mT, q, beta=shift))
        q = torch.linalg.solve_triangular(low.mT, q, upper=True, left=False)
        diagonal = low.diagonal(dim1=1, dim2=2)
        kept, failed = (diagonal, info) if kept is None else (kept * diagonal, failed + info)
    # 1 for a column kept, 0 for one dropped or a failed matrix's, NaN (from the
    # norms' sum) throughout a matrix with a non-finite entry.
    keep = ((kept > floor) & (failed == 0).unsqueeze(1)) + norms.sum(dim=2) * 0
    return matrices.copy_(q * keep.unsqueeze(1))


_IDENTITIES: dict = {}


def _identity(size: int, device: torch.device) -> torch.Tensor:
    """A float64 identity matrix, made once per size and device (not one a call)."""
    key = (size, device)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = torch.eye(size, dtype=torch.float64, device=device)
    return _IDENTITIES[key]


def held() -> list[torch.Tensor]:
    """The tensors this module keeps between calls (its identities): a captured graph
    may read them (graphs.py)."""
    return list(_IDENTITIES.values())


# What P and Q of one matrix may reach on a float16 wire, summed over workers:
# 2^10 leaves 64x headroom below float16's largest number (65504) for a gradient
# that grows between steps, and 2^24 below it before float16 goes subnormal.
WIRE_TARGET = 2.0**10


def wire_scale(bound: torch.Tensor, workers: int, out=None) -> torch.Tensor:
    """The power of two that brings numbers up to `bound` to about 2^10 / workers
    (written into `out` where given: a buffer a captured graph reads).

    Powers of two scale exactly, and the scale only needs `bound`, computed
    from state identical on every rank, so every rank picks the same scale
    without a collective. Where `bound` is 0 or not finite the scale is 1.
    """
    exponent = torch.floor(torch.log2(WIRE_TARGET / workers / bound)).clamp_(-60, 60)
    usable = torch.isfinite(exponent) & (bound > 0)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(bound), out=out)
