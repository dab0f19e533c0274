#include "bench/entropy.h"

#include <cmath>
#include <cstring>
#include <mutex>

#include "daemon/codec/format.h"
#include "daemon/common/parallel.h"

namespace refit::bench {

double BinaryEntropyBits(double p) {
  if (!(p > 0) || !(p < 1)) return 0;
  return -p * std::log2(p) - (1 - p) * std::log2(1 - p);
}

double PositionBoundBitsPerChange(double p) {
  if (!(p > 0)) return 0;
  return BinaryEntropyBits(p) / p;
}

int64_t OrderedDiff(uint64_t base_bits, uint64_t target_bits, int bits) {
  return static_cast<int64_t>(format::OrderedImage(target_bits, bits)) -
         static_cast<int64_t>(format::OrderedImage(base_bits, bits));
}

void DiffHistogram::Add(int64_t d, uint64_t n) {
  if (n == 0) return;
  if (d >= -kDenseRange && d <= kDenseRange) {
    dense_[static_cast<size_t>(d + kDenseRange)] += n;
  } else {
    sparse_[d] += n;
  }
  total_ += n;
}

void DiffHistogram::Merge(const DiffHistogram& other) {
  for (size_t i = 0; i < dense_.size(); ++i) dense_[i] += other.dense_[i];
  for (const auto& [d, n] : other.sparse_) sparse_[d] += n;
  total_ += other.total_;
}

uint64_t DiffHistogram::Count(int64_t d) const {
  if (d >= -kDenseRange && d <= kDenseRange) return dense_[static_cast<size_t>(d + kDenseRange)];
  auto it = sparse_.find(d);
  return it == sparse_.end() ? 0 : it->second;
}

uint64_t DiffHistogram::CountAbs(int64_t m) const {
  if (m < 0) return 0;
  if (m == 0) return Count(0);
  return Count(m) + Count(-m);
}

uint64_t DiffHistogram::CountAbsAbove(int64_t m) const {
  uint64_t at_most = 0;
  for (int64_t k = 0; k <= m && k <= kDenseRange; ++k) at_most += CountAbs(k);
  if (m > kDenseRange) {
    for (const auto& [d, n] : sparse_) {
      if (d >= -m && d <= m) at_most += n;
    }
  }
  return total_ - at_most;
}

double DiffHistogram::EntropyBits() const {
  if (total_ == 0) return 0;
  const double total = static_cast<double>(total_);
  double h = 0;
  auto term = [&](uint64_t n) {
    if (n == 0) return;
    const double q = static_cast<double>(n) / total;
    h -= q * std::log2(q);
  };
  for (uint64_t n : dense_) term(n);
  for (const auto& [d, n] : sparse_) term(n);
  return h <= 0 ? 0 : h;  // -0.0 for a single symbol
}

namespace {

template <typename T>
uint64_t ScanTyped(const uint8_t* a, const uint8_t* b, size_t begin, size_t end,
                   DiffHistogram* hist) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr size_t kGroup = 32 / sizeof(T);
  uint64_t changed = 0;
  size_t i = begin;
  auto one = [&](size_t k) {
    T x, y;
    std::memcpy(&x, a + k * sizeof(T), sizeof(T));
    std::memcpy(&y, b + k * sizeof(T), sizeof(T));
    if (x != y) {
      hist->Add(OrderedDiff(x, y, kBits));
      ++changed;
    }
  };
  for (; i + kGroup <= end; i += kGroup) {
    uint64_t x[4], y[4];
    std::memcpy(x, a + i * sizeof(T), 32);
    std::memcpy(y, b + i * sizeof(T), 32);
    if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
    for (size_t k = i; k < i + kGroup; ++k) one(k);
  }
  for (; i < end; ++i) one(i);
  return changed;
}

}  // namespace

uint64_t AccumulateDiffs(std::span<const uint8_t> base, std::span<const uint8_t> target,
                         int elem_bytes, DiffHistogram* hist, int threads) {
  const size_t n = std::min(base.size(), target.size()) / static_cast<size_t>(elem_bytes);
  std::mutex mu;
  uint64_t changed = 0;
  ParallelFor(n, threads, 1 << 16, [&](size_t lo, size_t hi) {
    DiffHistogram local;
    uint64_t c = 0;
    switch (elem_bytes) {
      case 1: c = ScanTyped<uint8_t>(base.data(), target.data(), lo, hi, &local); break;
      case 2: c = ScanTyped<uint16_t>(base.data(), target.data(), lo, hi, &local); break;
      default: c = ScanTyped<uint32_t>(base.data(), target.data(), lo, hi, &local); break;

    }
    std::lock_guard<std::mutex> lock(mu);
    hist->Merge(local);
    changed += c;
  });
  return changed;
}

