#!/usr/bin/env bash
# Style of what changed since the project adopted its style checks (.ci/style-base: a commit),
# or since BASE:
#   1. clang-format (.clang-format): every changed line of C++ (.cc, .h) formatted; the lines
#      that are not are printed as a diff and the script fails. CUDA sources (.cu, .cuh) are left
#      out: clang-format 14 takes them for C++ and splits a kernel launch's <<< >>>.
#   2. clang-tidy (.clang-tidy: bugprone-*, performance-*) on the changed .cc files, with
#      BUILD_DIR's compile_commands.json, when TIDY=1 (slow: about 10 s a file on 2 cores; not in
#      CI, whose budget it would exceed). Findings are reported; TIDY_STRICT=1 fails on any.
# Usage: scripts/check-style.sh [BASE]      Environment: BUILD_DIR (default build), TIDY, TIDY_STRICT
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-$(cat .ci/style-base)}
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  echo "check-style: base $base is not in this clone (shallow?): nothing to compare against" >&2
  exit 0
fi
mapfile -t files < <(git diff --name-only --diff-filter=AM "$base" -- \
  '*.cc' '*.h' | grep -v '^build' || true)
echo "check-style: ${#files[@]} C++ files changed since $(git rev-parse --short "$base")"
status=0
if [ "${#files[@]}" -gt 0 ]; then
  out=$(git clang-format --quiet --diff "$base" -- "${files[@]}" || true)
  if [ -n "$out" ] && [ "$out" != "no modified files to format" ]; then
    echo "$out"
    echo "check-style: changed lines above are not clang-formatted (git clang-format $base)" >&2
    status=1
  else
    echo "check-style: clang-format: every changed line formatted"
  fi
fi
if [ "${TIDY:-0}" = 1 ]; then
  build=${BUILD_DIR:-build}
  cc=()
  for f in "${files[@]}"; do [[ $f == *.cc ]] && cc+=("$f"); done
  echo "check-style: clang-tidy on ${#cc[@]} files ($build/compile_commands.json)"
  findings=0
  for f in "${cc[@]}"; do
    if grep -q "\"file\": \"$PWD/$f\"" "$build/compile_commands.json"; then
      n=$(clang-tidy -p "$build" --quiet "$f" 2>/dev/null | tee /dev/stderr | grep -c ': warning:' || true)
      findings=$((findings + n))
    fi
  done
  echo "check-style: clang-tidy: $findings findings"
  if [ "${TIDY_STRICT:-0}" = 1 ] && [ "$findings" -gt 0 ]; then status=1; fi
fi
exit $status
