// Streamed transfers with real daemons (docs/ARCHITECTURE.md "Streamed transfers"): a publisher
// and two subscribers follow versions with patched, unchanged, new, removed and re-typed
// tensors, bit-exact, with streaming on (the default) and with a publisher that does not grant
// it (transport.streamed_transfers: false; a subscriber with upstream.streamed_transfers: false
// beside one with it). Whether a version is streamed depends on timing here; the structural
// proof of pipelining is StreamedTransferTest in daemon/subscriber/upstream_test.cc.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

class E2EStream : public E2ETest {
 protected:
  // A publisher (granting streamed transfers or not) and two subscribers (sub-1 without them)
  // follow ModelAt(1..8) bit-exact; *streamed = the publisher's streamed transfers applied.
  void FollowVersions(bool grant, int* streamed);
};

// Occurrences of `what` in the daemon's log.
int CountInLog(const DaemonProcess& d, const std::string& what) {
  std::ifstream in(d.log_path());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string log = ss.str();
  int n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

// Version v of the test's model: patches every version; "frozen" never changes; "late" appears
// at 3; "gone" disappears at 5; "retyped" turns F32 at 6.
Model ModelAt(uint64_t v) {
  Model m = RandomModel(3, {{"a.big", 4 << 20}, {"b.mid", 1 << 20}, {"frozen", 1 << 18},
                            {"gone", 1 << 16}, {"retyped", 1 << 16}});
  for (uint64_t s = 2; s <= v; ++s) {
    PerturbTensor(*m.Find("a.big"), 0.02, s);
    PerturbTensor(*m.Find("b.mid"), 0.02, 100 + s);
  }
  if (v >= 3) m.tensors.push_back(RandomTensor(7, "late", 1 << 16));
  if (v >= 5) {
    std::erase_if(m.tensors, [](const ModelTensor& t) { return t.name == "gone"; });
  }
  if (v >= 6) {
    ModelTensor* t = m.Find("retyped");
    t->dtype = DType::kF32;
    t->shape = {1 << 15};  // same bytes, other dtype
  }
  m.SortByName();
  return m;
}

void E2EStream::FollowVersions(bool grant, int* streamed) {
  PublisherSpec ps;
  ps.name = "pub";
  if (!grant) ps.extra = "  transport:\n    streamed_transfers: false\n";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  std::vector<DaemonProcess*> subs;
  for (int i = 0; i < 2; ++i) {
    SubscriberSpec ss;
    ss.name = absl::StrCat("sub-", i);
    ss.upstream = {pub.listen_target()};
    ss.connections = 2;
    ss.streamed_transfers = i == 0;  // sub-1 is a subscriber without streamed transfers
    DaemonProcess& sub = NewSubscriber(ss);
    E2E_ASSERT_OK(sub.Start());
    subs.push_back(&sub);
  }
  for (uint64_t v = 1; v <= 8; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    const Model m = ModelAt(v);
    if (v > 1) E2E_ASSERT_OK(WaitVersion(pub, v - 1, absl::Seconds(60), true));
    E2E_ASSERT_OK(Publish(pub, m, v));
    for (DaemonProcess* sub : subs) E2E_ASSERT_OK(WaitVersion(*sub, v));
    for (DaemonProcess* sub : subs) E2E_ASSERT_OK(ExpectExportEquals(*sub, m));
  }
  E2E_ASSERT_OK(WaitVersion(pub, 8, absl::Seconds(60), true));
  *streamed = CountInLog(pub, ", streamed)");
}

TEST_F(E2EStream, StreamedVersionsBitExact) {
  int streamed = 0;
  FollowVersions(/*grant=*/true, &streamed);
  std::printf("[e2e] %d of the 7 delta transfers to sub-0 were streamed\n", streamed);
}

TEST_F(E2EStream, PublisherThatDoesNotGrantStreamingStillServes) {
  int streamed = -1;
  FollowVersions(/*grant=*/false, &streamed);
  EXPECT_EQ(streamed, 0);
}

}  // namespace
}  // namespace refit::e2e
