// Tensor-parallel slices end to end: a publisher cuts the column-parallel weights of a Llama-style
// model by rows and the row-parallel ones by columns into two parts (publisher.cut); two
// subscribers of TP ranks 0 and 1 (upstream.slice) each receive, verify and hold only their rank's
// share of every cut tensor and the other tensors whole, version after version as deltas, and
// their consumers see each share with its place in the whole tensor (rank 0 keeps a single copy
// updated in place, rank 1 two slots). A subscriber of whole
// tensors cannot join column parts and says so.
#include <fnmatch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "daemon/sync/tensor_part.h"
#include "gtest/gtest.h"
#include "tests/harness/consumer.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using E2ETpSlices = E2ETest;

constexpr uint32_t kRanks = 2;
const std::vector<std::string> kRows = {
    "*.q_proj.weight",  "*.k_proj.weight",           "*.v_proj.weight", "*.gate_proj.weight",
    "*.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"};
const std::vector<std::string> kColumns = {"*.o_proj.weight", "*.down_proj.weight"};

// The dim tensor `name` is cut along (0 rows, 1 columns), or -1 when it is published whole.
int CutDim(const std::string& name) {
  auto any = [&](const std::vector<std::string>& patterns) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) {
      return fnmatch(p.c_str(), name.c_str(), 0) == 0;
    });
  };
  return any(kRows) ? 0 : any(kColumns) ? 1 : -1;
}

std::string Quote(const std::vector<std::string>& patterns) {
  std::string out;
  for (const std::string& p : patterns)
    absl::StrAppend(&out, out.empty() ? "" : ", ", "\"", p, "\"");
  return out;
}

// What TP rank `rank` holds of `whole`: each cut tensor's share (2-d BF16), the rest whole.
Model ShareModel(const Model& whole, uint32_t rank) {
  Model out;
  for (const ModelTensor& t : whole.tensors) {
    const int dim = CutDim(t.name);
    if (dim < 0) {
      out.tensors.push_back(t);
      continue;
    }
    const uint64_t rows = static_cast<uint64_t>(t.shape[0]);
    const uint64_t cols = static_cast<uint64_t>(t.shape[1]);
    const sync::IndexRange share = sync::RankRange(dim == 0 ? rows : cols, rank, kRanks);
    ModelTensor s{t.name, t.dtype, t.shape, {}};
    s.shape[dim] = static_cast<int64_t>(share.size());
    const uint64_t r0 = dim == 0 ? share.begin : 0, r1 = dim == 0 ? share.end : rows;
    const uint64_t c0 = dim == 1 ? share.begin : 0, c1 = dim == 1 ? share.end : cols;
    for (uint64_t r = r0; r < r1; ++r) {
      s.data.insert(s.data.end(), t.data.begin() + (r * cols + c0) * 2,
                    t.data.begin() + (r * cols + c1) * 2);
    }
    out.tensors.push_back(std::move(s));
  }
  return out;
}

TEST_F(E2ETpSlices, EachRankHoldsItsShareOfEveryCutTensorBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(41));
  PublisherSpec ps;
  ps.extra = absl::StrCat("  cut:\n    parts: ", kRanks, "\n    rows: [", Quote(kRows),
                          "]\n    columns: [", Quote(kColumns), "]\n");
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  std::vector<DaemonProcess*> tp;
  for (uint32_t r = 0; r < kRanks; ++r) {
    SubscriberSpec ss;
    ss.name = absl::StrCat("tp", r);
    ss.upstream = {pub.listen_target()};
    ss.slice_rank = r;
    ss.slice_ranks = kRanks;
    ss.slots = r == 0 ? 1 : 2;  // rank 0 a single copy updated in place, rank 1 two slots
    tp.push_back(&NewSubscriber(ss));
    E2E_ASSERT_OK(tp.back()->Start());
  }
  SubscriberSpec ws;
  ws.name = "whole";
  ws.upstream = {pub.listen_target()};
  DaemonProcess& whole_sub = NewSubscriber(ws);
  E2E_ASSERT_OK(whole_sub.Start());

  for (uint64_t v = 1; v <= 4; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) traj->Step();
    const Model whole = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, whole, v));
    for (uint32_t r = 0; r < kRanks; ++r) {
      E2E_ASSERT_OK(ExpectHolds(*tp[r], ShareModel(whole, r), v));
      if (v == 1) continue;
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st,
                                 StatusAfterRefit(tp[r]->control_target(), v));
      EXPECT_EQ(st.last_refit().base_version(), v - 1) << DescribeRefit(st.last_refit());
      EXPECT_LT(st.last_refit().wire_bytes(), st.last_refit().dense_bytes() / 4)
          << DescribeRefit(st.last_refit());
    }
  }

  // Consumers of rank 1 see each share with its place, and hold 1/2 of the cut tensors.
  auto consumer = v1::ConsumerApi::NewStub(PlainChannel(tp[1]->local_target()));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::Lease lease, AcquireLease(*consumer, "e2e-tp"));
  const Model want = ShareModel(ModelFromTrajectory(*traj), 1);
  uint64_t held = 0, whole_bytes = 0;
  for (const v1::TensorLocation& loc : lease.layout().tensors()) {
    const int dim = CutDim(loc.spec().name());
    SCOPED_TRACE(loc.spec().name());
    if (dim < 0) {
      EXPECT_EQ(loc.slice().global_shape_size(), 0);
      continue;
    }
    ASSERT_EQ(loc.slice().global_shape_size(), 2);
    ASSERT_EQ(loc.slice().offsets_size(), 2);
    const uint64_t extent = loc.slice().global_shape(dim);
    EXPECT_EQ(loc.slice().offsets(dim), sync::RankRange(extent, 1, kRanks).begin);
    EXPECT_EQ(loc.slice().offsets(1 - dim), 0u);
    EXPECT_EQ(loc.spec().shape(dim), sync::RankRange(extent, 1, kRanks).size());
    EXPECT_NE(loc.digest(), 0u);
    REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                               ReadTensor(lease.layout(), loc.spec().name()));
    EXPECT_TRUE(bytes == want.Find(loc.spec().name())->data);
    held += bytes.size();
    whole_bytes += loc.slice().global_shape(0) * loc.slice().global_shape(1) * 2;
  }
  ASSERT_GT(whole_bytes, 0u);
  EXPECT_LE(static_cast<double>(held), static_cast<double>(whole_bytes) / kRanks * 1.02);
  E2E_ASSERT_OK(ReleaseLease(*consumer, lease.lease_id()));

  // The subscriber of whole tensors holds nothing and says why.
  absl::StatusOr<v1::StatusResponse> refused = PollStatus(
      whole_sub.control_target(),
      [](const v1::StatusResponse& r) {
        return absl::StrContains(r.ShortDebugString(), "do not join into the whole tensor");
      },
      absl::Seconds(30), "column parts refused by a whole subscriber");
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ(refused->version(), 0u);
}

}  // namespace
}  // namespace refit::e2e
