// Operations: the daemons' Prometheus metrics, read by a real Prometheus server (Debian's
// `prometheus` package) and cross-checked against `refitctl status --json`; the exposition of
// both daemons passes `promtool check metrics`, fetched by `refitctl metrics`.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "daemon/common/status_matchers.h"
#include "daemon/metrics/http_get.h"
#include "daemon/model/trajectory.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"
#include "tests/harness/prometheus.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

constexpr char kMetrics[] = "  metrics: {listen: \"127.0.0.1:0\"}\n";
constexpr uint64_t kVersions = 3;

// The refitd_* metric names an alert rule file or dashboard uses (histogram suffixes dropped).
std::set<std::string> NamesUsedIn(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  std::set<std::string> names;
  for (size_t i = s.find("refitd_"); i != std::string::npos; i = s.find("refitd_", i)) {
    size_t end = i;
    while (end < s.size() && (absl::ascii_islower(s[end]) || s[end] == '_')) ++end;
    std::string name = s.substr(i, end - i);
    for (const char* suffix : {"_bucket", "_count", "_sum"}) {
      if (absl::EndsWith(name, suffix) && absl::StrContains(name, "_seconds")) {
        name.resize(name.size() - strlen(suffix));
      }
    }
    names.insert(name);
    i = end;
  }
  return names;
}

// The dashboard's PromQL expressions with $instance as ".*".
absl::StatusOr<std::vector<std::string>> DashboardQueries(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::Struct dash;
  if (auto st = google::protobuf::util::JsonStringToMessage(text.str(), &dash); !st.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", st.ToString()));
  }
  std::vector<std::string> out;
  for (const auto& panel : dash.fields().at("panels").list_value().values()) {
    for (const auto& t : panel.struct_value().fields().at("targets").list_value().values()) {
      out.push_back(absl::StrReplaceAll(t.struct_value().fields().at("expr").string_value(),
                                        {{"$instance", ".*"}}));
    }
  }
  return out;
}

bool Exists(const char* path) {
  struct stat st;
  return stat(path, &st) == 0;
}

// `refitctl status --json` of a daemon, parsed.
absl::StatusOr<v1::StatusResponse> CtlStatus(const DaemonProcess& d) {
  const CommandResult r = RunRefitctl({"--target", d.control_target(), "status", "--json"});
  if (r.exit_code != 0) return absl::InternalError(r.Describe());
  v1::StatusResponse s;
  if (auto st = google::protobuf::util::JsonStringToMessage(r.out, &s); !st.ok()) {
    return absl::DataLossError(absl::StrCat("status --json: ", st.ToString(), ": ", r.out));
  }
  return s;
}

class E2EMetricsTest : public E2ETest {
 protected:
  // A publisher and a subscriber with metrics endpoints, kVersions published and applied.
  void StartAndPublish() {
    PublisherSpec ps;
    ps.extra = kMetrics;
    SubscriberSpec ss;
    ss.extra = kMetrics;
    ss.name = "sub";
    pub_ = &NewPublisher(ps);
    E2E_ASSERT_OK(pub_->Start());
    ss.upstream = {pub_->listen_target()};
    sub_ = &NewSubscriber(ss);
    E2E_ASSERT_OK(sub_->Start());
    ASSERT_FALSE(pub_->ready().metrics.empty()) << "no \"metrics\" in the publisher's ready file";
    ASSERT_FALSE(sub_->ready().metrics.empty()) << "no \"metrics\" in the subscriber's ready file";
    REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(13));
    for (uint64_t v = 1; v <= kVersions; ++v) {
      if (v > 1) (traj)->Step();
      E2E_ASSERT_OK(Publish(*pub_, ModelFromTrajectory(*traj), v));
      E2E_ASSERT_OK(WaitVersion(*pub_, v, absl::Seconds(60), /*all_subscribers=*/true));
    }
    E2E_ASSERT_OK(StatusAfterRefit(sub_->control_target(), kVersions));
  }

  DaemonProcess* pub_ = nullptr;
  DaemonProcess* sub_ = nullptr;
};

