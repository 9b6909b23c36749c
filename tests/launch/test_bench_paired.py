"""Proof that a paired benchmark job measures: plain Horovod slowed on purpose by 5 % of its
own step (`horovod-slowed`) must come out with a 95 % interval that excludes 1.00 and a
median within 1.05 +- 0.03, on the machine as it is and while two other processes keep both
cores at 100 %.

A tiny model at batch 1536 (a step of about 40-60 ms on one core, so the pause is far above
the timer's noise and the scheduler's wake-up lateness), 2 ranks under mpirun, one job per
variant of at most about two minutes: it stops once the slowdown's interval is within +-1 %,
or at its budget (the test then still passes if the interval already proves the slowdown,
and says the budget ran out). The bound: eleven jobs of this version read 1.035-1.068
(docs/benchmarks-method.md), with margin.

The busy variant's spinning processes run at the lowest priority, their sessions'
autogroups too: both cores stay at 100 % and the steps are about 20 % slower than on the
idle machine, but the job keeps the cores it asks for. At equal priority the job gets half
the machine, unevenly, and one job's result moves by more than its interval says, slowdown
or not: with no slowdown four jobs read 1.026, 1.021, 0.998 and 0.998, and the 5 % one 1.117
in one CI run (docs/benchmarks-method.md, Limits), so no fixed bound would hold there.
"""

import json
import subprocess
import sys

import pytest
from conftest import launch

from horovod_powersgd.bench import targets
from horovod_powersgd.bench.stats import Record

BUDGET_S = 110
# A process that spins at the lowest priority. Linux shares the CPU between sessions'
# autogroups before it looks at a task's nice value, so the hog lowers its own session's
# autogroup too (it is started in a session of its own, as the job is).
HOG = """
import os
os.nice(19)
try:
    with open("/proc/self/autogroup", "w") as group:
        group.write("19")
except OSError:  # a kernel without autogroups: the nice value alone decides
    pass
while True:
    pass
"""


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
        if busy:  # both cores kept at 100 %, by processes at the lowest priority (docstring)
            hogs = [
                subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in "ab"
            ]
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
    # 1.035-1.068 in eleven jobs of this version, both variants, docs/benchmarks-method.md),
    # more than one job's interval covers, so the bound is 1.05 +- 0.03, not the interval.
    assert abs(interval.median - 1.05) <= 0.03, f"measured {interval}{budget}; {ran}"
