#include "daemon/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
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

std::string ErrnoText(int err) { return std::strerror(err); }

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

absl::Status WriteAll(int fd, const uint8_t* p, size_t n, const std::string& what) {
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("write ", what, ": ", ErrnoText(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
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

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    Release();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    owned_ = std::move(o.owned_);
    header_size_ = std::exchange(o.header_size_, 0);
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
    o.owned_.clear();
    o.tensors_.clear();
    o.index_.clear();
    o.metadata_.clear();
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Release(); }

void SafetensorsFile::Release() {
  if (map_ != nullptr) ::munmap(map_, size_);
  map_ = nullptr;
}

const uint8_t* SafetensorsFile::base() const {
  return map_ != nullptr ? static_cast<const uint8_t*>(map_) : owned_.data();
}

std::span<const uint8_t> SafetensorsFile::data(size_t i) const {
  const SafetensorsEntry& e = tensors_[i];
  return {base() + e.offset, static_cast<size_t>(e.size)};
}

absl::StatusOr<size_t> SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named ", Quote(name)));
  }
  return it->second;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("open ", path, ": ", ErrnoText(err));
    return err == ENOENT   ? absl::NotFoundError(msg)
           : err == EACCES ? absl::PermissionDeniedError(msg)
                           : absl::InvalidArgumentError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("stat ", path, ": ", ErrnoText(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  SafetensorsFile f;
  f.path_ = path;
  f.size_ = static_cast<uint64_t>(st.st_size);
  if (f.size_ > 0) {
    void* m = ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(
          absl::StrCat("mmap ", path, " (", f.size_, " bytes): ", ErrnoText(err)));
    }
    f.map_ = m;
  }
  ::close(fd);
  RETURN_IF_ERROR(f.Parse());
  return f;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::vector<uint8_t> bytes,
                                                           std::string name) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  f.size_ = bytes.size();
  f.owned_ = std::move(bytes);
  RETURN_IF_ERROR(f.Parse());
  return f;
}

