#!/usr/bin/env bash
# Entry point of the horovod-powersgd images: optionally starts sshd so that
# `horovodrun -H node1:N,node2:N -p 2222 ...` on one container reaches the
# others, then runs the command (by default `make demo`).
#
#   entrypoint.sh COMMAND...   run COMMAND; with SSHD=1 start sshd first
#   entrypoint.sh keygen       write a fresh cluster key set into SSH_KEY_DIR, then exit
#
# Variables (defaults in brackets):
#   SSHD [0]                        1: start sshd (key-only, root by key) before COMMAND
#   SSH_PORT [2222]                 port sshd listens on, and that ssh uses to reach the others
#   SSH_KEY_DIR [/etc/horovod-ssh]  the cluster's keys, the same on every node (a volume or a
#                                   secret): id_ed25519(.pub) for root's logins, and
#                                   ssh_host_ed25519_key(.pub), one host key all nodes present,
#                                   so ssh can check it instead of trusting whatever answers.
set -euo pipefail

SSH_PORT=${SSH_PORT:-2222}
SSH_KEY_DIR=${SSH_KEY_DIR:-/etc/horovod-ssh}

log() { printf '[entrypoint] %s\n' "$*" >&2; }

keygen() {
  mkdir -p "$SSH_KEY_DIR"
  if [[ -f "$SSH_KEY_DIR/id_ed25519" && -f "$SSH_KEY_DIR/ssh_host_ed25519_key" ]]; then
    log "keys already in $SSH_KEY_DIR; keeping them"
    return
  fi
  rm -f "$SSH_KEY_DIR"/id_ed25519* "$SSH_KEY_DIR"/ssh_host_ed25519_key*
  ssh-keygen -q -t ed25519 -N '' -C horovod-cluster -f "$SSH_KEY_DIR/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -C horovod-cluster-host -f "$SSH_KEY_DIR/ssh_host_ed25519_key"
  log "wrote a new cluster key set to $SSH_KEY_DIR"
}

start_sshd() {
  for f in id_ed25519 id_ed25519.pub ssh_host_ed25519_key ssh_host_ed25519_key.pub; do
    if [[ ! -f "$SSH_KEY_DIR/$f" ]]; then
      log "SSHD=1 but $SSH_KEY_DIR/$f is missing: mount the cluster's keys there"
      log "(make them once with: entrypoint.sh keygen, e.g. compose's keygen service)"
      exit 1
    fi
  done
  # Copies, not links: the mounted files may be read-only or have modes that
  # ssh and sshd reject for private keys.
  install -d -m 700 /root/.ssh /run/sshd
  install -m 600 "$SSH_KEY_DIR/id_ed25519" /root/.ssh/id_ed25519
  install -m 644 "$SSH_KEY_DIR/id_ed25519.pub" /root/.ssh/id_ed25519.pub
  install -m 600 "$SSH_KEY_DIR/id_ed25519.pub" /root/.ssh/authorized_keys
  install -m 600 "$SSH_KEY_DIR/ssh_host_ed25519_key" /etc/ssh/ssh_host_ed25519_key
  install -m 644 "$SSH_KEY_DIR/ssh_host_ed25519_key.pub" /etc/ssh/ssh_host_ed25519_key.pub

  # Every node presents the shared host key, so one known_hosts line covers
  # them all and host-key checking stays on.
  printf '* %s\n' "$(cut -d' ' -f1,2 "$SSH_KEY_DIR/ssh_host_ed25519_key.pub")" \
    > /root/.ssh/known_hosts
  # ssh (mpirun's launcher and horovodrun's checks) goes to the same port.
  cat > /root/.ssh/config <<EOF
Host *
  Port $SSH_PORT
  IdentityFile /root/.ssh/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking yes
  UserKnownHostsFile /root/.ssh/known_hosts
  LogLevel ERROR
EOF
  chmod 600 /root/.ssh/config

  # A remote command gets this image's PATH (the venv first), not sshd's default.
  printf 'PATH=%s\n' "$PATH" > /root/.ssh/environment
  cat > /etc/ssh/sshd_config.d/horovod.conf <<EOF
Port $SSH_PORT
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitUserEnvironment PATH
UseDNS no
EOF
  /usr/sbin/sshd -t
  /usr/sbin/sshd
  log "sshd listening on port $SSH_PORT"
}

if [[ "${1:-}" == keygen ]]; then
  keygen
  exit 0
fi
if [[ "${SSHD:-0}" == 1 ]]; then
  start_sshd
fi
exec "$@"
