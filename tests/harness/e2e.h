// gtest fixture and helpers of the end-to-end tests: a per-test directory, daemons started from
// generated configs, refitctl wrappers (publish, wait, export, verify), gRPC Control helpers.
// On failure TearDown prints every daemon's log tail and keeps the directory.
#ifndef REFIT_TESTS_HARNESS_E2E_H_
#define REFIT_TESTS_HARNESS_E2E_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/control.pb.h"
#include "tests/harness/configs.h"
#include "tests/harness/model.h"
#include "tests/harness/process.h"

namespace refit::e2e {

inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

#define E2E_ASSERT_OK(expr)                                                       \
  do {                                                                            \
    const absl::Status e2e_status_ = ::refit::e2e::StatusOf(expr);                \
    ASSERT_TRUE(e2e_status_.ok()) << #expr << " failed: " << e2e_status_;         \
  } while (0)
#define E2E_EXPECT_OK(expr)                                                       \
  do {                                                                            \
    const absl::Status e2e_status_ = ::refit::e2e::StatusOf(expr);                \
    EXPECT_TRUE(e2e_status_.ok()) << #expr << " failed: " << e2e_status_;         \
  } while (0)

// Plaintext channel with large message limits ("127.0.0.1:1234", "unix:/path").
std::shared_ptr<grpc::Channel> PlainChannel(const std::string& target);

// Control RPCs (plaintext) with a deadline.
absl::StatusOr<v1::StatusResponse> RpcStatus(const std::string& target,
                                             absl::Duration timeout = absl::Seconds(10));
absl::StatusOr<v1::WaitVersionResponse> RpcWaitVersion(const std::string& target, uint64_t version,
                                                       absl::Duration timeout,
                                                       bool all_subscribers = false);
absl::StatusOr<v1::VerifyResponse> RpcVerify(const std::string& target,
                                             absl::Duration timeout = absl::Seconds(30));

// Polls Status (every ~10 ms, no other signal exists for session states) until `pred` holds;
// DeadlineExceeded with the last status otherwise.
absl::StatusOr<v1::StatusResponse> PollStatus(
    const std::string& target, const std::function<bool(const v1::StatusResponse&)>& pred,
    absl::Duration timeout, const std::string& what);

// Status once it reports `version` applied and its last_refit is that version's (the refit
// figures are recorded just after the version is announced, so poll briefly).
absl::StatusOr<v1::StatusResponse> StatusAfterRefit(const std::string& target, uint64_t version,
                                                    absl::Duration timeout = absl::Seconds(20));

// One line of figures of a refit for logs: "v7<-v6 wire 12345 B dense 2.6 MB (0.47%) ...".
std::string DescribeRefit(const v1::RefitStats& r);

class E2ETest : public ::testing::Test {
 public:
  E2ETest();
  ~E2ETest() override;

 protected:
  void SetUp() override;
  void TearDown() override;

  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Creates a daemon (config written, not started).
  DaemonProcess& NewPublisher(const PublisherSpec& spec);
  DaemonProcess& NewSubscriber(const SubscriberSpec& spec);
  // A publisher (from `publisher`) and a subscriber named `subscriber` following it, both started.
  struct PubSub {
    DaemonProcess* pub;
    DaemonProcess* sub;
  };
  absl::StatusOr<PubSub> StartPubSub(const std::string& subscriber,
                                     const PublisherSpec& publisher = PublisherSpec());
  // Rewrites a daemon's config from a changed spec (before a restart).
  void Reconfigure(DaemonProcess& d, const PublisherSpec& spec);
  void Reconfigure(DaemonProcess& d, const SubscriberSpec& spec);

  // Writes `model` to <dir>/<stem>.safetensors; returns the path.
  absl::StatusOr<std::string> WriteModelFile(const Model& model, const std::string& stem);
  // refitctl publish of `model` (written to <dir>/<pub>-v<version>.safetensors) as `version`.
  absl::Status Publish(const DaemonProcess& pub, const Model& model, uint64_t version);
  // refitctl wait --version V --timeout S.
  absl::Status WaitVersion(const DaemonProcess& d, uint64_t version,
                           absl::Duration timeout = absl::Seconds(60), bool all_subscribers = false);
  // refitctl export (to <dir>/<d>-export-<n>.safetensors) and the model it wrote.
  absl::StatusOr<Model> Export(const DaemonProcess& d, std::optional<uint64_t> version = std::nullopt);
  // Export and compare with `expected`: error naming the daemon and the differences.
  absl::Status ExpectExportEquals(const DaemonProcess& d, const Model& expected,
                                  std::optional<uint64_t> version = std::nullopt);
  // refitctl verify exits 0 and Control Verify says ok.
  absl::Status ExpectVerified(const DaemonProcess& d);
  // `d` reaches version v, exports exactly `m` and verifies.
  absl::Status ExpectHolds(const DaemonProcess& d, const Model& m, uint64_t v);

 private:
  class Watchdog;
  std::string dir_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  int exports_ = 0;
  std::unique_ptr<Watchdog> watchdog_;
};

// A test that runs longer than this is aborted (after printing its daemons' log tails and
// killing them): every wait has its own deadline, so this only catches a harness bug.
inline constexpr absl::Duration kTestWatchdog = absl::Seconds(240);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_E2E_H_
