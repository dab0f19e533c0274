#include "daemon/serving/baseline_persister.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/tensor_place.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

const BaselineTensor* Find(const std::vector<BaselineTensor>& v, const v1::TensorSpec& spec) {
  return FindAtPlace(v, spec,
                     [](const BaselineTensor& t) -> const v1::TensorSpec& { return t.spec; });
}

}  // namespace

// ---- BaselinePersister ------------------------------------------------------------------------

BaselinePersister::BaselinePersister(PersisterOptions options, PersisterStart start,
                                     WriteBaseline write, TakeSnapshot snapshot, NoteWrite note)
    : options_(std::move(options)),
      write_(std::move(write)),
      snapshot_(std::move(snapshot)),
      note_(std::move(note)),
      log_(std::move(start.log)) {
  {
    absl::MutexLock lock(&mu_);
    persisted_ = start.persisted_version;
    baseline_version_ = start.baseline_version;
    log_versions_ = start.log_versions;
    log_bytes_ = log_ != nullptr ? log_->bytes() : 0;
    compact_pending_ = start.compact_now;
  }
  thread_ = std::thread([this] { Run(); });
}

BaselinePersister::~BaselinePersister() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void BaselinePersister::Enqueue(LogRecord record) {
  absl::MutexLock lock(&mu_);
  queued_bytes_ += record.payload_bytes();
  queue_.push_back(std::move(record));
  if (queue_.size() <= options_.max_queued_versions && queued_bytes_ <= options_.max_queued_bytes) {
    return;
  }
  // The disk is behind: drop what waits, write the newest version as a baseline instead.
  Logger("persist")->warn(
      "persistence is behind ({} versions, {} bytes queued): coalescing them into a compaction "
      "at the newest version",
      queue_.size(), queued_bytes_);
  coalesced_ += queue_.size();
  queue_.clear();
  queued_bytes_ = 0;
  compact_pending_ = true;
}

absl::Status BaselinePersister::WaitPersisted(uint64_t version, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return persisted_ >= version || (attempted_ >= version && !last_error_.ok());
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (persisted_ >= version) return absl::OkStatus();
  if (attempted_ >= version && !last_error_.ok()) return last_error_;
  return absl::DeadlineExceededError(
      absl::StrCat("version ", version, " not persisted (files at ", persisted_, ")"));
}

PersisterStats BaselinePersister::Stats() const {
  absl::MutexLock lock(&mu_);
  return {.persisted_version = persisted_,
          .baseline_version = baseline_version_,
          .log_versions = log_versions_,
          .log_bytes = log_bytes_,
          .coalesced = coalesced_,
          .queued = static_cast<uint32_t>(queue_.size())};
}

void BaselinePersister::Run() {
  for (;;) {
    LogRecord record;
    bool compact = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BaselinePersister* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return p->stop_ || p->compact_pending_ || !p->queue_.empty();
          },
          this));
      if (compact_pending_) {
        compact = true;
        compact_pending_ = false;
      } else if (!queue_.empty()) {
        record = std::move(queue_.front());
        queue_.pop_front();
        queued_bytes_ -= std::min(queued_bytes_, record.payload_bytes());
      } else {
        return;  // stopping, nothing left
      }
    }
    if (compact) {
      Compact();
    } else {
      PersistRecord(record);
    }
  }
}

void BaselinePersister::Noted(uint64_t version, const absl::Status& st) {
  // The core's status first: whoever WaitPersisted wakes sees it.
  if (!st.ok()) {
    Logger("persist")->error(
        "version {} not persisted (served from memory; a restart falls back "
        "to version {}): {}",
        version, Stats().persisted_version, st.ToString());
  }
  if (note_) note_(version, st);
  absl::MutexLock lock(&mu_);
  attempted_ = std::max(attempted_, version);
  last_error_ = st;
}

