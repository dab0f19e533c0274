#!/usr/bin/env bash
# Unpacks the pristine CMake modules of the installed cmake (Debian's cmake-data package, as a
# user's machine has them) into DIR and prints DIR/usr/share/cmake-X.Y/Modules: pass it as
# -DCMAKE_MODULE_PATH=... to configure refitd against the stock FindCUDAToolkit, not a patched one.
#   scripts/stock-cmake-modules.sh DIR
# With nvcc present it also proves the modules are the defective ones where that applies: a
# minimal project that calls find_package(CUDAToolkit) under cmake_minimum_required(3.25), without
# refitd's workaround, must fail to configure with the CUDA::nvToolsExt error (CMake 3.25.0/1 and
# a toolkit without libnvToolsExt). Otherwise a CI step built on these modules would prove nothing.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: stock-cmake-modules.sh DIR" >&2
  exit 2
fi
dir=$(mkdir -p "$1" && cd "$1" && pwd)
version=$(dpkg-query -W -f='${Version}' cmake-data)
cmake_mm=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
modules="$dir/usr/share/cmake-$cmake_mm/Modules"
if [ ! -f "$modules/FindCUDAToolkit.cmake" ]; then
  (cd "$dir" && apt-get download -q "cmake-data=$version" >&2)
  dpkg-deb -x "$dir"/cmake-data_*.deb "$dir"
fi
[ -f "$modules/FindCUDAToolkit.cmake" ] || { echo "stock-cmake-modules: no FindCUDAToolkit in $modules" >&2; exit 1; }

nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
defective=0
if grep -qx '    if(CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)' "$modules/FindCUDAToolkit.cmake"; then
  defective=1
fi
if [ -n "$nvcc" ] && [ $defective = 1 ] && \
   ! ls "$(dirname "$(dirname "$nvcc")")"/lib64/libnvToolsExt* >/dev/null 2>&1; then
  probe=$(mktemp -d)
  trap 'rm -rf "$probe"' EXIT
  cat > "$probe/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(stock_probe LANGUAGES CXX CUDA)
find_package(CUDAToolkit REQUIRED)
EOF
  if cmake -S "$probe" -B "$probe/build" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 \
       -DCMAKE_MODULE_PATH="$modules" > "$probe/log" 2>&1; then
    echo "stock-cmake-modules: a plain find_package(CUDAToolkit) configured with $modules;" \
         "expected the CUDA::nvToolsExt failure of the stock module" >&2
    exit 1
  fi
  if ! grep -q 'CUDA::nvToolsExt' "$probe/log"; then
    echo "stock-cmake-modules: the probe failed, but not with the CUDA::nvToolsExt error:" >&2
    cat "$probe/log" >&2
    exit 1
  fi
  echo "stock-cmake-modules: confirmed, the stock FindCUDAToolkit fails without refitd's workaround" >&2
fi
echo "$modules"
