// The strict JSON pull reader of safetensors headers (safetensors_reader.cc's parser), with the
// UTF-8 checks it makes. Internal to daemon/model: the reader drives it with the schema it
// expects.
#ifndef REFIT_DAEMON_MODEL_STRICT_JSON_READER_H_
#define REFIT_DAEMON_MODEL_STRICT_JSON_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors_format.h"

namespace refit::model::internal {

// ---- UTF-8
// -----------------------------------------------------------------------------------------

// Length of the valid UTF-8 sequence starting at s[i] (1-4), or 0 if it is not valid (overlong
// forms, surrogates and code points past U+10FFFF are invalid).
inline size_t Utf8SequenceLength(absl::string_view s, size_t i) {
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

inline void AppendUtf8(uint32_t cp, std::string* out) {
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
      case '{': return "an object";
      case '[': return "an array";
      case '"': return "a string";
      case 't':
      case 'f': return "a boolean";
      case 'n': return "null";
      default: break;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return "a number";
    return absl::StrCat("unexpected character ", Quoted(absl::string_view(&s_[pos_], 1)));
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
    if (!*first) REFIT_RETURN_IF_ERROR(Expect(',', "',' or '}' in object"));
    *first = false;
    if (Peek() != '"')
      return SyntaxError(pos_, absl::StrCat("expected a string key, found ", DescribeNext()));
    *key_pos = pos_;
    REFIT_RETURN_IF_ERROR(ReadString(key));
    REFIT_RETURN_IF_ERROR(Expect(':', "':' after object key"));
    return true;
  }

  // Array iteration: call with first = true before the first element; returns false after ']'.
  absl::StatusOr<bool> NextElement(bool* first) {
    if (Peek() == ']') {
      ++pos_;
      return false;
    }
    if (!*first) REFIT_RETURN_IF_ERROR(Expect(',', "',' or ']' in array"));
    *first = false;
    return true;
  }

  absl::Status ReadString(std::string* out) {
    out->clear();
    REFIT_RETURN_IF_ERROR(Expect('"', "a string"));
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
        REFIT_RETURN_IF_ERROR(ReadEscape(out));
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
      case '"': out->push_back('"'); return absl::OkStatus();
      case '\\': out->push_back('\\'); return absl::OkStatus();
      case '/': out->push_back('/'); return absl::OkStatus();
      case 'b': out->push_back('\b'); return absl::OkStatus();
      case 'f': out->push_back('\f'); return absl::OkStatus();
      case 'n': out->push_back('\n'); return absl::OkStatus();
      case 'r': out->push_back('\r'); return absl::OkStatus();
      case 't': out->push_back('\t'); return absl::OkStatus();
      case 'u': break;
      default:
        return SyntaxError(start, absl::StrCat("invalid escape ", Quoted(s_.substr(start, 2))));
    }
    uint32_t cp = 0;
    REFIT_RETURN_IF_ERROR(ReadHex4(&cp));
    if (cp >= 0xDC00 && cp <= 0xDFFF)
      return SyntaxError(start, "unpaired low surrogate in \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (s_.substr(pos_, 2) != "\\u")
        return SyntaxError(start, "high surrogate not followed by a \\u low surrogate");
      pos_ += 2;
      uint32_t lo = 0;
      REFIT_RETURN_IF_ERROR(ReadHex4(&lo));
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

}  // namespace refit::model::internal

#endif  // REFIT_DAEMON_MODEL_STRICT_JSON_READER_H_
