"""Harness for Horovod inside an MPI program: run under `mpirun -np 4` (any even number >= 4).

mpi4py's COMM_WORLD is split into two halves, the groups: two members of an
ensemble, each training on its own. Each test module starts Horovod the way it
needs with a module-scoped fixture and shuts it down after its last test, so
one job covers both ways:

- `horovod_per_group`: `hvd.init(comm=GROUP)`, each group a Horovod world of
  its own (`hvd.rank()`, `hvd.size()` are the group's);
- `group_process_set`: `hvd.init(comm=WORLD, process_sets=[hvd.ProcessSet(GROUP)])`,
  one Horovod world of every rank and each rank's group as a process set.

Every rank runs the same tests in the same order. After each test body the
ranks exchange their outcome over COMM_WORLD with mpi4py, which works across
the groups whatever Horovod's state: a failure on any rank fails that test on
every rank. The exchange happens inside the test call (not in a fixture's
teardown) so that `xfail` means the same on every rank.

A test body talks within its group only. A collective of both groups inside it
would, once one group has failed half-way, meet that group's outcome exchange
instead (or wait forever): what compares the groups goes to the `across`
fixture, and runs after every rank has passed the body.
"""

import os
import shutil
import tempfile

import horovod.torch as hvd
import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
GROUPS = 2
# Contiguous halves: group 1 lacks world rank 0, which Horovod's global root is.
MEMBERS = [rank * GROUPS // WORLD.size for rank in range(WORLD.size)]  # group of each rank
MEMBER = MEMBERS[WORLD.rank]
GROUP = WORLD.Split(color=MEMBER, key=WORLD.rank)


class FailedOnAnotherRank(AssertionError):
    """The test passed here and failed on another rank."""


def pytest_configure(config):
    if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or WORLD.size < 4 or WORLD.size % 2:
        # Under horovodrun --gloo every process is an MPI job of one (see docs/mpi4py.md).
        raise pytest.UsageError(
            f"tests/mpi4py need mpirun with an even number >= 4 of processes (MPI world of "
            f"{WORLD.size}; Gloo has no MPI communicators)"
        )
    if WORLD.rank != 0:
        # One report is enough to read; every rank still asserts and exits non-zero on failure.
        config.option.verbose = -1


class Across:
    """Comparisons between the groups, run once the test body has passed on every rank."""

    def __init__(self):
        self.checks = []

    def check(self, value, assertion):
        """Later, `assertion(values)`, `values` this `value` of every world rank in rank order.

        Every rank asserts on the same gathered values, so all pass or all fail alike.
        """
        self.checks.append((value, assertion))


@pytest.fixture
def across():
    return Across()


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run the test, fail it on every rank if it failed on any rank, then compare the groups."""
    try:
        result = yield
    except (pytest.skip.Exception, pytest.xfail.Exception):
        _agree(failed_here=False)
        raise
    except BaseException:  # pytest.fail and assertion failures alike
        _agree(failed_here=True)
        raise
    _agree(failed_here=False)
    for value, assertion in getattr(pyfuncitem.funcargs.get("across"), "checks", []):
        assertion(WORLD.allgather(value))
    return result


def _agree(failed_here: bool) -> None:
    __tracebackhide__ = True
    failed = [rank for rank, failed in enumerate(WORLD.allgather(failed_here)) if failed]
    if failed and not failed_here:
        raise FailedOnAnotherRank(f"failed on world rank(s) {failed}")


@pytest.fixture(scope="module")
def horovod_per_group():
    """Horovod started on this rank's group alone; shut down after the module."""
    hvd.init(comm=GROUP)
    assert (hvd.rank(), hvd.size()) == (GROUP.rank, GROUP.size)
    yield
    hvd.shutdown()


@pytest.fixture(scope="module")
def group_process_set():
    """Horovod on every rank, with this rank's group as a process set (returned)."""
    process_set = hvd.ProcessSet(GROUP)
    hvd.init(comm=WORLD, process_sets=[process_set])
    yield process_set
    hvd.shutdown()


@pytest.fixture
def shared_dir():
    """A fresh directory every rank of both groups shares, as on a shared file system."""
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="hps-mpi4py-") if WORLD.rank == 0 else None)
    yield directory
    WORLD.Barrier()  # every rank is done with it
    if WORLD.rank == 0:
        shutil.rmtree(directory)
