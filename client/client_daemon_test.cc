// refitctl and TrainerClient against a real in-process publisher daemon (127.0.0.1:0, a unix
// socket for the TrainerApi in a temporary directory): the trainer registers and publishes a
// version from its memfd; refitctl publishes the next from a safetensors file, waits, reports
// status (table and JSON), exports and verifies.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/refitctl.h"
#include "client/refitctl_testing.h"
#include "client/trainer_client.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/config/config.h"
#include "daemon/model/safetensors.h"
#include "daemon/publisher/publisher_daemon.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::client {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using Result = refit::testing::CtlResult;

class ClientDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string yaml = absl::StrCat(
        "publisher:\n  name: client-test\n  log_level: warn\n  listen: \"127.0.0.1:0\"\n"
        "  control_access: {unauthenticated_tcp_role: write}\n  local_socket: ",
        dir_.path(), "/trainer.sock\n  codec:\n    threads: 2\n",
        "  files:\n    publish_dirs: [\"", dir_.path(), "\"]\n    export_dir: \"", dir_.path(),
        "\"\n");
    absl::StatusOr<v1::PublisherConfig> cfg =
        config::LoadPublisherConfigFromString(yaml, "client_daemon_test.yaml");
    ASSERT_THAT(cfg, IsOk());
    absl::StatusOr<std::unique_ptr<publisher::PublisherDaemon>> d =
        publisher::PublisherDaemon::Start(*cfg);
    ASSERT_THAT(d, IsOk());
    daemon_ = std::move(*d);
    target_ = daemon_->control_address().empty() ? daemon_->listen_address()
                                                 : daemon_->control_address();
  }
  void TearDown() override {
    if (daemon_) daemon_->Shutdown();
    daemon_.reset();
  }

  Result Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), {"--target", target_, "--timeout", "60"});
    return refit::testing::RunCtl(args);
  }

  static std::vector<v1::TensorSpec> Specs() {
    std::vector<v1::TensorSpec> specs(3);
    specs[0].set_name("a.weight");
    specs[0].set_dtype(v1::DTYPE_BF16);
    specs[0].add_shape(64);
    specs[0].add_shape(33);
    specs[1].set_name("b.bias");
    specs[1].set_dtype(v1::DTYPE_F32);
    specs[1].add_shape(17);
    specs[2].set_name("c.scale");
    specs[2].set_dtype(v1::DTYPE_BF16);  // a scalar
    return specs;
  }

  refit::testing::TempDir dir_{"refit-client"};
  std::unique_ptr<publisher::PublisherDaemon> daemon_;
  std::string target_;
};

