#include "daemon/subscriber/relay_feed.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"

namespace refit::subscriber {

RelayFeed::RelayFeed(publisher::PublisherCore* peers, uint32_t max_frame_bytes)
    : peers_(peers), max_frame_bytes_(max_frame_bytes), log_(Logger("relay")) {}

void RelayFeed::OnHeader(const v1::VersionHeader& header) {
  absl::MutexLock lock(&mu_);
  if (live_ != nullptr) FailLocked(absl::AbortedError("a new transfer started"));
  // A transfer of the completed version again (a retry after this subscriber rejected it) or of
  // an older one (another lineage) replaces what completed.
  if (completed_ != nullptr && header.version() <= completed_->version()) completed_.reset();
  bool streaming = false;
  absl::StatusOr<std::shared_ptr<publisher::LiveVersion>> live =
      peers_->OpenRelayed(header, &streaming);
  if (!live.ok()) {
    ++stats_.not_relayable;
    stats_.last_error = std::string(live.status().message());
    log_->debug("{}", stats_.last_error);
    return;
  }
  live_ = *std::move(live);
  ++stats_.transfers;
  if (streaming) ++stats_.streamed;
  assembler_ = std::make_unique<sync::FrameAssembler>(header.version(), max_frame_bytes_);
  if (absl::Status st = ExpectObjectsLocked(header); !st.ok()) FailLocked(st);
}

absl::Status RelayFeed::ExpectObjectsLocked(const v1::VersionHeader& upstream) {
  for (int i = 0; i < upstream.tensors_size(); ++i) {
    const v1::TensorPlan& tp = upstream.tensors(i);
    const auto index = static_cast<uint32_t>(i);
    if (tp.delivery() == v1::DELIVERY_UNCHANGED) {  // no frames: a zero-byte patch for peers
      live_->Ready(index, nullptr);
      continue;
    }
    // A relayable transfer has one object per tensor (OpenRelayed refused chains).
    REFIT_ASSIGN_OR_RETURN(std::vector<sync::ObjectSpec> objects, sync::ObjectsOf(tp, index));
    for (sync::ObjectSpec& spec : objects)
      REFIT_RETURN_IF_ERROR(assembler_->Expect(std::move(spec)));
  }
  return absl::OkStatus();
}

void RelayFeed::OnFrame(const v1::DataFrame& frame) {
  absl::MutexLock lock(&mu_);
  if (live_ == nullptr || frame.version() != live_->version()) return;
  absl::StatusOr<bool> done = assembler_->Add(frame);
  if (!done.ok()) {
    FailLocked(done.status());
    return;
  }
  if (!*done) return;
  absl::StatusOr<std::vector<uint8_t>> object = assembler_->TakeObject(frame.tensor_index(), 0);
  if (!object.ok()) {
    FailLocked(object.status());
    return;
  }
  stats_.object_bytes += object->size();
  live_->Ready(frame.tensor_index(),
               std::make_shared<const std::vector<uint8_t>>(*std::move(object)));
}

void RelayFeed::OnEnd(const v1::VersionEnd& end, sync::DigestFormat format) {
  absl::MutexLock lock(&mu_);
  if (live_ == nullptr) return;
  if (end.version() != live_->version()) {
    FailLocked(absl::FailedPreconditionError(absl::StrCat(
        "VersionEnd of version ", end.version(), " while relaying version ", live_->version())));
    return;
  }
  if (absl::Status st = assembler_->CheckAllComplete(); !st.ok()) {
    FailLocked(st);
    return;
  }
  v1::VersionEnd e = end;
  e.clear_frames();  // the sender's own
  e.clear_wire_bytes();
  if (format == sync::DigestFormat::kV2) {
    live_->CommitV2First(e);
    // v1 peers take the version from the peer core's history once it is adopted there.
    live_->CompleteV1(absl::UnavailableError(absl::StrCat(
        "version ", e.version(), " was relayed with tensor digests v2 only")));
  } else {
    live_->Commit(e, std::nullopt);
  }
  ++stats_.completed;
  completed_ = std::move(live_);
  live_.reset();
  assembler_.reset();
}

void RelayFeed::OnAbort(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (live_ != nullptr) FailLocked(why);
}

void RelayFeed::FailLocked(const absl::Status& why) {
  ++stats_.failed;
  stats_.last_error =
      absl::StrCat("relaying version ", live_->version(), " failed: ", why.message());
  log_->warn("{}", stats_.last_error);
  live_->Fail(absl::Status(why.code(), stats_.last_error));
  live_.reset();
  assembler_.reset();
}

std::shared_ptr<const publisher::LiveVersion> RelayFeed::Completed(uint64_t version) const {
  absl::MutexLock lock(&mu_);
  if (completed_ == nullptr || completed_->version() != version) return nullptr;
  return completed_;
}

RelayStats RelayFeed::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace refit::subscriber
