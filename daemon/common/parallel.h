// Fork-join over a process-wide pool of worker threads: run fn(begin, end) over [0, n) split
// across up to `threads` threads.
#ifndef REFIT_DAEMON_COMMON_PARALLEL_H_
#define REFIT_DAEMON_COMMON_PARALLEL_H_

#include <cstddef>
#include <functional>

namespace refit {

// Number of worker threads to use when a caller asks for `requested` (0 = one per hardware
// thread). Always >= 1.
int ResolveThreads(int requested);

// Splits [0, n) into at most `threads` contiguous ranges of at least `min_chunk` items and runs
// fn(begin, end) for each, the first on the calling thread. Returns when all have finished.
// Workers are started on first need and kept (at most 256); the calling thread also runs parts
// no worker has taken yet, so the call completes whether or not a worker is free, and fn may
// call ParallelFor itself. Parts must not wait for each other.
void ParallelFor(size_t n, int threads, size_t min_chunk,
                 const std::function<void(size_t begin, size_t end)>& fn);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_PARALLEL_H_
