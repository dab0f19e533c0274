// SubscriberCore, a transfer's header: its versions checked against what is held, each tensor's
// plan checked and the layout derived, the target store chosen (the current generation, or a
// new one for a new layout), old bases leased, and the objects the frames must bring listed.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::subscriber {

namespace {

bool SameShape(const std::vector<uint64_t>& a, const google::protobuf::RepeatedField<uint64_t>& b) {
  return a.size() == static_cast<size_t>(b.size()) && std::equal(a.begin(), a.end(), b.begin());
}

// The store's description of a spec's part (TensorSpec.part), or nullopt for a whole tensor;
// held `alone` by a tensor-parallel subscriber.
std::optional<store::PartDesc> PartOf(const v1::TensorSpec& spec, bool alone) {
  if (!sync::IsPart(spec)) return std::nullopt;
  return store::PartDesc{.first_row = spec.part().first_row(),
                         .whole_shape = std::vector<uint64_t>(spec.part().whole_shape().begin(),
                                                              spec.part().whole_shape().end()),
                         .dim = spec.part().dim(),
                         .alone = alone};
}

std::optional<uint64_t> FirstRow(const v1::TensorSpec& spec) {
  if (!sync::IsPart(spec)) return std::nullopt;
  return spec.part().first_row();
}

}  // namespace

// The header's version against the applied one: in range, above it (or of another lineage, as
// keyframes from base 0, or the repair ExpectRepair armed), based on it or on nothing. Sets t's
// lineage_change and repair.
absl::Status SubscriberCore::CheckHeader(StagedTransfer& t) const {
  const v1::VersionHeader& header = t.header;
  const uint64_t v = header.version();
  const uint64_t base = header.base_version();
  const uint64_t applied = applied_version();
  if (v == 0) return absl::InvalidArgumentError("header: version 0 is not a valid target");
  if (v > sync::kMaxVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("header for version ", v, ": above the largest version ", sync::kMaxVersion));
  }
  if (header.tensors_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("header for version ", v, " lists no tensors"));
  }
  bool all_keyframes = true;
  for (const v1::TensorPlan& tp : header.tensors()) {
    all_keyframes = all_keyframes && tp.delivery() == v1::DELIVERY_KEYFRAME;
  }
  // Another lineage: version numbers are not comparable, so a lower one is accepted, but only
  // as a full keyframe into a new store generation (data.proto "Versions and lineage").
  const bool lineage_change = applied != 0 && header.lineage() != applied_lineage();
  if (lineage_change && !(base == 0 && all_keyframes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, " of ", sync::DescribeLineage(header.lineage()),
        " has base version ", base, " but the applied version ", applied, " is of ",
        sync::DescribeLineage(applied_lineage()), " (a lineage change needs keyframes)"));
  }
  const uint64_t armed = repair_version_.load(std::memory_order_acquire);
  t.repair = v == armed && v == applied && base == v && header.lineage() == applied_lineage() &&
             header.reason() == v1::TRANSFER_REASON_REQUESTED;
  t.lineage_change = lineage_change;
  if (v <= applied && !lineage_change && !t.repair) {
    return absl::FailedPreconditionError(absl::StrCat("header for version ", v,
                                                      " is not above the applied version ", applied,
                                                      " (a version is never applied twice)"));
  }
  if (base != applied && !(base == 0 && all_keyframes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, " has base version ", base, " but the applied version is ",
        applied, base == 0 ? " (base 0 requires every tensor to be a keyframe)" : ""));
  }
  return absl::OkStatus();
}

namespace {

// One tensor's delivery and patch chain against the header's base (OnHeader). `where` names the
// tensor for errors.
absl::Status CheckTensorPlan(const v1::TensorPlan& tp, uint64_t base, uint64_t version,
                             const std::string& where) {
  switch (tp.delivery()) {
    case v1::DELIVERY_KEYFRAME:
    case v1::DELIVERY_UNCHANGED:
      if (tp.steps_size() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": steps given for a ", v1::Delivery_Name(tp.delivery())));
      }
      break;
    case v1::DELIVERY_PATCH: {
      if (tp.steps_size() == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": DELIVERY_PATCH without steps"));
      }
      uint64_t at = base;
      for (int s = 0; s < tp.steps_size(); ++s) {
        const v1::PatchStep& step = tp.steps(s);
        if (step.base_version() != at || step.target_version() <= step.base_version()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": patch step ", s, " goes ", step.base_version(), " -> ",
                           step.target_version(), ", expected a step from ", at));
        }
        at = step.target_version();
      }
      if (at != version) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": patch chain ends at version ", at, ", not ", version));
      }
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": invalid delivery ", static_cast<int>(tp.delivery())));
  }
  if (tp.delivery() != v1::DELIVERY_KEYFRAME && base == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", v1::Delivery_Name(tp.delivery()), " needs a base version"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<store::Layout> StagedTransfer::PlanTensors(uint64_t max_slot_bytes, bool& needs_base,
                                                          const sync::TensorSelection& slice) {
  const uint64_t v = header.version();
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : header.tensors()) specs.push_back(tp.spec());
  if (absl::Status st = sync::ValidateManifest(specs); !st.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, st, "header for version ", v);
  }
  const bool sliced = slice.slice_ranks() > 0;
  for (const v1::TensorSpec& spec : specs) {
    if (sliced && sync::IsPart(spec) && !slice.Takes(spec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header for version ", v, ": ", sync::DescribeSpec(spec), " is not the share of ",
          slice.Describe(), " (the upstream sent another rank's part)"));
    }
  }
  std::vector<store::UnitDesc> descs;
  needs_base = false;
  for (int i = 0; i < header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = header.tensors(i);
    const std::string where =
        absl::StrCat("header for version ", v, ", ",
                     sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()));
    auto dtype = sync::FromProtoDType(tp.spec().dtype());
    auto size = sync::TensorByteSize(tp.spec());
    if (!dtype.ok() || !size.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": invalid spec"));
    }
    dtypes.push_back(*dtype);
    bytes.push_back(*size);
    descs.push_back({{tp.spec().name(), *dtype,
                      std::vector<uint64_t>(tp.spec().shape().begin(), tp.spec().shape().end())},
                     PartOf(tp.spec(), sliced)});
    REFIT_RETURN_IF_ERROR(CheckTensorPlan(tp, header.base_version(), v, where));
    if (header.streamed() && (tp.delivery() == v1::DELIVERY_UNCHANGED ||
                              (tp.delivery() == v1::DELIVERY_PATCH && tp.steps_size() != 1))) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a streamed transfer has only PATCH tensors of one step and KEYFRAMEs"));
    }
    needs_base = needs_base || tp.delivery() != v1::DELIVERY_KEYFRAME;
  }
  auto layout = store::Layout::BuildUnits(std::move(descs));
  if (!layout.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, layout.status(), "header for version ",
                      v);
  }
  if (layout->slot_bytes() > max_slot_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("header for version ", v, ": the version needs ", layout->slot_bytes(),
                     " bytes per slot, above the limit of ", max_slot_bytes));
  }
  return layout;
}

