// The TrainerApi with sliced tensors: blocks of one tensor from several clients, checked at
// registration, joined at the commit into the whole tensor the publisher encodes.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/publisher/trainer_api_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using TrainerApiSlicesTest = TrainerApiTest;

TEST_F(TrainerApiSlicesTest, UnevenRowBlocksJoinIntoTheWholeTensor) {
  // FSDP2's Shard(0) of 10 rows over 3 ranks: 4, 4, 2; a fourth rank with no rows.
  std::vector<uint16_t> w = Whole(10, 6);
  Block b0(w, 10, 6, 0, 0, 4, 6), b1(w, 10, 6, 4, 0, 4, 6), b2(w, 10, 6, 8, 0, 2, 6),
      b3(w, 10, 6, 10, 0, 0, 6);
  Memfd norm(64, 5);
  ASSERT_THAT(Register("rank0", {b0.location, refit::testing::Location("norm", v1::DTYPE_BF16, {8},
                                                                       norm.path(), 0, 16)}),
              IsOk());
  ASSERT_THAT(Register("rank1", {b1.location}), IsOk());
  ASSERT_THAT(Register("rank2", {b2.location}), IsOk());
  ASSERT_THAT(Register("rank3", {b3.location}), IsOk());
  PublishAll({"rank1", "rank3", "rank0", "rank2"}, 1);
  EXPECT_EQ(PublishedBytes("w"), Bytes(w));
  EXPECT_EQ(PublishedBytes("norm"), std::vector<uint8_t>(norm.data(), norm.data() + 16));
  const std::vector<BaselineTensor> baseline = core_->Baseline();
  ASSERT_EQ(baseline.size(), 2u);  // the whole tensor once, not its blocks

  // The next step: the trainers write their blocks; the last client's blocks were lent to the
  // pass and written only after its Publish returned.
  w = Whole(10, 6, 1);
  for (Block* b : {&b0, &b1, &b2, &b3}) b->Write(w, 6);
  PublishAll({"rank0", "rank1", "rank3", "rank2"}, 2);
  std::memset(b2.memfd.data(), 0, 2 * 6 * 2);
  EXPECT_EQ(PublishedBytes("w"), Bytes(w));
}

TEST_F(TrainerApiSlicesTest, StatusNamesTheClientsAVersionWaitsFor) {
  const std::vector<uint16_t> w = Whole(8, 4);
  Block b0(w, 8, 4, 0, 0, 4, 4), b1(w, 8, 4, 4, 0, 4, 4);
  Memfd norm(64, 5);
  ASSERT_THAT(Register("rank0", {b0.location, refit::testing::Location("norm", v1::DTYPE_BF16, {8},
                                                                       norm.path(), 0, 16)}),
              IsOk());
  ASSERT_THAT(Register("rank1", {b1.location}), IsOk());
  v1::TrainerApiStatus st = api_->TrainerStatus();
  ASSERT_EQ(st.clients_size(), 2);
  EXPECT_EQ(st.clients(0).name(), "rank0");
  EXPECT_EQ(st.clients(0).tensors(), 1u);
  EXPECT_EQ(st.clients(0).blocks(), 1u);
  EXPECT_EQ(st.clients(0).bytes(), 32u + 16u);
  EXPECT_EQ(st.clients(1).blocks(), 1u);
  EXPECT_EQ(st.sliced_tensors(), 1u);
  EXPECT_EQ(st.round_version(), 0u);
  ASSERT_THAT(Publish("rank1", 1), IsOk());
  st = api_->TrainerStatus();
  EXPECT_EQ(st.round_version(), 1u);
  EXPECT_THAT(st.published(), ::testing::ElementsAre("rank1"));
  EXPECT_THAT(st.waiting_for(), ::testing::ElementsAre("rank0"));
  ASSERT_THAT(Publish("rank0", 1), IsOk());
  EXPECT_EQ(api_->TrainerStatus().round_version(), 0u);
}

TEST_F(TrainerApiSlicesTest, ColumnAndTwoDimensionalBlocksJoin) {
  // Row parallel (dim 1) blocks of "o", and a 2 x 2 grid of blocks of "g".
  const std::vector<uint16_t> o = Whole(6, 10), g = Whole(7, 5, 9);
  // o1 is read with pread, run by run.
  Block o0(o, 6, 10, 0, 0, 6, 3, "o"), o1(o, 6, 10, 0, 3, 6, 7, "o", /*sealable=*/false);
  Block g00(g, 7, 5, 0, 0, 3, 2, "g"), g01(g, 7, 5, 0, 2, 3, 3, "g"), g10(g, 7, 5, 3, 0, 4, 2, "g"),
      g11(g, 7, 5, 3, 2, 4, 3, "g");
  // One block of a tensor per client.
  EXPECT_THAT(Register("rank0", {o0.location, g00.location, g11.location}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 2 \"g\": duplicate name"),
                             HasSubstr("at most one block of a tensor"))));
  ASSERT_THAT(Register("rank0", {o0.location, g00.location}), IsOk());
  ASSERT_THAT(Register("rank1", {o1.location, g01.location}), IsOk());
  ASSERT_THAT(Register("rank2", {g10.location}), IsOk());
  ASSERT_THAT(Register("rank3", {g11.location}), IsOk());
  PublishAll({"rank0", "rank1", "rank3", "rank2"}, 1);
  EXPECT_EQ(PublishedBytes("o"), Bytes(o));
  EXPECT_EQ(PublishedBytes("g"), Bytes(g));
}

