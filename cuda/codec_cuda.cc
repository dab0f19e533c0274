// Host side of the GPU codec: argument checks, device scratch, kernel sequencing, the block table
// and header (identical to codec.cc's writer), and error messages (identical to codec.cc's). The
// kernels are in kernels.cuh; every CUDA runtime call goes through runtime.h.
#include "cuda/codec_cuda.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {
namespace {

using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;

static_assert(kern::kCtxExpClasses == kExponentClasses);
static_assert(kern::kCtxClasses == kContextClasses);
static_assert(kern::kCtxMaxK == kMaxGapK);

static_assert(static_cast<int>(ValueCoding::kOrderedDiff) == kern::kCodingOrdered);
static_assert(static_cast<int>(ValueCoding::kIntDiff) == kern::kCodingInt);
static_assert(static_cast<int>(ValueCoding::kRaw) == kern::kCodingRaw);

constexpr size_t kDefaultDecodeScratch = size_t{512} << 20;
constexpr uint64_t kDecodedChangeBytes = sizeof(uint32_t) + sizeof(uint64_t);
// The format-2 encoder's scratch per change: position, rank (then gap), class.
constexpr uint64_t kContextChangeBytes = 2 * sizeof(uint32_t) + 1;

uint64_t RoundUp8(uint64_t x) { return (x + 7) & ~uint64_t{7}; }


absl::Status CheckDevice() {
  static const absl::Status* const status = [] {
    absl::StatusOr<int> n = rt::DeviceCount();
    if (!n.ok()) {
      return new absl::Status(absl::UnavailableError(
          absl::StrCat("no usable CUDA device: ", n.status().message())));
    }
    if (*n <= 0) return new absl::Status(absl::UnavailableError("no CUDA device"));
    return new absl::Status();
  }();
  return *status;
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Grows `buf` to at least `bytes` (contents are not preserved).
absl::Status Reserve(DeviceBuffer& buf, size_t bytes) {
  if (buf.size() >= bytes) return absl::OkStatus();
  buf = DeviceBuffer();  // free first: lower peak memory
  ASSIGN_OR_RETURN(buf, DeviceBuffer::Allocate(bytes));
  return absl::OkStatus();
}

template <typename T>
T* Ptr(DeviceBuffer& b) {
  return static_cast<T*>(b.data());
}

// The kernels' copy of the dtype's class field (context_block.h ClassFieldOf).
kern::ContextField FieldArgs(DType dtype) {
  const ClassField cf = ClassFieldOf(dtype);
  kern::ContextField fl;
  fl.mask = cf.mask;
  fl.shift = cf.shift;
  fl.bits = cf.bits;
  fl.is_float = cf.is_float;
  fl.is_signed = cf.is_signed;
  return fl;
}

// A previous-change record's words on the device: changed[], then down[].
absl::Status UploadRecord(const ChangeRecord& r, DeviceBuffer& buf, void* stream) {
  const uint64_t words = r.changed.size();
  RETURN_IF_ERROR(Reserve(buf, std::max<uint64_t>(2 * words, 1) * sizeof(uint64_t)));
  if (words == 0) return absl::OkStatus();
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(buf.data(), r.changed.data(), words * sizeof(uint64_t), stream));
  return rt::CopyToDeviceAsync(Ptr<uint64_t>(buf) + words, r.down.data(), words * sizeof(uint64_t),
                               stream);
}


const char* DecodeErrorText(uint32_t code) {
  switch (code) {
    case kern::kErrRunTruncated: return "truncated or oversized run length";
    case kern::kErrRunPastCount: return "run length runs past the block's change count";
    case kern::kErrGapTruncated: return "truncated or oversized position gap";
    case kern::kErrPosPastEnd: return "position beyond the end of the block";
    case kern::kErrValueTruncated: return "truncated value";
    case kern::kErrRawEqualsBase: return "raw value equals the base value (not a change)";
    case kern::kErrExcPrefix: return "truncated or oversized exception prefix";
    case kern::kErrExcTooLarge: return "exception magnitude too large for the dtype";
    case kern::kErrExcTruncated: return "truncated exception magnitude";
    case kern::kErrDiffRange: return "difference out of range for the dtype";
    case kern::kErrCtxNotStream: return "not a range-coded stream (too short or bad first bytes)";
    case kern::kErrCtxAnchorExp: return "the class anchor exceeds the dtype's exponent field";
    case kern::kErrCtxAnchorWidth: return "the class anchor exceeds the dtype's width";
    case kern::kErrCtxNoClass: return "no class has a change";
    case kern::kErrCtxK: return "a class's gap parameter is out of [0, 24]";
    case kern::kErrCtxTruncated: return "truncated stream";
    case kern::kErrCtxGap: return "truncated or oversized gap";
    case kern::kErrCtxMore: return "more changes than the block's count";
    case kern::kErrCtxLastGap: return "the class's last gap runs past its elements";
    case kern::kErrCtxEmptyClass: return "a class in the mask has no change";
    case kern::kErrCtxFewer: return "fewer changes than the block's count";
    case kern::kErrCtxEnd: return "the stream does not end where its last symbol does";
    default: return "unknown decoder error";
  }
}

// The decoder's message for a failed SPARSE or CONTEXT block, as codec.cc's.
std::string DecodeFailure(const std::string& where, const kern::ApplyDesc& d,
                          const kern::ApplyError& e) {
  if (d.mode == kContext) {
    const int cls = static_cast<int>(e.used) - 1;
    return absl::StrCat(where, ", context-coded payload",
                        cls >= 0 ? absl::StrCat(", class ", cls) : "", ", change ", e.change,
                        " of ", d.count, " (byte ", e.bit, " of ", d.payload_bytes,
                        "): ", DecodeErrorText(e.code));
  }
  if (e.code == kern::kErrBadSize) {
    return absl::StrCat(where, ": payload has ", d.payload_bytes, " bytes but its ", d.count,
                        " changes use ", (e.used + 7) / 8);
  }
  if (e.code == kern::kErrPadding) return absl::StrCat(where, ": nonzero padding bits");
  return absl::StrCat(where, ", change ", e.change, " of ", d.count, " (bit ", e.bit, "): ",
                      DecodeErrorText(e.code));
}

// Records device stage times when asked to.
class StageClock {
 public:
  StageClock(DeviceTimings* out, void* stream) : out_(out), stream_(stream) {
    if (out_ != nullptr) out_->stages.clear();
  }
  absl::Status Begin(const char* name) {
    if (out_ == nullptr) return absl::OkStatus();
    timers_.emplace_back(name, std::make_unique<rt::Timer>());
    return timers_.back().second->Start(stream_);
  }
  absl::Status End() {
    if (out_ == nullptr) return absl::OkStatus();
    return timers_.back().second->Stop(stream_);
  }
  // After the stream is synchronised: collects the times.
  absl::Status Finish() {
    if (out_ == nullptr) return absl::OkStatus();
    for (auto& [name, timer] : timers_) {
      ASSIGN_OR_RETURN(double ms, timer->ElapsedMs());
      bool merged = false;
      for (auto& s : out_->stages) {
        if (s.name == name) {
          s.ms += ms;
          merged = true;
        }
      }
      if (!merged) out_->stages.push_back({name, ms});
    }
    return absl::OkStatus();
  }

