#include "daemon/publisher/persist_dir.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::testing::HasSubstr;

std::string NewDir(const std::string& tag) {
  std::string tmpl =
      (std::filesystem::temp_directory_path() / absl::StrCat("refit-persist-", tag, "-XXXXXX"))
          .string();
  return mkdtemp(tmpl.data());
}

TEST(PersistDirTest, OnePublisherPerDirectory) {
  const std::string dir = NewDir("lock");
  auto first = PersistDir::Open(dir, nullptr);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = PersistDir::Open(dir, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(dir));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use by another publisher"));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(absl::StrCat(getpid())));
  first->reset();  // released with the object
  EXPECT_TRUE(PersistDir::Open(dir, nullptr).ok());
  std::filesystem::remove_all(dir);
}

TEST(PersistDirTest, StaleTemporaryFilesAreRemovedOthersKept) {
  const std::string dir = NewDir("stale");
  for (const char* name : {"baseline.safetensors.tmp-Ab12Cd", "lineage.tmp-xyzXYZ",
                           "baseline.safetensors", "notes.txt"}) {
    std::ofstream(std::filesystem::path(dir) / name) << "x";
  }
  std::vector<std::string> removed;
  auto d = PersistDir::Open(dir, &removed);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir) / "lineage.tmp-xyzXYZ"));
  EXPECT_FALSE(
      std::filesystem::exists(std::filesystem::path(dir) / "baseline.safetensors.tmp-Ab12Cd"));
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "baseline.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "notes.txt"));
  std::filesystem::remove_all(dir);
}

TEST(PersistDirTest, LineageFileRoundTripAndMalformed) {
  const std::string dir = NewDir("lineage");
  auto d = PersistDir::Open(dir, nullptr);
  ASSERT_TRUE(d.ok()) << d.status();
  auto none = (*d)->ReadLineage();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE((*d)->WriteLineage({.lineage = 0xabcdef0123456789ull, .numbered = 42}, true).ok());
  auto back = (*d)->ReadLineage();
  ASSERT_TRUE(back.ok() && back->has_value()) << back.status();
  EXPECT_EQ((*back)->lineage, 0xabcdef0123456789ull);
  EXPECT_EQ((*back)->numbered, 42u);
  std::ofstream((*d)->lineage_path()) << "refit-lineage 1\nlineage zz\nnumbered 1\n";
  auto bad = (*d)->ReadLineage();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr((*d)->lineage_path()));
  std::filesystem::remove_all(dir);
}

TEST(PersistDirTest, MoveAsideKeepsTheFile) {
  const std::string dir = NewDir("aside");
  auto d = PersistDir::Open(dir, nullptr);
  ASSERT_TRUE(d.ok()) << d.status();
  std::vector<std::string> moved;
  for (int i = 0; i < 2; ++i) {
    std::ofstream((*d)->baseline_path()) << "corrupt " << i;
    auto to = (*d)->MoveAside((*d)->baseline_path());
    ASSERT_TRUE(to.ok()) << to.status();
    EXPECT_THAT(*to, HasSubstr("baseline.corrupt-"));
    EXPECT_TRUE(std::filesystem::exists(*to));
    moved.push_back(*to);
  }
  EXPECT_NE(moved[0], moved[1]) << "a second refusal in the same second keeps the first file";
  EXPECT_FALSE(std::filesystem::exists((*d)->baseline_path()));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::publisher
