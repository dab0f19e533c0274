// The patch log format (patch_log.h; docs/ARCHITECTURE.md "Patch log format, version 1"):
// round trip, torn tails, corrupt records, the golden file, and ReplayLog's lineage and chain
// checks.
#include "daemon/serving/patch_log.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/serving/baseline_persister.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  return testing::ScratchDir(absl::StrCat("patch_log_test-", name));
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::shared_ptr<const std::vector<uint8_t>> Bytes(std::vector<uint8_t> v) {
  return std::make_shared<const std::vector<uint8_t>>(std::move(v));
}

v1::TensorSpec Spec(const std::string& name, const std::vector<uint64_t>& shape) {
  v1::TensorSpec s;
  s.set_name(name);
  s.set_dtype(v1::DTYPE_BF16);
  for (uint64_t d : shape) s.add_shape(d);
  return s;
}

// The golden log's content: lineage 0x1122334455667788 after baseline version 1; version 2
// (one patch, one unchanged, one dense tensor) and version 5 (the dense one patched). The
// "patch" bytes are opaque to the log (the history checks them on replay).
LogHeader GoldenHeader() { return {.lineage = 0x1122334455667788ull, .base_version = 1}; }

std::vector<LogRecord> GoldenRecords() {
  LogRecord a;
  a.version = 2;
  a.base_version = 1;
  a.version_digest = 0x0102030405060708ull;
  a.lineage = 0x1122334455667788ull;
  a.snapshot_unix_nanos = 1764590400000000000ull;
  a.tensors.push_back({.spec = Spec("a.weight", {2, 3}),
                       .kind = LogTensorKind::kPatch,
                       .digest = 0xa1,
                       .changed_elements = 2,
                       .bytes = Bytes({9, 8, 7, 6, 5})});
  a.tensors.push_back({.spec = Spec("b.bias", {3}),
                       .kind = LogTensorKind::kUnchanged,
                       .digest = 0xb2,
                       .changed_elements = 0,
                       .bytes = nullptr});
  a.tensors.push_back({.spec = Spec("c.new", {2}),
                       .kind = LogTensorKind::kDense,
                       .digest = 0xc3,
                       .changed_elements = 2,
                       .bytes = Bytes({1, 2, 3, 4})});
  LogRecord b = a;
  b.version = 5;
  b.base_version = 2;
  b.version_digest = 0x1020304050607080ull;
  b.snapshot_unix_nanos += 1000;
  b.tensors[0] = {.spec = Spec("a.weight", {2, 3}),
                  .kind = LogTensorKind::kUnchanged,
                  .digest = 0xa1,
                  .changed_elements = 0,
                  .bytes = nullptr};
  b.tensors[2] = {.spec = Spec("c.new", {2}),
                  .kind = LogTensorKind::kPatch,
                  .digest = 0xc4,
                  .changed_elements = 1,
                  .bytes = Bytes({0xff})};
  return {a, b};
}

// Writes the golden content with PatchLogWriter.
void WriteGolden(const std::string& path) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto w, PatchLogWriter::Create(path, GoldenHeader(), /*fsync=*/false));
  for (const LogRecord& r : GoldenRecords()) ASSERT_THAT(w->Append(r), IsOk());
}

void ExpectSameRecord(const LogRecord& got, const LogRecord& want) {
  EXPECT_EQ(got.version, want.version);
  EXPECT_EQ(got.base_version, want.base_version);
  EXPECT_EQ(got.version_digest, want.version_digest);
  EXPECT_EQ(got.lineage, want.lineage);
  EXPECT_EQ(got.snapshot_unix_nanos, want.snapshot_unix_nanos);
  EXPECT_EQ(got.digests_v2, want.digests_v2);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    const LogTensor& g = got.tensors[i];
    const LogTensor& w = want.tensors[i];
    EXPECT_TRUE(sync::SameSpec(g.spec, w.spec)) << g.spec.ShortDebugString();
    EXPECT_EQ(g.kind, w.kind) << w.spec.name();
    EXPECT_EQ(g.digest, w.digest) << w.spec.name();
    EXPECT_EQ(g.changed_elements, w.changed_elements) << w.spec.name();
    EXPECT_EQ(g.bytes == nullptr, w.bytes == nullptr) << w.spec.name();
    if (g.bytes != nullptr && w.bytes != nullptr) {
      EXPECT_EQ(*g.bytes, *w.bytes) << w.spec.name();
    }
  }
}

