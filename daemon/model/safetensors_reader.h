// Reading safetensors files (the format: safetensors_format.h) with pread into memory the
// object owns.
//
// Reading validates all of the format (and the JSON itself, strictly) and reports what is wrong
// and where (file, tensor, field, and "header byte K", counted from the first byte of the JSON); a
// hostile file gives an error, never a crash. The JSON reader is schema-driven and never recurses
// on its input: nesting where the schema has none is reported as "expected X, found an
// array/object". Files are never mapped: they are read with pread (in parallel chunks) into
// anonymous memory the object owns (FileImage), so another process truncating the file while it
// is read gives an error ("... shrank while being read"), not SIGBUS; a FIFO, device or directory
// is refused without blocking (daemon/common/safe_file.h).
#ifndef REFIT_DAEMON_MODEL_SAFETENSORS_READER_H_
#define REFIT_DAEMON_MODEL_SAFETENSORS_READER_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/safe_file.h"
#include "daemon/model/safetensors_format.h"

namespace refit::model {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;  // empty for a scalar
  uint64_t offset = 0;         // of the tensor's first byte, from the start of the file
  uint64_t size = 0;           // bytes: num_elements() * DTypeSize(dtype)
  uint64_t num_elements() const;
};

class SafetensorsFile {
 public:
  // Reads the regular file `path` (symlinks followed) and validates its header.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  // The same, confined beneath one of `roots` (OpenRegularFileBeneath; `roots_field` names the
  // setting in errors).
  static absl::StatusOr<SafetensorsFile> OpenBeneath(const std::string& path,
                                                     std::span<const std::string> roots,
                                                     absl::string_view roots_field);
  // Reads the regular file open as `fd` (not closed; `path` appears in errors) with
  // ReadWholeFileImage over `read_threads` threads (0: its default).
  static absl::StatusOr<SafetensorsFile> FromFd(int fd, const std::string& path,
                                                int read_threads = 0);
  // Validates an in-memory file image (which the object then owns); `name` appears in errors.
  static absl::StatusOr<SafetensorsFile> FromBytes(std::vector<uint8_t> bytes,
                                                   std::string name = "<memory>");

  SafetensorsFile(SafetensorsFile&& other) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in header order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  // The bytes of tensor i (little-endian elements; not necessarily aligned). i < tensors().size().
  std::span<const uint8_t> data(size_t i) const;
  // Index of the tensor called `name`, or NotFound.
  absl::StatusOr<size_t> Find(absl::string_view name) const;
  // The "__metadata__" object (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t header_size() const { return header_size_; }  // N, the JSON's length in bytes
  uint64_t file_size() const { return image_.size(); }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string path_;
  // The file image: read from a file (file_) or handed over (owned_); image_ views it.
  FileImage file_;
  std::vector<uint8_t> owned_;
  std::span<const uint8_t> image_;
  uint64_t header_size_ = 0;
  std::vector<SafetensorsEntry> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace refit::model

#endif  // REFIT_DAEMON_MODEL_SAFETENSORS_READER_H_
