// Encoding a version on GPUs: per tensor, the target and base on its device, the fused encode
// (patch, digest v2, baseline updated in place), the v1 digest and the host bytes.
#include "daemon/serving/gpu_encode.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core_internal.h"

namespace refit::publisher {
namespace {

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
  REFIT_ASSIGN_OR_RETURN(out->memory, device->Allocate(host.size(), kind));
  REFIT_RETURN_IF_ERROR(ToMemory(*out, host.data(), host.size()));
  return std::shared_ptr<const DeviceBytes>(std::move(out));
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
  t.digest_pending = job.prev->digest_pending;
  t.digest_v2 = job.prev->digest_v2;
  out->unchanged[k] = true;
  if (job.old_gpu != nullptr) out->gpu[TensorPlace::Of(t.spec)] = std::move(job.old_gpu);
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
    return Annotate(up.status(), job.what, ": uploading to ", options.device->Describe());
  }
  sum->upload_micros += MicrosSince(upload_start);
  return std::move(*up);
}

// GPU encoding, step 3: the base of the encode on the target's device: the GPU baseline when this
// device can read it (its own memory, or pinned memory, which every device reads), else the
// previous host bytes uploaded for this call. `own` says the base is the publisher's GPU
// baseline held by nothing else, so the one pass may bring it up to date in place.
absl::StatusOr<std::shared_ptr<const DeviceBytes>> DeviceBase(DeviceTensorJob& job,
                                                              const DeviceBytes& target, bool* own,
                                                              PublishSummary* sum) {
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
    return Annotate(up.status(), job.what, ": uploading the previous version to ", dev->Describe());
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
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<const DeviceBytes> base,
                         DeviceBase(job, *target, &own, sum));
  EncodeOptions eo;
  eo.block_log2 = options.block_log2;
  eo.format = options.patch_format;
  const auto encode_start = Clock::now();
  // DeviceBytes is shared as const: only the baseline held by nobody else (`own`) is written.
  auto fused = dev->EncodeFused(out->next[k].dtype, base->memory.data(), target->memory.data(),
                                job.bytes, eo, /*update_base=*/own);
  sum->encode_micros += MicrosSince(encode_start);
  if (!fused.ok()) {
    return AnnotateAs(absl::StatusCode::kInternal, fused.status(), job.what, ": encoding on ",
                      dev->Describe(), " failed");
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
    t.digest_pending = job.prev->digest_pending;
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
  if (!digest.ok()) return Annotate(digest.status(), job.what, ": digest on ", dev->Describe());
  t.digest = *digest;
  if (!have_v2) {
    auto v2 = dev->DigestV2(now.memory.data(), job.bytes);
    if (!v2.ok()) {
      return Annotate(v2.status(), job.what, ": digest v2 on ", dev->Describe());
    }
    t.digest_v2 = *v2;
  }
  sum->digest_micros += MicrosSince(digest_start);
  if (job.in->device_bytes == nullptr) return absl::OkStatus();
  const auto download_start = Clock::now();
  auto host = std::make_shared<std::vector<uint8_t>>(job.bytes);
  absl::Status st = FromMemory(host->data(), now, job.bytes);
  if (!st.ok()) {
    return Annotate(st, job.what, ": copying the snapshot from ", dev->Describe(), " to the host");
  }
  t.bytes = std::move(host);
  sum->download_micros += MicrosSince(download_start);
  return absl::OkStatus();
}

// GPU encoding of one tensor (manifest order k): steps 1-5.
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
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<const DeviceBytes> target,
                         DeviceTarget(options, job, t, sum));
  cuda::Device* const dev = target->device;
  if (std::find(used->begin(), used->end(), dev) == used->end()) used->push_back(dev);
  std::shared_ptr<const DeviceBytes> now = std::move(target);
  if (job.same_spec) {
    std::shared_ptr<const DeviceBytes> next;
    REFIT_ASSIGN_OR_RETURN(const bool unchanged,
                           EncodeFusedOnDevice(options, job, std::move(now), k, out, &next, sum));
    now = std::move(next);
    if (unchanged) {
      out->gpu[TensorPlace::Of(t.spec)] = std::move(now);
      return absl::OkStatus();
    }
  }
  REFIT_RETURN_IF_ERROR(DigestAndDownload(job, *now, job.same_spec, t, sum));
  out->gpu[TensorPlace::Of(t.spec)] = std::move(now);
  return absl::OkStatus();
}

// GPU encoding (PublisherCore's class comment): every tensor encoded and digested on its device
// against its GPU baseline (`gpu_baseline`, whose entries are taken out as the tensors are

}  // namespace

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
      return Annotate(st, where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), in.name),
                      ": copying the snapshot from ", in.device_bytes->device->Describe(),
                      " to the host");
    }
    in.data = *host;
    in.owned = std::move(host);
    in.device_bytes = nullptr;
  }
  sum->download_micros += MicrosSince(start);
  return out;
}

absl::Status EncodeOnDevices(const PublisherOptions& options, std::span<const TensorInput> inputs,
                             const std::vector<size_t>& order,
                             const std::vector<v1::TensorSpec>& specs,
                             const std::vector<BaselineTensor>& prev, const std::string& where,
                             GpuBaselineMap* gpu_baseline, Encoded* out, PublishSummary* sum) {
  ResizeEncoded(order.size(), out);
  std::vector<cuda::Device*> used;
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.spec = specs[order[k]];
    t.dtype = in.dtype;
    DeviceTensorJob job;
    job.in = &in;
    job.prev = FindByPlace(prev, t.spec);
    job.same_spec = SameSpecAs(job.prev, t.spec);
    job.bytes = static_cast<size_t>(*sync::TensorByteSize(t.spec));
    job.what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(order[k]), in.name));
    if (auto it = gpu_baseline->find(TensorPlace::Of(t.spec)); it != gpu_baseline->end()) {
      job.old_gpu = std::move(it->second);
      gpu_baseline->erase(it);
    }
    REFIT_RETURN_IF_ERROR(EncodeTensorOnDevice(options, job, k, out, &used, sum));
  }
  std::vector<std::string> names;
  names.reserve(used.size());
  for (cuda::Device* d : used) names.push_back(d->Describe());
  sum->encode_device = names.empty() ? options.device->Describe() : absl::StrJoin(names, "; ");
  return absl::OkStatus();
}

}  // namespace refit::publisher
