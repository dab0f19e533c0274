#!/usr/bin/env bash
# One command for a GPU machine: lists the GPUs, runs every GPU test (codec kernels, Device layer,
# CUDA store, publisher GPU encode, and the daemons end to end over CUDA IPC), runs the GPU
# benchmark (its "onepass_*" rows time the publisher's one-pass EncodeFused against the separate
# encode / digest v2 / baseline-update passes; a second short run does so at the realistic 1.65%
# change rate), and exits non-zero if a test fails, skips, or a benchmark check fails. Every step has
# a timeout; the whole run stays under about 7.5 minutes.
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
CAPTURE=""
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
  # CAPTURE (a file), when set, also receives the output.
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" ${CAPTURE:+"$CAPTURE"}
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

# Every GPU test binary (ctest label gpu): the codec kernels, the Device layer, the CUDA store,
# the publisher's GPU encode path, and the daemons end to end over CUDA IPC.
GPU_TESTS=(codec_cuda_test device_test cuda_store_test refit_publisher_gpu_test refit_e2e_gpu_test)
if [[ -n "$PREBUILT" ]]; then
  BIN=$(cd "$PREBUILT" && pwd)
  export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  chmod +x "$BIN"/* 2>/dev/null || true
  [[ -f "$BIN/MANIFEST.txt" ]] && head -5 "$BIN/MANIFEST.txt"
  declare -A PATHS=()
  for t in "${GPU_TESTS[@]}" refit_codec_test gpu_codec_bench refitd refitctl; do PATHS[$t]="$BIN/$t"; done
else
  run "configure" 120 cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DREFIT_CUDA=ON -DREFIT_BUILD_BENCH=ON || exit 1
  run "build" 420 cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${GPU_TESTS[@]}" \
    gpu_codec_bench refit_codec_test refitd refitctl || exit 1
  declare -A PATHS=()
  for t in "${GPU_TESTS[@]}" refit_codec_test gpu_codec_bench refitd refitctl; do
    PATHS[$t]=$(find "$BUILD_DIR" -type f -name "$t" -perm -u+x -print -quit)
  done
fi
for t in "${!PATHS[@]}"; do
  [[ -n "${PATHS[$t]}" && -x "${PATHS[$t]}" ]] || { echo "gpu-check: missing $t" >&2; exit 1; }
done
# The e2e test starts these daemons (the harness's compiled-in paths are the build machine's).
export REFIT_E2E_REFITD="${PATHS[refitd]}" REFIT_E2E_REFITCTL="${PATHS[refitctl]}"
GPU_TEST="${PATHS[codec_cuda_test]}"
CPU_TEST="${PATHS[refit_codec_test]}"
BENCH="${PATHS[gpu_codec_bench]}"

# The CPU codec tests first: they show that the binaries and their libraries load here.
run "CPU codec tests" 45 "$CPU_TEST" --gtest_brief=1

# Not --gtest_brief: the skip check below needs the names of skipped tests.
GTEST_ARGS=()
# The publisher's TrainerApi CUDA tests open IPC handles in the exporting process, which only the
# emulator allows (on a GPU, refit_e2e_gpu_test covers that path across processes).
ALLOWED_SKIP='TrainerApiCuda'
if [[ $QUICK -eq 1 ]]; then
  export REFIT_GPU_TEST_HUGE=0
  ALLOWED_SKIP="$ALLOWED_SKIP|MoreThanFourGiElements"
fi
# A skipped GPU test means the device was not usable: on a GPU machine that is a failure
# (except those above).
for t in "${GPU_TESTS[@]}"; do
  out=$(mktemp)
  CAPTURE=$out run "GPU tests: $t" 200 "${PATHS[$t]}" ${GTEST_ARGS[@]+"${GTEST_ARGS[@]}"}
  skipped=$(grep -E '^\[  SKIPPED \] [A-Za-z]' "$out" | grep -vE "$ALLOWED_SKIP" | sort -u || true)
  if [[ -n "$skipped" ]]; then
    echo "gpu-check: $t skipped tests on a GPU machine:" && echo "$skipped"
    failures+=("$t skipped tests")
  fi
  rm -f "$out"
done
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
# The one pass (EncodeFused) against the separate passes at the realistic rate, 2^28 elements.
run "GPU one-pass benchmark" 60 "$BENCH" --json --elements 268435456 --rates 0.0165 --reps 5
if [[ -n "$OUTDIR" ]]; then
  grep '^{"bench":"gpu_codec"' "$LOG" >"$OUTDIR/gpu_codec_bench.jsonl" || true
fi

stamp "done"
if [[ ${#failures[@]} -gt 0 ]]; then
  echo "gpu-check: FAILED: ${failures[*]}"
  exit 1
fi
echo "gpu-check: all passed"
