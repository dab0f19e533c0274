// PersistDir: the publisher's baseline.persist_dir, owned by one process at a time.
//   - an exclusive flock on persist_dir/lock for the life of the object (a second publisher on
//     the same directory fails at start, naming the directory);
//   - temporary files of interrupted writes (baseline.safetensors.tmp-*, lineage.tmp-*,
//     patches.log.tmp-*) removed at open: while the lock is held nobody else writes there, so
//     they are stale;
//   - the lineage file (persist_dir/lineage): the publisher's lineage and the highest version it
//     ever numbered in it, written before a version becomes visible (data.proto "Versions and
//     lineage");
//   - moving a refused baseline aside (baseline.corrupt-<unix seconds>.safetensors), or a
//     refused patch log (patches.corrupt-<unix seconds>.log).
#ifndef REFIT_DAEMON_SERVING_PERSIST_DIR_H_
#define REFIT_DAEMON_SERVING_PERSIST_DIR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::publisher {

struct LineageState {
  uint64_t lineage = 0;   // never 0 in a valid file
  uint64_t numbered = 0;  // highest version numbered in this lineage (0 = none)
};

class PersistDir {
 public:
  // Creates `dir` if missing, takes the lock (FailedPrecondition "... is in use by another
  // publisher (pid N)" when held), removes stale temporary files (their paths in `removed`).
  static absl::StatusOr<std::unique_ptr<PersistDir>> Open(const std::string& dir,
                                                          std::vector<std::string>* removed);
  ~PersistDir();  // releases the lock
  PersistDir(const PersistDir&) = delete;
  PersistDir& operator=(const PersistDir&) = delete;

  const std::string& dir() const { return dir_; }
  // persist_dir/baseline.safetensors, persist_dir/lineage and persist_dir/patches.log.
  std::string baseline_path() const;
  std::string lineage_path() const;
  std::string log_path() const;

  // The lineage file: nullopt when absent; DataLoss naming the file when unreadable or
  // malformed.
  absl::StatusOr<std::optional<LineageState>> ReadLineage() const;
  // Writes it atomically (temporary file + rename; fsync of file and directory with `fsync`).
  absl::Status WriteLineage(const LineageState& state, bool fsync) const;

  // Renames `path` to persist_dir/baseline.corrupt-<unix seconds>[-N].safetensors; returns the
  // new path.
  absl::StatusOr<std::string> MoveAside(const std::string& path) const;
  // Renames `path` to persist_dir/patches.corrupt-<unix seconds>[-N].log.
  absl::StatusOr<std::string> MoveLogAside(const std::string& path) const;

 private:
  PersistDir(std::string dir, int lock_fd) : dir_(std::move(dir)), lock_fd_(lock_fd) {}
  absl::StatusOr<std::string> MoveAsideAs(const std::string& path, const char* stem,
                                          const char* suffix) const;
  const std::string dir_;
  const int lock_fd_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PERSIST_DIR_H_
