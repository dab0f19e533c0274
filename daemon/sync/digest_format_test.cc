#include "daemon/sync/digest_format.h"

#include <cstdint>
#include <vector>

#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

std::vector<uint8_t> Bytes(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 131 + 7);
  return b;
}

TEST(DigestFormatTest, MapsEachFormatToItsDigestFunction) {
  const std::vector<uint8_t> b = Bytes(100003);
  EXPECT_EQ(TensorDigestOf(DigestFormat::kV1, b, 1), TensorDigest(b, 1));
  EXPECT_EQ(TensorDigestOf(DigestFormat::kV2, b, 1), TensorDigestV2(b, 1));
  EXPECT_NE(TensorDigestOf(DigestFormat::kV1, b, 1), TensorDigestOf(DigestFormat::kV2, b, 1));
}

TEST(DigestFormatTest, WireValues) {
  EXPECT_EQ(*DigestFormatFromWire(0), DigestFormat::kV1);  // absent field: old publisher
  EXPECT_EQ(*DigestFormatFromWire(1), DigestFormat::kV1);
  EXPECT_EQ(*DigestFormatFromWire(2), DigestFormat::kV2);
  EXPECT_EQ(DigestFormatFromWire(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DigestFormatToWire(DigestFormat::kV2), 2u);
  EXPECT_STREQ(DigestFormatName(DigestFormat::kV2), "v2");
}

TEST(DigestFormatTest, PublisherPicksV2OnlyWhenOffered) {
  EXPECT_EQ(ChooseDigestFormat({}), DigestFormat::kV1);  // old subscriber: no field
  const std::vector<uint32_t> v2 = {2};
  const std::vector<uint32_t> unknown = {7, 9};
  const std::vector<uint32_t> mixed = {7, 2};
  EXPECT_EQ(ChooseDigestFormat(v2), DigestFormat::kV2);
  EXPECT_EQ(ChooseDigestFormat(unknown), DigestFormat::kV1);
  EXPECT_EQ(ChooseDigestFormat(mixed), DigestFormat::kV2);
  EXPECT_EQ(ChooseDigestFormat(v2, /*allow_v2=*/false), DigestFormat::kV1);
}

}  // namespace
}  // namespace refit::sync
