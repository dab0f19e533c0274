#include "daemon/publisher/publish_queue.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/safe_file.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/common/unix_time.h"
#include "daemon/serving/publish_files.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

std::string Percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", fraction * 100.0);
  return buf;
}

double Ratio(uint64_t a, uint64_t b) {
  return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
}

constexpr size_t kMaxRequestIdBytes = 128;

// What a request id stands for: the same id with other arguments is a client bug.
std::string Fingerprint(const FilesPublish& p) {
  return absl::StrCat(p.version.has_value() ? absl::StrCat(*p.version) : std::string("auto"), "|",
                      absl::StrJoin(p.paths, "\n"));
}

// The figures of a published version the metrics count (its log line's).
metrics::PublishFigures FiguresOf(const PublishSummary& s) {
  return {.wire_bytes = s.wire_bytes,
          .dense_bytes = s.dense_bytes,
          .changed_elements = s.changed_elements,
          .total_elements = s.total_elements,
          .keyframe_tensors = s.keyframe_tensors,
          .encode = absl::Microseconds(s.encode_micros),
          .digest = absl::Microseconds(s.digest_micros),
          .persist = absl::Microseconds(s.persist_micros),
          .total = absl::Microseconds(s.total_micros),
          .pass_cpu = absl::Microseconds(s.pass_cpu_micros),
          .digest_cpu = absl::Microseconds(s.digest_cpu_micros),
          .baseline_update_cpu = absl::Microseconds(s.baseline_update_cpu_micros),
          .cpu = absl::Microseconds(s.cpu_micros)};
}

}  // namespace

std::string DescribePublish(const PublishSummary& s) {
  return absl::StrCat(
      "version ", s.version, " published: change ",
      Percent(Ratio(s.changed_elements, s.total_elements)), " (", s.changed_elements, "/",
      s.total_elements, " elements), wire ", FormatBytes(s.wire_bytes),
      " (patches+keyframes) vs dense ", FormatBytes(s.dense_bytes), " (",
      Percent(Ratio(s.wire_bytes, s.dense_bytes)), "), tensors ", s.tensors, " (",
      s.patched_tensors, " patched, ", s.keyframe_tensors, " keyframe, ", s.unchanged_tensors,
      " unchanged, ", s.removed_tensors, " removed), patch format ", s.patch_format, ", encode ",
      s.encode_micros / 1000, " ms",
      s.encode_device.empty()
          ? std::string()
          : absl::StrCat(" on ", s.encode_device, " (upload ", s.upload_micros / 1000,
                         " ms, digest ", s.digest_micros / 1000, " ms, to host ",
                         s.download_micros / 1000, " ms)"),
      ", total ", s.total_micros / 1000, " ms, cpu ", FormatMicros(s.cpu_micros), " (pass ",
      FormatMicros(s.pass_cpu_micros), ", digest ", FormatMicros(s.digest_cpu_micros),
      ", baseline update ", FormatMicros(s.baseline_update_cpu_micros), ")");
}

std::vector<LogField> PublishFields(const PublishSummary& s) {
  auto ms = [](uint64_t micros) { return static_cast<double>(micros) / 1000.0; };
  return {
      {"event", std::string("publish")},
      {"version", s.version},
      {"change_rate", Ratio(s.changed_elements, s.total_elements)},
      {"changed_elements", s.changed_elements},
      {"total_elements", s.total_elements},
      {"wire_bytes", s.wire_bytes},
      {"dense_bytes", s.dense_bytes},
      {"tensors", static_cast<uint64_t>(s.tensors)},
      {"patched_tensors", static_cast<uint64_t>(s.patched_tensors)},
      {"keyframe_tensors", static_cast<uint64_t>(s.keyframe_tensors)},
      {"unchanged_tensors", static_cast<uint64_t>(s.unchanged_tensors)},
      {"removed_tensors", static_cast<uint64_t>(s.removed_tensors)},
      {"patch_format", static_cast<int64_t>(s.patch_format)},
      {"encode_ms", ms(s.encode_micros)},
      {"encode_device", s.encode_device},
      {"upload_ms", ms(s.upload_micros)},
      {"digest_ms", ms(s.digest_micros)},
      {"download_ms", ms(s.download_micros)},
      {"total_ms", ms(s.total_micros)},
      {"cpu_ms", ms(s.cpu_micros)},
      {"pass_cpu_ms", ms(s.pass_cpu_micros)},
      {"digest_cpu_ms", ms(s.digest_cpu_micros)},
      {"baseline_update_cpu_ms", ms(s.baseline_update_cpu_micros)},
  };
}