 private:
  DeviceTimings* out_;
  void* stream_;
  std::vector<std::pair<std::string, std::unique_ptr<rt::Timer>>> timers_;
};

// The apply kernels' plan of a patch: a descriptor per changed block (its payload's place in the
// staging buffer) and the decode waves over them, each holding at most `decode_limit` bytes of
// decoded changes.
struct ApplyPlan {
  std::vector<kern::ApplyDesc> descs;
  std::vector<std::pair<uint64_t, uint64_t>> waves;  // [lo, hi) descriptor ranges
  uint64_t stage_total = 0;       // staging bytes of every payload
  uint64_t max_wave_changes = 0;  // changed elements of the largest wave
};

ApplyPlan PlanApply(const PatchLayout& layout, size_t decode_limit) {
  ApplyPlan plan;
  std::vector<kern::ApplyDesc>& descs = plan.descs;
  const uint64_t wave_changes = std::max<uint64_t>(1, decode_limit / kDecodedChangeBytes);
  uint64_t wave_lo = 0, wave_used = 0;
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& b = layout.blocks[i];
    if (b.mode == kUnchanged) continue;
    kern::ApplyDesc d{};
    d.block_index = i;
    d.first_element = b.first_element;
    d.src_off = b.payload_offset;
    d.stage_off = plan.stage_total;
    d.payload_bytes = b.payload_bytes;
    d.num_elements = b.num_elements;
    d.count = b.count;
    d.checksum = b.checksum;
    d.mode = b.mode;
    d.kg = b.kg;
    d.kr = b.kr;
    d.ke = b.ke;
    plan.stage_total += RoundUp8(b.payload_bytes) + 8;
    if (b.mode == kSparse || b.mode == kContext) {
      if (wave_used > 0 && wave_used + b.count > wave_changes) {
        plan.waves.emplace_back(wave_lo, descs.size());
        wave_lo = descs.size();
        wave_used = 0;
      }
      d.scratch_off = wave_used;
      wave_used += b.count;
      plan.max_wave_changes = std::max(plan.max_wave_changes, wave_used);
    }
    descs.push_back(d);
  }
  if (wave_lo < descs.size()) plan.waves.emplace_back(wave_lo, descs.size());
  return plan;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Free functions, DeviceBuffer, DeviceTimings
// ---------------------------------------------------------------------------------------------

bool DeviceAvailable() { return CheckDevice().ok(); }

absl::StatusOr<std::string> DeviceDescription() {
  RETURN_IF_ERROR(CheckDevice());
  return rt::Describe();
}

DeviceBuffer::~DeviceBuffer() { rt::Free(ptr_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    rt::Free(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  RETURN_IF_ERROR(CheckDevice());
  DeviceBuffer b;
  if (bytes == 0) return b;
  void* p = nullptr;
  absl::Status st = rt::Malloc(&p, bytes);
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("allocating ", bytes, " bytes of device memory: ",
                                                 st.message()));
  }
  b.ptr_ = p;
  b.size_ = bytes;
  return b;
}

absl::Status DeviceBuffer::Upload(std::span<const uint8_t> host) {
  if (host.size() > size_) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceBuffer::Upload: ", host.size(),
                                                   " bytes into a buffer of ", size_));
  }
  return rt::CopyToDevice(ptr_, host.data(), host.size());
}

absl::Status DeviceBuffer::Download(std::span<uint8_t> host) const {
  if (host.size() > size_) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceBuffer::Download: ", host.size(),
                                                   " bytes from a buffer of ", size_));
  }
  return rt::CopyToHost(host.data(), ptr_, host.size());
}

absl::StatusOr<std::vector<uint8_t>> EncodePatchDevice(DType dtype, const void* d_base,
                                                       const void* d_target, uint64_t bytes,
                                                       const EncodeOptions& options,
                                                       PatchStats* stats, const ChangeRecord* prev) {
  DeviceCodec codec;
  return codec.Encode(dtype, d_base, d_target, bytes, options, stats, nullptr, prev);
}

absl::Status ApplyPatchDevice(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                              void* d_out, uint64_t bytes, const ChangeRecord* prev) {
  DeviceCodec codec;
  return codec.Apply(patch, dtype, d_base, d_out, bytes, nullptr, prev);
}

absl::StatusOr<uint64_t> TensorDigestDevice(const void* d_data, uint64_t bytes) {
  DeviceCodec codec;
  return codec.Digest(d_data, bytes);
}

// ---------------------------------------------------------------------------------------------
// DeviceCodec
// ---------------------------------------------------------------------------------------------

// WriteChanges' and RevertChanges' argument checks: the device, the dtype, refit::CheckChanges
// (the CPU twin's check and messages), then the pointer.
static absl::Status CheckChangeArgs(const TensorChanges& changes, const void* d_data,
                                    uint64_t bytes, const char* what) {
  RETURN_IF_ERROR(CheckDevice());
  if (!IsValidDType(static_cast<uint8_t>(changes.dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (device): invalid dtype code ",
                                                   static_cast<int>(changes.dtype)));
  }
  RETURN_IF_ERROR(CheckChanges(changes, changes.dtype, bytes));
  const int w = DTypeSize(changes.dtype);
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (device): null device pointer"));
  }
  if (!Aligned(d_data, static_cast<size_t>(w))) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " (device): the tensor must be aligned to the element size (", w, " bytes)"));
  }
  return absl::OkStatus();
}

struct DeviceCodec::Impl {
  void* stream = nullptr;
  size_t decode_limit = kDefaultDecodeScratch;
  // Encoder.
  DeviceBuffer enc_blocks, enc_tiles, enc_offsets, enc_stage, enc_out;
  std::vector<kern::EncBlock> host_blocks;
  std::vector<uint64_t> host_offsets;
  // Digest (v1 chunk hashes; v2 sum and apply delta accumulators).
  DeviceBuffer digest_hashes, digest_v2_sum, ap_delta;
  // Apply.
  DeviceBuffer ap_patch, ap_descs, ap_stage, ap_computed, ap_first_bad, ap_errors, ap_pos, ap_val;
  // Format 2: the previous-change record (apply and encode), the encoder's context jobs, streams,
  // their sizes, per-change scratch and each block's stream offset.
  DeviceBuffer ap_prev, cx_jobs, cx_out, cx_bytes, cx_pos, cx_rank, cx_cls, cx_off;
  // Change sets: the positions and values of one call, in one buffer.
  DeviceBuffer cs_stage;

