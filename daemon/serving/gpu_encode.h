// Encoding a version on GPUs (PublisherOptions::device; PublisherCore "GPU encoding"): every
// tensor encoded and digested on its device against its GPU baseline; and device snapshots
// brought to the host for the CPU codec.
#ifndef REFIT_DAEMON_SERVING_GPU_ENCODE_H_
#define REFIT_DAEMON_SERVING_GPU_ENCODE_H_

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/serving/encoded_version.h"
#include "daemon/serving/publisher_core.h"

namespace refit::publisher {

// GPU encoding (PublisherCore's class comment): every tensor encoded and digested on its device
// against its GPU baseline (`gpu_baseline`, whose entries are taken out as the tensors are
// encoded; the caller installs out->gpu once the version is committed).
absl::Status EncodeOnDevices(const PublisherOptions& options, std::span<const TensorInput> inputs,
                             const std::vector<size_t>& order,
                             const std::vector<v1::TensorSpec>& specs,
                             const std::vector<BaselineTensor>& prev, const std::string& where,
                             GpuBaselineMap* gpu_baseline, Encoded* out, PublishSummary* sum);

// CPU codec with DeviceBytes inputs: the same inputs with those copied to host buffers.
absl::StatusOr<std::vector<TensorInput>> DownloadDeviceInputs(std::span<const TensorInput> given,
                                                              const std::string& where,
                                                              PublishSummary* sum);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_GPU_ENCODE_H_
