// The TrainerApi of a shard publisher (TrainerApiOptions::parts): each sliced tensor's blocks
// tile whole rows [a, b) of it and are published as a part (TensorSpec.part) of those rows.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/publisher/trainer_api_testing.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// One client's rows [first, first + rows) of a 1-d BF16 tensor of `n` elements.
struct RowBlock {
  RowBlock(const std::vector<uint16_t>& whole, uint64_t n, uint64_t first, uint64_t rows,
           const std::string& name)
      : memfd(std::max<size_t>(rows * 2, 1)), first(first), rows(rows) {
    location = refit::testing::Location(name, v1::DTYPE_BF16, {rows}, memfd.path(), 0, rows * 2);
    location.mutable_slice()->add_global_shape(n);
    location.mutable_slice()->add_offsets(first);
    Write(whole);
  }
  void Write(const std::vector<uint16_t>& whole) {
    std::memcpy(memfd.data(), whole.data() + first, rows * 2);
  }
  Memfd memfd;
  uint64_t first, rows;
  v1::TensorLocation location;
};

// Bytes of rows [first, end) of a row-major BF16 tensor of `cols` columns.
std::vector<uint8_t> RowBytes(const std::vector<uint16_t>& whole, uint64_t cols, uint64_t first,
                              uint64_t end) {
  std::vector<uint16_t> rows(whole.begin() + static_cast<ptrdiff_t>(first * cols),
                             whole.begin() + static_cast<ptrdiff_t>(end * cols));
  return Bytes(rows);
}

class TrainerApiPartsTest : public TrainerApiTest {
 protected:
  void SetUp() override {
    TrainerApiTest::SetUp();
    TrainerApiOptions options;
    options.parts = true;
    api_ = std::make_unique<TrainerApiService>(queue_.get(), options);
  }
  std::optional<v1::TensorSpec> PublishedSpec(const std::string& name) {
    for (const BaselineTensor& t : core_->Baseline()) {
      if (t.spec.name() == name) return t.spec;
    }
    return std::nullopt;
  }
  // How a subscriber at the previous version receives `name` in the newest version.
  v1::Delivery DeliveryOf(uint64_t from_version, uint64_t from_digest, const std::string& name) {
    absl::StatusOr<std::shared_ptr<const Transfer>> t =
        core_->MakeTransfer(from_version, from_digest);
    EXPECT_THAT(t, IsOk());
    if (!t.ok()) return v1::DELIVERY_UNSPECIFIED;
    for (const auto& d : (*t)->plan().tensors) {
      if (d.plan.spec().name() == name) {
        EXPECT_TRUE(sync::SameSpec(d.plan.spec(), *PublishedSpec(name))) << name;
        return d.plan.delivery();
      }
    }
    return v1::DELIVERY_UNSPECIFIED;
  }
};

void ExpectPart(const std::optional<v1::TensorSpec>& spec, uint64_t first_row,
                const std::vector<uint64_t>& shape, const std::vector<uint64_t>& whole) {
  ASSERT_TRUE(spec.has_value());
  ASSERT_TRUE(sync::IsPart(*spec)) << spec->DebugString();
  EXPECT_EQ(spec->part().first_row(), first_row);
  EXPECT_EQ(std::vector<uint64_t>(spec->shape().begin(), spec->shape().end()), shape);
  EXPECT_EQ(
      std::vector<uint64_t>(spec->part().whole_shape().begin(), spec->part().whole_shape().end()),
      whole);
}

