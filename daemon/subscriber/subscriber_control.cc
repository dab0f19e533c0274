#include "daemon/subscriber/subscriber_control.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/durations.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/common/wait_deadline.h"
#include "daemon/subscriber/unit_spec.h"
#include "daemon/subscriber/version_export.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "refit/version.h"

namespace refit::subscriber {
namespace {

grpc::Status Error(absl::StatusCode code, absl::string_view message) {
  return ToGrpcStatus(absl::Status(code, message));
}

}  // namespace

SubscriberControlService::SubscriberControlService(SubscriberCore* core,
                                                   const VersionBoard* board,
                                                   SubscriberControlHooks hooks,
                                                   SubscriberControlOptions options)
    : core_(core),
      board_(board),
      hooks_(std::move(hooks)),
      options_(std::move(options)),
      log_(Logger("control")) {}

grpc::Status SubscriberControlService::Status(grpc::ServerContext* context,
                                              const v1::StatusRequest* request,
                                              v1::StatusResponse* response) {
  *response = GetStatus();
  return grpc::Status::OK;
}

v1::StatusResponse SubscriberControlService::GetStatus() const {
  v1::StatusResponse r;
  r.set_role(v1::ROLE_SUBSCRIBER);
  r.set_name(options_.name);
  r.set_build_version(kRefitVersion);
  const VersionRecord applied = core_->records().applied();
  r.set_version(applied.version);
  r.set_version_digest(applied.version_digest);
  r.set_digest_format(sync::DigestFormatToWire(applied.digest_format));
  r.set_lineage(core_->applied_lineage());
  if (std::shared_ptr<store::SlottedStore> st = core_->generations().current(); st != nullptr) {
    uint64_t bytes = 0;
    for (const store::TensorInfo& ti : st->layout().tensors()) bytes += ti.size_bytes;
    r.set_tensors(static_cast<uint32_t>(st->layout().size()));
    r.set_model_bytes(bytes);
  }
  if (hooks_.peer_sessions) {
    for (v1::SessionStatus& s : hooks_.peer_sessions()) *r.add_sessions() = std::move(s);
  }
  if (hooks_.upstream_status) *r.mutable_upstream() = hooks_.upstream_status();
  if (hooks_.bytes_sent) r.set_bytes_sent(hooks_.bytes_sent());
  if (hooks_.relay) *r.mutable_relay() = hooks_.relay();
  if (hooks_.shards) *r.mutable_shards() = hooks_.shards();
  if (hooks_.bytes_received) r.set_bytes_received(hooks_.bytes_received());
  if (hooks_.last_refit) *r.mutable_last_refit() = hooks_.last_refit();
  if (hooks_.scrub_status) hooks_.scrub_status(r);
  if (hooks_.tls_status) {
    for (v1::TlsMaterialStatus& t : hooks_.tls_status()) *r.add_tls() = std::move(t);
  }
  for (const LeaseEntry& e : core_->generations().Leases()) {
    if (e.lease.consumer == options_.self_consumer ||
        absl::StartsWith(e.lease.consumer, absl::StrCat(options_.self_consumer, "/"))) {
      continue;  // the daemon's own (migration base, export, layout, peers)
    }
    v1::LeaseStatus* l = r.add_leases();
    l->set_lease_id(e.lease.lease_id);
    l->set_consumer(e.lease.consumer);
    l->set_version(e.lease.version);
    l->set_remaining_ms(WholeMillis(e.lease.remaining));
  }
  if (std::optional<LeaseBlock> block = core_->generations().blocked(); block.has_value()) {
    v1::LeaseBlockStatus* b = r.mutable_blocked_on_leases();
    b->set_version(block->version);
    b->set_since_unix_nanos(UnixNanos(block->since));
    for (const std::string& h : block->holders) b->add_holders(h);
  }
  r.set_uptime_ms(WholeMillis(absl::Now() - options_.start_time));
  r.set_metrics_address(options_.metrics_address);
  return r;
}

grpc::Status SubscriberControlService::Publish(grpc::ServerContext* context,
                                               const v1::PublishRequest* request,
                                               v1::PublishResponse* response) {
  return Error(absl::StatusCode::kFailedPrecondition,
               absl::StrCat("Publish is a publisher verb; ", options_.name, " is a subscriber"));
}

grpc::Status SubscriberControlService::Export(grpc::ServerContext* context,
                                              const v1::ExportRequest* request,
                                              v1::ExportResponse* response) {
  const std::string& path = request->safetensors();
  if (options_.export_dir.empty()) {
    return Error(absl::StatusCode::kFailedPrecondition,
                 absl::StrCat("Export to \"", path,
                              "\" is disabled: subscriber.files.export_dir is not set"));
  }
  SafeWriteOptions write;
  write.root = options_.export_dir;
  write.root_field = "subscriber.files.export_dir";
  write.mode = static_cast<mode_t>(options_.export_mode);
  if (absl::Status s = PathBeneath(path, write.root, write.root_field).status(); !s.ok()) {
    return ToGrpcStatus(s);
  }
  std::optional<uint64_t> version;
  if (request->has_version()) version = request->version();
  absl::StatusOr<ExportSummary> summary = ExportVersion(*core_, path, version, write);
  if (!summary.ok()) return ToGrpcStatus(summary.status());
  response->set_version(summary->version);
  response->set_version_digest(summary->version_digest);
  response->set_tensors(summary->tensors);
  response->set_bytes(summary->bytes);
  log_->info("exported version {} ({} tensors, {} bytes) to {}", summary->version,
             summary->tensors, summary->bytes, path);
  return grpc::Status::OK;
}

grpc::Status SubscriberControlService::WaitVersion(grpc::ServerContext* context,
                                                   const v1::WaitVersionRequest* request,
                                                   v1::WaitVersionResponse* response) {
  if (request->all_subscribers()) {
    return Error(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("WaitVersion: all_subscribers is for a publisher; ", options_.name,
                              " is a subscriber"));
  }
  const WaitDeadline wait =
      WaitDeadline::Make(request->timeout_ms(), absl::FromChrono(context->deadline()));
  const absl::Time deadline = wait.deadline;
  const uint64_t want = request->version();
  AppliedVersion cur = board_->current();
  while (cur.version < want) {
    if (context->IsCancelled()) {
      return Error(absl::StatusCode::kCancelled,
                   absl::StrCat("WaitVersion for version ", want, " cancelled"));
    }
    if (board_->closed()) {
      return Error(absl::StatusCode::kUnavailable,
                   absl::StrCat("subscriber ", options_.name, " shutting down while waiting for "
                                "version ", want, ", at version ", cur.version));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) return ToGrpcStatus(wait.NotReached(want, cur.version, now));
    cur = board_->WaitAbove(want - 1, std::min(deadline, now + options_.poll_interval));
  }
  response->set_version(cur.version);
  response->set_version_digest(cur.version_digest);
  return grpc::Status::OK;
}

// The applied version's record and a lease on exactly that version; if a newer version replaced
// it in between (and took its slot), tries again with the newer one.
absl::StatusOr<SubscriberLease> SubscriberControlService::LeaseApplied(VersionRecord* rec) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    *rec = core_->records().applied();
    if (rec->version == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Verify: subscriber ", options_.name, " holds no version yet"));
    }
    absl::StatusOr<SubscriberLease> l = core_->generations().AcquireLease(
        absl::StrCat(options_.self_consumer, "/verify"), rec->version, absl::InfiniteDuration());
    if (l.ok() || l.status().code() != absl::StatusCode::kFailedPrecondition) return l;
  }
  return absl::UnavailableError("Verify: versions are being applied too fast to lease one; retry");
}

