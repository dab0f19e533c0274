// The pure half of cuda/device.h (no CUDA): UUID text, device selection, Allocation ownership.
// Part of refit_device_api, which every build has.
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/device.h"

namespace refit::cuda {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string FormatUuid(const Uuid& uuid) {
  std::string out = "GPU-";
  static constexpr char kHex[] = "0123456789abcdef";
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out.push_back(kHex[uuid[i] >> 4]);
    out.push_back(kHex[uuid[i] & 15]);
  }
  return out;
}

absl::StatusOr<Uuid> ParseUuid(absl::string_view text) {
  absl::string_view body = text;
  if (body.size() >= 4 && absl::AsciiStrToUpper(body.substr(0, 4)) == "GPU-") body.remove_prefix(4);
  // 8-4-4-4-12 hex digits.
  static constexpr size_t kGroups[] = {8, 4, 4, 4, 12};
  Uuid uuid{};
  size_t pos = 0, byte = 0;
  bool ok = true;
  for (size_t g = 0; g < 5 && ok; ++g) {
    if (g > 0) {
      if (pos >= body.size() || body[pos] != '-') {
        ok = false;
        break;
      }
      ++pos;
    }
    for (size_t k = 0; k < kGroups[g]; k += 2) {
      if (pos + 2 > body.size()) {
        ok = false;
        break;
      }
      const int hi = HexValue(body[pos]), lo = HexValue(body[pos + 1]);
      if (hi < 0 || lo < 0) {
        ok = false;
        break;
      }
      uuid[byte++] = static_cast<uint8_t>(hi * 16 + lo);
      pos += 2;
    }
  }
  if (!ok || pos != body.size() || byte != kUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text,
                     "\" is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as "
                     "nvidia-smi -L prints)"));
  }
  return uuid;
}

absl::StatusOr<Uuid> UuidFromBytes(absl::string_view bytes) {
  if (bytes.size() != kUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a GPU UUID has 16 bytes, got ", bytes.size()));
  }
  Uuid uuid{};
  for (size_t i = 0; i < kUuidBytes; ++i) uuid[i] = static_cast<uint8_t>(bytes[i]);
  return uuid;
}

std::string DeviceSelector::ToString() const {
  if (uuid.has_value() && ordinal.has_value()) {
    return absl::StrCat("device ", *ordinal, " (", FormatUuid(*uuid), ")");
  }
  if (uuid.has_value()) return absl::StrCat("device ", FormatUuid(*uuid));
  if (ordinal.has_value()) return absl::StrCat("device ", *ordinal);
  return "device 0 (default)";
}

absl::StatusOr<int> ResolveDevice(const DeviceSelector& selector,
                                  std::span<const DeviceInfo> visible,
                                  std::optional<std::string> cuda_visible_devices) {
  auto not_found = [&](absl::string_view why) {
    std::vector<std::string> seen;
    for (const DeviceInfo& d : visible) {
      seen.push_back(absl::StrCat(d.ordinal, ": ", d.name, " ", FormatUuid(d.uuid)));
    }
    return absl::NotFoundError(absl::StrCat(
        selector.ToString(), " ", why, "; this process sees ", visible.size(), " GPU(s)",
        visible.empty() ? "" : absl::StrCat(" [", absl::StrJoin(seen, "; "), "]"),
        " with CUDA_VISIBLE_DEVICES",
        cuda_visible_devices.has_value() ? absl::StrCat("=\"", *cuda_visible_devices, "\"")
                                         : std::string(" unset"),
        " (a container or process that should share the GPU must have it visible: see "
        "docs/CUDA_IPC.md)"));
  };
  if (selector.uuid.has_value()) {
    for (const DeviceInfo& d : visible) {
      if (d.uuid == *selector.uuid) {
        if (selector.ordinal.has_value() && *selector.ordinal != d.ordinal) {
          return absl::InvalidArgumentError(
              absl::StrCat(FormatUuid(*selector.uuid), " is device ", d.ordinal,
                           " in this process, not device ", *selector.ordinal));
        }
        return d.ordinal;
      }
    }
    return not_found("is not visible");
  }
  const int ordinal = selector.ordinal.value_or(0);
  for (const DeviceInfo& d : visible) {
    if (d.ordinal == ordinal) return ordinal;
  }
  return not_found("does not exist");
}

Allocation::~Allocation() {
  if (ptr_ != nullptr && free_ != nullptr) free_(ptr_, kind_, ordinal_);
}

Allocation::Allocation(Allocation&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      kind_(other.kind_),
      ordinal_(other.ordinal_),
      free_(std::exchange(other.free_, nullptr)) {}

Allocation& Allocation::operator=(Allocation&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr && free_ != nullptr) free_(ptr_, kind_, ordinal_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
    kind_ = other.kind_;
    ordinal_ = other.ordinal_;
    free_ = std::exchange(other.free_, nullptr);
  }
  return *this;
}

absl::StatusOr<uint64_t> Device::DigestV2(const void*, uint64_t) {
  return absl::UnimplementedError("this Device has no digest v2");
}

absl::StatusOr<FusedEncoding> Device::EncodeFused(DType, void*, const void*, uint64_t,
                                                  const EncodeOptions&, bool) {
  return absl::UnimplementedError("this Device has no one-pass encode");
}

absl::StatusOr<DigestV2Delta> Device::ApplyDigestV2(std::span<const uint8_t>, DType, const void*,
                                                    void*, uint64_t) {
  return absl::UnimplementedError("this Device has no apply with digest v2");
}

absl::Status Device::WriteChanges(const TensorChanges&, void*, uint64_t) {
  return absl::UnimplementedError("this Device cannot write change sets in place");
}

absl::Status Device::RevertChanges(const TensorChanges&, void*, uint64_t) {
  return absl::UnimplementedError("this Device cannot revert change sets in place");
}

}  // namespace refit::cuda
