// The subscriber's background scrub heals a corrupted tensor by keyframe. A byte of the
// committed version is flipped in the subscriber's store after verification (written into the
// daemon's own writable mapping through /proc/<pid>/mem, as a stray write would land: the store
// is sealed against new writable mappings, F_SEAL_FUTURE_WRITE). The scrub finds it, Control
// Status counts it, the repair (the same version again, the tensor dense) replaces it, and a
// consumer's new lease reads the publisher's bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/consumer.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

// Flips one bit of the byte at `offset` of the object at `path` (a ShmRegion) inside process
// `pid`'s shared writable mapping of it.
absl::Status FlipInDaemonMapping(pid_t pid, const std::string& path, uint64_t offset) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("stat ", path));
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  uint64_t address = 0;
  while (address == 0 && std::getline(maps, line)) {
    unsigned long start = 0, end = 0, file_off = 0, inode = 0;
    char perms[8] = {};
    unsigned dev_major = 0, dev_minor = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %lx %x:%x %lu", &start, &end, perms, &file_off,
                    &dev_major, &dev_minor, &inode) != 7) {
      continue;
    }
    if (inode != st.st_ino || perms[1] != 'w' || perms[3] != 's') continue;
    if (offset >= file_off && offset < file_off + (end - start)) {
      address = start + (offset - file_off);
    }
  }
  if (address == 0) {
    return absl::NotFoundError(absl::StrCat("no writable shared mapping of ", path, " in ", pid));
  }
  const int fd = open(absl::StrCat("/proc/", pid, "/mem").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat("open /proc/", pid, "/mem"));
  uint8_t b = 0;
  bool ok = pread(fd, &b, 1, static_cast<off_t>(address)) == 1;
  b ^= 0x20;
  ok = ok && pwrite(fd, &b, 1, static_cast<off_t>(address)) == 1;
  close(fd);
  if (!ok) return absl::InternalError(absl::StrCat("write /proc/", pid, "/mem: ", std::strerror(errno)));
  return absl::OkStatus();
}

class E2EScrub : public E2ETest {
 protected:
  absl::StatusOr<v1::Lease> Acquire() { return AcquireLease(*consumer_, "e2e-consumer"); }
  absl::Status Release(uint64_t id) { return ReleaseLease(*consumer_, id); }
  std::unique_ptr<v1::ConsumerApi::Stub> consumer_;
};

TEST_F(E2EScrub, FlippedByteInTheStoreIsFoundAndHealedByKeyframe) {
  PublisherSpec ps;
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.upstream = {pub.listen_target()};
  ss.store_extra = "    scrub_bytes_per_second: 1073741824\n    scrub_interval_ms: 20\n";
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  consumer_ = v1::ConsumerApi::NewStub(PlainChannel(sub.local_target()));

  Model m = RandomModel(5, {{"a.weight", 200000}, {"b.weight", 65536}, {"c.bias", 1000}});
  E2E_ASSERT_OK(Publish(pub, m, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));
  PerturbModel(m, 0.01, 6);
  E2E_ASSERT_OK(Publish(pub, m, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));

  REFIT_ASSERT_OK_AND_ASSIGN(v1::Lease lease, Acquire());
  const v1::TensorLocation* b = nullptr;
  for (const v1::TensorLocation& t : lease.layout().tensors()) {
    if (t.spec().name() == "b.weight") b = &t;
  }
  ASSERT_NE(b, nullptr);
  absl::Status flipped = FlipInDaemonMapping(sub.pid(), b->shm().path(), b->shm().offset() + 999);
  if (absl::IsPermissionDenied(flipped)) GTEST_SKIP() << "cannot write the daemon's memory: " << flipped;
  E2E_ASSERT_OK(flipped);
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> corrupt, ReadTensor(lease.layout(), "b.weight"));
  ASSERT_NE(corrupt, m.Find("b.weight")->data) << "the flip did not land";

  // The scrub counts the mismatch in Status.
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      sub.control_target(),
      [](const v1::StatusResponse& s) { return s.scrub_mismatches() >= 1; }, absl::Seconds(60),
      "a scrub mismatch");
  ASSERT_THAT(st, IsOk());
  EXPECT_GE(st->scrub_mismatches(), 1u);
  EXPECT_EQ(st->version(), 2u);
  // The lease taken before still reads the bytes it had (its slot is never written).
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> still, ReadTensor(lease.layout(), "b.weight"));
  EXPECT_EQ(still, corrupt);
  E2E_ASSERT_OK(Release(lease.lease_id()));

  // New leases read the repaired bytes: the publisher's dense copy of version 2.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::vector<uint8_t> got;
  do {
    REFIT_ASSERT_OK_AND_ASSIGN(v1::Lease l, Acquire());
    REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> r, ReadTensor(l.layout(), "b.weight"));
    got = r;
    E2E_ASSERT_OK(Release(l.lease_id()));
    if (got == m.Find("b.weight")->data) break;
    absl::SleepFor(absl::Milliseconds(20));  // polling interval
  } while (absl::Now() < deadline);
  EXPECT_EQ(got, m.Find("b.weight")->data) << "not healed";
  E2E_ASSERT_OK(ExpectExportEquals(sub, m));
  // The pass that found the flip goes on over the repaired version (a commit does not restart a
  // pass): wait for a complete one.
  st = PollStatus(
      sub.control_target(), [](const v1::StatusResponse& s) { return s.scrub_passes() >= 1; },
      absl::Seconds(60), "a complete scrub pass");
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->version(), 2u);
  EXPECT_GE(st->scrub_passes(), 1u);
  EXPECT_NE(st->last_scrub_unix_nanos(), 0u);
  // And the next delta applies on the repaired bytes.
  PerturbModel(m, 0.01, 7);
  E2E_ASSERT_OK(Publish(pub, m, 3));
  E2E_ASSERT_OK(WaitVersion(sub, 3));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m));
}

}  // namespace
}  // namespace refit::e2e
