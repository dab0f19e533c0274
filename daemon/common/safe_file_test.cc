#include "daemon/common/safe_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <string>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;

class TempTree {
 public:
  TempTree() {
    char tmpl[] = "/tmp/refit-safe-file-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempTree() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> DirEntries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Every confined-read test runs with openat2 and with the openat(O_NOFOLLOW) walk.
class SafeReadTest : public ::testing::TestWithParam<bool> {
 protected:
  SafeReadTest() {
    SetOpenat2DisabledForTesting(GetParam());
    std::filesystem::create_directories(t_ / "root/sub");
    WriteText(t_ / "root/sub/ok.bin", "hello");
    WriteText(t_ / "secret", "do not read");
    roots_ = {t_ / "root"};
  }
  ~SafeReadTest() override { SetOpenat2DisabledForTesting(false); }

  absl::StatusOr<UniqueFd> Open(const std::string& path) {
    return OpenRegularFileBeneath(path, roots_, "publisher.files.publish_dirs");
  }

  TempTree t_;
  std::vector<std::string> roots_;
};

TEST_P(SafeReadTest, ReadsARegularFileInsideARoot) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto fd, Open(t_ / "root/sub/ok.bin"));
  REFIT_ASSERT_OK_AND_ASSIGN(auto bytes, ReadWholeFile(fd.get(), "ok.bin"));
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), "hello");
}

TEST_P(SafeReadTest, RefusesAPathOutsideEveryRootNamingTheField) {
  auto fd = Open(t_ / "secret");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(fd.status().message(), HasSubstr("publisher.files.publish_dirs"));
  EXPECT_THAT(fd.status().message(), HasSubstr(t_ / "secret"));
}

TEST_P(SafeReadTest, RefusesDotDotComponents) {
  auto fd = Open(t_ / "root/../secret");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(), HasSubstr("\"..\" component"));
}

TEST_P(SafeReadTest, RefusesARelativeSymlinkOutOfTheRoot) {
  ASSERT_EQ(::symlink("../../secret", (t_ / "root/sub/rel").c_str()), 0);
  auto fd = Open(t_ / "root/sub/rel");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
}

TEST_P(SafeReadTest, RefusesAnAbsoluteSymlink) {
  ASSERT_EQ(::symlink((t_ / "secret").c_str(), (t_ / "root/abs").c_str()), 0);
  auto fd = Open(t_ / "root/abs");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
}

TEST_P(SafeReadTest, RefusesADirectorySymlinkOutOfTheRoot) {
  ASSERT_EQ(::symlink(t_.path().c_str(), (t_ / "root/up").c_str()), 0);
  auto fd = Open(t_ / "root/up/secret");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
}

TEST_P(SafeReadTest, AFifoIsRefusedPromptlyNamingItsType) {
  ASSERT_EQ(::mkfifo((t_ / "root/fifo").c_str(), 0600), 0);
  auto fd = Open(t_ / "root/fifo");  // no writer: a blocking open would never return
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(), HasSubstr("is a FIFO, not a regular file"));
}

TEST_P(SafeReadTest, ADirectoryIsRefused) {
  auto fd = Open(t_ / "root/sub");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(), HasSubstr("is a directory"));
}

TEST_P(SafeReadTest, NoRootsMeansReadingIsDisabled) {
  auto fd = OpenRegularFileBeneath(t_ / "root/sub/ok.bin", {}, "publisher.files.publish_dirs");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fd.status().message(), HasSubstr("publisher.files.publish_dirs is empty"));
}

INSTANTIATE_TEST_SUITE_P(Openat2AndWalk, SafeReadTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Walk" : "Openat2"; });

TEST(OpenRegularFileTest, DeviceNodeIsRefused) {
  auto fd = OpenRegularFile("/dev/null");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(), HasSubstr("\"/dev/null\" is a character device"));
}

TEST(OpenRegularFileTest, FifoIsRefusedPromptly) {
  TempTree t;
  ASSERT_EQ(::mkfifo((t / "fifo").c_str(), 0600), 0);
  auto fd = OpenRegularFile(t / "fifo");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(), HasSubstr("is a FIFO"));
}

