#include "daemon/common/testing.h"

#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace refit::testing {

TempDir::TempDir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr) << tmpl;
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string ScratchDir(const std::string& prefix) {
  // Destroyed at a normal exit: each TempDir removes its directory then.
  static std::mutex mu;
  static std::vector<std::unique_ptr<TempDir>> dirs;
  auto dir = std::make_unique<TempDir>(prefix);
  std::string path = dir->path();
  std::lock_guard<std::mutex> lock(mu);
  dirs.push_back(std::move(dir));
  return path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::chrono::system_clock::time_point Deadline(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

Memfd::Memfd(size_t bytes, bool allow_sealing) : size_(bytes) {
  fd_ = memfd_create("refit-test", MFD_CLOEXEC | (allow_sealing ? MFD_ALLOW_SEALING : 0));
  EXPECT_GE(fd_, 0);
  EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  EXPECT_NE(map, MAP_FAILED);
  if (map != MAP_FAILED) map_ = static_cast<uint8_t*>(map);
}

Memfd::~Memfd() {
  if (map_ != nullptr) munmap(map_, size_);
  if (fd_ >= 0) close(fd_);
}

std::string Memfd::path() const { return absl::StrCat("/proc/self/fd/", fd_); }

v1::TensorLocation Location(const std::string& name, v1::DType dtype,
                            const std::vector<uint64_t>& shape, const std::string& path,
                            uint64_t offset, uint64_t size) {
  v1::TensorLocation l;
  l.mutable_spec()->set_name(name);
  l.mutable_spec()->set_dtype(dtype);
  for (uint64_t d : shape) l.mutable_spec()->add_shape(d);
  l.mutable_shm()->set_path(path);
  l.mutable_shm()->set_offset(offset);
  l.mutable_shm()->set_size_bytes(size);
  return l;
}

}  // namespace refit::testing
