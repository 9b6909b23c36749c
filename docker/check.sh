#!/usr/bin/env bash
# `make docker-check`: build the CPU image with podman and check that the
# build's own self-test ran, then look inside the finished image. Slow (the
# image compiles Horovod), so not part of `make test`. docker/README.md has
# the timings.
#
# podman's chroot isolation is used because it needs no container runtime or
# privileges beyond root; `podman run` cannot work on such a machine, so the
# image's files are checked through `podman image mount` + chroot instead.
#
# Variables (defaults in brackets):
#   IMAGE [localhost/horovod-powersgd:cpu]   tag to build
#   BASE_IMAGE [python:3.11-slim-bookworm]   pulled if possible; otherwise a local
#       stand-in is built from Debian packages by docker/local-base.sh
#   LOG [runs/docker-check/build.log]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

IMAGE=${IMAGE:-localhost/horovod-powersgd:cpu}
BASE_IMAGE=${BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}
LOCAL_BASE=localhost/horovod-powersgd-base:bookworm
LOG=${LOG:-runs/docker-check/build.log}
mkdir -p "$(dirname "$LOG")"

log() { printf '[docker-check] %s\n' "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

if ! command -v podman >/dev/null; then
  log "installing podman (Debian)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman >/dev/null
fi

# --- base image: the real one if it can be pulled, else a local stand-in -------
base=$BASE_IMAGE
if ! podman image exists "$base" && ! timeout 120 podman pull -q "$base" >/dev/null 2>&1; then
  log "cannot pull $base; using $LOCAL_BASE made from Debian packages"
  base=$LOCAL_BASE
  if ! podman image exists "$base"; then
    command -v debootstrap >/dev/null || {
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    }
    bash docker/local-base.sh "$base"
  fi
fi

build_args=(--build-arg "BASE_IMAGE=$base")
volumes=()
# torch's CPU wheel index, where reachable; otherwise pip's own configuration
# (on this machine a local wheel folder, mounted into the build below).
if ! curl -fsS --max-time 20 -o /dev/null https://download.pytorch.org/whl/cpu/ 2>/dev/null; then
  log "torch's CPU index is unreachable: building with pip's configured indexes only"
  build_args+=(--build-arg TORCH_INDEX_URL=)
fi
for d in ${PIP_FIND_LINKS:-}; do
  if [[ -d "$d" ]]; then volumes+=(--volume "$d:$d:ro"); fi
done

# --- build ------------------------------------------------------------------------
log "podman build --isolation chroot -t $IMAGE (log: $LOG)"
start=$SECONDS
if ! podman build --isolation chroot -t "$IMAGE" "${build_args[@]}" "${volumes[@]}" . \
    >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  fail "podman build failed (full log: $LOG)"
fi
log "built $IMAGE in $((SECONDS - start)) s"

# --- the build's own self-test ran and passed ---------------------------------------
for want in 'Available Frameworks:' '\[X\] PyTorch' '\[X\] MPI' '\[X\] Gloo' 'self-test passed:'; do
  grep -q -- "$want" "$LOG" || fail "the build log lacks '$want' (log: $LOG)"
done
grep -m1 'self-test passed:' "$LOG" >&2

# --- the finished image, from the inside ----------------------------------------------
# Run docker/smoke.sh as the image would, in a chroot of its root file system,
# in private mount and network namespaces (nothing stays mounted, sshd's port
# is on a loopback of its own).
root=$(podman image mount "$IMAGE")
trap 'podman image unmount "$IMAGE" >/dev/null' EXIT
log "running docker/smoke.sh inside the image (chroot of $root)"
# shellcheck disable=SC2016  # expanded by the inner shell
unshare --mount --net --fork bash -euo pipefail -c '
  root=$1
  ip link set lo up
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  for d in dev/shm tmp run; do mount -t tmpfs tmpfs "$root/$d"; done
  exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
    PATH=/opt/horovod-powersgd/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \
    bash /opt/horovod-powersgd/docker/smoke.sh
' _ "$root" 2>&1 | tee -a "$LOG"

log "OK: $IMAGE built, its self-test passed, and smoke.sh passed inside it"