// ---- PublishQueue -------------------------------------------------------------------------------

PublishQueue::PublishQueue(PublisherCore* core, DataPlaneService* data_plane,
                           PublishQueueOptions options)
    : core_(core), data_plane_(data_plane), options_(std::move(options)),
      log_(Logger("publisher")) {
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
  uint64_t floor = std::max(core_->numbered_version(), published_version_);
  if (outstanding_ > 0) floor = std::max(floor, last_queued_version_);
  return floor;
}

absl::StatusOr<uint64_t> PublishQueue::ChooseLocked(std::optional<uint64_t> requested) const {
  const uint64_t floor = FloorLocked();
  if (!requested.has_value()) {
    if (floor >= sync::kMaxVersion) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no version number left: the newest numbered version ", floor,
          " is the largest version ", sync::kMaxVersion,
          " (start a new lineage: a publisher without its persisted baseline)"));
    }
    return floor + 1;
  }
  REFIT_RETURN_IF_ERROR(sync::CheckVersion(*requested, "publish"));
  if (*requested <= floor) {
    std::string what = absl::StrCat("newest published version is ", core_->newest_version());
    if (core_->numbered_version() > core_->newest_version()) {
      absl::StrAppend(&what, ", versions up to ", core_->numbered_version(),
                      " were numbered before a restart");
    }
    if (outstanding_ > 0) absl::StrAppend(&what, ", newest queued ", last_queued_version_);
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

absl::Status PublishQueue::CheckRoomLocked() {
  if (stopping_) return absl::UnavailableError("publisher shutting down");
  if (outstanding_ >= options_.max_pending) {
    ++refused_full_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "publish queue full: ", outstanding_, " publishes queued or running, at most ",
        options_.max_pending, " (publisher.publish_queue.max_pending); retry later"));
  }
  return absl::OkStatus();
}

absl::Status PublishQueue::CheckPublishGuard(const std::vector<GuardTensor>& next,
                                             bool allow_degenerate,
                                             absl::string_view where) const {
  return core_->CheckPublishGuard(next, allow_degenerate, where);
}

bool InputsRelease::Start() {
  absl::MutexLock lock(&mu_);
  if (abandoned_) return false;
  started_ = true;
  return true;
}

void InputsRelease::Release(const absl::Status& outcome) {
  absl::MutexLock lock(&mu_);
  if (released_) return;
  released_ = true;
  outcome_ = outcome;
}

absl::Status InputsRelease::Wait(absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(200));
    if (mu_.AwaitWithDeadline(absl::Condition(&released_), slice)) return outcome_;
    if (started_) continue;  // the worker reads the lent memory: wait for it
    if (absl::Now() >= deadline) {
      abandoned_ = true;
      return absl::DeadlineExceededError(
          "the call's deadline passed before the publish started (not run)");
    }
    if (cancelled && cancelled()) {
      abandoned_ = true;
      return absl::CancelledError("the call was cancelled before the publish started (not run)");
    }
  }
}

absl::Status PublishQueue::EnqueueTensors(uint64_t version, std::vector<OwnedTensor> tensors,
                                          std::string source, bool allow_degenerate,
                                          std::shared_ptr<InputsRelease> release) {
  absl::MutexLock lock(&mu_);
  REFIT_RETURN_IF_ERROR(CheckRoomLocked());
  REFIT_ASSIGN_OR_RETURN(const uint64_t chosen, ChooseLocked(version));
  Job job;
  job.version = chosen;
  job.tensors = std::move(tensors);
  job.allow_degenerate = allow_degenerate;
  job.source = std::move(source);
  job.release = std::move(release);
  queue_.push_back(std::move(job));
  ++outstanding_;
  last_queued_version_ = chosen;
  return absl::OkStatus();
}

