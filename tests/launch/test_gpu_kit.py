"""The GPU kit (scripts/gpu/gpu_check.py) runs here on the CPU with tiny sizes.

A device lease is 15 minutes, drawn by chance: a kit that breaks there wastes it. So
the same script runs here with tiny models and the Horovod already installed, and
what it reports is checked: every phase ran, the numbers are real (finite, positive),
the contract passed on 1 and 2 ranks, the host reads of a step are the documented
ones, and what goes back from the device fits its limits (8 files, plain names).
"""

import json
import math
import re
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT, launch

sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import gpu_check

from horovod_powersgd import stepmodel
from horovod_powersgd.bench import scale
from horovod_powersgd.collectives import parse_cluster

KIT = [sys.executable, "scripts/gpu/gpu_check.py", "--size", "tiny"]
# What the device sends back: at most 8 files, named in letters, digits, '.', '_', '-'.
RETURNED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
CONTRACT_TESTS = 35  # what gpu_check.CONTRACT selects of tests/parallel


def run_kit(tmp_path, *args, timeout):
    """The kit's run: rc, log, seconds (wall), report (report.json), out (its folder)."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [*KIT, "--out", str(out), "--work", str(work), *args]
    rc, log, seconds = launch(cmd, timeout=timeout)
    report = json.loads((out / "report.json").read_text())
    return SimpleNamespace(rc=rc, log=log, seconds=seconds, report=report, out=out)


def real(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def full_cpu_run(tmp_path_factory):
    return run_kit(tmp_path_factory.mktemp("gpu-kit"), timeout=560)


@pytest.mark.timeout(600)
def test_every_phase_runs_and_the_report_holds_real_numbers(full_cpu_run):
    run = full_cpu_run
    assert run.rc == 0, run.log[-3000:]
    report = run.report
    phases = report["phases"]
    assert phases["build"]["status"] == "skipped" and "no CUDA" in phases["build"]["note"]
    for phase in ("probe", "timing", "contract", "syncs", "e2e"):
        assert phases[phase]["status"] == "ok", (phase, phases[phase])

    for name in ("resnet50", "gpt2"):
        model = report["timing"]["models"][name]
        assert not model["errors"], model["errors"]
        for precision in ("fp32", "bf16"):
            assert real(model["forward_backward_ms"][precision])
            assert real(model["ddp_ms"][precision])
        # ranks 4, 16, 32 x rounds 2, 1 x Householder and CholeskyQR (", cholesky")
        assert len(model["local_work"]) == 12
        assert model["local_work"]["rank 4, rounds=2, cholesky"]["compressed_tensors"] > 0
        for work in model["local_work"].values():
            if work["compressed_tensors"]:
                assert real(work["ms"]) and real(work["with_statistics_ms"]), work
        assert model["local_work"]["rank 4, rounds=2"]["compressed_tensors"] > 0
        assert len(model["hook"]) == 6  # ranks 4, 16, 32, default and batched
        for hook in model["hook"].values():
            assert all(math.isfinite(v) for v in hook["overhead_ms"].values()), hook
        steps = report["e2e"]["models"][name]["step_ms"]
        assert {"horovod", "powersgd rank 4, rounds=2", "powersgd rank 4, rounds=1",
                "powersgd rank 4, rounds=2, graphs", "powersgd rank 4, rounds=1, graphs",
                "powersgd, nothing compressed"} <= set(steps)  # fmt: skip
        assert all(real(t) for times in steps.values() for t in times.values()), steps
        # rank="auto"'s profile of the model, readable by the scale model (docs/scale.md)
        got = report["profile"]["models"][name]
        assert "error" not in got, got.get("error")
        measured = stepmodel.Measurements.from_dict(got["profile"])
        assert real(measured.step_s) and measured.buckets, got["profile"]
        cluster = parse_cluster("2x4,intra=100GB/2us,inter=1gbit/20us")
        predicted = scale.predictions(measured, cluster)
        assert real(predicted["horovod"]) and real(predicted["powersgd-auto"]), predicted
    assert "profile: ok" in phases["e2e"]["note"], phases["e2e"]


@pytest.mark.timeout(600)
def test_the_contract_passes_on_one_and_two_ranks(full_cpu_run):
    # The kit runs tests/parallel's user contract itself (on CUDA with --device cuda): every
    # test it selects ran and passed on every rank, so the device reports the real tests.
    report = full_cpu_run.report
    for label, ranks in (("1 rank", 1), ("2 ranks, Gloo", 2)):
        run = report["contract"][label]
        assert (run["ranks"], run["device"]) == (ranks, "cpu"), run
        assert run["passed"] == CONTRACT_TESTS and not run["failed"], run
        assert run["status"] == "ok", run
    markdown = (full_cpu_run.out / "report.md").read_text()
    assert f"| 1 rank | cpu | 1 | {CONTRACT_TESTS} | 0 |" in markdown


@pytest.mark.timeout(600)
def test_host_reads_of_the_steps_are_the_documented_ones(full_cpu_run):
    probe = full_cpu_run.report["syncs"]["probe"]["result"]
    # rounds 2 and 1, fp32 and fp16 on the wire; rounds 2 and 1 with cuda_graphs=True
    assert len(probe["configs"]) == 6
    assert [c["graphs"] for c in probe["configs"]] == [False] * 4 + [True] * 2
    for config in probe["configs"]:
        reasons = [gpu_check.classify(e, probe["drift_check_every"]) for e in config["counted"]]
        assert reasons and not [r for r in reasons if r.startswith("NOT")], config["counted"]
        # the periodic checks are seen where documented (or the count proves nothing)
        assert any(r.startswith("statistics every 10") for r in reasons), reasons
        waits = set(config["collective_waits_per_step"].values())
        # One rank: nothing to wait for (a set of one makes no request, comm.Comm.alone);
        # on more, one bucket: a wait per round.
        assert waits == {0 if probe["ranks"] == 1 else config["rounds"]}, probe["ranks"]


@pytest.mark.timeout(600)
def test_what_goes_back_fits_the_device_and_the_markdown_shows_the_json(full_cpu_run):
    report, out = full_cpu_run.report, full_cpu_run.out
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(RETURNED_NAME.match(f) for f in files), files
    assert {"report.json", "report.md"} <= set(files)
    markdown = (out / "report.md").read_text()
    assert "CPU run, tiny models" in markdown
    fp32 = report["timing"]["models"]["resnet50"]["forward_backward_ms"]["fp32"]
    assert f"forward+backward: fp32 {gpu_check._ms(fp32)} ms" in markdown
    for phase in ("probe", "timing", "contract", "syncs", "e2e"):
        assert f"| {phase} | ok |" in markdown


@pytest.mark.timeout(300)
def test_a_failing_phase_leaves_the_report_of_the_others(tmp_path):
    run = run_kit(tmp_path, "--phases", "probe,timing,e2e", "--fail", "timing", timeout=280)
    assert run.rc != 0  # the run says something failed ...
    report = run.report
    phases = report["phases"]
    assert phases["timing"]["status"] == "failed"
    assert "failure injected" in phases["timing"]["log"]
    # ... and the phases after it ran and reported
    assert phases["e2e"]["status"] == "ok", phases["e2e"]
    assert real(report["e2e"]["models"]["gpt2"]["step_ms"]["horovod"]["fp32"])
    assert phases["contract"]["status"] == "skipped"
    assert "| timing | failed |" in (run.out / "report.md").read_text()


@pytest.mark.timeout(150)
def test_a_hanging_phase_is_stopped_within_the_budget_and_the_report_still_written(tmp_path):
    # The timing phase hangs (--stall); the kit must end it by its deadline (the budget
    # less the 8 s kept for the report), as a device call must end within its limit.
    budget = 40
    run = run_kit(
        tmp_path, "--phases", "probe,timing", "--stall", "timing", "--budget", str(budget),
        timeout=120,
    )  # fmt: skip
    phases = run.report["phases"]
    assert phases["timing"]["status"] == "timeout", phases
    assert phases["probe"]["status"] == "ok", phases
    assert run.rc != 0
    assert run.report["seconds"] < budget, run.report["seconds"]
    assert run.seconds < budget + 15, run.seconds  # seen from outside: interpreter start too
    assert "| timing | timeout |" in (run.out / "report.md").read_text()
