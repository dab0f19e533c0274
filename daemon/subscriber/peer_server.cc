#include "daemon/subscriber/peer_server.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/thread_priority.h"
#include "daemon/common/units.h"
#include "daemon/sync/versions.h"

namespace refit::subscriber {

absl::StatusOr<std::unique_ptr<PeerServer>> PeerServer::Create(SubscriberCore* core,
                                                               PeerServerOptions options) {
  std::unique_ptr<PeerServer> s(new PeerServer(core, std::move(options)));
  publisher::PublisherOptions po;
  po.encode_threads = s->options_.threads;
  po.digest_threads = s->options_.threads;
  // Peers verify v2: relayed versions from a v2 upstream need no v1 digests until a v1 peer
  // comes (PublisherCore::NeedV1Digests).
  po.lazy_v1_digests = true;
  REFIT_ASSIGN_OR_RETURN(s->peer_core_, publisher::PublisherCore::Open(po));
  publisher::DataPlaneOptions dpo;
  dpo.name = s->options_.name;
  dpo.logger = "peers";
  s->service_ = std::make_unique<publisher::DataPlaneService>(s->peer_core_.get(), dpo);
  if (s->hooks_.enabled()) {
    s->log_->warn("test hook: peers get no installed version while \"{}\" exists",
                  s->hooks_.File(TestHook::kStallPeers));
  }
  if (s->options_.cut_through) {
    s->relay_ = std::make_unique<RelayFeed>(s->peer_core_.get(), s->options_.max_frame_bytes);
  }
  return s;
}

PeerServer::PeerServer(SubscriberCore* core, PeerServerOptions options)
    : core_(core),
      options_(std::move(options)),
      log_(Logger("subscriber")),
      hooks_(TestHooks::FromEnvironment()) {}

PeerServer::~PeerServer() { Stop(); }

void PeerServer::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void PeerServer::Stop() {
  if (service_ != nullptr) service_->Shutdown();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void PeerServer::OnApplied() {
  absl::MutexLock lock(&mu_);
  ++wanted_;  // counts applied versions (a lineage change may lower the number)
}

void PeerServer::Loop() {
  // Installs for peers are adopted after the refit they follow; the threads they start inherit.
  if (absl::Status st = LowerThisThreadPriority(options_.background_nice); !st.ok()) {
    log_->warn("serving peers: the install thread keeps its priority: {}", st.ToString());
  }
  uint64_t done = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &done]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || wanted_ > done; };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      done = wanted_;
    }
    if (!StallHook()) return;
    // Always the newest applied version: intermediate ones that arrived meanwhile are skipped.
    if (absl::Status st = PublishNewest(); !st.ok()) {
      log_->warn("serving peers: {}", st.ToString());
    }
  }
}

// Test hook stall_peers (test_hooks.h): while its file exists, nothing is installed for the
// peers, so only relayed streams reach them. False on shutdown.
bool PeerServer::StallHook() {
  if (!hooks_.enabled()) return true;
  bool logged = false;
  while (hooks_.Stalled(TestHook::kStallPeers)) {
    if (!logged) log_->warn("test hook: installing versions for peers stalled");
    logged = true;
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(10))) return false;
  }
  return true;
}

absl::Status PeerServer::PublishNewest() {
  REFIT_ASSIGN_OR_RETURN(
      SubscriberLease lease,
      core_->generations().AcquireLease(options_.consumer, std::nullopt, absl::InfiniteDuration()));
  absl::Status result = FollowUpstreamLineage();
  if (result.ok() && lease.lease.version > peer_core_->newest_version()) {
    std::vector<publisher::TensorInput> inputs;
    result = InputsOf(lease, &inputs);
    absl::StatusOr<publisher::PublishSummary> summary =
        result.ok() ? Install(lease.lease.version, inputs)
                    : absl::StatusOr<publisher::PublishSummary>(result);
    if (summary.ok()) {
      log_->debug(
          "serving peers: version {} ({} tensors, wire {} for a peer at the previous "
          "version) in {}",
          summary->version, summary->tensors, FormatBytes(summary->wire_bytes),
          FormatMicros(summary->total_micros));
    } else {
      result = Annotate(summary.status(), "publishing version ", lease.lease.version, " to peers");
    }
  }
  (void)core_->generations().ReleaseLease(lease.lease.lease_id);
  if (result.ok()) service_->NotifyPublished();
  return result;
}

