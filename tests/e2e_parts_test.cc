// Slices across publishers end to end: a sharded trainer spread over two nodes, each node's
// ranks feeding their node's shard publisher. Every 2-d tensor is split by rows across the nodes
// (FSDP over nodes); inside a node its rows are split again by rows or by columns over the node's
// two ranks (tensor parallel inside a node). Each shard publisher joins only its node's blocks
// into its part (TensorSpec.part); the sharded subscriber joins the parts into whole tensors, bit
// for bit, version after version; a relay behind it serves them whole to an unsharded subscriber.
// A resized job moves the parts (keyframes of the moved parts), and parts that leave rows
// uncovered commit nothing.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/trainer_client.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using E2EParts = E2ETest;

constexpr int kNodes = 2;
constexpr int kRanksPerNode = 2;

// One rank's block of tensor `index`: rows [r0, r1) x columns [c0, c1) of a [rows, cols] tensor
// (a 1-d tensor of n elements is [n, 1]).
struct Piece {
  size_t index;
  uint64_t rows, cols, r0, r1, c0, c1;
  bool one_d;
};

// Node n's rows of a tensor of `rows` rows: [0, cut) and [cut + gap, rows) with cut =
// rows * share / 6 (rounded up).
std::pair<uint64_t, uint64_t> NodeRows(uint64_t rows, int node, uint64_t share, uint64_t gap) {
  const uint64_t cut = std::min(rows, (rows * share + 5) / 6);
  return node == 0 ? std::pair{uint64_t{0}, cut} : std::pair{std::min(rows, cut + gap), rows};
}

// The blocks of node `node`'s ranks: its rows of every tensor, split over the node's ranks by
// rows (even index, and 1-d tensors) or by columns (odd index).
std::vector<std::vector<Piece>> NodeLayout(const model::Trajectory& traj, int node, uint64_t share,
                                           uint64_t gap) {
  std::vector<std::vector<Piece>> out(kRanksPerNode);
  const auto& specs = traj.tensors();
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::vector<int64_t>& shape = specs[i].shape;
    const bool one_d = shape.size() != 2;
    const uint64_t rows = static_cast<uint64_t>(shape.empty() ? 1 : shape[0]);
    const uint64_t cols = one_d ? 1 : static_cast<uint64_t>(shape[1]);
    const auto [a, b] = NodeRows(rows, node, share, gap);
    if (a == b) continue;  // no rows of it on this node
    const bool by_rows = one_d || i % 2 == 0;
    const uint64_t extent = by_rows ? b - a : cols;
    const uint64_t chunk = (extent + kRanksPerNode - 1) / kRanksPerNode;
    for (int r = 0; r < kRanksPerNode; ++r) {
      const uint64_t lo = std::min(extent, chunk * r), hi = std::min(extent, chunk * (r + 1));
      if (lo == hi) continue;
      out[r].push_back(by_rows ? Piece{i, rows, cols, a + lo, a + hi, 0, cols, one_d}
                               : Piece{i, rows, cols, a, b, lo, hi, one_d});
    }
  }
  return out;
}

struct Node {
  std::vector<std::vector<Piece>> layout;
  std::vector<std::unique_ptr<client::TrainerClient>> ranks;
};

absl::Status Register(const model::Trajectory& traj, Node& node, const std::string& target,
                      const std::string& prefix) {
  const auto& specs = traj.tensors();
  node.ranks.clear();
  for (size_t r = 0; r < node.layout.size(); ++r) {
    std::vector<v1::TensorSpec> mine;
    for (const Piece& p : node.layout[r]) {
      v1::TensorSpec t;
      t.set_name(specs[p.index].name);
      t.set_dtype(sync::ToProtoDType(specs[p.index].dtype));
      t.add_shape(p.r1 - p.r0);
      if (!p.one_d) t.add_shape(p.c1 - p.c0);
      mine.push_back(t);
    }
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<client::TrainerClient> c,
                           client::TrainerClient::Create(target, absl::StrCat(prefix, r), mine));
    for (size_t k = 0; k < node.layout[r].size(); ++k) {
      const Piece& p = node.layout[r][k];
      if (p.one_d) {
        c->SetSlice(k, {p.rows}, {p.r0});
      } else {
        c->SetSlice(k, {p.rows, p.cols}, {p.r0, p.c0});
      }
    }
    REFIT_RETURN_IF_ERROR(c->Register().status());
    node.ranks.push_back(std::move(c));
  }
  return absl::OkStatus();
}

// Each rank writes its blocks of the trajectory's current BF16 tensors, then every rank
// publishes version v.
absl::Status PublishNode(const model::Trajectory& traj, Node& node, uint64_t v) {
  for (size_t r = 0; r < node.layout.size(); ++r) {
    for (size_t k = 0; k < node.layout[r].size(); ++k) {
      const Piece& p = node.layout[r][k];
      std::span<const uint8_t> whole = traj.bf16(p.index);
      std::span<uint8_t> dst = node.ranks[r]->tensor(k);
      const uint64_t width = (p.c1 - p.c0) * 2;
      for (uint64_t row = p.r0; row < p.r1; ++row) {
        std::copy_n(whole.begin() + (row * p.cols + p.c0) * 2, width,
                    dst.begin() + (row - p.r0) * width);
      }
    }
  }
  for (auto& rank : node.ranks) REFIT_RETURN_IF_ERROR(rank->Publish(v).status());
  return absl::OkStatus();
}

