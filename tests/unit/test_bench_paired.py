"""The pure parts of the paired benchmark: intervals, the stopping rule, verdicts, targets.

Deterministic: fixed seeds and made-up rounds, no timing. The intervals' coverage:
test_bench_intervals.py.
"""

import argparse
import dataclasses
import random
import sys
import time

import pytest

from horovod_powersgd.bench import confidence, paired, report, targets
from horovod_powersgd.bench.__main__ import paired_command, parse_configs, run_watched
from horovod_powersgd.bench.confidence import Interval
from horovod_powersgd.bench.paired import describe_plan
from horovod_powersgd.bench.stats import Record


def test_interval_is_two_of_the_rounds_and_holds_the_median():
    rng = random.Random(1)
    values = [1.05 + rng.gauss(0, 0.02) for _ in range(40)]
    interval = confidence.median_interval(values)
    assert interval == confidence.median_interval(values[::-1])  # the same report twice
    assert interval.lo in values and interval.hi in values  # order statistics, no resampling
    assert interval.lo <= interval.median <= interval.hi
    assert interval.median == confidence.median(values)


def test_interval_narrows_with_more_rounds_and_covers_the_truth():
    rng = random.Random(2)
    few = confidence.median_interval([1.05 + rng.gauss(0, 0.03) for _ in range(10)])
    many = confidence.median_interval([1.05 + rng.gauss(0, 0.03) for _ in range(400)])
    assert many.half_width < few.half_width / 3
    assert many.lo < 1.05 < many.hi


def test_round_ratios_pair_rounds_one_to_one():
    assert confidence.round_ratios([2.0, 6.0], [1.0, 3.0]) == [2.0, 2.0]
    with pytest.raises(ValueError, match="rounds differ"):
        confidence.round_ratios([1.0], [1.0, 2.0])
    # A round where the whole machine was 3x slower cancels in its ratio.
    assert confidence.ratio_interval([105, 315, 105], [100, 300, 100]).median == pytest.approx(1.05)


def test_precise_means_half_width_under_one_percent_of_the_median():
    assert confidence.is_precise(Interval(1.0, 0.991, 1.009))
    assert not confidence.is_precise(Interval(1.0, 0.98, 1.0))
    assert Interval(2.0, 1.9, 2.1).half_width == pytest.approx(0.05)


def test_stop_when_every_needed_interval_is_precise_after_the_minimum_rounds():
    narrow, wide = Interval(1.0, 0.995, 1.005), Interval(1.0, 0.95, 1.05)
    common = dict(elapsed_s=10, budget_s=900, round_s=5)
    assert confidence.stop_reason([narrow, narrow], rounds=8, min_rounds=8, **common) == "precise"
    assert confidence.stop_reason([narrow, wide], rounds=8, min_rounds=8, **common) is None
    assert confidence.stop_reason([narrow], rounds=3, min_rounds=8, **common) is None
    # Intervals not computed this round: only the budget can stop it.
    assert confidence.stop_reason(None, rounds=20, min_rounds=8, **common) is None
    assert confidence.check_due(8, 8) and not confidence.check_due(7, 8)
    assert sum(confidence.check_due(r, 8) for r in range(1, 1001)) <= 130  # bounded cost


def test_stop_before_the_next_round_would_overrun_the_budget():
    wide = Interval(1.0, 0.95, 1.05)
    kw = dict(rounds=20, min_rounds=8, budget_s=100)
    assert confidence.stop_reason([wide], elapsed_s=80, round_s=10, **kw) is None
    assert confidence.stop_reason([wide], elapsed_s=95, round_s=10, **kw) == "budget"


@pytest.mark.parametrize(
    ("interval", "limit", "expected"),
    [
        (Interval(1.00, 0.99, 1.01), 1.02, "hit"),
        (Interval(1.00, 0.99, 1.02), 1.02, "hit"),  # at the limit counts as within it
        (Interval(1.05, 1.03, 1.07), 1.02, "missed"),
        (Interval(1.02, 1.01, 1.03), 1.02, "not resolved"),  # never decided inside
        (Interval(1.00, 0.98, 1.03), 1.02, "not resolved"),
    ],
)
def test_verdict_is_decided_only_when_the_limit_lies_outside_the_interval(
    interval, limit, expected
):
    assert confidence.verdict(interval, limit) == expected


