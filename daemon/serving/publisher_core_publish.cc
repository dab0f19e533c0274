// PublisherCore::Publish and its commit: checks, the encode (CPU codec or GPU), the history and
// the streamed version's Ends, the baseline installed .
#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/baseline_persister.h"
#include "daemon/serving/cpu_encode.h"
#include "daemon/serving/encoded_version.h"
#include "daemon/serving/gpu_encode.h"
#include "daemon/serving/patch_log.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/serving/publisher_persistence.h"
#include "daemon/serving/tensor_cut.h"
#include "daemon/serving/version_inputs.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

// Publish, the encode: on the devices (GPU encoding) or the CPU codec (one pass or copying).
absl::Status EncodeVersion(const PublisherOptions& options, std::span<const TensorInput> given,
                           const std::vector<size_t>& order,
                           const std::vector<v1::TensorSpec>& specs,
                           const std::vector<BaselineTensor>& prev, const std::string& where,
                           GpuBaselineMap* gpu_baseline, const StreamPass& stream, Encoded* enc,
                           PublishSummary* sum) {
  if (options.device != nullptr) {
    REFIT_RETURN_IF_ERROR(
        EncodeOnDevices(options, given, order, specs, prev, where, gpu_baseline, enc, sum));
    return absl::OkStatus();  // v2 digests from the fused device encode (EncodeOnDevices)
  }
  // The CPU codec reads host bytes: device snapshots (CUDA tensors registered with a CPU codec)
  // come to the host first.
  std::span<const TensorInput> inputs = given;
  std::vector<TensorInput> downloaded;
  if (std::any_of(given.begin(), given.end(),
                  [](const TensorInput& in) { return in.device_bytes != nullptr; })) {
    REFIT_ASSIGN_OR_RETURN(downloaded, DownloadDeviceInputs(given, where, sum));
    inputs = downloaded;
  }
  if (!options.cpu_one_pass) {
    REFIT_RETURN_IF_ERROR(EncodeOnCpuCopying(options, inputs, order, specs, prev, where, enc, sum));
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

// patch_format_auto: the options delta version `version` is encoded with (the chooser's
// format); nullopt without auto (no chooser) or for a first version (keyframes only).
std::optional<PublisherOptions> AutoFormatOptions(const PublisherOptions& options,
                                                  FormatChooser* chooser, uint64_t version,
                                                  uint64_t prev_version) {
  if (chooser == nullptr || prev_version == 0) return std::nullopt;  // a first version: keyframes
  PublisherOptions o = options;
  o.patch_format = chooser->FormatFor(version);
  return o;
}

}  // namespace

absl::StatusOr<PublishSummary> PublisherCore::Publish(uint64_t version,
                                                      std::span<const TensorInput> given,
                                                      bool allow_degenerate,
                                                      const std::function<void()>& inputs_read) {
  const auto start = Clock::now();
  const absl::Duration cpu_start = ProcessCpuTime();
  absl::MutexLock publish_lock(&publish_mu_);
  PublishSummary sum;
  sum.version = version;
  const std::string where = absl::StrCat("publish version ", version);
  // Tensor-parallel cuts: the matched inputs become their parts (views or gathered buffers that
  // live until Publish returns).
  std::vector<TensorInput> cut;
  if (options_.cut.parts > 0) {
    REFIT_ASSIGN_OR_RETURN(cut, CutInputs(options_.cut, given, where));
    given = cut;
  }
  sum.tensors = given.size();

  uint64_t prev_version = 0;
  std::vector<BaselineTensor> prev = PublishBase(version, &prev_version);
  std::vector<v1::TensorSpec> specs;
  std::vector<size_t> order;
  REFIT_RETURN_IF_ERROR(CheckPublishable(version, prev_version, given, prev, allow_degenerate,
                                         where, &specs, &order));

  sum.snapshot_unix_nanos = NowUnixNanos();
  // Streamed transfers: sessions idle at prev_version send this version's frames as the pass
  // produces them; any failure from here to the commit aborts them (VersionAbort).
  std::shared_ptr<LiveVersion> live =
      OpenLive(version, prev_version, prev, specs, order, sum.snapshot_unix_nanos);
  absl::Cleanup fail_live = [&] {
    if (live != nullptr) live->Fail(absl::AbortedError(absl::StrCat(where, " failed")));
  };
  const bool defer_v1 = live != nullptr && options_.v1_after_end &&
                        live->base_version_digest(sync::DigestFormat::kV2) != 0;
  // The CPU one pass brings the baseline buffers the core alone holds forward as it encodes;
  // from here on a failure gives them back their bytes.
  Encoded enc;
  const std::vector<bool> in_pass =
      options_.update_baseline_in_pass && options_.device == nullptr && options_.cpu_one_pass
          ? BeginPassUpdate(prev)
          : std::vector<bool>();
  absl::Cleanup abort_update = [&] {
    publish_mu_.AssertHeld();  // runs before publish_lock's release (declared after it)
    if (!in_pass.empty()) AbortPassUpdate(enc);
  };
  const StreamPass stream{live.get(),
                          options_.stream_batch_bytes,
                          &options_.stream_batch_hook,
                          defer_v1,
                          options_.lazy_v1_digests && !v1_wanted_.load(std::memory_order_acquire),
                          &in_pass};
  const std::optional<PublisherOptions> chosen =
      AutoFormatOptions(options_, chooser_.get(), version, prev_version);
  sum.patch_format = chosen.has_value() ? chosen->patch_format : options_.patch_format;
  REFIT_RETURN_IF_ERROR(EncodeVersion(chosen.has_value() ? *chosen : options_, given, order, specs,
                                      prev, where, &gpu_baseline_, stream, &enc, &sum));
  std::vector<sync::TensorUpdate> updates;
  VersionCounts counts;
  counts.version = version;
  SummarizeVersion(enc, prev, &sum, &updates, &counts.changed);
  // The log record decides UNCHANGED against the previous version (as the history does); it
  // shares the patches and the dense tensors' buffers, never the caller's bytes.
  std::optional<LogRecord> record;
  if (persistence_ != nullptr) {
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
  REFIT_RETURN_IF_ERROR(RecordInHistory(version, prev_version, std::move(updates), live != nullptr,
                                        where, &sum, &lineage, &live_ends));
  // The streamed version's End goes out before the baseline update: a subscriber's refit does
  // not wait for the publisher's own bookkeeping.
  std::move(fail_live).Cancel();
  EndLive(version, prev_version, live.get(), std::move(live_ends), where, &enc, &sum);
  if (record.has_value()) SetLogDigests(enc.next, &*record);
  InstallVersion(
      version, [&] { UpdateBaselineBytes(&enc, options_.encode_threads, &sum); }, enc.next, enc.gpu,
      std::move(counts), sum);
  std::move(abort_update).Cancel();  // InstallVersion ended the pass's update
  if (inputs_read) inputs_read();    // the caller's bytes are not read any more

  if (record.has_value()) persistence_->Enqueue(*std::move(record), lineage, &sum);
  sum.total_micros = MicrosSince(start);
  sum.cpu_micros = WholeMicros(ProcessCpuTime() - cpu_start);
  return sum;
}

std::vector<BaselineTensor> PublisherCore::PublishBase(uint64_t version, uint64_t* prev_version) {
  // A relay's core: the adopted versions' deferred patches, before anything reads the baseline.
  if (absl::Status st = MaterializeBaselineLocked(); !st.ok()) {
    Logger("publisher")
        ->warn("publish version {}: {}; such tensors are sent as keyframes", version,
               st.ToString());
  }
  // lazy_v1_digests: while no v1 session wants them, the base's pending v1 digests stay pending
  // (unchanged tensors carry that state, changed ones are left pending after the End); once one
  // does (NeedV1Digests completed the newest version's), nothing is pending here.
  if (v1_wanted_.load(std::memory_order_acquire)) CompletePendingV1Locked();
  std::vector<BaselineTensor> prev;
  {
    absl::ReaderMutexLock lock(&mu_);
    prev = baseline_;
    *prev_version = newest_version_;
  }
  // A tensor whose baseline bytes are lost (BaselineTensor::deferred_failed) has no base.
  std::erase_if(prev, [](const BaselineTensor& t) { return t.deferred(); });
  return prev;
}

void PublisherCore::EndLive(uint64_t version, uint64_t prev_version, LiveVersion* live,
                            LiveEnds ends, const std::string& where, Encoded* enc,
                            PublishSummary* sum) {
  // v1 digests the version lacks: changed tensors the pass deferred (StreamPass::defer_v1) and,
  // on a lazy core, unchanged ones whose base's were pending.
  const bool v1_pending = std::any_of(enc->next.begin(), enc->next.end(),
                                      [](const BaselineTensor& t) { return t.digest_pending; });
  SettleLive(live, std::move(ends.v1), std::move(ends.v2), v1_pending);
  if (!v1_pending) return;
  if (v1_wanted_.load(std::memory_order_acquire)) {
    CompleteDeferredV1(version, prev_version, live, enc, sum);
  } else if (live != nullptr) {
    // lazy_v1_digests without a v1 session: the changed tensors' v1 digests stay pending (a v1
    // session admitted later has NeedV1Digests compute them from the baseline).
    live->CompleteV1(absl::FailedPreconditionError(
        absl::StrCat(where, ": v1 digests left pending (no session verifies v1)")));
  }
}

void PublisherCore::CompleteDeferredV1(uint64_t version, uint64_t prev_version, LiveVersion* live,
                                       Encoded* enc, PublishSummary* sum) {
  const std::vector<uint64_t> v1 = FillDeferredV1(enc, options_.digest_threads, sum);
  if (absl::Status st = RecordV1(version, prev_version, v1, live, sum); !st.ok()) {
    // The v2 End is out and subscribers may hold the version: it is installed regardless (the
    // core stays consistent with them); only v1 sessions cannot be sent it.
    Logger("publisher")->error("{}", st.ToString());
  }
}

absl::Status PublisherCore::CheckPublishable(uint64_t version, uint64_t prev_version,
                                             std::span<const TensorInput> given,
                                             const std::vector<BaselineTensor>& prev,
                                             bool allow_degenerate, const std::string& where,
                                             std::vector<v1::TensorSpec>* specs,
                                             std::vector<size_t>* order) const {
  REFIT_RETURN_IF_ERROR(sync::CheckVersion(version, "publish"));
  if (version <= prev_version) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": not above the newest published version ", prev_version));
  }
  if (given.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": no tensors"));
  REFIT_RETURN_IF_ERROR(ValidateInputs(given, where, specs, order));
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
  sum->version_digest_v2 = history_.VersionDigestOf(version, sync::DigestFormat::kV2).value_or(0);
  if (live) *live_ends = LiveEndsOf(history_, prev_version, version, *sum);
  return absl::OkStatus();
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
      if (live != nullptr)
        end = LiveEndOf(history_, prev_version, version, *sum, sync::DigestFormat::kV1);
    } else {
      // Cannot happen (one digest per tensor, of the bytes the pass encoded).
      st = absl::Status(absl::StatusCode::kInternal,
                        absl::StrCat("publish version ", version,
                                     ": recording the v1 digests: ", vdigest.status().message()));
      end = st;
    }
  }
  // Outside mu_: the live version's listener takes the service's lock.
  if (live != nullptr) live->CompleteV1(std::move(end));
  return st;
}

