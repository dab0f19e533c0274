#include "daemon/common/wait_deadline.h"
#include "daemon/publisher/publisher_control.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/hash.h"
#include "daemon/common/daemon_runtime.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

uint64_t NowUnixNanos() { return static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())); }

std::string Quoted(const std::string& s) { return absl::StrCat("\"", s, "\""); }

std::string Percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", fraction * 100.0);
  return buf;
}

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

uint64_t BaselineBytes(const std::vector<BaselineTensor>& baseline) {
  uint64_t bytes = 0;
  for (const BaselineTensor& t : baseline) bytes += t.bytes ? t.bytes->size() : 0;
  return bytes;
}

// The newest version and its tensors, read consistently (a publish may run concurrently).
struct Snapshot {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  std::vector<BaselineTensor> tensors;
};
Snapshot ConsistentBaseline(const PublisherCore& core) {
  Snapshot s;
  for (;;) {
    s.version = core.newest_version();
    s.version_digest = core.newest_version_digest();
    s.tensors = core.Baseline();
    if (core.newest_version() == s.version && core.newest_version_digest() == s.version_digest) {
      return s;
    }
  }
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  if (bytes < 1000) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1000.0 && unit < 6) {
    v /= 1000.0;
    ++unit;
  }
  char buf[32];
  if (v >= 99.95) {
    std::snprintf(buf, sizeof(buf), "%.0f %s", v, kUnits[unit]);
  } else if (v >= 9.995) {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[unit]);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  }
  return buf;
}

std::string DescribePublish(const PublishSummary& s) {
  return absl::StrCat("version ", s.version, " published: change ",
                      Percent(Ratio(s.changed_elements, s.total_elements)), " (",
                      s.changed_elements, "/", s.total_elements, " elements), wire ",
                      FormatBytes(s.wire_bytes), " (patches+keyframes) vs dense ",
                      FormatBytes(s.dense_bytes), " (", Percent(Ratio(s.wire_bytes, s.dense_bytes)),
                      "), tensors ", s.tensors, " (", s.patched_tensors, " patched, ",
                      s.keyframe_tensors, " keyframe, ", s.unchanged_tensors, " unchanged, ",
                      s.removed_tensors, " removed), encode ", s.encode_micros / 1000, " ms",
                      s.encode_device.empty()
                          ? std::string()
                          : absl::StrCat(" on ", s.encode_device, " (upload ",
                                         s.upload_micros / 1000, " ms, digest ",
                                         s.digest_micros / 1000, " ms, to host ",
                                         s.download_micros / 1000, " ms)"),
                      ", total ", s.total_micros / 1000, " ms");
}

// ---- PublishQueue -------------------------------------------------------------------------------

PublishQueue::PublishQueue(PublisherCore* core, DataPlaneService* data_plane)
    : core_(core), data_plane_(data_plane), log_(Logger("publisher")) {
  published_version_ = core_->newest_version();
  worker_ = std::thread([this] { Run(); });
}

PublishQueue::~PublishQueue() { Stop(); }

void PublishQueue::BeginStop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

void PublishQueue::Stop() {
  BeginStop();
  absl::MutexLock lock(&stop_mu_);
  if (worker_.joinable()) worker_.join();
}

uint64_t PublishQueue::FloorLocked() const {
  uint64_t floor = std::max(core_->newest_version(), published_version_);
  if (outstanding_ > 0) floor = std::max(floor, last_queued_version_);
  if (data_plane_ != nullptr) floor = std::max(floor, data_plane_->max_subscriber_version());
  return floor;
}

absl::StatusOr<uint64_t> PublishQueue::ChooseLocked(std::optional<uint64_t> requested) const {
  const uint64_t floor = FloorLocked();
  if (!requested.has_value()) return floor + 1;
  if (*requested <= floor) {
    std::string what = absl::StrCat("newest published version is ", core_->newest_version());
    if (outstanding_ > 0) absl::StrAppend(&what, ", newest queued ", last_queued_version_);
    if (data_plane_ != nullptr && data_plane_->max_subscriber_version() > 0) {
      absl::StrAppend(&what, ", a subscriber holds ", data_plane_->max_subscriber_version());
    }
    return absl::FailedPreconditionError(absl::StrCat("version ", *requested, " must exceed ",
                                                      floor, " (", what, ")"));
  }
  return *requested;
}

