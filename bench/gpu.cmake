# gpu_codec_bench: GPU codec throughput against a device-to-device copy (bench/gpu_codec_bench.cc).
# Included from bench/CMakeLists.txt when the CUDA kernels are built. A plain program (no Google
# Benchmark); --help lists its flags. It uses only cuda/codec_cuda.h, so the same source also links
# against the CPU emulator of the kernels: gpu_codec_bench_emu, whose small smoke run checks the
# benchmark's own logic (and its PASS/FAIL verdicts) on machines without a GPU.
if(REFIT_HAVE_CUDA)
  add_executable(gpu_codec_bench ${CMAKE_CURRENT_LIST_DIR}/gpu_codec_bench.cc)
  target_compile_options(gpu_codec_bench PRIVATE ${REFIT_WARNINGS})
  target_link_libraries(gpu_codec_bench PRIVATE refit_cuda refit_codec)
endif()
if(TARGET refit_cuda_emu)
  add_executable(gpu_codec_bench_emu ${CMAKE_CURRENT_LIST_DIR}/gpu_codec_bench.cc)
  target_compile_options(gpu_codec_bench_emu PRIVATE ${REFIT_WARNINGS})
  target_link_libraries(gpu_codec_bench_emu PRIVATE refit_cuda_emu refit_codec)
  add_test(NAME gpu_codec_bench_emu_smoke
           COMMAND gpu_codec_bench_emu --elements 300001 --reps 1 --json)
  set_tests_properties(gpu_codec_bench_emu_smoke PROPERTIES LABELS "bench;emu" TIMEOUT 300
                       FAIL_REGULAR_EXPRESSION "FAIL")
endif()
