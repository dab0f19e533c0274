// A daemon's config as refitd assembles it: the config layer's loading and rules
// (daemon/config/config.h) plus the checks that need the layers above it, with errors of the
// same form ("<file>:<line>:<col>: <field>: <problem>"):
//   - publisher.codec.cuda_device_uuid and subscriber.store.cuda_device_uuid are GPU UUIDs as
//     nvidia-smi writes them (cuda/device.h ParseUuid);
//   - subscriber.upstream.tensors is a valid tensor selection (daemon/sync/selection.h).
// refitd (and --validate) loads through these; code that builds a config in C++ calls
// config::ApplyDefaults, config::Validate*Config, then Check*DaemonConfig.
#ifndef REFIT_DAEMON_RUNTIME_DAEMON_CONFIG_H_
#define REFIT_DAEMON_RUNTIME_DAEMON_CONFIG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/config/yaml_proto.h"
#include "refit/v1/config.pb.h"

namespace refit::runtime {

// config::Load*Config (every config-layer rule) and Check*DaemonConfig.
absl::StatusOr<v1::PublisherConfig> LoadPublisherDaemonConfig(const std::string& path);
absl::StatusOr<v1::SubscriberConfig> LoadSubscriberDaemonConfig(const std::string& path);

// The same from text; `source_name` stands for the file name in messages.
absl::StatusOr<v1::PublisherConfig> LoadPublisherDaemonConfigFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");
absl::StatusOr<v1::SubscriberConfig> LoadSubscriberDaemonConfigFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");

// A file with either or both sections, each present section fully checked (config_check).
absl::StatusOr<v1::ConfigFile> LoadDaemonConfigFile(const std::string& path);
absl::StatusOr<v1::ConfigFile> LoadDaemonConfigFileFromString(
    const std::string& yaml_text, const std::string& source_name = "<config>");

// The checks of this layer alone, on a section the config layer accepted; errors carry the file
// and line when `source_map` is given.
absl::Status CheckPublisherDaemonConfig(const v1::PublisherConfig& config,
                                        const config::SourceMap* source_map = nullptr);
absl::Status CheckSubscriberDaemonConfig(const v1::SubscriberConfig& config,
                                         const config::SourceMap* source_map = nullptr);

}  // namespace refit::runtime

#endif  // REFIT_DAEMON_RUNTIME_DAEMON_CONFIG_H_
