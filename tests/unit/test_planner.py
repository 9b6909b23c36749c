"""rank="auto"'s choices from given measurements (planner.py), in one process."""

import math

import pytest

from horovod_powersgd import planner
from horovod_powersgd.planner import PLAIN, Bucket, Link, Measurements, Option

MB = 1e6
FAST = Link(latency_s=50e-6, bytes_per_s=5e9)  # about 40 Gbit/s
SLOW = Link(latency_s=1e-3, bytes_per_s=6.25e6)  # 50 Mbit/s


def option(rank, work_s=0.004, nbytes=4 * MB):
    """PowerSGD at `rank` of a bucket of `nbytes`: its factors are about rank/500 of it."""
    sent = nbytes * rank / 500
    return Option(compress_s=work_s / 2, work_s=work_s, round1_bytes=sent, round2_bytes=sent)


def job(link, buckets=4, backward_s=0.08, step_s=0.15, work_s=0.004, ranks=(1, 2, 4, 8)):
    """`buckets` buckets of 4 MB, final evenly through backward."""
    out = tuple(
        Bucket(
            ready_s=backward_s * (b + 1) / buckets,
            plain_bytes=4 * MB,
            options={r: option(r, work_s * (1 + r / 8)) for r in ranks},
        )
        for b in range(buckets)
    )
    return Measurements(out, backward_s, step_s, FAST).with_link(link)


def test_the_plain_plan_predicts_the_measured_plain_step():
    m = Measurements(job(FAST).buckets, 0.08, 0.15, FAST)
    assert planner.predict(m, [PLAIN] * 4) == pytest.approx(0.15)


def test_a_fast_link_keeps_every_bucket_plain():
    # Sending 16 MB takes 3 ms here: no PowerSGD work (4-8 ms a bucket) pays for itself.
    assert planner.choose(job(FAST), [1, 2, 4, 8]) == [PLAIN] * 4


def test_a_slow_link_compresses_every_bucket():
    plan = planner.choose(job(SLOW), [1, 2, 4, 8])
    assert PLAIN not in plan
    m = job(SLOW)
    assert planner.predict(m, plan) < 0.1 * planner.predict(m, [PLAIN] * 4)


def test_among_plans_about_as_fast_the_higher_ranks_win():
    # At 50 Mbit/s the factors of the early buckets leave while backward still
    # runs, so a higher rank costs them (almost) nothing; the last bucket's are
    # on the step's critical path.
    m = job(SLOW, work_s=0.0001)
    fastest, shortest = planner.fastest(m, [1, 2, 4, 8])
    chosen = planner.choose(m, [1, 2, 4, 8], tolerance=0.03)
    assert fastest == [1, 1, 1, 1]
    assert planner.predict(m, chosen) <= shortest * 1.03
    assert all(c >= f for c, f in zip(chosen, fastest)) and chosen != fastest
    assert chosen == sorted(chosen, reverse=True)  # the earlier, the higher
    # With no tolerance, the fastest plan is kept.
    assert planner.choose(m, [1, 2, 4, 8], tolerance=0.0) == fastest


def test_a_bucket_whose_work_costs_more_than_it_saves_stays_plain():
    # Bucket 0's compression is slow (50 ms) and its message small; bucket 1's pays.
    slow_work = {2: Option(0.05, 0.05, 1e3, 1e3)}
    cheap = {2: option(2, work_s=0.002, nbytes=40 * MB)}
    m = Measurements(
        (Bucket(0.04, 1e5, slow_work), Bucket(0.08, 40 * MB, cheap)), 0.08, 0.15, FAST
    ).with_link(Link(1e-3, 100 * MB))  # 800 Mbit/s: 40 MB take 0.4 s
    assert planner.choose(m, [2]) == [PLAIN, 2]


