// A trainer's shared-memory object (ShmRegion of local.proto) opened read-only and checked
// (OpenShmObject: the rules in trainer_api.h's top comment), sealed against shrinking
// (SealAgainstShrinking); and the small helpers of opening it (FdCloser).
#ifndef REFIT_DAEMON_PUBLISHER_SHM_OBJECT_H_
#define REFIT_DAEMON_PUBLISHER_SHM_OBJECT_H_

#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/peer_cred.h"
#include "refit/v1/local.pb.h"

namespace refit::publisher {

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

// A shared-memory object a ShmRegion names, opened read-only and checked (see the top comment).
struct ShmObject {
  int fd = -1;       // owned by the caller
  std::string name;  // "file \"/proc/12/fd/5\"", "shm object \"/w\"", for messages
  struct stat st = {};
};
// `what` prefixes errors. Codes: InvalidArgument (malformed name or path, not a regular file),
// NotFound, PermissionDenied (another process's fd, a path outside /proc/<pid>/fd and /dev/shm,
// not shared memory, another owner, world-writable).
absl::StatusOr<ShmObject> OpenShmObject(const v1::ShmRegion& region, const std::string& what,
                                        const std::optional<PeerCred>& peer);
// Makes sure the object behind `fd` can never shrink: true when it is sealed F_SEAL_SHRINK
// already or the seals F_SEAL_SHRINK | F_SEAL_GROW could be added now.
bool SealAgainstShrinking(int fd);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_SHM_OBJECT_H_
