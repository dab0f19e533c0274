// Acceptance 5: manifest changes between versions. A tensor added, one removed, one frozen
// (unchanged) and two changed: the exports equal the published models, and the wire bytes of the
// version are the changed tensors' patches plus the added tensor's dense bytes; the frozen tensor
// (the biggest one) costs nothing.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

using E2EManifest = E2ETest;

uint64_t PatchBytes(const ModelTensor& before, const ModelTensor& after) {
  absl::StatusOr<std::vector<uint8_t>> p = EncodePatch(DType::kBF16, before.data, after.data);
  return p.ok() ? p->size() : 0;
}

TEST_F(E2EManifest, AddedRemovedFrozenAndChangedTensorsRefitExactly) {
  absl::StatusOr<PubSub> daemons = StartPubSub("sub");
  E2E_ASSERT_OK(daemons);
  DaemonProcess& pub = *daemons->pub;
  DaemonProcess& sub = *daemons->sub;

  Model v1 = RandomModel(3, {{"a.changed", 1 << 19},
                             {"b.frozen", 2 << 20},  // 4 MiB, unchanged in v2
                             {"c.removed", 1 << 18},
                             {"d.changed", 1 << 18}});
  E2E_ASSERT_OK(Publish(pub, v1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));
  E2E_ASSERT_OK(ExpectExportEquals(sub, v1));

  Model v2;
  v2.tensors.push_back(*v1.Find("a.changed"));
  v2.tensors.push_back(*v1.Find("b.frozen"));
  v2.tensors.push_back(*v1.Find("d.changed"));
  v2.tensors.push_back(RandomTensor(77, "e.added", 1 << 17));
  PerturbTensor(*v2.Find("a.changed"), 0.01, 5);
  PerturbTensor(*v2.Find("d.changed"), 0.01, 6);
  E2E_ASSERT_OK(Publish(pub, v2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, v2));
  E2E_ASSERT_OK(ExpectVerified(sub));

  absl::StatusOr<v1::StatusResponse> st = StatusAfterRefit(sub.control_target(), 2);
  ASSERT_THAT(st, IsOk());
  const v1::RefitStats& r = st->last_refit();
  const uint64_t patches = PatchBytes(*v1.Find("a.changed"), *v2.Find("a.changed")) +
                           PatchBytes(*v1.Find("d.changed"), *v2.Find("d.changed"));
  const uint64_t added = v2.Find("e.added")->data.size();
  std::printf("[e2e] manifest change: %s; patches of the changed tensors %llu B, added tensor %llu B\n",
              DescribeRefit(r).c_str(), static_cast<unsigned long long>(patches),
              static_cast<unsigned long long>(added));
  ASSERT_GT(patches, 0u) << "EncodePatch of the changed tensors failed";
  EXPECT_EQ(r.version(), 2u);
  EXPECT_EQ(r.base_version(), 1u) << DescribeRefit(r);
  EXPECT_EQ(r.keyframe_tensors(), 1u) << "only the added tensor goes dense: " << DescribeRefit(r);
  EXPECT_EQ(r.dense_bytes(), v2.bytes()) << DescribeRefit(r);
  EXPECT_EQ(st->tensors(), 3u + 1u - 0u) << "tensors of v2 (c.removed gone)";
  // Patches are sent verbatim; the added tensor's keyframe is LZ4 or raw, whichever is smaller
  // (random mantissas barely compress). The frozen 4 MiB tensor adds nothing.
  EXPECT_GE(r.wire_bytes(), patches + added / 2) << DescribeRefit(r);
  EXPECT_LE(r.wire_bytes(), patches + added) << "more than changed patches + added tensor: "
                                            << DescribeRefit(r);

  // v3: the removed tensor comes back with the same name, the frozen one is still frozen.
  Model v3 = v2;
  v3.tensors.push_back(RandomTensor(78, "c.removed", 1 << 18));
  PerturbTensor(*v3.Find("a.changed"), 0.01, 7);
  E2E_ASSERT_OK(Publish(pub, v3, 3));
  E2E_ASSERT_OK(WaitVersion(sub, 3));
  E2E_ASSERT_OK(ExpectExportEquals(sub, v3));
  E2E_ASSERT_OK(ExpectVerified(sub));
  st = StatusAfterRefit(sub.control_target(), 3);
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->last_refit().keyframe_tensors(), 1u) << DescribeRefit(st->last_refit());
  EXPECT_LE(st->last_refit().wire_bytes(),
            PatchBytes(*v2.Find("a.changed"), *v3.Find("a.changed")) + (2u << 18))
      << DescribeRefit(st->last_refit());
}

}  // namespace
}  // namespace refit::e2e