void PublishQueue::RememberLocked(const std::shared_ptr<Waiter>& waiter) {
  if (waiter->request_id.empty()) return;
  requests_[waiter->request_id] = waiter;
  request_order_.push_back(waiter->request_id);
  while (request_order_.size() > options_.remembered_requests) {
    requests_.erase(request_order_.front());
    request_order_.pop_front();
  }
}

absl::StatusOr<std::shared_ptr<PublishQueue::Waiter>> PublishQueue::QueueFiles(
    FilesPublish& publish) {
  if (stopping_) return absl::UnavailableError("publisher shutting down");
  const std::string fingerprint = Fingerprint(publish);
  if (!publish.request_id.empty()) {
    if (auto it = requests_.find(publish.request_id); it != requests_.end()) {
      if (it->second->fingerprint != fingerprint) {
        return absl::InvalidArgumentError(absl::StrCat(
            "publish: request_id ", Quoted(publish.request_id),
            " was used for another publish (other files or version); use a new id"));
      }
      log_->info("publish request {} repeated: answering with the outcome of version {}",
                 Quoted(publish.request_id), it->second->version);
      return it->second;
    }
  }
  REFIT_RETURN_IF_ERROR(CheckRoomLocked());
  if (absl::Now() >= publish.deadline) {
    return absl::DeadlineExceededError("publish: the call's deadline passed before it was queued");
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t chosen, ChooseLocked(publish.version));
  auto waiter = std::make_shared<Waiter>();
  waiter->fingerprint = fingerprint;
  waiter->request_id = publish.request_id;
  waiter->version = chosen;
  Job job;
  job.version = chosen;
  job.source = absl::StrCat("control (", absl::StrJoin(publish.paths, ", "), ")");
  if (!publish.request_id.empty()) absl::StrAppend(&job.source, " request ", publish.request_id);
  job.paths = publish.paths;
  job.publish_dirs = publish.publish_dirs;
  job.allow_degenerate = publish.allow_degenerate;
  job.waiter = waiter;
  queue_.push_back(std::move(job));
  ++outstanding_;
  last_queued_version_ = chosen;
  RememberLocked(waiter);
  return waiter;
}

absl::StatusOr<PublishSummary> PublishQueue::Await(const std::shared_ptr<Waiter>& waiter,
                                                   const FilesPublish& publish) {
  ++waiter->waiting;
  waiter->deadline = std::max(waiter->deadline, publish.deadline);
  struct Args {
    PublishQueue* q;
    Waiter* w;
  } args{this, waiter.get()};
  const absl::Condition finished(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->q->stopping_ || a->w->done; },
      &args);
  absl::Status gave_up;
  for (;;) {
    const absl::Time slice = std::min(publish.deadline, absl::Now() + absl::Milliseconds(200));
    if (mu_.AwaitWithDeadline(finished, slice)) break;
    if (absl::Now() >= publish.deadline) {
      gave_up = absl::DeadlineExceededError(absl::StrCat(
          "publish of version ", waiter->version, ": the call's deadline passed while it was ",
          waiter->started ? "running (it completes; retry with the same request id for its "
                            "outcome)"
                          : "queued (it will not run)"));
      break;
    }
    if (publish.cancelled && publish.cancelled()) {
      gave_up = absl::CancelledError(absl::StrCat("publish of version ", waiter->version,
                                                  ": the call was cancelled"));
      break;
    }
  }
  --waiter->waiting;
  if (waiter->done) return waiter->result;
  if (!gave_up.ok()) {
    if (waiter->waiting == 0 && !waiter->started) DropLocked(*waiter, gave_up);
    return gave_up;
  }
  return absl::UnavailableError(absl::StrCat("publisher shutting down: version ", waiter->version,
                                             " was not published"));
}