TEST(PatchLogTest, RoundTrip) {
  const std::string path = TempDir("roundtrip") + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(path));
  auto read = ReadPatchLog(path);
  ASSERT_THAT(read, IsOk());
  EXPECT_EQ(read->header.lineage, GoldenHeader().lineage);
  EXPECT_EQ(read->header.base_version, 1u);
  EXPECT_FALSE(read->torn_tail);
  EXPECT_THAT(read->corrupt, IsOk());
  EXPECT_EQ(read->valid_end, read->file_bytes);
  ASSERT_EQ(read->records.size(), 2u);
  EXPECT_EQ(read->offsets[0], kPatchLogHeaderBytes);
  for (size_t i = 0; i < 2; ++i) ExpectSameRecord(read->records[i], GoldenRecords()[i]);

  // Appending continues the same file.
  REFIT_ASSERT_OK_AND_ASSIGN(auto w, PatchLogWriter::OpenForAppend(path, read->valid_end, false));
  LogRecord c = GoldenRecords()[1];
  c.version = 6;
  c.base_version = 5;
  ASSERT_THAT(w->Append(c), IsOk());
  read = ReadPatchLog(path);
  ASSERT_THAT(read, IsOk());
  ASSERT_EQ(read->records.size(), 3u);
  EXPECT_EQ(read->records[2].version, 6u);
}

TEST(PatchLogTest, GoldenFileIsFormatVersion1) {
  const std::string golden = std::string(REFIT_PATCH_LOG_TESTDATA) + "/patch_log_v1.bin";
  const std::string fresh = TempDir("golden") + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(fresh));
  if (std::getenv("REFIT_UPDATE_GOLDEN") != nullptr) {
    std::filesystem::copy_file(fresh, golden, std::filesystem::copy_options::overwrite_existing);
  }
  // The checked-in bytes decode to the golden content...
  REFIT_ASSERT_OK_AND_ASSIGN(auto read, ReadPatchLog(golden));
  ASSERT_EQ(read.records.size(), 2u);
  for (size_t i = 0; i < 2; ++i) ExpectSameRecord(read.records[i], GoldenRecords()[i]);
  // ... and a freshly written log is byte for byte the same.
  EXPECT_EQ(ReadFile(fresh), ReadFile(golden))
      << "the patch log format changed: version 1 is frozen (docs/ARCHITECTURE.md)";
  // Spot checks of the normative layout.
  const std::vector<uint8_t> bytes = ReadFile(golden);
  ASSERT_GE(bytes.size(), 72u);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 8), "REFITLOG");
  EXPECT_EQ(bytes[8], 1);  // format version, little-endian
  EXPECT_EQ(std::string(bytes.begin() + 40, bytes.begin() + 44), "RREC");
  EXPECT_EQ(bytes[68], 2);  // the first record body starts with its version
}

