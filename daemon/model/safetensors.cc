#include "daemon/model/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/safe_file.h"
#include "daemon/common/status_macros.h"

namespace refit::model {
namespace {

// ---- UTF-8
// -----------------------------------------------------------------------------------------

// Length of the valid UTF-8 sequence starting at s[i] (1-4), or 0 if it is not valid (overlong
// forms, surrogates and code points past U+10FFFF are invalid).
size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  auto cont = [&](size_t k, uint8_t lo, uint8_t hi) {
    return k < s.size() && byte(k) >= lo && byte(k) <= hi;
  };
  const uint8_t c = byte(i);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(i + 1, 0x80, 0xBF) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) && cont(i + 3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

bool IsValidUtf8(absl::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SequenceLength(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A name as it appears in error messages: quoted, non-printable bytes escaped, long ones cut.
std::string Quote(absl::string_view s) {
  constexpr size_t kMax = 200;
  std::string q = absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMax)), "\"");
  if (s.size() > kMax) absl::StrAppend(&q, "...");
  return q;
}

// ---- a strict pull-style JSON reader
// ------------------------------------------------------------------
//
// RFC 8259 syntax, no extensions: no comments, no trailing commas, no leading zeros, no NaN,
// strings must be valid UTF-8 with no raw control characters, \u escapes must pair surrogates. The
// caller drives it with the schema it expects (so memory is bounded by what the caller keeps, and
// nesting by the schema); every error names the byte offset in the JSON text.
class JsonReader {
 public:
  JsonReader(absl::string_view text, std::string context)
      : s_(text), context_(std::move(context)) {}

  size_t pos() const { return pos_; }

  // "<file>: header byte <at>: <what>" (schema errors from the caller use this too).
  absl::Status Error(size_t at, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(context_, ": header byte ", at, ": ", what));
  }
  absl::Status SyntaxError(size_t at, absl::string_view what) const {
    return Error(at, absl::StrCat("invalid JSON: ", what));
  }

  void SkipWhitespace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool AtEnd() {
    SkipWhitespace();
    return pos_ == s_.size();
  }
  char Peek() {
    SkipWhitespace();
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }

