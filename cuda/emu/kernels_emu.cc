// CPU-emulator build of the codec kernels (test infrastructure; see emu.h).
#ifndef REFIT_CUDA_EMULATE
#error "kernels_emu.cc must be compiled with REFIT_CUDA_EMULATE"
#endif
#define REFIT_CUDA_DEFINE_LAUNCHERS
#include "cuda/kernels.cuh"
#include "cuda/change_set_kernels.cuh"
