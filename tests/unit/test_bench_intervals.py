"""The paired benchmark's intervals hold the true median as often as they claim: at a fixed
number of rounds, and at the round where the job's stopping rule ends it.

Simulated jobs, seeded (the same jobs every run): per-round ratios independent around a
known median with a spread of 2-3 %, normal and right-skewed (the shape a busy machine
gives), each round's two blocks also scaled alike by a machine load that pairing cancels.
"""

import itertools
import math
import random

import pytest

from horovod_powersgd.bench import confidence

TRUE_MEDIAN = 1.035
# 1000 jobs a case. The intervals reach about 98 % under the stopping rule and 99 % or more
# at a fixed count; at 98 % the estimate's binomial standard error is
# sqrt(0.98 * 0.02 / 1000) = 0.44 %, so 94 % lies 9 standard errors below it: no seed turns
# a sound interval into a failure. The percentile bootstrap this replaced reached 87-88 %
# under the rule, 95 % intervals of order statistics at every look 92.5-95 %: both fail.
JOBS = 1000
BOUND = 0.94
SHAPES = ("normal", "skewed")
SPREADS = (0.02, 0.03)


def _ratio(rng: random.Random, shape: str, spread: float) -> float:
    if shape == "normal":
        return TRUE_MEDIAN + spread * rng.gauss(0, 1)
    # An exponential's median is ln 2 and its standard deviation 1: skewed right, median kept.
    return TRUE_MEDIAN + spread * (rng.expovariate(1.0) - math.log(2))


def _job(rng: random.Random, shape: str, spread: float, rounds: int):
    """Per-round block times of plain Horovod and of the configuration it is compared to."""
    plain = [100.0 * rng.uniform(1.0, 1.5) for _ in range(rounds)]  # the machine's load
    return [p * _ratio(rng, shape, spread) for p in plain], plain


def _stopped_interval(slowed, plain, budget_rounds: int):
    """The interval a paired job (paired.Job.decide) stops with, as its report renders it,
    and why it stopped."""
    for rounds in range(1, budget_rounds + 1):
        intervals = None
        if confidence.check_due(rounds, confidence.MIN_ROUNDS):
            intervals = [confidence.ratio_interval(slowed[:rounds], plain[:rounds])]
        # One round a second: the budget ends the job after budget_rounds rounds.
        reason = confidence.stop_reason(
            intervals,
            rounds=rounds,
            min_rounds=confidence.MIN_ROUNDS,
            elapsed_s=rounds,
            budget_s=budget_rounds,
            round_s=1.0,
        )
        if reason is not None:
            break
    return confidence.ratio_interval(slowed[:rounds], plain[:rounds]), reason


def _coverage(intervals) -> float:
    intervals = list(intervals)
    return sum(i.lo <= TRUE_MEDIAN <= i.hi for i in intervals) / len(intervals)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rounds", [8, 13, 20, 40, 60])
def test_interval_covers_the_median_at_a_fixed_number_of_rounds(shape, spread, rounds):
    rng = random.Random(f"fixed-{shape}-{spread}-{rounds}")
    jobs = (_job(rng, shape, spread, rounds) for _ in range(JOBS))
    assert _coverage(confidence.ratio_interval(s, p) for s, p in jobs) >= BOUND


@pytest.mark.parametrize("shape", SHAPES)
# Budgets where most jobs stop on a tight interval, not at the budget: about 45 rounds
# reach +-1 % at a 2 % spread, about 95 at 3 %.
@pytest.mark.parametrize(("spread", "budget_rounds"), [(0.02, 60), (0.03, 150)])
def test_interval_covers_the_median_where_the_stopping_rule_ends_the_job(
    shape, spread, budget_rounds
):
    rng = random.Random(f"stopped-{shape}-{spread}-{budget_rounds}")
    jobs = [_job(rng, shape, spread, budget_rounds) for _ in range(JOBS)]
    stopped = [_stopped_interval(s, p, budget_rounds) for s, p in jobs]
    assert _coverage(interval for interval, _ in stopped) >= BOUND
    # The rule, not the budget, ended most of them: what the repeated looks cost is in.
    assert sum(reason == "precise" for _, reason in stopped) >= 0.75 * JOBS


def _all_looks_cover(max_rounds: int) -> float:
    """The probability that every look of ``check_due`` up to ``max_rounds`` holds the median.

    Distribution-free and exact: an interval of order statistics holds the median unless
    too few samples lie on one side of it, and each sample lies below it with probability
    1/2, independently; so follow the count below through the rounds.
    """
    chance = [1.0]  # chance[b]: b samples below the median so far, every look held
    for n in range(1, max_rounds + 1):
        chance = [
            (chance[b] if b < n else 0.0) / 2 + (chance[b - 1] if b else 0.0) / 2
            for b in range(n + 1)
        ]
        if confidence.check_due(n, confidence.MIN_ROUNDS):
            depth = confidence.order_depth(n, confidence.LOOK_CONFIDENCE)
            chance = [c if depth <= b <= n - depth else 0.0 for b, c in enumerate(chance)]
    return sum(chance)


def test_any_rule_that_stops_at_a_look_keeps_95_percent_up_to_100_rounds():
    # Whatever decides at which look to stop (even one that saw the true median), the
    # interval it stops with holds the median when every look's did.
    assert _all_looks_cover(100) >= confidence.CONFIDENCE


@pytest.mark.parametrize("n", [6, 8, 9, 12, 15])
def test_order_statistic_coverage_matches_every_sign_pattern(n):
    """Against brute force: all 2**n ways the samples can fall below or above the median."""
    for confidence_level in (0.95, 0.99):
        depth = confidence.order_depth(n, confidence_level)
        if depth == 0:
            assert n < confidence.min_rounds_for(confidence_level)
            continue
        held = sum(
            depth <= sum(signs) <= n - depth for signs in itertools.product((0, 1), repeat=n)
        )
        assert held / 2**n == confidence.order_coverage(n, depth) >= confidence_level
        deeper = confidence.order_coverage(n, depth + 1) if depth < n // 2 else 0.0
        assert deeper < confidence_level  # the narrowest that keeps the level


def test_too_few_rounds_give_no_interval_and_no_verdict():
    interval = confidence.median_interval([1.05, 1.04, 1.06, 1.05, 1.05, 1.04, 1.06])
    assert not interval.exists and "no interval" in str(interval)
    assert confidence.verdict(interval, 1.10) == "not resolved"
    assert confidence.slowdown_verdict(interval, 1.05) == "not resolved"
    assert not confidence.is_precise(interval)
    assert confidence.MIN_ROUNDS == 8
    assert not confidence.check_due(7, 5)  # no look before an interval can exist