TEST(OpenRegularFileTest, MissingFileIsNotFound) {
  TempTree t;
  EXPECT_EQ(OpenRegularFile(t / "none").status().code(), absl::StatusCode::kNotFound);
}

TEST(ReadAtTest, AFileThatShrinksWhileReadIsAnErrorNotACrash) {
  TempTree t;
  const std::string path = t / "big";
  WriteText(path, std::string(1 << 20, 'x'));
  REFIT_ASSERT_OK_AND_ASSIGN(auto fd, OpenRegularFile(path));
  SetReadHookForTesting([&](const std::string&, uint64_t) { ::truncate(path.c_str(), 100); });
  auto bytes = ReadWholeFile(fd.get(), path);
  SetReadHookForTesting(nullptr);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bytes.status().message(), HasSubstr(path + "\" shrank while being read"));
}

// The parallel reader: a file truncated under it (chunks on both threads) is DataLoss naming it,
// never SIGBUS; a released image is reused and then holds the new file's bytes.
TEST(ReadWholeFileImageTest, ShrinkingIsAnErrorAndReusedImagesHoldTheNewBytes) {
  TempTree t;
  const std::string path = t / "big";
  std::string text(20 << 20, 'x');
  for (size_t i = 0; i < text.size(); i += 4096) text[i] = static_cast<char>('a' + i % 26);
  WriteText(path, text);
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto fd, OpenRegularFile(path));
    REFIT_ASSERT_OK_AND_ASSIGN(auto image, ReadWholeFileImage(fd.get(), path, 2));
    ASSERT_EQ(image.size(), text.size());
    EXPECT_EQ(std::memcmp(image.data(), text.data(), text.size()), 0);
  }  // released: kept for reuse
  std::string other(text.size(), 'y');
  WriteText(path, other);
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto fd, OpenRegularFile(path));
    REFIT_ASSERT_OK_AND_ASSIGN(auto image, ReadWholeFileImage(fd.get(), path, 2));
    EXPECT_EQ(std::memcmp(image.data(), other.data(), other.size()), 0);
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto fd, OpenRegularFile(path));
  SetReadHookForTesting([&](const std::string&, uint64_t offset) {
    if (offset >= (8u << 20)) ::truncate(path.c_str(), 100);
  });
  auto shrunk = ReadWholeFileImage(fd.get(), path, 2);
  SetReadHookForTesting(nullptr);
  EXPECT_EQ(shrunk.status().code(), absl::StatusCode::kDataLoss) << shrunk.status();
  EXPECT_THAT(shrunk.status().message(), HasSubstr(path + "\" shrank while being read"));
}