TEST_F(TrainerApiSlicesTest, BlocksThatDisagreeAreRefusedNamingBothClients) {
  const std::vector<uint16_t> w = Whole(8, 4);
  Block b0(w, 8, 4, 0, 0, 4, 4);
  ASSERT_THAT(Register("rank0", {b0.location}), IsOk());
  Block overlap(w, 8, 4, 3, 0, 5, 4);
  EXPECT_THAT(Register("rank1", {overlap.location}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("client \"rank1\": tensor \"w\""),
                             HasSubstr("block [3:8, 0:4] overlaps client \"rank0\"'s block "
                                       "[0:4, 0:4]"))));
  Block other_shape(Whole(9, 4), 9, 4, 4, 0, 4, 4);
  EXPECT_THAT(Register("rank1", {other_shape.location}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("of a tensor of shape [9, 4]"),
                             HasSubstr("client \"rank0\"'s block [0:4, 0:4] is of shape [8, 4]"))));
  Block other_dtype(w, 8, 4, 4, 0, 4, 4);
  other_dtype.location.mutable_spec()->set_dtype(v1::DTYPE_F16);
  EXPECT_THAT(Register("rank1", {other_dtype.location}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("is f16"), HasSubstr("rank0"), HasSubstr("is bf16"))));
  Block outside(Whole(10, 4), 8, 4, 6, 0, 4, 4);  // rows 6..10 of an 8-row tensor
  EXPECT_THAT(Register("rank1", {outside.location}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("client \"rank1\""), HasSubstr("leaves the tensor"))));
  // Whole on one client, sliced on another, either way round.
  Memfd m(64);
  EXPECT_THAT(
      Register("rank1", {refit::testing::Location("w", v1::DTYPE_BF16, {8, 4}, m.path(), 0, 64)}),
      StatusIs(absl::StatusCode::kAlreadyExists,
               AllOf(HasSubstr("registered whole"), HasSubstr("client \"rank0\""))));
  ASSERT_THAT(
      Register("rank2", {refit::testing::Location("x", v1::DTYPE_BF16, {8, 4}, m.path(), 0, 64)}),
      IsOk());
  Block x(w, 8, 4, 0, 0, 4, 4, "x");
  EXPECT_THAT(Register("rank1", {x.location}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("client \"rank2\"")));
  // None of the refused registrations stuck: rank1's correct half completes the tensor.
  ASSERT_THAT(api_->DoUnregister("rank2"), IsOk());
  Block b1(w, 8, 4, 4, 0, 4, 4);
  ASSERT_THAT(Register("rank1", {b1.location}), IsOk());
  PublishAll({"rank0", "rank1"}, 1);
  EXPECT_EQ(PublishedBytes("w"), Bytes(w));
}

TEST_F(TrainerApiSlicesTest, AGapFailsTheCommitAndPublishesNothing) {
  std::vector<uint16_t> w = Whole(12, 4);
  Block b0(w, 12, 4, 0, 0, 4, 4), b1(w, 12, 4, 4, 0, 4, 4), b2(w, 12, 4, 8, 0, 4, 4);
  ASSERT_THAT(Register("rank0", {b0.location}), IsOk());
  ASSERT_THAT(Register("rank1", {b1.location}), IsOk());
  ASSERT_THAT(Register("rank2", {b2.location}), IsOk());
  PublishAll({"rank0", "rank1", "rank2"}, 1);
  // rank1 leaves (a resized job, or a rank that unregistered): rows 4..8 are nobody's.
  ASSERT_THAT(api_->DoUnregister("rank1"), IsOk());
  ASSERT_THAT(Publish("rank0", 2), IsOk());
  EXPECT_THAT(Publish("rank2", 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("version 2"), HasSubstr("not published"),
                             HasSubstr("tensor \"w\" of shape [12, 4]"),
                             HasSubstr("index range 4:8 of dimension 0"),
                             HasSubstr("client \"rank0\" [0:4, 0:4]"),
                             HasSubstr("client \"rank2\" [8:12, 0:4]"))));
  EXPECT_EQ(core_->newest_version(), 1u);
  // Back with its rows, the job publishes version 2.
  w = Whole(12, 4, 7);
  for (Block* b : {&b0, &b1, &b2}) b->Write(w, 4);
  ASSERT_THAT(Register("rank1", {b1.location}), IsOk());
  PublishAll({"rank0", "rank1", "rank2"}, 2);
  EXPECT_EQ(PublishedBytes("w"), Bytes(w));
}

TEST_F(TrainerApiSlicesTest, ANewBlockLayoutPublishesTheSameWholeTensor) {
  std::vector<uint16_t> w = Whole(9, 8);
  {
    Block a(w, 9, 8, 0, 0, 5, 8), b(w, 9, 8, 5, 0, 4, 8);
    ASSERT_THAT(Register("rank0", {a.location}), IsOk());
    ASSERT_THAT(Register("rank1", {b.location}), IsOk());
    PublishAll({"rank0", "rank1"}, 1);
    EXPECT_EQ(PublishedBytes("w"), Bytes(w));
    ASSERT_THAT(api_->DoUnregister("rank0"), IsOk());
    ASSERT_THAT(api_->DoUnregister("rank1"), IsOk());
  }
  // Three ranks now, split along the other dimension.
  w = Whole(9, 8, 2);
  Block a(w, 9, 8, 0, 0, 9, 3), b(w, 9, 8, 0, 3, 9, 3), c(w, 9, 8, 0, 6, 9, 2);
  ASSERT_THAT(Register("new0", {a.location}), IsOk());
  ASSERT_THAT(Register("new1", {b.location}), IsOk());
  ASSERT_THAT(Register("new2", {c.location}), IsOk());
  PublishAll({"new2", "new0", "new1"}, 2);
  EXPECT_EQ(PublishedBytes("w"), Bytes(w));
}

}  // namespace
}  // namespace refit::publisher
