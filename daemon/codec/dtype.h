// Element types the codec understands and how each one's changed values are coded.
#ifndef REFIT_DAEMON_CODEC_DTYPE_H_
#define REFIT_DAEMON_CODEC_DTYPE_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace refit {

// Wire codes are part of the patch format (docs/ARCHITECTURE.md): never renumber.
enum class DType : uint8_t {
  kBF16 = 1,
  kF16 = 2,
  kF32 = 3,
  kF64 = 4,
  kF8E4M3 = 5,
  kF8E5M2 = 6,
  kI8 = 7,
  kI16 = 8,
  kI32 = 9,
  kI64 = 10,
  kU8 = 11,
  kU16 = 12,
  kU32 = 13,
  kU64 = 14,
  kBool = 15,
};

// How a changed element's value is represented in a sparse block.
enum class ValueCoding : uint8_t {
  // Floating point: difference of the "ordered integer" images (sign-magnitude bit pattern mapped
  // to a monotonic unsigned integer), as sign + magnitude. Every bit pattern (NaN payloads, -0.0,
  // infinities, denormals) maps bijectively, so any change round-trips.
  kOrderedDiff = 0,
  // Integers: two's complement difference modulo 2^bits, as sign + magnitude.
  kIntDiff = 1,
  // Anything else (bool): the new element's bits, verbatim.
  kRaw = 2,
};

bool IsValidDType(uint8_t code);
// Bytes per element (1, 2, 4 or 8). Requires IsValidDType.
int DTypeSize(DType t);
ValueCoding DTypeValueCoding(DType t);
// Canonical lower-case name: "bf16", "f16", "f32", "f64", "f8e4m3", "f8e5m2", "i8", ..., "bool".
absl::string_view DTypeName(DType t);
// Parses a canonical name or a safetensors dtype string ("BF16", "F8_E4M3", "BOOL", ...).
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_DTYPE_H_
