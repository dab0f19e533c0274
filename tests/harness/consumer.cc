#include "tests/harness/consumer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"

namespace refit::e2e {

absl::StatusOr<v1::Lease> AcquireLease(v1::ConsumerApi::Stub& stub, const std::string& consumer,
                                       std::optional<uint64_t> version, uint64_t ttl_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::AcquireLeaseRequest req;
  req.set_consumer(consumer);
  if (version.has_value()) req.set_version(*version);
  req.set_ttl_ms(ttl_ms);
  v1::Lease lease;
  REFIT_RETURN_IF_ERROR(FromGrpcStatus(stub.AcquireLease(&ctx, req, &lease)));
  return lease;
}

absl::Status ReleaseLease(v1::ConsumerApi::Stub& stub, uint64_t lease_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ReleaseLeaseRequest req;
  req.set_lease_id(lease_id);
  v1::ReleaseLeaseResponse resp;
  return FromGrpcStatus(stub.ReleaseLease(&ctx, req, &resp));
}

absl::StatusOr<std::vector<uint8_t>> ReadTensor(const v1::Layout& layout,
                                                const std::string& tensor) {
  for (const v1::TensorLocation& t : layout.tensors()) {
    if (t.spec().name() != tensor) continue;
    const int fd = open(t.shm().path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("open ", t.shm().path()));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("fstat ", t.shm().path()));
    }
    if (t.shm().offset() + t.shm().size_bytes() > static_cast<uint64_t>(st.st_size)) {
      close(fd);
      return absl::OutOfRangeError(absl::StrCat("tensor ", tensor, ": region outside ",
                                                t.shm().path()));
    }
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", t.shm().path()));
    const uint8_t* base = static_cast<const uint8_t*>(p) + t.shm().offset();
    std::vector<uint8_t> out(base, base + t.shm().size_bytes());
    munmap(p, static_cast<size_t>(st.st_size));
    return out;
  }
  return absl::NotFoundError(absl::StrCat("no tensor ", tensor));
}

}  // namespace refit::e2e
