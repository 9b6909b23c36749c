"""Pure helpers of the benchmark: percentiles, per-step aggregation, result records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# The keys of a JSON record, in the order the report shows them.
RECORD_KEYS = (
    "config",
    "model",
    "rank",
    "np",
    "bandwidth",
    "median_step_ms",
    "p10_step_ms",
    "p90_step_ms",
    "elements_per_step",
    "bytes_per_step",
    "compression_ratio",
    "peak_rss_mb",
    "detail",
    "round_ms",
    "settings",
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics.

    Same definition as numpy's default (``method="linear"``).

    Example:
        >>> percentile([1, 2, 3, 4], 50), percentile([10, 20], 10)
        (2.5, 11.0)
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def slowest_rank_step_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step i's time as the slowest rank saw it: synchronous training waits for it.

    Example:
        >>> slowest_rank_step_times([[1.0, 5.0], [2.0, 3.0]])
        [2.0, 5.0]
    """
    if not per_rank:
        raise ValueError("no ranks reported step times")
    lengths = {len(times) for times in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(lengths)}")
    return [max(column) for column in zip(*per_rank)]


@dataclass
class Record:
    """One configuration's result: one row of the table, one JSON object."""

    config: str
    model: str
    rank: int | None  # PowerSGD matrix rank; None where nothing is low-rank
    np: int  # number of worker processes
    bandwidth: str  # "unlimited", "1gbit", ...
    median_step_ms: float
    p10_step_ms: float
    p90_step_ms: float
    elements_per_step: float  # elements one worker hands to collectives per step
    bytes_per_step: float  # the same in bytes, at the dtype sent
    compression_ratio: float | None  # plain fp32 all-reduce bytes / bytes_per_step
    peak_rss_mb: float  # largest peak resident set size over the workers
    detail: str = ""  # rank="auto": the plan it settled on and the link it measured
    # A paired job (every configuration in one job): the block median of each round, the
    # same rounds for every configuration of the job. None: a job of its own.
    round_ms: list[float] | None = None
    # How the job ran (workers, steps, how it stopped); None in records written before.
    settings: dict | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in RECORD_KEYS}


def make_record(
    *,
    config: str,
    model: str,
    rank: int | None,
    np: int,
    bandwidth: str,
    step_times_s: Sequence[Sequence[float]],
    elements_per_step: float,
    bytes_per_step: float,
    plain_bytes_per_step: float,
    peak_rss_mb: Sequence[float],
    detail: str = "",
    settings: dict | None = None,
) -> Record:
    """Fold the per-rank reports of one configuration into a Record.

    Args:
        step_times_s: per rank, the seconds of each timed step.
        plain_bytes_per_step: what a plain fp32 all-reduce of every gradient sends,
            the reference of ``compression_ratio`` (None when nothing is sent).
    """
    steps = slowest_rank_step_times(step_times_s)
    ratio = plain_bytes_per_step / bytes_per_step if bytes_per_step > 0 else None
    return Record(
        config=config,
        model=model,
        rank=rank,
        np=np,
        bandwidth=bandwidth,
        median_step_ms=1e3 * percentile(steps, 50),
        p10_step_ms=1e3 * percentile(steps, 10),
        p90_step_ms=1e3 * percentile(steps, 90),
        elements_per_step=float(elements_per_step),
        bytes_per_step=float(bytes_per_step),
        compression_ratio=ratio,
        peak_rss_mb=max(peak_rss_mb),
        detail=detail,
        settings=settings,
    )
