"""PowerSGD low-rank gradient compression for Horovod.

Change one line of a Horovod script::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt = horovod_powersgd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""

from .config import PowerSGDConfig
from .compressor import PowerSGDCompressor, orthogonalize_

__version__ = "0.1.0"

__all__ = ["PowerSGDCompressor", "PowerSGDConfig", "__version__", "orthogonalize_"]
