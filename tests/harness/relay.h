// A throttling TCP relay for end-to-end tests: listens on 127.0.0.1:0 and forwards every
// connection to an upstream TCP address, each direction of each connection limited to a byte
// rate. It stands in for a slow (e.g. cross-region) link, so a test can observe and interrupt a
// transfer in the middle (netem does not exist on the test machines).
#ifndef REFIT_TESTS_HARNESS_RELAY_H_
#define REFIT_TESTS_HARNESS_RELAY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace refit::e2e {

class ThrottledRelay {
 public:
  // `upstream` is "host:port" (IPv4 literal or "localhost"); bytes_per_second > 0.
  static absl::StatusOr<std::unique_ptr<ThrottledRelay>> Start(const std::string& upstream,
                                                               uint64_t bytes_per_second);
  ~ThrottledRelay();  // closes every connection and joins the threads
  ThrottledRelay(const ThrottledRelay&) = delete;
  ThrottledRelay& operator=(const ThrottledRelay&) = delete;

  // "127.0.0.1:<port>": what the client connects to.
  std::string target() const;
  // Bytes forwarded from upstream to clients so far.
  uint64_t downstream_bytes() const { return downstream_bytes_.load(); }

 private:
  ThrottledRelay() = default;
  void AcceptLoop();
  void Pump(int from, int to, bool downstream);

  int listen_fd_ = -1;
  int stop_pipe_[2] = {-1, -1};  // written on destruction: wakes every poll
  uint16_t port_ = 0;
  std::string upstream_host_;
  uint16_t upstream_port_ = 0;
  uint64_t rate_ = 0;
  std::atomic<uint64_t> downstream_bytes_{0};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_RELAY_H_
