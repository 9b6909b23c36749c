"""The set-up recipe: Horovod 0.28.1's sources are fixed before they are built.

GCC 13 is not on these machines (Debian 12 ships GCC 12, whose headers still pull
<string> in everywhere), so the build failure itself cannot be reproduced here: the
tests check that the fix puts the includes the two headers use in front of every use,
that it is idempotent, and that the one recipe (bootstrap.sh) applies it before the build.
The C++ standard: the torch extension gets the one torch's headers ask for, and bootstrap.sh
runs as far as the build with a stand-in torch and python to show which one it hands over
and under which key the wheel would be cached.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXES = ROOT / "scripts" / "horovod_source_fixes.sh"
HEADERS = ("horovod/common/group_table.h", "horovod/common/common.h")
# What each header uses that GCC 13 no longer includes for it.
NEEDS = {
    "horovod/common/group_table.h": ("<string>", "<cstdint>"),
    "horovod/common/common.h": ("<stdexcept>", "<string>"),
}


def _fake_tree(root: Path) -> Path:
    """The parts of Horovod 0.28.1's sdist the fix touches, as released (abridged)."""
    (root / "horovod/torch").mkdir(parents=True)
    (root / "horovod/common").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD 14)\n")
    (root / "horovod/torch/CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD 14)\n")
    (root / HEADERS[0]).write_text(
        "#include <mutex>\n#include <unordered_map>\n#ifndef HOROVOD_GROUP_TABLE_H\n"
        "int32_t GetGroupIDFromTensorName(const std::string& tensor_name) const;\n#endif\n"
    )
    (root / HEADERS[1]).write_text(
        "#ifndef HOROVOD_COMMON_H\n#include <functional>\n"
        '  throw std::logic_error(std::string("GPU Error:"));\n#endif\n'
    )
    return root


def _first_line_with(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines()) if needle in line)


def _check_fixed(root: Path) -> None:
    for header, includes in NEEDS.items():
        text = (root / header).read_text()
        first_use = min(
            _first_line_with(text, use)
            for use in ("std::string", "int32_t", "std::logic_error")
            if use in text
        )
        for include in includes:
            assert _first_line_with(text, f"#include {include}") < first_use, (header, include)


def _standards(root: Path) -> tuple[str, str]:
    """The CMAKE_CXX_STANDARD lines of the top level and of the torch extension."""
    return tuple(
        "\n".join(
            line.strip()
            for line in (root / name).read_text().splitlines()
            if line.strip().startswith("set(CMAKE_CXX_STANDARD ")
        )
        for name in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
    )


def test_fix_puts_the_includes_before_their_first_use_and_cxx17(tmp_path):
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    subprocess.run(["bash", str(FIXES), str(root), "--cxx-standard", "17"], check=True)
    _check_fixed(root)
    assert _standards(root) == ("set(CMAKE_CXX_STANDARD 17)",) * 2
    before = {h: (root / h).read_text() for h in HEADERS}
    subprocess.run(["bash", str(FIXES), str(root), "--cxx-standard", "17"], check=True)
    assert {h: (root / h).read_text() for h in HEADERS} == before  # idempotent


def test_cxx20_reaches_the_torch_extension_and_leaves_the_rest_at_17(tmp_path):
    # torch 2.14's headers are compiled in horovod/torch's target only; the top level's
    # standard is what third_party/gloo inherits, and stays at upstream's 17.
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    for _ in range(2):  # idempotent
        subprocess.run(["bash", str(FIXES), str(root), "--cxx-standard", "20"], check=True)
        assert _standards(root) == ("set(CMAKE_CXX_STANDARD 17)", "set(CMAKE_CXX_STANDARD 20)")
    # A tree fixed for one torch and then for another follows the second.
    subprocess.run(["bash", str(FIXES), str(root), "--cxx-standard", "17"], check=True)
    assert _standards(root) == ("set(CMAKE_CXX_STANDARD 17)",) * 2


def test_without_the_option_the_standard_stays_as_released(tmp_path):
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    subprocess.run(["bash", str(FIXES), str(root)], check=True)
    assert _standards(root) == ("set(CMAKE_CXX_STANDARD 14)",) * 2


@pytest.mark.parametrize("args", [["--cxx17"], ["--cxx-standard", "23"], ["--cxx-standard"]])
def test_fix_refuses_an_unknown_option(tmp_path, args):
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    run = subprocess.run(["bash", str(FIXES), str(root), *args], capture_output=True, text=True)
    assert run.returncode != 0 and "--cxx-standard 17|20" in run.stderr
    assert _standards(root) == ("set(CMAKE_CXX_STANDARD 14)",) * 2


