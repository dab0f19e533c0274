#include "daemon/publisher/publisher_core.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/publisher/baseline_persister.h"
#include "daemon/publisher/patch_log.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t MicrosSince(Clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
}

uint64_t UnixNanosNow() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

constexpr char kBaselineFile[] = "baseline.safetensors";
constexpr char kMetaFormat[] = "refit.format";
constexpr char kMetaVersion[] = "refit.version";
constexpr char kMetaVersionDigest[] = "refit.version_digest";
constexpr char kMetaDigests[] = "refit.digests";
constexpr char kMetaSnapshot[] = "refit.snapshot_unix_nanos";
constexpr char kMetaLineage[] = "refit.lineage";
constexpr char kFormatValue[] = "1";

std::string Hex64(uint64_t v) { return absl::StrCat(absl::Hex(v, absl::kZeroPad16)); }

bool ParseHex64(const std::string& s, uint64_t* out) {
  if (s.size() != 16) return false;
  return absl::SimpleHexAtoi(s, out);
}

const BaselineTensor* FindByName(const std::vector<BaselineTensor>& v, const std::string& name) {
  auto it = std::lower_bound(v.begin(), v.end(), name,
                             [](const BaselineTensor& t, const std::string& n) {
                               return t.spec.name() < n;
                             });
  return it != v.end() && it->spec.name() == name ? &*it : nullptr;
}

uint64_t ElementsOf(const v1::TensorSpec& spec) {
  auto n = sync::ElementCount(spec);
  return n.ok() ? *n : 0;
}


// What the encoding of one version produced, tensors in name order.
struct Encoded {
  std::vector<BaselineTensor> next;
  std::vector<bool> unchanged;              // same spec and bytes as the previous version
  std::vector<sync::PatchBytes> patches;    // null: unchanged or keyframe
  std::vector<uint64_t> changed;            // encoder's changed elements (patched tensors)
  // StreamPass::defer_v1: the patched tensors' (`pending`) v1 digests are not computed yet
  // (digest 0) until FillDeferredV1.
  bool v1_deferred = false;
  // GPU encoding: the GPU baseline of `next` (every tensor that has one), by name.
  std::map<std::string, std::shared_ptr<const DeviceBytes>> gpu;
  // CPU one pass: changed tensors whose next[k].bytes is still null. Each becomes its previous
  // baseline buffer patched in place, or a copy of the caller's bytes (UpdateBaselineBytes).
  struct Pending {
    size_t k = 0;
    std::shared_ptr<const std::vector<uint8_t>> base;  // the previous version's buffer
    std::span<const uint8_t> target;                   // the caller's bytes (valid in Publish)
    std::shared_ptr<const std::vector<uint8_t>> owned;  // TensorInput::owned holding target
    // The pass's change log of this tensor (input `index` of its batch): the in-place update
    // writes only the changed elements from it, without decoding the patch.
    std::shared_ptr<const EncodedChanges> changes;
    size_t index = 0;
  };
  std::vector<Pending> pending;
};

void ResizeEncoded(size_t n, Encoded* out) {
  out->next.resize(n);
  out->unchanged.assign(n, false);
  out->patches.assign(n, nullptr);
  out->changed.assign(n, 0);
}

bool SameSpecAs(const BaselineTensor* p, const v1::TensorSpec& spec) {
  return p != nullptr && sync::SameSpec(p->spec, spec);
}

// Copies between host and a DeviceBytes' memory: pinned memory is host memory (a memcpy),
// device memory takes the device's copies.
absl::Status ToMemory(const DeviceBytes& dst, const uint8_t* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst.memory.kind() == cuda::Allocation::Kind::kPinnedHost) {
    std::memcpy(dst.memory.data(), src, bytes);
    return absl::OkStatus();
  }
  return dst.device->CopyToDevice(dst.memory.data(), src, bytes);
}
absl::Status FromMemory(uint8_t* dst, const DeviceBytes& src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src.memory.kind() == cuda::Allocation::Kind::kPinnedHost) {
    std::memcpy(dst, src.memory.data(), bytes);
    return absl::OkStatus();
  }
  return src.device->CopyToHost(dst, src.memory.data(), bytes);
}

// `host` in new memory of `kind` on `device`.
absl::StatusOr<std::shared_ptr<const DeviceBytes>> Upload(cuda::Device* device,
                                                          cuda::Allocation::Kind kind,
                                                          std::span<const uint8_t> host) {
  auto out = std::make_shared<DeviceBytes>();
  out->device = device;
  ASSIGN_OR_RETURN(out->memory, device->Allocate(host.size(), kind));
  RETURN_IF_ERROR(ToMemory(*out, host.data(), host.size()));
  return std::shared_ptr<const DeviceBytes>(std::move(out));
}

absl::Status Prefix(const std::string& what, const absl::Status& st) {
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

// The CPU codec's options of this publisher.
EncodeOptions CodecOptionsOf(const PublisherOptions& options) {
  EncodeOptions eo;
  eo.threads = options.encode_threads;
  eo.block_log2 = options.block_log2;
  eo.format = options.patch_format;
  return eo;
}

// The CPU codec's copying path (options.cpu_one_pass false, for benchmarks): memcmp, snapshot
// copy, digest of the copy, encode (four reads). Host bytes of every input (no DeviceBytes).
absl::Status EncodeOnCpuCopying(const PublisherOptions& options, std::span<const TensorInput> inputs,
                         const std::vector<size_t>& order, const std::vector<v1::TensorSpec>& specs,
                         const std::vector<BaselineTensor>& prev, const std::string& where,
                         Encoded* out, PublishSummary* sum) {
  ResizeEncoded(order.size(), out);
  // Snapshot: copy changed bytes; reuse the previous buffer of tensors whose bytes are equal.
  std::vector<const BaselineTensor*> bases(order.size(), nullptr);  // same spec, bytes differ
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.spec = specs[order[k]];
    t.dtype = in.dtype;
    const BaselineTensor* p = FindByName(prev, in.name);
    const bool same_spec = SameSpecAs(p, t.spec);
    if (same_spec && (in.data.empty() ||
                      std::memcmp(p->bytes->data(), in.data.data(), in.data.size()) == 0)) {
      t.bytes = p->bytes;
      t.digest = p->digest;
      out->unchanged[k] = true;
      continue;
    }
    t.bytes = in.owned != nullptr && in.owned->data() == in.data.data() &&
                      in.owned->size() == in.data.size()
                  ? in.owned
                  : std::make_shared<const std::vector<uint8_t>>(in.data.begin(), in.data.end());
    if (same_spec) bases[k] = p;
  }
  // From here on only our own copies are read: the caller's buffers are free.

  const auto digest_start = Clock::now();
  for (size_t k = 0; k < out->next.size(); ++k) {
    if (!out->unchanged[k]) {
      out->next[k].digest = TensorDigest(*out->next[k].bytes, options.digest_threads);
    }
  }
  sum->digest_micros += MicrosSince(digest_start);

  // Encode every changed tensor with a usable base in one call.
  std::vector<EncodeInput> enc;
  std::vector<size_t> enc_index;
  for (size_t k = 0; k < out->next.size(); ++k) {
    if (bases[k] == nullptr) continue;
    EncodeInput e;
    e.dtype = out->next[k].dtype;
    e.base = *bases[k]->bytes;
    e.target = *out->next[k].bytes;
    enc.push_back(e);
    enc_index.push_back(k);
  }
  if (enc.empty()) return absl::OkStatus();
  const auto encode_start = Clock::now();
  const EncodeOptions eo = CodecOptionsOf(options);
  std::vector<PatchStats> stats;
  auto encoded = EncodePatches(enc, eo, &stats);
  if (!encoded.ok()) {
    return absl::InternalError(absl::StrCat(where, ": encoding failed: ",
                                            encoded.status().message()));
  }
  sum->encode_micros = MicrosSince(encode_start);
  for (size_t j = 0; j < enc_index.size(); ++j) {
    const size_t k = enc_index[j];
    out->patches[k] = std::make_shared<const std::vector<uint8_t>>(std::move((*encoded)[j]));
    out->changed[k] = j < stats.size() ? stats[j].changed_elements : ElementsOf(out->next[k].spec);
  }
  return absl::OkStatus();
}

// `in.data` as a buffer of its own: the caller's `owned` when it holds exactly those bytes, else
// a copy.
std::shared_ptr<const std::vector<uint8_t>> OwnBytes(std::span<const uint8_t> data,
                                                     const std::shared_ptr<const std::vector<uint8_t>>& owned) {
  if (owned != nullptr && owned->data() == data.data() && owned->size() == data.size()) {
    return owned;
  }
  // Non-const vector: the one pass may later patch its elements in place (BaselineTensor).
  return std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
}

// CPU one pass, step 1: what each tensor needs. Same spec as before: encoded against its
// baseline (returned, in `order` positions); empty: unchanged; new or reshaped: a keyframe,
// copied and digested here.
std::vector<const BaselineTensor*> ClassifyForPass(const PublisherOptions& options,
                                                   std::span<const TensorInput> inputs,
                                                   const std::vector<size_t>& order,
                                                   const std::vector<v1::TensorSpec>& specs,
                                                   const std::vector<BaselineTensor>& prev,
                                                   Encoded* out, PublishSummary* sum) {
  std::vector<const BaselineTensor*> bases(order.size(), nullptr);
  const auto digest_start = Clock::now();
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.spec = specs[order[k]];
    t.dtype = in.dtype;
    const BaselineTensor* p = FindByName(prev, in.name);
    if (SameSpecAs(p, t.spec) && !in.data.empty()) {
      bases[k] = p;
    } else if (SameSpecAs(p, t.spec)) {  // no bytes: nothing can differ
      t.bytes = p->bytes;
      t.digest = p->digest;
      t.digest_v2 = p->digest_v2;
      out->unchanged[k] = true;
    } else {
      t.bytes = OwnBytes(in.data, in.owned);
      t.digest = TensorDigest(*t.bytes, options.digest_threads);
      t.digest_v2 = TensorDigestV2(*t.bytes, options.digest_threads);
    }
  }
  sum->digest_micros += MicrosSince(digest_start);
  return bases;
}

// Streamed transfers: where the one pass hands each tensor's object as soon as it exists.
struct StreamPass {
  LiveVersion* live = nullptr;  // null: not streamed
  uint64_t batch_bytes = 0;     // 0: one batch
  const std::function<absl::Status(size_t, size_t)>* hook = nullptr;
  // The changed tensors' v1 digests are left to after the v2 End (Encoded::v1_deferred).
  bool defer_v1 = false;
};

// CPU one pass, one batch: the tensors `ks` (name-order indices, each with a base) compared,
// encoded and digested by one EncodePatchesWithDigests.
absl::Status EncodeBatch(const PublisherOptions& options, std::span<const TensorInput> inputs,
                         const std::vector<size_t>& order,
                         const std::vector<const BaselineTensor*>& bases,
                         std::span<const size_t> ks, const std::string& where, bool defer_v1,
                         Encoded* out) {
  std::vector<EncodeInput> enc;
  for (size_t k : ks) enc.push_back({out->next[k].dtype, *bases[k]->bytes, inputs[order[k]].data});
  std::vector<PatchStats> stats;
  std::vector<uint64_t> digests;
  auto changes = std::make_shared<EncodedChanges>();
  auto encoded = EncodePatchesWithChanges(enc, CodecOptionsOf(options), &stats,
                                          defer_v1 ? nullptr : &digests, changes.get());
  if (!encoded.ok()) {
    return absl::InternalError(absl::StrCat(where, ": encoding failed: ",
                                            encoded.status().message()));
  }
  for (size_t j = 0; j < ks.size(); ++j) {
    const size_t k = ks[j];
    const BaselineTensor* p = bases[k];
    BaselineTensor& t = out->next[k];
    if (stats[j].changed_elements == 0) {  // bit patterns compared: the same bytes
      t.bytes = p->bytes;
      t.digest = p->digest;
      t.digest_v2 = p->digest_v2;
      out->unchanged[k] = true;
      continue;
    }
    t.digest = defer_v1 ? 0 : digests[j];
    // The scan's delta: the v2 digest is known before any byte of the baseline changes.
    t.digest_v2 = changes->DigestV2DeltaOf(j).ApplyTo(p->digest_v2, enc[j].target.size());
    out->patches[k] = std::make_shared<const std::vector<uint8_t>>(std::move((*encoded)[j]));
    out->changed[k] = stats[j].changed_elements;
    const TensorInput& in = inputs[order[k]];
    out->pending.push_back({k, p->bytes, in.data, in.owned, changes, j});
  }
  return absl::OkStatus();
}

