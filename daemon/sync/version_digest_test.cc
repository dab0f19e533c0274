#include "daemon/sync/version_digest.h"

#include <string>
#include <vector>

#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/sync/sync_testing.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;
using testing::Spec;

TEST(FrameChecksum, IsHash64WithFrameSeed) {
  const std::string payload = "hello frames";
  EXPECT_EQ(FrameChecksum(payload),
            Hash64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(payload.data()),
                                            payload.size()),
                   0x526566697446726Dull));
  EXPECT_NE(FrameChecksum(std::string("a")), FrameChecksum(std::string("b")));
}

TEST(VersionDigest, MatchesTheNormativeByteLayout) {
  std::vector<v1::TensorSpec> m = {Spec("a", v1::DTYPE_BF16, {2, 3}), Spec("bb", v1::DTYPE_F32, {})};
  std::vector<uint64_t> d = {0x1122334455667788ull, 42};
  // Hand-written encoding of the definition in common.proto.
  std::vector<uint8_t> buf = {1, 0, 0, 0, 'a', 1, 2};
  auto u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  u64(2);
  u64(3);
  u64(0x1122334455667788ull);
  for (int b : {2, 0, 0, 0, int('b'), int('b'), 3, 0}) buf.push_back(static_cast<uint8_t>(b));
  u64(42);
  REFIT_ASSERT_OK_AND_ASSIGN(auto got, VersionDigest(m, d));
  EXPECT_EQ(got, Hash64(buf, 0x5265666974566572ull));
}

TEST(VersionDigest, EmptyIsZeroAndEveryFieldMatters) {
  EXPECT_EQ(*VersionDigest({}, {}), 0u);
  std::vector<v1::TensorSpec> m = {Spec("a", v1::DTYPE_BF16, {4})};
  const uint64_t base = *VersionDigest(m, std::vector<uint64_t>{7});
  EXPECT_NE(base, *VersionDigest(m, std::vector<uint64_t>{8}));
  EXPECT_NE(base, *VersionDigest(std::vector{Spec("b", v1::DTYPE_BF16, {4})}, std::vector<uint64_t>{7}));
  EXPECT_NE(base, *VersionDigest(std::vector{Spec("a", v1::DTYPE_F16, {4})}, std::vector<uint64_t>{7}));
  EXPECT_NE(base, *VersionDigest(std::vector{Spec("a", v1::DTYPE_BF16, {2, 2})}, std::vector<uint64_t>{7}));
  EXPECT_EQ(VersionDigest(m, std::vector<uint64_t>{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<v1::TensorSpec> unsorted = {Spec("b", v1::DTYPE_BF16, {1}), Spec("a", v1::DTYPE_BF16, {1})};
  EXPECT_EQ(VersionDigest(unsorted, std::vector<uint64_t>{1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Manifest, ByteSizes) {
  EXPECT_EQ(*TensorByteSize(Spec("s", v1::DTYPE_F64, {})), 8u);
  EXPECT_EQ(*TensorByteSize(Spec("e", v1::DTYPE_BF16, {0, 1ull << 62, 1ull << 62})), 0u);
  EXPECT_EQ(*TensorByteSize(Spec("m", v1::DTYPE_BF16, {3, 5})), 30u);
  EXPECT_EQ(*ElementCount(Spec("m", v1::DTYPE_BF16, {3, 5})), 15u);
}

void ExpectInvalid(const v1::TensorSpec& s, const std::string& needle) {
  absl::Status st = ValidateTensorSpec(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << needle;
  EXPECT_NE(st.message().find(needle), absl::string_view::npos) << st;
}

TEST(Manifest, ValidationNamesTheProblem) {
  EXPECT_THAT(ValidateTensorSpec(Spec("ok", v1::DTYPE_BOOL, {1, 2})), IsOk());
  ExpectInvalid(Spec("", v1::DTYPE_BF16, {1}), "empty");
  ExpectInvalid(Spec(std::string(4097, 'x'), v1::DTYPE_BF16, {1}), "4097 bytes");
  EXPECT_THAT(ValidateTensorSpec(Spec(std::string(4096, 'x'), v1::DTYPE_BF16, {1})), IsOk());
  ExpectInvalid(Spec("bad\xff", v1::DTYPE_BF16, {1}), "UTF-8");
  ExpectInvalid(Spec("overlong\xc0\x80", v1::DTYPE_BF16, {1}), "UTF-8");
  EXPECT_THAT(ValidateTensorSpec(Spec("caf\xc3\xa9", v1::DTYPE_BF16, {1})), IsOk());
  ExpectInvalid(Spec("nodtype", v1::DTYPE_UNSPECIFIED, {1}), "dtype");
  ExpectInvalid(Spec("baddtype", static_cast<v1::DType>(99), {1}), "dtype");
  ExpectInvalid(Spec("rank", v1::DTYPE_U8, std::vector<uint64_t>(256, 1)), "rank 256");
  EXPECT_THAT(ValidateTensorSpec(Spec("rank", v1::DTYPE_U8, std::vector<uint64_t>(255, 1))),
              IsOk());
  ExpectInvalid(Spec("big", v1::DTYPE_U8, {1ull << 32, 1ull << 31}), "63 bits");
  ExpectInvalid(Spec("bytes", v1::DTYPE_F64, {1ull << 62}), "overflows");
}

TEST(Manifest, SortedUniqueAndSortHelper) {
  std::vector<v1::TensorSpec> m = {Spec("b", v1::DTYPE_BF16, {1}), Spec("a", v1::DTYPE_BF16, {2}),
                                   Spec("B", v1::DTYPE_BF16, {3})};
  std::vector<uint64_t> d = {1, 2, 3};
  absl::Status st = ValidateManifest(m);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("ascending"), absl::string_view::npos) << st;
  SortManifest(m, &d);
  ASSERT_THAT(ValidateManifest(m), IsOk());
  EXPECT_EQ(m[0].name(), "B");  // bytewise: uppercase first
  EXPECT_EQ(m[1].name(), "a");
  EXPECT_EQ(d, (std::vector<uint64_t>{3, 2, 1}));
  m.push_back(Spec("b", v1::DTYPE_BF16, {1}));
  st = ValidateManifest(m);
  EXPECT_NE(st.message().find("duplicate"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("index 3"), absl::string_view::npos) << st;
  // Bytewise order treats UTF-8 bytes as unsigned.
  std::vector<v1::TensorSpec> u = {Spec("z", v1::DTYPE_BF16, {1}), Spec("\xc3\xa9", v1::DTYPE_BF16, {1})};
  EXPECT_THAT(ValidateManifest(u), IsOk());
}

TEST(DType, ProtoRoundTrip) {
  for (int c = 1; c <= 15; ++c) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto d, FromProtoDType(static_cast<v1::DType>(c)));
    EXPECT_EQ(ToProtoDType(d), static_cast<v1::DType>(c));
  }
  EXPECT_THAT(FromProtoDType(v1::DTYPE_UNSPECIFIED), Not(IsOk()));
}

}  // namespace
}  // namespace refit::sync