def test_slowdown_is_measured_only_if_the_interval_holds_it_and_excludes_no_slowdown():
    assert confidence.slowdown_verdict(Interval(1.05, 1.04, 1.06), 1.05) == "measured"
    assert confidence.slowdown_verdict(Interval(1.02, 0.99, 1.05), 1.05) == "not resolved"
    assert confidence.slowdown_verdict(Interval(1.10, 1.08, 1.12), 1.05) == "wrong"


# --- targets over records ------------------------------------------------------------------


def _rec(config, rank, rounds, bandwidth="unlimited", model="gpt", **extra):
    ms = confidence.median(rounds)
    return Record(
        config, model, rank, 2, bandwidth, ms, ms, ms, 1.0, 4.0, 1.0, 500.0,
        round_ms=list(rounds), **extra,
    )  # fmt: skip


def test_auto_is_held_to_the_faster_of_plain_and_fp16_on_an_unlimited_link():
    plain = [100.0, 101.0, 99.0, 100.0] * 2  # 8 rounds: the fewest with an interval
    records = [
        _rec("horovod", None, plain),
        _rec("horovod-fp16", None, [110.0, 111.0, 109.0, 110.0] * 2),
        _rec("powersgd-auto", None, [x * 1.01 for x in plain]),
    ]
    (comparison,) = targets.comparisons(records)
    assert comparison.denominator.config == "horovod"
    assert comparison.interval().median == pytest.approx(1.01)
    assert comparison.verdict() == "hit"


def test_capped_auto_is_judged_against_its_own_schedule_and_shown_beside_the_other():
    base = [100.0, 102.0, 98.0, 100.0, 101.0] * 2
    records = [
        _rec("local", None, [x * 0.9 for x in base], "50mbit"),
        _rec("powersgd", 2, base, "50mbit"),
        _rec("powersgd-1round", 2, [x * 0.95 for x in base], "50mbit"),
        _rec("powersgd-auto", None, [x * 1.06 for x in base], "50mbit"),
    ]
    rows = {c.name: c for c in targets.comparisons(records)}
    same = rows["gpt: powersgd-auto / best fixed, same schedule (powersgd r2), 50mbit"]
    assert same.limit == targets.AUTO_CAPPED and same.verdict() == "missed"
    other = rows["gpt: powersgd-auto / best fixed, other schedule (powersgd-1round r2), 50mbit"]
    assert other.limit is None and other.verdict() == ""
    local = rows["gpt: powersgd-auto / local, 50mbit"]
    assert local.interval().median == pytest.approx(1.06 / 0.9)


def test_the_report_opens_with_autos_verdict_one_row_per_link_and_schedule(tmp_path):
    # The question a user asks of rank="auto" (turn it on, what can it cost me?) answered in
    # one table from every record: each auto at each link against what it is held to, with
    # what it settled on and the verdict; the other schedule's best is not a target there.
    base = [100.0, 102.0, 98.0, 100.0, 101.0] * 2
    plan = "plan [1 1], link 50 Mbit/s 2.00 ms"
    records = [
        _rec("horovod", None, base),
        _rec("horovod-fp16", None, [x * 1.1 for x in base]),
        _rec("powersgd-auto", None, [x * 1.05 for x in base], detail="plan [p p]"),
        _rec("local", None, [x * 0.97 for x in base], "50mbit"),
        _rec("powersgd", 1, base, "50mbit"),
        _rec("powersgd-1round", 1, [x * 0.95 for x in base], "50mbit"),
        _rec("powersgd-auto", None, [x * 1.001 for x in base], "50mbit", detail=plan),
        _rec("powersgd-1round-auto", None, [x * 0.95 * 1.04 for x in base], "50mbit"),
    ]
    rows = report.verdict_rows(records)
    assert [(r[1], r[2], r[5], r[-1]) for r in rows] == [
        ("unlimited", "powersgd-auto", "horovod", "missed"),
        ("50mbit", "powersgd-auto", "powersgd r1", "hit"),
        ("50mbit", "powersgd-auto", "local", "hit"),
        ("50mbit", "powersgd-1round-auto", "powersgd-1round r1", "missed"),
        ("50mbit", "powersgd-1round-auto", "local", "hit"),
    ]
    assert rows[1][3:5] == ("10", plan) and rows[0][4] == "plan [p p]" and rows[3][4] == "-"
    path = tmp_path / "report.md"
    report.write_markdown(records, path, command="make bench")
    text = path.read_text()
    verdict = text.index('## rank="auto": the verdict')
    assert verdict < text.index("## gpt, 2 workers") < text.index("## Targets")
    assert f"| gpt | 50mbit | powersgd-auto | 10 | {plan} | powersgd r1 | 1.001" in text


