#include "daemon/codec/hash_stream.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstring>

#include "daemon/codec/avx2_mul64.h"

namespace refit {

using namespace format;  // NOLINT: the constants are the format's vocabulary.

namespace {

enum Level : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int BestLevel() {
#if defined(__x86_64__)
  // AVX-512DQ: a 64-bit multiply in one instruction (AVX2 composes it of three 32-bit ones).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return kAvx512;
  if (__builtin_cpu_supports("avx2")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_level{BestLevel()};

// `rounds` whole rounds (kHashLanes words each, word l into lane l) from p into acc.
void RoundsScalar(uint64_t* acc, const uint8_t* p, size_t rounds) {
  for (size_t r = 0; r < rounds; ++r) {
    const uint8_t* q = p + r * 8 * kHashLanes;
    for (int l = 0; l < kHashLanes; ++l) {
      uint64_t w;
      std::memcpy(&w, q + 8 * l, 8);
      acc[l] = HashRound(acc[l], w);
    }
  }
}

#if defined(__x86_64__)
// HashRound in four lanes at a time: acc = rotl(acc + w * kP2, 31) * kP1.
__attribute__((target("avx2"))) void RoundsAvx2(uint64_t* acc, const uint8_t* p, size_t rounds) {
  using codec_internal::MulConst;
  const codec_internal::Const256 p1 = codec_internal::MakeConst(kP1);
  const codec_internal::Const256 p2 = codec_internal::MakeConst(kP2);
  static_assert(kHashLanes % 16 == 0);
  for (size_t r = 0; r < rounds; ++r) {
    const uint8_t* q = p + r * 8 * kHashLanes;
    for (int l = 0; l < kHashLanes; l += 16) {  // four registers in flight
      __m256i a[4];
      for (int v = 0; v < 4; ++v) {
        a[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + l + 4 * v));
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8 * (l + 4 * v)));
        a[v] = _mm256_add_epi64(a[v], MulConst(w, p2));
        a[v] = _mm256_or_si256(_mm256_slli_epi64(a[v], 31), _mm256_srli_epi64(a[v], 33));
        a[v] = MulConst(a[v], p1);
      }
      for (int v = 0; v < 4; ++v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + l + 4 * v), a[v]);
      }
    }
  }
}

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// HashRound in eight lanes at a time, with AVX-512's 64-bit multiply and rotate.
__attribute__((target("avx512f,avx512dq"))) void RoundsAvx512(uint64_t* acc, const uint8_t* p,
                                                              size_t rounds) {
  const __m512i p1 = _mm512_set1_epi64(static_cast<long long>(kP1));
  const __m512i p2 = _mm512_set1_epi64(static_cast<long long>(kP2));
  static_assert(kHashLanes % 32 == 0);
  for (size_t r = 0; r < rounds; ++r) {
    const uint8_t* q = p + r * 8 * kHashLanes;
    for (int l = 0; l < kHashLanes; l += 32) {  // four registers in flight
      __m512i a[4];
      for (int v = 0; v < 4; ++v) {
        a[v] = _mm512_loadu_si512(acc + l + 8 * v);
        const __m512i w = _mm512_loadu_si512(q + 8 * (l + 8 * v));
        a[v] = _mm512_add_epi64(a[v], _mm512_mullo_epi64(w, p2));
        a[v] = _mm512_mullo_epi64(_mm512_rol_epi64(a[v], 31), p1);
      }
      for (int v = 0; v < 4; ++v) _mm512_storeu_si512(acc + l + 8 * v, a[v]);
    }
  }
}
#pragma GCC diagnostic pop
#endif

void Rounds(uint64_t* acc, const uint8_t* p, size_t rounds) {
#if defined(__x86_64__)
  switch (g_level.load(std::memory_order_relaxed)) {
    case kAvx512: RoundsAvx512(acc, p, rounds); return;
    case kAvx2: RoundsAvx2(acc, p, rounds); return;
    default: break;
  }
#endif
  RoundsScalar(acc, p, rounds);
}

}  // namespace

void Hash64Stream::Reset(uint64_t seed) {
  seed_ = seed;
  bytes_ = 0;
  for (int l = 0; l < kHashLanes; ++l) acc_[l] = HashLaneInit(seed, l);
}

void Hash64Stream::Update(std::span<const uint8_t> piece) {
  assert(bytes_ % 8 == 0);  // only the last piece may end inside a word
  const uint8_t* p = piece.data();
  const size_t words = piece.size() / 8;
  size_t lane = static_cast<size_t>((bytes_ / 8) % kHashLanes);
  size_t i = 0;
  // Up to lane 0, then whole rounds (the loop Hash64 runs), then the rest word by word.
  for (; i < words && lane != 0; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    acc_[lane] = HashRound(acc_[lane], w);
    lane = (lane + 1) % kHashLanes;
  }
  const size_t rounds = (words - i) / kHashLanes;
  Rounds(acc_, p + i * 8, rounds);
  i += rounds * kHashLanes;
  for (; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    acc_[lane] = HashRound(acc_[lane], w);
    lane = (lane + 1) % kHashLanes;
  }
  if (piece.size() % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, p + words * 8, piece.size() % 8);  // little-endian host, zero padded
    acc_[lane] = HashRound(acc_[lane], w);
  }
  bytes_ += piece.size();
}

uint64_t Hash64Stream::Finish() const {
  uint64_t h = seed_ ^ (bytes_ * kP5);
  for (int l = 0; l < kHashLanes; ++l) h = HashMerge(h, acc_[l]);
  return Avalanche(h);
}

void ChunkHasher::Begin(uint64_t* hashes, uint64_t tensor_bytes, uint64_t offset) {
  assert(offset % kDigestChunkBytes == 0);
  hashes_ = hashes;
  tensor_bytes_ = tensor_bytes;
  offset_ = offset;
  chunk_.Reset(offset / kDigestChunkBytes);
}

void ChunkHasher::Feed(const uint8_t* p, size_t n) {
  if (n == 0) return;
  chunk_.Update({p, n});
  offset_ += n;
  const uint64_t chunk = (offset_ - 1) / kDigestChunkBytes;
  const uint64_t chunk_end = std::min(tensor_bytes_, (chunk + 1) * kDigestChunkBytes);
  assert(offset_ <= chunk_end);
  if (offset_ == chunk_end) {
    hashes_[chunk] = chunk_.Finish();
    chunk_.Reset(chunk + 1);
  }
}

namespace testing {

int Hash64Levels() { return BestLevel() + 1; }

void SetHash64Level(int level) {
  g_level.store(level < 0 ? BestLevel() : std::min(level, BestLevel()));
}

}  // namespace testing
}  // namespace refit