void BaselinePersister::PersistRecord(const LogRecord& record) {
  uint64_t persisted = 0, baseline = 0;
  {
    absl::MutexLock lock(&mu_);
    persisted = persisted_;
    baseline = baseline_version_;
  }
  if (record.version <= persisted) return;  // a compaction already wrote it
  if (log_ == nullptr && baseline != 0 && baseline == persisted &&
      record.base_version == persisted) {
    // The baseline is current but no log follows it (none yet, or starting one failed).
    auto log = PatchLogWriter::Create(
        options_.log_path, {.lineage = record.lineage, .base_version = baseline}, options_.fsync);
    if (log.ok()) log_ = std::move(*log);
  }
  if (log_ == nullptr || record.base_version != persisted) {
    Compact();  // no baseline yet, an earlier write failed, or records were dropped
    return;
  }
  if (options_.before_write) options_.before_write(record.version);
  absl::Status st = log_->Append(record);
  if (!st.ok()) {
    log_.reset();  // possibly torn at its end: the next write compacts
    Noted(record.version, st);
    return;
  }
  if (note_) note_(record.version, st);
  bool compact = false;
  {
    absl::MutexLock lock(&mu_);
    persisted_ = record.version;
    ++log_versions_;
    log_bytes_ = log_->bytes();
    attempted_ = std::max(attempted_, record.version);
    last_error_ = absl::OkStatus();
    compact = log_versions_ >= options_.compact_versions || log_bytes_ >= options_.compact_bytes;
  }
  if (compact) Compact();
}

void BaselinePersister::Compact() {
  BaselineSnapshot s = snapshot_();
  {
    absl::MutexLock lock(&mu_);
    if (s.version == 0 || (s.version == baseline_version_ && log_ != nullptr)) {
      return;  // nothing newer than what the files hold
    }
  }
  if (options_.before_write) options_.before_write(s.version);
  // Step 1: the baseline (temporary file, fsync, rename): a crash before the rename leaves the
  // old baseline and the old log; after it, the new baseline and the old log, whose records
  // are all <= s.version and are skipped.
  if (absl::Status st = write_(s); !st.ok()) {
    Noted(s.version, st);
    return;
  }
  // Step 2: a new log after it (temporary file, rename over the old log). The baseline holds
  // the version either way; a log that could not be started is retried by the next record.
  log_.reset();
  auto log = PatchLogWriter::Create(
      options_.log_path, {.lineage = s.lineage, .base_version = s.version}, options_.fsync);
  if (log.ok()) log_ = std::move(*log);
  const absl::Status st = log.ok() ? absl::OkStatus() : log.status();
  if (!st.ok()) {
    Logger("persist")->error("version {} persisted as the baseline, but no new patch log: {}",
                             s.version, st.ToString());
  }
  if (note_) note_(s.version, st);
  absl::MutexLock lock(&mu_);
  persisted_ = std::max(persisted_, s.version);
  baseline_version_ = s.version;
  log_versions_ = 0;
  log_bytes_ = log_ != nullptr ? log_->bytes() : 0;
  attempted_ = std::max(attempted_, s.version);
  last_error_ = absl::OkStatus();
  while (!queue_.empty() && queue_.front().version <= s.version) {
    queued_bytes_ -= std::min(queued_bytes_, queue_.front().payload_bytes());
    queue_.pop_front();
  }
}

// ---- MakeLogRecord ----------------------------------------------------------------------------

LogRecord MakeLogRecord(uint64_t version, uint64_t base_version, uint64_t version_digest,
                        uint64_t lineage, uint64_t snapshot_unix_nanos,
                        const std::vector<BaselineTensor>& prev,
                        const std::vector<BaselineTensor>& next,
                        const std::vector<sync::PatchBytes>& patches,
                        const std::vector<uint64_t>& changed) {
  LogRecord r;
  r.version = version;
  r.base_version = base_version;
  r.version_digest = version_digest;
  r.lineage = lineage;
  r.snapshot_unix_nanos = snapshot_unix_nanos;
  r.tensors.reserve(next.size());
  for (size_t k = 0; k < next.size(); ++k) {
    const BaselineTensor& t = next[k];
    LogTensor e;
    e.spec = t.spec;
    e.digest = t.digest;
    const BaselineTensor* p = Find(prev, t.spec);
    if (p != nullptr && sync::SameSpec(p->spec, t.spec) &&
        sync::SameDigests(p->digests(), t.digests())) {
      e.kind = LogTensorKind::kUnchanged;  // as PatchHistory::Add decides
    } else if (k < patches.size() && patches[k] != nullptr) {
      e.kind = LogTensorKind::kPatch;
      e.bytes = patches[k];
      e.changed_elements = k < changed.size() ? changed[k] : 0;
    } else {
      e.kind = LogTensorKind::kDense;
      e.bytes = t.bytes;
      e.changed_elements = sync::ElementCount(t.spec).value_or(0);
    }
    r.tensors.push_back(std::move(e));
  }
  return r;
}

