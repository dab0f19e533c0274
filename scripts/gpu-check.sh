#!/usr/bin/env bash
# One command for a GPU machine: lists the GPUs, runs the GPU codec tests, runs the GPU benchmark,
# and exits non-zero if a test or a benchmark check fails. Every step has a timeout; the whole run
# stays under about 6.5 minutes.
#
#   scripts/gpu-check.sh --prebuilt DIR   run the binaries from scripts/gpu-prebuild.sh DIR (for a
#                                         machine without the Debian libraries: LD_LIBRARY_PATH=DIR/lib)
#   scripts/gpu-check.sh [--build-dir DIR]   configure and build here first (needs the dependencies)
#
# Options:
#   --quick            skip the >4 Gi-element test and run the benchmark on 2^28 elements
#   --sanitize         also run compute-sanitizer (memcheck, racecheck) on a few small tests, where
#                      the machine supports it (adds up to 3 minutes)
#   --out DIR          also write the logs and the benchmark's JSON lines into DIR
#   --bench-args "..." extra arguments for gpu_codec_bench (default: 2^30 elements, rates 1% and 3%)
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREBUILT=""
BUILD_DIR="$ROOT/build-gpu"
QUICK=0
SANITIZE=0
OUTDIR=""
BENCH_ARGS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prebuilt) PREBUILT=$2; shift 2 ;;
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --sanitize) SANITIZE=1; shift ;;
    --out) OUTDIR=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done

start=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - start))s] $*"; }
failures=()
LOG=/dev/null
if [[ -n "$OUTDIR" ]]; then
  mkdir -p "$OUTDIR"
  LOG="$OUTDIR/gpu-check.log"
  : >"$LOG"
fi
# run NAME TIMEOUT CMD...: runs a step with a timeout, output to the terminal (and the log).
run() {
  local name=$1 limit=$2
  shift 2
  stamp "$name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "gpu-check: $name timed out after ${limit}s" | tee -a "$LOG"
  fi
  if [[ $rc -ne 0 ]]; then failures+=("$name (exit $rc)"); fi
  return "$rc"
}

stamp "GPUs"
timeout 15 nvidia-smi -L 2>&1 | tee -a "$LOG" || echo "gpu-check: nvidia-smi failed" | tee -a "$LOG"
timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
  tee -a "$LOG" || true

if [[ -n "$PREBUILT" ]]; then
  BIN=$(cd "$PREBUILT" && pwd)
  export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  chmod +x "$BIN"/codec_cuda_test "$BIN"/refit_codec_test "$BIN"/gpu_codec_bench 2>/dev/null || true
  [[ -f "$BIN/MANIFEST.txt" ]] && head -5 "$BIN/MANIFEST.txt"
  GPU_TEST="$BIN/codec_cuda_test"
  CPU_TEST="$BIN/refit_codec_test"
  BENCH="$BIN/gpu_codec_bench"
else
  run "configure" 120 cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DREFIT_CUDA=ON -DREFIT_BUILD_BENCH=ON || exit 1
  run "build" 420 cmake --build "$BUILD_DIR" -j "$(nproc)" --target codec_cuda_test gpu_codec_bench \
    refit_codec_test || exit 1
  GPU_TEST="$BUILD_DIR/cuda/codec_cuda_test"
  CPU_TEST="$BUILD_DIR/daemon/codec/refit_codec_test"
  BENCH="$BUILD_DIR/bench/gpu_codec_bench"
fi
for f in "$GPU_TEST" "$CPU_TEST" "$BENCH"; do
  [[ -x "$f" ]] || { echo "gpu-check: missing $f" >&2; exit 1; }
done

# The CPU codec tests first: they show that the binaries and their libraries load here.
run "CPU codec tests" 45 "$CPU_TEST" --gtest_brief=1

GTEST_ARGS=(--gtest_brief=1)
if [[ $QUICK -eq 1 ]]; then export REFIT_GPU_TEST_HUGE=0; fi
run "GPU codec tests" 200 "$GPU_TEST" "${GTEST_ARGS[@]}"
# A skipped suite means no usable device: that is a failure on a GPU machine.
if ! "$GPU_TEST" --gtest_filter='CudaCodec.DeviceDescription' 2>&1 | grep -q '^device: '; then
  failures+=("no usable CUDA device seen by the tests")
fi

if [[ $SANITIZE -eq 1 ]]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    SMALL='CudaCodec.SpecialValues:CudaCodec.DigestMatchesCpu:CudaCodec.FlippedPayload*:CudaCodec.ManyWaves*'
    for tool in memcheck racecheck; do
      run "compute-sanitizer $tool" 90 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        "$GPU_TEST" --gtest_brief=1 --gtest_filter="$SMALL" || true
    done
  else
    echo "gpu-check: compute-sanitizer not found; --sanitize skipped"
  fi
fi

if [[ -z "$BENCH_ARGS" ]]; then
  if [[ $QUICK -eq 1 ]]; then BENCH_ARGS="--elements 268435456"; else BENCH_ARGS=""; fi
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words by design
run "GPU benchmark" 120 "$BENCH" --json $BENCH_ARGS
if [[ -n "$OUTDIR" ]]; then
  grep '^{"bench":"gpu_codec"' "$LOG" >"$OUTDIR/gpu_codec_bench.jsonl" || true
fi

stamp "done"
if [[ ${#failures[@]} -gt 0 ]]; then
  echo "gpu-check: FAILED: ${failures[*]}"
  exit 1
fi
echo "gpu-check: all passed"
