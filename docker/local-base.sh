#!/usr/bin/env bash
# Make a local stand-in for the Dockerfile's base image (python:3.11-slim-bookworm)
# from Debian's own packages, for a machine that reaches a Debian mirror but no
# container registry. It has what the Dockerfile asks of a base: Debian bookworm
# and Python 3.11 (Debian's 3.11.2) as `python3`, with venv and headers.
#
#   bash docker/local-base.sh [IMAGE]      # default localhost/horovod-powersgd-base:bookworm
# then:
#   podman build --isolation chroot --build-arg BASE_IMAGE=IMAGE ...
#
# Needs root, debootstrap and podman. Takes about a minute.
# Variables: DEBIAN_RELEASE [bookworm], DEBIAN_MIRROR [http://deb.debian.org/debian].
set -euo pipefail

IMAGE=${1:-localhost/horovod-powersgd-base:bookworm}
DEBIAN_RELEASE=${DEBIAN_RELEASE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { printf '[local-base] %s\n' "$*" >&2; }

rootfs=$(mktemp -d /var/tmp/horovod-powersgd-rootfs.XXXXXX)
cleanup() {
  # debootstrap mounts /proc (and may bind /dev, /sys) inside the tree and
  # leaves them mounted if it fails: unmount before deleting, never delete
  # through a mount.
  awk -v r="$rootfs/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r \
    | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

log "debootstrap $DEBIAN_RELEASE from $DEBIAN_MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
  "$DEBIAN_RELEASE" "$rootfs" "$DEBIAN_MIRROR" >/dev/null

# Updates and security fixes, as an official Debian image has.
cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR $DEBIAN_RELEASE main
deb $DEBIAN_MIRROR $DEBIAN_RELEASE-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security $DEBIAN_RELEASE-security main
EOF

# This machine's own view of the network: extra CA certificates (an egress
# proxy that inspects TLS) and pip settings (CA bundle, local wheel folders)
# go into this local image only, never into the Dockerfile. pip in a venv uses
# its own CA bundle unless told otherwise, hence `cert`.
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >/dev/null
fi
{
  echo '[global]'
  echo 'cert = /etc/ssl/certs/ca-certificates.crt'
  if [[ -n "${PIP_FIND_LINKS:-}" ]]; then echo "find-links = $PIP_FIND_LINKS"; fi
} > "$rootfs/etc/pip.conf"

# As in Debian's official images: package scripts never start services during a
# build (in a chroot build they would start on this machine's own network),
# and apt keeps no package cache in the layers.
printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
chmod 755 "$rootfs/usr/sbin/policy-rc.d"
printf 'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n' \
  > "$rootfs/etc/apt/apt.conf.d/docker-clean"

chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin

log "podman import -> $IMAGE"
tar -C "$rootfs" -c . | podman import --quiet \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$IMAGE" >/dev/null
podman image inspect --format '{{.Id}} {{.Size}}' "$IMAGE"