def test_records_of_separate_jobs_have_no_interval_and_say_so():
    a = Record("powersgd", "resnet18", 2, 2, "unlimited", 105, 100, 110, 1, 4, 1.0, 500)
    b = Record("horovod", "resnet18", None, 2, "unlimited", 100, 95, 105, 1, 4, 1.0, 500)
    (comparison,) = targets.comparisons([a, b])
    assert comparison.interval() is None
    assert comparison.verdict() == "hit (no interval)"


def test_the_injected_slowdown_is_a_needed_interval_and_so_is_every_ratio_without_targets():
    plain = [100.0, 100.5, 99.5, 100.0] * 2
    slowed = _rec("horovod-slowed", None, [x * 1.05 for x in plain], settings={"slowdown": 0.05})
    records = [_rec("horovod", None, plain), slowed, _rec("local", None, plain)]
    rows = targets.comparisons(records)
    assert [c.expected for c in rows] == [pytest.approx(1.05)]
    assert rows[0].verdict() == "measured"
    assert len(targets.needed_intervals(records)) == 1  # the slowdown's: a target
    assert len(targets.needed_intervals(records[::2])) == 1  # none: local / horovod


# --- the driver's and the job's small parts --------------------------------------------------


def test_link_without_a_cost_per_byte_says_so_instead_of_inf():
    assert "inf" not in describe_plan([0, 0], float("inf"), 0.02)
    assert describe_plan([2, 0], 90e6 / 8, 0.0143) == "plan [2 p], link 90 Mbit/s 14.30 ms"


def test_slowed_configuration_needs_a_paired_job_beside_plain_horovod():
    from horovod_powersgd.bench.__main__ import _check_paired

    plan = parse_configs("horovod,horovod-slowed", [2], 2)
    _check_paired(plan, paired=True)
    with pytest.raises(ValueError, match="--paired"):
        _check_paired(plan, paired=False)


def test_paired_job_runs_every_horovod_configuration_in_one_launch_and_leaves_ddp_out(tmp_path):
    settings = dict(
        np=2, batch_size=8, warmup_steps=15, block_steps=3, min_rounds=8, max_rounds=100,
        budget_s=60.0, slowdown=0.05, start_iter=2, min_compression_rate=2.0, threads=1,
        controller="mpi", cycle_time_ms=None, fusion_threshold_mb=None,
        plan=[("local", None), ("horovod", None), ("powersgd", 2), ("ddp-powersgd", 2)],
    )  # fmt: skip
    argv, _ = paired_command("gpt", settings, "50mbit", tmp_path)
    assert argv[0] == "mpirun" and argv[argv.index("btl") + 1] == "tcp,self"
    plan = argv[argv.index("--plan") + 1]
    assert "ddp" not in plan and '["powersgd", 2]' in plan
    assert argv[argv.index("--bandwidth") + 1] == "50mbit"
    assert argv[argv.index("--budget-s") + 1] == "60.0"


def test_report_renders_the_settings_the_records_carry_not_the_command_line(tmp_path):
    from horovod_powersgd.bench import report

    job = dict(
        np=2, batch_size=96, warmup_steps=15, steps=10, block_steps=3, min_rounds=8, budget_s=900.0,
        tolerance=0.01, threads=1, controller="mpi", start_iter=2, min_compression_rate=2.0,
        paired=True, stopped="budget", rounds=12, seconds=940, warmup_s=60,
    )  # fmt: skip
    plain = [100.0, 101.0, 99.0] * 3
    records = [
        _rec("horovod", None, plain, settings=dict(job)),
        _rec("horovod-slowed", None, [x * 1.05 for x in plain], settings=dict(job, slowdown=0.05)),
    ]
    # torch's DDP hook ran beside the paired job, a job of its own with the same settings.
    separate = {k: v for k, v in job.items() if k not in report.JOB_OUTCOME}
    ddp = _rec("ddp-powersgd", 2, [100.0], settings=dict(separate, paired=False))
    records.append(dataclasses.replace(ddp, round_ms=None))
    path = tmp_path / "report.md"
    report.write_markdown(records, path, command="make bench")
    text = path.read_text()
    assert "batch 96 per worker" in text and "Paired:" in text
    # One Settings paragraph, that says both: not a second one as if every row were separate.
    assert text.count("Settings:") == 1 and "its rows ran as jobs of their own beside" in text
    # The budget counts the timed rounds; the warm-up before them is said beside it.
    assert "stopped after 12 rounds, 940 s in all: its time budget (900 s of rounds, " in text
    assert "after 60 s of warm-up) ran out" in text
    assert "Injected 5% slowdown: measured 1.050" in text
    old = [dataclasses.replace(r, settings=None) for r in records]
    report.write_markdown(old, path, command="make bench")
    assert "not recorded" in path.read_text()