TEST(PatchLogTest, ARecordWithAPartIsRecordVersion2AndMixesWithVersion1) {
  const std::string path = TempDir("parts") + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(path));  // two version-1 records
  const uint64_t v1_end = ReadFile(path).size();
  LogRecord c = GoldenRecords()[1];
  c.version = 6;
  c.base_version = 5;
  v1::TensorSpec part = Spec("a.weight", {2, 3});  // rows [4, 6) of a [10, 3] tensor
  part.mutable_part()->add_whole_shape(10);
  part.mutable_part()->add_whole_shape(3);
  part.mutable_part()->set_first_row(4);
  c.tensors[0] = {.spec = part,
                  .kind = LogTensorKind::kDense,
                  .digest = 0xa7,
                  .changed_elements = 6,
                  .bytes = Bytes(std::vector<uint8_t>(12, 3))};
  LogRecord d = GoldenRecords()[1];  // no part: version 1 again
  d.version = 7;
  d.base_version = 6;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto w, PatchLogWriter::OpenForAppend(path, v1_end, false));
    ASSERT_THAT(w->Append(c), IsOk());
    ASSERT_THAT(w->Append(d), IsOk());
  }
  const std::vector<uint8_t> bytes = ReadFile(path);
  EXPECT_EQ(std::string(bytes.begin() + static_cast<ptrdiff_t>(v1_end),
                        bytes.begin() + static_cast<ptrdiff_t>(v1_end) + 4),
            "RRE2");
  REFIT_ASSERT_OK_AND_ASSIGN(auto read, ReadPatchLog(path));
  EXPECT_THAT(read.corrupt, IsOk());
  ASSERT_EQ(read.records.size(), 4u);
  EXPECT_EQ(std::string(bytes.begin() + static_cast<ptrdiff_t>(read.offsets[3]),
                        bytes.begin() + static_cast<ptrdiff_t>(read.offsets[3]) + 4),
            "RREC");
  ExpectSameRecord(read.records[2], c);
  ExpectSameRecord(read.records[3], d);
  ASSERT_TRUE(sync::IsPart(read.records[2].tensors[0].spec));
  EXPECT_EQ(read.records[2].tensors[0].spec.part().first_row(), 4u);
  EXPECT_FALSE(sync::IsPart(read.records[2].tensors[1].spec));
  // A part that leaves its whole tensor does not decode.
  c.tensors[0].spec.mutable_part()->set_first_row(9);
  const std::vector<uint8_t> record = EncodeLogRecord(c);
  EXPECT_THAT(DecodeLogRecordBody(std::span<const uint8_t>(record).subspan(kPatchRecordFrameBytes),
                                  "here", 2),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr("here: tensor entry 0"),
                                                          HasSubstr("beyond the whole tensor"))));
}

// Columns [first, first + cols) of the BF16 tensor "o" of shape [4, 6] (a part along dim 1).
v1::TensorSpec ColumnPart(uint64_t first, uint64_t cols) {
  v1::TensorSpec s = Spec("o", {4, cols});
  s.mutable_part()->add_whole_shape(4);
  s.mutable_part()->add_whole_shape(6);
  s.mutable_part()->set_first_row(first);
  s.mutable_part()->set_dim(1);
  return s;
}

uint64_t U64At(const std::vector<uint8_t>& b, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[at + i]) << (8 * i);
  return v;
}

