// Tests of the CPU emulator itself and of the kernels' device helpers against their CPU
// counterparts (format.h, bitstream.h), run through the emulator. Part of codec_cuda_emu_test.
#include <cstring>
#include <random>
#include <vector>

#include "cuda/emu/emu.h"
#include "cuda/kernels.cuh"
#include "daemon/codec/bitstream.h"
#include "daemon/codec/format.h"
#include "gtest/gtest.h"

namespace refit::cuda {
namespace {

using kern::kThreads;

TEST(CudaEmulator, BarriersShufflesAndReductions) {
  std::vector<uint32_t> up(kThreads), down(kThreads), sum(kThreads), any(kThreads);
  REFIT_SHARED uint32_t slot[kThreads];
  emu::Launch(2, kThreads, [&] {
    const uint32_t t = dev::ThreadIndex();
    slot[t] = t * 3;
    dev::SyncThreads();
    const uint32_t neighbour = slot[(t + 1) % kThreads];  // written by another thread before the barrier
    dev::SyncThreads();
    if (dev::BlockIndex() == 1) {
      up[t] = dev::ShflUp(neighbour, 5);
      down[t] = dev::ShflDown(t, 3);
      sum[t] = dev::WarpReduceAdd(t);
      any[t] = dev::SyncThreadsOr(t == 77);
    } else {
      (void)dev::ShflUp(0u, 1);
      (void)dev::ShflDown(0u, 1);
      (void)dev::WarpReduceAdd(0);
      (void)dev::SyncThreadsOr(false);
    }
  });
  for (uint32_t t = 0; t < kThreads; ++t) {
    const uint32_t lane = t % 32, warp0 = t - lane;
    const uint32_t src = lane >= 5 ? t - 5 : t;
    EXPECT_EQ(up[t], ((src + 1) % kThreads) * 3) << t;
    EXPECT_EQ(down[t], lane + 3 < 32 ? t + 3 : t) << t;
    EXPECT_EQ(sum[t], 32 * warp0 + 31 * 32 / 2) << t;
    EXPECT_EQ(any[t], 1u) << t;
  }
  EXPECT_GT(emu::SwitchCount(), 0u);
}

TEST(CudaEmulator, EgBitsFastMatchesFormat) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20000; ++i) {
    const int bits = 1 + static_cast<int>(rng() % 63);
    const uint64_t x = rng() >> (64 - bits);
    for (int k = 0; k <= format::kMaxKe; ++k) {
      if (x > (~uint64_t{0} >> 1)) continue;  // the codec's magnitudes are < 2^63
      ASSERT_EQ(kern::EgBitsFast(x, k), format::EgBits(x, k)) << x << " " << k;
    }
  }
  for (int k = 0; k <= format::kMaxKe; ++k) {
    EXPECT_EQ(kern::EgBitsFast(0, k), format::EgBits(0, k));
    EXPECT_EQ(kern::EgBitsFast((uint64_t{1} << 63) - 2, k), format::EgBits((uint64_t{1} << 63) - 2, k));
  }
}

// The scans against sequential references, with random inputs and carries.
TEST(CudaEmulator, BlockScans) {
  std::mt19937_64 rng(2);
  for (int round = 0; round < 20; ++round) {
    std::vector<kern::Fwd> in(kThreads), out(kThreads), agg(kThreads);
    std::vector<uint64_t> sin(kThreads), sout(kThreads), sagg(kThreads);
    std::vector<uint32_t> min_in(kThreads), min_out(kThreads), min_agg(kThreads);
    uint32_t lp = 0;
    for (int t = 0; t < kThreads; ++t) {
      const uint32_t cnt = static_cast<uint32_t>(rng() % 4);
      if (cnt > 0) lp += 1 + static_cast<uint32_t>(rng() % 5);
      in[t] = kern::Fwd{cnt, cnt > 0 ? lp : 0, cnt > 0 && (rng() & 1) ? 1 + static_cast<uint32_t>(rng() % cnt) : 0};
      sin[t] = rng() % 1000;
      min_in[t] = (rng() % 3 == 0) ? static_cast<uint32_t>(rng() % 100000) : ~0u;
    }
    const kern::Fwd carry{static_cast<uint32_t>(rng() % 50), 0, static_cast<uint32_t>(rng() % 3)};
    const uint64_t scarry = rng() % 77;
    const uint32_t mcarry = static_cast<uint32_t>(rng() % 200000);
    emu::Launch(1, kThreads, [&] {
      REFIT_SHARED kern::Fwd s_fwd[kern::kWarps];
      REFIT_SHARED uint64_t s_add[kern::kWarps];
      REFIT_SHARED uint32_t s_min[kern::kWarps];
      const uint32_t t = dev::ThreadIndex();
      out[t] = kern::BlockScanForward(in[t], carry, kern::Fwd{0, 0, 0}, kern::FwdOp{}, s_fwd, &agg[t]);
      sout[t] = kern::BlockScanBackward(sin[t], scarry, uint64_t{0}, kern::AddOp{}, s_add, &sagg[t]);
      min_out[t] = kern::BlockScanBackward(min_in[t], mcarry, ~0u, kern::MinOp{}, s_min, &min_agg[t]);
    });
    kern::Fwd acc = carry, total{0, 0, 0};
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_EQ(out[t].cnt, acc.cnt) << t;
      EXPECT_EQ(out[t].lp1, acc.lp1) << t;
      EXPECT_EQ(out[t].le1, acc.le1) << t;
      acc = kern::FwdOp{}(acc, in[t]);
      total = kern::FwdOp{}(total, in[t]);
    }
    uint64_t ssuffix = scarry, stotal = 0;
    uint32_t msuffix = mcarry, mtotal = ~0u;
    for (int t = kThreads - 1; t >= 0; --t) {
      EXPECT_EQ(sout[t], ssuffix) << t;
      EXPECT_EQ(min_out[t], msuffix) << t;
      ssuffix += sin[t];
      stotal += sin[t];
      msuffix = std::min(msuffix, min_in[t]);
      mtotal = std::min(mtotal, min_in[t]);
    }
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_EQ(agg[t].cnt, total.cnt);
      EXPECT_EQ(agg[t].lp1, total.lp1);
      EXPECT_EQ(agg[t].le1, total.le1);
      EXPECT_EQ(sagg[t], stotal);
      EXPECT_EQ(min_agg[t], mtotal);
    }
  }
}