absl::Status SafetensorsFile::Parse() {
  if (size_ < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": file is ", size_, " bytes, too short for the 8-byte safetensors header length"));
  }
  const uint64_t n = LoadLE64(base());
  if (n > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header length ", n,
                                                   " exceeds the limit of ",
                                                   kSafetensorsMaxHeaderBytes, " bytes (100 MiB)"));
  }
  if (n > size_ - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": header length ", n, " is larger than the rest of the file (",
                     size_ - 8, " bytes after the length field): truncated?"));
  }
  header_size_ = n;
  const uint64_t data_start = 8 + n;
  const uint64_t data_len = size_ - data_start;
  const absl::string_view header(reinterpret_cast<const char*>(base() + 8), n);

  JsonReader r(header, path_);
  if (r.Peek() != '{') {
    return r.Error(r.pos(),
                   absl::StrCat("the header must be a JSON object, found ", r.DescribeNext()));
  }
  RETURN_IF_ERROR(r.Expect('{', "'{'"));
  struct Range {
    uint64_t begin, end;
  };
  std::vector<Range> ranges;
  bool seen_metadata = false;
  bool first = true;
  std::string key;
  size_t key_pos = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r.NextMember(&first, &key, &key_pos));
    if (!more) break;
    if (key == kMetadataKey) {
      if (seen_metadata) return r.Error(key_pos, "duplicate \"__metadata__\"");
      seen_metadata = true;
      if (r.Peek() == 'n') {  // "__metadata__": null is accepted, as by the reference reader
        RETURN_IF_ERROR(r.ReadLiteral("null"));
        continue;
      }
      if (r.Peek() != '{') {
        return r.Error(r.pos(),
                       absl::StrCat("\"__metadata__\" must be an object of strings, found ",
                                    r.DescribeNext()));
      }
      RETURN_IF_ERROR(r.Expect('{', "'{'"));
      bool mfirst = true;
      std::string mkey, mval;
      size_t mkey_pos = 0;
      while (true) {
        ASSIGN_OR_RETURN(bool mmore, r.NextMember(&mfirst, &mkey, &mkey_pos));
        if (!mmore) break;
        if (r.Peek() != '"') {
          return r.Error(r.pos(), absl::StrCat("\"__metadata__\" value for ", Quote(mkey),
                                               " must be a string, found ", r.DescribeNext()));
        }
        RETURN_IF_ERROR(r.ReadString(&mval));
        if (!metadata_.emplace(mkey, mval).second) {
          return r.Error(mkey_pos, absl::StrCat("duplicate \"__metadata__\" key ", Quote(mkey)));
        }
      }
      continue;
    }

    // A tensor entry.
    const std::string where = absl::StrCat("tensor ", Quote(key));
    auto field_error = [&](absl::string_view field, size_t at, absl::string_view what) {
      return r.Error(at, absl::StrCat(where, ": field \"", field, "\": ", what));
    };
    if (index_.contains(key))
      return r.Error(key_pos, absl::StrCat(where, ": duplicate tensor name"));
    if (r.Peek() != '{') {
      return r.Error(r.pos(),
                     absl::StrCat(where, ": expected an object, found ", r.DescribeNext()));
    }
    RETURN_IF_ERROR(r.Expect('{', "'{'"));
    SafetensorsEntry e;
    e.name = key;
    bool have_dtype = false, have_shape = false, have_offsets = false;
    uint64_t begin = 0, end = 0;
    size_t offsets_pos = 0, shape_pos = 0;
    bool efirst = true;
    std::string field, text;
    size_t field_pos = 0;
    while (true) {
      ASSIGN_OR_RETURN(bool emore, r.NextMember(&efirst, &field, &field_pos));
      if (!emore) break;
      r.SkipWhitespace();
      const size_t value_pos = r.pos();
      if (field == "dtype") {
        if (have_dtype) return field_error(field, field_pos, "duplicate field");
        have_dtype = true;
        if (r.Peek() != '"')
          return field_error("dtype", value_pos,
                             absl::StrCat("expected a string, found ", r.DescribeNext()));
        RETURN_IF_ERROR(r.ReadString(&text));
        auto dt = ParseDType(text);
        if (!dt.ok() || SafetensorsDTypeName(*dt) != text) {
          return field_error(
              "dtype", value_pos,
              absl::StrCat("unknown or unsupported dtype ", Quote(text),
                           " (supported: BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 I16 I32 "
                           "I64 U8 U16 U32 U64 BOOL)"));
        }
        e.dtype = *dt;
      } else if (field == "shape") {
        if (have_shape) return field_error(field, field_pos, "duplicate field");
        have_shape = true;
        shape_pos = value_pos;
        if (r.Peek() != '[')
          return field_error("shape", value_pos,
                             absl::StrCat("expected an array, found ", r.DescribeNext()));
        RETURN_IF_ERROR(r.Expect('[', "'['"));
        bool afirst = true;
        while (true) {
          ASSIGN_OR_RETURN(bool amore, r.NextElement(&afirst));
          if (!amore) break;
          if (e.shape.size() >= static_cast<size_t>(kSafetensorsMaxRank)) {
            return field_error("shape", value_pos,
                               absl::StrCat("more than ", kSafetensorsMaxRank, " dimensions"));
          }
          uint64_t d;
          RETURN_IF_ERROR(
              r.ReadUint64(&d, absl::StrCat(where, ": shape dimension ", e.shape.size())));
          if (d > static_cast<uint64_t>(INT64_MAX)) {
            return field_error(
                "shape", value_pos,
                absl::StrCat("dimension ", e.shape.size(), " = ", d, " is too large"));
          }
          e.shape.push_back(static_cast<int64_t>(d));
        }
      } else if (field == "data_offsets") {
        if (have_offsets) return field_error(field, field_pos, "duplicate field");
        have_offsets = true;
        offsets_pos = value_pos;
        if (r.Peek() != '[') {
          return field_error(
              "data_offsets", value_pos,
              absl::StrCat("expected an array of two integers, found ", r.DescribeNext()));
        }
        RETURN_IF_ERROR(r.Expect('[', "'['"));
        bool afirst = true;
        int count = 0;
        while (true) {
          ASSIGN_OR_RETURN(bool amore, r.NextElement(&afirst));
          if (!amore) break;
          if (count == 2) return field_error("data_offsets", value_pos, "more than two offsets");
          RETURN_IF_ERROR(r.ReadUint64(count == 0 ? &begin : &end,
                                       absl::StrCat(where, ": data_offsets[", count, "]")));
          ++count;
        }
        if (count != 2)
          return field_error("data_offsets", value_pos,
                             absl::StrCat("expected [begin, end], got ", count, " value(s)"));
      } else {
        return r.Error(field_pos, absl::StrCat(where, ": unknown field ", Quote(field),
                                               " (expected dtype, shape, data_offsets)"));
      }
    }
    if (!have_dtype || !have_shape || !have_offsets) {
      return r.Error(key_pos, absl::StrCat(where, ": missing field \"",
                                           !have_dtype   ? "dtype"
                                           : !have_shape ? "shape"
                                                         : "data_offsets",
                                           "\""));
    }
    if (begin > end) {
      return field_error("data_offsets", offsets_pos,
                         absl::StrCat("begin ", begin, " > end ", end));
    }
    if (end > data_len) {
      return field_error("data_offsets", offsets_pos,
                         absl::StrCat("[", begin, ", ", end, ") runs past the data region (",
                                      data_len, " bytes): truncated file?"));
    }
    // Bytes implied by the shape, with overflow checks (a zero dimension makes the product 0).
    uint64_t bytes = static_cast<uint64_t>(DTypeSize(e.dtype));
    bool overflow = false;
    const bool empty = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
    for (int64_t d : e.shape)
      overflow |= __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes);
    if (empty) bytes = 0;
    if (!empty && overflow) {
      return field_error("shape", shape_pos,
                         "the number of bytes the shape implies overflows 64 bits");
    }
    if (bytes != end - begin) {
      return field_error(
          "data_offsets", offsets_pos,
          absl::StrCat("[", begin, ", ", end, ") holds ", end - begin, " bytes but shape ",
                       "and dtype ", SafetensorsDTypeName(e.dtype), " need ", bytes));
    }
    e.offset = data_start + begin;
    e.size = end - begin;
    index_.emplace(e.name, tensors_.size());
    tensors_.push_back(std::move(e));
    ranges.push_back({begin, end});
  }
  if (!r.AtEnd()) return r.SyntaxError(r.pos(), "unexpected content after the header object");

  // The tensors must tile the data region: no overlap, no hole, nothing after the last one.
  std::vector<size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ranges[a].begin != ranges[b].begin ? ranges[a].begin < ranges[b].begin
                                              : ranges[a].end < ranges[b].end;
  });
  uint64_t covered = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const Range& rg = ranges[order[k]];
    const std::string& name = tensors_[order[k]].name;
    if (rg.begin < covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": tensor ", Quote(name), ": data_offsets [", rg.begin, ", ", rg.end,
                       ") overlaps tensor ", Quote(tensors_[order[k - 1]].name), " (which ends at ",
                       covered, ")"));
    }
    if (rg.begin > covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": tensor ", Quote(name), ": data_offsets [", rg.begin, ", ", rg.end,
                       ") leaves a hole: bytes [", covered, ", ", rg.begin,
                       ") of the data region belong to no tensor"));
    }
    covered = rg.end;
  }
  if (covered != data_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": the data region is ", data_len, " bytes but the tensors cover only ",
                     covered, " (", data_len - covered, " trailing bytes belong to no tensor)"));
  }
  return absl::OkStatus();
}

