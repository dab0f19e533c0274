#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this machine (Debian dependencies and nvcc needed,
# no GPU) and packs them, with every non-system shared library they load, into OUTDIR, so that
# scripts/gpu-check.sh --prebuilt OUTDIR runs them on a GPU machine that lacks those libraries.
#
#   scripts/gpu-prebuild.sh OUTDIR        (.gpu is git-ignored: scripts/gpu-prebuild.sh .gpu)
#
# OUTDIR gets the GPU test binaries, gpu_codec_bench, refit_codec_test, refitd, refitctl, lib/
# and MANIFEST.txt. The build
# directory is $BUILD_DIR (default: build-gpu-prebuild in the repository, git-ignored). The CUDA
# runtime is linked statically; the GPU machine provides libcuda (the driver) and the C/C++
# runtime libraries, whose minimum versions MANIFEST.txt records.
set -euo pipefail

if [[ $# -ne 1 || "$1" == -* ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$1
BUILD=${BUILD_DIR:-$ROOT/build-gpu-prebuild}
MAX_MIB=60

cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREFIT_CUDA=ON \
  -DREFIT_BUILD_BENCH=ON
BINS=(codec_cuda_test device_test cuda_store_test refit_publisher_gpu_test refit_e2e_gpu_test
      gpu_codec_bench refit_codec_test refitd refitctl)
cmake --build "$BUILD" -j "$(nproc)" --target "${BINS[@]}"

find_bin() {
  local path
  path=$(find "$BUILD" -type f -name "$1" -perm -u+x -print -quit)
  if [[ -z "$path" ]]; then
    echo "gpu-prebuild: $1 was not built (is bench/gpu.cmake included from bench/CMakeLists.txt?)" >&2
    exit 1
  fi
  echo "$path"
}

mkdir -p "$OUT/lib"
rm -f "$OUT"/lib/* "$OUT"/MANIFEST.txt
for b in "${BINS[@]}"; do
  cp -f "$(find_bin "$b")" "$OUT/$b"
  strip --strip-debug "$OUT/$b" 2>/dev/null || true
done

# Shared libraries to carry: everything ldd resolves except the C/C++ runtime, the dynamic loader
# and the CUDA driver, which the GPU machine has (and must match its kernel/driver).
is_system_lib() {
  case "$(basename "$1")" in
    libc.so* | libm.so* | libstdc++.so* | libgcc_s.so* | ld-linux*.so* | libpthread.so* | \
      libdl.so* | librt.so* | libcuda.so* | libnvidia*.so* | linux-vdso.so*) return 0 ;;
    *) return 1 ;;
  esac
}
missing=0
for b in "${BINS[@]}"; do
  while read -r line; do
    if [[ "$line" == *"not found"* ]]; then
      echo "gpu-prebuild: $b: $line" >&2
      missing=1
      continue
    fi
    lib=$(awk '/=>/ { print $3 }' <<<"$line")
    [[ -n "$lib" && -e "$lib" ]] || continue
    is_system_lib "$lib" && continue
    cp -fL "$lib" "$OUT/lib/$(basename "$lib")"
  done < <(ldd "$OUT/$b")
done
[[ $missing -eq 0 ]] || exit 1
strip --strip-debug "$OUT"/lib/*.so* 2>/dev/null || true

# Check that, with lib/ first on the path, nothing resolves to this machine's non-system libraries.
for b in "${BINS[@]}"; do
  while read -r lib; do
    [[ -n "$lib" ]] || continue
    is_system_lib "$lib" && continue
    case "$lib" in "$(cd "$OUT" && pwd)"/lib/*) ;; *)
      echo "gpu-prebuild: $b still loads $lib from outside $OUT/lib" >&2
      exit 1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$(cd "$OUT" && pwd)/lib" ldd "$OUT/$b" | awk '/=>/ { print $3 }')
done

size_kib=$(du -sk "$OUT" | awk '{ print $1 }')
glibc=$(objdump -T "$OUT"/"${BINS[0]}" "$OUT"/"${BINS[1]}" "$OUT"/"${BINS[2]}" "$OUT"/lib/*.so* 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)
glibcxx=$(objdump -T "$OUT"/"${BINS[0]}" "$OUT"/"${BINS[1]}" "$OUT"/"${BINS[2]}" "$OUT"/lib/*.so* 2>/dev/null |
  grep -o 'GLIBCXX_[0-9.]*' | sort -Vu | tail -1)
{
  echo "refitd GPU prebuilt binaries"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || /usr/local/cuda/bin/nvcc --version | tail -1)"
  echo "needs on the GPU machine: x86-64, an NVIDIA driver for CUDA 13 (libcuda), $glibc, $glibcxx"
  echo "size: ${size_kib} KiB"
  (cd "$OUT" && sha256sum "${BINS[@]}" lib/*)
} >"$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
if ((size_kib > MAX_MIB * 1024)); then
  echo "gpu-prebuild: $OUT is ${size_kib} KiB, over the ${MAX_MIB} MiB budget" >&2
  exit 1
fi
echo "gpu-prebuild: ready. On the GPU machine: scripts/gpu-check.sh --prebuilt $OUT"