// The end of the batch of `ks` starting at b: about batch_bytes of target bytes (at least one
// tensor); everything when not streamed or batch_bytes is 0.
size_t BatchEnd(const StreamPass& stream, std::span<const TensorInput> inputs,
                const std::vector<size_t>& order, const std::vector<size_t>& ks, size_t b) {
  if (stream.live == nullptr || stream.batch_bytes == 0) return ks.size();
  uint64_t bytes = 0;
  size_t e = b;
  while (e < ks.size() && (e == b || bytes < stream.batch_bytes)) {
    bytes += inputs[order[ks[e]]].data.size();
    ++e;
  }
  return e;
}

// CPU one pass (PublisherCore's class comment): every tensor with a base compared, encoded and
// digested by EncodePatchesWithDigests over (baseline, caller's bytes); no snapshot copy. When
// streamed, in batches, each tensor's object handed to the live version as its batch completes
// (keyframes and byte-less unchanged tensors before the pass).
absl::Status EncodeOnCpuOnePass(const PublisherOptions& options,
                                std::span<const TensorInput> inputs,
                                const std::vector<size_t>& order,
                                const std::vector<v1::TensorSpec>& specs,
                                const std::vector<BaselineTensor>& prev, const std::string& where,
                                const StreamPass& stream, Encoded* out, PublishSummary* sum) {
  ResizeEncoded(order.size(), out);
  out->v1_deferred = stream.defer_v1;
  const std::vector<const BaselineTensor*> bases =
      ClassifyForPass(options, inputs, order, specs, prev, out, sum);
  std::vector<size_t> ks;
  for (size_t k = 0; k < order.size(); ++k) {
    if (bases[k] != nullptr) {
      ks.push_back(k);
    } else if (stream.live != nullptr) {
      stream.live->Ready(static_cast<uint32_t>(k), out->unchanged[k] ? nullptr : out->next[k].bytes);
    }
  }
  if (ks.empty()) return absl::OkStatus();
  const auto pass_start = Clock::now();
  for (size_t b = 0; b < ks.size();) {
    const size_t e = BatchEnd(stream, inputs, order, ks, b);
    if (stream.live != nullptr && stream.hook != nullptr && *stream.hook) {
      RETURN_IF_ERROR((*stream.hook)(ks[b], ks[e - 1] + 1));
    }
    const std::span<const size_t> batch(ks.data() + b, e - b);
    RETURN_IF_ERROR(EncodeBatch(options, inputs, order, bases, batch, where, stream.defer_v1, out));
    for (size_t k : batch) {
      if (stream.live == nullptr) break;
      stream.live->Ready(static_cast<uint32_t>(k), out->unchanged[k] ? nullptr : out->patches[k]);
    }
    b = e;
  }
  sum->pass_micros = MicrosSince(pass_start);
  sum->encode_micros = sum->pass_micros;
  return absl::OkStatus();
}

// The references to a baseline buffer when only the core's baseline and Encoded::Pending hold it.
constexpr long kSoleBaselineOwners = 2;

// CPU one pass, before the commit (outside the core's lock): changed tensors whose baseline
// buffer something else already references get a new buffer now (copy-on-write). Their v2
// digests came from the pass (EncodeBatch).
void CopyPending(const Encoded::Pending& u, Encoded* enc, PublishSummary* sum) {
  enc->next[u.k].bytes = OwnBytes(u.target, u.owned);
  ++sum->baseline_copied_tensors;
}

void CopySharedPending(Encoded* enc, PublishSummary* sum) {
  const auto start = Clock::now();
  for (Encoded::Pending& u : enc->pending) {
    if (u.base.use_count() <= kSoleBaselineOwners) continue;
    CopyPending(u, enc, sum);
  }
  sum->baseline_update_micros += MicrosSince(start);
}

// CPU one pass, at the commit. Must run with the core's mu_ held exclusively, before the new
// baseline is installed: references to baseline buffers are only taken from the baseline under
// that lock, so a buffer nothing else references now stays unreferenced while it is patched.
// Such a buffer gets the pass's logged changes written in place (O(changed): no decode, no
// read of unchanged words); the others are copied from the caller's bytes.
void UpdateBaselineBytes(Encoded* enc, int threads, PublishSummary* sum) {
  const auto start = Clock::now();
  std::vector<Encoded::Pending*> in_place;
  for (Encoded::Pending& u : enc->pending) {
    if (enc->next[u.k].bytes != nullptr) continue;  // copied before the lock
    if (u.base.use_count() > kSoleBaselineOwners) {
      CopyPending(u, enc, sum);
    } else {
      in_place.push_back(&u);
    }
  }
  // Pairs with the release of the references dropped by other threads: their reads of the
  // buffer happen before the writes below.
  std::atomic_thread_fence(std::memory_order_acquire);
  ParallelFor(in_place.size(), threads, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      Encoded::Pending& u = *in_place[i];
      // Baseline buffers are non-const vectors (OwnBytes, the GPU download, LoadPersisted); only
      // their elements change, never their size.
      std::span<uint8_t> buf(const_cast<uint8_t*>(u.base->data()), u.base->size());
      if (!u.changes->ApplyTo(u.index, buf, u.target).ok()) {
        // The log is the pass's own and sized by it; should it not fit, the caller's bytes are
        // the new version (whose v2 digest the pass computed from those bytes).
        std::memcpy(buf.data(), u.target.data(), buf.size());
      }
    }
  });
  for (Encoded::Pending* u : in_place) enc->next[u->k].bytes = std::move(u->base);
  sum->baseline_in_place_tensors += in_place.size();
  sum->baseline_update_micros += MicrosSince(start);
}

// CPU codec with DeviceBytes inputs: the same inputs with those copied to host buffers.
absl::StatusOr<std::vector<TensorInput>> DownloadDeviceInputs(std::span<const TensorInput> given,
                                                              const std::string& where,
                                                              PublishSummary* sum) {
  const auto start = Clock::now();
  std::vector<TensorInput> out(given.begin(), given.end());
  for (size_t i = 0; i < out.size(); ++i) {
    TensorInput& in = out[i];
    if (in.device_bytes == nullptr) continue;
    auto host = std::make_shared<std::vector<uint8_t>>(in.device_bytes->memory.size());
    absl::Status st = FromMemory(host->data(), *in.device_bytes, host->size());
    if (!st.ok()) {
      return Prefix(absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), in.name),
                                 ": copying the snapshot from ", in.device_bytes->device->Describe(),
                                 " to the host"),
                    st);
    }
    in.data = *host;
    in.owned = std::move(host);
    in.device_bytes = nullptr;
  }
  sum->download_micros += MicrosSince(start);
  return out;
}

// GPU encoding, per tensor: what EncodeOnDevices' steps share.
struct DeviceTensorJob {
  const TensorInput* in = nullptr;
  const BaselineTensor* prev = nullptr;  // the previous version's tensor (same spec or not)
  bool same_spec = false;
  size_t bytes = 0;
  std::string what;  // for errors: "<where>: tensor N 'name'"
  // The previous GPU baseline of this tensor, taken out of the map (freed once this tensor is
  // encoded unless it becomes the new one; a failure further on loses it, and the next publish
  // then uploads the host baseline instead).
  std::shared_ptr<const DeviceBytes> old_gpu;
};

// GPU encoding, step 1: a host input whose bytes equal the previous version's is unchanged (no
// upload, no device work). True when it was.
bool HostInputUnchanged(DeviceTensorJob& job, size_t k, Encoded* out) {
  const TensorInput& in = *job.in;
  if (in.device_bytes != nullptr || !job.same_spec ||
      std::memcmp(job.prev->bytes->data(), in.data.data(), job.bytes) != 0) {
    return false;
  }
  BaselineTensor& t = out->next[k];
  t.bytes = job.prev->bytes;
  t.digest = job.prev->digest;
  t.digest_v2 = job.prev->digest_v2;
  out->unchanged[k] = true;
  if (job.old_gpu != nullptr) out->gpu[in.name] = std::move(job.old_gpu);
  return true;
}

// GPU encoding, step 2: the target on a device: the caller's device snapshot, or the host bytes
// (kept as the tensor's host bytes) uploaded to options.device.
absl::StatusOr<std::shared_ptr<const DeviceBytes>> DeviceTarget(const PublisherOptions& options,
                                                                const DeviceTensorJob& job,
                                                                BaselineTensor& t,
                                                                PublishSummary* sum) {
  const TensorInput& in = *job.in;
  if (in.device_bytes != nullptr) return in.device_bytes;
  t.bytes = in.owned != nullptr && in.owned->data() == in.data.data() &&
                    in.owned->size() == in.data.size()
                ? in.owned
                : std::make_shared<const std::vector<uint8_t>>(in.data.begin(), in.data.end());
  const auto upload_start = Clock::now();
  auto up = Upload(options.device, options.gpu_baseline, *t.bytes);
  if (!up.ok()) {
    return Prefix(absl::StrCat(job.what, ": uploading to ", options.device->Describe()),
                  up.status());
  }
  sum->upload_micros += MicrosSince(upload_start);
  return std::move(*up);
}

// GPU encoding, step 3: the base of the encode on the target's device: the GPU baseline when this
// device can read it (its own memory, or pinned memory, which every device reads), else the
// previous host bytes uploaded for this call. `own` says the base is the publisher's GPU
// baseline held by nothing else, so the one pass may bring it up to date in place.
absl::StatusOr<std::shared_ptr<const DeviceBytes>> DeviceBase(DeviceTensorJob& job,
                                                              const DeviceBytes& target,
                                                              bool* own, PublishSummary* sum) {
  cuda::Device* const dev = target.device;
  *own = false;
  if (job.old_gpu != nullptr && job.old_gpu->memory.size() == job.bytes &&
      (job.old_gpu->device == dev ||
       job.old_gpu->memory.kind() == cuda::Allocation::Kind::kPinnedHost)) {
    *own = job.old_gpu.use_count() == 1;
    return std::move(job.old_gpu);
  }
  job.old_gpu.reset();
  const auto upload_start = Clock::now();
  auto up = Upload(dev, target.memory.kind(), *job.prev->bytes);
  if (!up.ok()) {
    return Prefix(absl::StrCat(job.what, ": uploading the previous version to ", dev->Describe()),
                  up.status());
  }
  sum->upload_micros += MicrosSince(upload_start);
  return std::move(*up);
}

// GPU encoding, step 4 (same spec): the one pass on the device (Device::EncodeFused): the patch,
// the target's digest v2 and, when the base is the publisher's own, the base brought up to the
// target in place. Sets *new_gpu to the tensor's next GPU baseline (the updated base, or the
// target) and returns true when nothing changed (the tensor is then complete).
absl::StatusOr<bool> EncodeFusedOnDevice(const PublisherOptions& options, DeviceTensorJob& job,
                                         std::shared_ptr<const DeviceBytes> target, size_t k,
                                         Encoded* out, std::shared_ptr<const DeviceBytes>* new_gpu,
                                         PublishSummary* sum) {
  cuda::Device* const dev = target->device;
  bool own = false;
  ASSIGN_OR_RETURN(std::shared_ptr<const DeviceBytes> base, DeviceBase(job, *target, &own, sum));
  EncodeOptions eo;
  eo.block_log2 = options.block_log2;
  eo.format = options.patch_format;
  const auto encode_start = Clock::now();
  // DeviceBytes is shared as const: only the baseline held by nobody else (`own`) is written.
  auto fused = dev->EncodeFused(out->next[k].dtype, base->memory.data(), target->memory.data(),
                                job.bytes, eo, /*update_base=*/own);
  sum->encode_micros += MicrosSince(encode_start);
  if (!fused.ok()) {
    return absl::InternalError(absl::StrCat(job.what, ": encoding on ", dev->Describe(),
                                            " failed: ", fused.status().message()));
  }
  BaselineTensor& t = out->next[k];
  t.digest_v2 = fused->digest_v2;
  // The updated base equals the target now; else the target is the next baseline and the base
  // (the previous version) is no longer needed on the device.
  *new_gpu = own ? std::move(base) : std::move(target);
  if (job.in->device_bytes != nullptr && fused->stats.changed_elements == 0) {
    // The encoder compares bit patterns: no changed element = the same bytes.
    t.bytes = job.prev->bytes;
    t.digest = job.prev->digest;
    out->unchanged[k] = true;
    return true;
  }
  out->patches[k] = std::make_shared<const std::vector<uint8_t>>(std::move(fused->patch));
  out->changed[k] = fused->stats.changed_elements;
  return false;
}