  // What the next value is, for "expected X, found Y" messages.
  std::string DescribeNext() {
    if (AtEnd()) return "the end of the header";
    const char c = s_[pos_];
    switch (c) {
      case '{':
        return "an object";
      case '[':
        return "an array";
      case '"':
        return "a string";
      case 't':
      case 'f':
        return "a boolean";
      case 'n':
        return "null";
      default:
        break;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return "a number";
    return absl::StrCat("unexpected character ", Quote(absl::string_view(&s_[pos_], 1)));
  }

  absl::Status Expect(char c, absl::string_view what) {
    if (Peek() != c) {
      return SyntaxError(pos_, absl::StrCat("expected ", what, ", found ", DescribeNext()));
    }
    ++pos_;
    return absl::OkStatus();
  }

  // Object iteration: call with first = true before the first member; returns false after '}'.
  absl::StatusOr<bool> NextMember(bool* first, std::string* key, size_t* key_pos) {
    if (Peek() == '}') {
      ++pos_;
      return false;
    }
    if (!*first) RETURN_IF_ERROR(Expect(',', "',' or '}' in object"));
    *first = false;
    if (Peek() != '"')
      return SyntaxError(pos_, absl::StrCat("expected a string key, found ", DescribeNext()));
    *key_pos = pos_;
    RETURN_IF_ERROR(ReadString(key));
    RETURN_IF_ERROR(Expect(':', "':' after object key"));
    return true;
  }

  // Array iteration: call with first = true before the first element; returns false after ']'.
  absl::StatusOr<bool> NextElement(bool* first) {
    if (Peek() == ']') {
      ++pos_;
      return false;
    }
    if (!*first) RETURN_IF_ERROR(Expect(',', "',' or ']' in array"));
    *first = false;
    return true;
  }

  absl::Status ReadString(std::string* out) {
    out->clear();
    RETURN_IF_ERROR(Expect('"', "a string"));
    while (true) {
      if (pos_ >= s_.size()) return SyntaxError(pos_, "unterminated string");
      const uint8_t c = static_cast<uint8_t>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (c < 0x20) {
        return SyntaxError(pos_,
                           absl::StrCat("raw control character 0x", absl::Hex(c), " in string"));
      }
      if (c == '\\') {
        RETURN_IF_ERROR(ReadEscape(out));
        continue;
      }
      const size_t n = Utf8SequenceLength(s_, pos_);
      if (n == 0) return SyntaxError(pos_, "invalid UTF-8 in string");
      out->append(s_.data() + pos_, n);
      pos_ += n;
    }
  }

  // A JSON number that must be a non-negative integer representable as u64.
  absl::Status ReadUint64(uint64_t* out, absl::string_view what) {
    const char c = Peek();
    const size_t start = pos_;
    if (c == '-')
      return Error(start,
                   absl::StrCat(what, " must be a non-negative integer, found a negative number"));
    if (c < '0' || c > '9') {
      return Error(start,
                   absl::StrCat(what, " must be a non-negative integer, found ", DescribeNext()));
    }
    uint64_t v = 0;
    bool overflow = false;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const uint64_t d = static_cast<uint64_t>(s_[pos_] - '0');
      if (v > (~0ull - d) / 10) overflow = true;
      v = v * 10 + d;
      ++pos_;
    }
    if (s_[start] == '0' && pos_ - start > 1)
      return SyntaxError(start, "number with a leading zero");
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E')) {
      return Error(
          start,
          absl::StrCat(what, " must be an integer, found a number with a fraction or exponent"));
    }
    if (overflow) return Error(start, absl::StrCat(what, " does not fit in 64 bits"));
    *out = v;
    return absl::OkStatus();
  }

  absl::Status ReadLiteral(absl::string_view literal) {
    SkipWhitespace();
    if (s_.substr(pos_, literal.size()) != literal) {
      return SyntaxError(pos_, absl::StrCat("expected ", literal, ", found ", DescribeNext()));
    }
    pos_ += literal.size();
    return absl::OkStatus();
  }

 private:
  absl::Status ReadHex4(uint32_t* out) {
    if (s_.size() - pos_ < 4) return SyntaxError(pos_, "truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[pos_ + k];
      uint32_t d;
      if (h >= '0' && h <= '9')
        d = h - '0';
      else if (h >= 'a' && h <= 'f')
        d = h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        d = h - 'A' + 10;
      else
        return SyntaxError(pos_ + k, "bad hex digit in \\u escape");
      v = v * 16 + d;
    }
    pos_ += 4;
    *out = v;
    return absl::OkStatus();
  }

  absl::Status ReadEscape(std::string* out) {
    const size_t start = pos_;
    ++pos_;  // backslash
    if (pos_ >= s_.size()) return SyntaxError(start, "unterminated escape");
    const char e = s_[pos_++];
    switch (e) {
      case '"':
        out->push_back('"');
        return absl::OkStatus();
      case '\\':
        out->push_back('\\');
        return absl::OkStatus();
      case '/':
        out->push_back('/');
        return absl::OkStatus();
      case 'b':
        out->push_back('\b');
        return absl::OkStatus();
      case 'f':
        out->push_back('\f');
        return absl::OkStatus();
      case 'n':
        out->push_back('\n');
        return absl::OkStatus();
      case 'r':
        out->push_back('\r');
        return absl::OkStatus();
      case 't':
        out->push_back('\t');
        return absl::OkStatus();
      case 'u':
        break;
      default:
        return SyntaxError(start, absl::StrCat("invalid escape ", Quote(s_.substr(start, 2))));
    }
    uint32_t cp = 0;
    RETURN_IF_ERROR(ReadHex4(&cp));
    if (cp >= 0xDC00 && cp <= 0xDFFF)
      return SyntaxError(start, "unpaired low surrogate in \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (s_.substr(pos_, 2) != "\\u")
        return SyntaxError(start, "high surrogate not followed by a \\u low surrogate");
      pos_ += 2;
      uint32_t lo = 0;
      RETURN_IF_ERROR(ReadHex4(&lo));
      if (lo < 0xDC00 || lo > 0xDFFF)
        return SyntaxError(start, "high surrogate not followed by a low surrogate");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    AppendUtf8(cp, out);
    return absl::OkStatus();
  }

  absl::string_view s_;
  std::string context_;
  size_t pos_ = 0;
};

constexpr absl::string_view kMetadataKey = "__metadata__";

uint64_t LoadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// ---- writing helpers
// ------------------------------------------------------------------------------

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (char ch : s) {
    const uint8_t c = static_cast<uint8_t>(ch);
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      default:
        if (c < 0x20) {
          static constexpr char kHex[] = "0123456789abcdef";
          out->append("\\u00");
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 15]);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

}  // namespace

// ---- SafetensorsEntry / SafetensorsFile
// ----------------------------------------------------------

