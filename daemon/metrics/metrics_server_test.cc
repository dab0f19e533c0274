#include "daemon/metrics/metrics_server.h"

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "daemon/common/status_matchers.h"
#include "daemon/metrics/http_get.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace refit::metrics {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::StartsWith;

TEST(MetricsServerTest, ServesRegisteredMetricsOnAnOsChosenPort) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("publisher.metrics.listen", "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  const std::string addr = (*server)->bound_address();
  ASSERT_TRUE(absl::StartsWith(addr, "127.0.0.1:")) << addr;
  EXPECT_NE(addr, "127.0.0.1:0");

  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("refitd_test_total").Help("A test counter.").Register(*registry)
      .Add({{"k", "v"}})
      .Increment(3);
  (*server)->Register(registry);

  REFIT_ASSERT_OK_AND_ASSIGN(HttpResponse r, HttpGet(addr, "/metrics", absl::Seconds(10)));
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(absl::StartsWith(r.content_type, "text/plain")) << r.content_type;
  EXPECT_TRUE(absl::StrContains(r.body, "refitd_test_total{k=\"v\"} 3")) << r.body;

  REFIT_ASSERT_OK_AND_ASSIGN(HttpResponse other, HttpGet(addr, "/nothing", absl::Seconds(10)));
  EXPECT_EQ(other.status, 404);
}

TEST(MetricsServerTest, LocalhostBindsTheLoopbackAddress) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("publisher.metrics.listen", "localhost:0");
  ASSERT_THAT(server, IsOk());
  EXPECT_TRUE(absl::StartsWith((*server)->bound_address(), "127.0.0.1:"))
      << (*server)->bound_address();
}

TEST(MetricsServerTest, AnAddressInUseIsAnErrorNamingTheField) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("subscriber.metrics.listen", "127.0.0.1:0");
  ASSERT_THAT(first, IsOk());
  const std::string taken = (*first)->bound_address();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start("subscriber.metrics.listen", taken);
  ASSERT_THAT(second,
              StatusIs(absl::StatusCode::kUnavailable,
                       StartsWith("subscriber.metrics.listen \"" + taken + "\": cannot serve")));

  absl::StatusOr<std::unique_ptr<MetricsServer>> bad =
      MetricsServer::Start("publisher.metrics.listen", "unix:/tmp/x.sock");
  ASSERT_THAT(bad, StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(HttpGetTest, ErrorsNameTheUrl) {
  // A port nobody listens on: bind one, close it.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string addr = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  close(fd);
  absl::StatusOr<HttpResponse> r = HttpGet(addr, "/metrics", absl::Seconds(5));
  ASSERT_THAT(
      r, StatusIs(absl::StatusCode::kUnavailable, StartsWith("GET http://" + addr + "/metrics: ")));
  EXPECT_EQ(HttpGet("example.com:80", "/", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::metrics