TEST(PatchLogTest, PartsAlongDim1AreFlag2WithADimByteAndSeveralPartsOfANameRoundTrip) {
  LogRecord r = GoldenRecords()[0];
  r.tensors.clear();
  r.tensors.push_back({.spec = ColumnPart(0, 3),
                       .kind = LogTensorKind::kDense,
                       .digest = 0x11,
                       .changed_elements = 12,
                       .bytes = Bytes(std::vector<uint8_t>(24, 1))});
  r.tensors.push_back({.spec = ColumnPart(3, 3),
                       .kind = LogTensorKind::kDense,
                       .digest = 0x12,
                       .changed_elements = 12,
                       .bytes = Bytes(std::vector<uint8_t>(24, 2))});
  const std::vector<uint8_t> record = EncodeLogRecord(r);
  EXPECT_EQ(std::string(record.begin(), record.begin() + 4), "RRE2");
  const std::vector<uint8_t> body(record.begin() + kPatchRecordFrameBytes, record.end());
  // Body: 5 u64 + u32 count; entry 0 at byte 44: u16 name length, "o", dtype, kind, rank 2, 2 u64
  // dims, then the part at byte 66: flag 2, u64 first index, u8 dim, u8 whole rank, whole dims.
  ASSERT_GE(body.size(), 93u);
  EXPECT_EQ(body[44], 1);          // name length
  EXPECT_EQ(body[46], 'o');        // name
  EXPECT_EQ(body[48], 2);          // kind dense
  EXPECT_EQ(body[49], 2);          // rank
  EXPECT_EQ(U64At(body, 58), 3u);  // shape[1] (the part's columns)
  EXPECT_EQ(body[66], 2);          // part flag: along a dim other than 0
  EXPECT_EQ(U64At(body, 67), 0u);  // first index
  EXPECT_EQ(body[75], 1);          // dim
  EXPECT_EQ(body[76], 2);          // whole rank
  EXPECT_EQ(U64At(body, 77), 4u);  // whole dims
  EXPECT_EQ(U64At(body, 85), 6u);
  REFIT_ASSERT_OK_AND_ASSIGN(LogRecord back, DecodeLogRecordBody(body, "here", 2));
  ExpectSameRecord(back, r);
  EXPECT_EQ(back.tensors[1].spec.part().dim(), 1u);
  EXPECT_EQ(back.tensors[1].spec.part().first_row(), 3u);

  // Flag 2 never encodes dim 0 (flag 1 does, as before parts had a dim).
  std::vector<uint8_t> bad = body;
  bad[75] = 0;
  EXPECT_THAT(DecodeLogRecordBody(bad, "here", 2),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad part")));
  // Parts of one name out of order, or overlapping, do not decode.
  std::swap(r.tensors[0], r.tensors[1]);
  std::vector<uint8_t> swapped = EncodeLogRecord(r);
  EXPECT_THAT(DecodeLogRecordBody(std::span<const uint8_t>(swapped).subspan(kPatchRecordFrameBytes),
                                  "here", 2),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("here: tensor entry 1")));
  r.tensors[0].spec = ColumnPart(0, 4);
  r.tensors[0].bytes = Bytes(std::vector<uint8_t>(32, 1));
  r.tensors[1].spec = ColumnPart(2, 3);
  const std::vector<uint8_t> overlap = EncodeLogRecord(r);
  EXPECT_THAT(DecodeLogRecordBody(std::span<const uint8_t>(overlap).subspan(kPatchRecordFrameBytes),
                                  "here", 2),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("here: tensor entry 1")));
}

// The golden content of record version 2 with every part flag: version 6 after version 5 of the
// golden log holds "a.weight" rows [4, 6) of [10, 3] (flag 1), "o" as two column parts of [4, 6]
// (flag 2, dim 1) and "z" whole (flag 0).
LogRecord GoldenPartsRecord() {
  LogRecord r;
  r.version = 6;
  r.base_version = 5;
  r.version_digest = 0x0605040302010009ull;
  r.lineage = GoldenHeader().lineage;
  r.snapshot_unix_nanos = 1764590400000002000ull;
  v1::TensorSpec rows = Spec("a.weight", {2, 3});
  rows.mutable_part()->add_whole_shape(10);
  rows.mutable_part()->add_whole_shape(3);
  rows.mutable_part()->set_first_row(4);
  r.tensors.push_back({.spec = rows,
                       .kind = LogTensorKind::kDense,
                       .digest = 0xa8,
                       .changed_elements = 6,
                       .bytes = Bytes(std::vector<uint8_t>(12, 7))});
  r.tensors.push_back({.spec = ColumnPart(0, 3),
                       .kind = LogTensorKind::kPatch,
                       .digest = 0xd1,
                       .changed_elements = 1,
                       .bytes = Bytes({0xee, 0x01})});
  r.tensors.push_back({.spec = ColumnPart(3, 3),
                       .kind = LogTensorKind::kUnchanged,
                       .digest = 0xd2,
                       .changed_elements = 0,
                       .bytes = nullptr});
  r.tensors.push_back({.spec = Spec("z", {1}),
                       .kind = LogTensorKind::kDense,
                       .digest = 0xf1,
                       .changed_elements = 1,
                       .bytes = Bytes({0x3f, 0x80})});
  return r;
}

