#!/usr/bin/env bash
# `make gpu-bundle`: what the device lacks for scripts/gpu/gpu_check.py, fetched here (where the
# registries are) into an ignored folder that the device `run` carries (docs/gpu.md):
#   * Horovod's sdist as released on PyPI, which scripts/bootstrap.sh builds there with the
#     C++ standard fix (horovod PR #3998; C++20 from torch 2.14), as here: one recipe.
#   * wheels for the device's Python 3.12 on x86_64 that its image lacks: cffi (Horovod's
#     install_requires with PyTorch; its setup.py asks for it at build time) and pycparser;
#     setuptools and wheel, which the image has, for a pip there that prepares the sdist's
#     metadata in an isolated environment, offline.
# Every file is pinned by version and sha256. Idempotent: when the manifest matches the pins
# and every file its hash, nothing is fetched (well under a second).
# Variables: GPU_BUNDLE [build/gpu-bundle]  PYTHON [.venv/bin/python, else python3]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUNDLE=${GPU_BUNDLE:-build/gpu-bundle}
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
# What the device runs: CPython 3.12 on x86_64 (manylinux: glibc there is new enough).
PLATFORM_ARGS=(--python-version 3.12 --implementation cp --only-binary=:all:
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
               --platform manylinux2014_x86_64)
SDIST="horovod==0.28.1 --hash=sha256:92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
WHEELS=(
  "cffi==2.1.1 --hash=sha256:c1453022f490d2459a11819d83ad1d586e9ff65a12ac3e705ffebd46d3685dcf"
  "pycparser==3.12 --hash=sha256:a076f3f489b39b43ed13563a1dafe42447445bec2e294154ec5c57fcdda4c85e"
  "setuptools==84.2.1 --hash=sha256:ca140b45d5325a9478f880e351484f62fef15f336462e449ca0c03c873d589c2"
  "wheel==0.48.0 --hash=sha256:3217dcc807155e45db462d7ef2431f5ddda0d7273b700d05a67b271ceb1287ab"
)
# The device takes 64 MiB in all: the bundle plus the project's tracked files.
LIMIT_BYTES=$((64 * 1024 * 1024))

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

pins_hash=$(printf '%s\n' "$SDIST" "${WHEELS[@]}" | sha256sum | cut -d' ' -f1)
if [[ -f "$BUNDLE/MANIFEST" && "$(head -n1 "$BUNDLE/MANIFEST")" == "pins $pins_hash" ]] \
  && (cd "$BUNDLE" && tail -n +2 MANIFEST | sha256sum --check --quiet --status); then
  log "$BUNDLE is up to date ($(du -sh "$BUNDLE" | cut -f1))"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download=("$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --require-hashes
          -d "$tmp/files")
log "fetching Horovod's sdist and ${#WHEELS[@]} wheels for Python 3.12 / x86_64"
"${download[@]}" --no-binary :all: -r <(printf '%s\n' "$SDIST")
"${download[@]}" "${PLATFORM_ARGS[@]}" -r <(printf '%s\n' "${WHEELS[@]}")
# One file a pin (--require-hashes, one hash each). The manifest moves with the files: a move
# stopped half-way fails its hashes next time.
{ echo "pins $pins_hash"; (cd "$tmp/files" && sha256sum -- *); } > "$tmp/MANIFEST"
mv "$tmp/MANIFEST" "$tmp/files/MANIFEST"
rm -rf "$BUNDLE"
mkdir -p "$(dirname "$BUNDLE")"
mv "$tmp/files" "$BUNDLE"

bundle_bytes=$(du -sb "$BUNDLE" | cut -f1)
tracked_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)
total=$((bundle_bytes + tracked_bytes))
log "$BUNDLE: $((bundle_bytes / 1024)) KiB; with the tracked files $((total / 1024)) KiB" \
    "of the device's $((LIMIT_BYTES / 1024)) KiB"
((total <= LIMIT_BYTES)) || { log "too large for one device call"; exit 1; }
