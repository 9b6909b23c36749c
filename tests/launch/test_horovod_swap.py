"""The library put in Horovod's place by a wrapper function, in a process of its own."""

import pytest
from conftest import launch, mpirun_command


@pytest.mark.timeout(200)
def test_horovods_rank0_resume_after_a_swap_by_wrapper_runs_no_collective_on_one_rank(python):
    # Horovod initialises the optimizer of a rank without state with a plain step only
    # when the optimizer's class module is its optimizer module. Read after the user's
    # swap, it was the user's (__main__), and the ranks without state entered
    # PowerSGD's first-step all-gather while rank 0 waited in the broadcasts: a hang.
    rc, out, _ = launch(mpirun_command(python, 2, "tests/launch/swap_job.py"), timeout=150)
    assert rc == 0, out[-3000:]
    assert out.count("optimizer module horovod.torch.optimizer") == 2, out[-3000:]
    assert out.count("resumed in step") == 2, out[-3000:]
