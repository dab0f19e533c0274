#include "daemon/serving/version_file.h"

#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors_writer.h"

namespace refit::publisher {

absl::Status WriteVersionFile(const std::string& path, uint64_t version,
                              std::span<const VersionFileTensor> tensors,
                              const SafeWriteOptions& write) {
  std::vector<model::SafetensorsTensorRef> refs;
  refs.reserve(tensors.size());
  for (const VersionFileTensor& t : tensors) {
    model::SafetensorsTensorRef ref;
    ref.name = std::string(t.name);
    ref.dtype = t.dtype;
    ref.shape.assign(t.shape.begin(), t.shape.end());
    ref.data = t.data;
    refs.push_back(std::move(ref));
  }
  return Annotate(model::WriteSafetensors(path, refs, {}, write), "export of version ", version,
                  " to ", Quoted(path));
}

}  // namespace refit::publisher
