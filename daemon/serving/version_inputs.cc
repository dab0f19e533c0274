// A version's inputs checked before any encoding, the summary of an encoded version, and the
// publish guard's view of a version.
#include "daemon/serving/version_inputs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

absl::Status ValidateInputs(std::span<const TensorInput> given, const std::string& where,
                            std::vector<v1::TensorSpec>* specs_out,
                            std::vector<size_t>* order_out) {
  std::vector<v1::TensorSpec>& specs = *specs_out;
  specs.assign(given.size(), v1::TensorSpec());
  for (size_t i = 0; i < given.size(); ++i) {
    const TensorInput& in = given[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), in.name));
    if (!IsValidDType(static_cast<uint8_t>(in.dtype))) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": invalid dtype code ", static_cast<int>(in.dtype)));
    }
    v1::TensorSpec& s = specs[i];
    s.set_name(in.name);
    s.set_dtype(sync::ToProtoDType(in.dtype));
    for (uint64_t d : in.shape) s.add_shape(d);
    if (in.part.has_value()) *s.mutable_part() = *in.part;
    absl::Status st = sync::ValidateTensorSpec(s);
    if (!st.ok()) return AnnotateAs(absl::StatusCode::kInvalidArgument, st, what);
    const uint64_t bytes = *sync::TensorByteSize(s);
    if (in.device_bytes != nullptr && (in.device_bytes->device == nullptr || !in.data.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": device bytes need a device and no host data"));
    }
    const uint64_t given_bytes =
        in.device_bytes != nullptr ? in.device_bytes->memory.size() : in.data.size();
    if (given_bytes != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", given_bytes, " bytes given, dtype ", DTypeName(in.dtype),
                       " and shape [", absl::StrJoin(in.shape, ","), "] need ", bytes));
    }
    if (in.device_bytes == nullptr && in.data.data() == nullptr && bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null data"));
    }
  }
  std::vector<size_t>& order = *order_out;
  order.resize(given.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return sync::SpecBefore(specs[a], specs[b]); });
  for (size_t k = 1; k < order.size(); ++k) {
    const v1::TensorSpec& x = specs[order[k - 1]];
    const v1::TensorSpec& y = specs[order[k]];
    if (x.name() != y.name()) continue;
    const size_t a = std::min(order[k], order[k - 1]), b = std::max(order[k], order[k - 1]);
    if (!sync::IsPart(x) && !sync::IsPart(y)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(b), given[b].name),
                       " has the same name as tensor ", a));
    }
    // Several parts of one name: along one dim, same dtype and whole shape, not overlapping.
    if (absl::Status st = sync::CheckNextPart(x, y); !st.ok()) {
      return AnnotateAs(absl::StatusCode::kInvalidArgument, st, where, ": tensors ", a, " and ", b);
    }
  }

  return absl::OkStatus();
}

void SummarizeVersion(Encoded& enc, const std::vector<BaselineTensor>& prev, PublishSummary* sum,
                      std::vector<sync::TensorUpdate>* updates,
                      std::vector<std::pair<TensorPlace, uint64_t>>* counts) {
  for (size_t k = 0; k < enc.next.size(); ++k) {
    const BaselineTensor& t = enc.next[k];
    const uint64_t elems = ElementsOf(t.spec);
    const uint64_t bytes = *sync::TensorByteSize(t.spec);
    sum->total_elements += elems;
    sum->dense_bytes += bytes;
    if (enc.unchanged[k]) {
      ++sum->unchanged_tensors;
    } else if (enc.patches[k]) {
      ++sum->patched_tensors;
      sum->changed_elements += enc.changed[k];
      sum->wire_bytes += enc.patches[k]->size();
    } else {
      ++sum->keyframe_tensors;
      enc.changed[k] = elems;
      sum->changed_elements += elems;
      sum->wire_bytes += bytes;
    }
    counts->emplace_back(TensorPlace::Of(t.spec), enc.changed[k]);
    sync::TensorUpdate u;
    u.spec = t.spec;
    u.digest = t.digest;
    u.digest_pending = t.digest_pending;
    u.digest_v2 = t.digest_v2;
    u.patch = enc.patches[k];
    updates->push_back(std::move(u));
  }
  for (const BaselineTensor& p : prev) {
    if (FindByPlace(enc.next, p.spec) == nullptr) ++sum->removed_tensors;
  }
}

std::vector<GuardTensor> GuardTensorsOf(const std::vector<v1::TensorSpec>& specs) {
  std::vector<GuardTensor> out;
  out.reserve(specs.size());
  for (const v1::TensorSpec& s : specs) {
    out.push_back({s.name(), sync::TensorByteSize(s).value_or(0)});
  }
  return out;
}

std::vector<GuardTensor> GuardTensorsOf(const std::vector<BaselineTensor>& baseline) {
  std::vector<GuardTensor> out;
  out.reserve(baseline.size());
  for (const BaselineTensor& t : baseline) {
    out.push_back({t.spec.name(), sync::TensorByteSize(t.spec).value_or(0)});
  }
  return out;
}

}  // namespace refit::publisher