// ---- writing
// --------------------------------------------------------------------------------------

absl::Status WriteSafetensors(const std::string& path,
                              std::span<const SafetensorsTensorRef> tensors,
                              const std::map<std::string, std::string>& metadata,
                              bool durable) {
  // Validate and build the header.
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
  absl::flat_hash_map<absl::string_view, size_t> seen;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensorRef& t = tensors[i];
    const std::string where = absl::StrCat("write ", path, ": tensor ", Quote(t.name));
    if (t.name == kMetadataKey)
      return absl::InvalidArgumentError(absl::StrCat(where, ": reserved name"));
    if (!IsValidUtf8(t.name))
      return absl::InvalidArgumentError(absl::StrCat(where, ": name is not valid UTF-8"));
    if (!seen.emplace(t.name, i).second)
      return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate name"));
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
    if (header.size() > 1) header += ',';
    AppendJsonString(t.name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"", SafetensorsDTypeName(t.dtype), "\",\"shape\":[");
    for (size_t k = 0; k < t.shape.size(); ++k) absl::StrAppend(&header, k ? "," : "", t.shape[k]);
    absl::StrAppend(&header, "],\"data_offsets\":[", offset, ",", offset + bytes, "]}");
    offset += bytes;
  }
  header += '}';
  while (header.size() % 8 != 0) header += ' ';
  if (header.size() > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("write ", path, ": header would be ", header.size(),
                     " bytes, over the 100 MiB limit readers accept"));
  }

  // Write a temporary file next to the target, fsync, rename.
  std::string tmp = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("write ", path, ": cannot create a temporary file ",
                                            tmp, ": ", ErrnoText(errno)));
  }
  auto fail = [&](absl::Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  absl::Status s = WriteAll(fd, len, 8, tmp);
  if (s.ok()) s = WriteAll(fd, reinterpret_cast<const uint8_t*>(header.data()), header.size(), tmp);
  for (size_t i = 0; s.ok() && i < tensors.size(); ++i) {
    s = WriteAll(fd, tensors[i].data.data(), tensors[i].data.size(), tmp);
  }
  if (!s.ok()) return fail(s);
  if (::fchmod(fd, 0644) != 0)
    return fail(absl::InternalError(absl::StrCat("chmod ", tmp, ": ", ErrnoText(errno))));
  if (durable && ::fsync(fd) != 0)
    return fail(absl::InternalError(absl::StrCat("fsync ", tmp, ": ", ErrnoText(errno))));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("close ", tmp, ": ", ErrnoText(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("rename ", tmp, " to ", path, ": ", ErrnoText(err)));
  }
  // Make the rename durable.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  const int dfd = durable ? ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

}  // namespace refit::model
