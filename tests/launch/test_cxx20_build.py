"""Horovod built by scripts/bootstrap.sh against torch 2.14 (C++20), where that torch is at hand.

tests/unit/test_bootstrap.py shows which standard bootstrap.sh hands to the build; this
one compiles it: the whole of Horovod 0.28.1 against torch 2.14's headers, which refuse
anything older than C++20, then a one-rank all-reduce through the wheel it built.

It needs, and never downloads (torch 2.14 is gigabytes, the build 20 minutes of 2 cores):
- a torch >= 2.14 for this python version, either
  - ready: HPS_TORCH_PYTHON names a python (a venv's) that imports it, with what torch and
    Horovod's build need beside it (a CUDA wheel's nvidia-* wheels; pip, setuptools,
    wheel, cffi, cloudpickle, psutil, pyyaml, packaging), as the GPU kit uses the device's;
  - or a wheel: the file HPS_TORCH_WHEEL names, or one in the wheel cache (WHEEL_CACHE,
    default ~/.cache/horovod-powersgd/wheels, where bootstrap.sh keeps its own). A +cpu
    wheel: it is installed without its dependencies, which come from this environment;
- Horovod's sdist in that cache (bootstrap.sh keeps it there).
Elsewhere it skips and says which is missing.

    HPS_TORCH_PYTHON=/tmp/v214/bin/python \
        .venv/bin/python -m pytest tests/launch/test_cxx20_build.py
    HPS_TORCH_WHEEL=/path/torch-2.14.1+cpu-cp311-cp311-linux_x86_64.whl \
        .venv/bin/python -m pytest tests/launch/test_cxx20_build.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT, launch

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts/gpu"))
import gpu_check
import torch_cxx_standard

CACHE = Path(
    os.environ.get("WHEEL_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "horovod-powersgd/wheels"
)
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
# torch-2.14.1+cpu-cp311-cp311-linux_x86_64.whl ('+' may come as %2B from an index)
WHEEL_NAME = re.compile(r"^torch-([^-]+)-(cp\d+)-")


def _torch_wheel() -> tuple[Path, str] | None:
    """(wheel, version) of a torch whose headers need C++20, for this python, or None."""
    named = os.environ.get("HPS_TORCH_WHEEL")
    for wheel in [Path(named)] if named else sorted(CACHE.glob("torch-*.whl")):
        match = WHEEL_NAME.match(wheel.name)
        if not (wheel.is_file() and match and match.group(2) == PYTHON_TAG):
            continue
        version = match.group(1).replace("%2B", "+")
        if torch_cxx_standard.standard_for_version(version) == 20:
            return wheel, version
    return None


def _ready_torch() -> tuple[str, str] | None:
    """(its purelib, torch's version) of HPS_TORCH_PYTHON's torch >= 2.14, or None."""
    named = os.environ.get("HPS_TORCH_PYTHON")
    if not named:
        return None
    code = "import sysconfig, torch; print(sysconfig.get_paths()['purelib'], torch.__version__)"
    asked = subprocess.run([named, "-c", code], capture_output=True, text=True)
    assert asked.returncode == 0, f"HPS_TORCH_PYTHON={named}: no torch: {asked.stderr[-300:]}"
    purelib, version = asked.stdout.split()
    assert torch_cxx_standard.standard_for_version(version) == 20, f"{named}: torch {version}"
    return purelib, version


@pytest.mark.timeout(3900)
def test_horovod_builds_against_torch_214_and_all_reduces(tmp_path, monkeypatch):
    ready = _ready_torch()
    found = None if ready else _torch_wheel()
    if ready is None and found is None:
        where = os.environ.get("HPS_TORCH_WHEEL") or f"{CACHE}/torch-*.whl"
        pytest.skip(
            f"no torch >= 2.14 wheel for {PYTHON_TAG} at {where} (set HPS_TORCH_WHEEL, or "
            "HPS_TORCH_PYTHON to a python that has one); this test downloads nothing"
        )
    sdists = sorted(CACHE.glob("horovod-*.tar.gz"))
    if not sdists:
        pytest.skip(f"no Horovod sdist in {CACHE} (bootstrap.sh keeps one); nothing is downloaded")

    # A venv of its own for torch 2.14; the rest (pip, torch's dependencies, Horovod's build
    # helpers) from the ready python's, or else this one's, behind it, as the GPU kit does
    # (scripts/gpu/gpu_check.py).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin/python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    base = ready[0] if ready else sysconfig.get_paths()["purelib"]
    Path(site, "_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    (venv / ".project-installed").touch()  # this project comes from the base environment
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # launch() and bootstrap.sh see os.environ
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    if ready:
        version = ready[1]
    else:
        wheel, version = found
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
    imported = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    if imported.returncode != 0:
        pytest.skip(f"torch {version} installed but does not import here: {imported.stderr[-300:]}")
    assert imported.stdout.strip() == version

    cache = tmp_path / "wheels"  # the wheel built here stays out of the user's cache
    cache.mkdir()
    (cache / sdists[-1].name).symlink_to(sdists[-1])
    monkeypatch.setenv("SKIP_APT", "1")
    monkeypatch.setenv("VENV", os.path.relpath(venv, ROOT))  # relative to the root
    monkeypatch.setenv("TORCH_VERSION", version.split("+")[0])
    monkeypatch.setenv("WHEEL_CACHE", str(cache))
    if "+cpu" not in version:
        # A CUDA torch: Horovod's torch extension needs the CUDA toolkit (found as the GPU
        # kit finds it, behind an nvcc wrapper too), and no GPU operations: nvcc hidden,
        # or bootstrap.sh asks for NCCL. The NCCL build is the kit's (--build-variants).
        _, home = gpu_check._find_cuda()
        if home is None:
            pytest.skip(f"torch {version} needs a CUDA toolkit to build against; none here")
        monkeypatch.setenv("HOROVOD_CUDA_HOME", home)
        monkeypatch.setenv("CUDA_HOME", home)
        monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", gpu_check.CUDA_ARCH)
        shadow = str(tmp_path / "path")
        monkeypatch.setenv("PATH", gpu_check._path_without(os.environ["PATH"], "nvcc", shadow))
    rc, out, _ = launch(["bash", "scripts/bootstrap.sh"], timeout=3600)
    assert rc == 0, out[-4000:]
    # Built with C++20 and cached under a key that says so; --check-build passed (above).
    (built,) = cache.glob("horovod*-cxx20-*")
    assert f"torch{version.split('+')[0]}" in built.name

    code = (
        "import torch, horovod.torch as hvd\n"
        "hvd.init()\n"
        f"assert torch.__version__ == {version!r}, torch.__version__\n"
        "print(hvd.allreduce(torch.arange(4.0), op=hvd.Sum).tolist())\n"
    )
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[0.0, 1.0, 2.0, 3.0]"
