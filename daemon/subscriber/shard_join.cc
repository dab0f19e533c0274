#include "daemon/subscriber/shard_join.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::subscriber {
namespace {

constexpr uint64_t kJoinedLineageSeed = 0x526566697453686Eull;  // "RefitShn"

bool AllKeyframes(const v1::VersionHeader& h) {
  for (const v1::TensorPlan& tp : h.tensors()) {
    if (tp.delivery() != v1::DELIVERY_KEYFRAME) return false;
  }
  return true;
}

std::string Shard(uint32_t k) { return absl::StrCat("shard ", k); }

}  // namespace

// The TransferSink of one shard: forwards to the join with its index.
class ShardJoin::Port final : public TransferSink {
 public:
  Port(ShardJoin* join, uint32_t k) : join_(join), k_(k) {}
  absl::Status CheckWelcome(const v1::Welcome& welcome) override {
    return join_->CheckWelcome(k_, welcome);
  }
  void SetMaxFrameBytes(uint32_t frame_bytes) override { join_->SetMaxFrameBytes(k_, frame_bytes); }
  void SetDigestFormat(sync::DigestFormat format) override { join_->SetDigestFormat(k_, format); }
  absl::Status OnHeader(const v1::VersionHeader& header) override {
    return join_->OnHeader(k_, header);
  }
  absl::Status OnFrame(v1::DataFrame& frame) override { return join_->OnFrame(k_, frame); }
  v1::Ack OnEnd(const v1::VersionEnd& end) override { return join_->OnEnd(k_, end); }
  void Abort() override { join_->Abort(k_); }
  void Interrupt() override { join_->Interrupt(k_); }
  uint64_t applied_version() const override { return join_->core_->applied_version(); }
  uint64_t applied_digest() const override { return join_->AppliedDigest(k_); }
  uint64_t applied_lineage() const override { return join_->AppliedLineage(k_); }
  std::vector<v1::TensorDigest> applied_tensor_digests() const override {
    return join_->AppliedTensors(k_);
  }
  uint64_t generation() const override { return join_->core_->generations().generation(); }
  bool ExpectRepair(uint64_t) override { return false; }  // not joined yet (header comment)
  uint64_t pending_repair() const override { return 0; }

 private:
  ShardJoin* const join_;
  const uint32_t k_;
};

ShardJoin::ShardJoin(SubscriberCore* core, ShardJoinOptions options)
    : core_(core), options_(std::move(options)), log_(Logger("shards")) {
  parts_.resize(options_.count);
  for (uint32_t k = 0; k < options_.count; ++k) {
    ports_.push_back(std::make_unique<Port>(this, k));
  }
}

ShardJoin::~ShardJoin() = default;

TransferSink* ShardJoin::port(uint32_t index) { return ports_.at(index).get(); }

absl::Status ShardJoin::CheckWelcome(uint32_t k, const v1::Welcome& welcome) {
  const std::string expected = absl::StrCat("shard ", k, " of the ", options_.count,
                                            " shards of set ", Quoted(options_.set));
  if (!welcome.has_shard()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the upstream publishes whole versions, not ", expected,
        " (subscriber.upstream.shards[", k, "]): set its publisher.shard"));
  }
  const v1::ShardIdentity& s = welcome.shard();
  if (s.set() != options_.set || s.index() != k || s.count() != options_.count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the upstream serves shard ", s.index(), " of the ", s.count(), " shards of set ",
        Quoted(s.set()), ", but subscriber.upstream.shards[", k, "] expects ", expected));
  }
  return absl::OkStatus();
}

void ShardJoin::SetMaxFrameBytes(uint32_t k, uint32_t frame_bytes) {
  absl::MutexLock lock(&mu_);
  parts_[k].frame_bytes = frame_bytes;
}

void ShardJoin::SetDigestFormat(uint32_t k, sync::DigestFormat format) {
  absl::MutexLock lock(&mu_);
  parts_[k].format = format;
}

uint64_t ShardJoin::AppliedDigest(uint32_t k) const {
  absl::MutexLock lock(&mu_);
  return parts_[k].applied_digest;
}

uint64_t ShardJoin::AppliedLineage(uint32_t k) const {
  absl::MutexLock lock(&mu_);
  return parts_[k].lineage;
}