  size_t ScratchBytes() const {
    size_t n = 0;
    for (const DeviceBuffer* b : {&enc_blocks, &enc_tiles, &enc_offsets, &enc_stage, &enc_out,
                                  &digest_hashes, &digest_v2_sum, &ap_delta, &ap_patch, &ap_descs, &ap_stage, &ap_computed,
                                  &ap_first_bad, &ap_errors, &ap_pos, &ap_val, &ap_prev, &cx_jobs,
                                  &cx_out, &cx_bytes, &cx_pos, &cx_rank, &cx_cls, &cx_off,
                                  &cs_stage}) {
      n += b->size();
    }
    return n;
  }

  // digest_sum non-null: also the target's digest-v2 mix sum, from the analyze kernel's loads;
  // update_base non-null (== d_base): base := target by the changed elements (kernels.h).
  absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* d_base,
                                              const void* d_target, uint64_t bytes,
                                              const EncodeOptions& options, PatchStats* stats,
                                              DeviceTimings* timings,
                                              uint64_t* digest_sum = nullptr,
                                              void* update_base = nullptr,
                                              const ChangeRecord* prev = nullptr);
  // Format 2 (after analyze): context codes the changed blocks and makes those where that is
  // smaller CONTEXT blocks, in host_blocks and on the device; sets a.ctx_out / a.ctx_off.
  absl::Status ContextBlocks(DType dtype, const ChangeRecord* prev, kern::EncodeArgs& a,
                             StageClock& clock);
  // ContextBlocks' choice: every job whose stream fit and whose entry plus payload is strictly
  // smaller than its v1 form becomes a CONTEXT block (host_blocks, then a.blocks on the device).
  absl::Status AdoptContextBlocks(const std::vector<kern::ContextJob>& jobs,
                                  const std::vector<uint64_t>& v1_total,
                                  const std::vector<uint64_t>& out_bytes, kern::EncodeArgs& a);
  // Encode's steps. Analyze: reserves the block buffers, runs the analyze kernel, copies the
  // block records to host_blocks (and the digest-v2 sum); format 2: ContextBlocks.
  absl::Status EncodeAnalyze(DType dtype, const EncodeOptions& options, const ChangeRecord* prev,
                             kern::EncodeArgs& a, StageClock& clock, uint64_t* digest_sum);
  // Emit (host_offsets planned): writes, checksums and compacts the payloads into `payload`
  // (payload_total bytes), and copies the block records (with checksums) back to host_blocks.
  absl::Status EncodeEmit(kern::EncodeArgs& a, uint64_t stage_total, uint64_t payload_total,
                          uint8_t* payload, StageClock& clock);
  // Apply's steps. Verify: uploads the patch and descriptors, checks every payload checksum
  // (DataLoss naming the first bad block); nothing is written.
  absl::Status ApplyVerify(const kern::ApplyArgs& a, const ApplyPlan& plan,
                           const PatchLayout& layout, std::span<const uint8_t> patch,
                           StageClock& clock);
  // One decode wave, descriptors [lo, hi): decode and validate, then (all valid) the digest
  // delta of the old words and the write.
  absl::Status ApplyWave(const kern::ApplyArgs& a, const ApplyPlan& plan,
                         const PatchLayout& layout, uint64_t lo, uint64_t hi, StageClock& clock);
  // Out of place: out := base (in place or empty: nothing).
  absl::Status CopyBase(const void* d_base, void* d_out, uint64_t bytes, StageClock& clock);
  // digest_delta non-null: also the digest-v2 delta of what is written (LaunchApplyDigestV2Delta).
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base, void* d_out,
                     uint64_t bytes, DeviceTimings* timings, uint64_t* digest_delta,
                     const ChangeRecord* prev);
  absl::StatusOr<kern::ApplyArgs> ApplyArgsFor(const ApplyPlan& plan, uint64_t patch_bytes,
                                               const void* d_base, void* d_out, uint64_t bytes,
                                               DType dtype, bool want_delta);
  absl::StatusOr<uint64_t> Digest(const void* d_data, uint64_t bytes);
  absl::StatusOr<uint64_t> DigestV2(const void* d_data, uint64_t bytes);
  // WriteChanges and RevertChanges: `values` (changes.values or changes.old_values, count()
  // elements) scattered at the changes' positions of d_data. The change set has passed
  // CheckChanges.
  absl::Status ScatterChanges(const TensorChanges& changes, std::span<const uint8_t> values,
                              void* d_data);
};

DeviceCodec::DeviceCodec(void* stream) : impl_(std::make_unique<Impl>()) { impl_->stream = stream; }
DeviceCodec::~DeviceCodec() = default;
DeviceCodec::DeviceCodec(DeviceCodec&&) noexcept = default;
DeviceCodec& DeviceCodec::operator=(DeviceCodec&&) noexcept = default;

absl::StatusOr<std::vector<uint8_t>> DeviceCodec::Encode(DType dtype, const void* d_base,
                                                         const void* d_target, uint64_t bytes,
                                                         const EncodeOptions& options,
                                                         PatchStats* stats,
                                                         DeviceTimings* timings,
                                                         const ChangeRecord* prev) {
  return impl_->Encode(dtype, d_base, d_target, bytes, options, stats, timings, nullptr, nullptr,
                       prev);
}
absl::Status DeviceCodec::Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                                void* d_out, uint64_t bytes, DeviceTimings* timings,
                                const ChangeRecord* prev) {
  return impl_->Apply(patch, dtype, d_base, d_out, bytes, timings, nullptr, prev);
}
absl::StatusOr<uint64_t> DeviceCodec::Digest(const void* d_data, uint64_t bytes) {
  return impl_->Digest(d_data, bytes);
}
absl::StatusOr<DigestV2Delta> DeviceCodec::ApplyDigestV2(std::span<const uint8_t> patch,
                                                         DType dtype, const void* d_base,
                                                         void* d_out, uint64_t bytes,
                                                         DeviceTimings* timings,
                                                         const ChangeRecord* prev) {
  uint64_t sum = 0;
  RETURN_IF_ERROR(impl_->Apply(patch, dtype, d_base, d_out, bytes, timings, &sum, prev));
  return DigestV2Delta::FromSum(sum);
}
absl::StatusOr<uint64_t> DeviceCodec::DigestV2(const void* d_data, uint64_t bytes) {
  return impl_->DigestV2(d_data, bytes);
}
absl::StatusOr<double> DeviceCodec::DeviceCopy(void* d_dst, const void* d_src, uint64_t bytes) {
  RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && (d_dst == nullptr || d_src == nullptr)) {
    return absl::InvalidArgumentError("DeviceCopy: null device pointer");
  }
  rt::Timer timer;
  RETURN_IF_ERROR(timer.Start(impl_->stream));
  RETURN_IF_ERROR(rt::CopyOnDeviceAsync(d_dst, d_src, bytes, impl_->stream));
  RETURN_IF_ERROR(timer.Stop(impl_->stream));
  RETURN_IF_ERROR(rt::StreamSynchronize(impl_->stream));
  return timer.ElapsedMs();
}
absl::Status DeviceCodec::WriteChanges(const TensorChanges& changes, void* d_data,
                                       uint64_t bytes) {
  RETURN_IF_ERROR(CheckChangeArgs(changes, d_data, bytes, "WriteChanges"));
  return impl_->ScatterChanges(changes, changes.values, d_data);
}
absl::Status DeviceCodec::RevertChanges(const TensorChanges& changes, void* d_data,
                                        uint64_t bytes) {
  RETURN_IF_ERROR(CheckChangeArgs(changes, d_data, bytes, "RevertChanges"));
  if (changes.old_values.size() != changes.values.size()) {  // refit::RevertChanges' message
    return absl::InvalidArgumentError(
        absl::StrCat("change set has ", changes.old_values.size(),
                     " bytes of old values (the undo record), its values ", changes.values.size()));
  }
  return impl_->ScatterChanges(changes, changes.old_values, d_data);
}
void DeviceCodec::set_decode_scratch_limit(size_t bytes) { impl_->decode_limit = bytes; }
size_t DeviceCodec::scratch_bytes() const { return impl_->ScratchBytes(); }
void DeviceCodec::ReleaseScratch() {
  void* stream = impl_->stream;
  const size_t limit = impl_->decode_limit;
  impl_ = std::make_unique<Impl>();
  impl_->stream = stream;
  impl_->decode_limit = limit;
}

