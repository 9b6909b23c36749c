"""Proof that a paired benchmark job measures: plain Horovod slowed on purpose by 5 % of its
own step (`horovod-slowed`) must come out with a 95 % interval that excludes 1.00 and a
median within 1.05 +- 0.025, on the machine as it is and while two other processes keep both
cores busy.

A tiny model at batch 1536 (a step of about 60-120 ms on one core, so the pause is far
above the timer's noise and the scheduler's wake-up lateness), 2 ranks under mpirun, one
job per variant of at most about two minutes: it stops once the slowdown's interval is
within +-1 %, or at its budget (the test then still passes if the interval already proves
the slowdown, and says the budget ran out). Measured here: as the machine was, 1.049, 1.057
and 1.035 [1.028, 1.048] (1.05 just outside its interval); both cores busy, 1.048, 1.057 and
1.054 (docs/benchmarks-method.md says what did not work).
"""

import json
import subprocess
import sys

import pytest
from conftest import launch

from horovod_powersgd.bench import targets
from horovod_powersgd.bench.stats import Record

BUDGET_S = 110


def _run_paired(tmp_path):
    out = tmp_path / "records.json"
    cmd = [sys.executable, "-m", "horovod_powersgd.bench", "--paired", "-np", "2"]
    cmd += ["--models", "tiny", "--configs", "horovod,horovod-slowed", "--batch-size", "1536"]
    cmd += ["--warmup-steps", "15", "--block-steps", "3", "--min-rounds", "20"]
    cmd += ["--budget-s", str(BUDGET_S), "--slowdown", "0.05", "--json", str(out)]
    rc, log, seconds = launch(cmd, timeout=BUDGET_S + 150)
    assert rc == 0, log[-3000:]
    return [Record(**r) for r in json.loads(out.read_text())], log, seconds


@pytest.mark.timeout(BUDGET_S + 200)
@pytest.mark.parametrize("busy", [False, True], ids=["as-is", "both-cores-busy"])
def test_paired_job_measures_an_injected_five_percent_slowdown(tmp_path, busy):
    hogs = []
    try:
        if busy:  # two processes that never sleep: the machine twice oversubscribed
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in "ab"]
        records, log, seconds = _run_paired(tmp_path)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    (proof,) = [c for c in targets.time_comparisons(records) if c.expected is not None]
    interval = proof.interval()
    settings = records[0].settings
    ran = f"{settings['rounds']} rounds in {seconds:.0f} s, stopped: {settings['stopped']}"
    print(f"busy={busy}: measured {interval} ({ran})")
    assert "Injected 5% slowdown: measured" in log, log[-2000:]
    # The typical pause was the one asked for (a sleep's typical lateness asked less).
    assert settings["pause_taken_over_asked"]["horovod-slowed"] == pytest.approx(1.0, abs=0.02)
    budget = " (its budget ran out first)" if settings["stopped"] == "budget" else ""
    # The slowdown is found: 1.00 lies outside the interval.
    assert interval.lo > 1.0, f"1.00 inside {interval}: slowdown not resolved{budget}; {ran}"
    # And measured as 1.05: the injected pause itself varies from job to job (medians
    # 1.035-1.057 in six jobs of this version, both variants, docs/benchmarks-method.md),
    # more than one job's interval covers, so the bound is 1.05 +- 0.025, not the interval.
    assert abs(interval.median - 1.05) <= 0.025, f"measured {interval}{budget}; {ran}"