def test_a_one_round_configurations_bytes_are_both_steps_mean_whatever_its_phase():
    # rounds=1 sends Q and P on alternate steps; a block is 1 untimed + 3 timed steps, so its
    # timed steps alone would count Q, P, Q in every block of one configuration and P, Q, P
    # in another's, by the phase each happens to be at. Counted over whole blocks, both read
    # the mean of a P step and a Q step.
    class Counting:
        def __init__(self, phase):
            self.steps, self.phase = 0, phase

        def __call__(self):  # bytes so far: 100 on P steps, 300 on Q steps
            done = range(self.phase, self.phase + self.steps)
            return dict.fromkeys(paired.COUNTED, sum(300 if i % 2 else 100 for i in done))

    job = object.__new__(paired.Job)
    job.args = argparse.Namespace(block_steps=3, model="tiny", bandwidth="50mbit", slowdown=0.0)
    job.hvd = argparse.Namespace(size=lambda: 2)

    def step(c):
        c.counters.steps += 1
        return 0.1

    job.step = step
    made = [paired.Contender("powersgd-1round", 2, None, None, Counting(p)) for p in (0, 1)]
    for _ in range(5):
        for c in made:
            job.block(c)
    assert [job.record(c).bytes_per_step for c in made] == [200.0, 200.0]


def test_autos_record_says_when_it_settled_and_what_those_steps_took():
    # What turning rank="auto" on costs: the warm-up steps before its tuner settled (plain
    # measuring steps, trials), in seconds beside as many steps of its settled plan.
    class Tuner:
        phase = "measure"

    tuner = Tuner()
    opt = argparse.Namespace(powersgd_state=argparse.Namespace(tuner=tuner))
    job = object.__new__(paired.Job)
    job.args = argparse.Namespace(warmup_steps=15, block_steps=3)
    job._max = lambda values, name: values
    steps = []

    def step(c):  # 8 slow measuring steps, trials, then settled at the 14th step
        steps.append(c)
        if len(steps) == 14:
            tuner.phase = "settled"
        return 2.0 if len(steps) <= 8 else 0.5

    job.step = step
    auto = paired.Contender("powersgd-auto", None, None, opt, dict)
    assert job.warm_up(auto) == paired.AUTO_WARMUP_STEPS
    assert auto.settled_after == 14 and len(auto.warm_s) == paired.AUTO_WARMUP_STEPS
    auto.step_ms = [500.0, 500.0, 510.0]
    said = paired._settle_detail(auto)
    assert said == ", settled after 14 steps, 19.0 s (14 settled steps: 7.0 s)"
    fixed = paired.Contender("powersgd", 2, None, opt, dict)
    job.warm_up(fixed)
    assert fixed.warm_s == [] and paired._settle_detail(fixed) == ""


def test_a_paired_job_is_ended_by_a_stall_not_by_its_length(tmp_path):
    # The driver's limit on a paired job is time without a step (the job touches a file
    # after each), not a total: a warm-up of hundreds of slow steps runs to its end, a job
    # that stops stepping is killed (with what it started) and reported failed.
    progress = tmp_path / "progress"
    steps = (
        "import pathlib, sys, time\n"
        "p = pathlib.Path(sys.argv[1])\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    p.touch(); time.sleep(0.2)\n"
        "print('steps done', flush=True)\n"
        "time.sleep(float(sys.argv[3]))\n"
    )
    # 30 steps of 0.2 s: three times the 2 s idle limit in all, never 2 s without a step.
    started = time.monotonic()
    failed, log = run_watched(
        [sys.executable, "-c", steps, str(progress), "30", "0"], None, progress, 2.0, 0.1
    )
    assert not failed and "steps done" in log and time.monotonic() - started > 5.5, log
    progress.unlink()
    started = time.monotonic()
    failed, log = run_watched(
        [sys.executable, "-c", steps, str(progress), "3", "600"], None, progress, 2.0, 0.1
    )
    assert failed and "no step for 2 s" in log, log
    assert time.monotonic() - started < 60, "killed within its idle limit, not at the end"
