"""The C++ standard Horovod's torch extension must be compiled with: 17 or 20.

    python scripts/torch_cxx_standard.py            # for the torch this python imports
    python scripts/torch_cxx_standard.py --explain  # and which signal decided

scripts/bootstrap.sh asks it before building Horovod, hands the answer to
scripts/horovod_source_fixes.sh and puts it into the cached wheel's key when it is not 17.

The signal is what torch's own headers refuse: ATen/ATen.h and torch/all.h begin with
`#if ... __cplusplus < 201703L` (torch 2.1 to 2.13) or `< 202002L` (torch 2.14 and
later) followed by an `#error`; the standard asked for is the one whose `__cplusplus`
value that guard names. The headers are read where torch is installed, without importing
torch (bootstrap.sh runs this on every set-up). Only where no header has such a guard
(torch installed without its include/ folder) does the version decide, by a table: before
2.14 C++17, from 2.14 on C++20 (pytorch/pytorch#178150). Never below 17: upstream Horovod
compiles with 17 whatever the torch, and the project needs torch >= 2.1.

Not a signal: torch.utils.cpp_extension already passes `-std=c++20` in torch 2.13, whose
headers need C++17 only, and Horovod's CMake does not take its `-std` anyway
(cmake/Modules/FindPytorch.cmake reads include and library paths from it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

DEFAULT = 17
# The value of __cplusplus under each standard (GCC 10's -std=c++20 still says 201709L).
CPLUSPLUS = {201103: 11, 201402: 14, 201703: 17, 202002: 20, 202302: 23}
# The headers Horovod's torch sources pull in (torch/extension.h includes both).
HEADERS = ("ATen/ATen.h", "torch/csrc/api/include/torch/all.h")
# Fallback only: the first torch release whose headers need each standard above 17.
VERSION_TABLE = (((2, 14), 20),)

_GUARD = re.compile(r"^\s*#\s*if\b.*__cplusplus\s*<\s*(\d+)L?\b.*$", re.MULTILINE)


def standard_from_header(text: str) -> int | None:
    """The standard a header refuses to compile without, or None if it names none.

    A guard counts only if an `#error` follows it within two lines, so a header that
    merely picks an implementation by `__cplusplus` does not raise the standard.
    """
    needed = None
    for guard in _GUARD.finditer(text):
        following = text[guard.end() :].lstrip("\n").splitlines()[:2]
        if not any(line.lstrip().startswith("#error") for line in following):
            continue
        value = int(guard.group(1))
        known = [std for cplusplus, std in sorted(CPLUSPLUS.items()) if cplusplus >= value]
        if not known:
            raise ValueError(
                f"torch's headers need __cplusplus >= {value}, a standard unknown here"
            )
        needed = max(needed or 0, known[0])
    return needed


def standard_from_headers(include_dir: Path) -> int | None:
    """The highest standard the torch headers in `include_dir` require, or None."""
    found = [
        standard_from_header(path.read_text(errors="replace"))
        for path in (Path(include_dir) / name for name in HEADERS)
        if path.is_file()
    ]
    needed = [std for std in found if std is not None]
    return max(needed) if needed else None


def standard_for_version(version: str) -> int:
    """The fallback table: '2.13.0' -> 17; '2.14.1+cu130', '2.15.0.dev20260101' -> 20."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    release = (int(match.group(1)), int(match.group(2)))
    return max([DEFAULT] + [std for first, std in VERSION_TABLE if release >= first])


def torch_include_dir() -> Path | None:
    """torch/include of the torch this interpreter would import, without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "include"


def torch_cxx_standard(
    include_dir: Path | None = None, version: str | None = None
) -> tuple[int, str]:
    """(standard, why) for the installed torch, or for the given headers and version.

    Example:
        >>> torch_cxx_standard(Path("/nonexistent"), "2.13.0")
        (17, 'no C++ guard in /nonexistent; torch 2.13.0 by the version table')
    """
    include_dir = include_dir if include_dir is not None else torch_include_dir()
    if include_dir is not None:
        needed = standard_from_headers(include_dir)
        if needed is not None:
            return max(DEFAULT, needed), f"C++{needed} guard in {include_dir}"
    if version is None:
        version = importlib.metadata.version("torch")
    return standard_for_version(version), (
        f"no C++ guard in {include_dir}; torch {version} by the version table"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="say which signal decided")
    args = parser.parse_args(argv)
    standard, why = torch_cxx_standard()
    print(f"{standard} ({why})" if args.explain else standard)
    return 0


if __name__ == "__main__":
    sys.exit(main())
