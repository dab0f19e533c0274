// safetensors files (https://github.com/huggingface/safetensors): read with pread into memory the
// object owns, written atomically.
//
// Layout: u64 little-endian N, then N bytes of UTF-8 JSON, then the data region. The JSON is an
// object mapping each tensor name to {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}
// (offsets relative to the first byte after the header) plus an optional "__metadata__" object of
// string -> string. Tensors must tile the data region exactly: sorted by offsets, each begins where
// the previous one ends, the first at 0 and the last ends at the end of the file.
//
// Reading validates all of that (and the JSON itself, strictly) and reports what is wrong and where
// (file, tensor, field, and "header byte K", counted from the first byte of the JSON); a hostile
// file gives an error, never a crash. The JSON reader is schema-driven and never recurses on its
// input: nesting where the schema has none is reported as "expected X, found an array/object".
// Files are never mapped: they are read with pread (in parallel chunks) into anonymous memory the
// object owns (FileImage), so another process truncating the file while it is read gives an error
// ("... shrank while being read"), not SIGBUS; a FIFO, device or directory is refused without
// blocking (daemon/common/safe_file.h).
#ifndef REFIT_DAEMON_MODEL_SAFETENSORS_H_
#define REFIT_DAEMON_MODEL_SAFETENSORS_H_

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

namespace refit::model {

// Largest header a reader accepts (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull << 20;
// Largest number of dimensions a reader accepts for one tensor.
inline constexpr int kSafetensorsMaxRank = 64;

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

// The safetensors name of a dtype ("BF16", "F8_E4M3", "BOOL", ...).
absl::string_view SafetensorsDTypeName(DType t);

}  // namespace refit::model

#endif  // REFIT_DAEMON_MODEL_SAFETENSORS_H_