// GPU encoding, step 5: the v1 digest on the device (the wire's digest until every peer takes
// v2: a pass of its own, see cuda/README.md), the v2 digest of a keyframe tensor (no encode
// produced it), and the host bytes of a device snapshot (keyframes for new subscribers,
// persistence; one D2H copy).
absl::Status DigestAndDownload(const DeviceTensorJob& job, const DeviceBytes& now, bool have_v2,
                               BaselineTensor& t, PublishSummary* sum) {
  cuda::Device* const dev = now.device;
  const auto digest_start = Clock::now();
  auto digest = dev->Digest(now.memory.data(), job.bytes);
  if (!digest.ok()) return Prefix(absl::StrCat(job.what, ": digest on ", dev->Describe()), digest.status());
  t.digest = *digest;
  if (!have_v2) {
    auto v2 = dev->DigestV2(now.memory.data(), job.bytes);
    if (!v2.ok()) {
      return Prefix(absl::StrCat(job.what, ": digest v2 on ", dev->Describe()), v2.status());
    }
    t.digest_v2 = *v2;
  }
  sum->digest_micros += MicrosSince(digest_start);
  if (job.in->device_bytes == nullptr) return absl::OkStatus();
  const auto download_start = Clock::now();
  auto host = std::make_shared<std::vector<uint8_t>>(job.bytes);
  absl::Status st = FromMemory(host->data(), now, job.bytes);
  if (!st.ok()) {
    return Prefix(absl::StrCat(job.what, ": copying the snapshot from ", dev->Describe(),
                               " to the host"),
                  st);
  }
  t.bytes = std::move(host);
  sum->download_micros += MicrosSince(download_start);
  return absl::OkStatus();
}

// GPU encoding of one tensor (name order k): steps 1-5.
absl::Status EncodeTensorOnDevice(const PublisherOptions& options, DeviceTensorJob& job, size_t k,
                                  Encoded* out, std::vector<cuda::Device*>* used,
                                  PublishSummary* sum) {
  BaselineTensor& t = out->next[k];
  if (job.bytes == 0) {  // nothing to encode or copy
    t.bytes = job.same_spec ? job.prev->bytes : std::make_shared<const std::vector<uint8_t>>();
    t.digest = job.same_spec ? job.prev->digest : TensorDigest(std::span<const uint8_t>(), 1);
    t.digest_v2 = TensorDigestV2(std::span<const uint8_t>());
    out->unchanged[k] = job.same_spec;
    return absl::OkStatus();
  }
  if (HostInputUnchanged(job, k, out)) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::shared_ptr<const DeviceBytes> target, DeviceTarget(options, job, t, sum));
  cuda::Device* const dev = target->device;
  if (std::find(used->begin(), used->end(), dev) == used->end()) used->push_back(dev);
  std::shared_ptr<const DeviceBytes> now = std::move(target);
  if (job.same_spec) {
    std::shared_ptr<const DeviceBytes> next;
    ASSIGN_OR_RETURN(const bool unchanged,
                     EncodeFusedOnDevice(options, job, std::move(now), k, out, &next, sum));
    now = std::move(next);
    if (unchanged) {
      out->gpu[job.in->name] = std::move(now);
      return absl::OkStatus();
    }
  }
  RETURN_IF_ERROR(DigestAndDownload(job, *now, job.same_spec, t, sum));
  out->gpu[job.in->name] = std::move(now);
  return absl::OkStatus();
}

// GPU encoding (PublisherCore's class comment): every tensor encoded and digested on its device
// against its GPU baseline (`gpu_baseline`, whose entries are taken out as the tensors are
// encoded; the caller installs out->gpu once the version is committed).
absl::Status EncodeOnDevices(
    const PublisherOptions& options, std::span<const TensorInput> inputs,
    const std::vector<size_t>& order, const std::vector<v1::TensorSpec>& specs,
    const std::vector<BaselineTensor>& prev, const std::string& where,
    std::map<std::string, std::shared_ptr<const DeviceBytes>>* gpu_baseline, Encoded* out,
    PublishSummary* sum) {
  ResizeEncoded(order.size(), out);
  std::vector<cuda::Device*> used;
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.spec = specs[order[k]];
    t.dtype = in.dtype;
    DeviceTensorJob job;
    job.in = &in;
    job.prev = FindByName(prev, in.name);
    job.same_spec = SameSpecAs(job.prev, t.spec);
    job.bytes = static_cast<size_t>(*sync::TensorByteSize(t.spec));
    job.what = absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(order[k]), in.name));
    if (auto it = gpu_baseline->find(in.name); it != gpu_baseline->end()) {
      job.old_gpu = std::move(it->second);
      gpu_baseline->erase(it);
    }
    RETURN_IF_ERROR(EncodeTensorOnDevice(options, job, k, out, &used, sum));
  }
  std::vector<std::string> names;
  for (cuda::Device* d : used) names.push_back(d->Describe());
  sum->encode_device = names.empty() ? options.device->Describe() : absl::StrJoin(names, "; ");
  return absl::OkStatus();
}

// Publish, step 1: every input valid (dtype, spec, size, data), names unique. Fills the specs
// (input order) and `order` (input indices in name order).
absl::Status ValidateInputs(std::span<const TensorInput> given, const std::string& where,
                            std::vector<v1::TensorSpec>* specs_out, std::vector<size_t>* order_out) {
  std::vector<v1::TensorSpec>& specs = *specs_out;
  specs.assign(given.size(), v1::TensorSpec());
  for (size_t i = 0; i < given.size(); ++i) {
    const TensorInput& in = given[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), in.name));
    if (!IsValidDType(static_cast<uint8_t>(in.dtype))) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": invalid dtype code ", static_cast<int>(in.dtype)));
    }
    v1::TensorSpec& s = specs[i];
    s.set_name(in.name);
    s.set_dtype(sync::ToProtoDType(in.dtype));
    for (uint64_t d : in.shape) s.add_shape(d);
    absl::Status st = sync::ValidateTensorSpec(s);
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", st.message()));
    const uint64_t bytes = *sync::TensorByteSize(s);
    if (in.device_bytes != nullptr &&
        (in.device_bytes->device == nullptr || !in.data.empty())) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": device bytes need a device and no host data"));
    }
    const uint64_t given_bytes =
        in.device_bytes != nullptr ? in.device_bytes->memory.size() : in.data.size();
    if (given_bytes != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", given_bytes, " bytes given, dtype ", DTypeName(in.dtype), " and shape [",
          absl::StrJoin(in.shape, ","), "] need ", bytes));
    }
    if (in.device_bytes == nullptr && in.data.data() == nullptr && bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null data"));
    }
  }
  std::vector<size_t>& order = *order_out;
  order.resize(given.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return given[a].name < given[b].name; });
  for (size_t k = 1; k < order.size(); ++k) {
    if (given[order[k]].name == given[order[k - 1]].name) {
      const size_t a = std::min(order[k], order[k - 1]), b = std::max(order[k], order[k - 1]);
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(b), given[b].name),
                       " has the same name as tensor ", a));
    }
  }

  return absl::OkStatus();
}

// Publish, the summary's counts of an encoded version; the history's updates and the changed
// element counts per tensor (name order) for VersionEnd.
void SummarizeVersion(Encoded& enc, const std::vector<BaselineTensor>& prev, PublishSummary* sum,
                      std::vector<sync::TensorUpdate>* updates,
                      std::vector<std::pair<std::string, uint64_t>>* counts) {
  for (size_t k = 0; k < enc.next.size(); ++k) {
    const BaselineTensor& t = enc.next[k];
    const uint64_t elems = ElementsOf(t.spec);
    const uint64_t bytes = *sync::TensorByteSize(t.spec);
    sum->total_elements += elems;
    sum->dense_bytes += bytes;
    if (enc.unchanged[k]) {
      ++sum->unchanged_tensors;
    } else if (enc.patches[k]) {
      ++sum->patched_tensors;
      sum->changed_elements += enc.changed[k];
      sum->wire_bytes += enc.patches[k]->size();
    } else {
      ++sum->keyframe_tensors;
      enc.changed[k] = elems;
      sum->changed_elements += elems;
      sum->wire_bytes += bytes;
    }
    counts->emplace_back(t.spec.name(), enc.changed[k]);
    sync::TensorUpdate u;
    u.spec = t.spec;
    u.digest = t.digest;
    u.digest_pending = enc.v1_deferred && enc.patches[k] != nullptr;
    u.digest_v2 = t.digest_v2;
    u.patch = enc.patches[k];
    updates->push_back(std::move(u));
  }
  for (const BaselineTensor& p : prev) {
    if (FindByName(enc.next, p.spec.name()) == nullptr) ++sum->removed_tensors;
  }
}

// The copying path: each tensor's v2 digest, the previous one where the buffer is the
// previous version's, else TensorDigestV2 of the host bytes (a full read of changed tensors).
void FillDigestsV2(const PublisherOptions& options, const std::vector<BaselineTensor>& prev,
                   Encoded* enc, PublishSummary* sum) {
  const auto start = Clock::now();
  for (BaselineTensor& t : enc->next) {
    const BaselineTensor* p = FindByName(prev, t.spec.name());
    if (p != nullptr && p->bytes == t.bytes) {
      t.digest_v2 = p->digest_v2;
    } else if (t.bytes != nullptr) {
      t.digest_v2 = TensorDigestV2(*t.bytes, options.digest_threads);
    }
  }
  sum->digest_micros += MicrosSince(start);
}

// Publish, the encode: on the devices (GPU encoding) or the CPU codec (one pass or copying).
absl::Status EncodeVersion(
    const PublisherOptions& options, std::span<const TensorInput> given,
    const std::vector<size_t>& order, const std::vector<v1::TensorSpec>& specs,
    const std::vector<BaselineTensor>& prev, const std::string& where,
    std::map<std::string, std::shared_ptr<const DeviceBytes>>* gpu_baseline,
    const StreamPass& stream, Encoded* enc, PublishSummary* sum) {
  if (options.device != nullptr) {
    RETURN_IF_ERROR(
        EncodeOnDevices(options, given, order, specs, prev, where, gpu_baseline, enc, sum));
    return absl::OkStatus();  // v2 digests from the fused device encode (EncodeOnDevices)
  }
  // The CPU codec reads host bytes: device snapshots (CUDA tensors registered with a CPU codec)
  // come to the host first.
  std::span<const TensorInput> inputs = given;
  std::vector<TensorInput> downloaded;
  if (std::any_of(given.begin(), given.end(),
                  [](const TensorInput& in) { return in.device_bytes != nullptr; })) {
    ASSIGN_OR_RETURN(downloaded, DownloadDeviceInputs(given, where, sum));
    inputs = downloaded;
  }
  if (!options.cpu_one_pass) {
    RETURN_IF_ERROR(EncodeOnCpuCopying(options, inputs, order, specs, prev, where, enc, sum));
    FillDigestsV2(options, prev, enc, sum);
    return absl::OkStatus();
  }
  return EncodeOnCpuOnePass(options, inputs, order, specs, prev, where, stream, enc, sum);
}

// Publish, after the commit: streamed sessions send VersionEnd; without an end (the history
// could not plan it) they abort and the committed path serves the version.
// `v1_pending`: the v1 End comes later (StreamPass::defer_v1), so v2 sessions end now.
void SettleLive(LiveVersion* live, absl::StatusOr<v1::VersionEnd> end,
                std::optional<v1::VersionEnd> end_v2, bool v1_pending) {
  if (live == nullptr) return;
  if (end.ok()) {
    live->Commit(*std::move(end), std::move(end_v2));
  } else if (v1_pending && end_v2.has_value()) {
    live->CommitV2First(*std::move(end_v2));
  } else {
    live->Fail(end.status());
  }
}

