// The listener of a PublisherCore's live versions (streamed transfers; the DataPlaneService): told
// when a live version opens and whenever one changes. Its own class so that a listener can be
// set, replaced or removed while the core publishes.
#ifndef REFIT_DAEMON_SERVING_LIVE_LISTENER_H_
#define REFIT_DAEMON_SERVING_LIVE_LISTENER_H_

#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/serving/live_version.h"

namespace refit::publisher {

// Thread-safe. The functions run under the listener's lock, so that once Set returns the
// previous functions are no longer running and never run again (a listener that goes away
// removes itself with Set(nullptr, nullptr)). The core calls it without holding its own locks.
class LiveListener {
 public:
  using OnOpen = std::function<void(std::shared_ptr<const LiveVersion>)>;
  using OnChange = std::function<void()>;

  // Replaces the functions; null ones: no live versions are announced (or changes reported).
  void Set(OnOpen on_open, OnChange on_change);
  // Whether an open function is set (a publish only opens a live version for a listener).
  bool listening() const;
  // Announces `live`; false when no open function is set.
  bool Opened(std::shared_ptr<const LiveVersion> live);
  // A live version changed (a tensor ready, commit, failure).
  void Changed();

 private:
  mutable absl::Mutex mu_;
  OnOpen on_open_ ABSL_GUARDED_BY(mu_);
  OnChange on_change_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_LIVE_LISTENER_H_
