#include "daemon/model/safetensors_reader.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/printable.h"
#include "daemon/common/safe_file.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/strict_json_reader.h"

namespace refit::model {
namespace {

using internal::JsonReader;

uint64_t LoadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

uint64_t SafetensorsEntry::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<size_t> SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", Quoted(name)));
  }
  return it->second;
}

std::span<const uint8_t> SafetensorsFile::data(size_t i) const {
  const SafetensorsEntry& e = tensors_[i];
  return image_.subspan(static_cast<size_t>(e.offset), static_cast<size_t>(e.size));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const UniqueFd fd, OpenRegularFile(path));
  return FromFd(fd.get(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::OpenBeneath(const std::string& path,
                                                             std::span<const std::string> roots,
                                                             absl::string_view roots_field) {
  REFIT_ASSIGN_OR_RETURN(const UniqueFd fd, OpenRegularFileBeneath(path, roots, roots_field));
  return FromFd(fd.get(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromFd(int fd, const std::string& path,
                                                        int read_threads) {
  SafetensorsFile f;
  f.path_ = path;
  REFIT_ASSIGN_OR_RETURN(f.file_, ReadWholeFileImage(fd, path, read_threads));
  f.image_ = {f.file_.data(), static_cast<size_t>(f.file_.size())};
  REFIT_RETURN_IF_ERROR(f.Parse());
  return f;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::vector<uint8_t> bytes,
                                                           std::string name) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  f.owned_ = std::move(bytes);
  f.image_ = f.owned_;
  REFIT_RETURN_IF_ERROR(f.Parse());
  return f;
}

namespace {

// Where the data region lies (from the start of the file), for checking data_offsets.
struct DataRegion {
  uint64_t start = 0;
  uint64_t size = 0;
};

struct TensorRange {
  uint64_t begin = 0, end = 0;
};

// What the header object holds, in header order.
struct ParsedHeader {
  std::vector<SafetensorsEntry> tensors;
  std::vector<TensorRange> ranges;  // data_offsets of tensors[i]
  absl::flat_hash_map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;
};

// The 8-byte length field N, checked against the limit and the file size. The field may hold
// anything (the file need not be a safetensors file at all), so a bad N is never printed.
absl::StatusOr<uint64_t> ReadHeaderLength(std::span<const uint8_t> file, const std::string& path) {
  if (file.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": file is ", file.size(),
                                                   " bytes, too short for the 8-byte safetensors "
                                                   "header length"));
  }
  const uint64_t n = LoadLE64(file.data());
  if (n > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the header length field exceeds the limit of ",
                     kSafetensorsMaxHeaderBytes, " bytes (100 MiB): not a safetensors file?"));
  }
  if (n > file.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the header length field exceeds the file size of ", file.size(),
                     " bytes: truncated, or not a safetensors file?"));
  }
  return n;
}

// "__metadata__": null, or an object of string values.
absl::Status ParseMetadata(JsonReader& r, std::map<std::string, std::string>* metadata) {
  if (r.Peek() == 'n') return r.ReadLiteral("null");  // accepted, as by the reference reader
  if (r.Peek() != '{') {
    return r.Error(r.pos(), absl::StrCat("\"__metadata__\" must be an object of strings, found ",
                                         r.DescribeNext()));
  }
  REFIT_RETURN_IF_ERROR(r.Expect('{', "'{'"));
  bool first = true;
  std::string key, value;
  size_t key_pos = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &key, &key_pos));
    if (!more) return absl::OkStatus();
    if (r.Peek() != '"') {
      return r.Error(r.pos(), absl::StrCat("\"__metadata__\" value for ", Quoted(key),
                                           " must be a string, found ", r.DescribeNext()));
    }
    REFIT_RETURN_IF_ERROR(r.ReadString(&value));
    if (!metadata->emplace(key, value).second) {
      return r.Error(key_pos, absl::StrCat("duplicate \"__metadata__\" key ", Quoted(key)));
    }
  }
}

// One tensor object's fields while they are read.
struct TensorFields {
  std::string where;  // "tensor \"name\""
  SafetensorsEntry entry;
  bool have_dtype = false, have_shape = false, have_offsets = false;
  TensorRange range;
  size_t offsets_pos = 0, shape_pos = 0;

  absl::Status Error(const JsonReader& r, absl::string_view field, size_t at,
                     absl::string_view what) const {
    return r.Error(at, absl::StrCat(where, ": field ", Quoted(field), ": ", what));
  }
};

absl::Status ParseDTypeField(JsonReader& r, size_t value_pos, TensorFields& t) {
  if (r.Peek() != '"') {
    return t.Error(r, "dtype", value_pos,
                   absl::StrCat("expected a string, found ", r.DescribeNext()));
  }
  std::string text;
  REFIT_RETURN_IF_ERROR(r.ReadString(&text));
  auto dt = ParseDType(text);
  if (!dt.ok() || SafetensorsDTypeName(*dt) != text) {
    return t.Error(r, "dtype", value_pos,
                   absl::StrCat("unknown or unsupported dtype ", Quoted(text),
                                " (supported: BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 I16 I32 "
                                "I64 U8 U16 U32 U64 BOOL)"));
  }
  t.entry.dtype = *dt;
  return absl::OkStatus();
}

