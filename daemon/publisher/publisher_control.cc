#include "daemon/publisher/publisher_control.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/safe_file.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/common/wait_deadline.h"
#include "daemon/serving/tensor_join.h"
#include "daemon/serving/version_file.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/version_digest.h"
#include "refit/version.h"

namespace refit::publisher {
namespace {

double Ratio(uint64_t a, uint64_t b) {
  return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
}

// A gRPC deadline as absl::Time (InfiniteFuture for "none").
absl::Time RpcDeadline(const grpc::ServerContext* context) {
  const auto deadline = context->deadline();
  const auto now = std::chrono::system_clock::now();
  if (deadline - now > std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

uint64_t ManifestBytes(const std::vector<v1::TensorSpec>& manifest) {
  uint64_t bytes = 0;
  for (const v1::TensorSpec& spec : manifest) bytes += sync::TensorByteSize(spec).value_or(0);
  return bytes;
}

// The newest version and its tensors, read consistently (a publish may run concurrently).
// `version_digest` is v1 (the core's record); `version_digest_v2` is the version's identity in
// every response of this service (Status.digest_format 2), from the core's history.
// With `bytes` false only the manifest is read (Status does not wait for a running Publish).
struct Snapshot {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  uint64_t version_digest_v2 = 0;
  std::vector<BaselineTensor> tensors;
  std::vector<v1::TensorSpec> manifest;
};
Snapshot ConsistentBaseline(const PublisherCore& core, bool bytes = true) {
  Snapshot s;
  for (;;) {
    s.version = core.newest_version();
    s.version_digest = core.newest_version_digest();
    s.version_digest_v2 = core.VersionDigestOf(s.version, sync::DigestFormat::kV2).value_or(0);
    if (bytes) {
      s.tensors = core.Baseline();
    } else {
      s.manifest = core.Manifest();
    }
    if (core.newest_version() == s.version && core.newest_version_digest() == s.version_digest) {
      return s;
    }
  }
}

constexpr sync::DigestFormat kIdentityFormat = sync::DigestFormat::kV2;

}  // namespace

// ---- PublisherControl ---------------------------------------------------------------------------

PublisherControl::PublisherControl(PublisherCore* core, DataPlaneService* data_plane,
                                   PublishQueue* queue, ControlOptions options)
    : core_(core),
      data_plane_(data_plane),
      queue_(queue),
      options_(std::move(options)),
      log_(Logger("control")) {}

v1::StatusResponse PublisherControl::GetStatus() const {
  v1::StatusResponse r;
  r.set_role(v1::ROLE_PUBLISHER);
  r.set_name(options_.name);
  r.set_build_version(kRefitVersion);
  r.set_metrics_address(options_.metrics_address);
  if (options_.trainer_status) *r.mutable_trainer_api() = options_.trainer_status();
  const Snapshot baseline = ConsistentBaseline(*core_, /*bytes=*/false);
  r.set_version(baseline.version);
  r.set_version_digest(baseline.version_digest_v2);
  r.set_digest_format(sync::DigestFormatToWire(kIdentityFormat));
  r.set_version_digest_v1(baseline.version_digest);
  r.set_tensors(static_cast<uint32_t>(baseline.manifest.size()));
  r.set_model_bytes(ManifestBytes(baseline.manifest));
  if (data_plane_ != nullptr) {
    for (v1::SessionStatus& s : data_plane_->Sessions()) *r.add_sessions() = std::move(s);
    r.set_bytes_sent(data_plane_->bytes_sent());
  }
  if (std::optional<LastPublish> last = queue_->last_publish()) {
    const PublishSummary& s = last->summary;
    v1::RefitStats* refit = r.mutable_last_refit();
    refit->set_version(s.version);
    refit->set_base_version(last->base_version);
    refit->set_changed_elements(s.changed_elements);
    refit->set_total_elements(s.total_elements);
    refit->set_change_rate(Ratio(s.changed_elements, s.total_elements));
    refit->set_wire_bytes(s.wire_bytes);
    refit->set_dense_bytes(s.dense_bytes);
    refit->set_keyframe_tensors(static_cast<uint32_t>(s.keyframe_tensors));
    refit->set_finished_unix_nanos(last->finished_unix_nanos);
    refit->set_cpu_micros(s.cpu_micros);
    r.mutable_patch_format()->set_last(static_cast<uint32_t>(s.patch_format));
    if (data_plane_ != nullptr) {
      const v1::RefitStats acked = data_plane_->LastFullyAcked();
      if (acked.version() == s.version && s.version != 0) {
        refit->set_latency_micros(acked.latency_micros());
        refit->set_digests_verified(true);
        if (acked.finished_unix_nanos() != 0) {
          refit->set_finished_unix_nanos(acked.finished_unix_nanos());
        }
      }
    }
  }
  if (std::optional<FormatChooser::State> choice = core_->format_choice()) {
    v1::PatchFormatStatus* pf = r.mutable_patch_format();
    pf->set_auto_choice(true);
    pf->set_chosen(static_cast<uint32_t>(choice->chosen));
    pf->set_next(static_cast<uint32_t>(choice->next));
    pf->set_samples_v1(choice->samples[0]);
    pf->set_samples_v2(choice->samples[1]);
    pf->set_median_refit_micros_v1(choice->median_micros[0]);
    pf->set_median_refit_micros_v2(choice->median_micros[1]);
    pf->set_choices(choice->choices);
  }
  const sync::HistoryStats history = core_->HistoryStats();
  v1::HistoryStatus* h = r.mutable_history();
  h->set_oldest_version(history.oldest_version);
  h->set_newest_version(history.newest_version);
  h->set_versions(static_cast<uint32_t>(history.versions));
  h->set_bytes(history.bytes);
  h->set_budget_bytes(options_.history_budget_bytes);
  const int64_t uptime = absl::ToInt64Milliseconds(absl::Now() - options_.started);
  r.set_uptime_ms(uptime < 0 ? 0 : static_cast<uint64_t>(uptime));
  *r.mutable_baseline() = core_->baseline_status();
  r.set_lineage(core_->lineage());
  if (options_.shard.count() > 0) {
    const v1::ShardIdentity& id = options_.shard;
    v1::ShardsStatus* s = r.mutable_shards();
    s->set_set(id.set());
    s->set_index(id.index());
    s->set_count(id.count());
  }
  *r.mutable_publish_queue() = queue_->Status();

  if (options_.tls_status) {
    for (v1::TlsMaterialStatus& t : options_.tls_status()) *r.add_tls() = std::move(t);
  }
  return r;
}

absl::StatusOr<v1::PublishResponse> PublisherControl::DoPublish(
    const v1::PublishRequest& request, absl::Time rpc_deadline,
    const std::function<bool()>& cancelled) {
  FilesPublish publish;
  publish.paths.assign(request.safetensors().begin(), request.safetensors().end());
  if (request.has_version()) publish.version = request.version();
  publish.request_id = request.request_id();
  publish.deadline = rpc_deadline;
  publish.cancelled = cancelled;
  publish.publish_dirs = options_.publish_dirs;
  publish.allow_degenerate = request.allow_degenerate();
  REFIT_ASSIGN_OR_RETURN(const PublishSummary s, queue_->PublishFiles(std::move(publish)));
  v1::PublishResponse r;
  r.set_version(s.version);
  r.set_version_digest(s.version_digest_v2);
  r.set_tensors(static_cast<uint32_t>(s.tensors));
  r.set_bytes(s.dense_bytes);
  r.set_publish_micros(s.total_micros);
  const std::optional<LastPublish> last = queue_->last_publish();
  const bool first = last.has_value() && last->summary.version == s.version
                         ? last->base_version == 0
                         : false;
  r.set_change_rate(first ? 0.0 : Ratio(s.changed_elements, s.total_elements));
  return r;
}

namespace {

// Where and how Export writes: beneath publisher.files.export_dir, never into the persist_dir.
SafeWriteOptions ExportWriteOptions(const ControlOptions& o) {
  SafeWriteOptions w;
  w.root = o.export_dir;
  w.root_field = "publisher.files.export_dir";
  w.mode = static_cast<mode_t>(o.export_mode);
  if (!o.persist_dir.empty()) {
    w.forbidden_dirs = {{o.persist_dir, "publisher.baseline.persist_dir"}};
  }
  return w;
}

}  // namespace

absl::StatusOr<v1::ExportResponse> PublisherControl::DoExport(
    const v1::ExportRequest& request) const {
  const std::string& path = request.safetensors();
  if (options_.export_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "export to ", Quoted(path), " is disabled: publisher.files.export_dir is not set"));
  }
  // Checked before the snapshot is taken; AtomicFile checks again where it writes.
  REFIT_RETURN_IF_ERROR(
      PathBeneath(path, options_.export_dir, "publisher.files.export_dir").status());
  const Snapshot baseline = ConsistentBaseline(*core_);
  if (baseline.version == 0) {
    return absl::FailedPreconditionError("export: nothing published yet (no version to export)");
  }
  if (request.has_version() && request.version() != baseline.version) {
    return absl::FailedPreconditionError(
        absl::StrCat("export: version ", request.version(),
                     " is not held: the publisher holds only its newest version ",
                     baseline.version));
  }
  for (const BaselineTensor& t : baseline.tensors) {
    if (t.deferred()) {
      return absl::UnavailableError(absl::StrCat(
          "export: the bytes of tensor ", Quoted(t.spec.name()), " of version ", baseline.version,
          " are not held (lost by a failed publish): publish a new version"));
    }
  }
  // A cut version (publisher.cut) is exported as the model it was cut from: each name's parts
  // joined into the whole tensor (a shard publisher's part is written as it is).
  REFIT_ASSIGN_OR_RETURN(const std::vector<BaselineTensor> joined,
                         JoinTilingParts(baseline.tensors));
  std::vector<VersionFileTensor> tensors;
  tensors.reserve(joined.size());
  uint64_t bytes = 0;
  for (const BaselineTensor& t : joined) {
    tensors.push_back({t.spec.name(), t.dtype,
                       std::span<const uint64_t>(t.spec.shape().data(), t.spec.shape().size()),
                       std::span<const uint8_t>(*t.bytes)});
    bytes += t.bytes->size();
  }
  REFIT_RETURN_IF_ERROR(
      WriteVersionFile(path, baseline.version, tensors, ExportWriteOptions(options_)));
  v1::ExportResponse r;
  r.set_version(baseline.version);
  r.set_version_digest(baseline.version_digest_v2);
  r.set_tensors(static_cast<uint32_t>(joined.size()));
  r.set_bytes(bytes);
  return r;
}

absl::StatusOr<v1::WaitVersionResponse> PublisherControl::DoWaitVersion(
    const v1::WaitVersionRequest& request, absl::Time rpc_deadline,
    const std::function<bool()>& cancelled) {
  const WaitDeadline wait = WaitDeadline::Make(request.timeout_ms(), rpc_deadline);
  const absl::Time deadline = wait.deadline;
  absl::Status status = queue_->WaitPublished(request.version(), deadline, cancelled);
  if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    return wait.NotReached(request.version(), core_->newest_version());
  }
  REFIT_RETURN_IF_ERROR(status);
  if (request.all_subscribers() && data_plane_ != nullptr) {
    REFIT_RETURN_IF_ERROR(data_plane_->WaitAllAcked(request.version(), deadline));
  }
  const auto [version, digest] = core_->NewestVersionAndDigest(kIdentityFormat);
  v1::WaitVersionResponse r;
  r.set_version(version);
  r.set_version_digest(digest);
  return r;
}

