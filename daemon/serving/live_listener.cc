// LiveListener: the functions a PublisherCore announces its live versions to.
#include "daemon/serving/live_listener.h"

#include <utility>

namespace refit::publisher {

void LiveListener::Set(OnOpen on_open, OnChange on_change) {
  absl::MutexLock lock(&mu_);
  on_open_ = std::move(on_open);
  on_change_ = std::move(on_change);
}

bool LiveListener::listening() const {
  absl::MutexLock lock(&mu_);
  return static_cast<bool>(on_open_);
}

bool LiveListener::Opened(std::shared_ptr<const LiveVersion> live) {
  absl::MutexLock lock(&mu_);
  if (!on_open_) return false;
  on_open_(std::move(live));
  return true;
}

void LiveListener::Changed() {
  absl::MutexLock lock(&mu_);
  if (on_change_) on_change_();
}

}  // namespace refit::publisher