// ---- encode ---------------------------------------------------------------------------------------

absl::StatusOr<FusedEncoding> DeviceCodec::EncodeFused(DType dtype, void* d_base,
                                                       const void* d_target, uint64_t bytes,
                                                       const EncodeOptions& options,
                                                       bool update_base, DeviceTimings* timings,
                                                       const ChangeRecord* prev) {
  FusedEncoding out;
  uint64_t sum = 0;
  ASSIGN_OR_RETURN(out.patch, impl_->Encode(dtype, d_base, d_target, bytes, options, &out.stats,
                                            timings, &sum, update_base ? d_base : nullptr, prev));
  out.digest_v2 = format::DigestV2Final(sum, bytes);
  return out;
}

// Encode's argument checks: the same, in the same order, as EncodePatch (plus the launch limit).
static absl::Status CheckEncodeArgs(DType dtype, const void* d_base, const void* d_target,
                                    uint64_t bytes, int log2) {
  if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodePatchDevice: invalid dtype code ", static_cast<int>(dtype)));
  }
  if (log2 < format::kMinBlockLog2 || log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: block_log2 ", log2,
                                                   " outside [", format::kMinBlockLog2, ", ",
                                                   format::kMaxBlockLog2, "]"));
  }
  const int w = DTypeSize(dtype);
  if (bytes % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: ", bytes,
                                                   " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements"));
  }
  if (bytes > 0 && (d_base == nullptr || d_target == nullptr)) {
    return absl::InvalidArgumentError("EncodePatchDevice: null device pointer");
  }
  if (!Aligned(d_base, w) || !Aligned(d_target, w)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodePatchDevice: device pointers must be aligned to the element size (", w, " bytes)"));
  }
  const uint64_t n = bytes / w;
  const uint64_t block = uint64_t{1} << log2;
  const uint64_t num_blocks = (n + block - 1) / block;
  if (num_blocks > kern::kMaxGrid) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: ", num_blocks,
                                                   " blocks exceed the launch limit; use a "
                                                   "larger block_log2"));
  }
  return absl::OkStatus();
}

// Encode's plan from the analyzed blocks: each block's slot in the staging buffer (SPARSE:
// 8-aligned) and in the compacted output, its table record (checksum later), and the totals.
static absl::Status PlanEncodeOutput(const std::vector<kern::EncBlock>& blocks, uint64_t* stage_off,
                                     uint64_t* out_off, std::vector<BlockRecord>& records,
                                     uint64_t* stage_total, uint64_t* payload_total) {
  for (uint64_t i = 0; i < records.size(); ++i) {
    const kern::EncBlock& m = blocks[i];
    stage_off[i] = *stage_total;
    out_off[i] = *payload_total;
    if (m.mode != kUnchanged && m.mode != kSparse && m.mode != kDense && m.mode != kContext) {
      return absl::InternalError(absl::StrCat("EncodePatchDevice: block ", i, " has mode ",
                                              int{m.mode}, " (kernel bug)"));
    }
    if (m.mode == kSparse) *stage_total += RoundUp8(m.payload_bytes);
    records[i] = BlockRecord{m.mode, m.kg, m.kr, m.ke, m.count, 0, m.payload_bytes};
    *payload_total += m.payload_bytes;
  }
  return absl::OkStatus();
}

// Encode's kernel arguments for an n-element tensor (buffers are set by the steps that reserve them).
static kern::EncodeArgs EncodeArgsFor(DType dtype, const void* d_base, const void* d_target,
                                      uint64_t n, int log2, void* update_base) {
  const uint64_t block = uint64_t{1} << log2;
  kern::EncodeArgs a;
  a.base = d_base;
  a.target = d_target;
  a.num_elements = n;
  a.num_blocks = (n + block - 1) / block;
  a.width = DTypeSize(dtype);
  a.coding = static_cast<int>(DTypeValueCoding(dtype));
  a.block_log2 = log2;
  a.tiles_per_block = static_cast<uint32_t>((block + kern::kTile - 1) / kern::kTile);
  a.vector_loads = Aligned(d_base, 16) && Aligned(d_target, 16);
  a.update_base = update_base;
  return a;
}

// Encode's argument checks, after CheckEncodeArgs: the format, and a record that covers n.
static absl::Status CheckEncodeFormat(const EncodeOptions& options, const ChangeRecord* prev,
                                      uint64_t n) {
  if (options.format != 1 && options.format != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodePatchDevice: patch format ", options.format, " (this build writes 1 and 2)"));
  }
  if (prev != nullptr && !prev->Covers(n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodePatchDevice: the previous-change record covers ", prev->num_elements,
        " elements (", prev->changed.size(), " and ", prev->down.size(), " words), the tensor ", n));
  }
  return absl::OkStatus();
}

