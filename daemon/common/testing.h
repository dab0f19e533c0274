// Helpers for the tests of daemon/ and client/ (not for production code): a temporary
// directory, whole-file reads, RPC deadlines, memfd-backed tensor memory and its locations.
#ifndef REFIT_DAEMON_COMMON_TESTING_H_
#define REFIT_DAEMON_COMMON_TESTING_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "refit/v1/local.pb.h"

namespace refit::testing {

// A fresh directory under the system temp directory, removed with everything in it on
// destruction. `prefix` names it (e.g. "refit-pubd").
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "refit-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A fresh, empty directory <system temp>/<prefix>-XXXXXX for tests that hand a path around
// rather than hold a TempDir: removed with everything in it when the test binary exits
// normally (so repeated runs leave nothing behind; a crashed run may).
std::string ScratchDir(const std::string& prefix);

// The contents of the file at `path` ("" when it cannot be read).
std::string ReadFile(const std::string& path);

// A gRPC deadline `seconds` from now.
std::chrono::system_clock::time_point Deadline(int seconds = 30);

// A shared-memory file of `bytes` (zero-filled, mapped read-write), addressed as
// /proc/self/fd/N: valid for a daemon running in this process.
class Memfd {
 public:
  // `allow_sealing`: MFD_ALLOW_SEALING, as TrainerClient creates its memfd (the publisher then
  // seals it against resizing and maps it); without, the publisher reads it with pread.
  explicit Memfd(size_t bytes, bool allow_sealing = true);
  int fd() const { return fd_; }
  ~Memfd();
  Memfd(const Memfd&) = delete;
  Memfd& operator=(const Memfd&) = delete;

  std::string path() const;
  uint8_t* data() { return map_; }
  size_t size() const { return size_; }

 private:
  int fd_ = -1;
  size_t size_ = 0;
  uint8_t* map_ = nullptr;
};

// A TensorApi/ConsumerApi tensor location: `size` bytes at `offset` of the shared-memory file
// `path`, holding tensor `name` of `dtype` and `shape`.
v1::TensorLocation Location(const std::string& name, v1::DType dtype,
                            const std::vector<uint64_t>& shape, const std::string& path,
                            uint64_t offset, uint64_t size);

}  // namespace refit::testing

#endif  // REFIT_DAEMON_COMMON_TESTING_H_
