// A real Prometheus server (Debian's `prometheus` package) for the ops tests: scrapes the given
// metrics endpoints every second and answers instant queries through its HTTP API.
//
//   REFIT_ASSIGN_OR_RETURN(auto prom, PrometheusServer::Start(dir, {{"publisher", pub_metrics}}));
//   REFIT_RETURN_IF_ERROR(prom->WaitForValue("refitd_current_version{job=\"publisher\"}", 3, 20s));
#ifndef REFIT_TESTS_HARNESS_PROMETHEUS_H_
#define REFIT_TESTS_HARNESS_PROMETHEUS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/harness/process.h"

namespace refit::e2e {

inline constexpr char kPrometheusBin[] = "/usr/bin/prometheus";
inline constexpr char kPromtoolBin[] = "/usr/bin/promtool";

struct ScrapeTarget {
  std::string job;      // job label
  std::string address;  // "127.0.0.1:41234"
};

// One series of an instant query's result.
struct PromSample {
  std::map<std::string, std::string> labels;
  double value = 0;
};

class PrometheusServer {
 public:
  // Writes <dir>/prometheus.yml, starts the server on a free loopback port (another port when
  // the one picked was taken meanwhile), and waits until /-/ready answers 200.
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(
      const std::string& dir, const std::vector<ScrapeTarget>& targets,
      absl::Duration timeout = absl::Seconds(20));

  // GET /api/v1/query?query=<promql>: the result vector's samples.
  absl::StatusOr<std::vector<PromSample>> Query(const std::string& promql) const;
  // Polls Query until it returns one sample equal to `want` (the samples it saw otherwise).
  absl::Status WaitForValue(const std::string& promql, double want,
                            absl::Duration timeout = absl::Seconds(20)) const;

  const std::string& address() const { return address_; }
  std::string LogTail() const { return FileTail(process_->log_path()); }

 private:
  PrometheusServer(std::unique_ptr<ChildProcess> process, std::string address)
      : process_(std::move(process)), address_(std::move(address)) {}
  std::unique_ptr<ChildProcess> process_;
  std::string address_;
};

// "a b" -> "a%20b" (query string of a URL).
std::string UrlEncode(const std::string& s);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_PROMETHEUS_H_