v1::RelayStatus PeerServer::RelayStatus() const {
  v1::RelayStatus out;
  out.set_cut_through(relay_ != nullptr);
  if (relay_ != nullptr) {
    const RelayStats s = relay_->stats();
    out.set_transfers(s.transfers);
    out.set_streamed(s.streamed);
    out.set_completed(s.completed);
    out.set_failed(s.failed);
    out.set_not_relayable(s.not_relayable);
    out.set_object_bytes(s.object_bytes);
    out.set_last_error(s.last_error);
  }
  out.set_adopted_versions(adopted_versions_.load(std::memory_order_relaxed));
  out.set_reencoded_versions(reencoded_versions_.load(std::memory_order_relaxed));
  out.set_peer_streamed_transfers(service_->streamed_transfers());
  return out;
}

// Peers see the upstream's lineage: a subscriber bootstrapped from a peer keeps deltas from the
// publisher. A lineage change upstream starts the peer core afresh.
absl::Status PeerServer::FollowUpstreamLineage() {
  const uint64_t lineage = core_->applied_lineage();
  if (lineage == peer_core_->lineage()) return absl::OkStatus();
  const bool had_versions = peer_core_->newest_version() != 0;
  REFIT_RETURN_IF_ERROR(peer_core_->Reset(lineage));
  if (had_versions) {
    log_->warn("serving peers: upstream changed to {}: peers reconnect and get keyframes",
               sync::DescribeLineage(lineage));
    service_->EndSessions("the upstream changed lineage");
  }
  return absl::OkStatus();
}

// The leased version's tensors as publisher inputs (a GPU store's are downloaded: the peer
// publisher keeps host bytes anyway, and takes the buffers over without a second copy).
absl::Status PeerServer::InputsOf(const SubscriberLease& lease,
                                  std::vector<publisher::TensorInput>* inputs) {
  const store::Layout& layout = lease.store->layout();
  inputs->reserve(layout.size());
  const bool host = lease.store->memory().host_accessible();
  for (size_t i = 0; i < layout.size(); ++i) {
    const store::TensorInfo& ti = layout.tensor(i);
    publisher::TensorInput in;
    in.name = ti.name;
    in.dtype = ti.dtype;
    in.shape = ti.shape;
    in.data = lease.lease.spans[i];
    if (!host) {
      auto buf = std::make_shared<std::vector<uint8_t>>(lease.lease.spans[i].size());
      REFIT_RETURN_IF_ERROR(lease.store->memory().Download(*buf, lease.lease.spans[i]));
      in.data = *buf;
      in.owned = std::move(buf);
    }
    inputs->push_back(std::move(in));
  }
  return absl::OkStatus();
}

// The version relayed to the peers is adopted from the patches received; any other (not
// relayable, not the next one for the peer core, relays off) is encoded again.
absl::StatusOr<publisher::PublishSummary> PeerServer::Install(
    uint64_t version, const std::vector<publisher::TensorInput>& inputs) {
  std::shared_ptr<const publisher::LiveVersion> relayed =
      relay_ != nullptr ? relay_->Completed(version) : nullptr;
  if (relayed != nullptr && relayed->base_version() == peer_core_->newest_version()) {
    absl::StatusOr<publisher::PublishSummary> adopted = peer_core_->AdoptRelayed(*relayed, inputs);
    if (adopted.ok()) {
      adopted_versions_.fetch_add(1, std::memory_order_relaxed);
      return adopted;
    }
    log_->warn("serving peers: {}; encoding it instead", adopted.status().ToString());
  }
  reencoded_versions_.fetch_add(1, std::memory_order_relaxed);
  return peer_core_->Publish(version, inputs);
}

}  // namespace refit::subscriber