absl::Status DeviceCodec::Impl::EncodeAnalyze(DType dtype, const EncodeOptions& options,
                                              const ChangeRecord* prev, kern::EncodeArgs& a,
                                              StageClock& clock, uint64_t* digest_sum) {
  const uint64_t num_blocks = a.num_blocks;
  unsigned long long host_sum = 0;
  host_blocks.resize(num_blocks);
  if (num_blocks > 0) {
    RETURN_IF_ERROR(Reserve(enc_blocks, num_blocks * sizeof(kern::EncBlock)));
    RETURN_IF_ERROR(Reserve(enc_tiles, num_blocks * a.tiles_per_block * sizeof(kern::TileCarry)));
    RETURN_IF_ERROR(Reserve(enc_offsets, 2 * num_blocks * sizeof(uint64_t)));
    a.blocks = Ptr<kern::EncBlock>(enc_blocks);
    a.tiles = Ptr<kern::TileCarry>(enc_tiles);
    if (digest_sum != nullptr) {
      RETURN_IF_ERROR(Reserve(digest_v2_sum, sizeof(unsigned long long)));
      a.digest_v2_sum = Ptr<unsigned long long>(digest_v2_sum);
      RETURN_IF_ERROR(rt::MemsetAsync(a.digest_v2_sum, 0, sizeof(unsigned long long), stream));
    }
    RETURN_IF_ERROR(clock.Begin("analyze"));
    RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchEncodeAnalyze(a, stream), "EncodeAnalyzeKernel"));
    RETURN_IF_ERROR(clock.End());
    RETURN_IF_ERROR(rt::CopyToHostAsync(host_blocks.data(), a.blocks,
                                        num_blocks * sizeof(kern::EncBlock), stream));
    if (digest_sum != nullptr) {
      RETURN_IF_ERROR(rt::CopyToHostAsync(&host_sum, a.digest_v2_sum, sizeof host_sum, stream));
    }
    RETURN_IF_ERROR(rt::StreamSynchronize(stream));
    if (options.format == 2) RETURN_IF_ERROR(ContextBlocks(dtype, prev, a, clock));
  }
  if (digest_sum != nullptr) *digest_sum = host_sum;
  return absl::OkStatus();
}

absl::Status DeviceCodec::Impl::EncodeEmit(kern::EncodeArgs& a, uint64_t stage_total,
                                           uint64_t payload_total, uint8_t* payload,
                                           StageClock& clock) {
  const uint64_t num_blocks = a.num_blocks;
  if (num_blocks == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Reserve(enc_stage, std::max<uint64_t>(stage_total, 8)));
  RETURN_IF_ERROR(Reserve(enc_out, std::max<uint64_t>(payload_total, 8)));
  a.stage_off = Ptr<uint64_t>(enc_offsets);
  a.out_off = Ptr<uint64_t>(enc_offsets) + num_blocks;
  a.stage = Ptr<uint8_t>(enc_stage);
  a.out = Ptr<uint8_t>(enc_out);
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(enc_offsets.data(), host_offsets.data(),
                                        2 * num_blocks * sizeof(uint64_t), stream));
  RETURN_IF_ERROR(clock.Begin("emit"));
  RETURN_IF_ERROR(rt::MemsetAsync(a.stage, 0, stage_total, stream));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchEncodeWrite(a, stream), "EncodeWriteKernel"));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchEncodeChecksum(a, stream), "EncodeChecksumKernel"));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchEncodeCompact(a, stream), "EncodeCompactKernel"));
  RETURN_IF_ERROR(clock.End());
  RETURN_IF_ERROR(clock.Begin("d2h"));
  RETURN_IF_ERROR(rt::CopyToHostAsync(payload, a.out, payload_total, stream));
  RETURN_IF_ERROR(clock.End());
  RETURN_IF_ERROR(rt::CopyToHostAsync(host_blocks.data(), a.blocks,
                                      num_blocks * sizeof(kern::EncBlock), stream));
  RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  return clock.Finish();
}

