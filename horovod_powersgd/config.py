"""PowerSGDConfig: the tuning knobs of PowerSGD, validated once, up front.

Validation happens here, before the optimizer issues any collective, so that
a bad value fails on every rank alike: the settings in the constructor, and
the other arguments of `DistributedOptimizer` that need no Horovod to check
(`check_groups`, `check_named_parameters`, `check_log_every`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .collectives import parse_latency, parse_rate
from .stepmodel import factor_sizes

# The floating dtypes Horovod 0.28 can all-reduce (CPU and CUDA alike): what P, Q
# and gradients may travel in. bfloat16 is not among them: bfloat16 gradients
# travel as float32 copies, and comm_dtype bfloat16 is refused.
COMM_DTYPES = (torch.float16, torch.float32, torch.float64)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class PowerSGDConfig:
    """Settings of the PowerSGD compressor.

    How to tune:
      * ``rank``: 1-4 for CNNs (the paper trains ResNet-18 on CIFAR-10 at
        rank 2 to full-SGD accuracy), about 4 for an LSTM language model, 4-16
        for a transformer; measured ranks are in docs/results/convergence.md.
        Bytes per step grow linearly with rank.
      * ``start_iter``: steps of uncompressed all-reduce before compression
        starts. 0 (the default) keeps every step compressed; one plain step
        sends as much as about 100 compressed ones at rank 2. Set it to the
        end of the learning-rate warm-up when there is one, or with a large
        learning rate (docs/results/convergence.md).
      * ``min_compression_rate``: tensors that would not shrink at least this
        much are sent as they are; they ride in the same collective as P.

    Example:
        >>> PowerSGDConfig(rank=4, start_iter=100).rank
        4
    """

    # --- tuned by users -------------------------------------------------------
    # Rank r of the approximation P·Qᵀ; capped per tensor at min(n, m). "auto":
    # chosen per bucket from measurements of this job (tuner.py), up to max_rank.
    rank: int | str = 2
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
    # --- rank="auto" (tuner.py) ------------------------------------------------------
    # The highest rank of the ladder auto chooses from (1, 2, 4, ... up to it).
    max_rank: int = 16
    # The link to plan for instead of the one measured, e.g. "50mbit" or
    # "1gbit,2ms" (bandwidth per link, then the all-reduce latency): to test,
    # or to train with a slow link's decisions on a fast one. None: measured.
    auto_link: str | None = None
    # --- nodes (hierarchy.py) -------------------------------------------------------
    # Exact inside a node, compressed between nodes, each node's compression
    # shared by its workers: True, False, or "auto" (on for several nodes of
    # several workers each, where Horovod's process sets allow it).
    hierarchical: bool | str = False
    # --- statistics (monitor.py) --------------------------------------------------
    # Per-layer quality and the early warning; off saves a norm per gradient and
    # error buffer per step and a small all-reduce every 10 steps.
    layer_stats: bool = True
    # --- accelerators (graphs.py) ---------------------------------------------------
    # Capture the compressor's local work as CUDA graphs once the step's layout is
    # settled, and replay them: a few launches a step instead of hundreds. Eager on
    # the CPU; with rank="auto" once its plan is settled.
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.rank != "auto" and (not _is_int(self.rank) or self.rank < 1):
            raise ValueError(f'rank must be an integer >= 1 or "auto", got {self.rank!r}')
        if not _is_int(self.max_rank) or self.max_rank < 1:
            raise ValueError(f"max_rank must be an integer >= 1, got {self.max_rank!r}")
        if self.auto_link is not None:
            parse_link(self.auto_link)
        if self.rounds not in (1, 2) or not _is_int(self.rounds):
            raise ValueError(f"rounds must be 1 or 2, got {self.rounds!r}")
        if not _is_int(self.start_iter) or self.start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {self.start_iter!r}")
        rate = self.min_compression_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not rate >= 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        if rate == float("inf"):
            raise ValueError("min_compression_rate must be finite; use rank=... or plain Horovod")
        flags = ("error_feedback", "warm_start", "sparse_as_dense", "layer_stats", "cuda_graphs")
        for flag in flags:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not _is_int(self.drift_check_every) or self.drift_check_every < 0:
            raise ValueError(
                f"drift_check_every must be an integer >= 0, got {self.drift_check_every!r}"
            )
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (isinstance(self.hierarchical, bool) or self.hierarchical == "auto"):
            raise ValueError(
                f'hierarchical must be True, False or "auto", got {self.hierarchical!r}'
            )
        if self.comm_dtype is not None and self.comm_dtype not in COMM_DTYPES:
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} cannot be sent: Horovod all-reduces only "
                f"{', '.join(str(d) for d in COMM_DTYPES)} (or None: the compute dtype); use "
                "torch.float16 to halve P/Q bytes"
            )
        if not _is_int(self.backward_passes_per_step) or self.backward_passes_per_step < 1:
            raise ValueError(
                "backward_passes_per_step must be an integer >= 1, "
                f"got {self.backward_passes_per_step!r}"
            )
        factor = self.gradient_predivide_factor
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")

    @property
    def auto(self) -> bool:
        return self.rank == "auto"

    def ladder(self) -> tuple[int, ...]:
        """The ranks auto chooses from: powers of two up to `max_rank`, and max_rank."""
        ranks = [2**i for i in range(self.max_rank.bit_length()) if 2**i <= self.max_rank]
        return tuple(sorted({*ranks, self.max_rank}))

    def matrix_rank(self, n: int, m: int, rank: int | None = None) -> int:
        """The rank used for an n x m matrix: `rank` (default: the configured one), capped."""
        return min(self.rank if rank is None else rank, n, m)

    def compresses(self, shape: torch.Size, rank: int | None = None) -> bool:
        """Whether a gradient of this shape is sent as P and Q at `rank` (the rate test,
        `stepmodel.factor_sizes`)."""
        if (rank is None and self.auto) or rank == 0:
            return False
        rank = self.rank if rank is None else rank
        return factor_sizes(shape, rank, self.min_compression_rate) is not None


def parse_link(text: str) -> tuple[float, float]:
    """(bytes per second, latency in seconds) of a link like "50mbit" or "1gbit,2ms".

    Example:
        >>> parse_link("50mbit"), parse_link("1gbit,0.5ms")
        ((6250000.0, 0.001), (125000000.0, 0.0005))
    """
    rate, comma, latency = str(text).replace(" ", "").partition(",")
    try:
        return parse_rate(rate), parse_latency(latency) if comma else 1e-3
    except ValueError:
        raise ValueError(
            f'a link must read like "50mbit" or "1gbit,2ms" (a rate, collectives.parse_rate, '
            f"then optionally the latency of one all-reduce; 1 ms unless given), got {text!r}"
        ) from None


def check_log_every(log_every) -> None:
    """`log_every` of DistributedOptimizer: an integer >= 0 (may differ between ranks)."""
    if not _is_int(log_every) or log_every < 0:
        raise ValueError(f"log_every must be an integer >= 0, got {log_every!r}")


def check_groups(groups) -> None:
    """Horovod's validation of `groups`: None, an integer > 0, or lists of tensors."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if not _is_int(groups) or groups <= 0:
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor."
        )


def check_named_parameters(optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """The (name, parameter) pairs of the optimizer's parameters: unique names, none missing."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        # Like Horovod: positional names, identical on ranks that build the same optimizer.
        return [
            (f"group{i}.param{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    named_parameters = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, usually "
            "produced by model.named_parameters()"
        )
    seen, dups = set(), []
    for name, _ in named_parameters:
        if name in seen:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [i for i, p in enumerate(params) if id(p) not in named_ids]
    if unnamed:
        shapes = [tuple(params[i].shape) for i in unnamed[:5]]
        raise ValueError(
            f"{len(unnamed)} parameter(s) of the optimizer are missing from named_parameters "
            f"(shapes {shapes}); pass model.named_parameters() of the model being optimized"
        )
    param_ids = {id(p) for p in params}
    return [(name, p) for name, p in named_parameters if id(p) in param_ids]
