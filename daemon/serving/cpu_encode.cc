// Encoding a version on the CPU codec: the one pass (compare, encode and digest in one read of
// baseline and the caller's bytes; the baseline brought forward in place at the commit) and the
// copying path.
#include "daemon/serving/cpu_encode.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/functional/function_ref.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core_internal.h"

namespace refit::publisher {
namespace {

// The CPU codec's options of this publisher.
EncodeOptions CodecOptionsOf(const PublisherOptions& options) {
  EncodeOptions eo;
  eo.threads = options.encode_threads;
  eo.block_log2 = options.block_log2;
  eo.format = options.patch_format;
  return eo;
}

// `in.data` as a buffer of its own: the caller's `owned` when it holds exactly those bytes, else
// a copy.
std::shared_ptr<const std::vector<uint8_t>> OwnBytes(
    std::span<const uint8_t> data, const std::shared_ptr<const std::vector<uint8_t>>& owned) {
  if (owned != nullptr && owned->data() == data.data() && owned->size() == data.size()) {
    return owned;
  }
  // Non-const vector: the one pass may later patch its elements in place (BaselineTensor).
  return std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
}

// CPU one pass, step 1: what each tensor needs. Same spec as before: encoded against its
// baseline (returned, in `order` positions); no bytes: unchanged; otherwise (new or reshaped)
// a keyframe (null base, not unchanged), copied and digested by CopyKeyframes.
std::vector<const BaselineTensor*> ClassifyForPass(std::span<const TensorInput> inputs,
                                                   const std::vector<size_t>& order,
                                                   const std::vector<v1::TensorSpec>& specs,
                                                   const std::vector<BaselineTensor>& prev,
                                                   Encoded* out) {
  std::vector<const BaselineTensor*> bases(order.size(), nullptr);
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.spec = specs[order[k]];
    t.dtype = in.dtype;
    const BaselineTensor* p = FindByPlace(prev, t.spec);
    if (SameSpecAs(p, t.spec) && !in.data.empty()) {
      bases[k] = p;
    } else if (SameSpecAs(p, t.spec)) {  // no bytes: nothing can differ
      t.bytes = p->bytes;
      t.digest = p->digest;
      t.digest_pending = p->digest_pending;
      t.digest_v2 = p->digest_v2;
      out->unchanged[k] = true;
    }
  }
  return bases;
}

// CPU one pass, one batch of keyframe tensors `ks` (manifest-order indices): each copied into
// the core's own buffer (never the caller's bytes: they are sent after Publish returns) and
// digested (v1 unless `no_v1`: then left pending).
void CopyKeyframes(const PublisherOptions& options, std::span<const TensorInput> inputs,
                   const std::vector<size_t>& order, std::span<const size_t> ks, bool no_v1,
                   Encoded* out, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  for (size_t k : ks) {
    const TensorInput& in = inputs[order[k]];
    BaselineTensor& t = out->next[k];
    t.bytes = OwnBytes(in.data, in.owned);
    if (no_v1) {
      t.digest_pending = true;
    } else {
      t.digest = TensorDigest(*t.bytes, options.digest_threads);
    }
    t.digest_v2 = TensorDigestV2(*t.bytes, options.digest_threads);
  }
  AddSince(start, &sum->digest_micros, &sum->digest_cpu_micros);
}

// CPU one pass, one batch: the tensors `ks` (manifest-order indices, each with a base) compared,
// encoded and digested by one EncodePatchesWithDigests.
// `in_pass[k]`: tensor k's baseline buffer is brought to the new bytes by the scan itself.
absl::Status EncodeBatch(const PublisherOptions& options, std::span<const TensorInput> inputs,
                         const std::vector<size_t>& order,
                         const std::vector<const BaselineTensor*>& bases,
                         const std::vector<bool>& in_pass, std::span<const size_t> ks,
                         const std::string& where, bool defer_v1, Encoded* out) {
  std::vector<EncodeInput> enc;
  for (size_t k : ks) {
    EncodeInput e{out->next[k].dtype, *bases[k]->bytes, inputs[order[k]].data};
    if (in_pass[k]) {
      // Baseline buffers are non-const vectors (BaselineTensor); the core alone holds this one.
      e.update_base = const_cast<uint8_t*>(bases[k]->bytes->data());
    }
    enc.push_back(e);
  }
  std::vector<PatchStats> stats;
  std::vector<uint64_t> digests;
  auto changes = std::make_shared<EncodedChanges>();
  auto encoded = EncodePatchesWithChanges(enc, CodecOptionsOf(options), &stats,
                                          defer_v1 ? nullptr : &digests, changes.get());
  if (!encoded.ok()) {
    return AnnotateAs(absl::StatusCode::kInternal, encoded.status(), where, ": encoding failed");
  }
  for (size_t j = 0; j < ks.size(); ++j) {
    const size_t k = ks[j];
    const BaselineTensor* p = bases[k];
    BaselineTensor& t = out->next[k];
    if (stats[j].changed_elements == 0) {  // bit patterns compared: the same bytes
      t.bytes = p->bytes;
      t.digest = p->digest;
      t.digest_pending = p->digest_pending;
      t.digest_v2 = p->digest_v2;
      out->unchanged[k] = true;
      continue;
    }
    t.digest = defer_v1 ? 0 : digests[j];
    t.digest_pending = defer_v1;
    // The scan's delta: the v2 digest is known before any byte of the baseline changes.
    t.digest_v2 = changes->DigestV2DeltaOf(j).ApplyTo(p->digest_v2, enc[j].target.size());
    out->patches[k] = std::make_shared<const std::vector<uint8_t>>(std::move((*encoded)[j]));
    out->changed[k] = stats[j].changed_elements;
    const TensorInput& in = inputs[order[k]];
    out->pending.push_back({k, p->bytes, in.data, in.owned, changes, j, in_pass[k]});
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

// CPU one pass, before the commit (outside the core's lock): changed tensors whose baseline
// buffer something else already references get a new buffer now (copy-on-write). Their v2
// digests came from the pass (EncodeBatch).
void CopyPending(const Encoded::Pending& u, Encoded* enc, PublishSummary* sum) {
  enc->next[u.k].bytes = OwnBytes(u.target, u.owned);
  ++sum->baseline_copied_tensors;
}

}  // namespace

// The CPU codec's copying path (options.cpu_one_pass false, for benchmarks): memcmp, snapshot
// copy, digest of the copy, encode (four reads). Host bytes of every input (no DeviceBytes).
absl::Status EncodeOnCpuCopying(const PublisherOptions& options,
                                std::span<const TensorInput> inputs,
                                const std::vector<size_t>& order,
                                const std::vector<v1::TensorSpec>& specs,
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
    const BaselineTensor* p = FindByPlace(prev, t.spec);
    const bool same_spec = SameSpecAs(p, t.spec);
    if (same_spec &&
        (in.data.empty() || std::memcmp(p->bytes->data(), in.data.data(), in.data.size()) == 0)) {
      t.bytes = p->bytes;
      t.digest = p->digest;
      t.digest_pending = p->digest_pending;
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

  const StageMark digest_start = StageMark::Now();
  for (size_t k = 0; k < out->next.size(); ++k) {
    if (!out->unchanged[k]) {
      out->next[k].digest = TensorDigest(*out->next[k].bytes, options.digest_threads);
    }
  }
  AddSince(digest_start, &sum->digest_micros, &sum->digest_cpu_micros);

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
    return AnnotateAs(absl::StatusCode::kInternal, encoded.status(), where, ": encoding failed");
  }
  sum->encode_micros = MicrosSince(encode_start);
  for (size_t j = 0; j < enc_index.size(); ++j) {
    const size_t k = enc_index[j];
    out->patches[k] = std::make_shared<const std::vector<uint8_t>>(std::move((*encoded)[j]));
    out->changed[k] = j < stats.size() ? stats[j].changed_elements : ElementsOf(out->next[k].spec);
  }
  return absl::OkStatus();
}

// The batches of `ks` (BatchEnd), each run by `run` after the stream's test hook.
absl::Status ForEachBatch(const StreamPass& stream, std::span<const TensorInput> inputs,
                          const std::vector<size_t>& order, const std::vector<size_t>& ks,
                          absl::FunctionRef<absl::Status(std::span<const size_t>)> run) {
  for (size_t b = 0; b < ks.size();) {
    const size_t e = BatchEnd(stream, inputs, order, ks, b);
    if (stream.live != nullptr && stream.hook != nullptr && *stream.hook) {
      REFIT_RETURN_IF_ERROR((*stream.hook)(ks[b], ks[e - 1] + 1));
    }
    REFIT_RETURN_IF_ERROR(run(std::span<const size_t>(ks.data() + b, e - b)));
    b = e;
  }
  return absl::OkStatus();
}

// CPU one pass (PublisherCore's class comment): every tensor with a base compared, encoded and
// digested by EncodePatchesWithDigests over (baseline, caller's bytes); no snapshot copy. When
// streamed, in batches, each tensor's object handed to the live version as its batch completes:
// byte-less unchanged tensors first, then the keyframes (copied and digested batch by batch,
// so that a first version's frames leave while the rest is copied), then the patches.
absl::Status EncodeOnCpuOnePass(const PublisherOptions& options,
                                std::span<const TensorInput> inputs,
                                const std::vector<size_t>& order,
                                const std::vector<v1::TensorSpec>& specs,
                                const std::vector<BaselineTensor>& prev, const std::string& where,
                                const StreamPass& stream, Encoded* out, PublishSummary* sum) {
  ResizeEncoded(order.size(), out);
  // The changed tensors' v1 digests: after the End (FillDeferredV1), or not at all (no_v1).
  const bool skip_v1 = stream.defer_v1 || stream.no_v1;
  const std::vector<const BaselineTensor*> bases = ClassifyForPass(inputs, order, specs, prev, out);
  std::vector<bool> in_pass(order.size(), false);
  if (stream.update_base != nullptr && !stream.update_base->empty()) {
    for (size_t k = 0; k < order.size(); ++k) {
      if (bases[k] != nullptr) in_pass[k] = (*stream.update_base)[bases[k] - prev.data()];
    }
  }
  // A batch's objects to the live version: keyframes' own bytes, patches (none: unchanged).
  auto ready = [&](std::span<const size_t> batch, bool keyframes) {
    if (stream.live == nullptr) return;
    for (size_t k : batch) {
      stream.live->Ready(
          static_cast<uint32_t>(k),
          keyframes ? out->next[k].bytes : (out->unchanged[k] ? nullptr : out->patches[k]));
    }
  };
  std::vector<size_t> ks;
  std::vector<size_t> keyframes;
  for (size_t k = 0; k < order.size(); ++k) {
    if (bases[k] != nullptr) {
      ks.push_back(k);
    } else if (out->unchanged[k]) {
      if (stream.live != nullptr) stream.live->Ready(static_cast<uint32_t>(k), nullptr);
    } else {
      keyframes.push_back(k);
    }
  }
  REFIT_RETURN_IF_ERROR(
      ForEachBatch(stream, inputs, order, keyframes, [&](std::span<const size_t> batch) {
        CopyKeyframes(options, inputs, order, batch, stream.no_v1, out, sum);
        ready(batch, /*keyframes=*/true);
        return absl::OkStatus();
      }));
  if (ks.empty()) return absl::OkStatus();
  const StageMark pass_start = StageMark::Now();
  REFIT_RETURN_IF_ERROR(ForEachBatch(stream, inputs, order, ks, [&](std::span<const size_t> batch) {
    REFIT_RETURN_IF_ERROR(
        EncodeBatch(options, inputs, order, bases, in_pass, batch, where, skip_v1, out));
    ready(batch, /*keyframes=*/false);
    return absl::OkStatus();
  }));
  AddSince(pass_start, &sum->pass_micros, &sum->pass_cpu_micros);
  sum->encode_micros = sum->pass_micros;
  return absl::OkStatus();
}

void CopySharedPending(Encoded* enc, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  for (Encoded::Pending& u : enc->pending) {
    if (u.updated || u.base.use_count() <= kSoleBaselineOwners) continue;
    CopyPending(u, enc, sum);
  }
  AddSince(start, &sum->baseline_update_micros, &sum->baseline_update_cpu_micros);
}

// CPU one pass, at the commit. Must run with the core's mu_ held exclusively, before the new
// baseline is installed: references to baseline buffers are only taken from the baseline under
// that lock, so a buffer nothing else references now stays unreferenced while it is patched.
// Such a buffer gets the pass's logged changes written in place (O(changed): no decode, no
// read of unchanged words); the others are copied from the caller's bytes.
void UpdateBaselineBytes(Encoded* enc, int threads, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  std::vector<Encoded::Pending*> in_place;
  for (Encoded::Pending& u : enc->pending) {
    if (enc->next[u.k].bytes != nullptr) continue;  // copied before the lock
    if (!u.updated && u.base.use_count() > kSoleBaselineOwners) {
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
      if (u.updated) continue;  // by the pass
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
  AddSince(start, &sum->baseline_update_micros, &sum->baseline_update_cpu_micros);
}

// The copying path: each tensor's v2 digest, the previous one where the buffer is the
// previous version's, else TensorDigestV2 of the host bytes (a full read of changed tensors).
void FillDigestsV2(const PublisherOptions& options, const std::vector<BaselineTensor>& prev,
                   Encoded* enc, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  for (BaselineTensor& t : enc->next) {
    const BaselineTensor* p = FindByPlace(prev, t.spec);
    if (p != nullptr && p->bytes == t.bytes) {
      t.digest_v2 = p->digest_v2;
    } else if (t.bytes != nullptr) {
      t.digest_v2 = TensorDigestV2(*t.bytes, options.digest_threads);
    }
  }
  AddSince(start, &sum->digest_micros, &sum->digest_cpu_micros);
}

// After the v2 End is out: every v1 digest enc->next still lacks (digest_pending) into
// enc->next: a changed tensor's from the caller's bytes (valid until Publish returns; its
// baseline buffer is not updated yet), one carried over pending from its base
// (lazy_v1_digests) from its own bytes. Returns every tensor's v1 digest in manifest order.
std::vector<uint64_t> FillDeferredV1(Encoded* enc, int threads, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  std::vector<std::span<const uint8_t>> target_of(enc->next.size());
  for (const Encoded::Pending& u : enc->pending) target_of[u.k] = u.target;
  FillPendingV1(enc->next, threads, &target_of);
  std::vector<uint64_t> all;
  all.reserve(enc->next.size());
  for (const BaselineTensor& t : enc->next) all.push_back(t.digest);
  AddSince(start, &sum->digest_micros, &sum->digest_cpu_micros);
  return all;
}

}  // namespace refit::publisher