absl::StatusOr<v1::VerifyResponse> PublisherControl::DoVerify() const {
  const Snapshot baseline = ConsistentBaseline(*core_);
  if (baseline.version == 0) {
    return absl::FailedPreconditionError("verify: nothing published yet (no version to verify)");
  }
  v1::VerifyResponse r;
  r.set_version(baseline.version);
  // Each tensor's bytes against both recorded digests: v2, the version's identity (reported), and
  // v1, which sessions that ask for v1 are sent.
  bool ok = true;
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  manifest.reserve(baseline.tensors.size());
  digests.reserve(baseline.tensors.size());
  for (const BaselineTensor& t : baseline.tensors) {
    const std::span<const uint8_t> bytes(*t.bytes);
    const uint64_t actual = sync::TensorDigestOf(kIdentityFormat, bytes, options_.digest_threads);
    const uint64_t actual_v1 =
        sync::TensorDigestOf(sync::DigestFormat::kV1, bytes, options_.digest_threads);
    v1::TensorVerification* v = r.add_tensors();
    v->set_name(t.spec.name());
    v->set_expected(t.digest_v2);
    v->set_actual(actual);
    // A v1 digest left pending (PublisherOptions::lazy_v1_digests) has nothing to compare.
    if (actual != t.digest_v2 || (!t.digest_pending && actual_v1 != t.digest)) {
      ok = false;
      log_->error(
          "verify: version {} tensor {} digest v2 {} (recorded {}), v1 {} "
          "(recorded {})",
          baseline.version, Quoted(t.spec.name()), Hex64(actual), Hex64(t.digest_v2),
          Hex64(actual_v1), t.digest_pending ? std::string("pending") : Hex64(t.digest));
    }
    manifest.push_back(t.spec);
    digests.push_back(actual);
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t version_digest, sync::VersionDigest(manifest, digests));
  r.set_version_digest(version_digest);
  if (version_digest != baseline.version_digest_v2) ok = false;
  r.set_ok(ok);
  return r;
}

