# Finding the CUDA toolkit: included by the top-level CMakeLists.txt once nvcc is known
# (CMAKE_CUDA_COMPILER set), before enable_language(CUDA). It sets the default architectures,
# enables CUDA and runs find_package(CUDAToolkit), with a guarded workaround for the
# FindCUDAToolkit module of CMake 3.25.0/3.25.1 (Debian 12's cmake-data).
#
# That module, with a CUDA toolkit that has no libnvToolsExt (CUDA 12.9 and 13 ship only the
# header-only nvtx3), sets a DEPRECATION property on the target CUDA::nvToolsExt it did not create
# (it tests the project's cmake_minimum_required, not the target) and configure fails:
#   set_property could not find TARGET CUDA::nvToolsExt.
# CMake 3.25.2 guards that line with `if(TARGET CUDA::nvToolsExt ...)`. Here, for older CMakes
# only and only when the library really is absent, an empty INTERFACE IMPORTED target of that name
# is declared before the module runs: the module then skips creating it and its set_property
# finds a target. Nothing links it (refitd uses only cudart). A module that carries the fix, a
# newer CMake, or a toolkit that still ships the library leave this code inert.

# Default architectures: the GPUs RL rollout fleets run, as machine code, plus PTX of the newest
# so that later parts (Blackwell and on) JIT it. compute_80 is the floor: the kernels use
# __reduce_add_sync (sm_80+). Override with -DCMAKE_CUDA_ARCHITECTURES=...
#   80: A100, A30          86: A10, A40, RTX A6000       89: L4, L40S
#   90: H100, H200, GH200 (SASS, and PTX for newer parts)
set(REFIT_DEFAULT_CUDA_ARCHITECTURES "80-real;86-real;89-real;90")
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "${REFIT_DEFAULT_CUDA_ARCHITECTURES}")
endif()
enable_language(CUDA)

function(refit_cuda_toolkit_nvtoolsext_workaround)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.25.2 OR TARGET CUDA::nvToolsExt)
    return()
  endif()
  # Where the module looks: the toolkit root is the directory above nvcc's bin/.
  get_filename_component(bin_dir "${CMAKE_CUDA_COMPILER}" DIRECTORY)
  get_filename_component(root "${bin_dir}" DIRECTORY)
  file(GLOB target_lib_dirs "${root}/targets/*/lib")
  find_library(REFIT_CUDA_NVTOOLSEXT_LIBRARY NAMES nvToolsExt nvToolsExt64
               HINTS "${root}" ${target_lib_dirs} ENV CUDA_PATH
               PATH_SUFFIXES lib64 lib lib/x64 lib64/stubs lib/stubs)
  mark_as_advanced(REFIT_CUDA_NVTOOLSEXT_LIBRARY)
  if(REFIT_CUDA_NVTOOLSEXT_LIBRARY)
    return()  # the library exists: the module creates the target itself
  endif()
  message(STATUS "refitd: CMake ${CMAKE_VERSION}'s FindCUDAToolkit expects CUDA::nvToolsExt, "
                 "which this toolkit does not ship: declaring an empty placeholder target")
  add_library(CUDA::nvToolsExt INTERFACE IMPORTED GLOBAL)
  set_property(TARGET CUDA::nvToolsExt PROPERTY REFIT_PLACEHOLDER TRUE)
endfunction()

refit_cuda_toolkit_nvtoolsext_workaround()
find_package(CUDAToolkit REQUIRED)
