// The memory-read floor the benchmarks compare against (the issue's `pass_ms` / codec_bench's
// read_gbps): every byte of both versions of every tensor read once, in 1 MiB pieces spread over
// `threads` threads in one fork-join (the ideal split), XOR-accumulating 64-bit words.
#ifndef REFIT_BENCH_READ_PASS_H_
#define REFIT_BENCH_READ_PASS_H_

#include <cstdint>
#include <span>
#include <vector>

namespace refit::bench {

// One tensor's two versions (equal sizes).
struct ReadPair {
  std::span<const uint8_t> base, target;
};

// Reads every pair once. `prefetch` = false is the plain pass (read_gbps, the issue's
// definition); true adds software prefetch 2 KiB ahead, which is faster on the 2-core VMs
// (codec_bench's read_prefetch_gbps, a stricter floor).
void ReadPass(std::span<const ReadPair> pairs, int threads, bool prefetch = false);

// ReadPass timed: milliseconds of one pass.
double ReadPassMs(std::span<const ReadPair> pairs, int threads, bool prefetch = false);

}  // namespace refit::bench

#endif  // REFIT_BENCH_READ_PASS_H_
