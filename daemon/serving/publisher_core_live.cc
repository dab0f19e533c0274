// PublisherCore's streamed versions (docs/ARCHITECTURE.md "Streamed transfers"): the live
// version a Publish opens for the data plane's listener, and its VersionEnds once committed.
#include <utility>

#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {

void PublisherCore::SetLiveListener(std::function<void(std::shared_ptr<const LiveVersion>)> on_open,
                                    std::function<void()> on_change) {
  live_listener_.Set(std::move(on_open), std::move(on_change));
}

std::shared_ptr<LiveVersion> PublisherCore::OpenLive(uint64_t version, uint64_t prev_version,
                                                     const std::vector<BaselineTensor>& prev,
                                                     const std::vector<v1::TensorSpec>& specs,
                                                     const std::vector<size_t>& order,
                                                     uint64_t snapshot_nanos) {
  if (options_.device != nullptr || !options_.cpu_one_pass) return nullptr;
  if (!live_listener_.listening()) return nullptr;
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
  // A first version (base 0) streams to sessions that hold none: every tensor a keyframe.
  h.set_reason(prev_version == 0 ? v1::TRANSFER_REASON_BOOTSTRAP
                                 : v1::TRANSFER_REASON_NEXT_VERSION);
  h.set_snapshot_unix_nanos(snapshot_nanos);
  for (size_t k = 0; k < order.size(); ++k) {
    v1::TensorPlan* tp = h.add_tensors();
    *tp->mutable_spec() = specs[order[k]];
    if (SameSpecAs(FindByPlace(prev, tp->spec()), tp->spec())) {
      tp->set_delivery(v1::DELIVERY_PATCH);
      v1::PatchStep* step = tp->add_steps();
      step->set_base_version(prev_version);
      step->set_target_version(version);
    } else {
      tp->set_delivery(v1::DELIVERY_KEYFRAME);
    }
  }
  // A first version: its objects are the tensors' bytes (the frame size and pacing estimate).
  if (prev_version == 0) {
    for (const v1::TensorSpec& spec : specs) expected += sync::TensorByteSize(spec).value_or(0);
  }
  auto live =
      std::make_shared<LiveVersion>(std::move(h), expected, [this] { live_listener_.Changed(); });
  live->set_base_version_digests(base_digest, base_digest_v2);
  live_listener_.Opened(live);
  return live;
}

LiveEnds LiveEndsOf(const sync::PatchHistory& history, uint64_t prev_version, uint64_t version,
                    const PublishSummary& sum) {
  LiveEnds ends;
  ends.v1 = LiveEndOf(history, prev_version, version, sum, sync::DigestFormat::kV1);
  if (auto v2 = LiveEndOf(history, prev_version, version, sum, sync::DigestFormat::kV2); v2.ok()) {
    ends.v2 = *std::move(v2);
  }
  return ends;
}

absl::StatusOr<v1::VersionEnd> LiveEndOf(const sync::PatchHistory& history, uint64_t prev_version,
                                         uint64_t version, const PublishSummary& sum,
                                         sync::DigestFormat format) {
  // The same digests and version digest as the committed path's End (Transfer::End); from
  // version 0, the bootstrap plan's.
  uint64_t prev_digest = 0;
  if (prev_version != 0) {
    REFIT_ASSIGN_OR_RETURN(prev_digest, history.VersionDigestOf(prev_version, format));
  }
  REFIT_RETURN_IF_ERROR(history.VersionDigestOf(version, format).status());
  sync::PlanOptions po;
  po.digest_format = format;
  REFIT_ASSIGN_OR_RETURN(const sync::TransferPlan plan,
                         history.Plan(prev_version, prev_digest, version, po));
  v1::VersionEnd e = plan.End();
  e.set_version(version);
  e.set_changed_elements(sum.changed_elements);
  e.set_total_elements(sum.total_elements);
  e.set_encode_micros(sum.encode_micros);
  e.set_publish_pass_micros(sum.pass_micros);
  e.set_baseline_update_micros(sum.baseline_update_micros);
  return e;
}

}  // namespace refit::publisher
