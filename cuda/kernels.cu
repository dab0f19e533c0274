// nvcc build of the codec kernels (the source is kernels.cuh and change_set_kernels.cuh, shared
// with the CPU emulator).
#define REFIT_CUDA_DEFINE_LAUNCHERS
#include "cuda/kernels.cuh"
#include "cuda/change_set_kernels.cuh"