absl::StatusOr<v1::ResyncResponse> PublisherControl::DoResync(const v1::ResyncRequest& request) {
  if (data_plane_ == nullptr) {
    return absl::FailedPreconditionError("resync: this publisher serves no data plane");
  }
  std::vector<std::string> tensors(request.tensors().begin(), request.tensors().end());
  if (!tensors.empty()) {
    const Snapshot baseline = ConsistentBaseline(*core_, /*bytes=*/false);
    for (const std::string& name : tensors) {
      const bool known =
          std::any_of(baseline.manifest.begin(), baseline.manifest.end(),
                      [&](const v1::TensorSpec& spec) { return spec.name() == name; });
      if (!known) {
        return absl::NotFoundError(
            absl::StrCat("resync: tensor ", Quoted(name), " is not in version ", baseline.version));
      }
    }
  }
  const uint32_t sessions = data_plane_->RequestResync(request.subscriber(), tensors);
  if (sessions == 0 && !request.subscriber().empty()) {
    return absl::NotFoundError(
        absl::StrCat("resync: no live session of subscriber ", Quoted(request.subscriber())));
  }
  log_->info("resync: {} session(s) of {} will get keyframes of {}", sessions,
             request.subscriber().empty() ? std::string("every subscriber")
                                          : Quoted(request.subscriber()),
             tensors.empty() ? std::string("all tensors")
                             : absl::StrCat(tensors.size(), " tensor(s)"));
  v1::ResyncResponse r;
  r.set_sessions(sessions);
  return r;
}