// Target store: the current one when the manifest is unchanged, else a new generation.
absl::Status SubscriberCore::ChooseTarget(StagedTransfer& t, const store::Layout& layout) {
  std::shared_ptr<store::SlottedStore> current = generations_.current();
  if (current != nullptr && !t.lineage_change && current->layout().SameManifest(layout)) {
    t.target = std::move(current);
  } else {
    auto created = generations_.Create(layout);
    if (!created.ok()) {
      return Annotate(created.status(), "header for version ", t.header.version(),
                      ": cannot create a store");
    }
    t.target = std::move(*created);
    t.new_generation = true;
  }
  for (const v1::TensorPlan& tp : t.header.tensors()) {
    t.layout_index.push_back(*t.target->layout().FindUnit(tp.spec().name(), FirstRow(tp.spec())));
  }
  return absl::OkStatus();
}

// Bases across generations: by name, under a lease on the old store's applied version.
absl::Status SubscriberCore::LeaseOldBases(StagedTransfer& t) {
  const uint64_t v = t.header.version();
  const uint64_t applied = applied_version();
  std::shared_ptr<store::SlottedStore> current = generations_.current();
  if (current == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, ": patches/unchanged tensors but no version held"));
  }
  const store::Layout& old = current->layout();
  t.old_index.assign(static_cast<size_t>(t.header.tensors_size()), 0);
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) continue;
    auto idx = old.FindUnit(tp.spec().name(), FirstRow(tp.spec()));
    if (!idx.has_value() ||
        old.tensor(old.unit(*idx).tensor).dtype != t.dtypes[static_cast<size_t>(i)] ||
        !SameShape(old.unit(*idx).shape, tp.spec().shape())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "header for version ", v, ", ",
          sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          sync::IsPart(tp.spec()) ? absl::StrCat(" (", sync::DescribeSpec(tp.spec()), ")") : "",
          ": no tensor of that name, dtype and shape in the applied version ", applied,
          " to use as base"));
    }
    t.old_index[static_cast<size_t>(i)] = *idx;
  }
  t.old_store = current;
  auto lease = current->AcquireLease(options_.self_consumer, applied, absl::InfiniteDuration());
  if (!lease.ok()) {
    return Annotate(lease.status(), "header for version ", v, ": cannot lease the base version");
  }
  t.old_lease = std::move(*lease);
  return absl::OkStatus();
}

// The objects the transfer's frames carry; a keyframe goes straight into the staged slot when
// there is one the CPU can write, its digest v2 summed as its frames land (no second read).
absl::Status StagedTransfer::ExpectObjects(uint32_t max_frame_bytes) {
  const size_t n = static_cast<size_t>(header.tensors_size());
  assembler = std::make_unique<sync::FrameAssembler>(header.version(), max_frame_bytes);
  in_slot.assign(n, false);
  for (size_t i = 0; i < n; ++i) {
    const v1::TensorPlan& tp = header.tensors(static_cast<int>(i));
    REFIT_ASSIGN_OR_RETURN(std::vector<sync::ObjectSpec> objects,
                           sync::ObjectsOf(tp, static_cast<uint32_t>(i)));
    for (sync::ObjectSpec& spec : objects) {
      // A keyframe lands straight in the staged slot when the store is host memory.
      if (tp.delivery() == v1::DELIVERY_KEYFRAME && handle.has_value() &&
          target->memory().host_accessible()) {
        spec.buffer = Out(i);
        spec.digest_v2 = format == sync::DigestFormat::kV2;  // summed as it lands
        in_slot[i] = true;
      }
      REFIT_RETURN_IF_ERROR(assembler->Expect(std::move(spec)));
    }
  }
  return absl::OkStatus();
}

}  // namespace refit::subscriber
