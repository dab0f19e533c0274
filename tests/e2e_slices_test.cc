// Sliced tensors end to end: a sharded trainer's ranks (TrainerClients, one per rank) register
// only their blocks of each 2-d tensor (row blocks of some, column blocks of others, uneven), the
// publisher joins them, and the subscriber holds the whole tensors bit for bit, version after
// version, as deltas, also after the job changes its block layout.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trainer_client.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using E2ESlices = E2ETest;

// One rank's block of tensor `index`: rows [r0, r1) x columns [c0, c1) of a [rows, cols] tensor
// (1-d tensors: whole, one row of `cols`).
struct Piece {
  size_t index;
  bool sliced;
  uint64_t rows, cols, r0, r1, c0, c1;
};

// The ranks of a layout: 2-d tensors split over `ranks` along dim 0 (even index) or dim 1 (odd),
// torch.chunk-style (ceil-sized pieces, the last ones shorter or empty), or the other way round
// when `swap`; 1-d tensors whole on rank 0.
std::vector<std::vector<Piece>> Layout(const model::Trajectory& traj, int ranks, bool swap) {
  std::vector<std::vector<Piece>> out(ranks);
  const auto& specs = traj.tensors();
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::vector<int64_t>& shape = specs[i].shape;
    if (shape.size() != 2) {
      const uint64_t n = static_cast<uint64_t>(shape.empty() ? 1 : shape[0]);
      out[0].push_back({i, false, 1, n, 0, 1, 0, n});
      continue;
    }
    const uint64_t rows = static_cast<uint64_t>(shape[0]), cols = static_cast<uint64_t>(shape[1]);
    const bool by_rows = ((i % 2) == 0) != swap;
    const uint64_t extent = by_rows ? rows : cols;
    const uint64_t chunk = (extent + ranks - 1) / ranks;
    for (int r = 0; r < ranks; ++r) {
      const uint64_t b = std::min(extent, chunk * r), e = std::min(extent, chunk * (r + 1));
      out[r].push_back(by_rows ? Piece{i, true, rows, cols, b, e, 0, cols}
                               : Piece{i, true, rows, cols, 0, rows, b, e});
    }
  }
  return out;
}

std::vector<std::unique_ptr<client::TrainerClient>> Clients(
    const model::Trajectory& traj, const std::vector<std::vector<Piece>>& layout,
    const std::string& target, const std::string& prefix) {
  std::vector<std::unique_ptr<client::TrainerClient>> clients;
  const auto& specs = traj.tensors();
  for (size_t r = 0; r < layout.size(); ++r) {
    std::vector<v1::TensorSpec> mine;
    for (const Piece& p : layout[r]) {
      v1::TensorSpec t;
      t.set_name(specs[p.index].name);
      t.set_dtype(sync::ToProtoDType(specs[p.index].dtype));
      if (p.sliced) {
        t.add_shape(p.r1 - p.r0);
        t.add_shape(p.c1 - p.c0);
      } else {
        for (int64_t d : specs[p.index].shape) t.add_shape(static_cast<uint64_t>(d));
      }
      mine.push_back(t);
    }
    absl::StatusOr<std::unique_ptr<client::TrainerClient>> c =
        client::TrainerClient::Create(target, absl::StrCat(prefix, r), mine);
    EXPECT_THAT(c, IsOk());
    if (!c.ok()) return {};
    for (size_t k = 0; k < layout[r].size(); ++k) {
      const Piece& p = layout[r][k];
      if (p.sliced) (*c)->SetSlice(k, {p.rows, p.cols}, {p.r0, p.c0});
    }
    clients.push_back(std::move(*c));
  }
  return clients;
}

// Each rank writes its blocks of the trajectory's current BF16 tensors (its "local shards").
void WriteBlocks(const model::Trajectory& traj, const std::vector<std::vector<Piece>>& layout,
                 std::vector<std::unique_ptr<client::TrainerClient>>& clients) {
  for (size_t r = 0; r < layout.size(); ++r) {
    for (size_t k = 0; k < layout[r].size(); ++k) {
      const Piece& p = layout[r][k];
      std::span<const uint8_t> whole = traj.bf16(p.index);
      std::span<uint8_t> dst = clients[r]->tensor(k);
      const uint64_t width = (p.c1 - p.c0) * 2;
      for (uint64_t row = p.r0; row < p.r1; ++row) {
        std::copy_n(whole.begin() + (row * p.cols + p.c0) * 2, width,
                    dst.begin() + (row - p.r0) * width);
      }
    }
  }
}

TEST_F(E2ESlices, ShardedRanksPublishBlocksAndTheSubscriberHoldsWholeTensors) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(23));
  PublisherSpec ps;
  ps.local_socket = true;
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.name = "sub";
  ss.upstream = {pub.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());

  std::vector<std::vector<Piece>> layout = Layout(*traj, 3, false);
  ASSERT_GT(std::count_if(layout[1].begin(), layout[1].end(),
                          [](const Piece& p) { return p.sliced && p.c1 - p.c0 < p.cols; }),
            0)
      << "the model needs 2-d tensors split by columns";
  std::vector<std::unique_ptr<client::TrainerClient>> ranks =
      Clients(*traj, layout, pub.local_target(), "rank");
  ASSERT_EQ(ranks.size(), 3u);
  for (auto& r : ranks) E2E_ASSERT_OK(r->Register());
  for (uint64_t v = 1; v <= 6; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) traj->Step();
    if (v == 4) {
      // The job is resized: two ranks, each tensor split along its other dimension.
      for (auto& r : ranks) E2E_ASSERT_OK(r->Unregister());
      layout = Layout(*traj, 2, true);
      ranks = Clients(*traj, layout, pub.local_target(), "resized");
      ASSERT_EQ(ranks.size(), 2u);
      for (auto& r : ranks) E2E_ASSERT_OK(r->Register());
    }
    WriteBlocks(*traj, layout, ranks);
    for (size_t r = 0; r < ranks.size(); ++r) {
      absl::StatusOr<v1::LocalPublishResponse> p = ranks[r]->Publish(v);
      ASSERT_THAT(p, IsOk()) << "rank " << r;
      EXPECT_EQ(p->committed(), r + 1 == ranks.size()) << "rank " << r;
      if (r == 0 && ranks.size() > 1) {
        // The publisher's Status names the ranks the version still waits for.
        absl::StatusOr<v1::StatusResponse> st = RpcStatus(pub.control_target());
        ASSERT_THAT(st, IsOk());
        EXPECT_EQ(st->trainer_api().round_version(), v);
        EXPECT_EQ(st->trainer_api().waiting_for_size(), static_cast<int>(ranks.size()) - 1);
        EXPECT_EQ(st->trainer_api().published_size(), 1);
        EXPECT_GT(st->trainer_api().sliced_tensors(), 0u);
      }
    }
    E2E_ASSERT_OK(WaitVersion(sub, v));
    E2E_ASSERT_OK(ExpectExportEquals(sub, ModelFromTrajectory(*traj)));
    E2E_ASSERT_OK(ExpectVerified(sub));
    if (v > 1) {
      // A delta of whole tensors, also across the new layout.
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub.control_target(), v));
      EXPECT_EQ(st.last_refit().base_version(), v - 1) << DescribeRefit(st.last_refit());
      EXPECT_EQ(st.last_refit().keyframe_tensors(), 0u) << DescribeRefit(st.last_refit());
      EXPECT_LT(st.last_refit().wire_bytes(), st.last_refit().dense_bytes() / 4)
          << DescribeRefit(st.last_refit());
    }
  }
}

}  // namespace
}  // namespace refit::e2e
