#!/usr/bin/env bash
# The README's demo command: installs dependencies, builds (Release), and runs bench/wan/demo.py:
# a real `refitd publisher` and two `refitd subscriber` processes (mTLS, 4 connections each), fed
# by a trainer through the publisher's TrainerApi (a memfd over a unix socket) with a realistic RL
# trajectory (AdamW on fp32 masters of a transformer-shaped model, BF16 published every step).
# As root with CAP_NET_ADMIN, /dev/net/tun and `ip`, the subscribers sit across bench/wan's
# emulated cross-region link (50 ms RTT, 1 Gbit/s, two network namespaces); otherwise on loopback
# (the first line says why). Per version it prints the change rate, wire bytes, the delta's end to
# end time beside the raw TCP copy of the full checkpoint over the same link (1 and 4 streams,
# measured in the same run), their ratio, and whether both subscribers hold exactly the published
# bytes; then a summary. Exits non-zero if any check fails.
#
#   scripts/demo.sh                          # 127M-parameter model (254 MB), 10 delta versions:
#                                            # ~2 min on 2 cores, the first run ~40 s more to
#                                            # generate the trajectory (cached in $REFIT_WAN_CACHE,
#                                            # default /var/tmp/refit-wan-cache, keyed by preset,
#                                            # seed and the generator's sources)
#   PRESET=500m VERSIONS=5 scripts/demo.sh   # 551M parameters (1.10 GB): ~2 min more to generate
#   MODE=loopback scripts/demo.sh            # loopback even when privileged (MODE=netns: required)
#   BUILD_DIR=... JOBS=... THREADS=... KEEP=1
#     build directory (default build-release; an existing one is used as configured), build
#     parallelism, codec/staging threads (default 2), keep the run directory (configs, logs)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build-release}
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREFIT_CUDA="${REFIT_CUDA:-AUTO}" \
    -DREFIT_BUILD_BENCH=ON >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target refitd refitctl link_relay raw_copy make_trajectory \
  read_pass wan_step
args=(--build-dir "$BUILD_DIR" --preset "${PRESET:-medium}" --versions "${VERSIONS:-10}"
      --threads "${THREADS:-2}" --mode "${MODE:-auto}")
if [ -n "${KEEP:-}" ]; then args+=(--keep); fi
exec python3 bench/wan/demo.py "${args[@]}"
