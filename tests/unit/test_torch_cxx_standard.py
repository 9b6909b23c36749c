"""scripts/torch_cxx_standard.py: the C++ standard Horovod is built with, per torch.

What a user relies on: torch 2.13 keeps the build CI caches (C++17), torch 2.14 and later
get the C++20 their headers refuse to compile without, and the answer comes from the
headers that will be compiled, the version only where they say nothing.
"""

from __future__ import annotations

import doctest
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import torch_cxx_standard as tcs

ROOT = Path(__file__).resolve().parents[2]

# The first lines of ATen/ATen.h and torch/all.h as released (torch 2.13.0 is the one
# installed here; 2.14's as in pytorch/pytorch#178150 and docs/gpu.md's build).
ATEN_213 = (
    "#pragma once\n\n#if !defined(_MSC_VER) && __cplusplus < 201703L\n"
    "#error C++17 or later compatible compiler is required to use ATen.\n#endif\n"
)
ATEN_214 = ATEN_213.replace("201703L", "202002L").replace("C++17", "C++20")
ALL_214 = (
    "#pragma once\n\n#if __cplusplus < 202002L\n"
    "#error C++20 or later compatible compiler is required to use PyTorch.\n#endif\n"
)


@pytest.mark.parametrize(
    ("version", "standard"),
    [
        ("2.1.0", 17),
        ("2.9.1", 17),  # 9 < 14: compared as numbers, not as text
        ("2.13.0", 17),  # CI's torch: its cached Horovod wheel was built with C++17
        ("2.13.1+cu128", 17),
        ("2.14.0", 20),
        ("2.14.1+cu130", 20),  # docs/gpu.md: compiled by hand with -std=c++20
        ("2.14.0rc1", 20),
        ("2.14.0a0+nv26.08", 20),
        ("2.15.0.dev20260101", 20),
        ("3.0.0", 20),
    ],
)
def test_the_version_table(version, standard):
    assert tcs.standard_for_version(version) == standard


def test_a_version_that_is_none_fails_clearly():
    with pytest.raises(ValueError, match="not a torch version"):
        tcs.standard_for_version("latest")


@pytest.mark.parametrize(
    ("text", "standard"),
    [(ATEN_213, 17), (ATEN_214, 20), (ALL_214, 20), (ATEN_213.replace("201703L", "201402L"), 14)],
)
def test_a_headers_guard_names_its_standard(text, standard):
    assert tcs.standard_from_header(text) == standard


def test_a_guard_without_error_asks_for_nothing():
    # Headers pick implementations by __cplusplus; only a refusal raises the standard.
    text = "#if __cplusplus < 202002L\n#define C10_LIKELY(x) (x)\n#endif\n#include <x>\n"
    assert tcs.standard_from_header(text) is None


def test_a_standard_unknown_here_fails_instead_of_guessing():
    with pytest.raises(ValueError, match="202602"):
        tcs.standard_from_header(ATEN_214.replace("202002L", "202602L"))


def _headers(root: Path, aten: str, all_h: str | None = None) -> Path:
    (root / "ATen").mkdir(parents=True)
    (root / "ATen/ATen.h").write_text(aten)
    if all_h is not None:
        (root / "torch/csrc/api/include/torch").mkdir(parents=True)
        (root / "torch/csrc/api/include/torch/all.h").write_text(all_h)
    return root


def test_the_headers_decide_over_the_version(tmp_path):
    # A 2.14 pre-release built before the guard came (NVIDIA's 2.14.0a0 containers) gets
    # what its headers ask for; a version string alone would have said 20.
    assert tcs.torch_cxx_standard(_headers(tmp_path / "a", ATEN_213), "2.14.0a0")[0] == 17
    assert tcs.torch_cxx_standard(_headers(tmp_path / "b", ATEN_214), "2.13.0")[0] == 20
    # The strictest header wins.
    both = _headers(tmp_path / "c", ATEN_213, ALL_214)
    assert tcs.torch_cxx_standard(both, "2.13.0")[0] == 20


def test_never_below_17(tmp_path):
    old = _headers(tmp_path, ATEN_213.replace("201703L", "201402L"))
    assert tcs.torch_cxx_standard(old, "2.1.0") == (17, f"C++14 guard in {old}")


def test_without_headers_the_version_table_decides(tmp_path):
    assert tcs.torch_cxx_standard(tmp_path, "2.14.1+cu130")[0] == 20
    assert tcs.torch_cxx_standard(tmp_path, "2.13.0")[0] == 17


def test_the_installed_torchs_headers_agree_with_the_table():
    # What bootstrap.sh runs; for CI's torch 2.13.0 this is 17, so its wheel's key stays.
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/torch_cxx_standard.py"), "--explain"],
        capture_output=True,
        text=True,
        check=True,
    )
    version = importlib.metadata.version("torch")
    standard = tcs.standard_for_version(version)
    assert run.stdout.split()[0] == str(standard), (version, run.stdout)
    assert "guard in" in run.stdout, "the installed torch's headers were not read"
    if version.startswith("2.13.0"):
        assert standard == 17


def test_the_docstring_examples_hold():
    assert doctest.testmod(tcs).failed == 0
