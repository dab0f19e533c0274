#include "daemon/subscriber/subscriber_fuzz_input.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/sync_testing.h"

namespace refit::subscriber::fuzz {
namespace {

[[noreturn]] void Die(const absl::Status& st) {
  std::fprintf(stderr, "subscriber fuzz wires: %s\n", st.ToString().c_str());
  std::abort();
}

Wire Cut(publisher::PublisherCore& core, uint64_t base, uint64_t base_digest,
         const sync::PlanOptions& plan = {}) {
  publisher::TransferOptions o;
  o.plan = plan;
  o.frame_bytes = kFrameBytes;
  o.lz4 = true;
  auto t = core.MakeTransfer(base, base_digest, o);
  if (!t.ok()) Die(t.status());
  Wire w{(*t)->Header(), {}, {}};
  uint64_t bytes = 0;
  for (uint64_t i = 0; i < (*t)->frame_count(); ++i) {
    auto f = (*t)->Frame(i);
    if (!f.ok()) Die(f.status());
    bytes += f->payload().size();
    w.frames.push_back(*std::move(f));
  }
  w.end = (*t)->End(bytes);
  return w;
}

std::vector<Wire> MakeWires() {
  using sync::testing::BF16;
  // a: 8 keyframe chunks; b: one; scale: 4 elements, usually unchanged (DELIVERY_UNCHANGED).
  testing::ModelPublisher pub({BF16("a.weight", {40, 100}), BF16("b.bias", {300}),
                               BF16("scale", {4})},
                              /*seed=*/99, /*change=*/0.01);
  std::vector<Wire> w;
  pub.PublishNext();
  const uint64_t d1 = pub.digest();
  w.push_back(Cut(pub.core(), 0, 0));
  pub.PublishNext();
  const uint64_t d2 = pub.digest();
  w.push_back(Cut(pub.core(), 1, d1));
  w.push_back(Cut(pub.core(), 0, 0));
  pub.PublishNext(BF16("c.extra", {50}));
  w.push_back(Cut(pub.core(), 2, d2));
  w.push_back(Cut(pub.core(), 1, d1));
  sync::PlanOptions all;
  all.all_keyframes = true;
  w.push_back(Cut(pub.core(), 1, d1, all));
  sync::PlanOptions one;
  one.keyframe_tensors = {"a.weight"};
  w.push_back(Cut(pub.core(), 1, d1, one));
  if (pub.core().newest_version() != 3) Die(absl::InternalError("publish failed"));
  return w;
}

}  // namespace

const std::vector<Wire>& GetWires() {
  static const std::vector<Wire>* wires = new std::vector<Wire>(MakeWires());
  return *wires;
}

}  // namespace refit::subscriber::fuzz
