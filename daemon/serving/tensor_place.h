// Where a tensor sits in a version's manifest: its name and, for a part (TensorSpec.part), the
// part's dim and first index. A version may hold several parts of one name (a publisher that
// cuts tensors for tensor-parallel subscribers), so the publisher core keys every per-tensor
// record (baseline, GPU baseline, changed-element counts, persisted tensors) by place, never by
// name alone. The order is the manifest's (sync::SpecBefore) on valid manifests, and equal
// places are sync::SamePlace.
#ifndef REFIT_DAEMON_SERVING_TENSOR_PLACE_H_
#define REFIT_DAEMON_SERVING_TENSOR_PLACE_H_

#include <algorithm>
#include <compare>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/sync/tensor_part.h"
#include "refit/v1/common.pb.h"

namespace refit::publisher {

struct TensorPlace {
  std::string name;
  bool part = false;
  uint32_t dim = 0;
  uint64_t first_row = 0;

  static TensorPlace Of(const v1::TensorSpec& spec) {
    return {spec.name(), sync::IsPart(spec), spec.part().dim(), spec.part().first_row()};
  }
  auto operator<=>(const TensorPlace&) const = default;
  bool operator==(const TensorPlace&) const = default;
};

// The element of `v` (sorted by sync::SpecBefore on `spec_of(element)`) at `spec`'s place;
// null when none.
template <typename T, typename SpecOf>
const T* FindAtPlace(const std::vector<T>& v, const v1::TensorSpec& spec, SpecOf spec_of) {
  auto it = std::lower_bound(v.begin(), v.end(), spec, [&](const T& e, const v1::TensorSpec& s) {
    return sync::SpecBefore(spec_of(e), s);
  });
  return it != v.end() && sync::SamePlace(spec_of(*it), spec) ? &*it : nullptr;
}

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_TENSOR_PLACE_H_
