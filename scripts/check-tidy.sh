#!/usr/bin/env bash
# clang-tidy (.clang-tidy: bugprone-*, performance-*) on the .cc files changed since BASE (default
# .ci/tidy-base: the commit the current work started from), with BUILD_DIR's
# compile_commands.json (configure and build first: generated headers must exist). Files the
# build does not compile (CUDA off, benchmarks off) are listed and skipped. Any finding fails
# (exit 1); a BASE that is not in the clone fails too (exit 2). About 10 s a file on 2 cores,
# two files at a time.
# Usage: scripts/check-tidy.sh [BASE]      Environment: BUILD_DIR (default build), JOBS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-$(cat .ci/tidy-base)}
build=${BUILD_DIR:-build}
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  echo "check-tidy: base $base is not in this clone (shallow? run git fetch --unshallow)" >&2
  exit 2
fi
if [ ! -f "$build/compile_commands.json" ]; then
  echo "check-tidy: no $build/compile_commands.json (configure and build first)" >&2
  exit 2
fi
mapfile -t changed < <(git diff --name-only --diff-filter=AM "$base" -- '*.cc' | grep -v '^build' || true)
files=()
for f in "${changed[@]}"; do
  if grep -q "\"file\": \"$PWD/$f\"" "$build/compile_commands.json"; then
    files+=("$f")
  else
    echo "check-tidy: $f is not compiled by $build: skipped"
  fi
done
echo "check-tidy: ${#files[@]} changed .cc files since $(git rev-parse --short "$base")"
[ "${#files[@]}" -eq 0 ] && exit 0
out=$(mktemp)
trap 'rm -f "$out"' EXIT
printf '%s\0' "${files[@]}" |
  xargs -0 -n 1 -P "${JOBS:-2}" clang-tidy -p "$build" --quiet 2>/dev/null >"$out" || true
findings=$(grep -c ': warning:\|: error:' "$out" || true)
cat "$out"
echo "check-tidy: $findings findings"
[ "$findings" -eq 0 ]
