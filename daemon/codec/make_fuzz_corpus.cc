// Writes a seed corpus for patch_fuzzer: valid patches of every dtype (mode bytes 0 and 2) and
// round-trip inputs (mode byte 1). Usage: make_fuzz_corpus DIR
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_corpus DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::mt19937_64 rng(2024);
  int written = 0;
  auto write = [&](uint8_t mode, const std::vector<uint8_t>& body) {
    const std::string path = dir + "/seed-" + std::to_string(written++);
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) {
      std::perror(path.c_str());
      std::exit(1);
    }
    std::fputc(mode, f);
    std::fwrite(body.data(), 1, body.size(), f);
    std::fclose(f);
  };
  for (uint8_t code = 1; refit::IsValidDType(code); ++code) {
    const auto t = static_cast<refit::DType>(code);
    const size_t w = refit::DTypeSize(t);
    for (size_t n : {1u, 300u, 700u}) {
      for (double p : {0.01, 0.2, 1.0}) {
        std::vector<uint8_t> a(n * w), b;
        for (auto& x : a) x = static_cast<uint8_t>(rng());
        b = a;
        for (size_t i = 0; i < n; ++i) {
          if (std::uniform_real_distribution<double>(0, 1)(rng) >= p) continue;
          b[i * w] = static_cast<uint8_t>(b[i * w] + 1 + rng() % 3);
        }
        refit::EncodeOptions opt;
        opt.block_log2 = 8;
        opt.threads = 1;
        auto patch = refit::EncodePatch(t, a, b, opt);
        if (!patch.ok()) return 1;
        write(0, *patch);
        write(2, *patch);
        std::vector<uint8_t> rt{static_cast<uint8_t>(code - 1)};
        rt.insert(rt.end(), a.begin(), a.end());
        rt.insert(rt.end(), b.begin(), b.end());
        write(1, rt);
        rt[0] = static_cast<uint8_t>(rt[0] | 0x40);  // round trip in format 2 with a record
        write(1, rt);
      }
    }
  }
  // Format 2 seeds: BF16 weights of one scale moving by an ULP, the kind context coding wins on,
  // conditioned and not (the hostile path applies conditioned ones with its own record, after
  // writing that record's fingerprint when it re-signs: mode byte 2).
  for (size_t n : {2000u, 20000u}) {
    std::normal_distribution<float> nd(0.0f, 0.02f);
    std::vector<uint8_t> a(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const float x = nd(rng);
      uint32_t u;
      std::memcpy(&u, &x, 4);
      a[2 * i] = static_cast<uint8_t>(u >> 16);
      a[2 * i + 1] = static_cast<uint8_t>(u >> 24);
    }
    std::vector<uint8_t> b = a, before = a;
    for (size_t i = 0; i < n; ++i) {
      if (rng() % 16 == 0) b[2 * i] = static_cast<uint8_t>(b[2 * i] + 1);
      if (rng() % 16 == 0) before[2 * i] = static_cast<uint8_t>(before[2 * i] - 1);
    }
    const refit::ChangeRecord rec =
        refit::ChangeRecord::Compare(refit::DType::kBF16, before.data(), a.data(), n);
    for (const refit::ChangeRecord* prev : {static_cast<const refit::ChangeRecord*>(nullptr), &rec}) {
      refit::EncodeOptions opt;
      opt.block_log2 = 12;
      opt.threads = 1;
      opt.format = 2;
      const refit::EncodeInput in{refit::DType::kBF16, a, b, prev};
      auto patches = refit::EncodePatches(std::span<const refit::EncodeInput>(&in, 1), opt);
      if (!patches.ok()) return 1;
      write(0, (*patches)[0]);
      write(2, (*patches)[0]);
    }
  }
  std::printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}