TEST_F(TrainerApiPartsTest, BlocksOfWholeRowsArePublishedAsPartsAndThenAsDeltas) {
  // "w" [250, 8]: both clients hold rows [40, 100), split into column halves (tensor parallel
  // inside the node). "v" [300]: row blocks [100, 150) and [150, 220). "full" [20, 4]: all rows
  // here, so it is an ordinary whole tensor.
  std::vector<uint16_t> w = Whole(250, 8), v = Whole(300, 1, 5), full = Whole(20, 4, 9);
  Block wa(w, 250, 8, 40, 0, 60, 4), wb(w, 250, 8, 40, 4, 60, 4);
  Block fa(full, 20, 4, 0, 0, 10, 4, "full"), fb(full, 20, 4, 10, 0, 10, 4, "full");
  RowBlock va(v, 300, 100, 50, "v"), vb(v, 300, 150, 70, "v");
  Memfd norm(16, 3);
  ASSERT_THAT(
      Register("a", {wa.location, va.location, fa.location,
                     refit::testing::Location("norm", v1::DTYPE_BF16, {8}, norm.path(), 0, 16)}),
      IsOk());
  ASSERT_THAT(Register("b", {wb.location, vb.location, fb.location}), IsOk());
  PublishAll({"b", "a"}, 1);
  ExpectPart(PublishedSpec("w"), 40, {60, 8}, {250, 8});
  EXPECT_EQ(PublishedBytes("w"), RowBytes(w, 8, 40, 100));
  ExpectPart(PublishedSpec("v"), 100, {120}, {300});
  EXPECT_EQ(PublishedBytes("v"), RowBytes(v, 1, 100, 220));
  ASSERT_TRUE(PublishedSpec("full").has_value());
  EXPECT_FALSE(sync::IsPart(*PublishedSpec("full")));
  EXPECT_EQ(PublishedBytes("full"), Bytes(full));
  EXPECT_FALSE(sync::IsPart(*PublishedSpec("norm")));

  // Status shows each sliced tensor's rows.
  const v1::TrainerApiStatus st = api_->TrainerStatus();
  ASSERT_EQ(st.sliced_size(), 3);
  EXPECT_EQ(st.sliced(0).name(), "full");
  EXPECT_EQ(st.sliced(0).rows(), 20u);
  EXPECT_EQ(st.sliced(2).name(), "w");
  EXPECT_TRUE(st.sliced(2).shard_part());
  EXPECT_EQ(st.sliced(2).first_row(), 40u);
  EXPECT_EQ(st.sliced(2).rows(), 60u);
  EXPECT_THAT(st.sliced(2).whole_shape(), ElementsAre(250u, 8u));
  EXPECT_EQ(st.sliced(2).blocks(), 2u);

  // The next step changes a few elements: the parts are patches of themselves.
  const uint64_t digest1 = core_->newest_version_digest();
  w[50 * 8 + 6] ^= 1;
  w[99 * 8 + 1] ^= 4;
  v[219] ^= 2;
  for (Block* b : {&wa, &wb}) b->Write(w, 8);
  for (RowBlock* b : {&va, &vb}) b->Write(v);
  PublishAll({"a", "b"}, 2);
  EXPECT_EQ(PublishedBytes("w"), RowBytes(w, 8, 40, 100));
  EXPECT_EQ(PublishedBytes("v"), RowBytes(v, 1, 100, 220));
  EXPECT_EQ(DeliveryOf(1, digest1, "w"), v1::DELIVERY_PATCH);
  EXPECT_EQ(DeliveryOf(1, digest1, "v"), v1::DELIVERY_PATCH);
  EXPECT_EQ(DeliveryOf(1, digest1, "full"), v1::DELIVERY_UNCHANGED);
}

TEST_F(TrainerApiPartsTest, RowsThatAreNotWholeAreRefusedAndNothingIsQueued) {
  const std::vector<uint16_t> w = Whole(250, 8);
  // Only the left column half of rows [40, 100): the right half is nobody's on this publisher.
  Block left(w, 250, 8, 40, 0, 60, 4);
  Memfd norm(16, 3);
  ASSERT_THAT(Register("a", {left.location}), IsOk());
  ASSERT_THAT(
      Register("b", {refit::testing::Location("norm", v1::DTYPE_BF16, {8}, norm.path(), 0, 16)}),
      IsOk());
  ASSERT_THAT(Publish("b", 1), IsOk());
  EXPECT_THAT(Publish("a", 1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        AllOf(HasSubstr("version 1"), HasSubstr("not published"),
                                              HasSubstr("tensor \"w\" of shape [250, 8]"),
                                              HasSubstr("span rows [40, 100)"),
                                              HasSubstr("index range 4:8 of dimension 1"),
                                              HasSubstr("client \"a\" [40:100, 0:4]"),
                                              HasSubstr("must be whole rows along dim 0"))));
  EXPECT_EQ(core_->newest_version(), 0u);

  // Two separate row ranges: rows [60, 80) are missing between them.
  Block top(w, 250, 8, 40, 0, 20, 8), bottom(w, 250, 8, 80, 0, 20, 8);
  ASSERT_THAT(Register("a", {top.location}), IsOk());
  ASSERT_THAT(Register("b", {bottom.location}), IsOk());
  ASSERT_THAT(Publish("a", 2), IsOk());
  EXPECT_THAT(Publish("b", 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("version 2"), HasSubstr("span rows [40, 100)"),
                             HasSubstr("index range 60:80 of dimension 0"),
                             HasSubstr("client \"a\" [40:60, 0:8]"),
                             HasSubstr("client \"b\" [80:100, 0:8]"))));
  EXPECT_EQ(core_->newest_version(), 0u);
}

