// Test helpers for code that receives transfers (SubscriberCore, ShardJoin): a publisher that
// makes real transfers (PatchHistory plans, EncodePatches patches, shuffled frames) and
// functions that feed and read a core.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_TESTING_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_TESTING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "daemon/store/tensor_store.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/history.h"
#include "daemon/sync/sync_testing.h"
#include "refit/v1/data.pb.h"

namespace refit::subscriber::testing {

// What travels for one transfer.
struct Wire {
  v1::VersionHeader header;
  std::vector<v1::DataFrame> frames;
  v1::VersionEnd end;
};

// A publisher: a PatchHistory fed with EncodePatches, and transfers cut into shuffled frames.
class FakePublisher {
 public:
  explicit FakePublisher(uint32_t frame_bytes = 4096) : frame_bytes_(frame_bytes) {}

  // Adds `version` holding `m` (patches against the previous version published); a failure is
  // a test failure.
  void Publish(uint64_t version, const sync::testing::Model& m);

  const sync::testing::Model& model(uint64_t v) const { return models_.at(v); }
  uint64_t digest(uint64_t v) const { return *history_.VersionDigestOf(v, format_); }
  // The session's digest format (Welcome.digest_format): digests of plans and digest().
  void set_format(sync::DigestFormat f) { format_ = f; }

  // The transfer from what a subscriber holds to `target`.
  Wire Transfer(uint64_t sub_version, uint64_t sub_digest, uint64_t target,
                sync::PlanOptions options = {});

  const sync::TransferPlan& last_plan() const { return last_plan_; }
  // Called on every patch object before it is cut into frames (tests corrupt one).
  std::function<void(const std::string& tensor, uint32_t part, std::vector<uint8_t>& patch)>
      mutate_patch;

 private:
  uint32_t frame_bytes_;
  sync::PatchHistory history_{1ull << 30};
  sync::DigestFormat format_ = sync::DigestFormat::kV1;
  std::map<uint64_t, sync::testing::Model> models_;
  sync::TransferPlan last_plan_;
  std::mt19937 rng_{7};
};

// A core's options for small test models: two slots, the test's clock, 4 KiB frames.
SubscriberOptions SmallCoreOptions(store::FakeClock* clock, int threads);

// Tensor i of a lease, copied to the host through the store's memory (a GPU store's spans are
// device memory).
std::vector<uint8_t> HostCopy(const SubscriberLease& lease, size_t i);

// Header, frames and End into `core` (header and frames expected to be accepted).
v1::Ack Feed(SubscriberCore& core, const Wire& w);

// The current version's tensors, read under a lease.
std::map<std::string, std::vector<uint8_t>> Read(SubscriberCore& core);

// Expects `core` to hold `pub`'s version v: applied version and digest, every tensor's bytes.
void ExpectHolds(SubscriberCore& core, const FakePublisher& pub, uint64_t v);

}  // namespace refit::subscriber::testing

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_TESTING_H_
