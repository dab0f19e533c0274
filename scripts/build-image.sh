#!/usr/bin/env bash
# Builds refitd's container image (deploy/container/Containerfile) with buildah, Debian's
# daemonless builder (as root here; rootless works with the user's subuid range), then checks it.
#
#   scripts/build-image.sh [--tag refitd:0.1.0] [--cuda DIR|none] [--oci FILE]
#
# The base image is debian:12. When it is neither in local storage nor pullable (no registry
# reachable, as on the project's build machines), it is made from Debian's own packages:
# debootstrap --variant=minbase bookworm, committed as localhost/debian:12.
# --cuda DIR: build with the CUDA kernels (GPU stores and the GPU encoder), the toolkit taken from
# DIR; default `auto`: /usr/local/cuda if it has bin/nvcc, else `none` (host stores only).
# --oci FILE: also write the image as an OCI archive.
# Checks: refitd --version and refitctl --help run in the image, as uid 10001; every shared
# library resolves (ldd); no compiler or headers; a publisher from the shipped example config
# serves refitctl status.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=refitd:0.1.0
CUDA=auto
OCI=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=$2; shift 2 ;;
    --cuda) CUDA=$2; shift 2 ;;
    --oci) OCI=$2; shift 2 ;;
    *) echo "usage: build-image.sh [--tag NAME:TAG] [--cuda DIR|none] [--oci FILE]" >&2; exit 2 ;;
  esac
done
for tool in buildah debootstrap; do
  if ! command -v "$tool" > /dev/null; then
    echo "build-image: $tool is not installed (apt-get install buildah debootstrap)" >&2
    exit 1
  fi
done
# vfs storage and chroot isolation need no kernel overlay or user-namespace support.
B=(buildah --storage-driver vfs)
export BUILDAH_ISOLATION=chroot
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
stamp() { echo "=== build-image [$(date +%T)] $*"; }

BASE=debian:12
if ! "${B[@]}" inspect --type image "$BASE" > /dev/null 2>&1 &&
   ! timeout 60 "${B[@]}" pull -q "docker.io/library/$BASE" > /dev/null 2>&1; then
  BASE=localhost/debian:12
  if ! "${B[@]}" inspect --type image "$BASE" > /dev/null 2>&1; then
    stamp "no debian:12 image and no registry: making $BASE with debootstrap"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian > "$WORK/debootstrap.log" 2>&1 ||
      { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    ctr=$("${B[@]}" from scratch)
    mnt=$("${B[@]}" mount "$ctr")
    cp -a "$WORK/rootfs/." "$mnt/"
    "${B[@]}" umount "$ctr" > /dev/null
    "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --cmd /bin/bash "$ctr"
    "${B[@]}" commit -q "$ctr" "$BASE" > /dev/null
    "${B[@]}" rm "$ctr" > /dev/null
  fi
fi

mkdir -p "$WORK/no-cuda"
CUDA_CTX="$WORK/no-cuda"
REFIT_CUDA=OFF
if [ "$CUDA" = auto ]; then
  [ -x /usr/local/cuda/bin/nvcc ] && CUDA=/usr/local/cuda || CUDA=none
fi
if [ "$CUDA" != none ]; then
  [ -x "$CUDA/bin/nvcc" ] || { echo "build-image: no $CUDA/bin/nvcc" >&2; exit 2; }
  CUDA_CTX=$CUDA
  REFIT_CUDA=ON
fi

stamp "building $TAG from $BASE (REFIT_CUDA=$REFIT_CUDA)"
"${B[@]}" bud --pull=never --layers=false --build-arg "BASE=$BASE" \
  --build-arg "REFIT_CUDA=$REFIT_CUDA" --build-context "cuda=$CUDA_CTX" \
  -f deploy/container/Containerfile -t "$TAG" .

stamp "checking $TAG"
ctr=$("${B[@]}" from "$TAG")
trap '"${B[@]}" rm "$ctr" > /dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
user=$("${B[@]}" inspect --type image --format '{{.OCIv1.Config.User}}' "$TAG")
[ "$user" = "10001:10001" ] || { echo "build-image: image user is '$user', not 10001:10001" >&2; exit 1; }
version=$("${B[@]}" run --user 10001:10001 "$ctr" -- /usr/local/bin/refitd --version)
echo "in the image: $version"
[ "$version" = "refitd 0.1.0" ] || { echo "build-image: refitd --version said '$version'" >&2; exit 1; }
"${B[@]}" run --user 10001:10001 "$ctr" -- /usr/local/bin/refitctl --help > /dev/null
"${B[@]}" run "$ctr" -- sh -c '! ldd /usr/local/bin/refitd /usr/local/bin/refitctl | grep "not found"'
"${B[@]}" run "$ctr" -- sh -c 'test ! -e /usr/bin/c++ && test ! -e /usr/include/grpcpp'  # runtime only
# It serves: a publisher from the shipped example config answers refitctl status, as uid 10001.
"${B[@]}" run --user 10001:10001 "$ctr" -- sh -c '
  set -e
  cfg=/usr/share/refitd/examples/publisher.loopback.yaml
  refitd publisher --config $cfg --validate > /dev/null
  mkdir -p /tmp/refitd-demo/publish /tmp/refitd-demo/export
  refitd publisher --config $cfg > /tmp/publisher.log 2>&1 &
  pid=$!
  for i in $(seq 200); do
    refitctl --target unix:/tmp/refitd-demo/publisher-control.sock status > /tmp/status.txt 2>&1 && break
    sleep 0.1
  done
  kill $pid; wait $pid || true
  grep -q "^role: *publisher" /tmp/status.txt || { cat /tmp/status.txt /tmp/publisher.log; exit 1; }
  echo "in the image: a publisher served refitctl status"'
"${B[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG"
if [ -n "$OCI" ]; then
  "${B[@]}" push -q "$TAG" "oci-archive:$OCI:$TAG"
  echo "wrote $OCI"
fi
stamp "done: $TAG"