// BitSink (the kernels' code writer) writes what BitWriter writes; DevBitReader reads what
// BitReader reads, overruns included.
TEST(CudaEmulator, BitSinkAndReaderMatchBitstream) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 300; ++round) {
    struct Code {
      int kind;  // 0 rice, 1 eg, 2 raw bits
      uint64_t x;
      int k;
    };
    std::vector<Code> codes;
    const int num = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < num; ++i) {
      const int kind = static_cast<int>(rng() % 3);
      Code c{kind, 0, 0};
      if (kind == 0) {
        c.k = static_cast<int>(rng() % 25);
        c.x = rng() % (uint64_t{1} << (1 + rng() % 30));
      } else if (kind == 1) {
        c.k = static_cast<int>(rng() % 32);
        c.x = (rng() >> 1) >> (rng() % 63);
      } else {
        c.k = 1 + static_cast<int>(rng() % 64);
        c.x = c.k == 64 ? rng() : rng() & ((uint64_t{1} << c.k) - 1);
      }
      codes.push_back(c);
    }
    uint64_t total = 0;
    for (const Code& c : codes) {
      total += c.kind == 0 ? format::RiceBits(c.x, c.k) : c.kind == 1 ? format::EgBits(c.x, c.k) : c.k;
    }
    const size_t nbytes = (total + 7) / 8;
    std::vector<uint8_t> cpu(nbytes + 64, 0);
    BitWriter w(cpu.data());
    for (const Code& c : codes) {
      if (c.kind == 0) w.PutRice(c.x, c.k);
      else if (c.kind == 1) w.PutEg(c.x, c.k);
      else w.PutLong(c.x, c.k);
    }
    ASSERT_EQ(w.Finish(cpu.data()), nbytes);
    std::vector<uint32_t> words((nbytes + 3) / 4 + 1, 0);
    kern::BitSink sink{words.data(), total, false};
    uint64_t pos = 0;
    for (const Code& c : codes) {
      if (c.kind == 0) pos = sink.Rice(pos, c.x, c.k);
      else if (c.kind == 1) pos = sink.Eg(pos, c.x, c.k);
      else {
        if (c.x != 0) sink.Or(pos, c.x, c.k);
        pos += c.k;
      }
    }
    ASSERT_FALSE(sink.bad);
    ASSERT_EQ(pos, total);
    std::vector<uint8_t> gpu(words.size() * 4);
    std::memcpy(gpu.data(), words.data(), gpu.size());
    ASSERT_EQ(0, std::memcmp(gpu.data(), cpu.data(), nbytes)) << "round " << round;
    for (size_t i = nbytes; i < gpu.size(); ++i) ASSERT_EQ(gpu[i], 0) << "bits past the end";
    // A code past the limit is refused without touching memory.
    kern::BitSink tight{words.data(), total, false};
    tight.Or(total, 1, 1);
    EXPECT_TRUE(tight.bad);

    // Readers: random operation sequences over the CPU bytes (truncated to a random length).
    const size_t len = nbytes == 0 ? 0 : 1 + rng() % nbytes;
    std::vector<uint8_t> staged((len + 7) / 8 * 8 + 8, 0);
    std::memcpy(staged.data(), cpu.data(), len);
    BitReader r(cpu.data(), len);
    kern::DevBitReader d{staged.data(), len, len * 8, 0, false};
    for (int op = 0; op < 60; ++op) {
      const int kind = static_cast<int>(rng() % 3);
      if (kind == 0) {
        const uint64_t maxz = rng() % 200;
        ASSERT_EQ(d.GetUnary(maxz), r.GetUnary(maxz));
      } else if (kind == 1) {
        const int n = static_cast<int>(rng() % 65);
        ASSERT_EQ(d.Get(n), r.Get(n)) << n;
      } else {
        ASSERT_EQ(d.Peek57(), r.Peek57());
      }
      ASSERT_EQ(d.pos, r.bit_position());
      ASSERT_EQ(d.overrun, r.overrun());
    }
  }
}

}  // namespace
}  // namespace refit::cuda