def test_what_hides_behind_backward_costs_nothing_so_early_buckets_take_a_higher_rank():
    # Two buckets: the first is final early and its message hides behind the
    # backward pass that follows; the last leaves when backward ends.
    opts = {r: Option(1e-4, 2e-4, 1e6 * r, 0.0) for r in (1, 2, 4, 8)}
    m = Measurements(
        (Bucket(0.01, 20 * MB, opts), Bucket(0.2, 20 * MB, opts)), 0.2, 0.3, FAST, rounds=1
    ).with_link(Link(1e-4, 50 * MB))
    plan = planner.choose(m, [1, 2, 4, 8], tolerance=0.0)
    assert plan[0] > plan[1]


def test_link_fit_recovers_latency_and_bandwidth():
    truth = Link(latency_s=2e-3, bytes_per_s=12.5e6)
    samples = [(n, truth.seconds(n)) for n in (4, 1e5, 4e6, 4e6, 2e6)]
    fitted = Link.fit(samples)
    assert fitted.latency_s == pytest.approx(2e-3, rel=1e-6)
    assert fitted.bytes_per_s == pytest.approx(12.5e6, rel=1e-6)
    # All the same size, or no cost per byte: all of it is latency.
    same = Link.fit([(4e6, 0.01), (4e6, 0.012)])
    assert same.bytes_per_s == math.inf and same.latency_s == pytest.approx(0.011)
    with pytest.raises(ValueError, match="no timed all-reduce"):
        Link.fit([])


def test_candidates_hold_the_choice_plain_and_uniform_plans_once_each():
    m = job(Link(1e-4, 1e9))  # 8 Gbit/s: plain is the choice, the others near it
    found = planner.candidates(m, [1, 2, 4, 8])
    assert found[0] == planner.choose(m, [1, 2, 4, 8]) == [PLAIN] * 4
    assert found == [[PLAIN] * 4, [1] * 4, [2] * 4]  # and the two best uniform plans


def test_plans_expected_many_times_slower_are_not_tried():
    # 50 Mbit/s: a plain step is expected to take 2.6 s against the choice's 0.15 s.
    m = job(SLOW)
    found = planner.candidates(m, [1, 2, 4, 8])
    assert [PLAIN] * 4 not in found
    best = planner.predict(m, found[0])
    assert all(planner.predict(m, p) <= planner.HOPELESS * best for p in found)


def test_pick_measured_takes_the_most_accurate_of_the_fastest():
    plans = [[1, 1], [PLAIN, PLAIN], [4, 4], [4, 1]]
    # Plain is 2 % slower than the fastest: within 3 %, and the most accurate.
    assert planner.pick_measured(plans, [1.00, 1.02, 1.30, 1.05]) == [PLAIN, PLAIN]
    # Plain 10 % slower: out; rank 4 everywhere would be more accurate but is slow.
    assert planner.pick_measured(plans, [1.00, 1.10, 1.30, 1.02]) == [4, 1]
    assert planner.pick_measured(plans, [1.00, 1.10, 1.30, 1.05]) == [1, 1]


def test_a_failing_bucket_moves_one_rank_up_within_the_budget_only():
    m = job(SLOW, work_s=0.0001)
    plan = [1, 1, 1, 1]
    budget = planner.predict(m, plan) * 1.03
    raised = planner.raise_failing(m, plan, failing=[2], budget_s=budget)
    assert raised == [1, 1, 2, 1]
    # A budget the raise would exceed: no change.
    expensive = job(SLOW, work_s=0.2)
    tight = planner.predict(expensive, plan)
    assert planner.raise_failing(expensive, plan, [2], tight) == plan
    # At the top of the ladder the next step is plain.
    assert planner.raise_failing(m, [8] * 4, [0], math.inf) == [PLAIN, 8, 8, 8]


def test_a_bucket_with_nothing_to_compress_is_plain_in_every_plan():
    m = Measurements((Bucket(0.05, 1e3, {}), *job(SLOW).buckets[1:]), 0.08, 0.15, FAST).with_link(
        SLOW
    )
    assert planner.uniform(m, 4) == [PLAIN, 4, 4, 4]
    assert planner.choose(m, [1, 2, 4, 8])[0] == PLAIN
