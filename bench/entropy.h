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
#include <vector>

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

// ---- context bound (patch format v2): the same model, but conditioned on what the receiver holds
// ---- Each element's context is (the exponent field of its base value, the sign of its change in
// the previous version's patch: none known / down / unchanged / up). Positions cost the sum over
// contexts of n_c H(p_c) (elements of context c change independently at their context's rate),
// values the conditional entropy H(d | context) over the changed elements.
class ContextHistogram {
 public:
  static constexpr int kExponents = 256;
  static constexpr int kPrevSigns = 4;  // 0 = not known, 1 = down, 2 = unchanged, 3 = up

  ContextHistogram();
  // Adds a BF16 tensor pair; `prev_base` (the version before `base`, same size) gives each
  // element's previous change sign, or is empty (sign not known).
  void AddBF16(std::span<const uint8_t> base, std::span<const uint8_t> target,
               std::span<const uint8_t> prev_base, int threads = 0);
  void Merge(const ContextHistogram& other);

  uint64_t elements() const;
  uint64_t changed() const;
  // Bits per changed element; `with_prev` conditions on the previous change sign as well.
  double PositionBits(bool with_prev) const;
  double ValueBits(bool with_prev) const;

 private:
  struct Ctx {
    uint64_t elements = 0;
    DiffHistogram diffs;  // changed elements only
  };
  std::vector<Ctx> ctx_;  // kExponents * kPrevSigns, index exponent * kPrevSigns + prev
};

struct ContextBound {
  double position_exp = 0, value_exp = 0;    // conditioned on the base exponent
  double position_full = 0, value_full = 0;  // ... and on the previous change sign
  double exp_bits() const { return position_exp + value_exp; }
  double full_bits() const { return position_full + value_full; }
};
ContextBound ComputeContextBound(const ContextHistogram& h);

}  // namespace refit::bench

#endif  // REFIT_BENCH_ENTROPY_H_
