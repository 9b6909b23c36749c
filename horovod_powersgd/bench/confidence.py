"""Pure statistics of the paired benchmark: intervals of ratios, when to stop, verdicts.

A paired job measures every configuration once per round (a short block of steps each),
so a configuration's block and the reference's block of the same round saw the same
machine. The ratio of the two per round cancels what slowed the whole machine in that
round; the rounds are then the independent samples.

The interval of their median comes from order statistics and needs no assumption on the
ratios' distribution (a busy machine makes it skewed): of n rounds, the number below the
true median is binomial(n, 1/2) whatever that distribution, so ``[x_(j), x_(n+1-j)]``, the
j-th smallest and j-th largest ratio, holds the median with probability at least
``1 - 2 P(B <= j - 1)``, computed here from the binomial coefficients. The depth j is the
largest that keeps this at the level asked for; with too few rounds none does, and the
interval is (-inf, inf): no interval. The same rounds always give the same interval.

The job looks at its intervals again and again (``check_due``) and stops when they first
look tight; a look that happens to be tight is likelier to miss, so the interval it stops
with covers less than each look's level. Every interval is therefore taken at 99 %
(``LOOK_CONFIDENCE``) to keep the one the job stops with, and the one a report renders
from its rounds, at 95 % or more (``CONFIDENCE``): tests/unit/test_bench_intervals.py
simulates the rule and bounds any rule that stops at one of the looks;
docs/benchmarks-method.md gives the numbers. 99 % needs 8 rounds (``MIN_ROUNDS``): the
range of 8 rounds misses the median with probability 2 / 2**8.

Example:
    >>> interval = ratio_interval([105, 104, 106, 105] * 3, [100, 100, 101, 99] * 3)
    >>> round(interval.median, 3), verdict(interval, 1.10), is_precise(interval, 0.05)
    (1.05, 'hit', True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

# What an interval the job stops with must cover, its repeated looks included.
CONFIDENCE = 0.95
# The level of every interval, at every look: what keeps CONFIDENCE after the looks.
LOOK_CONFIDENCE = 0.99
# The stopping rule: every needed interval's half-width within 1 % of its median.
TOLERANCE = 0.01


@dataclass(frozen=True)
class Interval:
    """A median and its confidence interval; (-inf, inf) when too few samples give one."""

    median: float
    lo: float
    hi: float

    @property
    def exists(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to its median (0.01 = +-1 %)."""
        return (self.hi - self.lo) / 2 / abs(self.median) if self.median else float("inf")

    def describe(self, unit: str = "") -> str:
        """``1.050x [1.040, 1.060]`` with unit "x"; says so when there is no interval."""
        if not self.exists:
            return f"{self.median:.3f}{unit} [no interval]"
        return f"{self.median:.3f}{unit} [{self.lo:.3f}, {self.hi:.3f}]"

    def __str__(self) -> str:
        return self.describe()


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


@cache
def order_depth(n: int, confidence: float) -> int:
    """The largest j whose ``[x_(j), x_(n+1-j)]`` of n samples holds their median with
    probability ``confidence`` or more; 0 when not even the range ``[x_(1), x_(n)]`` does.

    Example:
        >>> [order_depth(n, 0.95) for n in (5, 6, 20, 60)], order_depth(7, 0.99)
        ([0, 1, 6, 22], 0)
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    # Each sample lies below the median or above it, all 2**n patterns equally likely; the
    # interval at depth j misses when fewer than j lie below, or fewer than j above.
    depth, low_misses = 0, 0  # low_misses: the patterns with at most `depth` below
    while depth < n // 2:
        low_misses += math.comb(n, depth)
        if 2 * low_misses / 2**n > 1 - confidence:  # depth + 1 would miss too often
            break
        depth += 1
    return depth


def order_coverage(n: int, depth: int) -> float:
    """The probability that ``[x_(depth), x_(n+1-depth)]`` of n samples holds their median.

    Example:
        >>> order_coverage(8, 1), order_coverage(6, 1)
        (0.9921875, 0.96875)
    """
    return 1 - 2 * sum(math.comb(n, i) for i in range(depth)) / 2**n


def min_rounds_for(confidence: float) -> int:
    """The fewest samples that give an interval at ``confidence``.

    Example:
        >>> min_rounds_for(0.95), min_rounds_for(0.99)
        (6, 8)
    """
    n = 1
    while order_depth(n, confidence) == 0:
        n += 1
    return n


MIN_ROUNDS = min_rounds_for(LOOK_CONFIDENCE)


def median_interval(values: Sequence[float], *, confidence: float = LOOK_CONFIDENCE) -> Interval:
    """The median of ``values`` with its order-statistic interval (module docstring).

    Args:
        values: independent samples (here: one ratio per round).
        confidence: each interval's own coverage; the default keeps the one a paired job
            stops with at ``CONFIDENCE``.

    Example:
        >>> median_interval([1.0] * 8)
        Interval(median=1.0, lo=1.0, hi=1.0)
        >>> median_interval([1.0] * 7).exists  # 7 give no 99 % interval
        False
    """
    if not values:
        raise ValueError("no samples for an interval")
    ordered = sorted(values)
    depth = order_depth(len(ordered), confidence)
    if depth == 0:
        return Interval(median(ordered), -math.inf, math.inf)
    return Interval(median(ordered), ordered[depth - 1], ordered[-depth])


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
    """The median ratio of two configurations' per-round times, with its interval.

    Example:
        >>> print(ratio_interval([105, 315, 105] * 3, [100, 300, 100] * 3))
        1.050 [1.050, 1.050]
    """
    return median_interval(round_ratios(numerator, denominator), **kwargs)


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

    Stops when every needed interval is precise (after ``min_rounds`` at least; with
    fewer than ``MIN_ROUNDS`` no interval exists, and none is precise), or when one more
    round (it took ``round_s`` last time) would end past ``budget_s``. ``intervals`` None:
    not looked at this round (see ``check_due``), only the budget counts.

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
    """Whether to look at the intervals after this round: from ``min_rounds`` on (and from
    ``MIN_ROUNDS``, the fewest that give one), every tenth of the rounds so far. Every look
    is a chance to stop on an interval that happens to be tight, and ``LOOK_CONFIDENCE`` is
    what keeps the one stopped with at ``CONFIDENCE`` over these looks (module docstring):
    a rule that looks more often needs it checked again.

    Example:
        >>> [r for r in range(1, 40) if check_due(r, 8)]
        [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 24, 26, 28, 30, 33, 36, 39]
    """
    return rounds >= max(min_rounds, MIN_ROUNDS) and rounds % max(1, rounds // 10) == 0


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