void SetLogDigests(const std::vector<BaselineTensor>& next, LogRecord* record) {
  record->digests_v2 = std::any_of(next.begin(), next.end(),
                                   [](const BaselineTensor& t) { return t.digest_pending; });
  for (size_t k = 0; k < next.size() && k < record->tensors.size(); ++k) {
    record->tensors[k].digest = record->digests_v2 ? next[k].digest_v2 : next[k].digest;
  }
}

// ---- ReplayLog --------------------------------------------------------------------------------

namespace {

struct Staged {
  BaselineTensor tensor;
  bool replaced = false;  // bytes not from the baseline: digest checked at the end
};

// Whether the unchanged tensor `p` has the digest `e` records (v2 in a digests_v2 record). A v1
// digest `p` left pending (the previous record was version 3) is computed from its bytes.
bool UnchangedMatches(const BaselineTensor& p, uint64_t recorded, bool digests_v2, int threads) {
  if (digests_v2) return p.digest_v2 == recorded;
  if (p.digest_pending) return TensorDigest(*p.bytes, threads) == recorded;
  return p.digest == recorded;
}

// `cur` after `rec` (manifest order), or why `rec` does not apply. Each tensor's v2 digest follows
// its bytes: carried when unchanged, brought forward by the patch's delta (reading only the
// changed words), computed for dense bytes. A record of v1 digests is checked by its version
// digest and, at the end of the replay, each replaced tensor's v1 digest; a record of v2 digests
// (version 3) tensor by tensor against the v2 digests, leaving the v1 digests pending.
absl::StatusOr<std::vector<Staged>> ApplyRecord(const std::vector<Staged>& cur,
                                                const LogRecord& rec, const std::string& where,
                                                int threads) {
  std::map<TensorPlace, const Staged*> by_place;
  for (const Staged& s : cur) by_place[TensorPlace::Of(s.tensor.spec)] = &s;
  std::vector<Staged> next;
  next.reserve(rec.tensors.size());
  for (size_t i = 0; i < rec.tensors.size(); ++i) {
    const LogTensor& e = rec.tensors[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), e.spec.name()));
    auto it = by_place.find(TensorPlace::Of(e.spec));
    const Staged* p = it != by_place.end() ? it->second : nullptr;
    const bool same = p != nullptr && sync::SameSpec(p->tensor.spec, e.spec);
    REFIT_ASSIGN_OR_RETURN(const DType dtype, sync::FromProtoDType(e.spec.dtype()));
    Staged s;
    s.tensor.spec = e.spec;
    s.tensor.dtype = dtype;
    s.tensor.digest = rec.digests_v2 ? 0 : e.digest;
    s.tensor.digest_pending = rec.digests_v2;
    switch (e.kind) {
      case LogTensorKind::kUnchanged:
        if (!same || !UnchangedMatches(p->tensor, e.digest, rec.digests_v2, threads)) {
          return absl::DataLossError(absl::StrCat(
              what, ": unchanged, but the previous version has another spec or digest"));
        }
        s = *p;
        if (!rec.digests_v2) {  // a pending v1 digest was just computed and matched
          s.tensor.digest = e.digest;
          s.tensor.digest_pending = false;
        }
        break;
      case LogTensorKind::kPatch: {
        if (!same) {
          return absl::DataLossError(
              absl::StrCat(what, ": a patch, but the previous version has no such tensor"));
        }
        auto out = std::make_shared<std::vector<uint8_t>>(p->tensor.bytes->size());
        absl::StatusOr<DigestV2Delta> delta =
            ApplyPatchDigestV2(*e.bytes, dtype, *p->tensor.bytes, *out, threads);
        if (!delta.ok()) {
          return AnnotateAs(absl::StatusCode::kDataLoss, delta.status(), what);
        }
        s.tensor.digest_v2 = delta->ApplyTo(p->tensor.digest_v2, out->size());
        s.tensor.bytes = std::move(out);
        s.replaced = true;
        break;
      }
      case LogTensorKind::kDense:
        s.tensor.bytes = e.bytes;
        s.tensor.digest_v2 = TensorDigestV2(*e.bytes, threads);
        s.replaced = true;
        break;
    }
    if (rec.digests_v2 && s.tensor.digest_v2 != e.digest) {
      return absl::DataLossError(absl::StrCat(what, ": digest v2 ", Hex64(s.tensor.digest_v2),
                                              ", the log records ", Hex64(e.digest)));
    }
    next.push_back(std::move(s));
  }
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const Staged& s : next) {
    manifest.push_back(s.tensor.spec);
    digests.push_back(rec.digests_v2 ? s.tensor.digest_v2 : s.tensor.digest);
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t vdigest, sync::VersionDigest(manifest, digests));
  if (vdigest != rec.version_digest) {
    return absl::DataLossError(absl::StrCat(where, ": version digest ", Hex64(vdigest),
                                            " does not match the recorded ",
                                            Hex64(rec.version_digest)));
  }
  return next;
}

