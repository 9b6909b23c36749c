"""PowerSGDConfig: the tuning knobs of PowerSGD, validated once, up front.

Validation happens here, in the constructor, so that a bad value fails on
every rank before the optimizer issues any collective.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class PowerSGDConfig:
    """Settings of the PowerSGD compressor.

    How to tune:
      * ``rank``: 1-4 is enough for CNNs (the paper trains ResNet-18 on
        CIFAR-10 at rank 2 to full-SGD accuracy); the LSTM language model
        matched plain Horovod at 4 (docs/results/convergence.md); the AdamW
        transformer example, after its 8-epoch cosine, was level with plain at
        4 (-1.2 %) and ahead at 16 (-6.8 %; means of 2 seeds). Bytes per step grow
        linearly with rank.
      * ``start_iter``: steps of uncompressed all-reduce before compression
        starts. 0 (the default) keeps every step compressed; one plain step
        sends as much as ~100 compressed ones (rank 2, the examples' CNN).
        Set it to the end of the learning-rate warm-up when there is one, or
        with a large learning rate. On the Fashion-MNIST CNN at lr 0.02, 100
        or 469 plain steps changed accuracy by less than the seed spread
        (docs/results/convergence.md).
      * ``min_compression_rate``: tensors that would not shrink at least this
        much are sent as they are; they ride in the same collective as P.

    Example:
        >>> PowerSGDConfig(rank=4, start_iter=100).rank
        4
    """

    # --- tuned by users -------------------------------------------------------
    # Rank r of the approximation P·Qᵀ; capped per tensor at min(n, m).
    rank: int = 2
    # All-reduce rounds per step: 2 = P, then Q (the paper); 1 = alternately Q
    # and P (the authors' current code), half the bytes and no round after backward.
    rounds: int = 2
    # Steps of plain (uncompressed) all-reduce before compression starts.
    start_iter: int = 0
    # Compress an n x m matrix only if n·m >= rate · r · (n + m).
    min_compression_rate: float = 2.0
    # Keep what compression dropped and add it back next step.
    error_feedback: bool = True
    # Reuse last step's Q (one power-iteration step per SGD step) instead of a fresh random Q.
    warm_start: bool = True
    # Seed of the random Q; the same on every rank, so P = M·Q can be summed.
    seed: int = 0
    # dtype compressed steps send P, Q and uncompressed gradients in (None: their own);
    # orthogonalisation stays float32 or wider.
    comm_dtype: torch.dtype | None = None
    # Compare a checksum of the parameters (and their optimizer state) across
    # ranks every this many steps, and repair a difference from the first rank
    # (0: never). Ranks rebuild P̂·Q_avgᵀ themselves, so processors or thread
    # counts that round differently make them drift apart (guard.py).
    drift_check_every: int = 100
    # --- Horovod semantics ------------------------------------------------------
    # Local backward passes accumulated before one communication step.
    backward_passes_per_step: int = 1
    # Average divides by the number of workers (in two halves, see Horovod's docs).
    gradient_predivide_factor: float = 1.0
    # Make sparse gradients dense (then compressed like any other) instead of refusing them.
    sparse_as_dense: bool = False
    # --- statistics (monitor.py) --------------------------------------------------
    # Per-layer quality and the early warning; off saves a norm per gradient and
    # error buffer per step and a small all-reduce every 10 steps.
    layer_stats: bool = True

    def __post_init__(self):
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {self.rank!r}")
        if self.rounds not in (1, 2) or not _is_int(self.rounds):
            raise ValueError(f"rounds must be 1 or 2, got {self.rounds!r}")
        if not _is_int(self.start_iter) or self.start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {self.start_iter!r}")
        rate = self.min_compression_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not rate >= 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        if rate == float("inf"):
            raise ValueError("min_compression_rate must be finite; use rank=... or plain Horovod")
        for flag in ("error_feedback", "warm_start", "sparse_as_dense", "layer_stats"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not _is_int(self.drift_check_every) or self.drift_check_every < 0:
            raise ValueError(
                f"drift_check_every must be an integer >= 0, got {self.drift_check_every!r}"
            )
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.comm_dtype is not None and self.comm_dtype not in _COMM_DTYPES:
            raise ValueError(
                "comm_dtype must be None or a floating dtype "
                f"({', '.join(str(d) for d in _COMM_DTYPES)}), got {self.comm_dtype!r}"
            )
        if not _is_int(self.backward_passes_per_step) or self.backward_passes_per_step < 1:
            raise ValueError(
                "backward_passes_per_step must be an integer >= 1, "
                f"got {self.backward_passes_per_step!r}"
            )
        factor = self.gradient_predivide_factor
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")

    def matrix_rank(self, n: int, m: int) -> int:
        """The rank used for an n x m matrix: the configured rank, capped at min(n, m)."""
        return min(self.rank, n, m)

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a gradient of this shape is sent as P and Q (the rate test)."""
        if len(shape) < 2:
            return False
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        if n == 0 or m == 0:
            return False
        r = self.matrix_rank(n, m)
        return n * m >= self.min_compression_rate * r * (n + m)
