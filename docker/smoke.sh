#!/usr/bin/env bash
# A quick proof that an image of horovod-powersgd works (about a minute).
#
#   docker run --rm horovod-powersgd:cpu docker/smoke.sh
#     one node: Horovod's build check, the package imports, Horovod initialises, 2 ranks all-reduce
#     over Gloo and over MPI, and sshd (entrypoint.sh, SSHD=1) takes a key
#     login with the image's PATH on the far side;
#   HOSTS=node1:2,node2:2 IFACE=eth0 docker/smoke.sh
#     on one node of a cluster whose nodes run with SSHD=1 (compose.yaml):
#     one all-reduce across all of them, over Gloo and over MPI.
# `make docker-check` runs both in chroots of the image it built.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '[smoke] %s\n' "$*" >&2; }

allreduce='
import horovod.torch as hvd, torch
hvd.init()
total = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
n = hvd.size()
assert total.tolist() == [n * (n + 1) / 2] * 3, total
print(f"rank {hvd.rank()} of {n} on {hvd.local_rank()}/{hvd.local_size()} of its node: allreduce ok")
'

if [[ -n "${HOSTS:-}" ]]; then
  np=0
  for slot in ${HOSTS//,/ }; do np=$((np + ${slot##*:})); done
  for controller in gloo mpi; do
    log "horovodrun -np $np -H $HOSTS --$controller"
    timeout 300 horovodrun -np "$np" -H "$HOSTS" -p "${SSH_PORT:-2222}" \
      ${IFACE:+--network-interface "$IFACE"} "--$controller" python -c "$allreduce"
  done
  log "all-reduce across $HOSTS passed"
  exit 0
fi

horovodrun --check-build
python -c 'import horovod_powersgd, horovod.torch as hvd; hvd.init(); print("import + hvd.init ok")'

for controller in gloo mpi; do
  log "horovodrun -np 2 --$controller"
  timeout 300 horovodrun -np 2 -H localhost:2 "--$controller" python -c "$allreduce"
done

log "sshd via docker/entrypoint.sh"
keys=$(mktemp -d)
SSH_KEY_DIR=$keys docker/entrypoint.sh keygen
SSH_KEY_DIR=$keys SSHD=1 docker/entrypoint.sh true
trap 'kill "$(cat /run/sshd.pid)" 2>/dev/null || true; rm -rf "$keys"' EXIT
# Key login with host-key checking on, and the image's PATH on the far side.
remote_python=$(ssh localhost 'command -v python')
if [[ "$remote_python" != "$PWD/.venv/bin/python" ]]; then
  log "FAIL: an ssh session finds python at '$remote_python', not in the venv"
  exit 1
fi
log "sshd on ${SSH_PORT:-2222}: key login ok, remote PATH has the venv"
log "all smoke checks passed"