// Parts of at most 1 KiB (a norm's rows on one node): at 1.65% changed their patch can be
// larger than they are, and the publisher then sends them whole.
uint32_t TinyParts(const Node (&nodes)[kNodes]) {
  uint32_t tiny = 0;
  for (const Node& node : nodes) {
    std::map<size_t, uint64_t> bytes;  // tensor index -> this node's bytes of it
    for (const auto& rank : node.layout) {
      for (const Piece& p : rank) bytes[p.index] += (p.r1 - p.r0) * (p.c1 - p.c0) * 2;
    }
    for (const auto& [index, b] : bytes) tiny += b <= 1024 ? 1 : 0;
  }
  return tiny;
}

TEST_F(E2EParts, TwoNodesPublishTheirRowsAndSubscribersHoldWholeTensors) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(29));
  std::vector<DaemonProcess*> pubs;
  for (int n = 0; n < kNodes; ++n) {
    PublisherSpec ps;
    ps.name = absl::StrCat("node", n);
    ps.local_socket = true;
    ps.extra = absl::StrCat("  shard: {set: fsdp, index: ", n, ", count: ", kNodes, "}\n");
    pubs.push_back(&NewPublisher(ps));
    E2E_ASSERT_OK(pubs.back()->Start());
  }
  SubscriberSpec ss;
  ss.name = "rollout";
  ss.shard_set = "fsdp";
  ss.serve_peers = true;
  for (DaemonProcess* p : pubs) ss.shards.push_back({p->listen_target()});
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  SubscriberSpec ds;
  ds.name = "behind-relay";
  ds.upstream = {sub.listen_target()};
  DaemonProcess& behind = NewSubscriber(ds);
  E2E_ASSERT_OK(behind.Start());

  Node nodes[kNodes];
  auto layout = [&](uint64_t share, uint64_t gap, const std::string& prefix) {
    for (int n = 0; n < kNodes; ++n) {
      for (auto& r : nodes[n].ranks) E2E_ASSERT_OK(r->Unregister());
      nodes[n].layout = NodeLayout(*traj, n, share, gap);
      E2E_ASSERT_OK(Register(*traj, nodes[n], pubs[n]->local_target(), prefix));
    }
  };
  layout(3, 0, "rank");  // half the rows on each node
  for (uint64_t v = 1; v <= 5; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) traj->Step();
    if (v == 4) layout(2, 0, "resized");  // a third of the rows on node 0 now
    for (int n = 0; n < kNodes; ++n) E2E_ASSERT_OK(PublishNode(*traj, nodes[n], v));
    const Model whole = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(ExpectHolds(sub, whole, v));
    E2E_ASSERT_OK(ExpectHolds(behind, whole, v));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub.control_target(), v));
    if (v == 1) {
      // Each node's publisher holds only its part of every tensor.
      for (DaemonProcess* p : pubs) {
        REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse ps, RpcStatus(p->control_target()));
        ASSERT_GT(ps.trainer_api().sliced_size(), 0);
        for (const auto& t : ps.trainer_api().sliced()) {
          EXPECT_TRUE(t.shard_part()) << t.ShortDebugString();
          EXPECT_LT(t.rows(), t.whole_shape(0)) << t.ShortDebugString();
        }
      }
      continue;
    }
    EXPECT_EQ(st.last_refit().base_version(), v - 1) << DescribeRefit(st.last_refit());
    if (v == 4) {
      // The moved parts come as keyframes; the rest stays a delta.
      EXPECT_GT(st.last_refit().keyframe_tensors(), 0u) << DescribeRefit(st.last_refit());
    } else {
      // Only a part so small that its patch outweighs it goes whole (the publisher's choice).
      EXPECT_LE(st.last_refit().keyframe_tensors(), TinyParts(nodes))
          << DescribeRefit(st.last_refit());
      EXPECT_LT(st.last_refit().wire_bytes(), st.last_refit().dense_bytes() / 4)
          << DescribeRefit(st.last_refit());
    }
  }

  // Node 1 loses a row of every tensor: the parts leave rows uncovered, nothing of version 6
  // commits anywhere, and the shards' status says which rows of which tensor.
  traj->Step();
  layout(2, 1, "gap");
  for (int n = 0; n < kNodes; ++n) E2E_ASSERT_OK(PublishNode(*traj, nodes[n], 6));
  absl::StatusOr<v1::StatusResponse> refused = PollStatus(
      sub.control_target(),
      [](const v1::StatusResponse& r) {
        for (const v1::ShardStatus& p : r.shards().shards()) {
          if (absl::StrContains(p.last_error(), "do not cover rows")) return true;
        }
        return false;
      },
      absl::Seconds(30), "version 6 refused for uncovered rows");
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ(refused->version(), 5u);
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse b, RpcStatus(behind.control_target()));
  EXPECT_EQ(b.version(), 5u);
  E2E_ASSERT_OK(ExpectVerified(sub));

  // The job fixed: version 7 commits whole again.
  traj->Step();
  layout(3, 0, "fixed");
  for (int n = 0; n < kNodes; ++n) E2E_ASSERT_OK(PublishNode(*traj, nodes[n], 7));
  const Model whole = ModelFromTrajectory(*traj);
  E2E_ASSERT_OK(ExpectHolds(sub, whole, 7));
  E2E_ASSERT_OK(ExpectHolds(behind, whole, 7));
}

}  // namespace
}  // namespace refit::e2e
