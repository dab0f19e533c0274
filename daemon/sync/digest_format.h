// Tensor digest formats (negotiated per session: data.proto Hello.digest_formats /
// Welcome.digest_format): the one place that maps a format to its tensor digest function. Every
// path that recomputes a tensor digest (subscriber verify and scrub, refitctl verify, peers,
// publisher restart) goes through TensorDigestOf.
#ifndef REFIT_DAEMON_SYNC_DIGEST_FORMAT_H_
#define REFIT_DAEMON_SYNC_DIGEST_FORMAT_H_

#include <cstdint>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"

namespace refit::sync {

// Wire values of Welcome.digest_format (0 on the wire means v1: the field is absent for old
// publishers).
enum class DigestFormat : uint32_t {
  kV1 = 1,  // daemon/codec/hash.h TensorDigest (ARCHITECTURE "Tensor digest")
  kV2 = 2,  // daemon/codec/digest_v2.h TensorDigestV2 (ARCHITECTURE "Tensor digest, version 2")
};

// The tensor digest of `data` in `format`, with up to `threads` threads (0 = all hardware).
uint64_t TensorDigestOf(DigestFormat format, std::span<const uint8_t> data, int threads = 0);

// Welcome.digest_format -> format: 0 and 1 are v1, 2 is v2; INVALID_ARGUMENT otherwise.
absl::StatusOr<DigestFormat> DigestFormatFromWire(uint32_t wire);
uint32_t DigestFormatToWire(DigestFormat format);

// The publisher's choice from Hello.digest_formats (formats the subscriber verifies besides v1):
// v2 when offered and `allow_v2`, v1 otherwise. Unknown values are ignored.
DigestFormat ChooseDigestFormat(std::span<const uint32_t> offered, bool allow_v2 = true);

// "v1" / "v2".
const char* DigestFormatName(DigestFormat format);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_DIGEST_FORMAT_H_