// StreamPass::defer_v1, after the v2 End is out: the v1 digests the pass left pending, from the
// caller's bytes (valid until Publish returns), into enc->next and the log record. Returns every
// tensor's v1 digest in name order.
std::vector<uint64_t> FillDeferredV1(Encoded* enc, int threads, std::optional<LogRecord>* record,
                                     PublishSummary* sum) {
  const auto start = Clock::now();
  std::vector<size_t> ks;
  std::vector<std::span<const uint8_t>> targets;
  for (const Encoded::Pending& u : enc->pending) {
    ks.push_back(u.k);
    targets.push_back(u.target);
  }
  const std::vector<uint64_t> d = TensorDigests(targets, threads);
  for (size_t i = 0; i < ks.size(); ++i) {
    enc->next[ks[i]].digest = d[i];
    if (record->has_value()) (*record)->tensors[ks[i]].digest = d[i];
  }
  enc->v1_deferred = false;
  std::vector<uint64_t> all;
  all.reserve(enc->next.size());
  for (const BaselineTensor& t : enc->next) all.push_back(t.digest);
  sum->digest_micros += MicrosSince(start);
  return all;
}

// The guard's view of a version: names and byte sizes.
std::vector<GuardTensor> GuardTensorsOf(const std::vector<v1::TensorSpec>& specs) {
  std::vector<GuardTensor> out;
  out.reserve(specs.size());
  for (const v1::TensorSpec& s : specs) {
    out.push_back({s.name(), sync::TensorByteSize(s).value_or(0)});
  }
  return out;
}

std::vector<GuardTensor> GuardTensorsOf(const std::vector<BaselineTensor>& baseline) {
  std::vector<GuardTensor> out;
  out.reserve(baseline.size());
  for (const BaselineTensor& t : baseline) {
    out.push_back({t.spec.name(), sync::TensorByteSize(t.spec).value_or(0)});
  }
  return out;
}

}  // namespace

// ---- Transfer -------------------------------------------------------------------------------

v1::VersionHeader Transfer::Header() const {
  v1::VersionHeader h = plan_.Header();
  h.set_snapshot_unix_nanos(snapshot_unix_nanos_);
  h.set_lineage(lineage_);
  return h;
}

v1::VersionEnd Transfer::End(uint64_t wire_bytes) const {
  v1::VersionEnd e = plan_.End();
  e.set_frames(total_frames_);
  e.set_wire_bytes(wire_bytes);
  e.set_changed_elements(changed_elements_);
  e.set_total_elements(total_elements_);
  e.set_encode_micros(encode_micros_);
  e.set_publish_pass_micros(pass_micros_);
  e.set_baseline_update_micros(baseline_update_micros_);
  return e;
}

absl::StatusOr<v1::DataFrame> Transfer::Frame(uint64_t i) const {
  if (i >= total_frames_) {
    return absl::OutOfRangeError(absl::StrCat("frame ", i, " of version ", plan_.version,
                                              ": the transfer has ", total_frames_, " frames"));
  }
  auto it = std::upper_bound(objects_.begin(), objects_.end(), i,
                             [](uint64_t f, const Object& o) { return f < o.first_frame; });
  const Object& o = *(it - 1);
  sync::FrameTarget target;
  target.version = plan_.version;
  target.tensor_index = o.tensor_index;
  target.part = o.part;
  sync::SplitOptions split;
  split.frame_bytes = frame_bytes_;
  split.lz4 = o.lz4;
  return sync::MakeFrame(o.bytes, target, split, static_cast<uint32_t>(i - o.first_frame));
}

// ---- PublisherCore --------------------------------------------------------------------------

PublisherCore::PublisherCore(const PublisherOptions& options)
    : options_(options), history_(options.history_budget_bytes, options.history_max_versions) {
  if (options_.patch_format_auto) chooser_ = std::make_unique<FormatChooser>(options_.format_chooser);
}

std::optional<PublisherOptions> PublisherCore::AutoFormatOptions(uint64_t version,
                                                                 uint64_t prev_version) const {
  if (chooser_ == nullptr || prev_version == 0) return std::nullopt;  // a first version: keyframes
  PublisherOptions o = options_;
  o.patch_format = chooser_->FormatFor(version);
  return o;
}

void PublisherCore::NoteRefitLatency(uint64_t version, uint64_t micros) {
  if (chooser_ != nullptr) chooser_->Observe(version, micros);
}

std::optional<FormatChooser::State> PublisherCore::format_choice() const {
  if (chooser_ == nullptr) return std::nullopt;
  return chooser_->state();
}

std::string PublisherCore::BaselinePath(const std::string& persist_dir) {
  return (std::filesystem::path(persist_dir) / kBaselineFile).string();
}

absl::StatusOr<std::unique_ptr<PublisherCore>> PublisherCore::Open(
    const PublisherOptions& options) {
  if (options.patch_format != 1 && options.patch_format != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublisherOptions.patch_format ", options.patch_format, " is not 1 or 2"));
  }
  if (options.persist_dir.empty()) {
    std::unique_ptr<PublisherCore> core(new PublisherCore(options));
    absl::MutexLock lock(&core->mu_);
    core->lineage_ = options.lineage != 0 ? options.lineage : sync::NewLineage();
    core->baseline_status_.set_state(v1::BASELINE_STATE_DISABLED);
    return core;
  }
  std::vector<std::string> removed;
  ASSIGN_OR_RETURN(std::unique_ptr<PersistDir> dir,
                   PersistDir::Open(options.persist_dir, &removed));
  ASSIGN_OR_RETURN(std::unique_ptr<PublisherCore> core, OpenPersisted(options, std::move(dir)));
  core->removed_temps_ = std::move(removed);
  return core;
}

absl::StatusOr<std::unique_ptr<PublisherCore>> PublisherCore::OpenPersisted(
    const PublisherOptions& options, std::unique_ptr<PersistDir> dir) {
  const std::string path = dir->baseline_path();
  // A malformed lineage file counts as absent: the baseline's own lineage decides.
  absl::StatusOr<std::optional<LineageState>> recorded = dir->ReadLineage();
  const bool has_file = recorded.ok() && recorded->has_value();
  const LineageState file = has_file ? **recorded : LineageState{};
  std::unique_ptr<PublisherCore> core(new PublisherCore(options));
  uint64_t lineage = 0;
  absl::Status loaded = core->LoadPersisted(path, &lineage);
  if (loaded.ok() && core->newest_version() > 0 && has_file && lineage != 0 &&
      lineage != file.lineage) {
    loaded = absl::FailedPreconditionError(absl::StrCat(
        "persisted baseline ", path, " belongs to ", sync::DescribeLineage(lineage), " but ",
        dir->lineage_path(), " names ", sync::DescribeLineage(file.lineage),
        " (a baseline of another publisher)"));
  }
  v1::BaselineStatus status;
  status.set_path(path);
  if (!loaded.ok()) {
    absl::StatusOr<std::string> moved = dir->MoveAside(path);
    if (!moved.ok()) {
      return absl::Status(moved.status().code(),
                          absl::StrCat("refused baseline (", loaded.message(),
                                       "): ", moved.status().message()));
    }
    core.reset(new PublisherCore(options));
    status.set_state(v1::BASELINE_STATE_MOVED_ASIDE);
    status.set_load_error(std::string(loaded.message()));
    status.set_moved_to(*moved);
  }
  LineageState state;
  PersisterStart start;
  if (core->newest_version() > 0) {
    status.set_state(v1::BASELINE_STATE_LOADED);
    state.lineage = lineage != 0 ? lineage : has_file ? file.lineage : sync::NewLineage();
    core->ReplayPersistedLog(*dir, core->newest_version(), state.lineage, &status, &start);
    status.set_persisted_version(start.persisted_version);
    state.numbered = core->newest_version();
    if (has_file && file.lineage == state.lineage) {
      state.numbered = std::max(state.numbered, file.numbered);
    }
  } else {
    if (status.state() == v1::BASELINE_STATE_UNSPECIFIED) status.set_state(v1::BASELINE_STATE_EMPTY);
    state.lineage = sync::NewLineage();
    // A log without a usable baseline cannot be replayed: kept for inspection.
    if (std::filesystem::exists(dir->log_path())) {
      absl::StatusOr<std::string> moved = dir->MoveLogAside(dir->log_path());
      Logger("persist")->warn("patch log {} has no usable baseline: {}", dir->log_path(),
                              moved.ok() ? absl::StrCat("moved aside to ", *moved)
                                         : std::string(moved.status().message()));
    }
  }
  if (absl::Status st = dir->WriteLineage(state, options.persist_fsync); !st.ok()) {
    status.set_last_persist_error(std::string(st.message()));
    status.set_last_persist_error_unix_nanos(UnixNanosNow());
  }
  {
    absl::MutexLock lock(&core->mu_);
    core->lineage_ = state.lineage;
    core->numbered_ = state.numbered;
    core->baseline_status_ = status;
    core->dir_ = std::move(dir);
  }
  core->StartPersister(std::move(start));
  return core;
}

void PublisherCore::ReplayPersistedLog(const PersistDir& dir, uint64_t base_version,
                                       uint64_t lineage, v1::BaselineStatus* status,
                                       PersisterStart* start) {
  auto log = Logger("persist");
  const std::string log_path = dir.log_path();
  start->baseline_version = base_version;
  start->persisted_version = base_version;
  absl::StatusOr<LogReadResult> read = ReadPatchLog(log_path);
  if (absl::IsNotFound(read.status())) return;  // none yet: the first record starts one
  LogReplay replay;
  if (read.ok()) {
    replay = ReplayLog(Baseline(), base_version, lineage, *read, log_path, options_.encode_threads);
    if (absl::Status st = RecordReplayed(base_version, replay); !st.ok()) replay.stopped = st;
  } else {
    replay.stopped = read.status();
  }
  const uint64_t newest = newest_version();
  if (!replay.versions.empty()) {
    log->info("patch log {}: replayed versions {}..{} onto the baseline of version {} ({} "
              "records at or below it skipped)",
              log_path, replay.versions.front().version, newest, base_version, replay.skipped);
  }
  if (read.ok() && read->torn_tail) {
    log->warn("patch log {}: torn record at offset {} (a crash while appending it): truncated",
              log_path, read->valid_end);
  }
  if (replay.stopped.ok()) {
    auto writer = PatchLogWriter::OpenForAppend(log_path, read->valid_end, options_.persist_fsync);
    if (writer.ok()) {
      start->log = std::move(*writer);
      start->log_versions = static_cast<uint32_t>(replay.versions.size());
      start->persisted_version = newest;
      return;
    }
    replay.stopped = writer.status();
  }
  // Unusable from some record on: keep the file for inspection, write the newest replayed
  // version as a baseline (the persister's first work), start a new log.
  absl::StatusOr<std::string> moved = dir.MoveLogAside(log_path);
  const std::string error = absl::StrCat(
      replay.stopped.message(), "; the log ",
      moved.ok() ? absl::StrCat("moved aside to ", *moved) : std::string(moved.status().message()),
      "; serving version ", newest);
  log->error("{}", error);
  status->set_load_error(error);
  start->compact_now = newest > base_version;
}

absl::Status PublisherCore::RecordReplayed(uint64_t base_version, const LogReplay& replay) {
  if (replay.versions.empty()) return absl::OkStatus();
  // v2 digests are not logged: the newest replayed version gets them from its bytes (one full
  // pass); older replayed versions stay without (a v2 session at one of them gets keyframes).
  std::vector<BaselineTensor> tensors = replay.tensors;
  for (BaselineTensor& t : tensors) {
    t.digest_v2 = TensorDigestV2(*t.bytes, options_.digest_threads);
  }
  for (const ReplayedVersion& v : replay.versions) {
    std::vector<sync::TensorUpdate> updates = v.updates;
    if (&v == &replay.versions.back()) {
      for (sync::TensorUpdate& u : updates) {
        const BaselineTensor* b = FindByName(tensors, u.spec.name());
        if (b != nullptr) u.digest_v2 = b->digest_v2;
      }
    }
    auto added = history_.Add(v.version, std::move(updates));
    if (!added.ok() || *added != v.version_digest) {
      // Not expected (ReplayLog checked what Add checks): back to the baseline alone.
      history_.Clear();
      const std::vector<BaselineTensor> base = Baseline();
      std::vector<sync::TensorUpdate> updates;
      for (const BaselineTensor& t : base) updates.push_back({t.spec, t.digest, false, t.digest_v2, nullptr});
      if (absl::Status st = history_.Add(base_version, std::move(updates)).status(); !st.ok()) {
        Logger("persist")->error("re-recording the baseline of version {}: {}", base_version,
                                 st.ToString());
      }
      return absl::DataLossError(absl::StrCat(
          "patch log: version ", v.version, " not recordable: ",
          added.ok() ? "version digest differs" : std::string(added.status().message())));
    }
  }
  absl::MutexLock lock(&mu_);
  for (const ReplayedVersion& v : replay.versions) {
    counts_.push_back({.version = v.version, .changed = v.changed});
  }
  counts_.erase(std::remove_if(counts_.begin(), counts_.end(),
                               [&](const VersionCounts& c) { return !history_.Contains(c.version); }),
                counts_.end());
  newest_version_ = replay.versions.back().version;
  newest_digest_ = replay.versions.back().version_digest;
  snapshot_unix_nanos_ = replay.versions.back().snapshot_unix_nanos;
  baseline_ = std::move(tensors);
  return absl::OkStatus();
}

