#!/usr/bin/env bash
# The README's demo command: installs dependencies, builds (Release), and runs refit_demo: a
# realistic RL trajectory (AdamW on a transformer-shaped model, BF16 published every step) sent
# version by version through refitd's codec, publisher side and subscriber side, with every
# tensor's digest verified. Prints per version: change rate, wire bytes vs dense bytes, times.
#
#   scripts/demo.sh                         # 127M-parameter model, 10 versions
#   PRESET=500m VERSIONS=20 scripts/demo.sh # larger (about 10 GB of RAM)
#   BUILD_DIR=... JOBS=...                  # build directory (default build-release), parallelism
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build-release}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREFIT_CUDA="${REFIT_CUDA:-AUTO}" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target refit_demo
"$BUILD_DIR/bench/refit_demo" --preset "${PRESET:-medium}" --versions "${VERSIONS:-10}" \
  --link_gbps "${LINK_GBPS:-10}"
