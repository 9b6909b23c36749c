"""Tests that launch whole Horovod jobs themselves (one pytest process here)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def launch(cmd, timeout, cwd=ROOT):
    """Run a launcher; returns (returncode, output, seconds). Never hangs past timeout."""
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # This tree's package, also where the venv's editable install is another
        # checkout's (a git worktree): a job started as `python tests/launch/x_job.py`
        # would import that one.
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"job still running after {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - start


def mpirun_command(python, np, script, *args):
    """mpirun of `script` on `np` local processes, as root, yielding idle cores."""
    return [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(np),
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--bind-to",
        "none",
        python,
        script,
        *args,
    ]


@pytest.fixture
def python():
    return str(BIN / "python")


@pytest.fixture
def horovodrun():
    return str(BIN / "horovodrun")