// Encode's last step: the checksums, which arrived with the second copy of the block records.
static absl::Status TakeChecksums(const std::vector<kern::EncBlock>& blocks,
                                  std::vector<BlockRecord>& records) {
  for (uint64_t i = 0; i < records.size(); ++i) {
    const kern::EncBlock& m = blocks[i];
    if (m.error != 0) {
      return absl::InternalError(absl::StrCat(
          "EncodePatchDevice: block ", i, ": the GPU encoder's bit layout is inconsistent (bug)"));
    }
    records[i].checksum = m.checksum;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> DeviceCodec::Impl::Encode(
    DType dtype, const void* d_base, const void* d_target, uint64_t bytes,
    const EncodeOptions& options, PatchStats* stats, DeviceTimings* timings,
    uint64_t* digest_sum, void* update_base, const ChangeRecord* prev) {
  RETURN_IF_ERROR(CheckDevice());
  const int log2 = options.block_log2;
  RETURN_IF_ERROR(CheckEncodeArgs(dtype, d_base, d_target, bytes, log2));
  const uint64_t n = bytes / DTypeSize(dtype);
  RETURN_IF_ERROR(CheckEncodeFormat(options, prev, n));
  StageClock clock(timings, stream);
  kern::EncodeArgs a = EncodeArgsFor(dtype, d_base, d_target, n, log2, update_base);
  RETURN_IF_ERROR(EncodeAnalyze(dtype, options, prev, a, clock, digest_sum));

  // Plan: payload offsets in the compacted output and, for SPARSE blocks, 8-aligned slots in the
  // staging buffer; the table's size (its contents wait for the checksums).
  const uint64_t num_blocks = a.num_blocks;
  host_offsets.resize(2 * num_blocks);
  uint64_t stage_total = 0, payload_total = 0;
  std::vector<BlockRecord> records(num_blocks);
  RETURN_IF_ERROR(PlanEncodeOutput(host_blocks, host_offsets.data(),
                                   host_offsets.data() + num_blocks, records, &stage_total,
                                   &payload_total));
  const uint64_t table_bytes = BlockTableBytes(records);
  std::vector<uint8_t> patch(format::kHeaderBytes + table_bytes + payload_total);
  RETURN_IF_ERROR(EncodeEmit(a, stage_total, payload_total,
                             patch.data() + format::kHeaderBytes + table_bytes, clock));
  RETURN_IF_ERROR(TakeChecksums(host_blocks, records));
  PatchStats st;
  WritePatchHead(dtype, log2, n, records, patch, &st, ConditionedFingerprint(records, prev));
  if (stats != nullptr) *stats = st;
  return patch;
}

// Format 2's candidates [codec.cc TryContextBlock]: each changed block whose CONTEXT entry and
// payload could be strictly smaller than its v1 form, with the capacity that leaves its stream.
// v1_total gets each job's v1 entry plus payload bytes.
static std::vector<kern::ContextJob> PlanContextJobs(const std::vector<kern::EncBlock>& blocks,
                                                     uint64_t num_elements, int log2, int width,
                                                     std::vector<uint64_t>* v1_total,
                                                     uint64_t* out_total) {
  std::vector<kern::ContextJob> jobs;
  for (uint64_t b = 0; b < blocks.size(); ++b) {
    const kern::EncBlock& m = blocks[b];
    if (m.mode == kUnchanged || m.count == 0) continue;
    const uint64_t len = std::min<uint64_t>(uint64_t{1} << log2, num_elements - (b << log2));
    const uint64_t dense_bytes = len * static_cast<uint64_t>(width);
    const uint64_t total =
        EntryBytes(BlockRecord{m.mode, m.kg, m.kr, m.ke, m.count, 0, m.payload_bytes}) +
        m.payload_bytes;
    const uint64_t least_entry = EntryBytes(BlockRecord{kContext, 0, 0, 0, m.count, 0, 1});
    if (total <= least_entry + 1) continue;
    const uint64_t capacity = std::min(total - least_entry - 1, dense_bytes - 1);
    if (capacity == 0) continue;
    jobs.push_back(kern::ContextJob{b, 0, *out_total, capacity, m.count, 0});
    v1_total->push_back(total);
    *out_total += capacity;
  }
  return jobs;
}

// The jobs' scratch slots, in waves of at most `wave_changes` changes (a job always fits alone).
static std::vector<std::pair<uint64_t, uint64_t>> PlanContextWaves(
    std::vector<kern::ContextJob>& jobs, uint64_t wave_changes, uint64_t* max_wave) {
  std::vector<std::pair<uint64_t, uint64_t>> waves;
  uint64_t lo = 0, used = 0;
  for (uint64_t j = 0; j < jobs.size(); ++j) {
    if (used > 0 && used + jobs[j].count > wave_changes) {
      waves.emplace_back(lo, j);
      lo = j;
      used = 0;
    }
    jobs[j].scratch_off = used;
    used += jobs[j].count;
    *max_wave = std::max(*max_wave, used);
  }
  if (lo < jobs.size()) waves.emplace_back(lo, jobs.size());
  return waves;
}

absl::Status DeviceCodec::Impl::ContextBlocks(DType dtype, const ChangeRecord* prev,
                                              kern::EncodeArgs& a, StageClock& clock) {
  std::vector<uint64_t> v1_total;
  uint64_t out_total = 0;
  std::vector<kern::ContextJob> jobs = PlanContextJobs(host_blocks, a.num_elements,
                                                       a.block_log2, a.width, &v1_total,
                                                       &out_total);
  if (jobs.empty()) return absl::OkStatus();
  uint64_t max_wave = 0;
  const auto waves = PlanContextWaves(
      jobs, std::max<uint64_t>(1, decode_limit / kContextChangeBytes), &max_wave);
  const uint64_t nj = jobs.size();
  RETURN_IF_ERROR(Reserve(cx_jobs, nj * sizeof(kern::ContextJob)));
  RETURN_IF_ERROR(Reserve(cx_out, std::max<uint64_t>(out_total, 8)));
  RETURN_IF_ERROR(Reserve(cx_bytes, nj * sizeof(uint64_t)));
  RETURN_IF_ERROR(Reserve(cx_pos, max_wave * sizeof(uint32_t)));
  RETURN_IF_ERROR(Reserve(cx_rank, max_wave * sizeof(uint32_t)));
  RETURN_IF_ERROR(Reserve(cx_cls, max_wave));
  kern::ContextEncodeArgs ca;
  ca.base = a.base;
  ca.target = a.target;
  ca.num_elements = a.num_elements;
  ca.width = a.width;
  ca.coding = a.coding;
  ca.block_log2 = a.block_log2;
  ca.field = FieldArgs(dtype);
  if (prev != nullptr) {
    RETURN_IF_ERROR(UploadRecord(*prev, ap_prev, stream));
    ca.prev_changed = Ptr<uint64_t>(ap_prev);
    ca.prev_down = Ptr<uint64_t>(ap_prev) + prev->changed.size();
  }
  ca.jobs = Ptr<kern::ContextJob>(cx_jobs);
  ca.scratch_pos = Ptr<uint32_t>(cx_pos);
  ca.scratch_rank = Ptr<uint32_t>(cx_rank);
  ca.scratch_cls = Ptr<uint8_t>(cx_cls);
  ca.out = Ptr<uint8_t>(cx_out);
  ca.out_bytes = Ptr<uint64_t>(cx_bytes);
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(cx_jobs.data(), jobs.data(), nj * sizeof(kern::ContextJob), stream));
  RETURN_IF_ERROR(clock.Begin("context"));
  for (const auto& [lo, hi] : waves) {
    RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchContextEncode(ca, lo, hi, stream), "ContextEncodeKernel"));
  }
  RETURN_IF_ERROR(clock.End());
  std::vector<uint64_t> out_bytes(nj);
  RETURN_IF_ERROR(rt::CopyToHostAsync(out_bytes.data(), ca.out_bytes, nj * sizeof(uint64_t), stream));
  RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  return AdoptContextBlocks(jobs, v1_total, out_bytes, a);
}

absl::Status DeviceCodec::Impl::AdoptContextBlocks(const std::vector<kern::ContextJob>& jobs,
                                                   const std::vector<uint64_t>& v1_total,
                                                   const std::vector<uint64_t>& out_bytes,
                                                   kern::EncodeArgs& a) {
  std::vector<uint64_t> ctx_off(host_blocks.size(), 0);
  bool any = false;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const uint64_t bytes = out_bytes[j];
    if (bytes == kern::kContextCountMismatch || bytes > jobs[j].capacity) {
      return absl::InternalError(absl::StrCat("EncodePatchDevice: block ", jobs[j].block,
                                              ": the GPU context coder disagrees with the analysis "
                                              "(kernel bug)"));
    }
    if (bytes == 0) continue;
    const BlockRecord ctx{kContext, 0, 0, 0, jobs[j].count, 0, bytes};
    if (EntryBytes(ctx) + bytes >= v1_total[j]) continue;
    kern::EncBlock& m = host_blocks[jobs[j].block];
    m = kern::EncBlock{0, bytes, jobs[j].count, 0, kContext, 0, 0, 0, 0};
    ctx_off[jobs[j].block] = jobs[j].out_off;
    any = true;
  }
  if (!any) return absl::OkStatus();
  RETURN_IF_ERROR(Reserve(cx_off, ctx_off.size() * sizeof(uint64_t)));
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(cx_off.data(), ctx_off.data(), ctx_off.size() * sizeof(uint64_t), stream));
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(a.blocks, host_blocks.data(),
                                        host_blocks.size() * sizeof(kern::EncBlock), stream));
  a.ctx_out = Ptr<uint8_t>(cx_out);
  a.ctx_off = Ptr<uint64_t>(cx_off);
  return absl::OkStatus();
}

