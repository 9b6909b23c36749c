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
# --format docker: the OCI format has no SHELL, and podman would run every RUN
# with /bin/sh, without pipefail.
if ! podman build --isolation chroot --format docker -t "$IMAGE" \
    "${build_args[@]}" "${volumes[@]}" . \
    >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  fail "podman build failed (full log: $LOG)"
fi
log "built $IMAGE in $((SECONDS - start)) s"

# --- the build's own self-test ran and passed ---------------------------------------
# The output of the Dockerfile's last RUN (`horovodrun --check-build` and the
# import + hvd.init() line). When that step came from the cache it did not run
# now, but podman caches a RUN layer only if its command succeeded, and
# smoke.sh below runs the same checks in the finished image.
selftest=$(awk '/^STEP [0-9]+\/[0-9]+: RUN horovodrun --check-build/ { on = 1; next }
                /^STEP / { on = 0 } on' "$LOG")
if grep -q -- '--> Using cache' <<<"$selftest"; then
  log "the self-test step is cached from an earlier build that passed it; smoke.sh repeats it"
else
  for want in 'Available Frameworks:' '\[X\] PyTorch' '\[X\] MPI' '\[X\] Gloo' '^self-test passed:'; do
    grep -q -- "$want" <<<"$selftest" || fail "the self-test's output lacks '$want' (log: $LOG)"
  done
  log "the build's self-test ran: $(grep -m1 '^self-test passed:' <<<"$selftest")"
fi

# --- the finished image, from the inside ----------------------------------------------
# `podman run` does not work here, so docker/chroot-node.sh runs the image as
# a container would, in network namespaces made for this check: one node
# (docker/smoke.sh), then two nodes on a veth pair named eth0 on both ends,
# sshd on port 2222 in each, and horovodrun on node1 reaching node2 over ssh.
ns1=hps-check-node1 ns2=hps-check-node2
work=$(mktemp -d)
source docker/netns-pair.sh
cleanup() {
  # Processes started in the nodes' namespaces by this check (sshd, orted).
  netns_pair_down hps-check
  podman image unmount "$IMAGE" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
root=$(podman image mount "$IMAGE")
IMAGE_ENV=$(podman image inspect --format '{{join .Config.Env "\n"}}' "$IMAGE")
IMAGE_WORKDIR=$(podman image inspect --format '{{.Config.WorkingDir}}' "$IMAGE")
IMAGE_ENTRYPOINT=$(podman image inspect --format '{{index .Config.Entrypoint 0}}' "$IMAGE")
export IMAGE_ENV IMAGE_WORKDIR IMAGE_ENTRYPOINT

printf '127.0.0.1 localhost\n10.77.0.1 node1\n10.77.0.2 node2\n' > "$work/hosts"
mkdir "$work/keys"
netns_pair_up hps-check 10.77.0  # namespaces $ns1 and $ns2
node() { # node NUMBER [VAR=VALUE...] -- COMMAND...
  local i=$1
  shift
  ip netns exec "hps-check-node$i" docker/chroot-node.sh "$root" "node$i" "$work/hosts" "$work/keys" "$@"
}

log "one node: docker/smoke.sh in the image"
node 1 -- docker/smoke.sh 2>&1 | tee -a "$LOG"

log "two nodes: node2 runs sshd; node1 runs horovodrun -H node1:1,node2:1 -p 2222"
node 1 -- keygen 2>&1 | tee -a "$LOG"
node 2 SSHD=1 -- sleep 900 >>"$LOG" 2>&1 &
for _ in $(seq 60); do
  ip netns exec "$ns1" bash -c '</dev/tcp/10.77.0.2/2222' 2>/dev/null && break
  sleep 1
done
node 1 SSHD=1 HOSTS=node1:1,node2:1 IFACE=eth0 -- docker/smoke.sh 2>&1 | tee -a "$LOG"

log "OK: $IMAGE; build and checks took $((SECONDS - start)) s; smoke.sh passed on one node and across two"