grpc::Status SubscriberControlService::Verify(grpc::ServerContext* context,
                                              const v1::VerifyRequest* request,
                                              v1::VerifyResponse* response) {
  VersionRecord rec;
  absl::StatusOr<SubscriberLease> leased = LeaseApplied(&rec);
  if (!leased.ok()) return ToGrpcStatus(leased.status());
  const SubscriberLease& lease = *leased;
  const store::Layout& layout = lease.store->layout();
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> digests;
  bool ok = true;
  std::vector<std::string> bad;
  // Per unit (a whole tensor or a part of one), in the record's order.
  for (size_t u = 0; u < layout.units().size(); ++u) {
    v1::TensorSpec spec = UnitSpec(layout, u);
    // The store's own digest, in the format the record was verified in: the CPU codec with
    // staging.threads threads on host memory, the digest kernel on a GPU store.
    absl::StatusOr<uint64_t> d = StoreDigestOf(lease.store->memory(), rec.digest_format,
                                               layout.UnitOf(lease.lease.spans, u));
    if (!d.ok()) {
      (void)core_->generations().ReleaseLease(lease.lease.lease_id);
      return ToGrpcStatus(Annotate(d.status(), "Verify: digest of ", sync::DescribeSpec(spec)));
    }
    const uint64_t actual = *d;
    v1::TensorVerification* tv = response->add_tensors();
    tv->set_name(spec.name());
    tv->set_actual(actual);
    if (u >= rec.tensors.size() || rec.tensors[u].name() != spec.name()) {
      ok = false;  // no record of the publisher's digest: cannot vouch for it
      bad.push_back(sync::DescribeSpec(spec));
    } else {
      tv->set_expected(rec.tensors[u].digest());
      if (rec.tensors[u].digest() != actual) {
        ok = false;
        bad.push_back(sync::DescribeSpec(spec));
      }
    }
    specs.push_back(std::move(spec));
    digests.push_back(actual);
  }
  (void)core_->generations().ReleaseLease(lease.lease.lease_id);
  ok = ok && rec.tensors.size() == layout.units().size();
  absl::StatusOr<uint64_t> vd = sync::VersionDigest(specs, digests);
  if (!vd.ok()) return ToGrpcStatus(vd.status());
  response->set_version(rec.version);
  response->set_version_digest(*vd);
  response->set_ok(ok && *vd == rec.version_digest);
  if (response->ok()) {
    log_->info("verify: version {} ok ({} tensors)", rec.version, layout.size());
  } else {
    if (bad.size() > 8) bad.resize(8);
    log_->error(
        "verify: version {} FAILED: recomputed version digest {}, expected {}; "
        "mismatched tensors (first 8): {}",
        rec.version, Hex64(*vd), Hex64(rec.version_digest), absl::StrJoin(bad, ", "));
  }
  return grpc::Status::OK;
}

