// Small helpers shared by the .cc files that implement PublisherCore (clock, tensor lookup by
// name, hex digests); not part of the core's interface.
#ifndef REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_
#define REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/durations.h"
#include "daemon/common/hex.h"
#include "daemon/common/unix_time.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

using Clock = std::chrono::steady_clock;

inline const BaselineTensor* FindByName(const std::vector<BaselineTensor>& v,
                                        const std::string& name) {
  auto it = std::lower_bound(
      v.begin(), v.end(), name,
      [](const BaselineTensor& t, const std::string& n) { return t.spec.name() < n; });
  return it != v.end() && it->spec.name() == name ? &*it : nullptr;
}

inline uint64_t ElementsOf(const v1::TensorSpec& spec) {
  auto n = sync::ElementCount(spec);
  return n.ok() ? *n : 0;
}

inline bool SameSpecAs(const BaselineTensor* p, const v1::TensorSpec& spec) {
  return p != nullptr && sync::SameSpec(p->spec, spec);
}

// The references to a baseline buffer when only the core's baseline and Encoded::Pending hold it.
constexpr long kSoleBaselineOwners = 2;

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_