TEST_F(E2EMetricsTest, PrometheusScrapesBothDaemonsAndAgreesWithStatus) {
  if (!Exists(kPrometheusBin)) GTEST_SKIP() << kPrometheusBin << " is not installed";
  ASSERT_NO_FATAL_FAILURE(StartAndPublish());
  absl::StatusOr<std::unique_ptr<PrometheusServer>> prom = PrometheusServer::Start(
      dir(), {{"publisher", pub_->ready().metrics}, {"subscriber", sub_->ready().metrics}});
  ASSERT_THAT(prom, IsOk());

  // Status is settled once every version is acked: each figure Prometheus reports must become
  // Status's (the scrape after the last change).
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse ps, CtlStatus(*pub_));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse ss, CtlStatus(*sub_));
  ASSERT_EQ(ps.version(), kVersions);
  ASSERT_EQ(ss.version(), kVersions);
  ASSERT_EQ(ps.sessions_size(), 1);
  EXPECT_EQ(ps.metrics_address(), pub_->ready().metrics);
  EXPECT_EQ(ss.metrics_address(), sub_->ready().metrics);
  const PrometheusServer& p = **prom;
  const auto d = [](uint64_t v) { return static_cast<double>(v); };
  const std::pair<std::string, double> checks[] = {
      {"refitd_current_version{job=\"publisher\"}", d(ps.version())},
      {"refitd_current_version{job=\"subscriber\"}", d(ss.version())},
      {"refitd_publisher_versions_published_total", d(kVersions)},
      {"refitd_model_bytes{job=\"publisher\"}", d(ps.model_bytes())},
      {"refitd_model_bytes{job=\"subscriber\"}", d(ss.model_bytes())},
      {"refitd_data_plane_sent_bytes_total{job=\"publisher\"}", d(ps.bytes_sent())},
      {"refitd_data_plane_received_bytes_total{job=\"subscriber\"}", d(ss.bytes_received())},
      {"refitd_session_acked_version{job=\"publisher\",session=\"sub\"}",
       d(ps.sessions(0).acked_version())},
      {"refitd_session_sent_bytes{job=\"publisher\",session=\"sub\"}",
       d(ps.sessions(0).bytes_sent())},
      {"refitd_session_lag_versions{job=\"publisher\",session=\"sub\"}", 0},
      {"refitd_sessions{job=\"publisher\",state=\"idle\"}", 1},
      {"refitd_last_refit_wire_bytes{job=\"subscriber\"}", d(ss.last_refit().wire_bytes())},
      {"refitd_last_refit_version{job=\"subscriber\"}", d(ss.last_refit().version())},
      {"sum(refitd_transfers_applied_total{job=\"subscriber\"})", d(kVersions)},
      {"sum(refitd_transfers_applied_total{job=\"publisher\"})", d(kVersions)},
      {"refitd_transfer_duration_seconds_count{job=\"subscriber\"}", d(kVersions)},
      {"refitd_publisher_refit_duration_seconds_count", d(kVersions)},
      {"refitd_transfers_rejected_total{job=\"subscriber\"}", 0},
      {"refitd_subscriber_upstream_state{state=\"idle\"}", 1},
      {absl::StrCat("refitd_build_info{job=\"subscriber\",role=\"subscriber\",version=\"",
                    ss.build_version(), "\"}"),
       1},
  };
  for (const auto& [query, want] : checks) {
    E2E_EXPECT_OK(p.WaitForValue(query, want));
  }
  // Both targets are up (the scrapes themselves succeeded).
  E2E_EXPECT_OK(p.WaitForValue("sum(up)", 2));

  // Every query of the shipped dashboard is valid PromQL over these series.
  absl::StatusOr<std::vector<std::string>> queries =
      DashboardQueries(REFIT_SOURCE_DIR "/deploy/grafana/refitd-dashboard.json");
  ASSERT_THAT(queries, IsOk());
  EXPECT_GE(queries->size(), 10u);
  for (const std::string& q : *queries) E2E_EXPECT_OK(p.Query(q));
}

TEST_F(E2EMetricsTest, RefitctlMetricsPassesPromtoolCheck) {
  if (!Exists(kPromtoolBin)) GTEST_SKIP() << kPromtoolBin << " is not installed";
  ASSERT_NO_FATAL_FAILURE(StartAndPublish());
  std::string exported;
  for (DaemonProcess* d : {pub_, sub_}) {
    // The publisher's endpoint as its Status names it, the subscriber's given by --address.
    std::vector<std::string> args = {"--target", d->control_target(), "metrics"};
    if (d == sub_) args.insert(args.end(), {"--address", d->ready().metrics});
    const CommandResult r = RunRefitctl(args);
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.out, "\nrefitd_current_version 3\n")) << r.out;
    // The same endpoint as the ready file names.
    absl::StatusOr<metrics::HttpResponse> direct =
        metrics::HttpGet(d->ready().metrics, "/metrics", absl::Seconds(10));
    ASSERT_THAT(direct, IsOk());
    EXPECT_TRUE(absl::StrContains(direct->body, "refitd_build_info{")) << direct->body;
    const std::string file = Path(d->name() + ".prom");
    std::ofstream(file) << r.out;
    const CommandResult check =
        RunCommand({"/bin/sh", "-c", absl::StrCat(kPromtoolBin, " check metrics < ", file)});
    EXPECT_EQ(check.exit_code, 0) << d->name() << ": " << check.Describe();
    std::printf("[e2e] %s: %zu bytes of metrics pass promtool check metrics\n",
                d->name().c_str(), r.out.size());
    exported += r.out;
  }
  // The alert rules and the dashboard use metrics the daemons export.
  for (const char* file : {"/deploy/prometheus/refitd-alerts.yml",
                           "/deploy/grafana/refitd-dashboard.json"}) {
    const std::set<std::string> used = NamesUsedIn(std::string(REFIT_SOURCE_DIR) + file);
    EXPECT_GE(used.size(), 5u) << file;
    for (const std::string& name : used) {
      EXPECT_TRUE(absl::StrContains(exported, absl::StrCat("# TYPE ", name, " ")))
          << file << " uses " << name << ", which neither daemon exports";
    }
  }
}

TEST_F(E2EMetricsTest, RefitctlMetricsWithoutAnEndpointSaysSo) {
  REFIT_ASSERT_OK_AND_ASSIGN(PubSub ps, StartPubSub("sub"));
  const CommandResult r = RunRefitctl({"--target", ps.pub->control_target(), "metrics"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "metrics.listen is empty")) << r.Describe();
}

}  // namespace
}  // namespace refit::e2e