grpc::Status SubscriberControlService::Resync(grpc::ServerContext* context,
                                              const v1::ResyncRequest* request,
                                              v1::ResyncResponse* response) {
  if (!request->subscriber().empty()) {
    return Error(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("Resync: subscriber \"", request->subscriber(),
                              "\" is for a publisher; ", options_.name, " is a subscriber"));
  }
  if (!hooks_.resync) {
    return Error(absl::StatusCode::kUnavailable,
                 absl::StrCat("Resync: subscriber ", options_.name, " has no upstream session"));
  }
  std::vector<std::string> tensors(request->tensors().begin(), request->tensors().end());
  if (!tensors.empty()) {
    // Names must be tensors of the held version (the publisher would refuse the request and
    // end the session otherwise).
    std::set<std::string> known;
    for (const v1::TensorDigest& d : core_->records().tensor_digests()) known.insert(d.name());
    for (const std::string& t : tensors) {
      if (known.count(t) == 0) {
        return Error(absl::StatusCode::kNotFound,
                     absl::StrCat("Resync: tensor ", Quoted(t), " is not in version ",
                                  core_->applied_version(), " held by ", options_.name));
      }
    }
  }
  response->set_sessions(hooks_.resync(tensors));
  log_->info("resync requested: {} tensor(s) as keyframes with the next transfer",
             tensors.empty() ? std::string("all") : std::to_string(tensors.size()));
  return grpc::Status::OK;
}

}  // namespace refit::subscriber