TEST_F(TrainerApiTest, AnUnshardedPublisherStillNeedsTheWholeTensor) {
  const std::vector<uint16_t> w = Whole(250, 8);
  Block wa(w, 250, 8, 40, 0, 60, 4), wb(w, 250, 8, 40, 4, 60, 4);
  ASSERT_THAT(Register("a", {wa.location}), IsOk());
  ASSERT_THAT(Register("b", {wb.location}), IsOk());
  ASSERT_THAT(Publish("a", 1), IsOk());
  EXPECT_THAT(Publish("b", 1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        AllOf(HasSubstr("tensor \"w\" of shape [250, 8] is not "
                                                        "covered by its blocks"),
                                              Not(HasSubstr("shard publisher")))));
  EXPECT_EQ(core_->newest_version(), 0u);
  EXPECT_FALSE(api_->TrainerStatus().sliced(0).shard_part());
}

TEST_F(TrainerApiPartsTest, RowsThatMoveAreAKeyframeOfThatTensorAndTheVersionPublishes) {
  std::vector<uint16_t> w = Whole(250, 8);
  Memfd norm(16, 3);
  const v1::TensorLocation norm_location =
      refit::testing::Location("norm", v1::DTYPE_BF16, {8}, norm.path(), 0, 16);
  {
    Block a(w, 250, 8, 40, 0, 30, 8), b(w, 250, 8, 70, 0, 30, 8);
    ASSERT_THAT(Register("a", {a.location, norm_location}), IsOk());
    ASSERT_THAT(Register("b", {b.location}), IsOk());
    PublishAll({"a", "b"}, 1);
    ExpectPart(PublishedSpec("w"), 40, {60, 8}, {250, 8});
  }
  const uint64_t digest1 = core_->newest_version_digest();
  // The job is resharded: this node now holds rows [100, 160).
  Block a(w, 250, 8, 100, 0, 30, 8), b(w, 250, 8, 130, 0, 30, 8);
  ASSERT_THAT(Register("a", {a.location, norm_location}), IsOk());
  ASSERT_THAT(Register("b", {b.location}), IsOk());
  PublishAll({"b", "a"}, 2);
  ExpectPart(PublishedSpec("w"), 100, {60, 8}, {250, 8});
  EXPECT_EQ(PublishedBytes("w"), RowBytes(w, 8, 100, 160));
  EXPECT_EQ(DeliveryOf(1, digest1, "w"), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(DeliveryOf(1, digest1, "norm"), v1::DELIVERY_UNCHANGED);
}

TEST_F(TrainerApiPartsTest, BlocksWithoutElementsPublishNothingOfTheirTensor) {
  // FSDP's last ranks may hold no rows of a tensor: a node whose ranks all do has no part of it.
  const std::vector<uint16_t> w = Whole(10, 4);
  Block empty(w, 10, 4, 10, 0, 0, 4);
  Memfd norm(16, 3);
  ASSERT_THAT(Register("a", {empty.location, refit::testing::Location("norm", v1::DTYPE_BF16, {8},
                                                                      norm.path(), 0, 16)}),
              IsOk());
  PublishAll({"a"}, 1);
  EXPECT_FALSE(PublishedSpec("w").has_value());
  EXPECT_TRUE(PublishedSpec("norm").has_value());
  const v1::TrainerApiStatus st = api_->TrainerStatus();
  ASSERT_EQ(st.sliced_size(), 1);
  EXPECT_TRUE(st.sliced(0).shard_part());
  EXPECT_EQ(st.sliced(0).rows(), 0u);
}

}  // namespace
}  // namespace refit::publisher