std::vector<v1::TensorDigest> ShardJoin::AppliedTensors(uint32_t k) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TensorDigest> out;
  for (uint32_t i : parts_[k].applied_tensors) {
    v1::TensorDigest& d = out.emplace_back();
    d.set_name(applied_.specs[i].name());
    d.set_digest(applied_.digests[i]);
  }
  return out;
}

// ---- headers ------------------------------------------------------------------------------------

absl::Status ShardJoin::CheckPartHeader(uint32_t k, const v1::VersionHeader& h) const {
  const Part& p = parts_[k];
  if (p.state != PartState::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(
        Shard(k), ": VersionHeader for version ", h.version(), " while its part of version ",
        p.header.has_value() ? p.header->version() : 0, " is open"));
  }
  for (int i = 1; i < h.tensors_size(); ++i) {
    if (!(h.tensors(i - 1).spec().name() < h.tensors(i).spec().name())) {
      return absl::InvalidArgumentError(absl::StrCat(
          Shard(k), ": header for version ", h.version(), ": ",
          sync::DescribeTensor(static_cast<uint32_t>(i), h.tensors(i).spec().name()),
          " is not after the tensor before it (names must be ascending and unique)"));
    }
  }
  // Same lineage and not above the applied version: the core would refuse it (double apply).
  if (core_->applied_version() != 0 && h.lineage() == p.lineage &&
      h.version() <= core_->applied_version()) {
    return absl::FailedPreconditionError(absl::StrCat(
        Shard(k), ": header for version ", h.version(), " is not above the applied version ",
        core_->applied_version()));
  }
  return absl::OkStatus();
}

absl::Status ShardJoin::OnHeader(uint32_t k, const v1::VersionHeader& header) {
  absl::MutexLock lock(&mu_);
  Part& p = parts_[k];
  if (p.interrupted) return absl::CancelledError(absl::StrCat(Shard(k), ": session ending"));
  REFIT_RETURN_IF_ERROR(CheckPartHeader(k, header));
  p.header = header;
  p.state = PartState::kWaiting;
  p.transfer_wire_bytes = 0;
  TryOpenLocked();
  auto decided = [&p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return p.interrupted || p.state != PartState::kWaiting;
  };
  mu_.Await(absl::Condition(&decided));
  switch (p.state) {
    case PartState::kWaiting:  // interrupted while waiting for the other shards
      ResetPartLocked(p);
      return absl::CancelledError(absl::StrCat(Shard(k), ": session ending"));
    case PartState::kRefused: {
      absl::Status st = p.error;
      ResetPartLocked(p);
      return st;
    }
    default:  // joined, or dropping (frames dropped, End answered REJECTED)
      return absl::OkStatus();
  }
}

void ShardJoin::TryOpenLocked() {
  if (open_) return;  // every part is in it: no part can be waiting
  uint64_t newest = 0;
  uint32_t newest_shard = 0;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    const Part& p = parts_[k];
    if (p.state == PartState::kWaiting && p.header->version() > newest) {
      newest = p.header->version();
      newest_shard = k;
    }
  }
  bool all = true;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    Part& p = parts_[k];
    if (p.state == PartState::kWaiting && p.header->version() < newest) {
      p.state = PartState::kDropping;
      p.error = absl::AbortedError(absl::StrCat(
          Shard(k), "'s version ", p.header->version(), " is superseded: ", Shard(newest_shard),
          " offers version ", newest, "; every shard must deliver the same version"));
      ++superseded_;
      log_->info("{}", std::string(p.error.message()));
    }
    all = all && p.state == PartState::kWaiting;
  }
  if (!all) return;
  std::vector<v1::DataFrame> synthetic;
  absl::StatusOr<v1::VersionHeader> joined = JoinHeadersLocked(synthetic);
  absl::Status st = joined.status();
  if (st.ok()) st = CheckSelectionCoveredLocked(*joined);  // refused like a refused header
  if (st.ok()) {
    uint32_t frame_bytes = 0;
    for (const Part& p : parts_) frame_bytes = std::max(frame_bytes, p.frame_bytes);
    core_->SetMaxFrameBytes(frame_bytes);
    core_->SetDigestFormat(parts_[0].format);  // JoinHeadersLocked checked they agree
    st = core_->OnHeader(*joined);
  }
  if (!st.ok()) {
    ++failed_transfers_;
    log_->warn("version {}: the shards' headers were not joined: {}", newest, st.ToString());
    for (Part& p : parts_) {
      // A refused joined header ends the sessions, as a refused header does without shards;
      // a part that cannot be joined is answered REJECTED (its publisher retries).
      p.state = joined.ok() ? PartState::kRefused : PartState::kDropping;
      p.error = st;
      p.last_error = std::string(st.message());
    }
    return;
  }
  joined_ = *std::move(joined);
  joined_time_ = absl::Now();
  open_ = true;
  ends_ = 0;
  for (Part& p : parts_) p.state = PartState::kJoined;
  if (options_.tap != nullptr) options_.tap->OnHeader(joined_);
  for (v1::DataFrame& f : synthetic) {
    if (options_.tap != nullptr) options_.tap->OnFrame(f);
    if (absl::Status fs = core_->OnFrame(f); !fs.ok()) {
      FailJoinedLocked(fs);
      return;
    }
  }
}

