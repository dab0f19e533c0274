// Publishing safetensors files (publish_files.h).
#include "daemon/serving/publish_files.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"

namespace refit::publisher {

absl::StatusOr<PublishSummary> PublishSafetensors(PublisherCore& core, uint64_t version,
                                                  std::span<const std::string> paths,
                                                  const std::vector<std::string>* publish_dirs,
                                                  bool allow_degenerate) {
  if (paths.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("publish version ", version, ": no safetensors files given"));
  }
  std::vector<model::SafetensorsFile> files;
  files.reserve(paths.size());
  for (const std::string& p : paths) {
    auto f = publish_dirs == nullptr
                 ? model::SafetensorsFile::Open(p)
                 : model::SafetensorsFile::OpenBeneath(p, *publish_dirs, kPublishDirsField);
    if (!f.ok()) {
      return Annotate(f.status(), "publish version ", version);
    }
    files.push_back(std::move(*f));
  }
  std::vector<TensorInput> inputs;
  for (const model::SafetensorsFile& f : files) {
    for (size_t i = 0; i < f.tensors().size(); ++i) {
      const model::SafetensorsEntry& e = f.tensors()[i];
      TensorInput in;
      in.name = e.name;
      in.dtype = e.dtype;
      for (int64_t d : e.shape) in.shape.push_back(static_cast<uint64_t>(d));
      in.data = f.data(i);
      inputs.push_back(std::move(in));
    }
  }
  return core.Publish(version, inputs, allow_degenerate);
}

}  // namespace refit::publisher
