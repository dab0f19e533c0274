// Entropy bounds for sparse BF16 deltas (bench only): the number of bits per changed element
// below which no coder can go for a given change rate and value-difference distribution.
//
// Model: positions are drawn independently at density p (cost H(p)/p bits per changed element,
// H the binary entropy), and each changed element's value is an order-0 symbol, the signed
// difference d = image(target) - image(base) of the ordered-integer images (format.h
// OrderedImage) as int64, with its empirical distribution (cost: its empirical entropy).
#ifndef REFIT_BENCH_ENTROPY_H_
#define REFIT_BENCH_ENTROPY_H_

#include <array>
#include <cstdint>
#include <span>
#include <unordered_map>

namespace refit::bench {

// Binary entropy H(p) = -p log2 p - (1-p) log2 (1-p) in bits; 0 at p <= 0 or p >= 1.
double BinaryEntropyBits(double p);

// H(p) / p: bits per changed element to name positions drawn independently at density p.
// 0 when p <= 0 (nothing to name) and when p >= 1 (every element changes).
double PositionBoundBitsPerChange(double p);

// Signed ordered-image difference image(target) - image(base) of two `bits`-wide floating-point
// bit patterns (format::OrderedImage), as a plain int64 (no wrap-around).
int64_t OrderedDiff(uint64_t base_bits, uint64_t target_bits, int bits);

// Histogram of signed differences, with a dense fast path for small |d|.
class DiffHistogram {
 public:
  static constexpr int64_t kDenseRange = 256;  // d in [-256, 256] counted in an array

  void Add(int64_t d, uint64_t n = 1);
  void Merge(const DiffHistogram& other);
  uint64_t total() const { return total_; }
  // Count of symbols equal to d.
  uint64_t Count(int64_t d) const;
  // Count of symbols with |d| == m, and with |d| > m.
  uint64_t CountAbs(int64_t m) const;
  uint64_t CountAbsAbove(int64_t m) const;
  // Empirical order-0 entropy in bits per symbol (0 when empty or a single symbol).
  double EntropyBits() const;

 private:
  std::array<uint64_t, 2 * kDenseRange + 1> dense_{};
  std::unordered_map<int64_t, uint64_t> sparse_;
  uint64_t total_ = 0;
};

// Compares two tensors of `elem_bytes`-wide (1, 2 or 4; 2 for BF16) floating-point elements and adds the
// OrderedDiff of every changed element to `hist`; returns the number of changed elements.
// `threads` as in refit::ParallelFor (0 = all hardware threads). base.size() == target.size().
uint64_t AccumulateDiffs(std::span<const uint8_t> base, std::span<const uint8_t> target,
                         int elem_bytes, DiffHistogram* hist, int threads = 0);

struct EntropyBound {
  double change_rate = 0;           // p = changed / elements
  double position_bits = 0;         // H(p)/p
  double value_bits = 0;            // empirical entropy of d over the changed elements
  double bits_per_change() const { return position_bits + value_bits; }
};

EntropyBound ComputeBound(uint64_t changed, uint64_t elements, const DiffHistogram& hist);

}  // namespace refit::bench

#endif  // REFIT_BENCH_ENTROPY_H_