uint64_t PublishQueue::VersionFloor() const {
  absl::MutexLock lock(&mu_);
  return FloorLocked();
}

absl::StatusOr<uint64_t> PublishQueue::ChooseVersion(std::optional<uint64_t> requested) const {
  absl::MutexLock lock(&mu_);
  return ChooseLocked(requested);
}

absl::Status PublishQueue::CheckPublishGuard(const std::vector<GuardTensor>& next,
                                             bool allow_degenerate,
                                             absl::string_view where) const {
  return core_->CheckPublishGuard(next, allow_degenerate, where);
}

absl::Status PublishQueue::EnqueueTensors(uint64_t version, std::vector<OwnedTensor> tensors,
                                          std::string source, bool allow_degenerate) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("publisher shutting down");
  ASSIGN_OR_RETURN(const uint64_t chosen, ChooseLocked(version));
  Job job;
  job.version = chosen;
  job.tensors = std::move(tensors);
  job.source = std::move(source);
  job.allow_degenerate = allow_degenerate;
  queue_.push_back(std::move(job));
  ++outstanding_;
  last_queued_version_ = chosen;
  return absl::OkStatus();
}

absl::StatusOr<PublishSummary> PublishQueue::PublishFiles(std::optional<uint64_t> version,
                                                          std::vector<std::string> paths,
                                                          bool allow_degenerate) {
  if (paths.empty()) {
    return absl::InvalidArgumentError("publish: no safetensors files given (need at least one)");
  }
  for (const std::string& p : paths) {
    if (p.empty() || p[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "publish: safetensors path ", Quoted(p),
          " is not absolute (paths are read on the publisher's host; give an absolute path)"));
    }
  }
  auto waiter = std::make_shared<Waiter>();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("publisher shutting down");
    ASSIGN_OR_RETURN(const uint64_t chosen, ChooseLocked(version));
    Job job;
    job.version = chosen;
    job.source = absl::StrCat("control (", absl::StrJoin(paths, ", "), ")");
    job.paths = std::move(paths);
    job.allow_degenerate = allow_degenerate;
    job.waiter = waiter;
    queue_.push_back(std::move(job));
    ++outstanding_;
    last_queued_version_ = chosen;
  }
  waiter->done.WaitForNotification();
  return waiter->result;
}

absl::StatusOr<PublishSummary> PublishQueue::Execute(Job& job) {
  if (!job.paths.empty()) {
    return core_->PublishSafetensors(job.version, job.paths, job.allow_degenerate);
  }
  std::vector<TensorInput> inputs;
  inputs.reserve(job.tensors.size());
  for (OwnedTensor& t : job.tensors) {
    if (t.device_bytes != nullptr) {
      TensorInput in;
      in.name = t.name;
      in.dtype = t.dtype;
      in.shape = t.shape;
      in.device_bytes = std::move(t.device_bytes);
      inputs.push_back(std::move(in));
      continue;
    }
    auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(t.bytes));
    TensorInput in;
    in.name = t.name;
    in.dtype = t.dtype;
    in.shape = t.shape;
    in.data = *owned;
    in.owned = std::move(owned);
    inputs.push_back(std::move(in));
  }
  job.tensors.clear();
  return core_->Publish(job.version, inputs, job.allow_degenerate);
}