// Writes the golden log followed by `extra` to a fresh file (*fresh), copies it over
// testdata/`name` (*golden) when REFIT_UPDATE_GOLDEN is set, and reads the checked-in file into
// *read: the golden records, then `extra`.
void WriteAndReadGoldenWith(const LogRecord& extra, const std::string& name, std::string* golden,
                            std::string* fresh, LogReadResult* read) {
  *golden = std::string(REFIT_PATCH_LOG_TESTDATA) + "/" + name;
  *fresh = TempDir(name) + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(*fresh));
  {
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto w, PatchLogWriter::OpenForAppend(*fresh, ReadFile(*fresh).size(), false));
    ASSERT_THAT(w->Append(extra), IsOk());
  }
  if (std::getenv("REFIT_UPDATE_GOLDEN") != nullptr) {
    std::filesystem::copy_file(*fresh, *golden, std::filesystem::copy_options::overwrite_existing);
  }
  REFIT_ASSERT_OK_AND_ASSIGN(*read, ReadPatchLog(*golden));
  EXPECT_THAT(read->corrupt, IsOk());
  ASSERT_EQ(read->records.size(), 3u);
  for (size_t i = 0; i < 2; ++i) ExpectSameRecord(read->records[i], GoldenRecords()[i]);
  ExpectSameRecord(read->records[2], extra);
}

// testdata/patch_log_v2_parts.bin: the golden log followed by GoldenPartsRecord (an "RRE2" record
// whose entries use part flags 0, 1 and 2). Regenerate with REFIT_UPDATE_GOLDEN=1 only for a
// deliberate format change.
TEST(PatchLogTest, GoldenFileWithPartsAlongTwoDimsIsFrozen) {
  std::string golden, fresh;
  LogReadResult read;
  ASSERT_NO_FATAL_FAILURE(WriteAndReadGoldenWith(GoldenPartsRecord(), "patch_log_v2_parts.bin",
                                                 &golden, &fresh, &read));
  EXPECT_EQ(read.records[2].tensors[1].spec.part().dim(), 1u);
  EXPECT_EQ(read.records[2].tensors[2].spec.part().first_row(), 3u);
  EXPECT_EQ(ReadFile(fresh), ReadFile(golden))
      << "the patch log format changed: part flags are frozen (docs/ARCHITECTURE.md)";
}

// The golden content of record version 3: version 6 after version 5 of the golden log, its
// digests v2 (a publisher that left the v1 digests pending), one tensor a part (version 3 carries
// parts as version 2 does).
LogRecord GoldenDigestsV2Record() {
  LogRecord r = GoldenRecords()[1];
  r.version = 6;
  r.base_version = 5;
  r.version_digest = 0x0706050403020109ull;
  r.snapshot_unix_nanos += 3000;
  r.digests_v2 = true;
  r.tensors[0] = {.spec = Spec("a.weight", {2, 3}),
                  .kind = LogTensorKind::kPatch,
                  .digest = 0x2a1,
                  .changed_elements = 1,
                  .bytes = Bytes({0x11, 0x22})};
  r.tensors[1].digest = 0x2b2;
  r.tensors[2] = {.spec = ColumnPart(0, 3),
                  .kind = LogTensorKind::kDense,
                  .digest = 0x2c3,
                  .changed_elements = 12,
                  .bytes = Bytes(std::vector<uint8_t>(24, 5))};
  return r;
}

