#!/usr/bin/env bash
# The README's demo command: installs dependencies, builds (Release), and runs bench/daemon_demo:
# a real `refitd publisher` and two `refitd subscriber` processes on loopback, fed by a trainer
# (the demo process, through the publisher's TrainerApi over a unix socket and a memfd) with a
# realistic RL trajectory (AdamW on a transformer-shaped model, BF16 published every step).
# Per version it prints the change rate, bits per changed element against the entropy bound,
# wire vs dense bytes, each subscriber's refit latency, publish -> all acknowledged, and whether
# both subscribers' digests verified against the publisher's; then a summary. Exits non-zero if
# any check fails.
#
#   scripts/demo.sh                          # 551M-parameter model, 10 versions: about 16-18 GB of
#                                            # RAM in all (generator ~9 GB, daemons ~8 GB), ~6 min on 2 cores
#   PRESET=medium VERSIONS=5 scripts/demo.sh # smaller and quicker (127M)
#   BUILD_DIR=... JOBS=... THREADS=... LOG_LEVEL=... KEEP=1
#     build directory (default build-release), build parallelism, worker threads (0 = all),
#     the daemons' log level (logs in the demo's temp dir), keep the temp dir (configs, logs)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build-release}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREFIT_CUDA="${REFIT_CUDA:-AUTO}" \
  -DREFIT_BUILD_BENCH=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target refitd daemon_demo
args=(--refitd "$BUILD_DIR/daemon/cli/refitd" --preset "${PRESET:-500m}" --versions "${VERSIONS:-10}"
      --threads "${THREADS:-0}" --log-level "${LOG_LEVEL:-warn}")
if [ -n "${KEEP:-}" ]; then args+=(--keep); fi
exec "$BUILD_DIR/bench/daemon_demo" "${args[@]}"