absl::Status ParseShapeField(JsonReader& r, size_t value_pos, TensorFields& t) {
  t.shape_pos = value_pos;
  if (r.Peek() != '[') {
    return t.Error(r, "shape", value_pos,
                   absl::StrCat("expected an array, found ", r.DescribeNext()));
  }
  REFIT_RETURN_IF_ERROR(r.Expect('[', "'['"));
  std::vector<int64_t>& shape = t.entry.shape;
  bool first = true;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(bool more, r.NextElement(&first));
    if (!more) return absl::OkStatus();
    if (shape.size() >= static_cast<size_t>(kSafetensorsMaxRank)) {
      return t.Error(r, "shape", value_pos,
                     absl::StrCat("more than ", kSafetensorsMaxRank, " dimensions"));
    }
    uint64_t d;
    REFIT_RETURN_IF_ERROR(
        r.ReadUint64(&d, absl::StrCat(t.where, ": shape dimension ", shape.size())));
    if (d > static_cast<uint64_t>(INT64_MAX)) {
      return t.Error(r, "shape", value_pos,
                     absl::StrCat("dimension ", shape.size(), " = ", d, " is too large"));
    }
    shape.push_back(static_cast<int64_t>(d));
  }
}

absl::Status ParseOffsetsField(JsonReader& r, size_t value_pos, TensorFields& t) {
  t.offsets_pos = value_pos;
  if (r.Peek() != '[') {
    return t.Error(r, "data_offsets", value_pos,
                   absl::StrCat("expected an array of two integers, found ", r.DescribeNext()));
  }
  REFIT_RETURN_IF_ERROR(r.Expect('[', "'['"));
  bool first = true;
  int count = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(bool more, r.NextElement(&first));
    if (!more) break;
    if (count == 2) return t.Error(r, "data_offsets", value_pos, "more than two offsets");
    REFIT_RETURN_IF_ERROR(r.ReadUint64(count == 0 ? &t.range.begin : &t.range.end,
                                       absl::StrCat(t.where, ": data_offsets[", count, "]")));
    ++count;
  }
  if (count != 2) {
    return t.Error(r, "data_offsets", value_pos,
                   absl::StrCat("expected [begin, end], got ", count, " value(s)"));
  }
  return absl::OkStatus();
}

// The members of a tensor object: dtype, shape and data_offsets, each exactly once.
absl::Status ParseTensorFields(JsonReader& r, size_t key_pos, TensorFields& t) {
  bool first = true;
  std::string field;
  size_t field_pos = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &field, &field_pos));
    if (!more) break;
    r.SkipWhitespace();
    const size_t value_pos = r.pos();
    bool* seen = field == "dtype"          ? &t.have_dtype
                 : field == "shape"        ? &t.have_shape
                 : field == "data_offsets" ? &t.have_offsets
                                           : nullptr;
    if (seen == nullptr) {
      return r.Error(field_pos, absl::StrCat(t.where, ": unknown field ", Quoted(field),
                                             " (expected dtype, shape, data_offsets)"));
    }
    if (*seen) return t.Error(r, field, field_pos, "duplicate field");
    *seen = true;
    REFIT_RETURN_IF_ERROR(field == "dtype"   ? ParseDTypeField(r, value_pos, t)
                          : field == "shape" ? ParseShapeField(r, value_pos, t)
                                             : ParseOffsetsField(r, value_pos, t));
  }
  if (!t.have_dtype || !t.have_shape || !t.have_offsets) {
    return r.Error(key_pos, absl::StrCat(t.where, ": missing field \"",
                                         !t.have_dtype   ? "dtype"
                                         : !t.have_shape ? "shape"
                                                         : "data_offsets",
                                         "\""));
  }
  return absl::OkStatus();
}

// data_offsets against the data region, and against the bytes the shape and dtype imply.
absl::Status CheckTensorExtent(const JsonReader& r, const DataRegion& data, TensorFields& t) {
  const uint64_t begin = t.range.begin, end = t.range.end;
  if (begin > end) {
    return t.Error(r, "data_offsets", t.offsets_pos, absl::StrCat("begin ", begin, " > end ", end));
  }
  if (end > data.size) {
    return t.Error(r, "data_offsets", t.offsets_pos,
                   absl::StrCat("[", begin, ", ", end, ") runs past the data region (", data.size,
                                " bytes): truncated file?"));
  }
  // Bytes implied by the shape, with overflow checks (a zero dimension makes the product 0).
  const std::vector<int64_t>& shape = t.entry.shape;
  uint64_t bytes = static_cast<uint64_t>(DTypeSize(t.entry.dtype));
  bool overflow = false;
  const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
  for (int64_t d : shape) {
    overflow |= __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes);
  }
  if (empty) bytes = 0;
  if (!empty && overflow) {
    return t.Error(r, "shape", t.shape_pos,
                   "the number of bytes the shape implies overflows 64 bits");
  }
  if (bytes != end - begin) {
    return t.Error(
        r, "data_offsets", t.offsets_pos,
        absl::StrCat("[", begin, ", ", end, ") holds ", end - begin, " bytes but shape ",
                     "and dtype ", SafetensorsDTypeName(t.entry.dtype), " need ", bytes));
  }
  t.entry.offset = data.start + begin;
  t.entry.size = end - begin;
  return absl::OkStatus();
}

