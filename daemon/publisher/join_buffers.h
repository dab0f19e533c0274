// JoinBufferPool: the whole-tensor buffers the TrainerApi copies a round's blocks into (each
// client's blocks straight into their place: one copy, no per-block snapshot), recycled across
// versions so that a sharded trainer's publishes do not fault fresh memory in every time.
#ifndef REFIT_DAEMON_PUBLISHER_JOIN_BUFFERS_H_
#define REFIT_DAEMON_PUBLISHER_JOIN_BUFFERS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace refit::publisher {

class JoinBufferPool : public std::enable_shared_from_this<JoinBufferPool> {
 public:
  // Make with std::make_shared: buffers return to the pool through a weak reference (a buffer
  // released after the pool is gone is freed).
  JoinBufferPool() = default;

  // A buffer of `bytes` bytes (contents undefined): a free one of that size if the pool has one,
  // else a new allocation. It comes back to the pool when its last reference is dropped, while
  // the pool then holds at most max_free_bytes(); beyond that it is freed.
  std::shared_ptr<uint8_t> Take(size_t bytes);

  // The most bytes of free buffers kept (the TrainerApi sets it to the bytes of its sliced
  // tensors: one round's worth).
  void set_max_free_bytes(size_t bytes);
  size_t free_bytes() const;

 private:
  void Give(uint8_t* buffer, size_t bytes);

  mutable absl::Mutex mu_;
  std::multimap<size_t, std::unique_ptr<uint8_t[]>> free_ ABSL_GUARDED_BY(mu_);
  size_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_JOIN_BUFFERS_H_
