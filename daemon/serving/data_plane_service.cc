// DataPlaneService's session registry and status: construction and shutdown, the sessions'
// registration and end, the publish notifications and the versions every session acked
// (WaitAllAcked; LastFullyAcked through FullyAckedTracker), Control's Sessions and Resync. The
// other members: data_plane_hello.cc (Hello, Welcome), data_plane_send.cc (the transfer loop, plain
// and streamed), data_plane_stripes.cc (frames over the streams, Stripe), data_plane_acks.cc (the
// subscriber's messages, Acks and retries).
#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/format.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/credentials.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/data_plane_session.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

DataPlaneService::DataPlaneService(PublisherCore* core, DataPlaneOptions options)
    : core_(core),
      options_(std::move(options)),
      log_(Logger(options_.logger)),
      acked_([this](const v1::RefitStats& stats, std::optional<uint64_t> refit_micros) {
        // codec.patch_format auto learns from it (the chooser's own leaf lock, not the core's).
        if (refit_micros.has_value()) core_->NoteRefitLatency(stats.version(), *refit_micros);
        if (options_.metrics != nullptr) {
          options_.metrics->FullyAcked(absl::Microseconds(stats.latency_micros()));
        }
      }) {
  if (options_.streamed_transfers) {
    core_->SetLiveListener(
        [this](std::shared_ptr<const LiveVersion> live) { OnLiveOpened(std::move(live)); },
        [this] { OnLiveChanged(); });
  }
}

DataPlaneService::~DataPlaneService() {
  if (options_.streamed_transfers) core_->SetLiveListener(nullptr, nullptr);
  Shutdown();
}

void DataPlaneService::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return;
  shutdown_ = true;
  ++epoch_;
  for (auto& [id, s] : sessions_) {
    if (!s->ended) {
      s->ended = true;
      s->end_status = absl::UnavailableError("publisher shutting down");
    }
    if (s->context != nullptr) s->context->TryCancel();
  }
}

void DataPlaneService::EndSessions(const std::string& why) {
  absl::MutexLock lock(&mu_);
  ++epoch_;
  for (auto& [id, s] : sessions_) {
    if (!s->ended) {
      s->ended = true;
      s->end_status = absl::UnavailableError(why);
    }
    if (s->context != nullptr) s->context->TryCancel();
  }
}

void DataPlaneService::NotifyPublished() {
  const uint64_t version = core_->newest_version();
  const uint64_t snapshot = core_->newest_snapshot_unix_nanos();
  absl::MutexLock lock(&mu_);
  ++epoch_;
  if (version == 0) return;
  std::vector<std::pair<uint64_t, FullyAckedTracker::SessionAck>> live;
  for (const auto& [id, s] : sessions_) {
    if (s->ended) continue;
    live.push_back({id,
                    {.ended = false,
                     .acked_version = s->acked_version,
                     .acked_unix_nanos = s->acked_unix_nanos}});
  }
  acked_.Published(version, snapshot, live, [&](uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return SessionAckOf(sessions_, id);
  });
}

std::vector<v1::SessionStatus> DataPlaneService::Sessions() const {
  const uint64_t newest = core_->newest_version();
  absl::MutexLock lock(&mu_);
  std::vector<v1::SessionStatus> out;
  for (const auto& [id, s] : sessions_) {
    if (s->ended) continue;
    v1::SessionStatus st;
    st.set_name(s->name);
    st.set_identity(s->identity);
    st.set_address(s->address);
    st.set_state(s->state);
    st.set_acked_version(s->acked_version);
    // A session at a number this publisher knows with another digest misses everything.
    const uint64_t held = s->verified ? s->acked_version : 0;
    st.set_lag_versions(newest > held ? newest - held : 0);
    st.set_streams(1 + s->joined_stripes);
    st.set_bytes_sent(s->bytes_sent);
    for (uint64_t b : s->stream_bytes_sent) st.add_stream_bytes_sent(b);
    st.set_stream_progress(s->progress);
    st.set_digest_format(sync::DigestFormatToWire(s->digest_format));
    st.set_connected_unix_nanos(s->connected_unix_nanos);
    *st.mutable_last_refit() = s->last_refit;
    out.push_back(std::move(st));
  }
  std::sort(out.begin(), out.end(), [](const v1::SessionStatus& a, const v1::SessionStatus& b) {
    return a.name() < b.name();
  });
  return out;
}

uint32_t DataPlaneService::RequestResync(const std::string& name,
                                         const std::vector<std::string>& tensors) {
  absl::MutexLock lock(&mu_);
  uint32_t n = 0;
  for (auto& [id, s] : sessions_) {
    if (s->ended || (!name.empty() && s->name != name)) continue;
    if (tensors.empty()) {
      s->all_keyframes = true;
    } else {
      s->keyframe_tensors.insert(tensors.begin(), tensors.end());
    }
    s->keyframe_reason = "resync requested through Control";
    ++n;
  }
  ++epoch_;
  return n;
}

absl::Status DataPlaneService::WaitAllAcked(uint64_t version, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shutdown_) return true;
    for (const auto& [id, s] : sessions_) {
      if (!s->ended && !s->CaughtUp(version)) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (shutdown_) return absl::UnavailableError("publisher shutting down");
  std::vector<std::string> behind;
  for (const auto& [id, s] : sessions_) {
    if (s->ended || s->CaughtUp(version)) continue;
    std::string why = absl::StrCat("subscriber ", s->name, " at version ", s->acked_version);
    if (!s->verified) absl::StrAppend(&why, " with another digest (diverged)");
    if (!s->diverged.empty()) absl::StrAppend(&why, " (", s->diverged, ")");
    behind.push_back(std::move(why));
  }
  if (behind.empty()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("not every subscriber reached version ", version,
                                                  ": ", absl::StrJoin(behind, ", ")));
}

v1::RefitStats DataPlaneService::LastFullyAcked() const { return acked_.LastFullyAcked(); }

// Adds the session unless shutting down or at transport.max_subscribers.
absl::Status DataPlaneService::RegisterSession(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("publisher shutting down");
  size_t live = 0;
  for (const auto& [id, s] : sessions_) live += s->ended ? 0 : 1;
  if (live >= options_.max_subscribers) {
    return absl::ResourceExhaustedError(absl::StrCat("publisher ", options_.name,
                                                     " already serves ", live,
                                                     " subscribers (transport.max_subscribers)"));
  }
  sessions_[session->id] = session;
  return absl::OkStatus();
}

// The session is over: forgotten, its end logged.
void DataPlaneService::EndSession(Session& s, const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    s.ended = true;
    s.context = nullptr;
    sessions_.erase(s.id);
    ++epoch_;
    acked_.Update([&](uint64_t id)
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return SessionAckOf(sessions_, id); });
  }
  if (status.ok() || status.error_code() == grpc::StatusCode::CANCELLED) {
    log_->info("session {}: subscriber {} left at version {}: {}", Hex64(s.id), s.name,
               s.acked_version, status.ok() ? "ok" : status.error_message());
  } else {
    log_->warn("session {}: subscriber {} ended: {}: {}", Hex64(s.id), s.name,
               absl::StatusCodeToString(FromGrpcCode(status.error_code())), status.error_message());
  }
}

}  // namespace refit::publisher