// One "name": {dtype, shape, data_offsets} member, appended to `out`.
absl::Status ParseTensorEntry(JsonReader& r, const std::string& name, size_t key_pos,
                              const DataRegion& data, ParsedHeader& out) {
  TensorFields t;
  t.where = absl::StrCat("tensor ", Quoted(name));
  if (out.index.contains(name))
    return r.Error(key_pos, absl::StrCat(t.where, ": duplicate tensor name"));
  if (r.Peek() != '{') {
    return r.Error(r.pos(),
                   absl::StrCat(t.where, ": expected an object, found ", r.DescribeNext()));
  }
  REFIT_RETURN_IF_ERROR(r.Expect('{', "'{'"));
  t.entry.name = name;
  REFIT_RETURN_IF_ERROR(ParseTensorFields(r, key_pos, t));
  REFIT_RETURN_IF_ERROR(CheckTensorExtent(r, data, t));
  out.index.emplace(name, out.tensors.size());
  out.tensors.push_back(std::move(t.entry));
  out.ranges.push_back(t.range);
  return absl::OkStatus();
}

// The header object: tensors and at most one "__metadata__", nothing after it.
absl::StatusOr<ParsedHeader> ParseHeaderObject(JsonReader& r, const DataRegion& data) {
  if (r.Peek() != '{') {
    return r.Error(r.pos(),
                   absl::StrCat("the header must be a JSON object, found ", r.DescribeNext()));
  }
  REFIT_RETURN_IF_ERROR(r.Expect('{', "'{'"));
  ParsedHeader out;
  bool seen_metadata = false;
  bool first = true;
  std::string key;
  size_t key_pos = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &key, &key_pos));
    if (!more) break;
    if (key != kSafetensorsMetadataKey) {
      REFIT_RETURN_IF_ERROR(ParseTensorEntry(r, key, key_pos, data, out));
      continue;
    }
    if (seen_metadata) return r.Error(key_pos, "duplicate \"__metadata__\"");
    seen_metadata = true;
    REFIT_RETURN_IF_ERROR(ParseMetadata(r, &out.metadata));
  }
  if (!r.AtEnd()) return r.SyntaxError(r.pos(), "unexpected content after the header object");
  return out;
}

// The tensors must tile the data region: no overlap, no hole, nothing after the last one.
absl::Status CheckTiling(const std::string& path, const ParsedHeader& h, uint64_t data_len) {
  std::vector<size_t> order(h.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return h.ranges[a].begin != h.ranges[b].begin ? h.ranges[a].begin < h.ranges[b].begin
                                                  : h.ranges[a].end < h.ranges[b].end;
  });
  uint64_t covered = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorRange& rg = h.ranges[order[k]];
    const std::string where = absl::StrCat(path, ": tensor ", Quoted(h.tensors[order[k]].name),
                                           ": data_offsets [", rg.begin, ", ", rg.end, ")");
    if (rg.begin < covered) {
      return absl::InvalidArgumentError(absl::StrCat(where, " overlaps tensor ",
                                                     Quoted(h.tensors[order[k - 1]].name),
                                                     " (which ends at ", covered, ")"));
    }
    if (rg.begin > covered) {
      return absl::InvalidArgumentError(absl::StrCat(where, " leaves a hole: bytes [", covered,
                                                     ", ", rg.begin,
                                                     ") of the data region belong to no tensor"));
    }
    covered = rg.end;
  }
  if (covered != data_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the data region is ", data_len, " bytes but the tensors cover only ",
                     covered, " (", data_len - covered, " trailing bytes belong to no tensor)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsFile::Parse() {
  REFIT_ASSIGN_OR_RETURN(header_size_, ReadHeaderLength(image_, path_));
  DataRegion data;
  data.start = 8 + header_size_;
  data.size = image_.size() - data.start;
  const absl::string_view header(reinterpret_cast<const char*>(image_.data() + 8), header_size_);
  JsonReader r(header, path_);
  REFIT_ASSIGN_OR_RETURN(ParsedHeader h, ParseHeaderObject(r, data));
  REFIT_RETURN_IF_ERROR(CheckTiling(path_, h, data.size));
  tensors_ = std::move(h.tensors);
  index_ = std::move(h.index);
  metadata_ = std::move(h.metadata);
  return absl::OkStatus();
}

}  // namespace refit::model
