#!/usr/bin/env bash
# The GPU check (issue 39) in one command: on the device machine it builds Horovod with
# NCCL from the carried bundle and measures at full size; here, on the CPU, it runs the
# same phases with tiny models and the Horovod already installed (make test runs it so).
#   bash scripts/gpu/gpu_check.sh                  # size from the machine: full with CUDA, else tiny
#   bash scripts/gpu/gpu_check.sh --size tiny      # options: python3 scripts/gpu/gpu_check.py --help
# Results in $OUT (default build/gpu-check): report.json, report.md, one log per phase.
# docs/gpu.md gives the device call.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1
# The project's environment where there is one (here); the machine's python3 elsewhere
# (the device's holds its torch).
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
exec "$PYTHON" scripts/gpu/gpu_check.py --out "${OUT:-$ROOT/build/gpu-check}" "$@"
