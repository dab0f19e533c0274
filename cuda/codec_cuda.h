// The patch codec on an NVIDIA GPU: encode from device-resident tensors, apply into device memory,
// and the tensor digest. The CPU codec (daemon/codec/codec.h) is the specification and test oracle:
// EncodePatchDevice returns byte for byte the patch EncodePatch returns, ApplyPatchDevice has
// ApplyPatch's semantics, TensorDigestDevice returns TensorDigest's value.
//
// Plain C++ (no CUDA types). Built without CUDA (REFIT_CUDA=OFF or no nvcc), every call returns
// absl::UnavailableError and DeviceAvailable() is false; built with CUDA on a machine without a
// usable device, calls return a non-OK status too.
//
// Device pointers ("d_") are CUDA device memory on the current device (cudaSetDevice), aligned to
// the element size. Work runs on the stream given to DeviceCodec (nullptr: the legacy default
// stream), and every call returns only after its device work is done. Callers that produced the
// inputs on another stream must order it before the call. Not thread-safe per DeviceCodec object;
// separate objects may be used from separate threads.
#ifndef REFIT_CUDA_CODEC_CUDA_H_
#define REFIT_CUDA_CODEC_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/fused_encode.h"

namespace refit::cuda {

// True iff this build has the CUDA kernels and the runtime reports at least one device.
bool DeviceAvailable();

// "NAME (device N, compute capability X.Y, S SMs, M MiB)" of the current device.
absl::StatusOr<std::string> DeviceDescription();

// Owning handle of a device allocation (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // A buffer of `bytes` bytes (uninitialised; 0 bytes gives an empty buffer with data() null).
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  void* data() { return ptr_; }
  const void* data() const { return ptr_; }
  size_t size() const { return size_; }

