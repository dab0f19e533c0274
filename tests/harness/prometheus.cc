#include "tests/harness/prometheus.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/metrics/http_get.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace refit::e2e {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// A loopback port free right now (bound to port 0, then closed).
absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  if (!ok) return absl::InternalError("cannot bind a loopback port");
  return ntohs(a.sin_port);
}

absl::Status WriteConfig(const std::string& path, const std::vector<ScrapeTarget>& targets) {
  std::string yaml =
      "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n";
  for (const ScrapeTarget& t : targets) {
    absl::StrAppend(&yaml, "  - job_name: ", t.job, "\n    static_configs:\n      - targets: [\"",
                    t.address, "\"]\n");
  }
  std::ofstream out(path);
  out << yaml;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Waits until the server answers /-/ready with 200: false if it exited first (port taken).
absl::StatusOr<bool> AwaitReady(ChildProcess& p, const std::string& address,
                                absl::Time deadline) {
  while (absl::Now() < deadline) {
    if (!p.running()) return false;
    absl::StatusOr<metrics::HttpResponse> r =
        metrics::HttpGet(address, "/-/ready", absl::Seconds(2));
    if (r.ok() && r->status == 200) return true;
    absl::SleepFor(absl::Milliseconds(50));  // polling interval, bounded by the deadline
  }
  return absl::DeadlineExceededError(absl::StrCat("prometheus on ", address, " not ready"));
}

std::string Describe(const std::vector<PromSample>& samples) {
  std::vector<std::string> parts;
  for (const PromSample& s : samples) {
    std::vector<std::string> labels;
    for (const auto& [k, v] : s.labels) labels.push_back(absl::StrCat(k, "=\"", v, "\""));
    parts.push_back(absl::StrCat("{", absl::StrJoin(labels, ","), "} ", s.value));
  }
  return parts.empty() ? "no samples" : absl::StrJoin(parts, "; ");
}

absl::StatusOr<PromSample> SampleOf(const Value& v) {
  const Struct& s = v.struct_value();
  PromSample out;
  if (auto m = s.fields().find("metric"); m != s.fields().end()) {
    for (const auto& [k, lv] : m->second.struct_value().fields()) {
      out.labels[k] = lv.string_value();
    }
  }
  auto value = s.fields().find("value");
  if (value == s.fields().end() || value->second.list_value().values_size() != 2 ||
      !absl::SimpleAtod(value->second.list_value().values(1).string_value(), &out.value)) {
    return absl::DataLossError("a result without [time, \"value\"]");
  }
  return out;
}

}  // namespace

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PrometheusServer>> PrometheusServer::Start(
    const std::string& dir, const std::vector<ScrapeTarget>& targets, absl::Duration timeout) {
  const std::string config = dir + "/prometheus.yml";
  if (absl::Status st = WriteConfig(config, targets); !st.ok()) return st;
  const absl::Time deadline = absl::Now() + timeout;
  for (int attempt = 1; attempt <= 5; ++attempt) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    if (!port.ok()) return port.status();
    const std::string address = absl::StrCat("127.0.0.1:", *port);
    absl::StatusOr<std::unique_ptr<ChildProcess>> p = ChildProcess::Start(
        {kPrometheusBin, "--config.file=" + config,
         absl::StrCat("--storage.tsdb.path=", dir, "/prometheus-data-", attempt),
         "--web.listen-address=" + address, "--log.level=warn"},
        dir + "/prometheus.log");
    if (!p.ok()) return p.status();
    absl::StatusOr<bool> ready = AwaitReady(**p, address, deadline);
    if (!ready.ok()) {
      return absl::Status(ready.status().code(),
                          absl::StrCat(ready.status().message(), ":\n",
                                       FileTail(dir + "/prometheus.log")));
    }
    if (*ready) {
      return std::unique_ptr<PrometheusServer>(new PrometheusServer(std::move(*p), address));
    }
  }
  return absl::UnavailableError(absl::StrCat("prometheus exited at start 5 times:\n",
                                             FileTail(dir + "/prometheus.log")));
}

absl::StatusOr<std::vector<PromSample>> PrometheusServer::Query(const std::string& promql) const {
  absl::StatusOr<metrics::HttpResponse> r = metrics::HttpGet(
      address_, "/api/v1/query?query=" + UrlEncode(promql), absl::Seconds(5));
  if (!r.ok()) return r.status();
  Struct body;
  if (auto st = google::protobuf::util::JsonStringToMessage(r->body, &body); !st.ok()) {
    return absl::DataLossError(absl::StrCat("query ", promql, ": not JSON: ", r->body));
  }
  const auto status = body.fields().find("status");
  if (r->status != 200 || status == body.fields().end() ||
      status->second.string_value() != "success") {
    return absl::InvalidArgumentError(absl::StrCat("query ", promql, ": HTTP ", r->status, ": ",
                                                   r->body));
  }
  std::vector<PromSample> out;
  const auto data = body.fields().find("data");
  if (data == body.fields().end()) {
    return absl::DataLossError(absl::StrCat("query ", promql, ": no data: ", r->body));
  }
  const auto result = data->second.struct_value().fields().find("result");
  if (result == data->second.struct_value().fields().end()) {
    return absl::DataLossError(absl::StrCat("query ", promql, ": no result: ", r->body));
  }
  for (const Value& v : result->second.list_value().values()) {
    absl::StatusOr<PromSample> s = SampleOf(v);
    if (!s.ok()) return s.status();
    out.push_back(std::move(*s));
  }
  return out;
}

absl::Status PrometheusServer::WaitForValue(const std::string& promql, double want,
                                            absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer";
  while (absl::Now() < deadline) {
    absl::StatusOr<std::vector<PromSample>> samples = Query(promql);
    if (samples.ok() && samples->size() == 1 && (*samples)[0].value == want) {
      return absl::OkStatus();
    }
    last = samples.ok() ? Describe(*samples) : samples.status().ToString();
    absl::SleepFor(absl::Milliseconds(100));  // polling interval, bounded by the deadline
  }
  return absl::DeadlineExceededError(absl::StrCat("prometheus: ", promql, " never became ",
                                                  want, " within ", absl::FormatDuration(timeout),
                                                  "; last: ", last));
}

}  // namespace refit::e2e