TEST_F(ClientDaemonTest, TrainerThenRefitctl) {
  // ---- the trainer publishes version 1 from its memfd ----
  absl::StatusOr<std::unique_ptr<TrainerClient>> trainer =
      TrainerClient::Create(daemon_->local_address(), "rank0", Specs());
  ASSERT_THAT(trainer, IsOk());
  TrainerClient& t = **trainer;
  ASSERT_EQ(t.num_tensors(), 3u);
  EXPECT_EQ(t.tensor(0).size(), 64u * 33 * 2);
  EXPECT_EQ(t.tensor(1).size(), 17u * 4);
  EXPECT_EQ(t.tensor(2).size(), 2u);
  for (size_t i = 0; i < t.num_tensors(); ++i) {
    std::span<uint8_t> bytes = t.tensor(i);
    EXPECT_EQ(bytes.data() - t.tensor(0).data(), static_cast<ptrdiff_t>(
                                                        t.RegisterRequest().tensors(i).shm().offset()));
    EXPECT_EQ(t.RegisterRequest().tensors(i).shm().offset() % 256, 0u);
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<uint8_t>(i * 31 + k * 7);
  }
  EXPECT_EQ(t.RegisterRequest().tensors(0).shm().path(), t.ProcPath());
  ASSERT_THAT(t.Find("b.bias"), IsOk());
  EXPECT_EQ(*t.Find("b.bias"), 1u);
  EXPECT_EQ(t.Find("nope").status().code(), absl::StatusCode::kNotFound);

  REFIT_ASSERT_OK_AND_ASSIGN(v1::RegisterTensorsResponse reg, t.Register());
  EXPECT_EQ(reg.tensors(), 3u);
  REFIT_ASSERT_OK_AND_ASSIGN(v1::LocalPublishResponse pub, t.Publish());
  EXPECT_EQ(pub.version(), 1u);
  EXPECT_TRUE(pub.committed());

  Result r = Ctl({"wait", "--version", "1", "--timeout", "30"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("version 1 digest 0x"));

  // ---- refitctl publishes version 2 from a safetensors file (relative path) ----
  std::vector<std::vector<uint8_t>> v2(3);
  std::vector<model::SafetensorsTensorRef> refs;
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kBF16};
  const std::vector<std::vector<int64_t>> shapes = {{64, 33}, {17}, {}};
  for (size_t i = 0; i < 3; ++i) {
    std::span<const uint8_t> cur = t.tensor(i);
    v2[i].assign(cur.begin(), cur.end());
    v2[i][i % v2[i].size()] ^= 1;  // one changed element per tensor
    refs.push_back({Specs()[i].name(), dtypes[i], shapes[i], v2[i]});
  }
  const std::string file = absl::StrCat(dir_.path(), "/v2.safetensors");
  ASSERT_THAT(model::WriteSafetensors(file, refs), IsOk());
  const std::string relative = std::filesystem::relative(file).string();
  ASSERT_FALSE(relative.empty());
  ASSERT_NE(relative[0], '/');
  r = Ctl({"publish", "--safetensors", relative});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("published version 2 digest 0x"));
  EXPECT_THAT(r.out, HasSubstr("3 tensors"));

  // A trainer version that does not exceed the newest is refused.
  absl::StatusOr<v1::LocalPublishResponse> stale = t.Publish(2);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(std::string(stale.status().message()), HasSubstr("rank0"));

  r = Ctl({"wait", "--version", "2"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string digest_line = r.out;
  r = Ctl({"wait", "--version", "9", "--timeout", "0.2"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, StartsWith("refitctl: wait: DEADLINE_EXCEEDED: "));

  // ---- status ----
  r = Ctl({"status"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("role:       publisher\n"));
  EXPECT_THAT(r.out, HasSubstr("name:       client-test\n"));
  EXPECT_THAT(r.out, HasSubstr("version:    2 (digest 0x"));
  EXPECT_THAT(r.out, HasSubstr("model:      3 tensors"));
  r = Ctl({"status", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"role\": \"ROLE_PUBLISHER\""));
  EXPECT_THAT(r.out, HasSubstr("\"version\": \"2\""));

  // ---- export, verify ----
  const std::string out_file = absl::StrCat(dir_.path(), "/export.safetensors");
  r = Ctl({"export", "--safetensors", out_file});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("exported version 2 digest 0x"));
  REFIT_ASSERT_OK_AND_ASSIGN(model::SafetensorsFile exported,
                             model::SafetensorsFile::Open(out_file));
  for (size_t i = 0; i < 3; ++i) {
    REFIT_ASSERT_OK_AND_ASSIGN(size_t k, exported.Find(Specs()[i].name()));
    std::span<const uint8_t> got = exported.data(k);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), v2[i].begin(), v2[i].end()))
        << Specs()[i].name();
  }
  r = Ctl({"verify"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("version 2 digest 0x"));
  EXPECT_THAT(r.out, HasSubstr(": 3 tensors, ok\n"));
  // The digest verify prints is the one wait reported.
  EXPECT_THAT(digest_line, HasSubstr(r.out.substr(r.out.find("digest"), 25)));

  // The trainer leaves; the publisher forgets its tensors.
  EXPECT_THAT(t.Unregister(), IsOk());
}

}  // namespace
}  // namespace refit::client
