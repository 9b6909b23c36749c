"""rank="auto": which buckets to compress, and at which rank, from measurements of this job.

Pure: no Horovod and no tensor math. `tuner.py` measures, asks here, and
applies the answer. A plan gives every bucket (the reducer's unit of
communication, in the order backward produces them) a rank: 0 sends it as the
user's `compression` does (plain), r >= 1 sends its compressible tensors as
PowerSGD factors of rank r. A plan's step is the step model's (stepmodel.py:
`predict` from the job's `Measurements`); here is only the choosing.

`choose` minimises that over per-bucket ranks (coordinate descent from every
uniform plan), then, among plans within `tolerance` of the shortest, takes
the preferred one: plain, then the lowest rank, bucket by bucket. The model is
only a guide: the tuner measures the real step time of a few `candidates`
before it settles, and `pick_measured` takes the preferred of those measured
within the trials' noise (`margin`) of the fastest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .stepmodel import PLAIN, Bucket, Measurements, NodeSteps, predict, uniform


def _accuracy(rank: int) -> float:
    """Higher is closer to the exact average: plain, then the highest rank."""
    return math.inf if rank == PLAIN else rank


def _preference(rank: int) -> float:
    """Higher is preferred where plans are as fast: plain (the exact average, and nothing
    to gain from compressing), then the lowest rank (the fewest bytes on the wire)."""
    return math.inf if rank == PLAIN else -rank


def _choices(m: Measurements | NodeSteps, bucket: Bucket) -> list[int]:
    """A bucket's ranks: plain, and those it can be compressed at (where it can be, only
    those under hierarchical PowerSGD: `NodeSteps.compress_all`)."""
    ranks = sorted(bucket.options)
    return ranks if ranks and m.compress_all else [PLAIN, *ranks]


def _uniform(m: Measurements | NodeSteps, rank: int) -> list[int]:
    """Every bucket at `rank` (`uniform`); under `compress_all` a bucket that cannot take
    it takes its nearest rank below (or its lowest), never plain."""
    if not m.compress_all:
        return uniform(m, rank)
    return [
        max((r for r in b.options if r <= rank), default=min(b.options)) if b.options else PLAIN
        for b in m.buckets
    ]


def _descend(m: Measurements, plan: list[int], passes: int = 3) -> tuple[list[int], float]:
    """Coordinate descent: each bucket's fastest choice given the others', until stable."""
    best = predict(m, plan)
    for _ in range(passes):
        moved = False
        for b, bucket in enumerate(m.buckets):
            for rank in _choices(m, bucket):
                trial = [*plan[:b], rank, *plan[b + 1 :]]
                seconds = predict(m, trial)
                if seconds < best - 1e-12:
                    plan, best, moved = trial, seconds, True
        if not moved:
            break
    return plan, best


def fastest(m: Measurements, ladder: Sequence[int]) -> tuple[list[int], float]:
    """The plan of the shortest predicted step (descent from every uniform plan)."""
    starts = ladder if m.compress_all else (PLAIN, *ladder)
    results = [_descend(m, _uniform(m, rank)) for rank in starts]
    return min(results, key=lambda result: result[1])


def preferred_within(m: Measurements, plan: Sequence[int], budget_s: float) -> list[int]:
    """`plan` with each bucket moved to its preferred choice (plain, then the lowest rank)
    that keeps the predicted step <= budget, bucket by bucket."""
    plan = list(plan)
    for b, bucket in enumerate(m.buckets):
        for rank in sorted(_choices(m, bucket), key=_preference, reverse=True):
            if _preference(rank) <= _preference(plan[b]):
                break
            trial = [*plan[:b], rank, *plan[b + 1 :]]
            if predict(m, trial) <= budget_s:
                plan = trial
                break
    return plan


def choose(m: Measurements, ladder: Sequence[int], tolerance: float = 0.03) -> list[int]:
    """The plan: the preferred among those within `tolerance` of the shortest step (plain,
    then the lowest rank, bucket by bucket).

    Example:
        >>> from horovod_powersgd.collectives import Hop
        >>> from horovod_powersgd.stepmodel import Option
        >>> fast = Hop(latency_s=1e-4, bytes_per_s=1e10)
        >>> option = Option(compress_s=0.002, work_s=0.005, round1_bytes=1e4, round2_bytes=1e4)
        >>> b = Bucket(ready_s=0.05, plain_bytes=4e6, options={2: option})
        >>> m = Measurements((b,), backward_s=0.05, step_s=0.1, link=fast)
        >>> choose(m, [2]), choose(m.with_link(Hop(1e-3, 6.25e6)), [2])  # 10 Gbit/s, 50 Mbit/s
        ([0], [2])
    """
    plan, shortest = fastest(m, ladder)
    return preferred_within(m, plan, shortest * (1 + tolerance))


def hierarchical_pays(
    flat: Measurements, nodes: NodeSteps, ladder: Sequence[int], tolerance: float = 0.03
) -> tuple[bool, float, float]:
    """Whether to run hierarchical PowerSGD (hierarchical="auto" with rank="auto"): where
    the predicted step of its `choose`n plan is shorter than flat's by more than
    `tolerance`. Returns that and the two steps (flat, hierarchical)."""
    flat_s = predict(flat, choose(flat, ladder, tolerance))
    nodes_s = predict(nodes, choose(nodes, ladder, tolerance))
    return nodes_s < flat_s * (1 - tolerance), flat_s, nodes_s


# A plan the model expects this many times slower than its choice is not tried:
# the model has been off by up to 1.5x on a loaded 2-core machine, never by 3x,
# and trying plain on a slow link costs steps many times as long.
HOPELESS = 3.0


def candidates(m: Measurements, ladder: Sequence[int], tolerance: float = 0.03) -> list[list[int]]:
    """Plans worth timing for real: the model's choice, plain, the two best uniform ones
    (those the model expects at most `HOPELESS` times slower than its choice)."""
    chosen = choose(m, ladder, tolerance)
    limit = HOPELESS * predict(m, chosen)
    uniforms = sorted((_uniform(m, r) for r in ladder), key=lambda plan: predict(m, plan))
    out: list[list[int]] = []
    plain = [] if m.compress_all else [uniform(m, PLAIN)]
    for plan in (chosen, *plain, *uniforms[:2]):
        if plan not in out and predict(m, plan) <= limit:
            out.append(plan)
    return out


# A plan counts as faster than another only where a one-sided test at this level says so
# (`margin`): were the two as fast, with normal errors, it would be measured that much
# faster in one comparison in 10^4, whatever the number of steps its noise is known from.
NOISE_ALPHA = 1e-4
# Student's t at 1 - NOISE_ALPHA by degrees of freedom, 1 to 30 (more take 30's, a little
# above theirs): the t where betainc(df / 2, 1 / 2, 0, df / (df + t^2), regularized) / 2
# is NOISE_ALPHA (mpmath, bisection), rounded up to 0.01 (tests/unit/test_planner.py
# integrates the tail again).
T_QUANTILE = (
    3183.1, 70.71, 22.21, 13.04, 9.68, 8.03, 7.07, 6.45, 6.02, 5.7, 5.46, 5.27, 5.12, 4.99, 4.88,
    4.8, 4.72, 4.65, 4.59, 4.54, 4.5, 4.46, 4.42, 4.39, 4.36, 4.33, 4.3, 4.28, 4.26, 4.24,
)  # fmt: skip


def margin(groups: Sequence[Sequence[float]], steps: int, tolerance: float = 0.03) -> float:
    """How much faster than another a timed plan must be measured to count as faster,
    relative: the larger of `tolerance` and the trials' noise, the standard error of the
    difference between two plans' mean steps over `steps` timed steps each, times Student's
    t at 1 - NOISE_ALPHA (`T_QUANTILE`: the spread is estimated from few steps).

    The spread of one step comes from `groups` (each the step times of one plan; the
    non-finite ones left out), pooled about each group's own mean relative to it: the
    step's jitter, not the plans' differences. Where no group has two steps, `tolerance`.

    Example:
        >>> plain, compressed = [1.00, 1.10, 0.90, 1.00], [0.95, 1.05, 0.85, 0.95]
        >>> round(margin([plain, compressed], steps=4), 3)  # 8.03 x 8.4 % x (2 / 4) ** 0.5
        0.476
    """
    squares, freedom = 0.0, 0
    for group in groups:
        times = [t for t in group if math.isfinite(t)]
        if len(times) < 2:
            continue
        mean = sum(times) / len(times)
        squares += sum((t / mean - 1) ** 2 for t in times)
        freedom += len(times) - 1
    if not freedom:
        return tolerance
    t = T_QUANTILE[min(freedom, len(T_QUANTILE)) - 1]
    return max(tolerance, t * math.sqrt(squares / freedom) * math.sqrt(2 / steps))


def pick_measured(
    plans: Sequence[Sequence[int]],
    steps: Sequence[Sequence[float]],
    tolerance: float = 0.03,
    spread: Sequence[Sequence[float]] = (),
) -> tuple[list[int], float]:
    """Of plans timed for real (`steps`: each plan's timed step times), the preferred of
    those whose mean step is within the `margin` of the fastest: the one with the most
    plain buckets, then the lowest ranks (their sum), then the faster. Returns the plan
    and the margin.

    The margin is the larger of `tolerance` and the trials' noise, from the spread of
    `steps` and of `spread` (more groups of steps of one plan each, e.g. the plain steps
    measured before the trials). So plain stays unless a compressed plan was measured
    faster than it by more than the noise, a bucket stays plain where a plan that sends it
    plain is as fast, and of the compressed plans as fast as the fastest, the one of the
    lowest ranks is taken.

    Example:
        >>> plans = [[0, 0], [1, 1], [2, 2]]
        >>> steps = [[1.00, 1.10, 0.90, 1.00], [0.95, 1.05, 0.85, 0.95], [2.0, 2.1, 1.9, 2.0]]
        >>> plan, noise = pick_measured(plans, steps)  # rank 1: 5 % faster, in 31 % noise
        >>> plan, round(noise, 2)
        ([0, 0], 0.31)
    """
    seconds = [sum(g) / len(g) for g in steps]
    noise = margin([*spread, *steps], min(len(g) for g in steps), tolerance)
    shortest = min(seconds)
    near = [(list(p), s) for p, s in zip(plans, seconds) if s <= shortest * (1 + noise)]

    def preference(timed):
        plan, s = timed
        return sum(r == PLAIN for r in plan), -sum(plan), -s

    return max(near, key=preference)[0], noise


def raise_failing(
    m: Measurements, plan: Sequence[int], failing: Sequence[int], budget_s: float
) -> list[int]:
    """`plan` with each failing bucket (its approximation fails) one step more accurate,
    where the step stays within `budget_s`."""
    plan = list(plan)
    for b in failing:
        more = [r for r in _choices(m, m.buckets[b]) if _accuracy(r) > _accuracy(plan[b])]
        for rank in sorted(more, key=_accuracy):
            trial = [*plan[:b], rank, *plan[b + 1 :]]
            if predict(m, trial) <= budget_s:
                plan = trial
            break
    return plan
