#!/usr/bin/env bash
# A quick proof that an image of horovod-powersgd works: the package imports,
# Horovod initialises, two ranks all-reduce over Gloo and over MPI, and sshd
# (docker/entrypoint.sh) takes a key login on its port. About a minute.
#   docker run --rm horovod-powersgd:cpu docker/smoke.sh
# `make docker-check` runs it in a chroot of the image it built.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '[smoke] %s\n' "$*" >&2; }

python -c 'import horovod_powersgd, horovod.torch as hvd; hvd.init(); print("import + hvd.init ok")'

allreduce='
import horovod.torch as hvd, torch
hvd.init()
total = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
assert total.tolist() == [3.0, 3.0, 3.0], total
print(f"rank {hvd.rank()} of {hvd.size()}: allreduce ok")
'
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
[[ "$remote_python" == "$PWD/.venv/bin/python" ]] || {
  log "FAIL: ssh session finds python at '$remote_python', not in the venv"
  exit 1
}
log "sshd on ${SSH_PORT:-2222}: key login ok, remote PATH has the venv"
log "all smoke checks passed"