// The parts' headers agree on what the joined header holds once: digest format, base version.
// Fills the joined header's version, base, streamed flag, snapshot time and reason.
absl::Status ShardJoin::JoinHeaderFieldsLocked(v1::VersionHeader& out) const {
  const v1::VersionHeader& first = *parts_[0].header;
  out.set_version(first.version());
  uint64_t base = 0;
  bool streamed = false;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    const Part& p = parts_[k];
    const v1::VersionHeader& h = *p.header;
    if (p.format != parts_[0].format) {
      return absl::FailedPreconditionError(absl::StrCat(
          Shard(k), " verifies digests in format ", sync::DigestFormatToWire(p.format), ", ",
          Shard(0), " in ", sync::DigestFormatToWire(parts_[0].format),
          ": every shard's publisher must offer the same digest formats"));
    }
    if (h.base_version() != 0) {
      if (base != 0 && base != h.base_version()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "version ", h.version(), ": ", Shard(k), " patches from version ", h.base_version(),
            ", another shard from ", base));
      }
      base = h.base_version();
    }
    streamed = streamed || h.streamed();
    out.set_snapshot_unix_nanos(std::max(out.snapshot_unix_nanos(), h.snapshot_unix_nanos()));
    if (k == 0 || h.reason() > out.reason()) out.set_reason(h.reason());
  }
  out.set_base_version(base);
  out.set_streamed(streamed);
  return absl::OkStatus();
}

// The transfer continues the applied version's lineage (the core's double-apply guard holds
// its number above the applied one), unless nothing is applied yet or every tensor is a
// keyframe at a number not above the applied one: then the lineage is the parts' together.
uint64_t ShardJoin::JoinedLineageLocked(uint64_t version) const {
  bool keyframes = true;
  uint64_t lineage = kJoinedLineageSeed;
  for (const Part& p : parts_) {
    keyframes = keyframes && AllKeyframes(*p.header);
    const uint64_t part_lineage = p.header->lineage();
    lineage = Hash64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&part_lineage),
                                              sizeof(part_lineage)),
                     lineage);
  }
  const bool continues =
      core_->applied_version() != 0 && (!keyframes || version > core_->applied_version());
  if (continues) return core_->applied_lineage();
  return lineage == 0 ? 1 : lineage;
}

// A non-streamed part's tensor in a streamed transfer: UNCHANGED becomes a zero-byte patch
// (its one empty frame into `synthetic`); a chain of several patches cannot be streamed.
absl::Status ShardJoin::StreamTensorLocked(uint32_t part, uint32_t joined_index,
                                           const v1::VersionHeader& out, v1::TensorPlan& tp,
                                           std::vector<v1::DataFrame>& synthetic) const {
  if (tp.delivery() == v1::DELIVERY_PATCH && tp.steps_size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", out.version(), ": ", Shard(part), " sends ", Quoted(tp.spec().name()),
        " as a chain of ", tp.steps_size(), " patches while another shard streams"));
  }
  if (tp.delivery() != v1::DELIVERY_UNCHANGED) return absl::OkStatus();
  tp.set_delivery(v1::DELIVERY_PATCH);
  v1::PatchStep* step = tp.add_steps();
  step->set_base_version(out.base_version());
  step->set_target_version(out.version());
  v1::DataFrame& f = synthetic.emplace_back();
  f.set_version(out.version());
  f.set_tensor_index(joined_index);
  f.set_chunk_count(1);
  f.set_checksum(sync::FrameChecksum(std::string()));
  return absl::OkStatus();
}

