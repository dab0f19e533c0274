#!/usr/bin/env bash
# Formatting of what changed since the project adopted its style checks (.ci/style-base: a
# commit), or since BASE: every changed line of C++ (.cc, .h) clang-formatted (.clang-format); the
# lines that are not are printed as a diff and the script fails. CUDA sources (.cu, .cuh) are
# left out: clang-format 14 takes them for C++ and splits a kernel launch's <<< >>>.
# A base that is not in the clone (a shallow clone, a mistyped commit) fails the check (exit 2):
# nothing compared is not a pass. clang-tidy is scripts/check-tidy.sh.
# Usage: scripts/check-style.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-$(cat .ci/style-base)}
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  echo "check-style: base $base is not in this clone (shallow? run git fetch --unshallow):" \
    "nothing to compare against" >&2
  exit 2
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
exit $status