// ---- apply ----------------------------------------------------------------------------------------

// Apply's pointer checks (as ApplyPatch's): non-null, element-aligned, the output either the base
// itself (in place) or disjoint from it.
static absl::Status CheckApplyPointers(const void* d_base, void* d_out, uint64_t bytes,
                                               int w) {
  if (bytes > 0 && (d_base == nullptr || d_out == nullptr)) {
    return absl::InvalidArgumentError("ApplyPatchDevice: null device pointer");
  }
  if (!Aligned(d_base, w) || !Aligned(d_out, w)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ApplyPatchDevice: device pointers must be aligned to the element size (", w, " bytes)"));
  }
  const uintptr_t ob = reinterpret_cast<uintptr_t>(d_out), bb = reinterpret_cast<uintptr_t>(d_base);
  if (ob != bb && ob < bb + bytes && bb < ob + bytes) {
    return absl::InvalidArgumentError("ApplyPatchDevice: output partially overlaps the base");
  }
  return absl::OkStatus();
}

// Apply's device buffers for `plan` (reserved) and the kernels' arguments.
absl::StatusOr<kern::ApplyArgs> DeviceCodec::Impl::ApplyArgsFor(const ApplyPlan& plan,
                                                                uint64_t patch_bytes,
                                                                const void* d_base, void* d_out,
                                                                uint64_t bytes, DType dtype,
                                                                bool want_delta) {
  const uint64_t nd = plan.descs.size();
  const uint64_t stage_total = plan.stage_total;
  const uint64_t max_wave_changes = plan.max_wave_changes;
  const int w = DTypeSize(dtype);
  RETURN_IF_ERROR(Reserve(ap_patch, patch_bytes));
  RETURN_IF_ERROR(Reserve(ap_descs, nd * sizeof(kern::ApplyDesc)));
  RETURN_IF_ERROR(Reserve(ap_stage, stage_total));
  RETURN_IF_ERROR(Reserve(ap_computed, nd * sizeof(uint32_t)));
  RETURN_IF_ERROR(Reserve(ap_first_bad, sizeof(unsigned long long)));
  RETURN_IF_ERROR(Reserve(ap_errors, nd * sizeof(kern::ApplyError)));
  RETURN_IF_ERROR(Reserve(ap_pos, std::max<uint64_t>(max_wave_changes, 1) * sizeof(uint32_t)));
  RETURN_IF_ERROR(Reserve(ap_val, std::max<uint64_t>(max_wave_changes, 1) * sizeof(uint64_t)));

  kern::ApplyArgs a;
  a.patch = Ptr<uint8_t>(ap_patch);
  a.descs = Ptr<kern::ApplyDesc>(ap_descs);
  a.num_descs = nd;
  a.stage = Ptr<uint8_t>(ap_stage);
  a.computed = Ptr<uint32_t>(ap_computed);
  a.first_bad = Ptr<unsigned long long>(ap_first_bad);
  a.errors = Ptr<kern::ApplyError>(ap_errors);
  a.scratch_pos = Ptr<uint32_t>(ap_pos);
  a.scratch_val = Ptr<uint64_t>(ap_val);
  a.base = d_base;
  a.out = d_out;
  a.width = w;
  a.coding = static_cast<int>(DTypeValueCoding(dtype));
  a.field = FieldArgs(dtype);
  a.tensor_bytes = bytes;
  if (want_delta) {
    RETURN_IF_ERROR(Reserve(ap_delta, sizeof(unsigned long long)));
    a.digest_delta = Ptr<unsigned long long>(ap_delta);
    RETURN_IF_ERROR(rt::MemsetAsync(a.digest_delta, 0, sizeof(unsigned long long), stream));
  }

  return a;
}

absl::Status DeviceCodec::Impl::ApplyVerify(const kern::ApplyArgs& a, const ApplyPlan& plan,
                                            const PatchLayout& layout,
                                            std::span<const uint8_t> patch, StageClock& clock) {
  const std::vector<kern::ApplyDesc>& descs = plan.descs;
  const uint64_t nd = descs.size();
  RETURN_IF_ERROR(clock.Begin("h2d"));
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(ap_patch.data(), patch.data(), patch.size(), stream));
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(ap_descs.data(), descs.data(), nd * sizeof(kern::ApplyDesc), stream));
  RETURN_IF_ERROR(clock.End());
  RETURN_IF_ERROR(clock.Begin("verify"));
  RETURN_IF_ERROR(rt::MemsetAsync(a.first_bad, 0xff, sizeof(unsigned long long), stream));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyStage(a, stream), "ApplyStageKernel"));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyVerify(a, stream), "ApplyVerifyKernel"));
  RETURN_IF_ERROR(clock.End());
  unsigned long long first_bad = 0;
  RETURN_IF_ERROR(rt::CopyToHostAsync(&first_bad, a.first_bad, sizeof first_bad, stream));
  RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (first_bad == ~0ull) return absl::OkStatus();
  if (first_bad >= nd) return absl::InternalError("ApplyPatchDevice: bad checksum index (bug)");
  uint32_t computed = 0;
  RETURN_IF_ERROR(rt::CopyToHost(&computed, a.computed + first_bad, sizeof computed));
  const kern::ApplyDesc& d = descs[first_bad];
  return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(d.block_index, layout.blocks[d.block_index]),
                                          ": payload checksum mismatch (table says ", d.checksum,
                                          ", payload hashes to ", computed, ")"));
}

absl::Status DeviceCodec::Impl::ApplyWave(const kern::ApplyArgs& a, const ApplyPlan& plan,
                                          const PatchLayout& layout, uint64_t lo, uint64_t hi,
                                          StageClock& clock) {
  RETURN_IF_ERROR(clock.Begin("decode"));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyDecode(a, lo, hi, stream), "ApplyDecodeKernel"));
  RETURN_IF_ERROR(clock.End());
  unsigned long long first_bad = 0;
  RETURN_IF_ERROR(rt::CopyToHostAsync(&first_bad, a.first_bad, sizeof first_bad, stream));
  RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (first_bad != ~0ull) {
    if (first_bad < lo || first_bad >= hi) {
      return absl::InternalError("ApplyPatchDevice: bad decoder error index (bug)");
    }
    kern::ApplyError e{};
    RETURN_IF_ERROR(rt::CopyToHost(&e, a.errors + first_bad, sizeof e));
    const kern::ApplyDesc& d = plan.descs[first_bad];
    return absl::DataLossError(DecodeFailure(
        absl::StrCat("patch ", DescribeBlock(d.block_index, layout.blocks[d.block_index])), d, e));
  }
  if (a.digest_delta != nullptr) {  // reads the wave's old words before the write below
    RETURN_IF_ERROR(clock.Begin("digest_delta"));
    RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyDigestV2Delta(a, lo, hi, stream),
                                    "ApplyDigestV2DeltaKernel"));
    RETURN_IF_ERROR(clock.End());
  }
  RETURN_IF_ERROR(clock.Begin("write"));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyWrite(a, lo, hi, stream), "ApplyWriteKernel"));
  return clock.End();
}