// testdata/patch_log_v3_digests_v2.bin: the golden log followed by GoldenDigestsV2Record (an
// "RRE3" record). Regenerate with REFIT_UPDATE_GOLDEN=1 only for a deliberate format change.
TEST(PatchLogTest, GoldenFileWithARecordOfV2DigestsIsFrozen) {
  std::string golden, fresh;
  LogReadResult read;
  ASSERT_NO_FATAL_FAILURE(WriteAndReadGoldenWith(
      GoldenDigestsV2Record(), "patch_log_v3_digests_v2.bin", &golden, &fresh, &read));
  const std::vector<uint8_t> bytes = ReadFile(golden);
  EXPECT_EQ(std::string(bytes.begin() + static_cast<ptrdiff_t>(read.offsets[2]),
                        bytes.begin() + static_cast<ptrdiff_t>(read.offsets[2]) + 4),
            "RRE3");
  EXPECT_EQ(ReadFile(fresh), bytes)
      << "the patch log format changed: record version 3 is frozen (docs/ARCHITECTURE.md)";
}

TEST(PatchLogTest, TornTailIsTruncatedNotAnError) {
  const std::string dir = TempDir("torn");
  const std::string path = dir + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(path));
  const std::vector<uint8_t> full = ReadFile(path);
  REFIT_ASSERT_OK_AND_ASSIGN(auto read, ReadPatchLog(path));
  const uint64_t second = read.offsets[1];
  // Cut inside the second record's frame, inside its body, and one byte short of its end.
  for (uint64_t cut : {second + 3, second + kPatchRecordFrameBytes + 4, full.size() - 1}) {
    WriteFile(path, std::vector<uint8_t>(full.begin(), full.begin() + static_cast<long>(cut)));
    REFIT_ASSERT_OK_AND_ASSIGN(auto torn, ReadPatchLog(path));
    EXPECT_TRUE(torn.torn_tail) << "cut at " << cut;
    EXPECT_THAT(torn.corrupt, IsOk());
    ASSERT_EQ(torn.records.size(), 1u) << "cut at " << cut;
    EXPECT_EQ(torn.valid_end, second);
  }
  // A complete last record whose bytes did not all reach the disk (its body checksum fails and
  // nothing follows it).
  std::vector<uint8_t> zeroed = full;
  zeroed[full.size() - 2] ^= 0x5a;
  WriteFile(path, zeroed);
  REFIT_ASSERT_OK_AND_ASSIGN(auto last, ReadPatchLog(path));
  EXPECT_TRUE(last.torn_tail);
  EXPECT_EQ(last.records.size(), 1u);
  // Space allocated but never written (all zeros) after the last record.
  std::vector<uint8_t> padded = full;
  padded.resize(full.size() + 100, 0);
  WriteFile(path, padded);
  REFIT_ASSERT_OK_AND_ASSIGN(auto pad, ReadPatchLog(path));
  EXPECT_TRUE(pad.torn_tail);
  EXPECT_EQ(pad.records.size(), 2u);
  // Appending after a torn tail truncates it first.
  REFIT_ASSERT_OK_AND_ASSIGN(auto w, PatchLogWriter::OpenForAppend(path, pad.valid_end, false));
  LogRecord c = GoldenRecords()[1];
  c.version = 7;
  c.base_version = 5;
  ASSERT_THAT(w->Append(c), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto after, ReadPatchLog(path));
  EXPECT_FALSE(after.torn_tail);
  ASSERT_EQ(after.records.size(), 3u);
  EXPECT_EQ(after.records[2].version, 7u);
}

