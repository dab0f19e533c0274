// TensorMemory: how the daemon touches a store's bytes. A store's spans (TensorStore: staging
// handles, leases) point at host memory (ShmStore) or at device memory (CudaStore); the daemon
// never reads or writes them directly, only through the store's memory(): copies, uploads of
// received keyframes, downloads (export, peers), patch application and digests. The host
// implementation is the CPU codec; the device one runs the codec's kernels (cuda/device.h).
//
// Every call is synchronous and returns the operation's first error. Spans are the store's own
// (`store` side) or the caller's host memory (`host` side).
#ifndef REFIT_DAEMON_STORE_TENSOR_MEMORY_H_
#define REFIT_DAEMON_STORE_TENSOR_MEMORY_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/changed_lines.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/dtype.h"

namespace refit::store {

// OK when a copy's destination and source have the same size, else INVALID_ARGUMENT naming `what`.
absl::Status CheckSameSize(size_t dst, size_t src, const char* what);

class TensorMemory {
 public:
  virtual ~TensorMemory() = default;

  // "host" or the device's description, for logs.
  virtual std::string Describe() const = 0;
  // True when store spans may be dereferenced by the CPU (ShmStore): the daemon may then
  // reassemble frames straight into a staged slot.
  virtual bool host_accessible() const = 0;

  // store -> store (same size; may be the same store or another one of the same kind).
  virtual absl::Status Copy(std::span<uint8_t> dst, std::span<const uint8_t> src) = 0;
  // host -> store and store -> host (same size).
  virtual absl::Status Upload(std::span<uint8_t> dst, std::span<const uint8_t> host) = 0;
  virtual absl::Status Download(std::span<uint8_t> host, std::span<const uint8_t> src) = 0;
  // refit::ApplyPatch of a host `patch` from `base` (a store span) into `out` (a store span; may
  // equal base: in place). Same errors and guarantees as the CPU codec.
  virtual absl::Status Apply(std::span<const uint8_t> patch, DType dtype,
                             std::span<const uint8_t> base, std::span<uint8_t> out) = 0;
  // refit::TensorDigest of a store span.
  virtual absl::StatusOr<uint64_t> Digest(std::span<const uint8_t> data) = 0;
  // Copy that also returns refit::TensorDigestV2 of the bytes copied (the source read once where
  // the memory allows). Default: Copy, then DigestV2 of the destination.
  virtual absl::StatusOr<uint64_t> CopyDigestV2(std::span<uint8_t> dst,
                                                std::span<const uint8_t> src);
  // refit::TensorDigestV2 of a store span, and Apply that also returns the digest-v2 delta of
  // what it writes (refit::ApplyPatchDigestV2: in place it reads only the changed words).
  virtual absl::StatusOr<uint64_t> DigestV2(std::span<const uint8_t> data) = 0;
  virtual absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                                      std::span<const uint8_t> base,
                                                      std::span<uint8_t> out) = 0;
  // ApplyDigestV2 that also marks the 64-byte lines it changes in *lines (refit::ChangedLines,
  // sized to out.size() first when it has no size; marks of earlier steps stay), so that
  // CopyLines can bring another copy of the base forward. Default: ApplyDigestV2, *lines left as
  // it is (a memory that marks nothing leaves it without a size).
  virtual absl::StatusOr<DigestV2Delta> ApplyMarkingLines(std::span<const uint8_t> patch,
                                                          DType dtype,
                                                          std::span<const uint8_t> base,
                                                          std::span<uint8_t> out,
                                                          ChangedLines* lines);
  // The lines `lines` marks copied from `src` to `dst` (store spans of lines.tensor_bytes()).
  // Default: one Copy per run of lines.
  virtual absl::Status CopyLines(std::span<uint8_t> dst, std::span<const uint8_t> src,
                                 const ChangedLines& lines);
  // refit::WriteChanges into a store span in place (the single-copy store's update): the host
  // change set's new values written at its positions. Checked first (refit::CheckChanges):
  // nothing is written on error.
  virtual absl::Status WriteChanges(std::span<uint8_t> data, const TensorChanges& changes) = 0;
  // refit::RevertChanges: the change set's old values (its undo record) written back.
  virtual absl::Status RevertChanges(std::span<uint8_t> data, const TensorChanges& changes) = 0;
  // WriteChanges of a whole version: sets[i] into data[i]. Every set is checked before anything
  // is written; a failure after that (a device error) may leave some tensors written: revert
  // them tensor by tensor. Default: one WriteChanges per tensor; host memory does them all in
  // one fork-join (the pause of a many-tensor version).
  virtual absl::Status WriteChangesOfTensors(std::span<const std::span<uint8_t>> data,
                                             std::span<const TensorChanges* const> sets);
};

// Host memory: memcpy and the CPU codec with `threads` threads (0 = all hardware threads).
class HostMemory final : public TensorMemory {
 public:
  explicit HostMemory(int threads = 0) : threads_(threads) {}
  std::string Describe() const override { return "host memory"; }
  bool host_accessible() const override { return true; }
  absl::Status Copy(std::span<uint8_t> dst, std::span<const uint8_t> src) override;
  // Piece by piece (1 MiB): each piece's digest sum while it is read, then its copy from the
  // cache.
  absl::StatusOr<uint64_t> CopyDigestV2(std::span<uint8_t> dst,
                                        std::span<const uint8_t> src) override;
  absl::Status Upload(std::span<uint8_t> dst, std::span<const uint8_t> host) override;
  absl::Status Download(std::span<uint8_t> host, std::span<const uint8_t> src) override;
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                     std::span<uint8_t> out) override;
  absl::StatusOr<uint64_t> Digest(std::span<const uint8_t> data) override;
  absl::StatusOr<uint64_t> DigestV2(std::span<const uint8_t> data) override;
  absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                              std::span<const uint8_t> base,
                                              std::span<uint8_t> out) override;
  absl::StatusOr<DigestV2Delta> ApplyMarkingLines(std::span<const uint8_t> patch, DType dtype,
                                                  std::span<const uint8_t> base,
                                                  std::span<uint8_t> out,
                                                  ChangedLines* lines) override;
  absl::Status CopyLines(std::span<uint8_t> dst, std::span<const uint8_t> src,
                         const ChangedLines& lines) override;
  absl::Status WriteChanges(std::span<uint8_t> data, const TensorChanges& changes) override;
  absl::Status RevertChanges(std::span<uint8_t> data, const TensorChanges& changes) override;
  absl::Status WriteChangesOfTensors(std::span<const std::span<uint8_t>> data,
                                     std::span<const TensorChanges* const> sets) override;

 private:
  const int threads_;
};

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_TENSOR_MEMORY_H_
