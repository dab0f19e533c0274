// Writing safetensors files (the format: safetensors_format.h), atomically.
#ifndef REFIT_DAEMON_MODEL_SAFETENSORS_WRITER_H_
#define REFIT_DAEMON_MODEL_SAFETENSORS_WRITER_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/safe_file.h"
#include "daemon/model/safetensors_format.h"

namespace refit::model {

// One tensor to write: `data` holds product(shape) * DTypeSize(dtype) bytes, little-endian.
struct SafetensorsTensorRef {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;
};

// Writes a safetensors file with the tensors in the given order (data region in the same order;
// the reference writer instead sorts by descending alignment, so order tensors by descending dtype
// size yourself if every tensor must be naturally aligned in the file)
// and the metadata as "__metadata__" (omitted when empty). The header is compact JSON padded with
// spaces so that the data region starts at a multiple of 8, as the reference implementation does.
// Atomic (AtomicFile, daemon/common/safe_file.h): written to a temporary file in the same
// directory, fsync'd (unless options.durable is false: then a system crash may leave a stale or
// damaged file, which readers that check digests detect), then renamed over `path`, which must be
// absent or a regular file; on failure `path` is untouched and the temporary file removed. The
// file gets exactly options.mode (default 0600); options.root confines `path` beneath it.
absl::Status WriteSafetensors(const std::string& path,
                              std::span<const SafetensorsTensorRef> tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              const SafeWriteOptions& options = {});

}  // namespace refit::model

#endif  // REFIT_DAEMON_MODEL_SAFETENSORS_WRITER_H_
