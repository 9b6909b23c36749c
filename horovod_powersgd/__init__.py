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

        try:
            module = importlib.import_module(f".{_NEEDS_HOROVOD[name]}", __name__)
        except ModuleNotFoundError as error:
            if not (error.name or "").partition(".")[0] == "horovod":
                raise
            raise ModuleNotFoundError(
                f"horovod_powersgd.{name} needs Horovod with PyTorch support, and "
                f"{error.name!r} cannot be imported. Build Horovod against the installed "
                "torch: in a checkout of horovod-powersgd, `make setup` (or `bash "
                "scripts/bootstrap.sh`) builds Horovod 0.28.1 with the C++ standard "
                "today's torch needs and caches the wheel; docs/usage.md says how by hand",
                name=error.name,
            ) from error
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
