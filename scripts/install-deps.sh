#!/usr/bin/env bash
# Installs everything refitd needs to build and test, from Debian 12's packages.
# Safe to re-run. Needs root (or sudo). The CUDA toolkit is optional: with nvcc on PATH (or in
# /usr/local/cuda) the kernels are built too.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  clang libclang-rt-14-dev            # libFuzzer target and sanitizers; -Wthread-safety
  clang-format clang-tidy             # scripts/check-style.sh: changed lines formatted, tidy checks
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev liblz4-dev libzstd-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-grpcio python3-protobuf python3-torch python3-pytest python3-setuptools
  python3-venv                        # the test venv of PyPI packages (python/requirements-model.txt)
  openssl iproute2
  util-linux                          # setpriv: tests run clients as an unprivileged user
  systemd python3-yaml                # deploy checks: systemd-analyze verify/security, k8s YAML
  libssl-dev                          # libcrypto: refitd checks TLS files itself (README)
  prometheus-cpp-dev                  # the daemons' metrics endpoint (daemon/metrics)
  prometheus                          # ops tests: a real Prometheus server and promtool
)

# --build-only: what building refitd and refitctl needs (the container image's build stage,
# deploy/container/Containerfile), not the test, benchmark and demo tools.
if [ "${1:-}" = "--build-only" ]; then
  PKGS=(
    build-essential cmake ninja-build pkg-config ca-certificates binutils
    libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
    libabsl-dev libspdlog-dev libfmt-dev liblz4-dev libzstd-dev libyaml-cpp-dev libssl-dev
    prometheus-cpp-dev
    libgtest-dev libgmock-dev         # configure finds GTest (the tests are not built)
  )
elif [ $# -gt 0 ]; then
  echo "usage: install-deps.sh [--build-only]" >&2
  exit 2
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The test venv (.venv, beside Debian's python3 packages: --system-site-packages keeps Debian's
# torch 1.13, grpc and protobuf) with the PyPI packages of python/requirements-model.txt:
# Hugging Face transformers 4.40.2 (the last releases that support torch 1.13) and its
# dependencies, for the real-model consumer test (python/tests_model). Not for --build-only.
if [ "${1:-}" != "--build-only" ]; then
  ROOT=$(cd "$(dirname "$0")/.." && pwd)
  VENV="$ROOT/.venv"
  if ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
    echo "install-deps: test venv $VENV (python/requirements-model.txt)"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/python/requirements-model.txt"
  fi
fi
