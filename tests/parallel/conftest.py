"""Harness for tests that run on every rank under `mpirun` or `horovodrun`.

Every rank runs the same tests in the same order. After each test the ranks
exchange their outcome with one all-reduce, so a failure on any rank fails that
test on every rank (and the ranks stay in step for the next test). A test marked
``world_size(n)`` is skipped unless exactly n processes are running.

``--device cuda`` puts the helpers' model and data on each rank's GPU (local rank
modulo the GPUs there): the GPU kit runs the user contract so. Without it, the CPU.
"""

import os
import shutil
import tempfile

import helpers
import horovod.torch as hvd
import pytest
import torch

# Process sets made at run time (a test builds one without rank 1).
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
hvd.init()
torch.manual_seed(1234 + hvd.rank())
# Each rank's tmp_path under a root of its own: ranks sharing pytest's default root
# remove each other's old numbered directories while listing them, and the listing's
# unclosed iterator is a ResourceWarning in pytest's own code, an error here
# (filterwarnings; it failed a CI run after every test had passed).
TEMP_ROOT = tempfile.mkdtemp(prefix=f"hps-pytest-rank{hvd.rank()}-")
os.environ["PYTEST_DEBUG_TEMPROOT"] = TEMP_ROOT


def pytest_unconfigure(config):
    shutil.rmtree(TEMP_ROOT, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="where the tests' model and data live (default cpu)")  # fmt: skip


def pytest_configure(config):
    if config.getoption("device") == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        helpers.DEVICE = torch.device("cuda", torch.cuda.current_device())
    if hvd.rank() != 0:
        # One report is enough to read; every rank still asserts and exits non-zero on failure.
        config.option.verbose = -1


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("world_size")
        if marker is not None and marker.args[0] != hvd.size():
            item.add_marker(
                pytest.mark.skip(reason=f"needs {marker.args[0]} processes, running {hvd.size()}")
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.failed_here = report.failed


_outcome_counter = 0


@pytest.fixture(autouse=True)
def all_ranks_agree(request):
    """Fail a test on every rank when it failed on any rank."""
    global _outcome_counter
    yield
    _outcome_counter += 1
    failed_here = float(getattr(request.node, "failed_here", False))
    flags = hvd.allgather(torch.tensor([failed_here]), name=f"test.outcome.{_outcome_counter}")
    failed_ranks = [r for r, f in enumerate(flags.tolist()) if f]
    if failed_ranks and not failed_here:
        pytest.fail(f"failed on rank(s) {failed_ranks}", pytrace=False)


@pytest.fixture
def shared_dir():
    """A fresh directory every rank shares (rank 0's), as on a shared file system."""
    directory = hvd.broadcast_object(
        tempfile.mkdtemp(prefix="hps-test-") if hvd.rank() == 0 else None,
        root_rank=0,
        name="test.shared_dir",
    )
    yield directory
    hvd.barrier()  # every rank is done with it
    if hvd.rank() == 0:
        shutil.rmtree(directory)


@pytest.fixture
def rank():
    return hvd.rank()


@pytest.fixture
def size():
    return hvd.size()


def controller():
    """'mpi' or 'gloo': which Horovod controller this run uses."""
    return "gloo" if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") else "mpi"
