#include "daemon/config/yaml_proto.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "refit/v1/options.pb.h"

namespace refit::config {
namespace {

// How much of a value from the file an error shows (Quoted cuts the rest).
constexpr size_t kValueShown = 80;

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

const v1::FieldRules& RulesOf(const FieldDescriptor* f) {
  return f->options().GetExtension(v1::rules);
}

std::string JoinPath(const std::string& path, absl::string_view name) {
  return path.empty() ? std::string(name) : absl::StrCat(path, ".", name);
}

SourceMap::Location LocationOf(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  if (mark.is_null()) return {};
  return {mark.line + 1, mark.column + 1};
}

// ---- names for messages --------------------------------------------------------------------

// The enum's value prefix ("LOG_LEVEL_" for LogLevel): taken from its FOO_UNSPECIFIED value
// (the style guide's zero value), else the longest '_'-terminated prefix all values share.
std::string EnumPrefix(const EnumDescriptor* e) {
  const std::string& zero = e->value(0)->name();
  constexpr absl::string_view kUnspecified = "UNSPECIFIED";
  if (absl::EndsWith(zero, absl::StrCat("_", kUnspecified))) {
    return zero.substr(0, zero.size() - kUnspecified.size());
  }
  std::string common = zero;
  for (int i = 1; i < e->value_count(); ++i) {
    const std::string& name = e->value(i)->name();
    size_t n = 0;
    while (n < common.size() && n < name.size() && common[n] == name[n]) ++n;
    common.resize(n);
  }
  const size_t underscore = common.rfind('_');
  return e->value_count() > 1 && underscore != std::string::npos ? common.substr(0, underscore + 1)
                                                                 : std::string();
}

bool IsUnspecified(const EnumValueDescriptor* v) {
  return v->number() == 0 && absl::EndsWith(v->name(), "_UNSPECIFIED");
}

// Short lower-case name of an enum value ("LOG_LEVEL_INFO" -> "info").
std::string ShortName(const EnumValueDescriptor* v) {
  const std::string prefix = EnumPrefix(v->type());
  absl::string_view name = v->name();
  absl::ConsumePrefix(&name, prefix);
  return absl::AsciiStrToLower(name);
}

std::string EnumChoices(const EnumDescriptor* e) {
  std::vector<std::string> names;
  for (int i = 0; i < e->value_count(); ++i) {
    if (!IsUnspecified(e->value(i))) names.push_back(ShortName(e->value(i)));
  }
  return absl::StrJoin(names, ", ");
}

std::string Expected(const FieldDescriptor* f) {
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return "a 32-bit integer";
    case FieldDescriptor::CPPTYPE_INT64: return "a 64-bit integer";
    case FieldDescriptor::CPPTYPE_UINT32: return "an unsigned 32-bit integer";
    case FieldDescriptor::CPPTYPE_UINT64: return "an unsigned 64-bit integer";
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT: return "a number";
    case FieldDescriptor::CPPTYPE_BOOL: return "true or false";
    case FieldDescriptor::CPPTYPE_STRING: return "a string";
    case FieldDescriptor::CPPTYPE_ENUM:
      return absl::StrCat("one of: ", EnumChoices(f->enum_type()));
    case FieldDescriptor::CPPTYPE_MESSAGE: return "a mapping";
  }
  return "a value";
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a sequence";
    case YAML::NodeType::Scalar:
      return node.Tag() == "!"
                 ? absl::StrCat("the quoted string ", Quoted(node.Scalar(), kValueShown))
                 : Quoted(node.Scalar(), kValueShown);
    case YAML::NodeType::Undefined: break;
  }
  return "nothing";
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// ---- scalars ---------------------------------------------------------------------------------

bool IsDecimalInteger(absl::string_view s) {
  absl::ConsumePrefix(&s, "-");
  return !s.empty() && std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
}

bool IsDecimalNumber(absl::string_view s) {
  // [-+]? (digits [. digits?] | . digits) ([eE] [-+]? digits)?
  size_t i = 0;
  auto digits = [&] {
    const size_t start = i;
    while (i < s.size() && absl::ascii_isdigit(s[i])) ++i;
    return i - start;
  };
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
  size_t mantissa = digits();
  if (i < s.size() && s[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
    if (digits() == 0) return false;
  }
  return i == s.size();
}

template <typename T>
absl::Status CheckIntegerRules(const FieldDescriptor* f, T value) {
  const v1::FieldRules& rules = RulesOf(f);
  T lo = std::numeric_limits<T>::min(), hi = std::numeric_limits<T>::max();
  if (rules.has_min() && !absl::SimpleAtoi(rules.min(), &lo)) {
    return absl::InternalError(absl::StrCat("schema: bad min ", Quoted(rules.min())));
  }
  if (rules.has_max() && !absl::SimpleAtoi(rules.max(), &hi)) {
    return absl::InternalError(absl::StrCat("schema: bad max ", Quoted(rules.max())));
  }
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat(value, " is out of range [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<T> ParseInteger(const FieldDescriptor* f, absl::string_view text) {
  if (!IsDecimalInteger(text)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", Expected(f), " (decimal digits), got ", Quoted(text, kValueShown)));
  }
  T value{};
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(text, " is out of range for ", Expected(f), " [",
                                                   std::numeric_limits<T>::min(), ", ",
                                                   std::numeric_limits<T>::max(), "]"));
  }
  REFIT_RETURN_IF_ERROR(CheckIntegerRules<T>(f, value));
  return value;
}

absl::StatusOr<double> ParseDouble(const FieldDescriptor* f, absl::string_view text) {
  double value = 0;
  if (!IsDecimalNumber(text) || !absl::SimpleAtod(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a decimal number, got ", Quoted(text, kValueShown)));
  }
  if (!std::isfinite(value) || (f->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT &&
                                std::fabs(value) > std::numeric_limits<float>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(text, " is out of range"));
  }
  const v1::FieldRules& rules = RulesOf(f);
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  if ((rules.has_min() && !absl::SimpleAtod(rules.min(), &lo)) ||
      (rules.has_max() && !absl::SimpleAtod(rules.max(), &hi))) {
    return absl::InternalError("schema: bad min/max");
  }
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(text, " is out of range [", rules.min(), ", ", rules.max(), "]"));
  }
  return value;
}