TEST(PatchLogTest, CorruptRecordStopsReadingThereNamingFileAndOffset) {
  const std::string path = TempDir("corrupt") + "/patches.log";
  ASSERT_NO_FATAL_FAILURE(WriteGolden(path));
  const std::vector<uint8_t> full = ReadFile(path);
  // A flipped byte in the first record's body (the second follows it: not a torn tail).
  std::vector<uint8_t> body = full;
  body[kPatchLogHeaderBytes + kPatchRecordFrameBytes + 10] ^= 1;
  WriteFile(path, body);
  auto read = ReadPatchLog(path);
  ASSERT_THAT(read, IsOk());
  EXPECT_THAT(read->corrupt,
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("at offset 40"), HasSubstr("checksum"))));
  EXPECT_TRUE(read->records.empty());
  EXPECT_EQ(read->valid_end, kPatchLogHeaderBytes);
  // A flipped byte in the second record's frame (its length).
  std::vector<uint8_t> frame = full;
  WriteFile(path, full);
  REFIT_ASSERT_OK_AND_ASSIGN(auto good, ReadPatchLog(path));
  frame[good.offsets[1] + 5] ^= 0x10;
  WriteFile(path, frame);
  read = ReadPatchLog(path);
  ASSERT_THAT(read, IsOk());
  EXPECT_THAT(std::string(read->corrupt.message()),
              HasSubstr(absl::StrCat("at offset ", good.offsets[1])));
  EXPECT_EQ(read->records.size(), 1u);
  // A bad header: nothing usable.
  std::vector<uint8_t> header = full;
  header[20] ^= 1;
  WriteFile(path, header);
  auto bad = ReadPatchLog(path);
  ASSERT_THAT(bad, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header checksum")));
  EXPECT_EQ(ReadPatchLog(path + ".absent").status().code(), absl::StatusCode::kNotFound);
}

// ReplayLog on a one-tensor baseline: a real codec patch replays; another lineage's record or
// one that does not chain stops the replay there, naming file, offset and the reason.
TEST(PatchLogTest, ReplayChecksLineageAndChain) {
  const uint64_t lineage = 0xabcdef0123456789ull;
  std::vector<uint8_t> v1(64), v2(64);
  for (size_t i = 0; i < v1.size(); ++i) v1[i] = static_cast<uint8_t>(i * 7 + 3);
  v2 = v1;
  v2[10] ^= 1;
  v2[33] ^= 2;
  BaselineTensor base;
  base.spec = Spec("w", {32});
  base.digest = TensorDigest(v1);
  base.bytes = Bytes(v1);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, v1, v2));
  LogRecord r;
  r.version = 2;
  r.base_version = 1;
  r.lineage = lineage;
  r.tensors.push_back({.spec = base.spec,
                       .kind = LogTensorKind::kPatch,
                       .digest = TensorDigest(v2),
                       .changed_elements = 2,
                       .bytes = Bytes(patch)});
  const std::vector<v1::TensorSpec> manifest = {base.spec};
  const std::vector<uint64_t> digests = {TensorDigest(v2)};
  r.version_digest = *sync::VersionDigest(manifest, digests);

  auto replay = [&](std::vector<LogRecord> records) {
    LogReadResult log;
    uint64_t off = kPatchLogHeaderBytes;
    for (LogRecord& x : records) {
      log.offsets.push_back(off);
      off += 1000;
      log.records.push_back(std::move(x));
    }
    return ReplayLog({base}, 1, lineage, log, "/p/patches.log", 1);
  };
  LogReplay ok = replay({r});
  ASSERT_THAT(ok.stopped, IsOk());
  ASSERT_EQ(ok.versions.size(), 1u);
  EXPECT_EQ(*ok.tensors[0].bytes, v2);

  LogRecord foreign = r;
  foreign.lineage = lineage + 1;
  LogReplay wrong = replay({foreign});
  EXPECT_TRUE(wrong.versions.empty());
  EXPECT_THAT(std::string(wrong.stopped.message()), HasSubstr("lineage"));
  EXPECT_THAT(std::string(wrong.stopped.message()), HasSubstr("/p/patches.log"));
  EXPECT_THAT(std::string(wrong.stopped.message()), HasSubstr("offset 40"));
  EXPECT_EQ(*wrong.tensors[0].bytes, v1);

  LogRecord gap = r;
  gap.version = 4;
  gap.base_version = 3;
  LogReplay unchained = replay({r, gap});
  EXPECT_EQ(unchained.versions.size(), 1u) << "version 2 replays, 4 does not follow it";
  EXPECT_THAT(std::string(unchained.stopped.message()), HasSubstr("does not follow version 2"));

  LogRecord wrong_digest = r;
  wrong_digest.tensors[0].digest ^= 1;
  wrong_digest.version_digest =
      *sync::VersionDigest(manifest, std::vector<uint64_t>{wrong_digest.tensors[0].digest});
  LogReplay refused = replay({wrong_digest});
  EXPECT_TRUE(refused.versions.empty());
  EXPECT_THAT(std::string(refused.stopped.message()), HasSubstr("digest"));
  EXPECT_EQ(*refused.tensors[0].bytes, v1) << "nothing replayed";

  LogRecord old = r;  // at or below the baseline: skipped
  old.version = 1;
  old.base_version = 0;
  LogReplay skipped = replay({old, r});
  EXPECT_THAT(skipped.stopped, IsOk());
  EXPECT_EQ(skipped.skipped, 1u);
  EXPECT_EQ(skipped.versions.size(), 1u);
}