void PublishQueue::Run() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](PublishQueue* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return q->stopping_ || !q->queue_.empty();
          },
          this));
      if (stopping_) {
        for (Job& dropped : queue_) {
          if (dropped.waiter) {
            dropped.waiter->result = absl::UnavailableError(absl::StrCat(
                "publisher shutting down: version ", dropped.version, " was not published"));
            dropped.waiter->done.Notify();
          } else {
            log_->warn("version {} from {} dropped: publisher shutting down", dropped.version,
                       dropped.source);
          }
        }
        queue_.clear();
        outstanding_ = 0;
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }

    const uint64_t base = core_->newest_version();
    absl::StatusOr<PublishSummary> result = Execute(job);
    if (result.ok()) {
      if (data_plane_ != nullptr) data_plane_->NotifyPublished();
      log_->info("{}", DescribePublish(*result));
      if (!result->persist_status.ok()) {
        log_->error(
            "version {} is served from memory but its baseline was NOT persisted (a restart "
            "falls back to the previous persisted version): {}",
            result->version, result->persist_status.ToString());
      }
    } else {
      log_->error("version {} from {} failed: {}", job.version, job.source,
                  result.status().ToString());
    }
    {
      absl::MutexLock lock(&mu_);
      --outstanding_;
      if (result.ok()) {
        published_version_ = std::max(published_version_, result->version);
        last_ = LastPublish{.summary = *result,
                            .base_version = base,
                            .finished_unix_nanos = NowUnixNanos(),
                            .source = job.source};
      }
    }
    if (job.waiter) {
      job.waiter->result = std::move(result);
      job.waiter->done.Notify();
    }
  }
}

absl::Status PublishQueue::WaitPublished(uint64_t version, absl::Time deadline,
                                         const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  struct Args {
    PublishQueue* q;
    uint64_t version;
  } args{this, version};
  const absl::Condition reached(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return a->q->stopping_ || a->q->published_version_ >= a->version;
      },
      &args);
  for (;;) {
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(200));
    if (mu_.AwaitWithDeadline(reached, slice)) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("version ", version, " not reached, at version ", published_version_));
    }
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("wait for version ", version, " cancelled"));
    }
  }
  if (published_version_ >= version) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("publisher shutting down while waiting for version ",
                                             version, " (at version ", published_version_, ")"));
}

std::optional<LastPublish> PublishQueue::last_publish() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

uint64_t PublishQueue::published_version() const {
  absl::MutexLock lock(&mu_);
  return published_version_;
}

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
  r.set_build_version(kBuildVersion);
  const Snapshot baseline = ConsistentBaseline(*core_);
  r.set_version(baseline.version);
  r.set_version_digest(baseline.version_digest);
  r.set_tensors(static_cast<uint32_t>(baseline.tensors.size()));
  r.set_model_bytes(BaselineBytes(baseline.tensors));
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
  const sync::HistoryStats history = core_->HistoryStats();
  v1::HistoryStatus* h = r.mutable_history();
  h->set_oldest_version(history.oldest_version);
  h->set_newest_version(history.newest_version);
  h->set_versions(static_cast<uint32_t>(history.versions));
  h->set_bytes(history.bytes);
  h->set_budget_bytes(options_.history_budget_bytes);
  const int64_t uptime = absl::ToInt64Milliseconds(absl::Now() - options_.started);
  r.set_uptime_ms(uptime < 0 ? 0 : static_cast<uint64_t>(uptime));
  return r;
}