absl::StatusOr<const EnumValueDescriptor*> ParseEnum(const FieldDescriptor* f,
                                                     absl::string_view text) {
  const EnumDescriptor* e = f->enum_type();
  for (int i = 0; i < e->value_count(); ++i) {
    const EnumValueDescriptor* v = e->value(i);
    if (IsUnspecified(v)) continue;
    if (text == v->name() || absl::EqualsIgnoreCase(text, ShortName(v))) return v;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown value ", Quoted(text, kValueShown),
                                                 "; expected one of: ", EnumChoices(e)));
}

enum class Style { kPlain, kQuoted };

// Sets (or, for repeated fields, appends) one scalar. Errors carry no location or path.
absl::Status SetScalar(Message* msg, const FieldDescriptor* f, absl::string_view text,
                       Style style) {
  const Reflection* r = msg->GetReflection();
  const bool add = f->is_repeated();
  const auto cpp = f->cpp_type();
  const bool numeric =
      cpp == FieldDescriptor::CPPTYPE_INT32 || cpp == FieldDescriptor::CPPTYPE_INT64 ||
      cpp == FieldDescriptor::CPPTYPE_UINT32 || cpp == FieldDescriptor::CPPTYPE_UINT64 ||
      cpp == FieldDescriptor::CPPTYPE_DOUBLE || cpp == FieldDescriptor::CPPTYPE_FLOAT ||
      cpp == FieldDescriptor::CPPTYPE_BOOL;
  if (numeric && style == Style::kQuoted) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", Expected(f), ", got the quoted string ",
                     Quoted(text, kValueShown), " (remove the quotes)"));
  }
  switch (cpp) {
    case FieldDescriptor::CPPTYPE_INT32: {
      REFIT_ASSIGN_OR_RETURN(const int32_t v, ParseInteger<int32_t>(f, text));
      add ? r->AddInt32(msg, f, v) : r->SetInt32(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      REFIT_ASSIGN_OR_RETURN(const int64_t v, ParseInteger<int64_t>(f, text));
      add ? r->AddInt64(msg, f, v) : r->SetInt64(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      REFIT_ASSIGN_OR_RETURN(const uint32_t v, ParseInteger<uint32_t>(f, text));
      add ? r->AddUInt32(msg, f, v) : r->SetUInt32(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      REFIT_ASSIGN_OR_RETURN(const uint64_t v, ParseInteger<uint64_t>(f, text));
      add ? r->AddUInt64(msg, f, v) : r->SetUInt64(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      REFIT_ASSIGN_OR_RETURN(const double v, ParseDouble(f, text));
      add ? r->AddDouble(msg, f, v) : r->SetDouble(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      REFIT_ASSIGN_OR_RETURN(const double v, ParseDouble(f, text));
      add ? r->AddFloat(msg, f, static_cast<float>(v)) : r->SetFloat(msg, f, static_cast<float>(v));
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      if (text != "true" && text != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("expected true or false, got ", Quoted(text, kValueShown)));
      }
      add ? r->AddBool(msg, f, text == "true") : r->SetBool(msg, f, text == "true");
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string v(text);
      if (RulesOf(f).required() && !f->is_repeated() && v.empty()) {
        return absl::InvalidArgumentError("must not be empty");
      }
      add ? r->AddString(msg, f, std::move(v)) : r->SetString(msg, f, std::move(v));
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      REFIT_ASSIGN_OR_RETURN(const EnumValueDescriptor* v, ParseEnum(f, text));
      add ? r->AddEnum(msg, f, v) : r->SetEnum(msg, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return absl::InternalError("SetScalar on a message field");
  }
  return absl::OkStatus();
}

// ---- YAML -> message ---------------------------------------------------------------------------

class Walker {
 public:
  explicit Walker(SourceMap* source_map) : map_(source_map) {}

  absl::Status MapMessage(const YAML::Node& node, Message* msg, const std::string& path) {
    if (!node.IsMap())
      return Error(node, path, absl::StrCat("expected a mapping, got ", Describe(node)));
    const Descriptor* desc = msg->GetDescriptor();
    absl::flat_hash_map<std::string, int> first_line;
    for (auto it = node.begin(); it != node.end(); ++it) {
      // Copies: the iterator's pair is a temporary (Nodes are cheap handles).
      const YAML::Node key = it->first;
      const YAML::Node value = it->second;
      if (!key.IsScalar()) {
        return Error(key, path.empty() ? "<root>" : path,
                     absl::StrCat("keys must be names, got ", Describe(key)));
      }
      const std::string& name = key.Scalar();
      const std::string fpath = JoinPath(path, name);
      const int line = LocationOf(key).line;
      if (auto [seen, inserted] = first_line.emplace(name, line); !inserted) {
        return Error(key, fpath, absl::StrCat("duplicate key (first at line ", seen->second, ")"));
      }
      const FieldDescriptor* f = desc->FindFieldByName(name);
      if (f == nullptr) return Error(key, fpath, UnknownKey(desc, name));
      if (f->is_map())
        return absl::InternalError(absl::StrCat(fpath, ": map fields are unsupported"));
      if (const auto* oneof = f->real_containing_oneof(); oneof != nullptr) {
        if (const FieldDescriptor* set = msg->GetReflection()->GetOneofFieldDescriptor(*msg, oneof);
            set != nullptr) {
          return Error(key, fpath,
                       absl::StrCat("cannot be combined with '", set->name(),
                                    "' (only one of them may be set)"));
        }
      }
      // Null values have no useful mark of their own: point at the key then.
      map_->Set(fpath, LocationOf(value.IsNull() ? key : value));
      REFIT_RETURN_IF_ERROR(SetField(value, key, msg, f, fpath));
    }
    // Required keys of this (present) message.
    for (int i = 0; i < desc->field_count(); ++i) {
      const FieldDescriptor* f = desc->field(i);
      if (!RulesOf(f).required()) continue;
      const bool present = f->is_repeated() ? msg->GetReflection()->FieldSize(*msg, f) > 0
                                            : msg->GetReflection()->HasField(*msg, f);
      if (!present && !first_line.contains(f->name())) {
        return Error(node, JoinPath(path, f->name()), "required key is missing");
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status SetField(const YAML::Node& value, const YAML::Node& key, Message* msg,
                        const FieldDescriptor* f, const std::string& path) {
    const Reflection* r = msg->GetReflection();
    if (f->is_repeated()) {
      if (!value.IsSequence()) {
        return Error(
            value.IsNull() ? key : value, path,
            absl::StrCat("expected a sequence of ", ElementName(f), ", got ", Describe(value)));
      }
      size_t i = 0;
      for (auto it = value.begin(); it != value.end(); ++it, ++i) {
        const YAML::Node element = *it;
        const std::string epath = absl::StrCat(path, "[", i, "]");
        map_->Set(epath, LocationOf(element));
        if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          REFIT_RETURN_IF_ERROR(MapMessage(element, r->AddMessage(msg, f), epath));
        } else {
          REFIT_RETURN_IF_ERROR(Scalar(element, element, msg, f, epath));
        }
      }
      if (i == 0 && RulesOf(f).required()) return Error(value, path, "must not be empty");
      return absl::OkStatus();
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (value.IsNull()) {
        return Error(key, path, "expected a mapping, got null (write {} for an empty one)");
      }
      return MapMessage(value, r->MutableMessage(msg, f), path);
    }
    return Scalar(value, key, msg, f, path);
  }

  absl::Status Scalar(const YAML::Node& value, const YAML::Node& key, Message* msg,
                      const FieldDescriptor* f, const std::string& path) {
    if (!value.IsScalar()) {
      std::string hint;
      if (value.IsNull() && f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        hint = " (write \"\" for an empty string)";
      }
      return Error(value.IsNull() ? key : value, path,
                   absl::StrCat("expected ", Expected(f), ", got ", Describe(value), hint));
    }
    Style style;
    if (value.Tag() == "?") {
      style = Style::kPlain;
    } else if (value.Tag() == "!") {
      style = Style::kQuoted;
    } else {
      return Error(value, path,
                   absl::StrCat("explicit YAML tags are not supported (", value.Tag(), ")"));
    }
    absl::Status s = SetScalar(msg, f, value.Scalar(), style);
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kInternal) {
        return AnnotateAs(absl::StatusCode::kInternal, s, path);
      }
      return Error(value, path, s.message());
    }
    return absl::OkStatus();
  }

  static std::string ElementName(const FieldDescriptor* f) {
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE: return "mappings";
      case FieldDescriptor::CPPTYPE_STRING: return "strings";
      case FieldDescriptor::CPPTYPE_ENUM: return "names";
      case FieldDescriptor::CPPTYPE_BOOL: return "booleans";
      default: return "numbers";
    }
  }

  static std::string UnknownKey(const Descriptor* desc, const std::string& name) {
    std::vector<std::string> names;
    std::string best;
    size_t best_distance = 3;  // suggest only close matches
    for (int i = 0; i < desc->field_count(); ++i) {
      const std::string& candidate = desc->field(i)->name();
      names.push_back(candidate);
      const size_t d = EditDistance(absl::AsciiStrToLower(name), candidate);
      if (d < best_distance) {
        best_distance = d;
        best = candidate;
      }
    }
    return absl::StrCat("unknown key",
                        best.empty() ? "" : absl::StrCat(" (did you mean ", Quoted(best), "?)"),
                        "; expected one of: ", absl::StrJoin(names, ", "));
  }

  absl::Status Error(const YAML::Node& at, const std::string& path, absl::string_view what) {
    const SourceMap::Location loc = LocationOf(at);
    std::string where = map_->source_name();
    if (loc.line > 0) absl::StrAppend(&where, ":", loc.line, ":", loc.column);
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", path, ": ", what));
  }

  SourceMap* map_;
};

// ---- message -> YAML ---------------------------------------------------------------------------

// A string as a YAML double-quoted scalar that reads back to the same bytes: the emitter's
// serializer, not a display escaper (Printable/Quoted escape for people and may change bytes
// that are not UTF-8; this keeps every byte, escaping only what YAML requires).
std::string YamlQuote(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

std::string FormatDouble(double v) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

std::string ScalarText(const Message& msg, const FieldDescriptor* f, int index) {
  const Reflection* r = msg.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(msg, f, index) : r->GetInt32(msg, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r->GetRepeatedInt64(msg, f, index) : r->GetInt64(msg, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(msg, f, index) : r->GetUInt32(msg, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r->GetRepeatedUInt64(msg, f, index) : r->GetUInt64(msg, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FormatDouble(rep ? r->GetRepeatedDouble(msg, f, index) : r->GetDouble(msg, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FormatDouble(rep ? r->GetRepeatedFloat(msg, f, index) : r->GetFloat(msg, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(msg, f, index) : r->GetBool(msg, f)) ? "true" : "false";
    case FieldDescriptor::CPPTYPE_STRING:
      return YamlQuote(rep ? r->GetRepeatedString(msg, f, index) : r->GetString(msg, f));
    case FieldDescriptor::CPPTYPE_ENUM: {
      const EnumValueDescriptor* v = rep ? r->GetRepeatedEnum(msg, f, index) : r->GetEnum(msg, f);
      return IsUnspecified(v) ? v->name() : ShortName(v);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
  return "";
}

void EmitMessage(const Message& msg, int indent, std::string* out) {
  const std::string pad(indent, ' ');
  const Descriptor* desc = msg.GetDescriptor();
  const Reflection* r = msg.GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const FieldDescriptor* f = desc->field(i);
    const bool message = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (f->is_repeated()) {
      const int n = r->FieldSize(msg, f);
      if (n == 0) continue;
      absl::StrAppend(out, pad, f->name(), ":\n");
      for (int j = 0; j < n; ++j) {
        if (message) {
          absl::StrAppend(out, pad, "  -\n");
          EmitMessage(r->GetRepeatedMessage(msg, f, j), indent + 4, out);
        } else {
          absl::StrAppend(out, pad, "  - ", ScalarText(msg, f, j), "\n");
        }
      }
      continue;
    }
    if (!r->HasField(msg, f)) continue;
    if (message) {
      const Message& sub = r->GetMessage(msg, f);
      std::string body;
      EmitMessage(sub, indent + 2, &body);
      absl::StrAppend(out, pad, f->name(), body.empty() ? ": {}\n" : ":\n", body);
    } else {
      absl::StrAppend(out, pad, f->name(), ": ", ScalarText(msg, f, 0), "\n");
    }
  }
}

// Where the root node of each of a stream's documents starts (the first two at most).
class DocumentRoots : public YAML::EventHandler {
 public:
  const std::vector<YAML::Mark>& roots() const { return roots_; }

  void OnDocumentStart(const YAML::Mark&) override { root_seen_ = false; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t) override { Node(mark); }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { Node(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                const std::string&) override {
    Node(mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    Node(mark);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    Node(mark);
  }
  void OnMapEnd() override {}

 private:
  void Node(const YAML::Mark& mark) {
    if (!root_seen_) roots_.push_back(mark);
    root_seen_ = true;
  }
  std::vector<YAML::Mark> roots_;
  bool root_seen_ = false;
};

// A config is one YAML document. Counted with a bounded loop rather than YAML::LoadAll, which in
// yaml-cpp 0.7 loops forever, allocating, on a stray ',' (the parser returns the same empty
// document again and again without consuming it: a yaml-cpp bug). May throw YAML::Exception.
absl::Status CheckOneDocument(const std::string& yaml_text, const std::string& source) {
  std::istringstream in(yaml_text);
  YAML::Parser parser(in);
  DocumentRoots docs;
  while (docs.roots().size() < 2 && parser.HandleNextDocument(docs)) {
  }
  if (docs.roots().size() < 2) return absl::OkStatus();
  const YAML::Mark& second = docs.roots()[1];
  const bool stuck = second.pos == docs.roots()[0].pos;  // no input consumed: not YAML
  return absl::InvalidArgumentError(
      absl::StrCat(source, ":", second.line + 1, ":", second.column + 1,
                   stuck ? ": YAML syntax error: no YAML node can start here"
                         : ": a second YAML document; a config holds exactly one"));
}

// yaml-cpp's message for a syntax error, without file contents: "unknown escape character: "
// ends with the character itself (a line break, a control character, ...); the location says
// where it is.
std::string ParserProblem(const std::string& msg) {
  if (absl::StartsWith(msg, YAML::ErrorMsg::INVALID_ESCAPE)) return "unknown escape character";
  return OneLine(msg);
}

}  // namespace

const SourceMap::Location* SourceMap::Find(const std::string& path) const {
  auto it = locations_.find(path);
  return it == locations_.end() || it->second.line == 0 ? nullptr : &it->second;
}

std::string SourceMap::Prefix(const std::string& path) const {
  // An absent field (a default) points at the nearest enclosing key that is in the source.
  std::string p = path;
  while (!p.empty()) {
    if (const Location* loc = Find(p)) {
      return absl::StrCat(source_name_, ":", loc->line, ":", loc->column, ": ");
    }
    const size_t cut = p.find_last_of(".[");
    p.resize(cut == std::string::npos ? 0 : cut);
  }
  return absl::StrCat(source_name_, ": ");
}

absl::Status ParseYamlInto(const std::string& yaml_text, Message* message, SourceMap* source_map) {
  const std::string& source = source_map->source_name();
  if (yaml_text.size() > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": ", yaml_text.size(), " bytes; a config may be at most ", kMaxConfigBytes));
  }
  try {
    REFIT_RETURN_IF_ERROR(CheckOneDocument(yaml_text, source));
    const YAML::Node doc = YAML::Load(yaml_text);
    if (doc.IsNull()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": the configuration is empty"));
    }
    Walker walker(source_map);
    const absl::Status st = walker.MapMessage(doc, message, "");
    return st.ok() ? st : absl::Status(st.code(), OneLine(st.message()));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": YAML error: ", e.msg));
    }
    return absl::InvalidArgumentError(absl::StrCat(source, ":", e.mark.line + 1, ":",
                                                   e.mark.column + 1, ": YAML syntax error: ",
                                                   ParserProblem(e.msg)));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": cannot parse YAML: ", e.what()));
  }
}

absl::Status ApplyDefaults(Message* message) {
  const Descriptor* desc = message->GetDescriptor();
  const Reflection* r = message->GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const FieldDescriptor* f = desc->field(i);
    const v1::FieldRules& rules = RulesOf(f);
    if (f->is_repeated()) {
      if (rules.has_default_value()) {
        return absl::InternalError(
            absl::StrCat("schema: repeated field ", f->full_name(), " has a default"));
      }
      continue;
    }
    if (f->real_containing_oneof() != nullptr) continue;
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      REFIT_RETURN_IF_ERROR(ApplyDefaults(r->MutableMessage(message, f)));
      continue;
    }
    if (!rules.has_default_value() || r->HasField(*message, f)) continue;
    if (!f->has_presence()) {
      return absl::InternalError(absl::StrCat("schema: field ", f->full_name(),
                                              " has a default but no presence (make it optional)"));
    }
    absl::Status s = SetScalar(message, f, rules.default_value(), Style::kPlain);
    if (!s.ok()) {
      return AnnotateAs(absl::StatusCode::kInternal, s, "schema: default of ", f->full_name(), " (",
                        rules.default_value(), ")");
    }
  }
  return absl::OkStatus();
}

std::string MessageToYaml(const Message& message) {
  std::string out;
  EmitMessage(message, 0, &out);
  return out;
}

}  // namespace refit::config
