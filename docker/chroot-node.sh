#!/usr/bin/env bash
# Run a command in an image's file system much as `docker run` would, where no
# container runtime works (podman's chroot isolation builds images but cannot
# run them): private mount and UTS namespaces, a throw-away writable overlay
# on the image, /proc, /dev, fresh /dev/shm, /tmp and /run, the image's
# environment, working directory and entry point. The network namespace is
# the caller's (e.g. `ip netns exec NS chroot-node.sh ...`). `make docker-check`
# uses it to run an image as one node or as two.
#
#   chroot-node.sh IMAGE_ROOT HOSTNAME HOSTS_FILE KEY_DIR [VAR=VALUE...] -- COMMAND...
#
# IMAGE_ROOT: the image's file system (`podman image mount IMAGE`);
# HOSTS_FILE becomes /etc/hosts and KEY_DIR /etc/horovod-ssh (the cluster's
# keys, see entrypoint.sh); IMAGE_ENV: the image's environment, one VAR=VALUE
# a line (`podman image inspect --format '{{join .Config.Env "\n"}}'`).
# Needs root.
set -euo pipefail

if [[ "${_CHROOT_NODE_NS:-}" != 1 ]]; then
  _CHROOT_NODE_NS=1 exec unshare --mount --uts --fork --kill-child "$0" "$@"
fi

root=$1 name=$2 hosts=$3 keys=$4
shift 4
extra_env=()
while (($#)) && [[ "$1" != -- ]]; do extra_env+=("$1"); shift; done
[[ "${1:-}" == -- ]] && shift
mapfile -t image_env < <(printf '%s\n' "${IMAGE_ENV:-}" | grep -v '^$' || true)

# Nothing mounted here is seen outside this mount namespace, and all of it
# goes away with it; the tmpfs over /mnt holds the overlay's writable layer.
mount -t tmpfs -o size=4g tmpfs /mnt
mkdir /mnt/upper /mnt/work /mnt/root
mount -t overlay overlay -o "lowerdir=$root,upperdir=/mnt/upper,workdir=/mnt/work" /mnt/root
new=/mnt/root
mount -t proc proc "$new/proc"
mount -t sysfs -o ro sysfs "$new/sys"  # hwloc (OpenMPI) reads the CPU topology there
mount --rbind /dev "$new/dev"
for d in dev/shm tmp run; do mount -t tmpfs tmpfs "$new/$d"; done
touch "$new/etc/hosts"  # a runtime provides it; the image need not have one
mount --bind "$hosts" "$new/etc/hosts"
mkdir -p "$new/etc/horovod-ssh"
mount --bind "$keys" "$new/etc/horovod-ssh"
hostname "$name"

workdir=${IMAGE_WORKDIR:-/opt/horovod-powersgd}
entrypoint=${IMAGE_ENTRYPOINT:-/opt/horovod-powersgd/docker/entrypoint.sh}
# shellcheck disable=SC2016  # $1 and $@ belong to the inner bash
exec chroot "$new" /usr/bin/env -i HOME=/root "${image_env[@]}" "${extra_env[@]}" \
  /bin/bash -c 'cd "$1" && shift && exec "$@"' _ "$workdir" "$entrypoint" "$@"
