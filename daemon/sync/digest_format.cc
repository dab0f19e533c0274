#include "daemon/sync/digest_format.h"

#include "absl/strings/str_cat.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"

namespace refit::sync {

uint64_t TensorDigestOf(DigestFormat format, std::span<const uint8_t> data, int threads) {
  switch (format) {
    case DigestFormat::kV2:
      return TensorDigestV2(data, threads);
    case DigestFormat::kV1:
      break;
  }
  return TensorDigest(data, threads);
}

absl::StatusOr<DigestFormat> DigestFormatFromWire(uint32_t wire) {
  switch (wire) {
    case 0:
    case 1:
      return DigestFormat::kV1;
    case 2:
      return DigestFormat::kV2;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("Welcome.digest_format: unknown tensor digest format ", wire));
  }
}

uint32_t DigestFormatToWire(DigestFormat format) { return static_cast<uint32_t>(format); }

DigestFormat ChooseDigestFormat(std::span<const uint32_t> offered, bool allow_v2) {
  if (!allow_v2) return DigestFormat::kV1;
  for (uint32_t f : offered) {
    if (f == DigestFormatToWire(DigestFormat::kV2)) return DigestFormat::kV2;
  }
  return DigestFormat::kV1;
}

const char* DigestFormatName(DigestFormat format) {
  return format == DigestFormat::kV2 ? "v2" : "v1";
}

}  // namespace refit::sync