TEST(ReadWholeFileTest, RefusesAFileOverTheLimit) {
  TempTree t;
  WriteText(t / "f", "0123456789");
  REFIT_ASSERT_OK_AND_ASSIGN(auto fd, OpenRegularFile(t / "f"));
  EXPECT_EQ(ReadWholeFile(fd.get(), t / "f", 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

absl::Status WriteFile(const std::string& path, const SafeWriteOptions& options,
                       const std::string& text = "data") {
  auto f = AtomicFile::Create(path, options);
  if (!f.ok()) return f.status();
  absl::Status s =
      f->Write({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  if (!s.ok()) return s;
  return f->Commit();
}

class AtomicFileTest : public ::testing::Test {
 protected:
  AtomicFileTest() {
    std::filesystem::create_directories(t_ / "export/sub");
    options_.root = t_ / "export";
    options_.root_field = "publisher.files.export_dir";
  }
  TempTree t_;
  SafeWriteOptions options_;
};

TEST_F(AtomicFileTest, WritesMode0600WhateverTheUmask) {
  for (const mode_t umask_value : {mode_t{0}, mode_t{077}, mode_t{022}}) {
    const mode_t old = ::umask(umask_value);
    ASSERT_THAT(WriteFile(t_ / "export/out", options_), IsOk());
    ::umask(old);
    struct stat st;
    ASSERT_EQ(::stat((t_ / "export/out").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << "umask " << umask_value;
  }
  options_.mode = 0640;
  ASSERT_THAT(WriteFile(t_ / "export/out", options_), IsOk());
  struct stat st;
  ASSERT_EQ(::stat((t_ / "export/out").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
}

TEST_F(AtomicFileTest, AcceptsAPathRelativeToTheRootAndReplacesARegularFile) {
  WriteText(t_ / "export/sub/out", "old");
  ASSERT_THAT(WriteFile("sub/out", options_, "new"), IsOk());
  EXPECT_EQ(ReadText(t_ / "export/sub/out"), "new");
  EXPECT_EQ(DirEntries(t_ / "export/sub"), std::vector<std::string>{"out"});
}

TEST_F(AtomicFileTest, RefusesAPathOutsideTheRoot) {
  absl::Status s = WriteFile(t_ / "elsewhere", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("publisher.files.export_dir"));
  EXPECT_FALSE(std::filesystem::exists(t_ / "elsewhere"));
  EXPECT_EQ(WriteFile("../elsewhere", options_).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AtomicFileTest, RefusesADirectorySymlinkOutOfTheRoot) {
  std::filesystem::create_directories(t_ / "outside");
  ASSERT_EQ(::symlink((t_ / "outside").c_str(), (t_ / "export/link").c_str()), 0);
  EXPECT_EQ(WriteFile(t_ / "export/link/out", options_).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(std::filesystem::is_empty(t_ / "outside"));
}

TEST_F(AtomicFileTest, NeverReplacesAFifoASymlinkOrADeviceNode) {
  ASSERT_EQ(::mkfifo((t_ / "export/fifo").c_str(), 0600), 0);
  WriteText(t_ / "victim", "keep");
  ASSERT_EQ(::symlink((t_ / "victim").c_str(), (t_ / "export/link").c_str()), 0);
  ASSERT_EQ(::symlink("/dev/null", (t_ / "export/null").c_str()), 0);
  for (const char* name : {"fifo", "link", "null"}) {
    absl::Status s = WriteFile(t_ / "export" + "/" + name, options_);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << name << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("only a regular file is ever replaced"));
  }
  struct stat st;
  ASSERT_EQ(::lstat((t_ / "export/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(::lstat((t_ / "export/link").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  EXPECT_EQ(ReadText(t_ / "victim"), "keep");
  // No temporary file is left behind.
  EXPECT_EQ(DirEntries(t_ / "export"), (std::vector<std::string>{"fifo", "link", "null", "sub"}));
}

TEST_F(AtomicFileTest, RefusesADirectoryTarget) {
  absl::Status s = WriteFile(t_ / "export/sub", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is a directory"));
}

TEST_F(AtomicFileTest, TempFileIsRemovedWhenNotCommitted) {
  {
    auto f = AtomicFile::Create(t_ / "export/out", options_);
    ASSERT_THAT(f, IsOk());
    EXPECT_EQ(DirEntries(t_ / "export").size(), 2u);  // sub and the temporary file
  }
  EXPECT_EQ(DirEntries(t_ / "export"), std::vector<std::string>{"sub"});
}

TEST_F(AtomicFileTest, RefusesAForbiddenDirectory) {
  std::filesystem::create_directories(t_ / "export/persist");
  options_.forbidden_dirs = {{t_ / "export/persist", "publisher.baseline.persist_dir"}};
  absl::Status s = WriteFile(t_ / "export/persist/baseline.safetensors", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("publisher.baseline.persist_dir"));
  EXPECT_TRUE(std::filesystem::is_empty(t_ / "export/persist"));
}

TEST(AtomicFileUnconfinedTest, WritesAnyDirectoryButStillNeverReplacesAFifo) {
  TempTree t;
  ASSERT_THAT(WriteFile(t / "plain", {}), IsOk());
  EXPECT_EQ(ReadText(t / "plain"), "data");
  ASSERT_EQ(::mkfifo((t / "fifo").c_str(), 0600), 0);
  EXPECT_EQ(WriteFile(t / "fifo", {}).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace refit
