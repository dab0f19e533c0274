// A version written as a safetensors file: the one way both daemons export what they hold (the
// publisher its newest version, the subscriber a held version), so the file format stays below
// the daemons (daemon/model) and both exports write the same file for the same tensors.
#ifndef REFIT_DAEMON_SERVING_VERSION_FILE_H_
#define REFIT_DAEMON_SERVING_VERSION_FILE_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/safe_file.h"

namespace refit::publisher {

// One tensor of the version, in file order: views of what the caller holds (name, shape and
// bytes are read while the file is written).
struct VersionFileTensor {
  absl::string_view name;
  DType dtype = DType::kBF16;
  std::span<const uint64_t> shape;
  std::span<const uint8_t> data;
};

// Writes `tensors` (the held `version`) to `path` atomically, confined as `write` says
// (export_dir, mode, forbidden dirs). Errors say "export of version <v> to "<path>": ..." and
// keep the writer's code (INVALID_ARGUMENT for a path outside the export dir, DATA_LOSS, ...).
absl::Status WriteVersionFile(const std::string& path, uint64_t version,
                              std::span<const VersionFileTensor> tensors,
                              const SafeWriteOptions& write);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_VERSION_FILE_H_
