#include "daemon/subscriber/consumer_api.h"

#include <malloc.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/durations.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/peer_cred.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/store/tensor_store.h"
#include "daemon/sync/version_digest.h"

namespace refit::subscriber {

// ---- VersionBoard -------------------------------------------------------------------------------

void VersionBoard::Announce(const AppliedVersion& applied) {
  absl::MutexLock lock(&mu_);
  if (applied.version <= current_.version) return;
  current_ = applied;
  if (pending_.version <= current_.version) pending_ = AppliedVersion{};
}

void VersionBoard::AnnouncePending(uint64_t version, uint64_t version_digest) {
  absl::MutexLock lock(&mu_);
  if (version <= current_.version || version <= pending_.version) return;
  pending_ = AppliedVersion{};
  pending_.version = version;
  pending_.version_digest = version_digest;
  pending_.applied_unix_nanos = NowUnixNanos();
}

AppliedVersion VersionBoard::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

void VersionBoard::WaitChange(uint64_t after_version, uint64_t after_pending,
                              absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || current_.version > after_version ||
           (pending_.version > after_version && pending_.version > after_pending);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
}

void VersionBoard::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

AppliedVersion VersionBoard::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

bool VersionBoard::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

AppliedVersion VersionBoard::WaitAbove(uint64_t after_version, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto ready = [this, after_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || current_.version > after_version;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  return current_;
}

// ---- layouts ------------------------------------------------------------------------------------

namespace {

// A requested TTL (ms) as a duration; absurd values saturate (the store caps at max_ttl anyway).
absl::Duration Ttl(uint64_t ttl_ms) {
  return absl::Milliseconds(static_cast<int64_t>(std::min<uint64_t>(ttl_ms, uint64_t{1} << 50)));
}

}  // namespace

std::string ConsumerIdentity(const std::optional<PeerCred>& peer, absl::string_view consumer) {
  if (peer.has_value()) return absl::StrCat("uid ", peer->uid);
  return absl::StrCat("consumer ", Quoted(consumer));
}

v1::Layout LeaseLayout(const SubscriberCore& core, const SubscriberLease& lease) {
  v1::Layout out;
  out.set_version(lease.lease.version);
  std::map<std::string, uint64_t> digests;
  const std::optional<VersionRecord> rec = core.records().Find(lease.lease.version);
  if (rec.has_value()) {
    out.set_version_digest(rec->version_digest);
    for (const v1::TensorDigest& d : rec->tensors) digests[d.name()] = d.digest();
  }
  const store::Layout& layout = lease.store->layout();
  if (layout.units().size() != layout.size()) {
    // A tensor joined from parts: its whole-tensor digest (VersionRecord::joined), never a
    // part's; none when it is not known.
    for (const store::UnitInfo& u : layout.units()) {
      if (u.first_row.has_value() && !layout.tensor(u.tensor).slice.has_value()) {
        digests.erase(layout.tensor(u.tensor).name);
      }
    }
    if (rec.has_value()) {
      for (const v1::TensorDigest& d : rec->joined) digests[d.name()] = d.digest();
    }
  }
  // Where the leased slot is, once per lease; each tensor adds its offset in the slot.
  const store::SlotRegion region = lease.store->Region(lease.lease.slot);
  for (size_t i = 0; i < layout.size(); ++i) {
    const store::TensorInfo& ti = layout.tensor(i);
    v1::TensorLocation* loc = out.add_tensors();
    v1::TensorSpec* spec = loc->mutable_spec();
    spec->set_name(ti.name);
    spec->set_dtype(sync::ToProtoDType(ti.dtype));
    for (uint64_t d : ti.shape) spec->add_shape(d);
    if (ti.slice.has_value()) {  // a tensor-parallel share: where it lies in the whole tensor
      v1::TensorSlice* slice = loc->mutable_slice();
      for (size_t d = 0; d < ti.slice->whole_shape.size(); ++d) {
        slice->add_global_shape(ti.slice->whole_shape[d]);
        slice->add_offsets(d == ti.slice->dim ? ti.slice->first_row : 0);
      }
    }
    const uint64_t offset = region.slot_offset + ti.offset;
    if (region.kind == store::SlotRegion::Kind::kCudaIpc) {
      // The leased slot's allocation; the consumer opens it on the GPU with this UUID, whatever
      // that GPU's ordinal is in its own process.
      v1::CudaIpcRegion* ipc = loc->mutable_cuda_ipc();
      ipc->set_ipc_handle(region.ipc_handle);
      ipc->set_device_uuid(region.device_uuid);
      ipc->set_offset(offset);
      ipc->set_size_bytes(ti.size_bytes);
      ipc->set_allocation_bytes(region.allocation_bytes);
    } else if (region.kind == store::SlotRegion::Kind::kFile) {
      v1::ShmRegion* shm = loc->mutable_shm();
      shm->set_path(region.path);
      shm->set_offset(offset);
      shm->set_size_bytes(ti.size_bytes);
    }
    auto it = digests.find(ti.name);
    if (it != digests.end()) loc->set_digest(it->second);
  }
  return out;
}

// ---- ConsumerApiService -------------------------------------------------------------------------

ConsumerApiService::ConsumerApiService(SubscriberCore* core, const VersionBoard* board,
                                       ConsumerApiOptions options)
    : core_(core), board_(board), options_(std::move(options)), log_(Logger("consumer-api")) {}

v1::Lease ConsumerApiService::MakeLease(const SubscriberLease& lease) const {
  v1::Lease out;
  out.set_lease_id(lease.lease.lease_id);
  out.set_version(lease.lease.version);
  *out.mutable_layout() = LeaseLayout(*core_, lease);
  out.set_ttl_ms(WholeMillis(lease.lease.expires - absl::Now()));
  return out;
}

grpc::Status ConsumerApiService::GetLayout(grpc::ServerContext* context,
                                           const v1::GetLayoutRequest* request,
                                           v1::Layout* response) {
  std::optional<uint64_t> version;
  if (request->has_version()) version = request->version();
  // A short lease pins the version's slot while its offsets are read.
  auto lease =
      core_->generations().AcquireLease(options_.layout_consumer, version, absl::Seconds(10),
                                        ConsumerIdentity(PeerCredOf(*context), "GetLayout"));
  if (!lease.ok()) {
    return ToGrpcStatus(Annotate(
        lease.status(), version.has_value() ? absl::StrCat("GetLayout of version ", *version)
                                            : std::string("GetLayout of the current version")));
  }
  *response = LeaseLayout(*core_, *lease);
  (void)core_->generations().ReleaseLease(lease->lease.lease_id);
  return grpc::Status::OK;
}

grpc::Status ConsumerApiService::WatchVersions(grpc::ServerContext* context,
                                               const v1::WatchVersionsRequest* request,
                                               grpc::ServerWriter<v1::VersionEvent>* writer) {
  uint64_t after = request->after_version();
  uint64_t pending_sent = 0;
  bool sent_any = false;
  uint64_t last_generation = 0;
  while (!context->IsCancelled()) {
    const absl::Time deadline = absl::Now() + options_.poll_interval;
    AppliedVersion cur;
    if (request->pause_events()) {
      board_->WaitChange(after, pending_sent, deadline);
      cur = board_->current();
    } else {
      cur = board_->WaitAbove(after, deadline);
    }
    if (board_->closed()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "subscriber shutting down");
    }
    if (request->pause_events() && cur.version <= after) {
      const AppliedVersion pending = board_->pending();
      if (pending.version > after && pending.version > pending_sent) {
        v1::VersionEvent ev;
        ev.set_version(pending.version);
        ev.set_version_digest(pending.version_digest);
        ev.set_applied_unix_nanos(pending.applied_unix_nanos);
        ev.set_pending(true);
        if (!writer->Write(ev)) break;
        pending_sent = pending.version;
      }
      continue;
    }
    if (cur.version <= after) continue;
    v1::VersionEvent ev;
    ev.set_version(cur.version);
    ev.set_version_digest(cur.version_digest);
    ev.set_applied_unix_nanos(cur.applied_unix_nanos);
    // A skipped version may have switched generations: compare with what this stream saw.
    ev.set_layout_changed(cur.layout_changed || (sent_any && cur.generation != last_generation));
    if (!writer->Write(ev)) break;  // client gone
    sent_any = true;
    last_generation = cur.generation;
    after = cur.version;
  }
  return grpc::Status::OK;
}

grpc::Status ConsumerApiService::AcquireLease(grpc::ServerContext* context,
                                              const v1::AcquireLeaseRequest* request,
                                              v1::Lease* response) {
  std::optional<uint64_t> version;
  if (request->has_version()) version = request->version();
  const std::string consumer = request->consumer().empty() ? "unnamed" : request->consumer();
  auto lease = core_->generations().AcquireLease(consumer, version, Ttl(request->ttl_ms()),
                                                 ConsumerIdentity(PeerCredOf(*context), consumer));
  if (!lease.ok()) {
    log_->debug("lease for {} refused: {}", Printable(consumer), lease.status().ToString());
    return ToGrpcStatus(
        Annotate(lease.status(), absl::StrCat("AcquireLease for consumer ", Quoted(consumer))));
  }
  *response = MakeLease(*lease);
  log_->debug("lease {} for {}: version {} (slot {}), ttl {} ms", Hex64(lease->lease.lease_id),
              Printable(consumer), lease->lease.version, lease->lease.slot, response->ttl_ms());
  return grpc::Status::OK;
}

grpc::Status ConsumerApiService::RenewLease(grpc::ServerContext* context,
                                            const v1::RenewLeaseRequest* request,
                                            v1::Lease* response) {
  auto lease = core_->generations().RenewLease(request->lease_id(), Ttl(request->ttl_ms()));
  if (!lease.ok()) return ToGrpcStatus(Annotate(lease.status(), "RenewLease"));
  *response = MakeLease(*lease);
  return grpc::Status::OK;
}

grpc::Status ConsumerApiService::GetChanges(grpc::ServerContext* context,
                                            const v1::GetChangesRequest* request,
                                            v1::ChangeSet* response) {
  const uint64_t from = request->from_version();
  const uint64_t to = request->to_version() != 0 ? request->to_version() : core_->applied_version();
  response->set_from_version(from);
  response->set_to_version(to);
  if (to == 0) {
    return ToGrpcStatus(absl::FailedPreconditionError("GetChanges: no version is applied yet"));
  }
  // The caller (its process) takes change sets: from here on it holds `to` (it applies this
  // set, or reloads `to` fully), and the sets after `to` are kept for it (ChangeLog::Claim).
  // Those it took are let go, and their memory handed back to the system.
  const std::optional<PeerCred> peer = PeerCredOf(*context);
  const std::string key = peer.has_value() ? absl::StrCat("pid ", peer->pid) : context->peer();
  absl::StatusOr<v1::ChangeSet> set = v1::ChangeSet();
  if (from != to) set = exports_.Get(core_->change_log(), from, to, key);
  if (core_->change_log().Claim(key, to, peer.has_value() ? peer->pid : 0) > 0) malloc_trim(0);
  if (from == to) return grpc::Status::OK;  // nothing changed: no tensors, no region
  if (!set.ok() && set.status().code() == absl::StatusCode::kFailedPrecondition) {
    response->set_reload_fully(true);
    response->set_reason(std::string(set.status().message()));
    return grpc::Status::OK;
  }
  if (!set.ok()) return ToGrpcStatus(Annotate(set.status(), "GetChanges"));
  *response = std::move(*set);
  log_->debug("change set {} -> {}: {} tensors", from, to, response->tensors_size());
  return grpc::Status::OK;
}

grpc::Status ConsumerApiService::ReleaseLease(grpc::ServerContext* context,
                                              const v1::ReleaseLeaseRequest* request,
                                              v1::ReleaseLeaseResponse* response) {
  absl::Status st = core_->generations().ReleaseLease(request->lease_id());
  if (!st.ok()) return ToGrpcStatus(Annotate(st, "ReleaseLease"));
  log_->debug("lease {} released", Hex64(request->lease_id()));
  return grpc::Status::OK;
}

}  // namespace refit::subscriber
