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
    residuals that bfloat16 would round away, and Gram-Schmidt needs the range.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


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
