"""Two trainings in one MPI job (hvd.init(comm=...) per half of COMM_WORLD) when one
rank raises; and what the ensemble example does under Gloo, which has no communicators.
"""

import json

import pytest
from conftest import launch

JOB = "tests/launch/groups_job.py"
# World rank 1 (group 0) raises at step 3.
RAISE = ("--raise-rank", "1", "--raise-step", "3")
INJECTED = "RuntimeError: injected failure on world rank 1 at step 3"


def run_job(python, folder, *args, runner=()):
    """groups_job.py under mpirun -np 4: (returncode, output, world rank -> how it ended)."""
    cmd = [
        "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", "--bind-to", "none",
        "--mca", "mpi_yield_when_idle", "1", python, *runner, JOB, str(folder), *args,
    ]  # fmt: skip
    rc, out, _ = launch(cmd, timeout=180)
    ended = {int(f.stem[4:]): json.loads(f.read_text()) for f in folder.glob("rank*.json")}
    return rc, out, ended


@pytest.mark.timeout(200)
def test_a_rank_that_raises_ends_its_group_with_the_error_and_the_other_group_finishes(
    python, tmp_path
):
    # Group 1 (world ranks 2, 3) trains 200 steps.
    rc, out, ended = run_job(python, tmp_path, "--steps", "200", *RAISE)
    assert sorted(ended) == [0, 1, 2, 3], out[-3000:]
    # Group 0: the raising rank's own error, and its partner is told at once instead of
    # waiting forever in the next all-reduce.
    assert ended[1]["error"] == INJECTED
    assert "Traceback" in out and "injected failure on world rank 1" in out
    assert ended[0]["error"].startswith("HorovodInternalError: Horovod has been shut down")
    # Group 1 trains on to the end, after group 0 has failed.
    assert ended[2]["finished_steps"] == ended[3]["finished_steps"] == 200, ended
    assert max(ended[0]["time"], ended[1]["time"]) < min(ended[2]["time"], ended[3]["time"])
    # Then the job fails. (Group 0's processes wait in MPI_Finalize until group 1 is done.)
    assert rc != 0


@pytest.mark.timeout(200)
def test_with_process_sets_a_rank_that_raises_ends_every_sets_training_with_an_error(
    python, tmp_path
):
    # Process sets share one Horovod world: its shutdown, at the raising rank's exit,
    # ends the other set's training too (an error, not a hang). A handle whose set went
    # with the shutdown says so in other words (seen when a set finishes early).
    rc, out, ended = run_job(python, tmp_path, "--process-sets", "--steps", "200", *RAISE)
    assert sorted(ended) == [0, 1, 2, 3], out[-3000:]
    assert ended[1]["error"] == INJECTED
    for rank in (0, 2, 3):
        error = ended[rank]["error"]
        assert "Horovod has been shut down" in error or "not been registered" in error, error
    assert rc != 0


@pytest.mark.timeout(200)
def test_under_python_m_mpi4py_a_rank_that_raises_aborts_the_whole_job(python, tmp_path):
    # mpi4py's runner calls MPI_Abort on an uncaught exception: every process ends at
    # once, the other group too, where a plain run would let it finish. Its 100,000
    # steps would take far longer than launch()'s timeout, which fails the test.
    runner = ("-m", "mpi4py")
    rc, out, ended = run_job(python, tmp_path, "--steps", "100000", *RAISE, runner=runner)
    assert rc != 0
    assert ended[1]["error"] == INJECTED, out[-3000:]
    assert "finished_steps" not in ended.get(2, {}) and "finished_steps" not in ended.get(3, {})


@pytest.mark.timeout(200)
def test_the_ensemble_example_refuses_gloo_whose_horovod_ignores_comm(python, horovodrun):
    # Under horovodrun --gloo each process is an MPI program of one: hvd.init(comm=...)
    # silently starts one Gloo world of every process. The example says so and stops.
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", python]
    rc, out, _ = launch([*cmd, "examples/ensemble.py", "--members", "1"], timeout=180)
    assert rc != 0
    assert "Horovod runs 2 processes, the member's communicator has 1" in out, out[-2000:]
    assert "Gloo has no MPI communicators; launch with mpirun" in out