EntropyBound ComputeBound(uint64_t changed, uint64_t elements, const DiffHistogram& hist) {
  EntropyBound b;
  b.change_rate = elements == 0 ? 0 : static_cast<double>(changed) / static_cast<double>(elements);
  b.position_bits = PositionBoundBitsPerChange(b.change_rate);
  b.value_bits = hist.EntropyBits();
  return b;
}

}  // namespace refit::bench

namespace refit::bench {

ContextHistogram::ContextHistogram() : ctx_(kExponents * kPrevSigns) {}

namespace {

int PrevSign(const uint8_t* prev, const uint8_t* base, size_t k) {
  if (prev == nullptr) return 0;
  uint16_t x, y;
  std::memcpy(&x, prev + 2 * k, 2);
  std::memcpy(&y, base + 2 * k, 2);
  const int64_t d = OrderedDiff(x, y, 16);
  return d < 0 ? 1 : (d == 0 ? 2 : 3);
}

}  // namespace

void ContextHistogram::AddBF16(std::span<const uint8_t> base, std::span<const uint8_t> target,
                               std::span<const uint8_t> prev_base, int threads) {
  const size_t n = std::min(base.size(), target.size()) / 2;
  const uint8_t* prev = prev_base.size() >= 2 * n ? prev_base.data() : nullptr;
  std::mutex mu;
  const size_t parts = static_cast<size_t>(std::max(threads, 1)) * 2;
  ParallelFor(n, threads, std::max<size_t>(1 << 16, n / parts + 1), [&](size_t lo, size_t hi) {
    ContextHistogram local;
    for (size_t k = lo; k < hi; ++k) {
      uint16_t x, y;
      std::memcpy(&x, base.data() + 2 * k, 2);
      std::memcpy(&y, target.data() + 2 * k, 2);
      Ctx& c = local.ctx_[((x >> 7) & 0xFF) * kPrevSigns + PrevSign(prev, base.data(), k)];
      ++c.elements;
      if (x != y) c.diffs.Add(OrderedDiff(x, y, 16));
    }
    std::lock_guard<std::mutex> lock(mu);
    Merge(local);
  });
}

void ContextHistogram::Merge(const ContextHistogram& other) {
  for (size_t i = 0; i < ctx_.size(); ++i) {
    if (other.ctx_[i].elements == 0) continue;
    ctx_[i].elements += other.ctx_[i].elements;
    ctx_[i].diffs.Merge(other.ctx_[i].diffs);
  }
}

uint64_t ContextHistogram::elements() const {
  uint64_t n = 0;
  for (const Ctx& c : ctx_) n += c.elements;
  return n;
}

uint64_t ContextHistogram::changed() const {
  uint64_t n = 0;
  for (const Ctx& c : ctx_) n += c.diffs.total();
  return n;
}

double ContextHistogram::PositionBits(bool with_prev) const {
  // n elements of which m changed, independently: n H(m / n) bits.
  auto cost = [](uint64_t n, uint64_t m) {
    return n == 0 ? 0.0
                  : static_cast<double>(n) *
                        BinaryEntropyBits(static_cast<double>(m) / static_cast<double>(n));
  };
  double bits = 0;
  for (int e = 0; e < kExponents; ++e) {
    uint64_t n = 0, m = 0;
    for (int s = 0; s < kPrevSigns; ++s) {
      const Ctx& c = ctx_[e * kPrevSigns + s];
      if (with_prev) bits += cost(c.elements, c.diffs.total());
      n += c.elements;
      m += c.diffs.total();
    }
    if (!with_prev) bits += cost(n, m);
  }
  const uint64_t ch = changed();
  return ch == 0 ? 0 : bits / static_cast<double>(ch);
}

double ContextHistogram::ValueBits(bool with_prev) const {
  double bits = 0;
  for (int e = 0; e < kExponents; ++e) {
    if (with_prev) {
      for (int s = 0; s < kPrevSigns; ++s) {
        const DiffHistogram& h = ctx_[e * kPrevSigns + s].diffs;
        bits += static_cast<double>(h.total()) * h.EntropyBits();
      }
    } else {
      DiffHistogram h;
      for (int s = 0; s < kPrevSigns; ++s) h.Merge(ctx_[e * kPrevSigns + s].diffs);
      bits += static_cast<double>(h.total()) * h.EntropyBits();
    }
  }
  const uint64_t ch = changed();
  return ch == 0 ? 0 : bits / static_cast<double>(ch);
}

ContextBound ComputeContextBound(const ContextHistogram& h) {
  ContextBound b;
  b.position_exp = h.PositionBits(false);
  b.value_exp = h.ValueBits(false);
  b.position_full = h.PositionBits(true);
  b.value_full = h.ValueBits(true);
  return b;
}

}  // namespace refit::bench