void PublisherCore::StartPersister(PersisterStart start) {
  PersisterOptions po;
  po.log_path = dir_->log_path();
  po.fsync = options_.persist_fsync;
  po.compact_versions = options_.compact_log_versions;
  po.compact_bytes = options_.compact_log_bytes;
  po.max_queued_versions = options_.persist_max_queued_versions;
  po.max_queued_bytes = options_.persist_max_queued_bytes;
  po.before_write = options_.persist_hook;
  persister_ = std::make_unique<BaselinePersister>(
      std::move(po), std::move(start),
      [this](const BaselineSnapshot& s) { return Persist(s); },
      [this] { return PersistSnapshot(); },
      [this](uint64_t version, const absl::Status& st) { NotePersist(version, st); });
}

namespace {

// A persisted baseline's metadata (LoadPersisted).
struct PersistedMeta {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  uint64_t snapshot_unix_nanos = 0;
  uint64_t lineage = 0;                // 0: a file from before lineages
  std::vector<std::string> digests;    // per tensor, file order, hex
};

absl::StatusOr<PersistedMeta> ParsePersistedMeta(const model::SafetensorsFile& file,
                                                 const std::string& where) {
  const auto& meta = file.metadata();
  auto get = [&](const char* key) -> absl::StatusOr<std::string> {
    auto it = meta.find(key);
    if (it == meta.end()) {
      return absl::DataLossError(absl::StrCat(where, ": metadata key '", key, "' missing"));
    }
    return it->second;
  };
  ASSIGN_OR_RETURN(std::string format, get(kMetaFormat));
  if (format != kFormatValue) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": unsupported format '", format, "' (expected ", kFormatValue, ")"));
  }
  ASSIGN_OR_RETURN(std::string version_s, get(kMetaVersion));
  ASSIGN_OR_RETURN(std::string vdigest_s, get(kMetaVersionDigest));
  ASSIGN_OR_RETURN(std::string digests_s, get(kMetaDigests));
  PersistedMeta m;
  if (!absl::SimpleAtoi(version_s, &m.version) || m.version == 0) {
    return absl::DataLossError(absl::StrCat(where, ": bad ", kMetaVersion, " '", version_s, "'"));
  }
  if (!ParseHex64(vdigest_s, &m.version_digest)) {
    return absl::DataLossError(
        absl::StrCat(where, ": bad ", kMetaVersionDigest, " '", vdigest_s, "'"));
  }
  if (auto it = meta.find(kMetaSnapshot); it != meta.end()) {
    if (!absl::SimpleAtoi(it->second, &m.snapshot_unix_nanos)) m.snapshot_unix_nanos = 0;
  }
  if (m.version > sync::kMaxVersion) {
    return absl::DataLossError(absl::StrCat(where, ": ", kMetaVersion, " ", m.version,
                                            " is above the largest version ", sync::kMaxVersion));
  }
  if (auto it = meta.find(kMetaLineage); it != meta.end()) {
    if (!ParseHex64(it->second, &m.lineage) || m.lineage == 0) {
      return absl::DataLossError(absl::StrCat(where, ": bad ", kMetaLineage, " '", it->second, "'"));
    }
  }
  if (!digests_s.empty()) m.digests = absl::StrSplit(digests_s, ',');
  if (m.digests.size() != file.tensors().size()) {
    return absl::DataLossError(absl::StrCat(where, ": ", kMetaDigests, " has ", m.digests.size(),
                                            " entries for ", file.tensors().size(), " tensors"));
  }
  if (file.tensors().empty()) return absl::DataLossError(absl::StrCat(where, ": no tensors"));
  return m;
}

// The persisted tensors, each checked against its recorded v1 digest (v2 computed), name order.
absl::StatusOr<std::vector<BaselineTensor>> LoadPersistedTensors(
    const model::SafetensorsFile& file, const PersistedMeta& meta, const std::string& where,
    int threads) {
  const auto& entries = file.tensors();
  std::vector<BaselineTensor> tensors;
  tensors.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const model::SafetensorsEntry& e = entries[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), e.name));
    uint64_t want = 0;
    if (!ParseHex64(meta.digests[i], &want)) {
      return absl::DataLossError(absl::StrCat(what, ": bad digest '", meta.digests[i], "'"));
    }
    BaselineTensor t;
    t.spec.set_name(e.name);
    t.spec.set_dtype(sync::ToProtoDType(e.dtype));
    for (int64_t d : e.shape) t.spec.add_shape(static_cast<uint64_t>(d));
    t.dtype = e.dtype;
    std::span<const uint8_t> data = file.data(i);
    auto bytes = std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
    t.digest = TensorDigest(*bytes, threads);
    if (t.digest != want) {
      return absl::DataLossError(absl::StrCat(what, ": digest ", Hex64(t.digest),
                                              " does not match the recorded ", Hex64(want),
                                              " (corrupt file)"));
    }
    t.digest_v2 = TensorDigestV2(*bytes, threads);
    t.bytes = std::move(bytes);
    tensors.push_back(std::move(t));
  }
  std::sort(tensors.begin(), tensors.end(), [](const BaselineTensor& a, const BaselineTensor& b) {
    return a.spec.name() < b.spec.name();
  });
  return tensors;
}

}  // namespace

absl::Status PublisherCore::LoadPersisted(const std::string& path, uint64_t* lineage_out) {
  *lineage_out = 0;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (ec) return absl::FailedPreconditionError(absl::StrCat(path, ": ", ec.message()));
    return absl::OkStatus();  // nothing persisted yet: start empty
  }
  const std::string where = absl::StrCat("persisted baseline ", path);
  auto file = model::SafetensorsFile::Open(path);
  if (!file.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": ", file.status().message()));
  }
  ASSIGN_OR_RETURN(const PersistedMeta meta, ParsePersistedMeta(*file, where));
  ASSIGN_OR_RETURN(std::vector<BaselineTensor> tensors,
                   LoadPersistedTensors(*file, meta, where, options_.digest_threads));
  std::vector<sync::TensorUpdate> updates;
  for (const BaselineTensor& t : tensors) {
    sync::TensorUpdate u;
    u.spec = t.spec;
    u.digest = t.digest;
    u.digest_v2 = t.digest_v2;
    updates.push_back(std::move(u));
  }
  auto added = history_.Add(meta.version, std::move(updates));
  if (!added.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": ", added.status().message()));
  }
  if (*added != meta.version_digest) {
    return absl::DataLossError(absl::StrCat(where, ": version digest ", Hex64(*added),
                                            " does not match the recorded ",
                                            Hex64(meta.version_digest)));
  }
  *lineage_out = meta.lineage;
  absl::MutexLock lock(&mu_);
  newest_version_ = meta.version;
  newest_digest_ = meta.version_digest;
  snapshot_unix_nanos_ = meta.snapshot_unix_nanos;
  baseline_ = std::move(tensors);
  return absl::OkStatus();
}

absl::Status PublisherCore::Persist(const BaselineSnapshot& s) const {
  std::vector<model::SafetensorsTensorRef> refs;
  std::vector<std::string> digests;
  refs.reserve(s.tensors.size());
  for (const BaselineTensor& t : s.tensors) {
    model::SafetensorsTensorRef r;
    r.name = t.spec.name();
    r.dtype = t.dtype;
    for (uint64_t d : t.spec.shape()) r.shape.push_back(static_cast<int64_t>(d));
    r.data = *t.bytes;
    refs.push_back(std::move(r));
    digests.push_back(Hex64(t.digest));
  }
  std::map<std::string, std::string> meta;
  meta[kMetaFormat] = std::string(kFormatValue);
  meta[kMetaVersion] = absl::StrCat(s.version);
  meta[kMetaVersionDigest] = Hex64(s.version_digest);
  meta[kMetaDigests] = absl::StrJoin(digests, ",");
  meta[kMetaSnapshot] = absl::StrCat(s.snapshot_unix_nanos);
  meta[kMetaLineage] = Hex64(s.lineage);
  SafeWriteOptions write;
  write.durable = options_.persist_fsync;
  absl::Status st = model::WriteSafetensors(dir_->baseline_path(), refs, meta, write);
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("persisting the baseline of version ", s.version,
                                                ": ", st.message()));
  }
  return absl::OkStatus();
}

BaselineSnapshot PublisherCore::PersistSnapshot() const {
  absl::ReaderMutexLock lock(&mu_);
  return {.version = newest_version_,
          .version_digest = newest_digest_,
          .snapshot_unix_nanos = snapshot_unix_nanos_,
          .lineage = lineage_,
          .tensors = baseline_};
}

PublisherCore::~PublisherCore() { persister_.reset(); }

absl::Status PublisherCore::WaitPersisted(uint64_t version, absl::Time deadline) const {
  if (persister_ == nullptr) return absl::FailedPreconditionError("no baseline persistence");
  return persister_->WaitPersisted(version, deadline);
}

absl::StatusOr<PublishSummary> PublisherCore::Publish(uint64_t version,
                                                      std::span<const TensorInput> given,
                                                      bool allow_degenerate,
                                                      const std::function<void()>& inputs_read) {
  const auto start = Clock::now();
  absl::MutexLock publish_lock(&publish_mu_);
  PublishSummary sum;
  sum.version = version;
  sum.tensors = given.size();

  std::vector<BaselineTensor> prev;
  uint64_t prev_version = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    prev = baseline_;
    prev_version = newest_version_;
  }
  const std::string where = absl::StrCat("publish version ", version);
  std::vector<v1::TensorSpec> specs;
  std::vector<size_t> order;
  RETURN_IF_ERROR(CheckPublishable(version, prev_version, given, prev, allow_degenerate, where,
                                   &specs, &order));

  sum.snapshot_unix_nanos = UnixNanosNow();
  // Streamed transfers: sessions idle at prev_version send this version's frames as the pass
  // produces them; any failure from here to the commit aborts them (VersionAbort).
  std::shared_ptr<LiveVersion> live =
      OpenLive(version, prev_version, prev, specs, order, sum.snapshot_unix_nanos);
  absl::Cleanup fail_live = [&] {
    if (live != nullptr) live->Fail(absl::AbortedError(absl::StrCat(where, " failed")));
  };
  const bool defer_v1 = live != nullptr && options_.v1_after_end &&
                        live->base_version_digest(sync::DigestFormat::kV2) != 0;
  const StreamPass stream{live.get(), options_.stream_batch_bytes, &options_.stream_batch_hook,
                          defer_v1};
  const std::optional<PublisherOptions> chosen = AutoFormatOptions(version, prev_version);
  sum.patch_format = chosen.has_value() ? chosen->patch_format : options_.patch_format;
  Encoded enc;
  RETURN_IF_ERROR(EncodeVersion(chosen.has_value() ? *chosen : options_, given, order, specs, prev,
                                where, &gpu_baseline_, stream, &enc, &sum));
  std::vector<sync::TensorUpdate> updates;
  VersionCounts counts;
  counts.version = version;
  SummarizeVersion(enc, prev, &sum, &updates, &counts.changed);
  // The log record decides UNCHANGED against the previous version (as the history does); it
  // shares the patches and the dense tensors' buffers, never the caller's bytes.
  std::optional<LogRecord> record;
  if (persister_ != nullptr) {
    record = MakeLogRecord(version, prev_version, /*version_digest=*/0, /*lineage=*/0,
                           sum.snapshot_unix_nanos, prev, enc.next, enc.patches, enc.changed);
  }
  // From here on the baseline buffers are referenced only by baseline_, the pending updates and
  // transfers or other holders (which the one pass's copy-on-write respects).
  prev.clear();
  CopySharedPending(&enc, &sum);

  RecordNumbered(version);
  uint64_t lineage = 0;
  LiveEnds live_ends;
  RETURN_IF_ERROR(RecordInHistory(version, prev_version, std::move(updates), live != nullptr,
                                  where, &sum, &lineage, &live_ends));
  // The streamed version's End goes out before the baseline update: a subscriber's refit does
  // not wait for the publisher's own bookkeeping.
  std::move(fail_live).Cancel();
  const bool v1_pending = enc.v1_deferred && !enc.pending.empty();
  SettleLive(live.get(), std::move(live_ends.v1), std::move(live_ends.v2), v1_pending);
  if (v1_pending) {
    const std::vector<uint64_t> v1 = FillDeferredV1(&enc, options_.digest_threads, &record, &sum);
    if (absl::Status st = RecordV1(version, prev_version, v1, live.get(), &sum); !st.ok()) {
      // The v2 End is out and subscribers may hold the version: it is installed regardless
      // (the core stays consistent with them); only v1 sessions cannot be sent it.
      Logger("publisher")->error("{}", st.ToString());
    }
  }
  InstallVersion(version, [&] { UpdateBaselineBytes(&enc, options_.encode_threads, &sum); },
                 enc.next, enc.gpu, std::move(counts), sum);
  if (inputs_read) inputs_read();  // the caller's bytes are not read any more

  if (record.has_value()) EnqueueRecord(*std::move(record), lineage, &sum);
  sum.total_micros = MicrosSince(start);
  return sum;
}

