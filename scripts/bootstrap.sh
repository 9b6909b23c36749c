#!/usr/bin/env bash
# Set up everything horovod-powersgd needs, idempotently:
#   system packages (OpenMPI, compilers, cmake, data sets) -> .venv -> torch ->
#   this project (editable, with extras) -> Horovod built from source against
#   that torch, its wheel cached so the second run takes seconds. Horovod is compiled with
#   the C++ standard the installed torch's headers ask for (scripts/torch_cxx_standard.py:
#   17 up to torch 2.13, 20 from 2.14), which the wheel's key names when it is not 17.
# Used by the Makefile, the Dockerfile and CI, so there is one recipe only.
#
# Variables (defaults in brackets):
#   TORCH_VERSION [2.13.0]  HOROVOD_VERSION [0.28.1]  VENV [.venv]
#   PYTHON [python3]        EXTRAS [test,dev,examples]
#   WHEEL_CACHE [~/.cache/horovod-powersgd/wheels]
#   SKIP_APT=1 skips the system-package step (e.g. in an image that already has them).
set -euo pipefail

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test,dev,examples}
WHEEL_CACHE=${WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-powersgd/wheels}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- 1. system packages --------------------------------------------------------
# OpenMPI for the MPI controller, a C++ toolchain and cmake to compile Horovod,
# iproute2 for the benchmark's bandwidth cap, and two Debian data sets the
# examples train on (no download at run time).
APT_PACKAGES=(libopenmpi-dev openmpi-bin build-essential cmake git iproute2
              dataset-fashion-mnist python3.11-doc)
if [[ "${SKIP_APT:-0}" != 1 ]] && command -v dpkg-query >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
      log "missing system packages: ${missing[*]}"
      log "install them as root:  apt-get install -y --no-install-recommends ${missing[*]}"
      exit 1
    fi
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# --- 2. virtualenv, torch, this project -----------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$ROOT/$VENV/bin/python"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

have_torch=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [[ "$have_torch" != "$TORCH_VERSION" ]]; then
  log "installing torch==$TORCH_VERSION"
  pip_q "torch==$TORCH_VERSION"
fi
# Build helpers Horovod's setup.py needs when built without isolation.
"$PY" -c 'import wheel, setuptools' 2>/dev/null || pip_q wheel setuptools

stamp="$VENV/.project-installed"
if [[ ! -f "$stamp" || setup.py -nt "$stamp" || pyproject.toml -nt "$stamp" ]]; then
  log "installing horovod-powersgd (editable, extras: $EXTRAS)"
  # mpi4py (test extra) compiled against the OpenMPI above, like Horovod: one process
  # holds one MPI library. pip caches the built wheel, so a second venv takes seconds.
  MPICC=mpicc PIP_NO_BINARY=mpi4py pip_q -e ".[$EXTRAS]"
  touch "$stamp"
fi

# --- 3. Horovod, built against this torch ---------------------------------------
gpu_ops=""
if command -v nvcc >/dev/null && "$PY" -c 'import torch,sys; sys.exit(not torch.version.cuda)'; then
  gpu_ops=NCCL
fi
# The C++ standard torch's headers need (17; 20 from torch 2.14): scripts/torch_cxx_standard.py.
# 17 leaves the key as it always was; any other standard is part of it, so a wheel built
# with one standard is never installed for another.
cxx_std=$("$PY" "$ROOT/scripts/torch_cxx_standard.py")
build_opts="pytorch-gloo-mpi${gpu_ops:+-nccl}"
if [[ "$cxx_std" != 17 ]]; then build_opts+="-cxx$cxx_std"; fi
key="horovod${HOROVOD_VERSION}-torch${TORCH_VERSION}-${build_opts}-$(uname -m)"
cached="$WHEEL_CACHE/$key"

installed_key=$(cat "$VENV/.horovod-key" 2>/dev/null || true)
if [[ "$installed_key" != "$key" ]] || ! "$PY" -c 'import horovod.torch' 2>/dev/null; then
  if ! ls "$cached"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION against torch $TORCH_VERSION ($build_opts); takes minutes"
    # The sdist stays beside the wheels (tests/unit/test_bootstrap.py checks the fix on it).
    sdist="$WHEEL_CACHE/horovod-$HOROVOD_VERSION.tar.gz"
    if [[ ! -f "$sdist" ]]; then
      mkdir -p "$WHEEL_CACHE"
      "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" \
        -d "$WHEEL_CACHE"
    fi
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    tar -xzf "$sdist" -C "$src"
    srcdir=$(echo "$src"/horovod-*/)
    # Horovod 0.28.1 compiles with C++14, torch's headers need $cxx_std, and two of its headers
    # miss includes that GCC 13 no longer pulls in: scripts/horovod_source_fixes.sh.
    bash "$ROOT/scripts/horovod_source_fixes.sh" "$srcdir" --cxx-standard "$cxx_std"
    mkdir -p "$cached.tmp"
    (
      cd "$srcdir"
      export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
      export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
      if [[ -n "$gpu_ops" ]]; then export HOROVOD_GPU_OPERATIONS=$gpu_ops; fi
      "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$cached.tmp" .
    )
    rm -rf "$cached" && mv "$cached.tmp" "$cached"
  fi
  log "installing cached Horovod wheel ($key)"
  pip_q --force-reinstall --no-deps "$cached"/horovod-*.whl
  pip_q "$cached"/horovod-*.whl  # now its runtime requirements (cffi, cloudpickle, ...)
  echo "$key" > "$VENV/.horovod-key"
fi

"$VENV/bin/horovodrun" --check-build
# hvd.init(comm=...) hands mpi4py's raw MPI_Comm handle to Horovod: both must use one MPI library.
if "$PY" -c 'import mpi4py' 2>/dev/null; then
  "$PY" -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI
v = MPI.Get_library_version(); assert v.startswith("Open MPI"), f"mpi4py uses {v}"'
fi