// The log records v1 digests only; every replayed version still gets its tensors' v2 digests
// (a patch's delta, a dense tensor's bytes, an unchanged tensor's carried), each equal to the
// digest of the bytes at that version, so v2 sessions at any replayed version get deltas.
TEST(PatchLogTest, ReplayGivesEveryVersionItsDigestV2) {
  const uint64_t lineage = 0x1122334455667788ull;
  std::vector<uint8_t> b1(4096), b2, b3(4096);
  for (size_t i = 0; i < b1.size(); ++i) b1[i] = static_cast<uint8_t>(i * 13 + 1);
  b2 = b1;
  for (size_t i = 0; i < b2.size(); i += 97) b2[i] ^= 0x21;
  for (size_t i = 0; i < b3.size(); ++i) b3[i] = static_cast<uint8_t>(i * 5 + 9);
  BaselineTensor base;
  base.spec = Spec("w", {2048});
  base.digest = TensorDigest(b1);
  base.digest_v2 = TensorDigestV2(b1);
  base.bytes = Bytes(b1);
  const std::vector<v1::TensorSpec> manifest = {base.spec};
  auto record = [&](uint64_t version, LogTensorKind kind, const std::vector<uint8_t>& target,
                    std::shared_ptr<const std::vector<uint8_t>> bytes) {
    LogRecord r;
    r.version = version;
    r.base_version = version - 1;
    r.lineage = lineage;
    r.tensors.push_back({.spec = base.spec,
                         .kind = kind,
                         .digest = TensorDigest(target),
                         .bytes = std::move(bytes)});
    r.version_digest = *sync::VersionDigest(manifest, std::vector<uint64_t>{TensorDigest(target)});
    return r;
  };
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, b1, b2));
  LogReadResult log;
  log.records = {record(2, LogTensorKind::kPatch, b2, Bytes(patch)),
                 record(3, LogTensorKind::kDense, b3, Bytes(b3)),
                 record(4, LogTensorKind::kUnchanged, b3, nullptr)};
  log.offsets = {kPatchLogHeaderBytes, kPatchLogHeaderBytes + 1000, kPatchLogHeaderBytes + 2000};
  const LogReplay replay = ReplayLog({base}, 1, lineage, log, "/p/patches.log", 2);
  ASSERT_THAT(replay.stopped, IsOk());
  ASSERT_EQ(replay.versions.size(), 3u);
  const uint64_t want[] = {TensorDigestV2(b2), TensorDigestV2(b3), TensorDigestV2(b3)};
  for (size_t k = 0; k < 3; ++k) {
    ASSERT_EQ(replay.versions[k].updates.size(), 1u);
    ASSERT_TRUE(replay.versions[k].updates[0].digest_v2.has_value()) << "version " << k + 2;
    EXPECT_EQ(*replay.versions[k].updates[0].digest_v2, want[k]) << "version " << k + 2;
  }
  ASSERT_EQ(replay.tensors.size(), 1u);
  EXPECT_EQ(*replay.tensors[0].bytes, b3);
  EXPECT_EQ(replay.tensors[0].digest_v2, TensorDigestV2(b3));
}

}  // namespace
}  // namespace refit::publisher