absl::StatusOr<PublishSummary> PublishQueue::PublishFiles(FilesPublish publish) {
  if (publish.paths.empty()) {
    return absl::InvalidArgumentError("publish: no safetensors files given (need at least one)");
  }
  for (const std::string& p : publish.paths) {
    if (p.empty() || p[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "publish: safetensors path ", Quoted(p),
          " is not absolute (paths are read on the publisher's host; give an absolute path)"));
    }
    absl::StatusOr<UniqueFd> fd = OpenRegularFileBeneath(p, publish.publish_dirs,
                                                         kPublishDirsField);
    if (!fd.ok()) {
      return Annotate(fd.status(), "publish");
    }
  }
  if (publish.request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("publish: request_id has ",
                                                   publish.request_id.size(),
                                                   " bytes, at most ", kMaxRequestIdBytes));
  }
  absl::MutexLock lock(&mu_);
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<Waiter> waiter, QueueFiles(publish));
  return Await(waiter, publish);
}

absl::StatusOr<PublishSummary> PublishQueue::Execute(Job& job) {
  if (!job.paths.empty()) {
    return PublishSafetensors(*core_, job.version, job.paths, &job.publish_dirs,
                              job.allow_degenerate);
  }
  std::vector<TensorInput> inputs;
  inputs.reserve(job.tensors.size());
  std::vector<std::shared_ptr<const void>> lent;  // keeps borrowed memory mapped meanwhile
  for (OwnedTensor& t : job.tensors) {
    if (t.keep != nullptr) {
      TensorInput in;
      in.name = t.name;
      in.dtype = t.dtype;
      in.shape = t.shape;
      in.part = t.part;
      in.data = t.borrowed;
      inputs.push_back(std::move(in));
      lent.push_back(std::move(t.keep));
      continue;
    }
    if (t.device_bytes != nullptr) {
      TensorInput in;
      in.name = t.name;
      in.dtype = t.dtype;
      in.shape = t.shape;
      in.part = t.part;
      in.device_bytes = std::move(t.device_bytes);
      inputs.push_back(std::move(in));
      continue;
    }
    auto owned = std::make_shared<std::vector<uint8_t>>(std::move(t.bytes));
    TensorInput in;
    in.name = t.name;
    in.dtype = t.dtype;
    in.shape = t.shape;
    in.part = t.part;
    in.data = *owned;
    in.owned = std::move(owned);
    inputs.push_back(std::move(in));
  }
  job.tensors.clear();
  std::function<void()> inputs_read;
  if (job.release != nullptr) {
    inputs_read = [release = job.release] { release->Release(absl::OkStatus()); };
  }
  return core_->Publish(job.version, inputs, job.allow_degenerate, inputs_read);
}

void PublishQueue::StallForTest() const {
  if (options_.stall_file.empty()) return;
  struct stat st;
  bool logged = false;
  while (::stat(options_.stall_file.c_str(), &st) == 0) {
    if (!logged) {
      log_->warn("test hook: publish stalled while {} exists", Quoted(options_.stall_file));
      logged = true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

bool PublishQueue::Next(Job* job) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](PublishQueue* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return q->stopping_ || !q->queue_.empty();
        },
        this));
    if (stopping_) {
      for (Job& dropped : queue_) {
        if (dropped.release != nullptr) {
          dropped.release->Release(absl::UnavailableError(absl::StrCat(
              "publisher shutting down: version ", dropped.version, " was not published")));
        }
        if (dropped.waiter) {
          Finish(dropped, absl::UnavailableError(absl::StrCat(
                              "publisher shutting down: version ", dropped.version,
                              " was not published")));
        } else {
          log_->warn("version {} from {} dropped: publisher shutting down", dropped.version,
                     dropped.source);
        }
      }
      queue_.clear();
      outstanding_ = 0;
      return false;
    }
    *job = std::move(queue_.front());
    queue_.pop_front();
    Waiter* w = job->waiter.get();
    if (w == nullptr) return true;
    // Nobody waits any more (deadline passed, cancelled): the caller was told it failed, so the
    // job must not run.
    const bool expired = absl::Now() >= w->deadline;
    if (w->waiting > 0 && !expired) {
      w->started = true;
      return true;
    }
    // (Await drops its job itself when it gives up; this catches a deadline passed meanwhile.)
    const absl::Status why =
        expired ? absl::DeadlineExceededError(absl::StrCat(
                      "publish of version ", job->version,
                      ": the call's deadline passed before it started (not run)"))
                : absl::CancelledError(absl::StrCat("publish of version ", job->version,
                                                    ": cancelled before it started"));
    NoteDroppedLocked(*w, job->source, why);
  }
}

