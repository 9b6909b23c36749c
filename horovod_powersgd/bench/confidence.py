"""Pure statistics of the paired benchmark: intervals of ratios, when to stop, verdicts.

A paired job measures every configuration once per round (a short block of steps each),
so a configuration's block and the reference's block of the same round saw the same
machine. The ratio of the two per round cancels what slowed the whole machine in that
round; the rounds are then the independent samples. The interval of their median is a
percentile bootstrap over rounds: no assumption on the shape of the ratios' distribution
(a busy machine makes it skewed), exact for the median of a few dozen rounds, and
deterministic with a fixed seed, so a report rendered again says the same.

Example:
    >>> interval = ratio_interval([105, 104, 106, 105], [100, 100, 101, 99])
    >>> round(interval.median, 3), verdict(interval, 1.10), is_precise(interval, 0.05)
    (1.05, 'hit', True)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# The stopping rule: every needed interval's half-width within 1 % of its median.
TOLERANCE = 0.01


@dataclass(frozen=True)
class Interval:
    """A median and its confidence interval."""

    median: float
    lo: float
    hi: float

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to its median (0.01 = +-1 %)."""
        return (self.hi - self.lo) / 2 / abs(self.median) if self.median else float("inf")

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count).

    Example:
        >>> median([3, 1, 2]), median([4, 1, 2, 3])
        (2, 2.5)
    """
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def bootstrap_median(
    values: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """The median of ``values`` with a percentile-bootstrap interval.

    Args:
        values: independent samples (here: one ratio per round).
        confidence: the interval's coverage, e.g. 0.95.
        resamples: bootstrap resamples; the same seed and values give the same interval.

    Example:
        >>> bootstrap_median([1.0, 1.0, 1.0])
        Interval(median=1.0, lo=1.0, hi=1.0)
    """
    if not values:
        raise ValueError("no samples to bootstrap")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    lo = stats[int(tail * resamples)]
    hi = stats[min(resamples - 1, int((1 - tail) * resamples))]
    return Interval(median(values), lo, hi)


def round_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per round, the numerator's time over the denominator's of the same round.

    Example:
        >>> round_ratios([2.0, 3.0], [1.0, 2.0])
        [2.0, 1.5]
    """
    if len(numerator) != len(denominator):
        raise ValueError(f"rounds differ: {len(numerator)} and {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator)]


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float], **kwargs) -> Interval:
    """The median ratio of two configurations' per-round times, with its interval."""
    return bootstrap_median(round_ratios(numerator, denominator), **kwargs)


def is_precise(interval: Interval, tolerance: float = TOLERANCE) -> bool:
    """Whether the interval is narrower than +-``tolerance`` of its median."""
    return interval.half_width < tolerance


def stop_reason(
    intervals: Sequence[Interval] | None,
    *,
    rounds: int,
    min_rounds: int,
    elapsed_s: float,
    budget_s: float,
    round_s: float,
    tolerance: float = TOLERANCE,
) -> str | None:
    """Why the run should stop after this round, or None to go on.

    Stops when every needed interval is precise (after ``min_rounds`` at least: a
    bootstrap of a handful of rounds is too coarse to trust), or when one more round
    (it took ``round_s`` last time) would end past ``budget_s``. ``intervals`` None: not
    computed this round (the bootstrap costs time; see ``check_due``), only the budget counts.

    Example:
        >>> stop_reason([Interval(1.0, 0.995, 1.005)], rounds=10, min_rounds=8,
        ...             elapsed_s=60, budget_s=900, round_s=6)
        'precise'
    """
    checked = intervals is not None and rounds >= min_rounds
    if checked and all(is_precise(i, tolerance) for i in intervals):
        return "precise"
    if elapsed_s + round_s > budget_s:
        return "budget"
    return None


def check_due(rounds: int, min_rounds: int) -> bool:
    """Whether to bootstrap the intervals after this round: from ``min_rounds`` on, every
    tenth of the rounds so far, so the checks cost a bounded share of the job.

    Example:
        >>> [r for r in range(1, 40) if check_due(r, 8)]
        [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 24, 26, 28, 30, 33, 36, 39]
    """
    return rounds >= min_rounds and rounds % max(1, rounds // 10) == 0


def verdict(interval: Interval, limit: float) -> str:
    """``hit`` when the whole interval is at or below ``limit``, ``missed`` when the whole
    interval is above it, ``not resolved`` while the limit lies inside it.

    Example:
        >>> [verdict(Interval(1.0, 0.99, 1.01), x) for x in (1.02, 0.98, 1.0)]
        ['hit', 'missed', 'not resolved']
    """
    if interval.hi <= limit:
        return "hit"
    if interval.lo > limit:
        return "missed"
    return "not resolved"


def slowdown_verdict(interval: Interval, expected: float) -> str:
    """An injected slowdown is measured when ``expected`` lies inside the interval and
    1.0 (no slowdown) does not.

    Example:
        >>> slowdown_verdict(Interval(1.05, 1.04, 1.06), 1.05)
        'measured'
        >>> slowdown_verdict(Interval(1.02, 0.99, 1.06), 1.05)
        'not resolved'
    """
    if interval.lo <= 1.0 <= interval.hi:
        return "not resolved"
    return "measured" if interval.lo <= expected <= interval.hi else "wrong"