// The K waiting headers as one: tensors in name order, the parts' maps, and the zero-byte
// frames of UNCHANGED tensors of non-streamed parts when the joined header is streamed.
absl::StatusOr<v1::VersionHeader> ShardJoin::JoinHeadersLocked(
    std::vector<v1::DataFrame>& synthetic) {
  v1::VersionHeader out;
  REFIT_RETURN_IF_ERROR(JoinHeaderFieldsLocked(out));
  struct Entry {
    const v1::TensorPlan* plan;
    uint32_t part;
    uint32_t index;
  };
  std::vector<Entry> entries;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    const v1::VersionHeader& h = *parts_[k].header;
    for (int i = 0; i < h.tensors_size(); ++i) {
      entries.push_back({&h.tensors(i), k, static_cast<uint32_t>(i)});
    }
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return sync::SpecBefore(a.plan->spec(), b.plan->spec());
  });
  for (Part& p : parts_) p.map.assign(p.header->tensors_size(), 0);
  std::vector<v1::TensorSpec> specs;
  for (size_t j = 0; j < entries.size(); ++j) {
    const Entry& e = entries[j];
    const v1::TensorSpec& spec = e.plan->spec();
    if (j > 0 && entries[j - 1].plan->spec().name() == spec.name()) {
      const v1::TensorSpec& prev = entries[j - 1].plan->spec();
      if (!sync::IsPart(prev) || !sync::IsPart(spec)) {
        return absl::InvalidArgumentError(
            absl::StrCat("version ", out.version(), ": tensor ", Quoted(spec.name()),
                         " is published by ", Shard(entries[j - 1].part), " and ", Shard(e.part),
                         "; the shards of a set must own disjoint tensors or disjoint rows of "
                         "one (TensorSpec.part)"));
      }
      if (absl::Status st = sync::CheckNextPart(prev, spec); !st.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("version ", out.version(), ": ", Shard(entries[j - 1].part), "'s part ",
                         sync::DescribeSpec(prev), " and ", Shard(e.part), "'s part ",
                         sync::DescribeSpec(spec), " do not join: ", st.message()));
      }
    }
    specs.push_back(spec);
    parts_[e.part].map[e.index] = static_cast<uint32_t>(j);
    v1::TensorPlan* tp = out.add_tensors();
    *tp = *e.plan;
    if (out.streamed() && !parts_[e.part].header->streamed()) {
      REFIT_RETURN_IF_ERROR(
          StreamTensorLocked(e.part, static_cast<uint32_t>(j), out, *tp, synthetic));
    }
  }
  // Every tensor whole: the parts of each sliced tensor, over all shards, tile its rows.
  if (absl::Status st = sync::CheckPartsTile(specs); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("version ", out.version(), " over all ",
                                                   parts_.size(), " shards: ", st.message(), " (",
                                                   PartOwnersLocked(), ")"));
  }
  out.set_lineage(JoinedLineageLocked(out.version()));
  return out;
}

// "shard 0 (set s) rows [0, 63) of 'w', ...": which shard sent which part, for errors.
std::string ShardJoin::PartOwnersLocked() const {
  std::vector<std::string> owners;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    for (const v1::TensorPlan& tp : parts_[k].header->tensors()) {
      if (sync::IsPart(tp.spec())) {
        owners.push_back(absl::StrCat(Shard(k), ": ", sync::DescribeSpec(tp.spec())));
      }
    }
  }
  if (owners.size() > 16) {
    owners.resize(16);
    owners.push_back("...");
  }
  return absl::StrCat("parts: ", absl::StrJoin(owners, "; "));
}

// upstream.tensors with shards: each shard sent its part; together they must hold a tensor for
// every pattern, as one publisher of the whole version would check.
absl::Status ShardJoin::CheckSelectionCoveredLocked(const v1::VersionHeader& joined) const {
  if (options_.selection.all()) return absl::OkStatus();
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : joined.tensors()) specs.push_back(tp.spec());
  absl::Status st = options_.selection.CheckCovered(
      specs, absl::StrCat("version ", joined.version(), " over all ", parts_.size(), " shards"));
  if (st.ok()) return st;
  return AnnotateAs(absl::StatusCode::kInvalidArgument, st, "subscriber.upstream.tensors");
}

