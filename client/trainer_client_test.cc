// TrainerClient without a daemon: spec checks, memfd layout, an unreachable publisher.
#include "client/trainer_client.h"

#include <sys/stat.h>

#include <string>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::client {
namespace {

using ::refit::testing::IsOk;
using sync::testing::Spec;
using ::testing::HasSubstr;

TEST(TrainerClient, LayoutIsAlignedAndWritable) {
  absl::StatusOr<std::unique_ptr<TrainerClient>> c = TrainerClient::Create(
      "/nonexistent-dir/pub.sock", "rank0",
      {Spec("w", v1::DTYPE_BF16, {3, 5}), Spec("b", v1::DTYPE_F32, {7}),
       Spec("s", v1::DTYPE_U8, {})});
  ASSERT_THAT(c, IsOk());
  TrainerClient& t = **c;
  EXPECT_EQ(t.tensor(0).size(), 30u);
  EXPECT_EQ(t.tensor(1).size(), 28u);
  EXPECT_EQ(t.tensor(2).size(), 1u);
  v1::RegisterTensorsRequest req = t.RegisterRequest();
  ASSERT_EQ(req.tensors_size(), 3);
  EXPECT_EQ(req.client(), "rank0");
  EXPECT_EQ(req.tensors(0).shm().offset(), 0u);
  EXPECT_EQ(req.tensors(1).shm().offset(), 256u);
  EXPECT_EQ(req.tensors(2).shm().offset(), 512u);
  EXPECT_EQ(req.tensors(1).shm().size_bytes(), 28u);
  EXPECT_EQ(req.tensors(2).shm().path(), t.ProcPath());
  EXPECT_EQ(t.total_bytes(), 513u);
  // The /proc path names the memfd, whose size covers every tensor.
  struct stat st {};
  ASSERT_EQ(stat(t.ProcPath().c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_size), t.total_bytes());
  for (size_t i = 0; i < t.num_tensors(); ++i) {
    for (uint8_t& b : t.tensor(i)) b = static_cast<uint8_t>(i + 1);
  }
  EXPECT_EQ(t.tensor(1)[27], 2);
}

TEST(TrainerClient, RejectsBadInput) {
  const std::vector<v1::TensorSpec> one = {Spec("w", v1::DTYPE_BF16, {4})};
  EXPECT_EQ(TrainerClient::Create("unix:/tmp/x.sock", "", one).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TrainerClient::Create("unix:/tmp/x.sock", "r", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A TCP address is refused before anything is dialled (the TrainerApi is a unix socket).
  absl::Status tcp = TrainerClient::Create("127.0.0.1:7400", "r", one).status();
  EXPECT_EQ(tcp.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tcp.message()), HasSubstr("not a unix socket"));
  absl::Status dup =
      TrainerClient::Create("unix:/tmp/x.sock", "r", {one[0], one[0]}).status();
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dup.message()), HasSubstr("\"w\" appears twice"));
  EXPECT_EQ(TrainerClient::Create("unix:/tmp/x.sock", "r", {Spec("w", v1::DTYPE_UNSPECIFIED, {4})})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TrainerClient, UnreachablePublisherIsUnavailable) {
  TrainerClientOptions opt;
  opt.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<TrainerClient>> c = TrainerClient::Create(
      "unix:/nonexistent-dir/pub.sock", "rank3", {Spec("w", v1::DTYPE_BF16, {4})}, opt);
  ASSERT_THAT(c, IsOk());
  absl::Status s = (*c)->Register().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"rank3\""));
  EXPECT_EQ((*c)->Publish().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace refit::client