absl::StatusOr<PublishSummary> PublisherCore::PublishSafetensors(
    uint64_t version, std::span<const std::string> paths,
    const std::vector<std::string>* publish_dirs, bool allow_degenerate) {
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
      return absl::Status(f.status().code(), absl::StrCat("publish version ", version, ": ",
                                                          f.status().message()));
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
  return Publish(version, inputs, allow_degenerate);
}

absl::Status Transfer::AddObject(uint32_t tensor_index, uint32_t part,
                                std::span<const uint8_t> bytes, bool lz4) {
  Object o;
  o.tensor_index = tensor_index;
  o.part = part;
  o.bytes = bytes;
  o.lz4 = lz4;
  o.first_frame = total_frames_;
  ASSIGN_OR_RETURN(o.chunks, sync::ChunkCount(bytes.size(), frame_bytes_));
  total_frames_ += o.chunks;
  object_bytes_ += bytes.size();
  objects_.push_back(o);
  return absl::OkStatus();
}

// Plan tensor `index`'s baseline tensor, from *j on (both in name order; a selection skips
// some); Internal when it is missing or its digest is not the plan's.
static absl::StatusOr<const BaselineTensor*> PlannedBaseline(
    const sync::TransferPlan& plan, uint32_t index, const std::vector<BaselineTensor>& baseline,
    sync::DigestFormat format, size_t* j) {
  const sync::TensorDelivery& d = plan.tensors[index];
  while (*j < baseline.size() && baseline[*j].spec.name() < d.plan.spec().name()) ++*j;
  if (*j == baseline.size()) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": ",
                                            sync::DescribeTensor(index, d.plan.spec().name()),
                                            " of the plan is not in the baseline"));
  }
  const BaselineTensor& b = baseline[*j];
  const uint64_t b_digest = format == sync::DigestFormat::kV2 ? b.digest_v2 : b.digest;
  if (b.spec.name() != d.plan.spec().name() || b_digest != d.digest) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": ",
                                            sync::DescribeTensor(index, d.plan.spec().name()),
                                            " of the plan does not match the baseline"));
  }
  return &b;
}

uint64_t PublisherCore::ChainChangedElements(const std::vector<VersionCounts>& counts,
                                             const sync::TransferPlan& plan,
                                             const std::string& name) {
  uint64_t changed = 0;
  for (const VersionCounts& c : counts) {
    if (c.version <= plan.base_version || c.version > plan.version) continue;
    auto it = std::lower_bound(c.changed.begin(), c.changed.end(), name,
                               [](const std::pair<std::string, uint64_t>& e,
                                  const std::string& n) { return e.first < n; });
    if (it != c.changed.end() && it->first == name) changed += it->second;
  }
  return changed;
}

absl::Status PublisherCore::AddTransferObjects(const std::vector<BaselineTensor>& baseline,
                                               const std::vector<VersionCounts>& counts,
                                               const TransferOptions& options, Transfer& t) {
  const sync::TransferPlan& plan = t.plan_;
  if (baseline.size() < plan.tensors.size()) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": plan has ",
                                            plan.tensors.size(), " tensors, baseline ",
                                            baseline.size()));
  }
  size_t j = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i, ++j) {
    const sync::TensorDelivery& d = plan.tensors[i];
    const uint32_t index = static_cast<uint32_t>(i);
    ASSIGN_OR_RETURN(const BaselineTensor* b,
                     PlannedBaseline(plan, index, baseline, options.plan.digest_format, &j));
    const uint64_t elems = ElementsOf(d.plan.spec());
    t.total_elements_ += elems;
    switch (d.plan.delivery()) {
      case v1::DELIVERY_KEYFRAME:
        t.keep_.push_back(b->bytes);
        // LZ4 decided once per keyframe object (sync::Lz4Pays), not per frame.
        RETURN_IF_ERROR(t.AddObject(index, 0, *b->bytes, options.lz4 && sync::Lz4Pays(*b->bytes)));
        t.changed_elements_ += elems;
        break;
      case v1::DELIVERY_PATCH:
        for (size_t s = 0; s < d.patches.size(); ++s) {
          RETURN_IF_ERROR(t.AddObject(index, static_cast<uint32_t>(s), *d.patches[s], false));
        }
        t.changed_elements_ += ChainChangedElements(counts, plan, d.plan.spec().name());
        break;
      default:
        break;  // unchanged: no frames
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Transfer>> PublisherCore::MakeTransfer(
    uint64_t subscriber_version, uint64_t subscriber_version_digest,
    const TransferOptions& options) const {
  auto chunks_ok = sync::ChunkCount(0, options.frame_bytes);
  if (!chunks_ok.ok()) return chunks_ok.status();

  auto t = std::make_shared<Transfer>();
  std::vector<BaselineTensor> baseline;
  std::vector<VersionCounts> counts;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (newest_version_ == 0) {
      return absl::FailedPreconditionError("no version has been published yet");
    }
    ASSIGN_OR_RETURN(t->plan_, history_.Plan(subscriber_version, subscriber_version_digest,
                                             newest_version_, options.plan));
    baseline = baseline_;
    counts = counts_;
    t->snapshot_unix_nanos_ = snapshot_unix_nanos_;
    t->lineage_ = lineage_;
    if (t->plan_.reason == v1::TRANSFER_REASON_NEXT_VERSION) {
      t->encode_micros_ = encode_micros_;
      t->pass_micros_ = pass_micros_;
      t->baseline_update_micros_ = baseline_update_micros_;
    }
  }
  t->frame_bytes_ = options.frame_bytes;
  if (t->plan_.up_to_date) return std::shared_ptr<const Transfer>(std::move(t));
  RETURN_IF_ERROR(AddTransferObjects(baseline, counts, options, *t));
  return std::shared_ptr<const Transfer>(std::move(t));
}

void PublisherCore::SetLiveListener(std::function<void(std::shared_ptr<const LiveVersion>)> on_open,
                                    std::function<void()> on_change) {
  absl::MutexLock lock(&live_mu_);
  live_open_ = std::move(on_open);
  live_change_ = std::move(on_change);
}

void PublisherCore::NotifyLiveChange() {
  absl::MutexLock lock(&live_mu_);
  if (live_change_) live_change_();
}

std::shared_ptr<LiveVersion> PublisherCore::OpenLive(uint64_t version, uint64_t prev_version,
                                                     const std::vector<BaselineTensor>& prev,
                                                     const std::vector<v1::TensorSpec>& specs,
                                                     const std::vector<size_t>& order,
                                                     uint64_t snapshot_nanos) {
  if (prev_version == 0 || options_.device != nullptr || !options_.cpu_one_pass) return nullptr;
  {
    absl::MutexLock lock(&live_mu_);
    if (!live_open_) return nullptr;
  }
  v1::VersionHeader h;
  uint64_t expected = 0;
  uint64_t base_digest = 0;
  uint64_t base_digest_v2 = 0;  // 0: the base has no v2 digests (v2 sessions do not stream)
  {
    absl::ReaderMutexLock lock(&mu_);
    if (newest_version_ != prev_version) return nullptr;
    h.set_lineage(lineage_);
    expected = newest_wire_bytes_;
    base_digest = newest_digest_;
    base_digest_v2 = history_.VersionDigestOf(prev_version, sync::DigestFormat::kV2).value_or(0);
  }
  h.set_version(version);
  h.set_base_version(prev_version);
  h.set_reason(v1::TRANSFER_REASON_NEXT_VERSION);
  h.set_snapshot_unix_nanos(snapshot_nanos);
  for (size_t k = 0; k < order.size(); ++k) {
    v1::TensorPlan* tp = h.add_tensors();
    *tp->mutable_spec() = specs[order[k]];
    if (SameSpecAs(FindByName(prev, tp->spec().name()), tp->spec())) {
      tp->set_delivery(v1::DELIVERY_PATCH);
      v1::PatchStep* step = tp->add_steps();
      step->set_base_version(prev_version);
      step->set_target_version(version);
    } else {
      tp->set_delivery(v1::DELIVERY_KEYFRAME);
    }
  }
  auto live = std::make_shared<LiveVersion>(std::move(h), expected,
                                            [this] { NotifyLiveChange(); });
  live->set_base_version_digests(base_digest, base_digest_v2);
  absl::MutexLock lock(&live_mu_);
  if (live_open_) live_open_(live);
  return live;
}

absl::Status PublisherCore::CheckPublishable(uint64_t version, uint64_t prev_version,
                                            std::span<const TensorInput> given,
                                            const std::vector<BaselineTensor>& prev,
                                            bool allow_degenerate, const std::string& where,
                                            std::vector<v1::TensorSpec>* specs,
                                            std::vector<size_t>* order) const {
  RETURN_IF_ERROR(sync::CheckVersion(version, "publish"));
  if (version <= prev_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": not above the newest published version ", prev_version));
  }
  if (given.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": no tensors"));
  RETURN_IF_ERROR(ValidateInputs(given, where, specs, order));
  return publisher::CheckPublishGuard(options_.publish_guard, GuardTensorsOf(prev),
                                      GuardTensorsOf(*specs), allow_degenerate, where);
}

absl::Status PublisherCore::RecordInHistory(uint64_t version, uint64_t prev_version,
                                            std::vector<sync::TensorUpdate> updates, bool live,
                                            const std::string& where, PublishSummary* sum,
                                            uint64_t* lineage, LiveEnds* live_ends) {
  absl::MutexLock lock(&mu_);
  *lineage = lineage_;
  // history_.Add only fails on inputs ValidateInputs and the encoder already guarantee.
  auto vdigest = history_.Add(version, std::move(updates));
  if (!vdigest.ok()) {
    return absl::Status(absl::StatusCode::kInternal,
                        absl::StrCat(where, ": ", vdigest.status().message()));
  }
  sum->version_digest = *vdigest;
  if (live) *live_ends = LiveEndsLocked(prev_version, version, *sum);
  return absl::OkStatus();
}

void PublisherCore::EnqueueRecord(LogRecord&& record, uint64_t lineage, PublishSummary* sum) {
  // After the commit, off this path: the persister's thread appends the record (or compacts);
  // Publish returns, and subscribers are woken, without waiting for the disk.
  const auto persist_start = Clock::now();
  record.version_digest = sum->version_digest;
  record.lineage = lineage;
  persister_->Enqueue(std::move(record));
  sum->persist_micros = MicrosSince(persist_start);
}