// ---- frames -------------------------------------------------------------------------------------

absl::Status ShardJoin::OnFrame(uint32_t k, v1::DataFrame& frame) {
  {
    absl::MutexLock lock(&mu_);
    Part& p = parts_[k];
    p.wire_bytes += frame.payload().size();
    p.transfer_wire_bytes += frame.payload().size();
    if (p.state == PartState::kDropping) return absl::OkStatus();
    if (p.state != PartState::kJoined) {
      return absl::FailedPreconditionError(absl::StrCat(
          Shard(k), ": DataFrame of version ", frame.version(), " outside a transfer"));
    }
    if (frame.tensor_index() >= p.map.size()) {
      absl::Status st = absl::InvalidArgumentError(absl::StrCat(
          Shard(k), ": DataFrame of version ", frame.version(), " for tensor index ",
          frame.tensor_index(), ", but its header has ", p.map.size(), " tensors"));
      FailJoinedLocked(st);
      return st;
    }
    frame.set_tensor_index(p.map[frame.tensor_index()]);
  }
  // Outside the join's lock: the core serialises frames itself, and no other joined transfer
  // can open before this part's End, which its session sends only after this frame returned.
  if (options_.tap != nullptr) options_.tap->OnFrame(frame);
  return core_->OnFrame(frame);
}

// ---- ends ---------------------------------------------------------------------------------------

absl::Status ShardJoin::CheckPartEnd(uint32_t k, const v1::VersionEnd& end) const {
  const Part& p = parts_[k];
  const v1::VersionHeader& h = *p.header;
  if (end.version() != h.version()) {
    return absl::FailedPreconditionError(absl::StrCat(
        Shard(k), ": VersionEnd for version ", end.version(), " but its transfer is of version ",
        h.version()));
  }
  if (end.digests_size() != h.tensors_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Shard(k), ": VersionEnd of version ", end.version(), " has ", end.digests_size(),
        " digests for ", h.tensors_size(), " tensors"));
  }
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : h.tensors()) specs.push_back(tp.spec());
  absl::StatusOr<uint64_t> d = sync::VersionDigest(
      specs, std::vector<uint64_t>(end.digests().begin(), end.digests().end()));
  if (!d.ok() || *d != end.version_digest()) {
    return absl::DataLossError(absl::StrCat(
        Shard(k), ": VersionEnd of version ", end.version(),
        ": its version digest does not match its tensors' digests"));
  }
  return absl::OkStatus();
}

v1::Ack ShardJoin::OnEnd(uint32_t k, const v1::VersionEnd& end) {
  std::optional<AppliedEvent> event;
  v1::Ack ack;
  {
    absl::MutexLock lock(&mu_);
    Part& p = parts_[k];
    if (p.state != PartState::kJoined) {
      const absl::Status why = p.state == PartState::kDropping
                                   ? p.error
                                   : absl::FailedPreconditionError(absl::StrCat(
                                         Shard(k), ": VersionEnd without a transfer"));
      ack = RejectLocked(k, end.version(), why);
      ResetPartLocked(p);
      return ack;
    }
    if (absl::Status st = CheckPartEnd(k, end); !st.ok()) {
      FailJoinedLocked(st);
      ack = RejectLocked(k, end.version(), st);
      ResetPartLocked(p);
      return ack;
    }
    p.end = end;
    if (++ends_ == parts_.size()) FinishJoinedLocked(event);
    auto answered = [&p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return p.ack.has_value() || p.interrupted;
    };
    mu_.Await(absl::Condition(&answered));
    if (!p.ack.has_value()) {  // this shard's session ends while the others are awaited
      FailJoinedLocked(absl::CancelledError(absl::StrCat(Shard(k), "'s session ended")));
    }
    ack = *p.ack;
    ResetPartLocked(p);
  }
  if (event.has_value() && options_.on_applied) options_.on_applied(*event);
  return ack;
}