grpc::Status PublisherControl::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                      v1::StatusResponse* response) {
  *response = GetStatus();
  return grpc::Status::OK;
}

grpc::Status PublisherControl::Publish(grpc::ServerContext* context,
                                       const v1::PublishRequest* request,
                                       v1::PublishResponse* response) {
  absl::StatusOr<v1::PublishResponse> r =
      DoPublish(*request, RpcDeadline(context), [context] { return context->IsCancelled(); });
  if (!r.ok()) {
    log_->warn("Publish: {}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PublisherControl::Export(grpc::ServerContext*, const v1::ExportRequest* request,
                                      v1::ExportResponse* response) {
  absl::StatusOr<v1::ExportResponse> r = DoExport(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  log_->info("exported version {} ({} tensors, {}) to {}", r->version(), r->tensors(),
             FormatBytes(r->bytes()), Quoted(request->safetensors()));
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PublisherControl::WaitVersion(grpc::ServerContext* context,
                                           const v1::WaitVersionRequest* request,
                                           v1::WaitVersionResponse* response) {
  absl::StatusOr<v1::WaitVersionResponse> r =
      DoWaitVersion(*request, RpcDeadline(context), [context] { return context->IsCancelled(); });
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PublisherControl::Verify(grpc::ServerContext*, const v1::VerifyRequest*,
                                      v1::VerifyResponse* response) {
  absl::StatusOr<v1::VerifyResponse> r = DoVerify();
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PublisherControl::Resync(grpc::ServerContext*, const v1::ResyncRequest* request,
                                      v1::ResyncResponse* response) {
  absl::StatusOr<v1::ResyncResponse> r = DoResync(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = std::move(*r);
  return grpc::Status::OK;
}

}  // namespace refit::publisher
