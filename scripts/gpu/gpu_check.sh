#!/usr/bin/env bash
# The GPU check in one command (scripts/gpu/gpu_check.py says what it runs, and its options;
# docs/gpu.md gives the device call): with the project's .venv where there is one (here),
# else the machine's python3 (the device's holds its torch). Results in $OUT (default
# build/gpu-check).
#   bash scripts/gpu/gpu_check.sh              # size from the machine: full with CUDA, else tiny
#   bash scripts/gpu/gpu_check.sh --size tiny
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
PYTHONUNBUFFERED=1 exec "$PYTHON" scripts/gpu/gpu_check.py --out "${OUT:-$PWD/build/gpu-check}" "$@"
