"""PowerSGD low-rank gradient compression for Horovod.

Change one line of a Horovod script::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt = horovod_powersgd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The local math (compressor, config, linalg, planner, monitor) imports without
Horovod, so it can be timed or tested where Horovod is not built yet; the names
that need Horovod (the optimizer, the checkpoints) import it on first use.
"""

from .compressor import PowerSGDCompressor
from .config import PowerSGDConfig
from .linalg import orthogonalize_
from .monitor import ErrorGrowthWarning

__version__ = "0.1.0"

# name -> the module that defines it; each of these modules imports Horovod.
_NEEDS_HOROVOD = {
    "DistributedOptimizer": "optimizer",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
}

__all__ = [
    "DistributedOptimizer",
    "ErrorGrowthWarning",
    "PowerSGDCompressor",
    "PowerSGDConfig",
    "__version__",
    "load_checkpoint",
    "orthogonalize_",
    "save_checkpoint",
]


def __getattr__(name: str):
    if name in _NEEDS_HOROVOD:
        import importlib

        value = getattr(importlib.import_module(f".{_NEEDS_HOROVOD[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