uint64_t SafetensorsEntry::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::string_view SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kF64:
      return "F64";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kI8:
      return "I8";
    case DType::kI16:
      return "I16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
    case DType::kU16:
      return "U16";
    case DType::kU32:
      return "U32";
    case DType::kU64:
      return "U64";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

absl::StatusOr<size_t> SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", Quote(name)));
  }
  return it->second;
}

std::span<const uint8_t> SafetensorsFile::data(size_t i) const {
  const SafetensorsEntry& e = tensors_[i];
  return image_.subspan(static_cast<size_t>(e.offset), static_cast<size_t>(e.size));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(const UniqueFd fd, OpenRegularFile(path));
  return FromFd(fd.get(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::OpenBeneath(const std::string& path,
                                                             std::span<const std::string> roots,
                                                             absl::string_view roots_field) {
  ASSIGN_OR_RETURN(const UniqueFd fd, OpenRegularFileBeneath(path, roots, roots_field));
  return FromFd(fd.get(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromFd(int fd, const std::string& path,
                                                        int read_threads) {
  SafetensorsFile f;
  f.path_ = path;
  ASSIGN_OR_RETURN(f.file_, ReadWholeFileImage(fd, path, read_threads));
  f.image_ = {f.file_.data(), static_cast<size_t>(f.file_.size())};
  RETURN_IF_ERROR(f.Parse());
  return f;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::vector<uint8_t> bytes,
                                                           std::string name) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  f.owned_ = std::move(bytes);
  f.image_ = f.owned_;
  RETURN_IF_ERROR(f.Parse());
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
absl::StatusOr<uint64_t> ReadHeaderLength(std::span<const uint8_t> file,
                                          const std::string& path) {
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
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": the header length field exceeds the file size of ", file.size(),
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
  RETURN_IF_ERROR(r.Expect('{', "'{'"));
  bool first = true;
  std::string key, value;
  size_t key_pos = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &key, &key_pos));
    if (!more) return absl::OkStatus();
    if (r.Peek() != '"') {
      return r.Error(r.pos(), absl::StrCat("\"__metadata__\" value for ", Quote(key),
                                           " must be a string, found ", r.DescribeNext()));
    }
    RETURN_IF_ERROR(r.ReadString(&value));
    if (!metadata->emplace(key, value).second) {
      return r.Error(key_pos, absl::StrCat("duplicate \"__metadata__\" key ", Quote(key)));
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
    return r.Error(at, absl::StrCat(where, ": field \"", field, "\": ", what));
  }
};

absl::Status ParseDTypeField(JsonReader& r, size_t value_pos, TensorFields& t) {
  if (r.Peek() != '"') {
    return t.Error(r, "dtype", value_pos,
                   absl::StrCat("expected a string, found ", r.DescribeNext()));
  }
  std::string text;
  RETURN_IF_ERROR(r.ReadString(&text));
  auto dt = ParseDType(text);
  if (!dt.ok() || SafetensorsDTypeName(*dt) != text) {
    return t.Error(r, "dtype", value_pos,
                   absl::StrCat("unknown or unsupported dtype ", Quote(text),
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
  RETURN_IF_ERROR(r.Expect('[', "'['"));
  std::vector<int64_t>& shape = t.entry.shape;
  bool first = true;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r.NextElement(&first));
    if (!more) return absl::OkStatus();
    if (shape.size() >= static_cast<size_t>(kSafetensorsMaxRank)) {
      return t.Error(r, "shape", value_pos,
                     absl::StrCat("more than ", kSafetensorsMaxRank, " dimensions"));
    }
    uint64_t d;
    RETURN_IF_ERROR(r.ReadUint64(&d, absl::StrCat(t.where, ": shape dimension ", shape.size())));
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
  RETURN_IF_ERROR(r.Expect('[', "'['"));
  bool first = true;
  int count = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r.NextElement(&first));
    if (!more) break;
    if (count == 2) return t.Error(r, "data_offsets", value_pos, "more than two offsets");
    RETURN_IF_ERROR(r.ReadUint64(count == 0 ? &t.range.begin : &t.range.end,
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
    ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &field, &field_pos));
    if (!more) break;
    r.SkipWhitespace();
    const size_t value_pos = r.pos();
    bool* seen = field == "dtype"          ? &t.have_dtype
                 : field == "shape"        ? &t.have_shape
                 : field == "data_offsets" ? &t.have_offsets
                                           : nullptr;
    if (seen == nullptr) {
      return r.Error(field_pos, absl::StrCat(t.where, ": unknown field ", Quote(field),
                                             " (expected dtype, shape, data_offsets)"));
    }
    if (*seen) return t.Error(r, field, field_pos, "duplicate field");
    *seen = true;
    RETURN_IF_ERROR(field == "dtype"   ? ParseDTypeField(r, value_pos, t)
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
    return t.Error(r, "data_offsets", t.offsets_pos,
                   absl::StrCat("[", begin, ", ", end, ") holds ", end - begin, " bytes but shape ",
                                "and dtype ", SafetensorsDTypeName(t.entry.dtype), " need ",
                                bytes));
  }
  t.entry.offset = data.start + begin;
  t.entry.size = end - begin;
  return absl::OkStatus();
}

// One "name": {dtype, shape, data_offsets} member, appended to `out`.
absl::Status ParseTensorEntry(JsonReader& r, const std::string& name, size_t key_pos,
                              const DataRegion& data, ParsedHeader& out) {
  TensorFields t;
  t.where = absl::StrCat("tensor ", Quote(name));
  if (out.index.contains(name))
    return r.Error(key_pos, absl::StrCat(t.where, ": duplicate tensor name"));
  if (r.Peek() != '{') {
    return r.Error(r.pos(),
                   absl::StrCat(t.where, ": expected an object, found ", r.DescribeNext()));
  }
  RETURN_IF_ERROR(r.Expect('{', "'{'"));
  t.entry.name = name;
  RETURN_IF_ERROR(ParseTensorFields(r, key_pos, t));
  RETURN_IF_ERROR(CheckTensorExtent(r, data, t));
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
  RETURN_IF_ERROR(r.Expect('{', "'{'"));
  ParsedHeader out;
  bool seen_metadata = false;
  bool first = true;
  std::string key;
  size_t key_pos = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &key, &key_pos));
    if (!more) break;
    if (key != kMetadataKey) {
      RETURN_IF_ERROR(ParseTensorEntry(r, key, key_pos, data, out));
      continue;
    }
    if (seen_metadata) return r.Error(key_pos, "duplicate \"__metadata__\"");
    seen_metadata = true;
    RETURN_IF_ERROR(ParseMetadata(r, &out.metadata));
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
    const std::string where =
        absl::StrCat(path, ": tensor ", Quote(h.tensors[order[k]].name), ": data_offsets [",
                     rg.begin, ", ", rg.end, ")");
    if (rg.begin < covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " overlaps tensor ", Quote(h.tensors[order[k - 1]].name),
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
  ASSIGN_OR_RETURN(header_size_, ReadHeaderLength(image_, path_));
  DataRegion data;
  data.start = 8 + header_size_;
  data.size = image_.size() - data.start;
  const absl::string_view header(reinterpret_cast<const char*>(image_.data() + 8), header_size_);
  JsonReader r(header, path_);
  ASSIGN_OR_RETURN(ParsedHeader h, ParseHeaderObject(r, data));
  RETURN_IF_ERROR(CheckTiling(path_, h, data.size));
  tensors_ = std::move(h.tensors);
  index_ = std::move(h.index);
  metadata_ = std::move(h.metadata);
  return absl::OkStatus();
}

// ---- writing
// --------------------------------------------------------------------------------------

namespace {

// Appends one tensor's header entry; checks the name, dtype, shape and data size.
absl::Status AppendTensorHeader(const std::string& path, const SafetensorsTensorRef& t,
                                uint64_t* offset, std::string* header) {
  const std::string where = absl::StrCat("write ", path, ": tensor ", Quote(t.name));
  if (t.name == kMetadataKey)
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
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape and dtype ", SafetensorsDTypeName(t.dtype), " need ", bytes,
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
    AppendJsonString(kMetadataKey, &header);
    header += ":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return absl::InvalidArgumentError(absl::StrCat("write ", path, ": metadata key ", Quote(k),
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
          absl::StrCat("write ", path, ": tensor ", Quote(t.name), ": duplicate name"));
    }
    RETURN_IF_ERROR(AppendTensorHeader(path, t, &offset, &header));
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
  ASSIGN_OR_RETURN(const std::string header, BuildHeader(path, tensors, metadata));
  ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path, options));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  RETURN_IF_ERROR(file.Write(len));
  RETURN_IF_ERROR(
      file.Write({reinterpret_cast<const uint8_t*>(header.data()), header.size()}));
  for (const SafetensorsTensorRef& t : tensors) RETURN_IF_ERROR(file.Write(t.data));
  return file.Commit();
}

}  // namespace refit::model
