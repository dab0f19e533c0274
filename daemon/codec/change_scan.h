// The encoder's scan for changed elements: SIMD compares of base and target (portable SSE2,
// AVX2, AVX-512) that list the positions of elements that differ, and the AVX-512 variant for
// 16-bit dtypes that also yields each change's difference. The variant is picked once from the
// CPU's features; tests may lower it (codec.h testing::SetEncoderScanLevel).
#ifndef REFIT_DAEMON_CODEC_CHANGE_SCAN_H_
#define REFIT_DAEMON_CODEC_CHANGE_SCAN_H_

#include <atomic>
#include <cstdint>

namespace refit::codec_internal {

// The scan variant to use: the best the CPU supports, or lower when a test asks for it.
enum ScanIsa : int { kIsaPortable = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

// The best variant this CPU supports.
int BestScanIsa();

// The variant in use (BestScanIsa unless a test lowered it).
extern std::atomic<int> g_scan_isa;

// Appends the positions in [begin, end) of elements that differ to pos[n..]; returns the new n.
template <typename T>
uint32_t FindChanges(int isa, const T* a, const T* b, uint32_t begin, uint32_t end, uint32_t* pos,
                     uint32_t n);

#if defined(__x86_64__)
// 16-bit dtypes on AVX-512: also each changed lane's difference (of ordered images for floats
// when kOrdered), sign-extended to 32 bits, into dv[n..].
template <bool kOrdered>
__attribute__((target("avx512f,avx512bw,popcnt"))) uint32_t FindChangesAndDiffs16(
    const uint16_t* a, const uint16_t* b, uint32_t begin, uint32_t end, uint32_t* pos, int32_t* dv,
    uint32_t n);
#endif

}  // namespace refit::codec_internal

#endif  // REFIT_DAEMON_CODEC_CHANGE_SCAN_H_
