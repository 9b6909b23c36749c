"""The examples in the docstrings are true: each module's doctests run and pass.

(The optimizer's and checkpoint's examples are fragments of a training script, to
read, not run; every other module with examples is here.)
"""

import doctest
import importlib

import pytest

MODULES = [
    "horovod_powersgd.bench.confidence",
    "horovod_powersgd.bench.netcap",
    "horovod_powersgd.bench.paired",
    "horovod_powersgd.bench.stats",
    "horovod_powersgd.collectives",
    "horovod_powersgd.compressor",
    "horovod_powersgd.config",
    "horovod_powersgd.linalg",
    "horovod_powersgd.monitor",
    "horovod_powersgd.planner",
    "horovod_powersgd.shares",
    "horovod_powersgd.stepmodel",
]


@pytest.mark.parametrize("name", MODULES)
def test_the_modules_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples left: drop it from this list"
    assert result.failed == 0
