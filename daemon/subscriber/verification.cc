// SubscriberCore, a transfer's end: the VersionEnd checked against what arrived, every staged
// tensor's digest (v1, or v2 tracked while applying) compared with the publisher's, and the Ack
// of an applied version.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::subscriber {

absl::Status StagedTransfer::CheckEnd(const v1::VersionEnd& end) const {
  const uint64_t v = header.version();
  const size_t n = static_cast<size_t>(header.tensors_size());
  const std::string what = absl::StrCat("version ", v, ": ");
  if (end.version() != v) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "VersionEnd names version ", end.version()));
  }
  if (!failed.ok()) {
    return Annotate(
        failed, "version ", v,
        dropped_frames > 0 ? absl::StrCat(" (", dropped_frames, " later frames dropped)") : "");
  }
  if (absl::Status st = assembler->CheckAllComplete(); !st.ok()) {
    return Annotate(st, "version ", v);
  }
  if (static_cast<size_t>(end.digests_size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "VersionEnd has ", end.digests_size(), " digests for ", n, " tensors"));
  }
  return absl::OkStatus();
}

// Verification, one step: every tensor's digest of the staged slot against the VersionEnd, then
// the version digest, in the session's format. In v2 a tensor staged in place from a slot whose
// digests were verified has its digest already (the slot's plus the deltas of every patch
// applied): it is not read again. Every other tensor (keyframes, copies, a slot without known
// digests, v1 sessions) is read in full.
absl::StatusOr<VerifiedDigests> StagedTransfer::Verify(const v1::VersionEnd& end,
                                                       std::vector<std::string>& mismatched) {
  const size_t n = static_cast<size_t>(header.tensors_size());
  std::vector<uint64_t> digests(n);
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<uint64_t> digest = StagedDigest(i);
    if (!digest.ok()) {
      return absl::Status(
          digest.status().code(),
          absl::StrCat("version ", header.version(), ": digest of ",
                       sync::DescribeTensor(static_cast<uint32_t>(i),
                                            header.tensors(static_cast<int>(i)).spec().name()),
                       " failed: ", digest.status().message()));
    }
    digests[i] = *digest;
  }
  REFIT_ASSIGN_OR_RETURN(VerifiedDigests verified,
                         CheckTensorDigests(header, end, std::move(digests), mismatched));
  absl::StatusOr<std::vector<v1::TensorDigest>> joined =
      JoinedDigests(target->layout(), target->memory(), format, handle->out);
  if (!joined.ok()) return Annotate(joined.status(), "version ", header.version());
  verified.joined = std::move(*joined);
  return verified;
}

absl::StatusOr<std::vector<v1::TensorDigest>> JoinedDigests(
    const store::Layout& layout, store::TensorMemory& memory, sync::DigestFormat format,
    const std::vector<std::span<uint8_t>>& spans) {
  std::vector<v1::TensorDigest> out;
  if (layout.units().size() == layout.size()) return out;  // every unit a whole tensor
  for (const store::UnitInfo& unit : layout.units()) {
    if (!unit.first_row.has_value() || unit.offset_in_tensor != 0) continue;  // first part
    const store::TensorInfo& tensor = layout.tensor(unit.tensor);
    if (tensor.slice.has_value()) continue;  // held alone: the part's digest is the tensor's
    absl::StatusOr<uint64_t> d = StoreDigestOf(memory, format, spans[unit.tensor]);
    if (!d.ok()) {
      return Annotate(d.status(), "whole-tensor digest of ", Quoted(tensor.name),
                      " (joined from parts)");
    }
    v1::TensorDigest& td = out.emplace_back();
    td.set_name(tensor.name);
    td.set_digest(*d);
  }
  return out;
}