absl::Status DeviceCodec::Impl::CopyBase(const void* d_base, void* d_out, uint64_t bytes,
                                         StageClock& clock) {
  if (d_out == d_base || bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(clock.Begin("copy"));
  RETURN_IF_ERROR(rt::CopyOnDeviceAsync(d_out, d_base, bytes, stream));
  return clock.End();
}

absl::Status DeviceCodec::Impl::Apply(std::span<const uint8_t> patch, DType dtype,
                                      const void* d_base, void* d_out, uint64_t bytes,
                                      DeviceTimings* timings, uint64_t* digest_delta,
                                      const ChangeRecord* prev) {
  RETURN_IF_ERROR(CheckDevice());
  // The same checks, in the same order and with the same messages, as ApplyPatch.
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatchFor(patch, dtype, bytes));
  const int w = DTypeSize(dtype);
  RETURN_IF_ERROR(CheckApplyPointers(d_base, d_out, bytes, w));
  ASSIGN_OR_RETURN(const ChangeRecord* record, RecordForPatch(layout, prev));
  StageClock clock(timings, stream);

  // Descriptors of the changed blocks; decode waves over them.
  ApplyPlan plan = PlanApply(layout, decode_limit);
  if (digest_delta != nullptr) *digest_delta = 0;
  if (plan.descs.empty()) {
    RETURN_IF_ERROR(CopyBase(d_base, d_out, bytes, clock));
    RETURN_IF_ERROR(rt::StreamSynchronize(stream));
    return clock.Finish();
  }
  if (plan.descs.size() > kern::kMaxGrid) {
    return absl::InvalidArgumentError("ApplyPatchDevice: too many changed blocks for one launch");
  }
  ASSIGN_OR_RETURN(kern::ApplyArgs a, ApplyArgsFor(plan, patch.size(), d_base, d_out, bytes, dtype,
                                                  digest_delta != nullptr));
  if (record != nullptr) {
    RETURN_IF_ERROR(UploadRecord(*record, ap_prev, stream));
    a.prev_changed = Ptr<uint64_t>(ap_prev);
    a.prev_down = Ptr<uint64_t>(ap_prev) + record->changed.size();
  }
  // Phase 1: upload, stage, verify every checksum. Nothing is written to d_out.
  RETURN_IF_ERROR(ApplyVerify(a, plan, layout, patch, clock));
  // Phase 2: out of place, out = base; then per wave: decode and validate, and only if the whole
  // wave is valid, write it.
  RETURN_IF_ERROR(CopyBase(d_base, d_out, bytes, clock));
  for (const auto& [lo, hi] : plan.waves) {
    RETURN_IF_ERROR(ApplyWave(a, plan, layout, lo, hi, clock));
  }
  unsigned long long sum = 0;
  if (digest_delta != nullptr) {
    RETURN_IF_ERROR(rt::CopyToHostAsync(&sum, a.digest_delta, sizeof sum, stream));
  }
  RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (digest_delta != nullptr) *digest_delta = sum;
  return clock.Finish();
}

// ---- digest ---------------------------------------------------------------------------------------

absl::StatusOr<uint64_t> DeviceCodec::Impl::Digest(const void* d_data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError("TensorDigestDevice: null device pointer");
  }
  const uint64_t chunks = (bytes + format::kDigestChunkBytes - 1) / format::kDigestChunkBytes;
  if (chunks > kern::kMaxGrid) return absl::InvalidArgumentError("TensorDigestDevice: tensor too large");
  std::vector<uint64_t> hashes(chunks);
  if (chunks > 0) {
    RETURN_IF_ERROR(Reserve(digest_hashes, chunks * sizeof(uint64_t)));
    RETURN_IF_ERROR(rt::CheckLaunch(
        kern::LaunchDigestChunks(d_data, bytes, chunks, Ptr<uint64_t>(digest_hashes), stream),
        "DigestChunksKernel"));
    RETURN_IF_ERROR(rt::CopyToHostAsync(hashes.data(), digest_hashes.data(), chunks * sizeof(uint64_t), stream));
    RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  }
  return CombineChunkHashes(hashes, bytes);
}

// ---- change sets -----------------------------------------------------------------------------------

absl::Status DeviceCodec::Impl::ScatterChanges(const TensorChanges& changes,
                                               std::span<const uint8_t> values, void* d_data) {
  const uint64_t n = changes.count();
  if (n == 0) return absl::OkStatus();
  const int w = DTypeSize(changes.dtype);
  // [positions: 8n][values: wn]; both parts stay aligned to w (cudaMalloc: 256).
  const uint64_t pos_bytes = n * sizeof(uint64_t);
  const uint64_t val_bytes = n * static_cast<uint64_t>(w);
  RETURN_IF_ERROR(Reserve(cs_stage, pos_bytes + val_bytes));
  uint8_t* d_stage = Ptr<uint8_t>(cs_stage);
  kern::ScatterChangesArgs a;
  a.data = d_data;
  a.positions = reinterpret_cast<const uint64_t*>(d_stage);
  a.values = d_stage + pos_bytes;
  a.count = n;
  a.width = w;
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(d_stage, changes.positions.data(), pos_bytes, stream));
  RETURN_IF_ERROR(rt::CopyToDeviceAsync(d_stage + pos_bytes, values.data(), val_bytes, stream));
  RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchScatterChanges(a, stream), "ScatterChangesKernel"));
  return rt::StreamSynchronize(stream);
}

absl::StatusOr<uint64_t> DeviceCodec::Impl::DigestV2(const void* d_data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError("DigestV2 (device): null device pointer");
  }
  const uint64_t grid = ((bytes + 7) / 8 + kern::kDigestV2BlockWords - 1) / kern::kDigestV2BlockWords;
  if (grid > kern::kMaxGrid) return absl::InvalidArgumentError("DigestV2 (device): tensor too large");
  unsigned long long sum = 0;
  if (grid > 0) {
    RETURN_IF_ERROR(Reserve(digest_v2_sum, sizeof(unsigned long long)));
    auto* d_sum = Ptr<unsigned long long>(digest_v2_sum);
    RETURN_IF_ERROR(rt::MemsetAsync(d_sum, 0, sizeof(unsigned long long), stream));
    RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchDigestV2(d_data, bytes, d_sum, stream), "DigestV2Kernel"));
    RETURN_IF_ERROR(rt::CopyToHostAsync(&sum, d_sum, sizeof sum, stream));
    RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  }
  return format::DigestV2Final(sum, bytes);
}

}  // namespace refit::cuda
