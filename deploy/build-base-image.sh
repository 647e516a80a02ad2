#!/usr/bin/env bash
# Builds a local Debian base image with Python 3.11 for deploy/Dockerfile, for
# machines that cannot pull from a registry:
#
#   sudo deploy/build-base-image.sh [TAG]      # default TAG: elevator-base:bookworm
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=elevator-base:bookworm -t grain-elevator .
#
# The image build still installs from a Python package index, so the base is
# made able to reach one, and checked:
#   EXTRA_CA_CERTS="a.crt b.crt"   PEM CAs for the image to trust too (a
#                                  TLS-intercepting proxy's), see below
#   PIP_INDEX_URL=https://...      an index or mirror, written to the base's
#                                  /etc/pip.conf (default: pip's own, PyPI)
#   HTTP(S)_PROXY, NO_PROXY        passed to the check (give docker build the
#                                  same, e.g. in ~/.docker/config.json)
# After building, pip inside the base downloads one package; where it cannot,
# the script says why and what to set in one line, removes the image and
# exits 1.
set -euo pipefail
tag="${1:-elevator-base:bookworm}"
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
command -v docker >/dev/null || { echo "needs docker, to import the image" >&2; exit 1; }
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm into $root ..."
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  bookworm "$root" >/dev/null
# Debian marks its Python as externally managed; the image is ours to manage.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
# debootstrap leaves its .debs and the package lists behind (~100 MB).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# Behind a TLS-intercepting proxy, pip in the image must trust its CA as well
# (Debian's pip reads the system's CAs, which update-ca-certificates writes):
#   EXTRA_CA_CERTS="/usr/local/share/ca-certificates/proxy.crt" deploy/build-base-image.sh
if [ -n "${EXTRA_CA_CERTS:-}" ]; then
  for ca in $EXTRA_CA_CERTS; do
    name="$(basename "$ca")"
    install -m 0644 "$ca" "$root/usr/local/share/ca-certificates/${name%.*}.crt"
  done
  chroot "$root" update-ca-certificates >/dev/null
fi
if [ -n "${PIP_INDEX_URL:-}" ]; then
  printf '[global]\nindex-url = %s\n' "$PIP_INDEX_URL" > "$root/etc/pip.conf"
fi
tar -C "$root" -c . | docker import - "$tag"
echo "built $tag"

# pip in the base must reach the index, or `docker build` fails at its first
# install, deep in its output. Ask now, once.
index="${PIP_INDEX_URL:-https://pypi.org/simple}"
echo "checking that pip in $tag reaches $index ..."
if out="$(docker run --rm -e HTTP_PROXY -e HTTPS_PROXY -e NO_PROXY -e http_proxy \
            -e https_proxy -e no_proxy "$tag" python3 -m pip download --no-deps \
            --retries 2 --timeout 15 --disable-pip-version-check --no-cache-dir \
            --dest /tmp/pip-check pip 2>&1)"; then
  echo "pip in $tag reaches $index"
  exit 0
fi
if grep -q "CERTIFICATE_VERIFY_FAILED" <<<"$out"; then
  why="the index's TLS certificate is not trusted (a TLS-intercepting proxy?)"
  fix="rebuild with EXTRA_CA_CERTS=/path/to/proxy-ca.crt (the proxy's CA, PEM)"
elif grep -qE "ProxyError|NewConnectionError|Name or service not known|Temporary failure in name resolution|Network is unreachable|timed out" <<<"$out"; then
  why="no connection to it from a container"
  fix="set HTTPS_PROXY (and Docker's proxy settings) to reach it, or PIP_INDEX_URL to a mirror that a container reaches"
else
  why="$(grep -m1 "ERROR" <<<"$out" || tail -n1 <<<"$out")"
  fix="set PIP_INDEX_URL to an index that a container reaches"
fi
docker image rm "$tag" >/dev/null || true
echo "error: pip in $tag cannot download from $index: $why; $fix, then run this again" >&2
exit 1