void PublishQueue::NoteDroppedLocked(Waiter& w, const std::string& source,
                                     const absl::Status& why) {
  log_->warn("version {} from {} not published: its caller's {} before it started", w.version,
             source, absl::IsDeadlineExceeded(why) ? "deadline passed" : "call was cancelled");
  ++dropped_expired_;
  --outstanding_;
  if (!w.request_id.empty()) requests_.erase(w.request_id);  // a retry publishes afresh
  w.result = why;
  w.done = true;
}

void PublishQueue::DropLocked(Waiter& w, const absl::Status& why) {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (it->waiter.get() != &w) continue;
    const std::string source = it->source;
    queue_.erase(it);  // frees its place in the queue at once
    NoteDroppedLocked(w, source, why);
    return;
  }
}

void PublishQueue::Finish(Job& job, absl::StatusOr<PublishSummary> result) {
  if (job.waiter == nullptr) return;
  job.waiter->result = std::move(result);
  job.waiter->done = true;
}

void PublishQueue::Run() {
  Job job;
  while (Next(&job)) {
    StallForTest();
    if (job.release != nullptr && !job.release->Start()) {
      SkipAbandoned(job);
      job = Job();
      continue;
    }
    if (options_.before_pass) options_.before_pass(job.version);
    const uint64_t base = core_->newest_version();
    const absl::Duration cpu_start = ProcessCpuTime();
    absl::StatusOr<PublishSummary> result = Execute(job);
    // The publish's CPU with the reading of its input files (Execute reads them).
    if (result.ok()) result->cpu_micros = WholeMicros(ProcessCpuTime() - cpu_start);
    // Released already when the core committed; otherwise (an error) with the reason.
    if (job.release != nullptr) job.release->Release(result.status());
    if (result.ok()) {
      if (data_plane_ != nullptr) data_plane_->NotifyPublished();
      LogEvent(*log_, spdlog::level::info, DescribePublish(*result), PublishFields(*result));
      if (options_.metrics != nullptr) options_.metrics->Published(FiguresOf(*result));
      if (!result->persist_status.ok()) {
        log_->error(
            "version {} is served from memory but its baseline was NOT persisted (a restart "
            "falls back to the previous persisted version): {}",
            result->version, result->persist_status.ToString());
      }
    } else {
      log_->error("version {} from {} failed: {}", job.version, job.source,
                  result.status().ToString());
      if (options_.metrics != nullptr) options_.metrics->PublishFailed();
    }
    absl::MutexLock lock(&mu_);
    --outstanding_;
    if (!result.ok() && job.waiter != nullptr && !job.waiter->request_id.empty()) {
      // Nothing was published: a retry with the same id may try again.
      requests_.erase(job.waiter->request_id);
    }
    if (result.ok()) {
      published_version_ = std::max(published_version_, result->version);
      last_ = LastPublish{.summary = *result,
                          .base_version = base,
                          .finished_unix_nanos = NowUnixNanos(),
                          .source = job.source};
    }
    Finish(job, std::move(result));
    job = Job();
  }
}

void PublishQueue::SkipAbandoned(Job& job) {
  log_->warn("version {} from {} not published: its trainer gave up before it started",
             job.version, job.source);
  absl::MutexLock lock(&mu_);
  ++dropped_expired_;
  --outstanding_;
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


v1::PublishQueueStatus PublishQueue::Status() const {
  absl::MutexLock lock(&mu_);
  v1::PublishQueueStatus s;
  s.set_pending(static_cast<uint32_t>(outstanding_));
  s.set_max_pending(options_.max_pending);
  s.set_refused_full(refused_full_);
  s.set_dropped_expired(dropped_expired_);
  return s;
}

}  // namespace refit::publisher