absl::StatusOr<v1::PublishResponse> PublisherControl::DoPublish(const v1::PublishRequest& request) {
  std::vector<std::string> paths(request.safetensors().begin(), request.safetensors().end());
  std::optional<uint64_t> version;
  if (request.has_version()) version = request.version();
  ASSIGN_OR_RETURN(const PublishSummary s, queue_->PublishFiles(version, std::move(paths),
                                                                request.allow_degenerate()));
  v1::PublishResponse r;
  r.set_version(s.version);
  r.set_version_digest(s.version_digest);
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

absl::StatusOr<v1::ExportResponse> PublisherControl::DoExport(
    const v1::ExportRequest& request) const {
  const std::string& path = request.safetensors();
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("export: output path ", Quoted(path),
                     " is not absolute (written on the publisher's host; give an absolute path)"));
  }
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
  std::vector<model::SafetensorsTensorRef> refs;
  refs.reserve(baseline.tensors.size());
  uint64_t bytes = 0;
  for (const BaselineTensor& t : baseline.tensors) {
    model::SafetensorsTensorRef ref;
    ref.name = t.spec.name();
    ref.dtype = t.dtype;
    for (const uint64_t d : t.spec.shape()) ref.shape.push_back(static_cast<int64_t>(d));
    ref.data = std::span<const uint8_t>(*t.bytes);
    bytes += t.bytes->size();
    refs.push_back(std::move(ref));
  }
  absl::Status written = model::WriteSafetensors(path, refs);
  if (!written.ok()) {
    return absl::Status(written.code(), absl::StrCat("export of version ", baseline.version,
                                                     " to ", Quoted(path), ": ",
                                                     written.message()));
  }
  v1::ExportResponse r;
  r.set_version(baseline.version);
  r.set_version_digest(baseline.version_digest);
  r.set_tensors(static_cast<uint32_t>(baseline.tensors.size()));
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
  RETURN_IF_ERROR(status);
  if (request.all_subscribers() && data_plane_ != nullptr) {
    RETURN_IF_ERROR(data_plane_->WaitAllAcked(request.version(), deadline));
  }
  v1::WaitVersionResponse r;
  r.set_version(core_->newest_version());
  r.set_version_digest(core_->newest_version_digest());
  return r;
}

absl::StatusOr<v1::VerifyResponse> PublisherControl::DoVerify() const {
  const Snapshot baseline = ConsistentBaseline(*core_);
  if (baseline.version == 0) {
    return absl::FailedPreconditionError("verify: nothing published yet (no version to verify)");
  }
  v1::VerifyResponse r;
  r.set_version(baseline.version);
  bool ok = true;
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  manifest.reserve(baseline.tensors.size());
  digests.reserve(baseline.tensors.size());
  for (const BaselineTensor& t : baseline.tensors) {
    const uint64_t actual = TensorDigest(std::span<const uint8_t>(*t.bytes),
                                         options_.digest_threads);
    v1::TensorVerification* v = r.add_tensors();
    v->set_name(t.spec.name());
    v->set_expected(t.digest);
    v->set_actual(actual);
    if (actual != t.digest) {
      ok = false;
      log_->error("verify: version {} tensor '{}' digest {:016x} != recorded {:016x}",
                  baseline.version, t.spec.name(), actual, t.digest);
    }
    manifest.push_back(t.spec);
    digests.push_back(actual);
  }
  ASSIGN_OR_RETURN(const uint64_t version_digest, sync::VersionDigest(manifest, digests));
  r.set_version_digest(version_digest);
  if (version_digest != baseline.version_digest) ok = false;
  r.set_ok(ok);
  return r;
}

absl::StatusOr<v1::ResyncResponse> PublisherControl::DoResync(const v1::ResyncRequest& request) {
  if (data_plane_ == nullptr) {
    return absl::FailedPreconditionError("resync: this publisher serves no data plane");
  }
  std::vector<std::string> tensors(request.tensors().begin(), request.tensors().end());
  if (!tensors.empty()) {
    const Snapshot baseline = ConsistentBaseline(*core_);
    for (const std::string& name : tensors) {
      const bool known = std::any_of(baseline.tensors.begin(), baseline.tensors.end(),
                                     [&](const BaselineTensor& t) { return t.spec.name() == name; });
      if (!known) {
        return absl::NotFoundError(absl::StrCat("resync: tensor '", name, "' is not in version ",
                                                baseline.version));
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

grpc::Status PublisherControl::Publish(grpc::ServerContext*, const v1::PublishRequest* request,
                                       v1::PublishResponse* response) {
  absl::StatusOr<v1::PublishResponse> r = DoPublish(*request);
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
  log_->info("exported version {} ({} tensors, {}) to \"{}\"", r->version(), r->tensors(),
             FormatBytes(r->bytes()), request->safetensors());
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
