#!/usr/bin/env bash
# Builds a local Debian base image with Python 3.11 for deploy/Dockerfile, for
# machines that cannot pull from a registry:
#
#   sudo deploy/build-base-image.sh [TAG]      # default TAG: elevator-base:bookworm
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
tar -C "$root" -c . | docker import - "$tag"
echo "built $tag"
