#include "daemon/serving/persist_dir.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string NewDir(const std::string& tag) {
  return testing::ScratchDir(absl::StrCat("refit-persist-", tag));
}

TEST(PersistDirTest, OnePublisherPerDirectory) {
  const std::string dir = NewDir("lock");
  REFIT_ASSERT_OK_AND_ASSIGN(auto first, PersistDir::Open(dir, nullptr));
  auto second = PersistDir::Open(dir, nullptr);
  ASSERT_THAT(second, StatusIs(absl::StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr(dir), HasSubstr("in use by another publisher"),
                                     HasSubstr(absl::StrCat(getpid())))));
  first.reset();  // released with the object
  EXPECT_THAT(PersistDir::Open(dir, nullptr), IsOk());
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
  ASSERT_THAT(d, IsOk());
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
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, PersistDir::Open(dir, nullptr));
  REFIT_ASSERT_OK_AND_ASSIGN(auto none, d->ReadLineage());
  EXPECT_FALSE(none.has_value());
  ASSERT_THAT(d->WriteLineage({.lineage = 0xabcdef0123456789ull, .numbered = 42}, true), IsOk());
  auto back = d->ReadLineage();
  ASSERT_TRUE(back.ok() && back->has_value()) << back.status();
  EXPECT_EQ((*back)->lineage, 0xabcdef0123456789ull);
  EXPECT_EQ((*back)->numbered, 42u);
  std::ofstream(d->lineage_path()) << "refit-lineage 1\nlineage zz\nnumbered 1\n";
  auto bad = d->ReadLineage();
  ASSERT_THAT(bad, StatusIs(absl::StatusCode::kDataLoss, HasSubstr(d->lineage_path())));
  std::filesystem::remove_all(dir);
}

TEST(PersistDirTest, MoveAsideKeepsTheFile) {
  const std::string dir = NewDir("aside");
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, PersistDir::Open(dir, nullptr));
  std::vector<std::string> moved;
  for (int i = 0; i < 2; ++i) {
    std::ofstream(d->baseline_path()) << "corrupt " << i;
    REFIT_ASSERT_OK_AND_ASSIGN(auto to, d->MoveAside(d->baseline_path()));
    EXPECT_THAT(to, HasSubstr("baseline.corrupt-"));
    EXPECT_TRUE(std::filesystem::exists(to));
    moved.push_back(to);
  }
  EXPECT_NE(moved[0], moved[1]) << "a second refusal in the same second keeps the first file";
  EXPECT_FALSE(std::filesystem::exists(d->baseline_path()));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::publisher
