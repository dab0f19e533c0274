// nvcc build of the codec kernels (the source is kernels.cuh, shared with the CPU emulator).
#define REFIT_CUDA_DEFINE_LAUNCHERS
#include "cuda/kernels.cuh"
