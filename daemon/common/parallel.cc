#include "daemon/common/parallel.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/thread_priority.h"

namespace refit {
namespace {

// One ParallelFor call: its parts are claimed by index, by the caller and by pool workers alike,
// so the call finishes even when no worker is free (or when its parts call ParallelFor
// themselves). Shared with the workers that took it from the queue, which may still touch it
// after its last part ran.
struct Batch {
  const std::function<void(size_t, size_t)>* fn = nullptr;
  size_t parts = 0, base = 0, extra = 0;
  std::atomic<size_t> next{1};  // part 0 is the caller's
  std::atomic<size_t> unfinished{0};
  absl::Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;

  void RunPart(size_t p) {
    const size_t b = p * base + std::min(p, extra);
    (*fn)(b, b + base + (p < extra ? 1 : 0));
    if (unfinished.fetch_sub(1) == 1) {
      absl::MutexLock lock(&mu);
      finished = true;
    }
  }
  // Runs parts until none is left to claim.
  void Drain() {
    for (size_t p = next.fetch_add(1); p < parts; p = next.fetch_add(1)) RunPart(p);
  }
  bool Finished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return finished; }
};

// Process-wide workers, started on demand and kept for the next call (a thread per call cost a
// clone, a wake-up and a join per tensor applied). One pool per nice value of the callers: a
// worker is started by a caller and inherits its nice value (threads keep their own, sched(7)),
// so the parts of a background thread's call never run above its priority and the data path's
// never below theirs. Never destroyed: workers outlive static destruction harmlessly, blocked
// on the queue.
class Pool {
 public:
  // The pool of the calling thread's nice value.
  static Pool& ForThisThread() {
    static constexpr int kNices = 40;  // -20 .. 19
    static std::array<std::atomic<Pool*>, kNices> pools{};
    const int nice = ThisThreadNice().value_or(0);
    const int index = std::clamp(nice, -20, kMaxNice) + 20;
    std::atomic<Pool*>& slot = pools[static_cast<size_t>(index)];
    Pool* pool = slot.load(std::memory_order_acquire);
    if (pool != nullptr) return *pool;
    Pool* fresh = new Pool;
    if (slot.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another caller of this nice value made it first
    return *pool;
  }

  // Offers `batch` to `helpers` workers, starting workers while fewer than that are idle (up to
  // kMaxWorkers).
  void Offer(const std::shared_ptr<Batch>& batch, size_t helpers) {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < helpers; ++i) queue_.push_back(batch);
    while (idle_ < queue_.size() && workers_ < kMaxWorkers) {
      ++workers_;
      ++idle_;
      std::thread([this] { Work(); }).detach();
    }
    for (size_t i = 0; i < helpers; ++i) cv_.Signal();
  }

 private:
  static constexpr size_t kMaxWorkers = 256;

  void Work() {
    for (;;) {
      std::shared_ptr<Batch> batch;
      {
        absl::MutexLock lock(&mu_);
        while (queue_.empty()) cv_.Wait(&mu_);
        batch = std::move(queue_.front());
        queue_.pop_front();
        --idle_;
      }
      batch->Drain();
      batch.reset();
      absl::MutexLock lock(&mu_);
      ++idle_;
    }
  }

  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::shared_ptr<Batch>> queue_ ABSL_GUARDED_BY(mu_);
  size_t workers_ ABSL_GUARDED_BY(mu_) = 0;
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

int ResolveThreads(int requested) {
  if (requested > 0) return requested;
  // glibc reads sysfs for every hardware_concurrency() call: read once, as the thread pools are
  // sized once.
  static const int kHardware = [] {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }();
  return kHardware;
}

void ParallelFor(size_t n, int threads, size_t min_chunk,
                 const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (min_chunk == 0) min_chunk = 1;
  size_t max_parts = (n + min_chunk - 1) / min_chunk;
  size_t parts = std::min<size_t>(static_cast<size_t>(ResolveThreads(threads)), max_parts);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->fn = &fn;
  batch->parts = parts;
  batch->base = n / parts;
  batch->extra = n % parts;
  batch->unfinished.store(parts);
  Pool::ForThisThread().Offer(batch, parts - 1);
  batch->RunPart(0);
  batch->Drain();
  absl::MutexLock lock(&batch->mu);
  batch->mu.Await(absl::Condition(batch.get(), &Batch::Finished));
}

}  // namespace refit