void PublisherCore::InstallVersion(uint64_t version, absl::FunctionRef<void()> update_baseline,
                                   std::vector<BaselineTensor>& next, GpuBaselineMap& gpu,
                                   VersionCounts counts, const PublishSummary& sum) {
  absl::MutexLock lock(&mu_);
  update_baseline();
  SetNewestLocked(version, sum);
  baseline_ = std::move(next);
  baseline_updating_ = false;
  if (options_.device != nullptr) gpu_baseline_ = std::move(gpu);
  counts_.push_back(std::move(counts));
  PruneCounts(history_, &counts_);
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

std::vector<bool> PublisherCore::BeginPassUpdate(const std::vector<BaselineTensor>& prev) {
  std::vector<bool> in_pass(prev.size(), false);
  bool any = false;
  absl::MutexLock lock(&mu_);
  for (size_t k = 0; k < prev.size(); ++k) {
    // baseline_ and `prev` hold it: no transfer, Baseline() copy or compaction snapshot does,
    // and none can take it to read until baseline_updating_ is cleared.
    in_pass[k] = prev[k].bytes != nullptr && prev[k].bytes.use_count() <= kSoleBaselineOwners;
    any = any || in_pass[k];
  }
  if (!any) return {};
  baseline_updating_ = true;
  return in_pass;
}

void PublisherCore::AbortPassUpdate(const Encoded& enc) {
  absl::MutexLock lock(&mu_);
  for (const Encoded::Pending& u : enc.pending) {
    if (!u.updated) continue;
    std::span<uint8_t> buf(const_cast<uint8_t*>(u.base->data()), u.base->size());
    if (absl::Status st = u.changes->Undo(u.index, buf); !st.ok()) {
      // Cannot happen (the pass's own log); its bytes are not the version's any more.
      Logger("publisher")
          ->error("restoring the baseline of {}: {}", enc.next[u.k].spec.name(), st.ToString());
      for (BaselineTensor& t : baseline_) {
        if (t.bytes == u.base) t.deferred_failed = true;
      }
    }
  }
  baseline_updating_ = false;
}

}  // namespace refit::publisher
