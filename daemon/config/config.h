// Loading and validating daemon configs (schema: proto/refit/v1/config.proto; examples: config/).
//
// A config file is YAML whose top level has a `publisher:` and/or a `subscriber:` section. Loading
// is strict (yaml_proto.h: unknown keys, duplicates, wrong types, out-of-range numbers are errors),
// fills every default, then checks the rules that span fields, e.g.
//   publisher.yaml:3:11: publisher.listen: "0.0.0.0:7000" is not a loopback address, so
//   publisher.tls needs cert, key and ca (mTLS), or set publisher.tls.insecure: true explicitly
// Every error is one line naming the file, line, field and problem; code InvalidArgument (NotFound
// / PermissionDenied / ... when the file itself cannot be read). No exception escapes.
//
// Loading does not touch the files a config names (TLS PEM files, directories): CheckConfigFiles
// does, so a config can be validated on a machine other than the one it runs on. Daemons call
// both at start; `refitd ... --validate` should too.
//
// This layer depends on daemon/common only (no cuda/, no daemon/sync/). The rules that need
// those (a cuda_device_uuid is a GPU UUID; subscriber.upstream.tensors is a valid tensor
// selection) are checked where the daemon assembles its config, daemon/runtime/daemon_config.h,
// with errors of the same form (FieldError); refitd loads its config through that.
#ifndef REFIT_DAEMON_CONFIG_CONFIG_H_
#define REFIT_DAEMON_CONFIG_CONFIG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/config/yaml_proto.h"
#include "refit/v1/config.pb.h"

namespace refit::config {

// Longest config `name` (bytes of UTF-8).
inline constexpr size_t kMaxNameBytes = 128;

// Reads `path` and returns its `publisher:` (resp. `subscriber:`) section with defaults filled
// and every rule checked. The other role's section, if present, is checked against the schema
// only.
absl::StatusOr<v1::PublisherConfig> LoadPublisherConfig(const std::string& path);
absl::StatusOr<v1::SubscriberConfig> LoadSubscriberConfig(const std::string& path);

// The same from text; `source_name` stands for the file name in messages.
absl::StatusOr<v1::PublisherConfig> LoadPublisherConfigFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");
absl::StatusOr<v1::SubscriberConfig> LoadSubscriberConfigFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");

// Reads a file with either or both sections and fully validates each section present (at least
// one is required). For tools and tests that check every example.
absl::StatusOr<v1::ConfigFile> LoadConfigFile(const std::string& path);
absl::StatusOr<v1::ConfigFile> LoadConfigFileFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");

// A loaded section (or file) with the source map of its text: for the checks a layer above adds
// (daemon/runtime/daemon_config.h), so that their errors carry the file and line as well.
template <typename Section>
struct LoadedSection {
  Section section;
  SourceMap source_map;
};
absl::StatusOr<LoadedSection<v1::PublisherConfig>> LoadPublisherSection(
    const std::string& yaml_text, const std::string& source_name = "<config>");
absl::StatusOr<LoadedSection<v1::SubscriberConfig>> LoadSubscriberSection(
    const std::string& yaml_text, const std::string& source_name = "<config>");
absl::StatusOr<LoadedSection<v1::ConfigFile>> LoadConfigFileSections(
    const std::string& yaml_text, const std::string& source_name = "<config>");

// An error of the form every config error has, InvalidArgument
// "<file>:<line>:<col>: <path>: <problem>" (the location from `source_map`; without one,
// "<path>: <problem>"), the problem made one line.
absl::Status FieldError(const SourceMap* source_map, const std::string& path,
                        absl::string_view problem);

// Cross-field rules of a section whose defaults are filled (ApplyDefaults). Errors name fields
// by path ("publisher.listen"); with a source map they also carry the file and line. For code
// that builds configs in C++: ApplyDefaults, then Validate.
absl::Status ValidatePublisherConfig(const v1::PublisherConfig& config,
                                     const SourceMap* source_map = nullptr);
absl::Status ValidateSubscriberConfig(const v1::SubscriberConfig& config,
                                      const SourceMap* source_map = nullptr);

// Parses a file mode written as an octal string ("0660"), at most 0777 (socket_mode fields).
// InvalidArgument naming `field` otherwise.
absl::StatusOr<unsigned> ParseFileMode(const std::string& text, const std::string& field);

// The mode of a validated mode field, or `fallback` when it does not parse.
unsigned FileModeOr(const std::string& text, unsigned fallback);

// Checks the files a validated config names: every configured TLS PEM file is readable and holds
// what it should (certificates, a CA bundle, a private key that matches the certificate:
// tls_material.h). NotFound / PermissionDenied / InvalidArgument naming the field and the path.
// Unix socket directories are not checked here (they may be created just before the daemon
// starts); StartServer names a missing one.
absl::Status CheckConfigFiles(const v1::PublisherConfig& config);
absl::Status CheckConfigFiles(const v1::SubscriberConfig& config);

// The effective config as a loadable YAML file ("publisher:\n  name: ..."), e.g. for --validate
// to print, or for tests to write a config they built in C++.
std::string ConfigToYaml(const v1::PublisherConfig& config);
std::string ConfigToYaml(const v1::SubscriberConfig& config);

// Reads a whole (small) file: the config itself, PEM files. Errors name `what` and the path
// ("cannot read tls.cert \"/x.pem\": No such file or directory"), with the errno's code.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const std::string& what,
                                          size_t max_bytes = kMaxConfigBytes);

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_CONFIG_H_