  // Synchronous copies between the start of the buffer and host memory; the host span may be
  // shorter than the buffer, not longer.
  absl::Status Upload(std::span<const uint8_t> host);
  absl::Status Download(std::span<uint8_t> host) const;

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Device time of each stage of one Encode or Apply call (CUDA events on the codec's stream).
struct DeviceTimings {
  struct Stage {
    std::string name;
    double ms = 0;
  };
  std::vector<Stage> stages;
  double TotalMs() const {
    double t = 0;
    for (const auto& s : stages) t += s.ms;
    return t;
  }
  double StageMs(const std::string& name) const {  // 0 if absent
    for (const auto& s : stages) {
      if (s.name == name) return s.ms;
    }
    return 0;
  }
};

// The codec with its device scratch memory kept between calls (the free functions below create
// one per call). Scratch grows to the largest call's needs; ReleaseScratch frees it.
class DeviceCodec {
 public:
  // `stream` is a cudaStream_t (nullptr = the legacy default stream).
  explicit DeviceCodec(void* stream = nullptr);
  ~DeviceCodec();
  DeviceCodec(DeviceCodec&&) noexcept;
  DeviceCodec& operator=(DeviceCodec&&) noexcept;
  DeviceCodec(const DeviceCodec&) = delete;
  DeviceCodec& operator=(const DeviceCodec&) = delete;

  // EncodePatchDevice. `timings`, if given, receives the device time of: analyze (find changes,
  // choose parameters), context (format 2: the context coding of the changed blocks), emit
  // (write bit streams, checksums, compaction) and d2h (patch payload to the host). With
  // options.format 2, `prev` (host memory; null: none) is the base's previous-change record the
  // CONTEXT blocks are coded given, as refit::EncodeInput::prev.
  absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* d_base, const void* d_target,
                                              uint64_t bytes, const EncodeOptions& options = {},
                                              PatchStats* stats = nullptr,
                                              DeviceTimings* timings = nullptr,
                                              const ChangeRecord* prev = nullptr);
  // The one-pass encode (daemon/codec/fused_encode.h; CPU twin refit::EncodeFusedCpu): Encode's
  // patch and stats, plus the target's digest v2 summed from the analyze kernel's own loads, and
  // with update_base, d_base := d_target by the changed elements (SPARSE blocks in the write
  // kernel, DENSE blocks in the compact kernel; no extra pass over the tensor). Errors: Encode's;
  // on error with update_base, d_base may be partly updated. Stages as Encode's.
  absl::StatusOr<FusedEncoding> EncodeFused(DType dtype, void* d_base, const void* d_target,
                                            uint64_t bytes, const EncodeOptions& options = {},
                                            bool update_base = false,
                                            DeviceTimings* timings = nullptr,
                                            const ChangeRecord* prev = nullptr);
  // ApplyPatchDevice. `timings`: h2d (patch upload), verify (staging and checksums), decode and
  // write (all waves together), copy (base to out, out of place only). A conditioned format-2
  // patch needs `prev` (host memory), as refit::ApplyPatch.
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base, void* d_out,
                     uint64_t bytes, DeviceTimings* timings = nullptr,
                     const ChangeRecord* prev = nullptr);
  // TensorDigestDevice.
  absl::StatusOr<uint64_t> Digest(const void* d_data, uint64_t bytes);
  // Apply, also returning the digest-v2 delta of what it writes: refit::ApplyPatchDigestV2's
  // value. The delta kernel reads each decoded wave's old words before the wave is written.
  // `timings` as Apply's, plus digest_delta.
  absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                              const void* d_base, void* d_out, uint64_t bytes,
                                              DeviceTimings* timings = nullptr,
                                              const ChangeRecord* prev = nullptr);
  // refit::TensorDigestV2 of `bytes` bytes of device memory (any alignment).
  absl::StatusOr<uint64_t> DigestV2(const void* d_data, uint64_t bytes);
  // refit::WriteChanges on device memory: d_data (`bytes` long, aligned to the element size)
  // gets the change set's values at its positions, byte for byte the CPU twin's result. Positions
  // and values are uploaded into the codec's scratch and one kernel scatters them. Errors:
  // refit::CheckChanges' (the CPU twin's messages), then INVALID_ARGUMENT for a null or misaligned
  // d_data; nothing is written on error. An empty change set launches nothing.
  absl::Status WriteChanges(const TensorChanges& changes, void* d_data, uint64_t bytes);
  // refit::RevertChanges on device memory: the same scatter with changes.old_values (the undo
  // record captured when the change set was decoded), so that d_data is again the base the
  // change set was decoded against. Errors as WriteChanges', and the CPU twin's INVALID_ARGUMENT
  // when old_values' size is not values'.
  absl::Status RevertChanges(const TensorChanges& changes, void* d_data, uint64_t bytes);
  // Copies `bytes` from d_src to d_dst (device to device, not overlapping) on the codec's stream;
  // returns the copy's device time in milliseconds (the benchmark's baseline).
  absl::StatusOr<double> DeviceCopy(void* d_dst, const void* d_src, uint64_t bytes);

  // Apply decodes SPARSE and CONTEXT blocks in waves whose decoded changes (12 bytes each) fit
  // this many bytes of scratch (default 512 MiB; a single block always fits: at most 2^24
  // changes, 192 MiB); the format-2 encoder codes blocks in waves of as many changes (9 bytes
  // each).
  void set_decode_scratch_limit(size_t bytes);
  size_t scratch_bytes() const;
  void ReleaseScratch();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Encodes base -> target (both `bytes` long, device memory) into a host patch identical to
// refit::EncodePatch's for the same inputs and options (options.threads is ignored).
absl::StatusOr<std::vector<uint8_t>> EncodePatchDevice(DType dtype, const void* d_base,
                                                       const void* d_target, uint64_t bytes,
                                                       const EncodeOptions& options = {},
                                                       PatchStats* stats = nullptr,
                                                       const ChangeRecord* prev = nullptr);

// Applies a host `patch` to the device tensor d_base (`bytes` long), writing d_out, with
// refit::ApplyPatch's semantics: d_out may equal d_base (in place) but must not partly overlap it;
// every block checksum is verified before anything is written, and each block is decoded and
// validated completely before any of its bytes are written. Errors in the payloads are
// absl::DataLossError naming the block and its element range, as the CPU decoder's. On error,
// out-of-place output is unspecified and the base untouched; in place, blocks before the failing
// one may have been applied.
absl::Status ApplyPatchDevice(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                              void* d_out, uint64_t bytes, const ChangeRecord* prev = nullptr);

// refit::TensorDigest of `bytes` bytes of device memory (any alignment).
absl::StatusOr<uint64_t> TensorDigestDevice(const void* d_data, uint64_t bytes);

}  // namespace refit::cuda

#endif  // REFIT_CUDA_CODEC_CUDA_H_
