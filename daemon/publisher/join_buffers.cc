#include "daemon/publisher/join_buffers.h"

#include <utility>

namespace refit::publisher {

std::shared_ptr<uint8_t> JoinBufferPool::Take(size_t bytes) {
  std::unique_ptr<uint8_t[]> buffer;
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      buffer = std::move(it->second);
      free_.erase(it);
      free_bytes_ -= bytes;
    }
  }
  if (buffer == nullptr) buffer.reset(new uint8_t[bytes == 0 ? 1 : bytes]);
  std::weak_ptr<JoinBufferPool> pool = weak_from_this();
  return std::shared_ptr<uint8_t>(buffer.release(), [pool, bytes](uint8_t* p) {
    if (std::shared_ptr<JoinBufferPool> alive = pool.lock()) {
      alive->Give(p, bytes);
    } else {
      delete[] p;
    }
  });
}

void JoinBufferPool::Give(uint8_t* buffer, size_t bytes) {
  std::unique_ptr<uint8_t[]> owned(buffer);
  absl::MutexLock lock(&mu_);
  if (free_bytes_ + bytes > max_free_bytes_) return;  // freed
  free_.emplace(bytes, std::move(owned));
  free_bytes_ += bytes;
}

void JoinBufferPool::set_max_free_bytes(size_t bytes) {
  absl::MutexLock lock(&mu_);
  max_free_bytes_ = bytes;
  while (free_bytes_ > max_free_bytes_ && !free_.empty()) {
    auto largest = std::prev(free_.end());
    free_bytes_ -= largest->first;
    free_.erase(largest);
  }
}

size_t JoinBufferPool::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return free_bytes_;
}

}  // namespace refit::publisher
