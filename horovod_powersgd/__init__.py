"""PowerSGD low-rank gradient compression for Horovod.

Change one line of a Horovod script::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt = horovod_powersgd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .compressor import PowerSGDCompressor
from .config import PowerSGDConfig
from .linalg import orthogonalize_
from .monitor import ErrorGrowthWarning
from .optimizer import DistributedOptimizer

__version__ = "0.1.0"

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