absl::Status PublisherCore::RecordV1(uint64_t version, uint64_t prev_version,
                                     const std::vector<uint64_t>& digests, LiveVersion* live,
                                     PublishSummary* sum) {
  absl::StatusOr<v1::VersionEnd> end = absl::UnknownError("no live version");
  absl::Status st;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto vdigest = history_.CompleteV1Digests(version, digests);
    if (vdigest.ok()) {
      sum->version_digest = *vdigest;
      if (live != nullptr) end = LiveEndLocked(prev_version, version, *sum, sync::DigestFormat::kV1);
    } else {
      // Cannot happen (one digest per tensor, of the bytes the pass encoded).
      st = absl::Status(absl::StatusCode::kInternal,
                        absl::StrCat("publish version ", version, ": recording the v1 digests: ",
                                     vdigest.status().message()));
      end = st;
    }
  }
  // Outside mu_: the live version's listener takes the service's lock.
  if (live != nullptr) live->CompleteV1(std::move(end));
  return st;
}

void PublisherCore::InstallVersion(
    uint64_t version, absl::FunctionRef<void()> update_baseline,
    std::vector<BaselineTensor>& next,
    std::map<std::string, std::shared_ptr<const DeviceBytes>>& gpu, VersionCounts counts,
    const PublishSummary& sum) {
  absl::MutexLock lock(&mu_);
  update_baseline();
  SetNewestLocked(version, sum);
  baseline_ = std::move(next);
  if (options_.device != nullptr) gpu_baseline_ = std::move(gpu);
  RecordCountsLocked(std::move(counts));
}

void PublisherCore::SetNewestLocked(uint64_t version, const PublishSummary& sum) {
  newest_version_ = version;
  newest_digest_ = sum.version_digest;
  snapshot_unix_nanos_ = sum.snapshot_unix_nanos;
  encode_micros_ = sum.encode_micros;
  pass_micros_ = sum.pass_micros;
  baseline_update_micros_ = sum.baseline_update_micros;
  newest_wire_bytes_ = sum.wire_bytes;
}

void PublisherCore::RecordCountsLocked(VersionCounts counts) {
  counts_.push_back(std::move(counts));
  counts_.erase(std::remove_if(counts_.begin(), counts_.end(),
                               [&](const VersionCounts& c) { return !history_.Contains(c.version); }),
                counts_.end());
}

PublisherCore::LiveEnds PublisherCore::LiveEndsLocked(uint64_t prev_version, uint64_t version,
                                                      const PublishSummary& sum) const {
  LiveEnds ends;
  ends.v1 = LiveEndLocked(prev_version, version, sum, sync::DigestFormat::kV1);
  if (auto v2 = LiveEndLocked(prev_version, version, sum, sync::DigestFormat::kV2); v2.ok()) {
    ends.v2 = *std::move(v2);
  }
  return ends;
}

absl::StatusOr<v1::VersionEnd> PublisherCore::LiveEndLocked(uint64_t prev_version,
                                                            uint64_t version,
                                                            const PublishSummary& sum,
                                                            sync::DigestFormat format) const {
  // The same digests and version digest as the committed path's End (Transfer::End).
  ASSIGN_OR_RETURN(const uint64_t prev_digest, history_.VersionDigestOf(prev_version, format));
  RETURN_IF_ERROR(history_.VersionDigestOf(version, format).status());
  sync::PlanOptions po;
  po.digest_format = format;
  ASSIGN_OR_RETURN(const sync::TransferPlan plan,
                   history_.Plan(prev_version, prev_digest, version, po));
  v1::VersionEnd e = plan.End();
  e.set_version(version);
  e.set_changed_elements(sum.changed_elements);
  e.set_total_elements(sum.total_elements);
  e.set_encode_micros(sum.encode_micros);
  e.set_publish_pass_micros(sum.pass_micros);
  e.set_baseline_update_micros(sum.baseline_update_micros);
  return e;
}

uint64_t PublisherCore::newest_version() const {
  absl::ReaderMutexLock lock(&mu_);
  return newest_version_;
}

uint64_t PublisherCore::numbered_version() const {
  absl::ReaderMutexLock lock(&mu_);
  return std::max(numbered_, newest_version_);
}

uint64_t PublisherCore::lineage() const {
  absl::ReaderMutexLock lock(&mu_);
  return lineage_;
}

v1::BaselineStatus PublisherCore::baseline_status() const {
  v1::BaselineStatus out;
  {
    absl::ReaderMutexLock lock(&mu_);
    out = baseline_status_;
  }
  if (persister_ != nullptr) {
    const PersisterStats s = persister_->Stats();
    out.set_persisted_version(s.persisted_version);
    out.set_baseline_version(s.baseline_version);
    out.set_log_versions(s.log_versions);
    out.set_log_bytes(s.log_bytes);
  }
  return out;
}

void PublisherCore::RecordNumbered(uint64_t version) {
  uint64_t lineage = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (dir_ == nullptr || version <= numbered_) return;
    lineage = lineage_;
  }
  absl::Status st = dir_->WriteLineage({.lineage = lineage, .numbered = version},
                                       options_.persist_fsync);
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    numbered_ = version;
    return;
  }
  // The version is still published: a restart may then number it again in this lineage, which
  // subscribers detect by its digest (DIVERGED). Reported like a failed baseline persist.
  baseline_status_.set_last_persist_error(
      absl::StrCat("recording version ", version, ": ", st.message()));
  baseline_status_.set_last_persist_error_unix_nanos(UnixNanosNow());
  baseline_status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
}

void PublisherCore::NotePersist(uint64_t version, const absl::Status& st) {
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    baseline_status_.set_persisted_version(version);
    if (numbered_ >= version) {  // the lineage file is current too
      baseline_status_.set_state(v1::BASELINE_STATE_PERSISTED);
      baseline_status_.clear_last_persist_error();
      baseline_status_.clear_last_persist_error_unix_nanos();
    }
    return;
  }
  baseline_status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
  baseline_status_.set_last_persist_error(std::string(st.message()));
  baseline_status_.set_last_persist_error_unix_nanos(UnixNanosNow());
}

absl::Status PublisherCore::Reset(uint64_t lineage) {
  if (dir_ != nullptr) {
    return absl::FailedPreconditionError("a publisher with a persist_dir keeps its lineage");
  }
  absl::MutexLock publish_lock(&publish_mu_);
  absl::MutexLock lock(&mu_);
  history_.Clear();
  newest_version_ = 0;
  newest_digest_ = 0;
  snapshot_unix_nanos_ = 0;
  encode_micros_ = 0;
  pass_micros_ = 0;
  baseline_update_micros_ = 0;
  baseline_.clear();
  counts_.clear();
  gpu_baseline_.clear();
  lineage_ = lineage != 0 ? lineage : sync::NewLineage();
  numbered_ = 0;
  return absl::OkStatus();
}

uint64_t PublisherCore::newest_version_digest() const {
  absl::ReaderMutexLock lock(&mu_);
  return newest_digest_;
}

uint64_t PublisherCore::newest_snapshot_unix_nanos() const {
  absl::ReaderMutexLock lock(&mu_);
  return snapshot_unix_nanos_;
}

std::vector<BaselineTensor> PublisherCore::Baseline() const {
  absl::ReaderMutexLock lock(&mu_);
  return baseline_;
}

absl::Status PublisherCore::CheckPublishGuard(const std::vector<GuardTensor>& next,
                                              bool allow_degenerate,
                                              absl::string_view where) const {
  std::vector<GuardTensor> current;
  {
    absl::ReaderMutexLock lock(&mu_);
    current = GuardTensorsOf(baseline_);
  }
  return publisher::CheckPublishGuard(options_.publish_guard, current, next, allow_degenerate,
                                      where);
}


// ---- Relayed versions (docs/ARCHITECTURE.md "Relays") -----------------------------------------

namespace {

// The streamed header of a relayable upstream transfer: every tensor PATCH with one step
// (UNCHANGED becomes a zero-byte PATCH object) or KEYFRAME.
absl::StatusOr<v1::VersionHeader> RelayedHeader(const v1::VersionHeader& up,
                                                const std::string& where) {
  if (up.base_version() == 0 || up.version() <= up.base_version()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a delta"));
  }
  v1::VersionHeader h;
  h.set_version(up.version());
  h.set_base_version(up.base_version());
  h.set_lineage(up.lineage());
  h.set_reason(up.reason());
  h.set_snapshot_unix_nanos(up.snapshot_unix_nanos());
  for (int i = 0; i < up.tensors_size(); ++i) {
    const v1::TensorPlan& tp = up.tensors(i);
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()));
    v1::TensorPlan* out = h.add_tensors();
    *out->mutable_spec() = tp.spec();
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) {
      out->set_delivery(v1::DELIVERY_KEYFRAME);
      continue;
    }
    if (tp.delivery() == v1::DELIVERY_PATCH && tp.steps_size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " comes as a chain of ", tp.steps_size(), " patches"));
    }
    if (tp.delivery() != v1::DELIVERY_PATCH && tp.delivery() != v1::DELIVERY_UNCHANGED) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has delivery ", tp.delivery()));
    }
    out->set_delivery(v1::DELIVERY_PATCH);
    v1::PatchStep* step = out->add_steps();
    step->set_base_version(up.base_version());
    step->set_target_version(up.version());
  }
  return h;
}

// One tensor of a relayed version being adopted: what the history records, the new baseline
// tensor, and which digests still have to be computed from its bytes.
struct AdoptedTensor {
  sync::TensorUpdate update;
  BaselineTensor tensor;  // tensor.bytes null until AdoptBaselineBytes for a changed tensor
  std::span<const uint8_t> data;  // the version's bytes (the caller's)
  // A changed tensor's previous baseline buffer: brought forward in place by the received
  // patch when the core holds it alone at the install (ApplyAdoptedInPlace), else a copy of
  // `data` is made. base_digest_v2: its digest v2.
  std::shared_ptr<const std::vector<uint8_t>> base;
  uint64_t base_digest_v2 = 0;
  bool unchanged = false;
  bool need_v1 = false;
  bool need_v2 = false;
  uint64_t changed = 0;  // elements (all of them for a keyframe)
};

// The objects of a committed relayed version by tensor index (unset: none arrived).
std::vector<std::optional<std::span<const uint8_t>>> ObjectsByTensor(const LiveVersion& live) {
  std::vector<std::optional<std::span<const uint8_t>>> out(live.tensor_count());
  for (size_t j = 0; j < live.ready_objects(); ++j) {
    const LiveVersion::Object o = live.object(j);
    if (o.tensor_index < out.size()) out[o.tensor_index] = o.bytes;
  }
  return out;
}

// Tensor i of the relayed version: unchanged (a zero-byte PATCH object: the previous baseline
// tensor is kept) or its new bytes with the End's digests (the other format computed later).
absl::StatusOr<AdoptedTensor> AdoptTensor(const v1::TensorPlan& tp, size_t i,
                                          std::span<const uint8_t> object,
                                          const TensorInput& in, const BaselineTensor* prev,
                                          const absl::StatusOr<v1::VersionEnd>& e1,
                                          const absl::StatusOr<v1::VersionEnd>& e2,
                                          const std::string& where) {
  AdoptedTensor a;
  a.update.spec = tp.spec();
  const bool patch = tp.delivery() == v1::DELIVERY_PATCH;
  if (patch && (prev == nullptr || !sync::SameSpec(prev->spec, tp.spec()))) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
        " is a patch but the newest version has no such tensor"));
  }
  if (patch && object.empty()) {
    a.unchanged = true;
    a.tensor = *prev;
    a.update.digest = prev->digest;
    a.update.digest_v2 = prev->digest_v2;
    return a;
  }
  a.tensor.spec = tp.spec();
  a.tensor.dtype = in.dtype;
  a.data = in.data;
  if (in.owned != nullptr) {
    a.tensor.bytes = in.owned;
  } else if (patch) {
    a.base = prev->bytes;
    a.base_digest_v2 = prev->digest_v2;
  } else {
    a.tensor.bytes = std::make_shared<const std::vector<uint8_t>>(in.data.begin(), in.data.end());
  }
  if (patch) {
    absl::StatusOr<PatchStats> ps = InspectPatch(object);
    if (!ps.ok()) {
      return absl::DataLossError(absl::StrCat(
          where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()), ": ",
          ps.status().message()));
    }
    a.changed = ps->changed_elements;
    a.update.patch = std::make_shared<const std::vector<uint8_t>>(object.begin(), object.end());
  } else {
    a.changed = ElementsOf(tp.spec());
  }
  const int k = static_cast<int>(i);
  a.need_v1 = !e1.ok();
  a.need_v2 = !e2.ok();
  if (e1.ok()) a.tensor.digest = e1->digests(k);
  if (e2.ok()) a.tensor.digest_v2 = e2->digests(k);
  return a;
}

