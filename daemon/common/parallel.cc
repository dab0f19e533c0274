#include "daemon/common/parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace refit {

int ResolveThreads(int requested) {
  if (requested > 0) return requested;
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
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
  std::vector<std::thread> workers;
  workers.reserve(parts - 1);
  size_t base = n / parts, extra = n % parts;
  size_t begin = 0;
  size_t first_end = base + (extra > 0 ? 1 : 0);
  begin = first_end;
  for (size_t p = 1; p < parts; ++p) {
    size_t len = base + (p < extra ? 1 : 0);
    size_t b = begin, e = begin + len;
    workers.emplace_back([&fn, b, e] { fn(b, e); });
    begin = e;
  }
  fn(0, first_end);
  for (auto& w : workers) w.join();
}

}  // namespace refit
