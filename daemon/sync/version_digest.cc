#include "daemon/sync/version_digest.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/hash.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/tensor_part.h"

namespace refit::sync {
namespace {

bool IsValidUtf8(const std::string& s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    int len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (int k = 1; k < len; ++k) {
      const uint8_t cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and code points above U+10FFFF are invalid.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      return false;
    }
    i += len;
  }
  return true;
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

}  // namespace

uint64_t FrameChecksum(std::span<const uint8_t> payload) {
  return Hash64(payload, kFrameChecksumSeed);
}
uint64_t FrameChecksum(const std::string& payload) {
  return FrameChecksum(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
}

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  const int code = static_cast<int>(dtype);
  if (code <= 0 || code > 255 || !IsValidDType(static_cast<uint8_t>(code))) {
    return absl::InvalidArgumentError(absl::StrCat("invalid dtype code ", code));
  }
  return static_cast<DType>(code);
}

v1::DType ToProtoDType(DType dtype) { return static_cast<v1::DType>(static_cast<int>(dtype)); }

std::string DescribeTensor(uint32_t index, const std::string& name) {
  return absl::StrCat("tensor ", index, " ", Quoted(name));
}

absl::StatusOr<uint64_t> ElementCount(const v1::TensorSpec& spec) {
  constexpr uint64_t kLimit = (1ull << 63) - 1;
  const bool has_zero = std::find(spec.shape().begin(), spec.shape().end(), 0u) != spec.shape().end();
  uint64_t count = 1;
  for (uint64_t d : spec.shape()) {
    if (d > kLimit) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(spec.name()), ": dimension ",
                                                     d, " exceeds 2^63 - 1"));
    }
    if (has_zero) continue;
    if (__builtin_mul_overflow(count, d, &count) || count > kLimit) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quoted(spec.name()), ": element count of shape [",
                       absl::StrJoin(spec.shape(), ", "), "] does not fit in 63 bits"));
    }
  }
  return has_zero ? 0 : count;
}

absl::StatusOr<uint64_t> TensorByteSize(const v1::TensorSpec& spec) {
  auto dtype = FromProtoDType(spec.dtype());
  if (!dtype.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, dtype.status(), "tensor ",
                      Quoted(spec.name()));
  }
  auto count = ElementCount(spec);
  if (!count.ok()) return count.status();
  uint64_t bytes;
  if (__builtin_mul_overflow(*count, static_cast<uint64_t>(DTypeSize(*dtype)), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", Quoted(spec.name()), ": byte size overflows 64 bits"));
  }
  return bytes;
}

absl::Status ValidateTensorSpec(const v1::TensorSpec& spec) {
  if (spec.name().empty()) return absl::InvalidArgumentError("tensor name is empty");
  if (spec.name().size() > kMaxTensorNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(spec.name()), ": name is ",
                                                   spec.name().size(), " bytes (max ",
                                                   kMaxTensorNameBytes, ")"));
  }
  if (!IsValidUtf8(spec.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", Quoted(spec.name()), ": name is not valid UTF-8"));
  }
  if (static_cast<size_t>(spec.shape_size()) > kMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(spec.name()), ": rank ",
                                                   spec.shape_size(), " exceeds ", kMaxRank));
  }
  auto bytes = TensorByteSize(spec);
  if (!bytes.ok()) return bytes.status();
  return IsPart(spec) ? ValidatePart(spec) : absl::OkStatus();
}

absl::Status ValidateManifest(std::span<const v1::TensorSpec> manifest) {
  for (size_t i = 0; i < manifest.size(); ++i) {
    absl::Status s = ValidateTensorSpec(manifest[i]);
    if (!s.ok()) {
      return AnnotateAs(absl::StatusCode::kInvalidArgument, s, "manifest index ", i);
    }
    if (i > 0 && manifest[i - 1].name() == manifest[i].name()) {
      if (absl::Status p = CheckNextPart(manifest[i - 1], manifest[i]); !p.ok()) {
        return AnnotateAs(absl::StatusCode::kInvalidArgument, p, "manifest index ", i);
      }
      continue;
    }
    if (i > 0 && !(manifest[i - 1].name() < manifest[i].name())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest index ", i, ": ", DescribeTensor(static_cast<uint32_t>(i), manifest[i].name()),
          manifest[i - 1].name() == manifest[i].name() ? " is a duplicate name"
                                                       : " is not in ascending name order"));
    }
  }
  return absl::OkStatus();
}

void SortManifest(std::vector<v1::TensorSpec>& manifest, std::vector<uint64_t>* digests) {
  std::vector<size_t> order(manifest.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return SpecBefore(manifest[a], manifest[b]); });
  std::vector<v1::TensorSpec> sorted;
  sorted.reserve(manifest.size());
  for (size_t i : order) sorted.push_back(std::move(manifest[i]));
  manifest = std::move(sorted);
  if (digests != nullptr && digests->size() == order.size()) {
    std::vector<uint64_t> d;
    d.reserve(order.size());
    for (size_t i : order) d.push_back((*digests)[i]);
    *digests = std::move(d);
  }
}

bool SameSpec(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  return a.name() == b.name() && a.dtype() == b.dtype() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end()) &&
         SamePlace(a, b) &&
         std::equal(a.part().whole_shape().begin(), a.part().whole_shape().end(),
                    b.part().whole_shape().begin(), b.part().whole_shape().end());
}

absl::StatusOr<uint64_t> VersionDigest(std::span<const v1::TensorSpec> manifest,
                                       std::span<const uint64_t> tensor_digests) {
  if (manifest.size() != tensor_digests.size()) {
    return absl::InvalidArgumentError(absl::StrCat("version digest: ", manifest.size(),
                                                   " tensors but ", tensor_digests.size(),
                                                   " tensor digests"));
  }
  if (absl::Status s = ValidateManifest(manifest); !s.ok()) return s;
  if (manifest.empty()) return 0;
  std::string buf;
  for (size_t i = 0; i < manifest.size(); ++i) {
    const v1::TensorSpec& t = manifest[i];
    // A part sets bit 31 of the name length (names are at most 4096 bytes) and follows its
    // dimensions with its place in the whole tensor; a part along a dim other than 0 also sets
    // bit 30 and puts that dim (one byte) after its first index.
    const bool other_dim = IsPart(t) && t.part().dim() != 0;
    const uint32_t n = static_cast<uint32_t>(t.name().size()) |
                       (IsPart(t) ? uint32_t{1} << 31 : uint32_t{0}) |
                       (other_dim ? uint32_t{1} << 30 : uint32_t{0});
    for (int k = 0; k < 4; ++k) buf.push_back(static_cast<char>((n >> (8 * k)) & 0xFF));
    buf.append(t.name());
    buf.push_back(static_cast<char>(static_cast<uint8_t>(t.dtype())));
    buf.push_back(static_cast<char>(static_cast<uint8_t>(t.shape_size())));
    for (uint64_t d : t.shape()) PutU64(buf, d);
    if (IsPart(t)) {
      PutU64(buf, t.part().first_row());
      if (other_dim) buf.push_back(static_cast<char>(static_cast<uint8_t>(t.part().dim())));
      buf.push_back(static_cast<char>(static_cast<uint8_t>(t.part().whole_shape_size())));
      for (uint64_t d : t.part().whole_shape()) PutU64(buf, d);
    }
    PutU64(buf, tensor_digests[i]);
  }
  return Hash64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf.data()), buf.size()),
                kVersionDigestSeed);
}

}  // namespace refit::sync