absl::StatusOr<VerifiedDigests> CheckTensorDigests(const v1::VersionHeader& header,
                                                   const v1::VersionEnd& end,
                                                   std::vector<uint64_t> digests,
                                                   std::vector<std::string>& mismatched) {
  const std::string what = absl::StrCat("version ", header.version(), ": ");
  std::vector<std::string> mismatch_desc;
  for (size_t i = 0; i < digests.size(); ++i) {
    const v1::TensorPlan& tp = header.tensors(static_cast<int>(i));
    if (digests[i] == end.digests(static_cast<int>(i))) continue;
    mismatched.push_back(tp.spec().name());
    mismatch_desc.push_back(
        absl::StrCat(sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()), " (",
                     v1::Delivery_Name(tp.delivery()), ")"));
  }
  if (!mismatched.empty()) {
    return absl::DataLossError(absl::StrCat(what, "digest mismatch on ", mismatched.size(),
                                            " tensor(s): ", absl::StrJoin(mismatch_desc, ", ")));
  }
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : header.tensors()) specs.push_back(tp.spec());
  auto vdigest = sync::VersionDigest(specs, digests);
  if (!vdigest.ok() || *vdigest != end.version_digest()) {
    return absl::DataLossError(absl::StrCat(what, "version digest mismatch: staged ",
                                            vdigest.ok() ? absl::StrCat(absl::Hex(*vdigest)) : "?",
                                            ", VersionEnd says ", absl::Hex(end.version_digest())));
  }
  VerifiedDigests out;
  out.digests = std::move(digests);
  out.version_digest = *vdigest;
  return out;
}

VersionRecord StagedTransfer::Record(const VerifiedDigests& verified) const {
  VersionRecord r{header.version(), format, verified.version_digest, {}, verified.joined};
  for (int i = 0; i < header.tensors_size(); ++i) {
    v1::TensorDigest& d = r.tensors.emplace_back();
    d.set_name(header.tensors(i).spec().name());
    d.set_digest(verified.digests[static_cast<size_t>(i)]);
  }
  return r;
}

std::vector<std::optional<uint64_t>> StagedTransfer::ByLayout(
    const VerifiedDigests& verified) const {
  std::vector<std::optional<uint64_t>> out(target->layout().units().size());
  for (size_t i = 0; i < verified.digests.size(); ++i) out[layout_index[i]] = verified.digests[i];
  return out;
}

v1::Ack AppliedAck(uint64_t version, uint64_t version_digest, uint64_t wire_bytes,
                   const StageMark& start, const StageMark& received, const StageMark& staged,
                   const StageMark& verified, const StageMark& applied) {
  v1::Ack ack;
  ack.set_version(version);
  ack.set_result(v1::ACK_RESULT_APPLIED);
  ack.set_applied_version(version);
  ack.set_applied_version_digest(version_digest);
  ack.set_wire_bytes(wire_bytes);
  v1::TransferTimings* tm = ack.mutable_timings();
  tm->set_receive_micros(WholeMicros(received.wall - start.wall));
  tm->set_stage_micros(WholeMicros(staged.wall - received.wall));
  tm->set_verify_micros(WholeMicros(verified.wall - staged.wall));
  tm->set_apply_micros(WholeMicros(applied.wall - verified.wall));
  tm->set_total_micros(WholeMicros(applied.wall - start.wall));
  tm->set_receive_cpu_micros(WholeMicros(received.cpu - start.cpu));
  tm->set_stage_cpu_micros(WholeMicros(staged.cpu - received.cpu));
  tm->set_verify_cpu_micros(WholeMicros(verified.cpu - staged.cpu));
  tm->set_apply_cpu_micros(WholeMicros(applied.cpu - verified.cpu));
  tm->set_total_cpu_micros(WholeMicros(applied.cpu - start.cpu));
  return ack;
}

// Tensor i's digest as staged, in the transfer's format: tracked or summed on arrival (v2, no
// read) or full.
absl::StatusOr<uint64_t> StagedTransfer::StagedDigest(size_t i) {
  if (format == sync::DigestFormat::kV2 && i < v2.size() && v2[i].has_value()) {
    ++(in_slot[i] ? stats.digests_received : stats.digests_incremental);
    return *v2[i];
  }
  ++stats.digests_full;
  return StoreDigestOf(target->memory(), format, Out(i));
}

}  // namespace refit::subscriber