void ShardJoin::FinishJoinedLocked(std::optional<AppliedEvent>& event) {
  const v1::VersionEnd end = JoinEndsLocked();
  if (options_.tap != nullptr) options_.tap->OnEnd(end, parts_[0].format);
  const uint64_t prev_generation = core_->generations().generation();
  const uint64_t prev_version = core_->applied_version();
  const uint64_t prev_lineage = core_->applied_lineage();
  const v1::Ack joined = core_->OnEnd(end);
  open_ = false;
  if (joined.result() == v1::ACK_RESULT_APPLIED) {
    RecordAppliedLocked();
    ++joined_versions_;
    AppliedEvent& ev = event.emplace();
    ev.stats = sync::TransferStats(joined_, end, joined.wire_bytes(), absl::Now() - joined_time_);
    ev.stats.set_cpu_micros(joined.timings().total_cpu_micros());
    last_refit_ = ev.stats;
    ev.ack = joined;
    ev.ack.set_applied_version_digest(core_->applied_digest());
    ev.layout_changed = core_->generations().generation() != prev_generation;
    ev.upstream = absl::StrCat(parts_.size(), " shards of set ", options_.set);
    ev.reason = joined_.reason();
    ev.tensors = static_cast<uint32_t>(joined_.tensors_size());
    ev.lineage_changed = prev_version != 0 && prev_lineage != core_->applied_lineage();
  } else {
    ++failed_transfers_;
    log_->warn("joined version {} rejected: {}", end.version(), joined.error());
  }
  for (uint32_t k = 0; k < parts_.size(); ++k) parts_[k].ack = PartAckLocked(k, joined);
}

v1::VersionEnd ShardJoin::JoinEndsLocked() const {
  v1::VersionEnd out;
  out.set_version(joined_.version());
  std::vector<uint64_t> digests(static_cast<size_t>(joined_.tensors_size()), 0);
  for (const Part& p : parts_) {
    const v1::VersionEnd& e = *p.end;
    for (size_t i = 0; i < p.map.size(); ++i) digests[p.map[i]] = e.digests(static_cast<int>(i));
    out.set_frames(out.frames() + e.frames());
    out.set_wire_bytes(out.wire_bytes() + e.wire_bytes());
    out.set_dense_bytes(out.dense_bytes() + e.dense_bytes());
    out.set_changed_elements(out.changed_elements() + e.changed_elements());
    out.set_total_elements(out.total_elements() + e.total_elements());
    out.set_encode_micros(std::max(out.encode_micros(), e.encode_micros()));
    out.set_publish_pass_micros(std::max(out.publish_pass_micros(), e.publish_pass_micros()));
    out.set_baseline_update_micros(
        std::max(out.baseline_update_micros(), e.baseline_update_micros()));
  }
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : joined_.tensors()) specs.push_back(tp.spec());
  for (uint64_t d : digests) out.add_digests(d);
  absl::StatusOr<uint64_t> vd = sync::VersionDigest(specs, digests);
  out.set_version_digest(vd.ok() ? *vd : 0);  // the core validated the manifest
  return out;
}

void ShardJoin::RecordAppliedLocked() {
  applied_.specs.clear();
  applied_.digests.clear();
  for (const v1::TensorPlan& tp : joined_.tensors()) applied_.specs.push_back(tp.spec());
  applied_.digests.assign(applied_.specs.size(), 0);
  applied_format_ = parts_[0].format;
  for (Part& p : parts_) {
    p.lineage = p.header->lineage();
    p.applied_tensors = p.map;
    p.applied_bytes = 0;
    std::vector<v1::TensorSpec> specs;
    std::vector<uint64_t> digests;
    for (size_t i = 0; i < p.map.size(); ++i) {
      applied_.digests[p.map[i]] = p.end->digests(static_cast<int>(i));
      specs.push_back(applied_.specs[p.map[i]]);
      digests.push_back(applied_.digests[p.map[i]]);
      absl::StatusOr<uint64_t> b = sync::TensorByteSize(specs.back());
      p.applied_bytes += b.ok() ? *b : 0;
    }
    absl::StatusOr<uint64_t> d = sync::VersionDigest(specs, digests);
    p.applied_digest = d.ok() ? *d : 0;  // CheckPartEnd verified this manifest's digest
    p.last_error.clear();
  }
}

