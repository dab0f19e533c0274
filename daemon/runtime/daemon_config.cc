#include "daemon/runtime/daemon_config.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/device.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/config.h"
#include "daemon/sync/selection.h"

namespace refit::runtime {
namespace {

// A cuda_device_uuid field that is set: a GPU UUID. (The config layer already refused it next
// to cuda_device, or on a CPU codec / non-cuda store.)
absl::Status CheckGpuUuid(const config::SourceMap* map, absl::string_view section,
                          const std::string& text) {
  absl::StatusOr<cuda::Uuid> uuid = cuda::ParseUuid(text);
  if (!uuid.ok()) {
    return config::FieldError(map, absl::StrCat(section, ".cuda_device_uuid"),
                              uuid.status().message());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPublisherDaemonConfig(const v1::PublisherConfig& config,
                                        const config::SourceMap* source_map) {
  if (config.codec().has_cuda_device_uuid()) {
    REFIT_RETURN_IF_ERROR(
        CheckGpuUuid(source_map, "publisher.codec", config.codec().cuda_device_uuid()));
  }
  return absl::OkStatus();
}

absl::Status CheckSubscriberDaemonConfig(const v1::SubscriberConfig& config,
                                         const config::SourceMap* source_map) {
  const v1::UpstreamConfig& up = config.upstream();
  if (absl::StatusOr<sync::TensorSelection> sel = sync::TensorSelection::Make(
          std::vector<std::string>(up.tensors().begin(), up.tensors().end()), "tensors");
      !sel.ok()) {
    return config::FieldError(source_map, "subscriber.upstream.tensors", sel.status().message());
  }
  if (config.store().has_cuda_device_uuid()) {
    REFIT_RETURN_IF_ERROR(
        CheckGpuUuid(source_map, "subscriber.store", config.store().cuda_device_uuid()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PublisherConfig> LoadPublisherDaemonConfigFromString(
    const std::string& yaml_text, const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(config::LoadedSection<v1::PublisherConfig> loaded,
                         config::LoadPublisherSection(yaml_text, source_name));
  REFIT_RETURN_IF_ERROR(CheckPublisherDaemonConfig(loaded.section, &loaded.source_map));
  return std::move(loaded.section);
}

absl::StatusOr<v1::SubscriberConfig> LoadSubscriberDaemonConfigFromString(
    const std::string& yaml_text, const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(config::LoadedSection<v1::SubscriberConfig> loaded,
                         config::LoadSubscriberSection(yaml_text, source_name));
  REFIT_RETURN_IF_ERROR(CheckSubscriberDaemonConfig(loaded.section, &loaded.source_map));
  return std::move(loaded.section);
}

absl::StatusOr<v1::ConfigFile> LoadDaemonConfigFileFromString(const std::string& yaml_text,
                                                              const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(config::LoadedSection<v1::ConfigFile> loaded,
                         config::LoadConfigFileSections(yaml_text, source_name));
  const v1::ConfigFile& file = loaded.section;
  if (file.has_publisher()) {
    REFIT_RETURN_IF_ERROR(CheckPublisherDaemonConfig(file.publisher(), &loaded.source_map));
  }
  if (file.has_subscriber()) {
    REFIT_RETURN_IF_ERROR(CheckSubscriberDaemonConfig(file.subscriber(), &loaded.source_map));
  }
  return std::move(loaded.section);
}

absl::StatusOr<v1::PublisherConfig> LoadPublisherDaemonConfig(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, config::ReadSmallFile(path, "config"));
  return LoadPublisherDaemonConfigFromString(text, path);
}

absl::StatusOr<v1::SubscriberConfig> LoadSubscriberDaemonConfig(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, config::ReadSmallFile(path, "config"));
  return LoadSubscriberDaemonConfigFromString(text, path);
}

absl::StatusOr<v1::ConfigFile> LoadDaemonConfigFile(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, config::ReadSmallFile(path, "config"));
  return LoadDaemonConfigFileFromString(text, path);
}

}  // namespace refit::runtime
