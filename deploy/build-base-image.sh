#!/usr/bin/env bash
# Builds a local Debian base image with Python 3.11 for deploy/Dockerfile, for
# machines that cannot pull from a registry:
#
#   sudo deploy/build-base-image.sh [TAG]      # default TAG: elevator-base:bookworm
#   (EXTRA_CA_CERTS="a.crt b.crt": PEM CAs for the image to trust too, see below)
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=elevator-base:bookworm -t grain-elevator .
set -euo pipefail
tag="${1:-elevator-base:bookworm}"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
echo "debootstrap bookworm into $root ..."
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  bookworm "$root" >/dev/null
# Debian marks its Python as externally managed; the image is ours to manage.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
# debootstrap leaves its .debs and the package lists behind (~100 MB).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# Behind a TLS-intercepting proxy, pip in the image must trust its CA as well:
#   EXTRA_CA_CERTS="/usr/local/share/ca-certificates/proxy.crt" deploy/build-base-image.sh
if [ -n "${EXTRA_CA_CERTS:-}" ]; then
  for ca in $EXTRA_CA_CERTS; do
    name="$(basename "$ca")"
    install -m 0644 "$ca" "$root/usr/local/share/ca-certificates/${name%.*}.crt"
  done
  chroot "$root" update-ca-certificates >/dev/null
fi
tar -C "$root" -c . | docker import - "$tag"
echo "built $tag"
