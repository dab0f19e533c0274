#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, in build-fuzz/) and runs each from a fresh
# seed corpus for a bounded time, one after the other; prints per target the seconds run,
# executions, final corpus size and findings (crash-/leak-/timeout-/oom- files).
#   scripts/fuzz.sh [SECONDS] [TARGET...]     default: 300 s each, every target
# Environment: BUILD_DIR (default build-fuzz), JOBS (default nproc), FUZZ_ARGS (extra libFuzzer
# flags), FUZZ_OUT (corpora, logs and findings; default $BUILD_DIR/fuzz-out).
# Exit status 1 if any target found something (the inputs are in FUZZ_OUT/TARGET/artifacts/).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-300}
shift || true
ALL=(patch_fuzzer safetensors_fuzzer config_fuzzer data_plane_fuzzer subscriber_fuzzer)
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL[@]}")
BUILD_DIR=${BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
OUT=${FUZZ_OUT:-$BUILD_DIR/fuzz-out}

# Seed corpus writers, by target (run with the corpus directory as last argument).
declare -A SEEDS=(
  [patch_fuzzer]="$BUILD_DIR/daemon/codec/make_fuzz_corpus"
  [safetensors_fuzzer]="$BUILD_DIR/daemon/model/make_safetensors_corpus"
  [config_fuzzer]="cp config/*.yaml"
  [data_plane_fuzzer]="$BUILD_DIR/daemon/serving/make_data_plane_corpus"
  [subscriber_fuzzer]="$BUILD_DIR/daemon/subscriber/make_subscriber_corpus"
)
declare -A DIRS=(
  [patch_fuzzer]=daemon/codec [safetensors_fuzzer]=daemon/model [config_fuzzer]=daemon/config
  [data_plane_fuzzer]=daemon/serving [subscriber_fuzzer]=daemon/subscriber
)

build_targets=()
for t in "${TARGETS[@]}"; do
  [ -n "${DIRS[$t]:-}" ] || { echo "fuzz.sh: unknown target $t (known: ${ALL[*]})" >&2; exit 2; }
  build_targets+=("$t")
  gen=${SEEDS[$t]%% *}
  [[ $gen == "$BUILD_DIR"/* ]] && build_targets+=("$(basename "$gen")")
done
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREFIT_CUDA=OFF \
    -DREFIT_FUZZ=ON -DREFIT_BUILD_BENCH=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${build_targets[@]}"

summary=()
found=0
for t in "${TARGETS[@]}"; do
  dir="$OUT/$t"
  rm -rf "$dir" && mkdir -p "$dir/corpus" "$dir/artifacts"
  ${SEEDS[$t]} "$dir/corpus" > /dev/null
  seeds=$(find "$dir/corpus" -type f | wc -l)
  echo "=== $t: $SECONDS_EACH s from $seeds seeds (log: $dir/log)"
  start=$(date +%s)
  rc=0
  # shellcheck disable=SC2086
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} "$BUILD_DIR/${DIRS[$t]}/$t" \
    -max_total_time="$SECONDS_EACH" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/" ${FUZZ_ARGS:-} "$dir/corpus" > "$dir/log" 2>&1 || rc=$?
  ran=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
  corpus=$(find "$dir/corpus" -type f | wc -l)
  findings=$(find "$dir/artifacts" -type f | wc -l)
  if [ "$rc" -ne 0 ] && [ "$findings" -eq 0 ]; then findings=1; fi  # died without an artifact
  [ "$findings" -eq 0 ] || { found=1; tail -n 40 "$dir/log"; }
  summary+=("$(printf '%-20s %6s s %12s execs %7s corpus %4s findings' "$t" "$ran" "${execs:-?}" \
    "$corpus" "$findings")")
done
echo "=== fuzzing summary"
printf '%s\n' "${summary[@]}"
exit "$found"
