// Strict YAML <-> protobuf mapping through reflection, driven by the schema and by the
// (refit.v1.rules) field options (proto/refit/v1/options.proto): defaults, bounds, required keys.
//
// Mapping: a message is a YAML mapping whose keys are field names; a repeated field is a
// sequence; integers are plain decimal scalars ([-]digits), range-checked against the field's type
// and its rules; floating-point fields take plain decimal numbers (finite); booleans are exactly
// `true` / `false`; strings are any scalar (quote them when YAML would read something else);
// enums are a value's full name (LOG_LEVEL_INFO) or its short name in any case ("info": the
// value name without the enum's UPPER_SNAKE prefix); *_UNSPECIFIED values are not accepted.
// Explicit tags (!!str), null values, unknown keys and duplicate keys are errors.
//
// Every error is one line: "<source>:<line>:<column>: <field path>: <problem>", e.g.
//   publisher.yaml:7:5: publisher.tls.cret: unknown key (did you mean 'cert'?); expected one
//   of: cert, key, ca, allowed_identities, insecure
// No exception escapes: yaml-cpp's are caught and converted.
#ifndef REFIT_DAEMON_CONFIG_YAML_PROTO_H_
#define REFIT_DAEMON_CONFIG_YAML_PROTO_H_

#include <cstddef>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace refit::config {

// Largest config text accepted.
inline constexpr size_t kMaxConfigBytes = 1 << 20;

// Where values came from: field path ("publisher.tls.cert", "subscriber.upstream.addresses[1]")
// -> 1-based line and column in the source, so later (semantic) checks can point at a line too.
class SourceMap {
 public:
  struct Location {
    int line = 0;
    int column = 0;
  };

  explicit SourceMap(std::string source_name = "<config>") : source_name_(std::move(source_name)) {}

  const std::string& source_name() const { return source_name_; }
  void Set(const std::string& path, Location location) { locations_[path] = location; }
  // nullptr when the path was not in the source (e.g. a default).
  const Location* Find(const std::string& path) const;
  // "<source>:<line>:<column>: " of the path, or of its nearest enclosing key in the source
  // (for fields that were absent), else "<source>: ".
  std::string Prefix(const std::string& path) const;

 private:
  std::string source_name_;
  absl::flat_hash_map<std::string, Location> locations_;
};

// Parses `yaml_text` (exactly one YAML document whose root is a mapping) onto `message`, which
// should be empty. Field paths in errors and in `source_map` start at the root's keys.
// InvalidArgument on any error, with the location and the field path.
absl::Status ParseYamlInto(const std::string& yaml_text, google::protobuf::Message* message,
                           SourceMap* source_map);

// For each absent field with a (rules).default_value, sets the default; recurses into every
// singular sub-message, creating it if absent (so readers need no presence checks). Oneof members
// are left alone. Internal error if the schema itself is inconsistent (a default that does not
// parse or is out of its bounds, a default on a field without presence).
absl::Status ApplyDefaults(google::protobuf::Message* message);

// Renders `message` (fields that are present, declaration order) as YAML that ParseYamlInto reads
// back to an equal message. Strings are double-quoted, enums use their short lower-case names.
std::string MessageToYaml(const google::protobuf::Message& message);

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_YAML_PROTO_H_