// Computes the digests AdoptTensor left to do, then copies them into the updates.
void FillAdoptedDigests(std::vector<AdoptedTensor>& tensors, int threads) {
  std::vector<std::span<const uint8_t>> v1_bytes;
  for (const AdoptedTensor& a : tensors) {
    if (a.need_v1) v1_bytes.push_back(a.data);
  }
  const std::vector<uint64_t> v1 = TensorDigests(v1_bytes, threads);
  size_t next_v1 = 0;
  for (AdoptedTensor& a : tensors) {
    if (a.unchanged) continue;
    if (a.need_v1) a.tensor.digest = v1[next_v1++];
    if (a.need_v2) a.tensor.digest_v2 = TensorDigestV2(a.data, threads);
    a.update.digest = a.tensor.digest;
    a.update.digest_v2 = a.tensor.digest_v2;
  }
}

// The version digest of the adopted tensors in `format` must be the End's.
absl::Status CheckAdoptedDigest(const v1::VersionHeader& h, const std::vector<AdoptedTensor>& a,
                                const absl::StatusOr<v1::VersionEnd>& end, sync::DigestFormat format,
                                const std::string& where) {
  if (!end.ok()) return absl::OkStatus();
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> digests;
  for (size_t i = 0; i < a.size(); ++i) {
    specs.push_back(h.tensors(static_cast<int>(i)).spec());
    digests.push_back(format == sync::DigestFormat::kV2 ? *a[i].update.digest_v2
                                                        : a[i].update.digest);
  }
  sync::SortManifest(specs, &digests);
  ASSIGN_OR_RETURN(const uint64_t vd, sync::VersionDigest(specs, digests));
  if (vd != end->version_digest()) {
    return absl::DataLossError(absl::StrCat(
        where, ": the version digest of its tensors' ", sync::DigestFormatName(format),
        " digests is ", Hex64(vd), ", the upstream's End says ", Hex64(end->version_digest())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AdoptedTensor>> AdoptTensors(
    const LiveVersion& live, std::span<const TensorInput> given,
    const std::vector<v1::TensorSpec>& specs, const std::vector<size_t>& order,
    const std::vector<BaselineTensor>& prev, const absl::StatusOr<v1::VersionEnd>& e1,
    const absl::StatusOr<v1::VersionEnd>& e2, const std::string& where, PublishSummary* sum) {
  const v1::VersionHeader& h = live.header();
  const auto objects = ObjectsByTensor(live);
  std::vector<AdoptedTensor> out;
  out.reserve(given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const v1::TensorPlan& tp = h.tensors(static_cast<int>(i));
    // The header is in name order (a relayed header keeps the upstream's manifest order).
    auto it = std::lower_bound(order.begin(), order.end(), tp.spec().name(),
                               [&](size_t k, const std::string& n) { return given[k].name < n; });
    const TensorInput* in = it != order.end() && given[*it].name == tp.spec().name()
                                ? &given[*it]
                                : nullptr;
    if (in == nullptr || !objects[i].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          in == nullptr ? " is not among the tensors given" : " has no object"));
    }
    if (!sync::SameSpec(specs[*it], tp.spec())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          " given with another dtype or shape than the version's"));
    }
    ASSIGN_OR_RETURN(AdoptedTensor a,
                     AdoptTensor(tp, i, *objects[i], *in, FindByName(prev, tp.spec().name()), e1,
                                 e2, where));
    sum->changed_elements += a.changed;
    sum->unchanged_tensors += a.unchanged ? 1 : 0;
    sum->patched_tensors += a.update.patch != nullptr ? 1 : 0;
    sum->keyframe_tensors += tp.delivery() == v1::DELIVERY_KEYFRAME ? 1 : 0;
    sum->wire_bytes += objects[i]->size();
    sum->dense_bytes += *sync::TensorByteSize(tp.spec());
    sum->total_elements += ElementsOf(tp.spec());
    out.push_back(std::move(a));
  }
  for (const BaselineTensor& p : prev) {
    auto it = std::lower_bound(order.begin(), order.end(), p.spec.name(),
                               [&](size_t k, const std::string& n) { return given[k].name < n; });
    if (it == order.end() || given[*it].name != p.spec.name()) ++sum->removed_tensors;
  }
  return out;
}
// A patched tensor's previous baseline buffer (held by the core alone) brought to the version's
// bytes by its received patch, in place: only the changed words are written, and the digest v2
// the apply computes on the way must be the version's. A patch that does not apply or disagrees
// (it was verified on arrival, so a bug) is repaired by copying the version's bytes whole.
// False after such a repair.
bool ApplyAdoptedInPlace(const AdoptedTensor& a) {
  std::span<uint8_t> buf(const_cast<uint8_t*>(a.base->data()), a.base->size());
  absl::StatusOr<DigestV2Delta> delta =
      ApplyPatchDigestV2(*a.update.patch, a.tensor.dtype, buf, buf, /*threads=*/1);
  if (delta.ok() && delta->ApplyTo(a.base_digest_v2, buf.size()) == a.tensor.digest_v2) return true;
  Logger("publisher")->error(
      "adopting {}: its patch does not bring the previous bytes to the version's ({}); copied",
      a.tensor.spec.name(), delta.ok() ? "digest v2 differs" : delta.status().ToString());
  std::memcpy(buf.data(), a.data.data(), buf.size());
  return false;
}

// The new baseline (name order; under the core's lock, as UpdateBaselineBytes): a changed
// tensor's previous buffer is brought forward in place when nothing but the core's baseline and
// `adopted` holds it (a transfer in flight may still read it: then a copy of the version's bytes).
void AdoptBaselineBytes(std::vector<AdoptedTensor>& adopted, int threads,
                        std::vector<BaselineTensor>* next, PublishSummary* sum) {
  const auto start = Clock::now();
  std::vector<AdoptedTensor*> in_place;
  for (AdoptedTensor& a : adopted) {
    if (a.tensor.bytes != nullptr || a.base == nullptr) continue;
    if (a.base.use_count() > kSoleBaselineOwners) {
      a.tensor.bytes = std::make_shared<const std::vector<uint8_t>>(a.data.begin(), a.data.end());
      ++sum->baseline_copied_tensors;
    } else {
      in_place.push_back(&a);
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // as UpdateBaselineBytes
  std::atomic<uint64_t> repaired{0};
  ParallelFor(in_place.size(), threads, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      if (!ApplyAdoptedInPlace(*in_place[i])) repaired.fetch_add(1, std::memory_order_relaxed);
    }
  });
  for (AdoptedTensor* a : in_place) a->tensor.bytes = std::move(a->base);
  sum->baseline_in_place_tensors += in_place.size() - repaired.load();
  sum->baseline_copied_tensors += repaired.load();
  next->reserve(adopted.size());
  for (AdoptedTensor& a : adopted) next->push_back(std::move(a.tensor));
  sum->baseline_update_micros += MicrosSince(start);
}

}  // namespace

absl::StatusOr<std::shared_ptr<LiveVersion>> PublisherCore::OpenRelayed(
    const v1::VersionHeader& upstream, bool* streaming) {
  *streaming = false;
  const std::string where = absl::StrCat("relaying version ", upstream.version(), " (base ",
                                         upstream.base_version(), ")");
  ASSIGN_OR_RETURN(v1::VersionHeader h, RelayedHeader(upstream, where));
  bool at_base = false;
  uint64_t expected = 0, base_digest = 0, base_digest_v2 = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    at_base = newest_version_ == upstream.base_version() && lineage_ == upstream.lineage() &&
              options_.device == nullptr;
    expected = newest_wire_bytes_;
    if (at_base) {
      base_digest = newest_digest_;
      base_digest_v2 =
          history_.VersionDigestOf(newest_version_, sync::DigestFormat::kV2).value_or(0);
    }
  }
  auto live = std::make_shared<LiveVersion>(std::move(h), expected, [this] { NotifyLiveChange(); });
  live->set_base_version_digests(base_digest, base_digest_v2);
  if (!at_base) return live;
  {
    // Peers that took the relayed version and reconnect before it is adopted are ahead of the
    // newest version, not diverged (numbered_version()).
    absl::MutexLock lock(&mu_);
    numbered_ = std::max(numbered_, live->version());
  }
  absl::MutexLock lock(&live_mu_);
  if (live_open_) {
    live_open_(live);
    *streaming = true;
  }
  return live;
}

absl::StatusOr<PublishSummary> PublisherCore::AdoptRelayed(const LiveVersion& live,
                                                           std::span<const TensorInput> given) {
  const auto start = Clock::now();
  absl::MutexLock publish_lock(&publish_mu_);
  const v1::VersionHeader& h = live.header();
  const std::string where = absl::StrCat("adopting relayed version ", h.version());
  std::vector<BaselineTensor> prev;
  uint64_t prev_version = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    prev = baseline_;
    prev_version = newest_version_;
    if (lineage_ != h.lineage() || prev_version != h.base_version() ||
        persister_ != nullptr || options_.device != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": needs the newest version to be its base ", h.base_version(), " of ",
          sync::DescribeLineage(h.lineage()), ", no persistence and no GPU encoding (newest ",
          prev_version, " of ", sync::DescribeLineage(lineage_), ")"));
    }
  }
  if (live.state() != LiveVersion::State::kCommitted) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": its transfer did not complete"));
  }
  RETURN_IF_ERROR(sync::CheckVersion(h.version(), "adopt"));
  std::vector<v1::TensorSpec> specs;
  std::vector<size_t> order;
  RETURN_IF_ERROR(ValidateInputs(given, where, &specs, &order));
  if (given.size() != live.tensor_count()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", given.size(),
                                                   " tensors given, the version has ",
                                                   live.tensor_count()));
  }
  const absl::StatusOr<v1::VersionEnd> e1 = live.end(sync::DigestFormat::kV1);
  const absl::StatusOr<v1::VersionEnd> e2 = live.end(sync::DigestFormat::kV2);
  if (!e1.ok() && !e2.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": no End: ", e1.status().message()));
  }
  PublishSummary sum;
  sum.version = h.version();
  sum.tensors = given.size();
  sum.snapshot_unix_nanos = h.snapshot_unix_nanos();
  ASSIGN_OR_RETURN(std::vector<AdoptedTensor> adopted,
                   AdoptTensors(live, given, specs, order, prev, e1, e2, where, &sum));
  FillAdoptedDigests(adopted, options_.digest_threads);
  RETURN_IF_ERROR(CheckAdoptedDigest(h, adopted, e1, sync::DigestFormat::kV1, where));
  RETURN_IF_ERROR(CheckAdoptedDigest(h, adopted, e2, sync::DigestFormat::kV2, where));
  std::vector<sync::TensorUpdate> updates;
  VersionCounts counts;
  counts.version = h.version();
  for (AdoptedTensor& a : adopted) {
    counts.changed.emplace_back(a.tensor.spec.name(), a.changed);
    updates.push_back(a.update);  // a copy: the install applies a.update.patch in place
  }
  std::sort(adopted.begin(), adopted.end(), [](const AdoptedTensor& a, const AdoptedTensor& b) {
    return a.tensor.spec.name() < b.tensor.spec.name();
  });
  std::sort(counts.changed.begin(), counts.changed.end());
  prev.clear();  // the previous buffers are now referenced by baseline_, adopted and transfers
  RecordNumbered(h.version());  // no-op: a relay's core does not persist
  uint64_t lineage = 0;
  LiveEnds ends;
  RETURN_IF_ERROR(RecordInHistory(h.version(), prev_version, std::move(updates), /*live=*/false,
                                  where, &sum, &lineage, &ends));
  std::map<std::string, std::shared_ptr<const DeviceBytes>> no_gpu;
  std::vector<BaselineTensor> next;
  InstallVersion(h.version(), [&] { AdoptBaselineBytes(adopted, options_.encode_threads, &next, &sum); },
                 next, no_gpu, std::move(counts), sum);
  sum.total_micros = MicrosSince(start);
  return sum;
}

}  // namespace refit::publisher
