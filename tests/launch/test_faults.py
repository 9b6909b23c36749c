"""A killed worker, and restarts with another number of workers."""

import json

import pytest
from conftest import launch, mpirun_command

JOB = "tests/launch/train_job.py"


def mpirun(python, np, *args):
    return mpirun_command(python, np, JOB, *args)


def gloo(horovodrun, python, np, *args):
    return [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo", python, JOB, *args]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun-gloo"])
def test_killed_worker_stops_the_job_quickly_with_an_error(launcher, python, horovodrun):
    args = ("--steps", "100000", "--kill-rank", "1", "--kill-step", "5")
    cmd = mpirun(python, 2, *args) if launcher == "mpirun" else gloo(horovodrun, python, 2, *args)
    rc, out, seconds = launch(cmd, timeout=180)
    assert rc != 0, out[-2000:]
    assert seconds < 60 + 30, f"took {seconds:.0f} s"  # 60 s budget + process start-up here
    # the launcher names the process that died
    assert "signal 9" in out or "Killed" in out or "exit code" in out.lower() or "137" in out, out[
        -2000:
    ]


UNEVEN_JOB = "tests/launch/uneven_exit_job.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("launcher", "extra_rank", "options"),
    [
        ("mpirun", 1, ("--small-buckets", "--rounds", "2")),
        ("mpirun", 0, ("--rounds", "1")),
        ("horovodrun-gloo", 0, ("--rounds", "2")),
        ("horovodrun-gloo", 1, ("--small-buckets", "--rounds", "1")),
    ],
)
def test_a_rank_that_steps_once_more_gets_horovods_shutdown_error_and_the_job_ends(
    launcher, extra_rank, options, python, horovodrun
):
    # The other rank's exit shuts Horovod down; the extra step's collectives must then end
    # with Horovod's error, as under plain Horovod, never wait for ever (docs/reliability.md).
    # A hang past 45 s dumps the stacks and exits 1 (the job's faulthandler).
    args = ("--extra-rank", str(extra_rank), *options)
    if launcher == "mpirun":
        cmd = mpirun_command(python, 2, UNEVEN_JOB, *args)
    else:
        cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", python, UNEVEN_JOB, *args]
    rc, out, _ = launch(cmd, timeout=150)
    assert rc == 0, out[-3000:]
    assert f"rank {1 - extra_rank} done" in out, out[-3000:]
    raised = [line for line in out.splitlines() if f"rank {extra_rank} raised" in line]
    assert raised, out[-3000:]
    assert "HorovodInternalError" in raised[0] and "shut down" in raised[0], raised[0]


def last_json(out):
    """The JSON line rank 0 prints last (launchers may prefix it; other output may follow)."""
    line = [line for line in out.splitlines() if "{" in line][-1]
    return json.JSONDecoder().raw_decode(line[line.index("{") :])[0]


@pytest.mark.timeout(800)
def test_resume_with_same_workers_is_exact_and_other_workers_resets_residuals(tmp_path, python):
    ckpt = str(tmp_path / "ckpt.pt")
    rc, out, _ = launch(mpirun(python, 2, "--steps", "12"), timeout=180)
    assert rc == 0, out[-2000:]
    uninterrupted = last_json(out)

    rc, out, _ = launch(mpirun(python, 2, "--steps", "6", "--save", ckpt), timeout=180)
    assert rc == 0, out[-2000:]
    rc, out, _ = launch(
        mpirun(python, 2, "--steps", "6", "--first-step", "6", "--load", ckpt), timeout=180
    )
    assert rc == 0, out[-2000:]
    resumed = last_json(out)
    assert resumed["params"] == uninterrupted["params"]
    assert resumed["powersgd_step"] == 12

    # Three workers resume the two-worker checkpoint: residuals start from zero
    # (with a warning), everything else continues.
    rc, out, _ = launch(mpirun(python, 3, "--steps", "0", "--load", ckpt), timeout=180)
    assert rc == 0, out[-2000:]
    resized = last_json(out)
    assert "error buffers reset" in out
    assert resized["size"] == 3
    assert resized["error_norm"] == 0.0
    assert resized["powersgd_step"] == 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("alone", "launcher"), [("save", "mpirun"), ("load", "horovodrun-gloo")])
def test_checkpoint_on_rank_0_alone_ends_the_job_with_what_to_call_instead(
    tmp_path, python, horovodrun, monkeypatch, alone, launcher
):
    # Horovod's examples save under `if hvd.rank() == 0:`; save_checkpoint and
    # load_checkpoint are collective, so there rank 0 waited for ever in the first
    # collective and the others in their next step's.
    ckpt = str(tmp_path / "ckpt.pt")
    rc, out, _ = launch(mpirun(python, 2, "--steps", "2", "--save", ckpt), timeout=180)
    assert rc == 0, out[-2000:]
    monkeypatch.setenv("HOROVOD_POWERSGD_CHECKPOINT_TIMEOUT", "5")
    args = ("--steps", "10000", "--alone", alone, "--alone-step", "3", f"--{alone}", ckpt)
    if launcher == "mpirun":
        cmd = mpirun(python, 2, *args)
        cmd[1:1] = ["-x", "HOROVOD_POWERSGD_CHECKPOINT_TIMEOUT"]
    else:
        cmd = gloo(horovodrun, python, 2, *args)
    rc, out, seconds = launch(cmd, timeout=240)
    assert rc != 0, out[-2000:]
    assert seconds < 5 + 60, f"took {seconds:.0f} s"
    what = f"{alone}_checkpoint"
    assert f"TimeoutError: {what} waited 5 s on rank 0" in out, out[-3000:]
    assert "every one of them must call it" in out and "hvd.broadcast_optimizer_state" in out
    # The other rank ends too: Horovod shuts down when rank 0's process exits.
    assert "Horovod has been shut down" in out, out[-3000:]
