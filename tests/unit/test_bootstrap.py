"""The set-up recipe: Horovod 0.28.1's sources are fixed before they are built.

GCC 13 is not on these machines (Debian 12 ships GCC 12, whose headers still pull
<string> in everywhere), so the build failure itself cannot be reproduced here: the
tests check that the fix puts the includes the two headers use in front of every use,
that it is idempotent, and that the one recipe (bootstrap.sh) applies it before the build.
"""

from __future__ import annotations

import os
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


def test_fix_puts_the_includes_before_their_first_use_and_cxx17(tmp_path):
    root = _fake_tree(tmp_path / "horovod-0.28.1")
    subprocess.run(["bash", str(FIXES), str(root), "--cxx17"], check=True)
    _check_fixed(root)
    assert "CMAKE_CXX_STANDARD 17" in (root / "CMakeLists.txt").read_text()
    assert "CMAKE_CXX_STANDARD 17" in (root / "horovod/torch/CMakeLists.txt").read_text()
    before = {h: (root / h).read_text() for h in HEADERS}
    subprocess.run(["bash", str(FIXES), str(root), "--cxx17"], check=True)  # idempotent
    assert {h: (root / h).read_text() for h in HEADERS} == before


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
    subprocess.run(["bash", str(FIXES), str(root), "--cxx17"], check=True)
    _check_fixed(root)


def test_bootstrap_applies_the_fix_before_it_builds():
    recipe = (ROOT / "scripts" / "bootstrap.sh").read_text()
    fix = recipe.index('scripts/horovod_source_fixes.sh" "$srcdir"')
    assert fix < recipe.index("pip wheel"), "the sources must be fixed before the build"
    assert recipe.index('tar -xzf "$sdist"') < fix


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
