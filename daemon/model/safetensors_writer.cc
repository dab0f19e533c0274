#include "daemon/model/safetensors_writer.h"

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/json_string.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/utf8.h"

namespace refit::model {

namespace {

// Appends one tensor's header entry; checks the name, dtype, shape and data size.
absl::Status AppendTensorHeader(const std::string& path, const SafetensorsTensorRef& t,
                                uint64_t* offset, std::string* header) {
  const std::string where = absl::StrCat("write ", path, ": tensor ", Quoted(t.name));
  if (t.name == kSafetensorsMetadataKey)
    return absl::InvalidArgumentError(absl::StrCat(where, ": reserved name"));
  if (!IsValidUtf8(t.name))
    return absl::InvalidArgumentError(absl::StrCat(where, ": name is not valid UTF-8"));
  if (!IsValidDType(static_cast<uint8_t>(t.dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": invalid dtype code ", static_cast<int>(t.dtype)));
  }
  if (t.shape.size() > static_cast<size_t>(kSafetensorsMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", kSafetensorsMaxRank, " dimensions"));
  }
  uint64_t bytes = static_cast<uint64_t>(DTypeSize(t.dtype));
  bool overflow = false, empty = false;
  for (int64_t d : t.shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": negative dimension ", d));
    empty |= d == 0;
    overflow |= __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes);
  }
  if (empty) bytes = 0;
  if (overflow && !empty)
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape overflows"));
  if (bytes != t.data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape and dtype ",
                                                   SafetensorsDTypeName(t.dtype), " need ", bytes,
                                                   " bytes but the data span has ", t.data.size()));
  }
  if (header->size() > 1) *header += ',';
  AppendJsonString(t.name, header);
  absl::StrAppend(header, ":{\"dtype\":\"", SafetensorsDTypeName(t.dtype), "\",\"shape\":[");
  for (size_t k = 0; k < t.shape.size(); ++k) absl::StrAppend(header, k ? "," : "", t.shape[k]);
  absl::StrAppend(header, "],\"data_offsets\":[", *offset, ",", *offset + bytes, "]}");
  *offset += bytes;
  return absl::OkStatus();
}

// The header JSON, padded with spaces to a multiple of 8 bytes.
absl::StatusOr<std::string> BuildHeader(const std::string& path,
                                        std::span<const SafetensorsTensorRef> tensors,
                                        const std::map<std::string, std::string>& metadata) {
  std::string header = "{";
  if (!metadata.empty()) {
    AppendJsonString(kSafetensorsMetadataKey, &header);
    header += ":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return absl::InvalidArgumentError(absl::StrCat("write ", path, ": metadata key ", Quoted(k),
                                                       " or its value is not valid UTF-8"));
      }
      if (!first) header += ',';
      first = false;
      AppendJsonString(k, &header);
      header += ':';
      AppendJsonString(v, &header);
    }
    header += '}';
  }
  absl::flat_hash_set<absl::string_view> seen;
  uint64_t offset = 0;
  for (const SafetensorsTensorRef& t : tensors) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("write ", path, ": tensor ", Quoted(t.name), ": duplicate name"));
    }
    REFIT_RETURN_IF_ERROR(AppendTensorHeader(path, t, &offset, &header));
  }
  header += '}';
  while (header.size() % 8 != 0) header += ' ';
  if (header.size() > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("write ", path, ": header would be ", header.size(),
                     " bytes, over the 100 MiB limit readers accept"));
  }
  return header;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path,
                              std::span<const SafetensorsTensorRef> tensors,
                              const std::map<std::string, std::string>& metadata,
                              const SafeWriteOptions& options) {
  REFIT_ASSIGN_OR_RETURN(const std::string header, BuildHeader(path, tensors, metadata));
  REFIT_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path, options));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  REFIT_RETURN_IF_ERROR(file.Write(len));
  REFIT_RETURN_IF_ERROR(
      file.Write({reinterpret_cast<const uint8_t*>(header.data()), header.size()}));
  for (const SafetensorsTensorRef& t : tensors) REFIT_RETURN_IF_ERROR(file.Write(t.data));
  return file.Commit();
}

}  // namespace refit::model
