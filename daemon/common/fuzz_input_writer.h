// Writes fuzz inputs that LLVM's FuzzedDataProvider (<fuzzer/FuzzedDataProvider.h>) reads back
// as the values written, so a seed corpus generator can spell out a valid operation sequence for
// a fuzz target that decodes its input with a FuzzedDataProvider. For fuzzing tools only.
//
// Mirrors the provider's rules: integers (ConsumeIntegralInRange, ConsumeIntegral, ConsumeBool)
// come from the end of the data, most significant byte first, as many bytes as the range needs;
// ConsumeBytes(n) and ConsumeRandomLengthString come from the front ('\' is escaped as "\\",
// and "\" followed by another byte ends the string). Call the writer's methods in the order the
// target consumes the values.
#ifndef REFIT_DAEMON_COMMON_FUZZ_INPUT_WRITER_H_
#define REFIT_DAEMON_COMMON_FUZZ_INPUT_WRITER_H_

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace refit {

class FuzzInputWriter {
 public:
  // What ConsumeIntegralInRange<T>(min, max) returns as `value` (min <= value <= max).
  template <typename T>
  void Integral(T min, T max, T value) {
    static_assert(std::is_integral_v<T> && sizeof(T) <= sizeof(uint64_t));
    const uint64_t range = static_cast<uint64_t>(max) - static_cast<uint64_t>(min);
    const uint64_t offset = static_cast<uint64_t>(value) - static_cast<uint64_t>(min);
    int bytes = 0;
    for (size_t bits = 0; bits < sizeof(T) * CHAR_BIT && (range >> bits) > 0; bits += CHAR_BIT) {
      ++bytes;
    }
    // Consumed most significant first: the first byte read is the last one of the data.
    for (int i = bytes - 1; i >= 0; --i) back_.push_back(static_cast<uint8_t>(offset >> (8 * i)));
  }
  // ConsumeIntegral<T>().
  template <typename T>
  void Integral(T value) {
    Integral<T>(std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), value);
  }
  // ConsumeBool().
  void Bool(bool value) { Integral<uint8_t>(value ? 1 : 0); }
  // ConsumeBytes<uint8_t>(bytes.size()).
  void Bytes(std::span<const uint8_t> bytes) { front_.insert(front_.end(), bytes.begin(), bytes.end()); }
  // ConsumeRandomLengthString(max_length) with s.size() < max_length.
  void String(const std::string& s) {
    for (char c : s) {
      if (c == '\\') front_.push_back('\\');
      front_.push_back(static_cast<uint8_t>(c));
    }
    front_.push_back('\\');
    front_.push_back(' ');
  }
  // The input: the front part, then the integers in reverse order of consumption.
  std::vector<uint8_t> Finish() const {
    std::vector<uint8_t> out = front_;
    out.insert(out.end(), back_.rbegin(), back_.rend());
    return out;
  }

 private:
  std::vector<uint8_t> front_;
  std::vector<uint8_t> back_;  // in consumption order
};

// Seed corpus generators: writes `bytes` as DIR/seed-<n> (n counts up from 0); exits 1 with the
// path on failure (a generator has nothing better to do).
class SeedFiles {
 public:
  explicit SeedFiles(std::string dir) : dir_(std::move(dir)) {}
  void Write(std::span<const uint8_t> bytes) {
    const std::string path = dir_ + "/seed-" + std::to_string(written_++);
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
      std::perror(path.c_str());
      std::exit(1);
    }
    std::fclose(f);
  }
  void Write(const FuzzInputWriter& w) {
    const std::vector<uint8_t> bytes = w.Finish();
    Write(std::span<const uint8_t>(bytes));
  }
  int written() const { return written_; }

 private:
  std::string dir_;
  int written_ = 0;
};

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_FUZZ_INPUT_WRITER_H_