def test_fix_fails_where_it_finds_no_standard_to_set(tmp_path):
    # A Horovod whose CMakeLists no longer sets the standard this way must not build
    # silently with the compiler's default.
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    (root / "horovod/torch/CMakeLists.txt").write_text("set(CMAKE_CXX_STANDARD_REQUIRED ON)\n")
    run = subprocess.run(
        ["bash", str(FIXES), str(root), "--cxx-standard", "20"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "horovod/torch/CMakeLists.txt" in run.stderr


def test_fix_refuses_a_tree_without_the_headers(tmp_path):
    run = subprocess.run(["bash", str(FIXES), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode != 0 and "group_table.h" in run.stderr


def test_the_real_sdist_is_fixed_when_the_cache_holds_it(tmp_path):
    # bootstrap.sh keeps the sdist it built from beside the cached wheel.
    cache = Path(
        os.environ.get("WHEEL_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "horovod-powersgd"
        / "wheels"
    )
    sdists = sorted(cache.glob("horovod-*.tar.gz"))
    if not sdists:
        pytest.skip(f"no Horovod sdist cached in {cache} (bootstrap.sh keeps one)")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(tmp_path, filter="data")
    (root,) = tmp_path.iterdir()
    released = (root / "CMakeLists.txt").read_text()
    subprocess.run(["bash", str(FIXES), str(root), "--cxx-standard", "20"], check=True)
    _check_fixed(root)
    assert _standards(root) == ("set(CMAKE_CXX_STANDARD 17)", "set(CMAKE_CXX_STANDARD 20)")
    # Only the one line changed at the top level: not the C++17 Gloo copy TensorFlow uses.
    fixed = (root / "CMakeLists.txt").read_text()
    assert fixed == released.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)")


def test_bootstrap_applies_the_fix_before_it_builds():
    recipe = (ROOT / "scripts" / "bootstrap.sh").read_text()
    fix = recipe.index('scripts/horovod_source_fixes.sh" "$srcdir"')
    assert fix < recipe.index("pip wheel"), "the sources must be fixed before the build"
    assert recipe.index('tar -xzf "$sdist"') < fix


# A stand-in for the venv's python: it runs the real one, except for the wheel build,
# where it keeps what the build would have compiled and fails, so bootstrap.sh stops
# there and installs nothing.
STUB_PYTHON = """#!/usr/bin/env bash
if [[ "$1 $2 $3" == "-m pip wheel" ]]; then
  cp CMakeLists.txt "$RECORD/top" && cp horovod/torch/CMakeLists.txt "$RECORD/torch"
  printf '%s\\n' "$@" > "$RECORD/args"
  exit 1
fi
exec {python} "$@"
"""


@pytest.mark.parametrize(
    ("torch_version", "guard", "standard", "build_opts"),
    [
        # CI's torch: the key is the one its cached wheel has always had, C++17 as before.
        ("2.13.0", "201703L", "17", "pytorch-gloo-mpi"),
        ("2.14.1+cu130", "202002L", "20", "pytorch-gloo-mpi-cxx20"),
    ],
)
def test_bootstrap_builds_with_the_standard_torchs_headers_ask_for(
    tmp_path, torch_version, guard, standard, build_opts
):
    # A torch that is only its version and ATen/ATen.h's guard, first on PYTHONPATH.
    torch = tmp_path / "fake-torch" / "torch"
    (torch / "include/ATen").mkdir(parents=True)
    (torch / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
    (torch / "version.py").write_text("cuda = None\n")  # no NCCL build, nvcc or not
    (torch / "include/ATen/ATen.h").write_text(
        f"#if !defined(_MSC_VER) && __cplusplus < {guard}\n#error C++ too old for ATen.\n#endif\n"
    )
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text(STUB_PYTHON.format(python=sys.executable))
    (venv / "bin/python").chmod(0o755)
    (venv / ".project-installed").touch()  # this project counts as installed
    cache, record = tmp_path / "wheels", tmp_path / "record"
    cache.mkdir()
    record.mkdir()
    tree = _fake_tree(tmp_path / "sdist" / "horovod-0.28.1")
    with tarfile.open(cache / "horovod-0.28.1.tar.gz", "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    env = dict(
        os.environ,
        SKIP_APT="1",
        VENV=os.path.relpath(venv, ROOT),  # bootstrap.sh takes it relative to the root
        TORCH_VERSION=torch_version.split("+")[0],
        WHEEL_CACHE=str(cache),
        PYTHONPATH=str(torch.parent),
        RECORD=str(record),
        TMPDIR=str(tmp_path),
        PIP_NO_INDEX="1",
    )
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/bootstrap.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert (record / "args").exists(), run.stderr  # it got as far as the build
    assert run.returncode != 0, "the stand-in build fails: nothing may be installed"
    assert (record / "torch").read_text() == f"set(CMAKE_CXX_STANDARD {standard})\n"
    assert (record / "top").read_text() == "set(CMAKE_CXX_STANDARD 17)\n"
    args = (record / "args").read_text().splitlines()
    key = f"horovod0.28.1-torch{torch_version.split('+')[0]}-{build_opts}-{platform.machine()}"
    assert args[args.index("-w") + 1] == str(cache / key) + ".tmp"


def test_the_local_math_imports_without_horovod():
    # The GPU kit times the local math before (or without) a Horovod build.
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "import horovod_powersgd as hps\n"
        "from horovod_powersgd import compressor, config, layout, linalg, monitor, planner\n"
        "from horovod_powersgd import reducer\n"
        "import torch\n"
        "c = hps.PowerSGDCompressor([('w', torch.zeros(64, 32))], hps.PowerSGDConfig(rank=2))\n"
        "try:\n"
        "    hps.DistributedOptimizer\n"
        "except ImportError:\n"
        "    print('needs horovod')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "needs horovod"
