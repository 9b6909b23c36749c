"""Pure functions on tensors: matrix views, orthogonalisation, the float16 wire scale."""

from __future__ import annotations

import torch


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(n, m) of the matrix view of a tensor: first dimension by all the others.

    A conv weight (out, in, kh, kw) becomes (out, in·kh·kw).
    """
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return n, m


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


def orthogonalize_(matrices: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of a (k, n, r) batch, in place.

    One batched Householder QR (`torch.linalg.qr`), so the cost is a fixed
    number of operations whatever k and r (on a GPU each operation is a kernel
    launch; Gram-Schmidt needed about 10 per column). Every matrix is handled
    by its own norms, never one norm for the whole batch. A column that is zero,
    or numerically dependent on the columns before it (|R_jj| below 1000 eps of
    its norm), becomes zero instead of noise, so P̂·P̂ᵀ is always an orthogonal
    projection onto (a subspace of) the columns' span. (Householder gives a
    dependent column an arbitrary direction, orthogonal to the others; zeroing
    it drops that direction. A later, independent column keeps its component
    along it only where Gram-Schmidt would have: the direction is lost from the
    span when a dependent column comes before an independent one, which needs
    a rank-deficient gradient meeting a particular partner.) Signs may differ
    from Gram-Schmidt's; PowerSGD's products do not depend on them. With n < r
    only the first n columns can be independent; the rest become zero.
    Non-finite input gives non-finite output for that matrix only.

    Example:
        >>> p = torch.randn(3, 10, 2)
        >>> q = orthogonalize_(p)
        >>> torch.allclose(q.transpose(1, 2) @ q, torch.eye(2).expand(3, 2, 2), atol=1e-5)
        True
    """
    _peak_scaled_(matrices, dim=1)  # a non-zero column's norm is now at least 1
    initial = torch.linalg.vector_norm(matrices, dim=1)  # (k, r)
    q, r = torch.linalg.qr(matrices)  # q: (k, n, min(n, r))
    columns = q.shape[-1]
    kept = r.diagonal(dim1=1, dim2=2).abs()  # (k, min(n, r))
    # A column left with less than this fraction of its norm after removing the
    # columns before it is rounding noise, not a new direction: it counts as zero
    # (a zero column too: 0 > 0 is false).
    floor = 1000 * torch.finfo(matrices.dtype).eps
    alive = kept > floor * initial[:, :columns]
    if columns < matrices.shape[-1]:
        matrices[:, :, columns:].zero_()
    torch.mul(q, alive.unsqueeze(1), out=matrices[:, :, :columns])
    return matrices


# What P and Q of one matrix may reach on a float16 wire, summed over workers:
# 2^10 leaves 64x headroom below float16's largest number (65504) for a gradient
# that grows between steps, and 2^24 below it before float16 goes subnormal.
WIRE_TARGET = 2.0**10


def wire_scale(bound: torch.Tensor, workers: int) -> torch.Tensor:
    """The power of two that brings numbers up to `bound` to about 2^10 / workers.

    Powers of two scale exactly, and the scale only needs `bound`, computed
    from state identical on every rank, so every rank picks the same scale
    without a collective. Where `bound` is 0 or not finite the scale is 1.
    """
    exponent = torch.floor(torch.log2(WIRE_TARGET / workers / bound)).clamp_(-60, 60)
    usable = torch.isfinite(exponent) & (bound > 0)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(bound))