v1::Ack ShardJoin::PartAckLocked(uint32_t k, const v1::Ack& joined) const {
  const Part& p = parts_[k];
  v1::Ack ack;
  ack.set_version(joined.version());
  ack.set_result(joined.result());
  ack.set_error(joined.error());
  ack.set_applied_version(core_->applied_version());
  ack.set_applied_version_digest(p.applied_digest);
  *ack.mutable_timings() = joined.timings();
  ack.set_wire_bytes(p.transfer_wire_bytes);
  for (const std::string& name : joined.mismatched_tensors()) {
    for (size_t i = 0; i < p.map.size(); ++i) {
      if (joined_.tensors(static_cast<int>(p.map[i])).spec().name() == name) {
        ack.add_mismatched_tensors(name);
      }
    }
  }
  return ack;
}

v1::Ack ShardJoin::RejectLocked(uint32_t k, uint64_t version, const absl::Status& why) const {
  v1::Ack ack;
  ack.set_version(version);
  ack.set_result(v1::ACK_RESULT_REJECTED);
  ack.set_error(std::string(why.message()));
  ack.set_applied_version(core_->applied_version());
  ack.set_applied_version_digest(parts_[k].applied_digest);
  ack.set_wire_bytes(parts_[k].transfer_wire_bytes);
  return ack;
}

// ---- failures -----------------------------------------------------------------------------------

void ShardJoin::FailJoinedLocked(const absl::Status& why) {
  if (!open_) return;
  open_ = false;
  ++failed_transfers_;
  log_->warn("joined version {} failed: {}; the applied version {} stays", joined_.version(),
             why.ToString(), core_->applied_version());
  core_->Abort();
  if (options_.tap != nullptr) options_.tap->OnAbort(why);
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    Part& p = parts_[k];
    p.last_error = std::string(why.message());
    if (p.state != PartState::kJoined) continue;
    if (p.end.has_value()) {
      p.ack = RejectLocked(k, joined_.version(), why);
    } else {
      p.state = PartState::kDropping;
      p.error = why;
    }
  }
}

void ShardJoin::ResetPartLocked(Part& p) {
  p.state = PartState::kIdle;
  p.header.reset();
  p.end.reset();
  p.ack.reset();
  p.map.clear();
  p.error = absl::OkStatus();
}

void ShardJoin::Abort(uint32_t k) {
  absl::MutexLock lock(&mu_);
  Part& p = parts_[k];
  p.interrupted = false;  // the session is over; the next one starts clean
  // Never during this part's own OnEnd: its session calls Abort from the same thread, or
  // after that thread ended.
  if (p.state == PartState::kJoined) {
    FailJoinedLocked(absl::AbortedError(absl::StrCat(
        Shard(k), "'s part of version ", p.header->version(),
        " was dropped (its session ended or its publisher aborted the version)")));
  }
  ResetPartLocked(p);
}

void ShardJoin::Interrupt(uint32_t k) {
  absl::MutexLock lock(&mu_);
  parts_[k].interrupted = true;
}

ShardJoinStatus ShardJoin::Status() const {
  absl::MutexLock lock(&mu_);
  ShardJoinStatus s;
  s.set = options_.set;
  s.applied_version = core_->applied_version();
  s.joined_versions = joined_versions_;
  s.failed_transfers = failed_transfers_;
  s.superseded = superseded_;
  for (uint32_t k = 0; k < parts_.size(); ++k) {
    const Part& p = parts_[k];
    s.shards.push_back({.index = k,
                        .offered_version = p.header.has_value() ? p.header->version() : 0,
                        .joined = p.state == PartState::kJoined,
                        .lineage = p.lineage,
                        .tensors = static_cast<uint32_t>(p.applied_tensors.size()),
                        .bytes = p.applied_bytes,
                        .wire_bytes = p.wire_bytes,
                        .last_error = p.last_error});
    if (p.state == PartState::kWaiting) {
      s.waiting_version = std::max(s.waiting_version, p.header->version());
    }
  }
  if (s.waiting_version != 0) {
    for (uint32_t k = 0; k < parts_.size(); ++k) {
      const Part& p = parts_[k];
      if (p.state != PartState::kWaiting || p.header->version() != s.waiting_version) {
        s.waiting_for.push_back(k);
      }
    }
  }
  return s;
}

v1::RefitStats ShardJoin::last_refit() const {
  absl::MutexLock lock(&mu_);
  return last_refit_;
}

}  // namespace refit::subscriber