// The version `rec` made, whose tensors are `staged` (ApplyRecord's result, rec's order).
ReplayedVersion VersionOf(const LogRecord& rec, const std::vector<Staged>& staged) {
  ReplayedVersion v;
  v.version = rec.version;
  v.version_digest = rec.digests_v2 ? 0 : rec.version_digest;
  v.version_digest_v2 = rec.digests_v2 ? rec.version_digest : 0;
  v.snapshot_unix_nanos = rec.snapshot_unix_nanos;
  for (size_t i = 0; i < rec.tensors.size(); ++i) {
    const LogTensor& e = rec.tensors[i];
    sync::TensorUpdate u;
    u.spec = e.spec;
    u.digest = staged[i].tensor.digest;
    u.digest_pending = staged[i].tensor.digest_pending;
    u.digest_v2 = staged[i].tensor.digest_v2;
    if (e.kind == LogTensorKind::kPatch) u.patch = e.bytes;
    v.updates.push_back(std::move(u));
    v.changed.emplace_back(TensorPlace::Of(e.spec), e.changed_elements);
  }
  return v;
}

}  // namespace

LogReplay ReplayLog(const std::vector<BaselineTensor>& base, uint64_t base_version,
                    uint64_t lineage, const LogReadResult& log, const std::string& path,
                    int threads) {
  LogReplay out;
  std::vector<Staged> cur;
  cur.reserve(base.size());
  for (const BaselineTensor& t : base) cur.push_back({t, false});
  uint64_t at = base_version;
  for (size_t i = 0; i < log.records.size(); ++i) {
    const LogRecord& rec = log.records[i];
    if (rec.version <= base_version) {
      ++out.skipped;
      continue;
    }
    const std::string where = absl::StrCat("patch log ", Quoted(path), " at offset ",
                                           log.offsets[i], " (version ", rec.version, ")");
    if (rec.lineage != lineage) {
      out.stopped = absl::DataLossError(
          absl::StrCat(where, ": record of ", sync::DescribeLineage(rec.lineage),
                       ", the baseline's is ", sync::DescribeLineage(lineage)));
      break;
    }
    if (rec.base_version != at) {
      out.stopped = absl::DataLossError(absl::StrCat(where, ": its base version ", rec.base_version,
                                                     " does not follow version ", at));
      break;
    }
    absl::StatusOr<std::vector<Staged>> next = ApplyRecord(cur, rec, where, threads);
    if (!next.ok()) {
      out.stopped = next.status();
      break;
    }
    cur = std::move(*next);
    at = rec.version;
    out.versions.push_back(VersionOf(rec, cur));
  }
  if (out.stopped.ok() && !log.corrupt.ok()) out.stopped = log.corrupt;
  // Every tensor whose bytes came from the log: its digest at the last replayed version (one
  // whose v1 digest is pending was checked by its v2 digest at each record).
  for (const Staged& s : cur) {
    if (!s.replaced || s.tensor.digest_pending) continue;
    const uint64_t d = TensorDigest(*s.tensor.bytes, threads);
    if (d != s.tensor.digest) {
      LogReplay refused;
      refused.tensors = base;
      refused.skipped = out.skipped;
      refused.stopped = absl::DataLossError(
          absl::StrCat("patch log ", Quoted(path), ": after replaying to version ", at, ", tensor ",
                       sync::DescribeSpec(s.tensor.spec), " has digest ", Hex64(d),
                       ", the log records ", Hex64(s.tensor.digest), " (nothing replayed)"));
      return refused;
    }
  }
  for (Staged& s : cur) out.tensors.push_back(std::move(s.tensor));
  return out;
}

}  // namespace refit::publisher
