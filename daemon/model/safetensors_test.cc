#include "daemon/model/safetensors.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::model {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TempPath(absl::string_view name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrCat(::testing::TempDir(), "refit_st_", info->name(), "_", getpid(), "_", name);
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// A file image: u64 length of `header`, the header, then `data_bytes` bytes of `fill`.
std::vector<uint8_t> Image(const std::string& header, size_t data_bytes, uint8_t fill = 0xAB) {
  std::vector<uint8_t> out(8);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data_bytes, fill);
  return out;
}

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 37);
  return b;
}

// Expects FromBytes to fail with InvalidArgument and a message containing every `needle`.
void ExpectRejected(const std::vector<uint8_t>& image, std::vector<std::string> needles) {
  auto f = SafetensorsFile::FromBytes(image, "bad.safetensors");
  ASSERT_THAT(f, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad.safetensors")))
      << "accepted: " << std::string(image.begin(), image.end());
  for (const auto& n : needles) {
    EXPECT_NE(f.status().message().find(n), absl::string_view::npos)
        << "message lacks '" << n << "': " << f.status().message();
  }
}

TEST(Safetensors, RoundTripManyDtypesAndShapes) {
  struct T {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<T> specs = {
      {"model.embed_tokens.weight", DType::kBF16, {4, 3}},
      {"scalar", DType::kF32, {}},
      {"empty", DType::kI64, {0}},
      {"empty3d", DType::kF16, {3, 0, 2}},
      {"bytes", DType::kU8, {5}},
      {"mask", DType::kBool, {2, 2}},
      {"fp8", DType::kF8E4M3, {3}},
      {"fp8b", DType::kF8E5M2, {1, 1}},
      {"doubles", DType::kF64, {1, 1, 2}},
      {"i32", DType::kI32, {3}},
      {"u64", DType::kU64, {1}},
      {"naïve \"quoted\"\n\\ \xF0\x9F\x98\x80", DType::kI16, {2}},
  };
  std::vector<std::vector<uint8_t>> data;
  std::vector<SafetensorsTensorRef> refs;
  for (size_t i = 0; i < specs.size(); ++i) {
    uint64_t n = 1;
    for (int64_t d : specs[i].shape) n *= static_cast<uint64_t>(d);
    data.push_back(Bytes(n * DTypeSize(specs[i].dtype), static_cast<uint8_t>(i)));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    refs.push_back({specs[i].name, specs[i].dtype, specs[i].shape, data[i]});
  }
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "42"}, {"k\"ey\t", "välue\x01"}};
  const std::string path = TempPath("rt.safetensors");
  ASSERT_THAT(WriteSafetensors(path, refs, meta), IsOk());

  REFIT_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::Open(path));
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.header_size() % 8, 0u);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), specs.size());
  uint64_t expect_offset = 8 + f.header_size();
  for (size_t i = 0; i < specs.size(); ++i) {
    const SafetensorsEntry& e = f.tensors()[i];
    EXPECT_EQ(e.name, specs[i].name);
    EXPECT_EQ(e.dtype, specs[i].dtype);
    EXPECT_EQ(e.shape, specs[i].shape);
    EXPECT_EQ(e.offset, expect_offset) << e.name;  // written in the given order
    EXPECT_EQ(e.size, data[i].size());
    EXPECT_EQ(e.num_elements() * DTypeSize(e.dtype), e.size);
    auto d = f.data(i);
    EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), data[i]) << e.name;
    REFIT_ASSERT_OK_AND_ASSIGN(auto found, f.Find(specs[i].name));
    EXPECT_EQ(found, i);
    expect_offset += e.size;
  }
  EXPECT_EQ(f.file_size(), expect_offset);
  EXPECT_EQ(f.Find("nope").status().code(), absl::StatusCode::kNotFound);

  // Moving keeps the mapping valid.
  SafetensorsFile moved = std::move(f);
  EXPECT_EQ(moved.tensors().size(), specs.size());
  EXPECT_EQ(moved.data(0)[0], data[0][0]);
  SafetensorsFile again = std::move(moved);
  EXPECT_EQ(again.data(4).size(), 5u);

  // The same bytes parse from memory too.
  REFIT_ASSERT_OK_AND_ASSIGN(auto mem, SafetensorsFile::FromBytes(ReadFile(path)));
  EXPECT_EQ(mem.tensors().size(), specs.size());
  std::remove(path.c_str());
}

TEST(Safetensors, EmptyFileAndNoMetadata) {
  const std::string path = TempPath("empty.safetensors");
  ASSERT_THAT(WriteSafetensors(path, {}), IsOk());
  const std::vector<uint8_t> bytes = ReadFile(path);
  // {} padded with spaces to 8 bytes.
  const std::vector<uint8_t> want = {8,   0,   0,   0,   0,   0,   0,   0,
                                     '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
  EXPECT_EQ(bytes, want);
  REFIT_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::Open(path));
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());
  std::remove(path.c_str());
}

TEST(Safetensors, WritesTheReferenceLayout) {
  // What the reference writer produces for {"a": F32 [2]} with metadata {"format": "pt"}: compact
  // JSON, "__metadata__" first, header padded with spaces to a multiple of 8.
  const std::vector<uint8_t> data = {0, 0, 128, 63, 0, 0, 0, 64};  // 1.0f, 2.0f
  const std::string path = TempPath("ref.safetensors");
  const SafetensorsTensorRef t{"a", DType::kF32, {2}, data};
  ASSERT_THAT(WriteSafetensors(path, {&t, 1}, {{"format", "pt"}}), IsOk());
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string padded = json;
  while (padded.size() % 8) padded += ' ';
  std::vector<uint8_t> want = Image(padded, 0);
  want.insert(want.end(), data.begin(), data.end());
  EXPECT_EQ(ReadFile(path), want);
  std::remove(path.c_str());
}

TEST(Safetensors, ParsesAHandWrittenFile) {
  // Layout as written by the reference implementation (huggingface/safetensors test suite):
  // I32 [2, 2] "test", no padding needed, header length 60 ('<').
  const char kFile[] =
      "<\x00\x00\x00\x00\x00\x00\x00"
      "{\"test\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}"
      "\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00";
  std::vector<uint8_t> bytes(kFile, kFile + sizeof(kFile) - 1);
  ASSERT_EQ(bytes.size(), 8u + 60u + 16u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::FromBytes(bytes));
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.tensors()[0].name, "test");
  EXPECT_EQ(f.tensors()[0].dtype, DType::kI32);
  EXPECT_EQ(f.tensors()[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(f.tensors()[0].offset, 68u);
  EXPECT_EQ(f.data(0)[4], 2);

  // Whitespace, escapes, surrogate pairs, null metadata, tensors listed out of offset order.
  const std::string header =
      "{ \"__metadata__\" : null ,\n\t\"b\\u00e9\\ud83d\\ude00\\/\" : {\"shape\":[ 1 ],"
      " \"dtype\":\"U8\",\"data_offsets\":[2,3]},\r\n "
      "\"a\":{\"data_offsets\":[0,2],\"dtype\":\"BF16\","
      "\"shape\":[]}   }    ";
  REFIT_ASSERT_OK_AND_ASSIGN(auto g, SafetensorsFile::FromBytes(Image(header, 3)));
  ASSERT_EQ(g.tensors().size(), 2u);
  EXPECT_EQ(g.tensors()[0].name, "b\xC3\xA9\xF0\x9F\x98\x80/");
  EXPECT_EQ(g.tensors()[0].offset, 8 + header.size() + 2);
  EXPECT_EQ(g.tensors()[1].name, "a");
  EXPECT_TRUE(g.tensors()[1].shape.empty());
  EXPECT_EQ(g.tensors()[1].size, 2u);
  EXPECT_TRUE(g.metadata().empty());
}

TEST(Safetensors, RejectsBadLengthsAndLimits) {
  ExpectRejected({}, {"too short"});
  ExpectRejected({1, 2, 3}, {"too short"});
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the building blocks are valid.
  ASSERT_THAT(SafetensorsFile::FromBytes(Image("{" + ok_a + "}", 8)), IsOk());
  ASSERT_THAT(SafetensorsFile::FromBytes(Image("{}", 0)), IsOk());

  // Header length.
  {
    std::vector<uint8_t> img = Image("{}", 0);
    img[0] = 200;  // longer than the file
    ExpectRejected(img, {"header length field exceeds the file size of 10 bytes"});
    std::vector<uint8_t> huge(64, ' ');
    const uint64_t n = (100ull << 20) + 1;
    for (int i = 0; i < 8; ++i) huge[i] = static_cast<uint8_t>(n >> (8 * i));
    ExpectRejected(huge, {"100 MiB"});
  }
  // JSON syntax.
  ExpectRejected(Image("", 0), {"must be a JSON object"});
  ExpectRejected(Image("[]", 0), {"must be a JSON object", "an array"});
  ExpectRejected(Image("{", 0), {"invalid JSON", "byte 1"});
  ExpectRejected(Image("{" + ok_a + ",}", 8), {"invalid JSON", "string key"});
  ExpectRejected(Image("{" + ok_a + "} x", 8), {"invalid JSON", "after the header object"});
  ExpectRejected(Image("{'a':1}", 0), {"invalid JSON"});
  ExpectRejected(Image("{/*c*/}", 0), {"invalid JSON"});
  ExpectRejected(Image(R"({"a" {}})", 0), {"invalid JSON", "':'"});
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8),
                 {"invalid JSON"});
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[2] "data_offsets":[0,8]}})", 8),
                 {"invalid JSON", "','"});
  ExpectRejected(Image(R"({"a\q":{}})", 0), {"invalid JSON", "escape"});
  ExpectRejected(Image(R"({"a\ud800":{}})", 0), {"invalid JSON", "surrogate"});
  ExpectRejected(Image(R"({"a\udc00":{}})", 0), {"invalid JSON", "surrogate"});
  ExpectRejected(Image(R"({"a\ud800\u0041":{}})", 0), {"invalid JSON", "surrogate"});
  ExpectRejected(Image(R"({"a\u12G4":{}})", 0), {"invalid JSON", "hex"});
  ExpectRejected(Image(R"({"a\u12)", 0), {"invalid JSON"});
  ExpectRejected(Image("{\"a\xFF\":{}}", 0), {"invalid JSON", "UTF-8"});
  ExpectRejected(Image("{\"a\xC0\x80\":{}}", 0), {"invalid JSON", "UTF-8"});      // overlong
  ExpectRejected(Image("{\"a\xED\xA0\x80\":{}}", 0), {"invalid JSON", "UTF-8"});  // surrogate
  ExpectRejected(Image("{\"a\nb\":{}}", 0), {"invalid JSON", "control character"});
  ExpectRejected(Image("{\"abc", 0), {"invalid JSON", "unterminated"});
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}})", 8),
                 {"leading zero"});
  ExpectRejected(Image(R"({"a":{"dtype":"F32","shape":[tru],"data_offsets":[0,8]}})", 8),
                 {"a boolean"});

  // Metadata.
  ExpectRejected(Image(R"({"__metadata__":{"a":1}})", 0), {"__metadata__", "must be a string"});
  ExpectRejected(Image(R"({"__metadata__":[]})", 0), {"__metadata__", "object"});
  ExpectRejected(Image(R"({"__metadata__":{"a":"1","a":"2"}})", 0), {"duplicate", "\"a\""});
  ExpectRejected(Image(R"({"__metadata__":{},"__metadata__":{}})", 0),
                 {"duplicate", "__metadata__"});

  // Tensor entries.
  auto one = [](const std::string& entry, size_t data) {
    return Image("{\"t\":" + entry + "}", data);
  };
  ExpectRejected(one("[]", 0), {"tensor \"t\"", "expected an object"});
  ExpectRejected(one(R"({"dtype":"F4","shape":[2],"data_offsets":[0,1]})", 1),
                 {"tensor \"t\"", "dtype", "F4"});
  ExpectRejected(one(R"({"dtype":"C64","shape":[2],"data_offsets":[0,16]})", 16), {"dtype", "C64"});
  ExpectRejected(one(R"({"dtype":"bf16","shape":[2],"data_offsets":[0,4]})", 4), {"dtype", "bf16"});
  ExpectRejected(one(R"({"dtype":7,"shape":[2],"data_offsets":[0,4]})", 4), {"dtype", "a number"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[3],"data_offsets":[0,4]})", 4),
                 {"tensor \"t\"", "data_offsets", "need 6"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[-2],"data_offsets":[0,4]})", 4),
                 {"tensor \"t\"", "negative"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2.0],"data_offsets":[0,4]})", 4),
                 {"shape dimension 0", "integer"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[1e1],"data_offsets":[0,4]})", 4), {"integer"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":2,"data_offsets":[0,4]})", 4),
                 {"shape", "an array"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[[2]],"data_offsets":[0,4]})", 4),
                 {"shape", "an array"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[null],"data_offsets":[0,4]})", 4),
                 {"shape", "null"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[99999999999999999999],"data_offsets":[0,4]})", 4),
                 {"64 bits"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[9223372036854775808],"data_offsets":[0,4]})", 4),
                 {"too large"});
  ExpectRejected(one(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,4]})", 4),
                 {"shape", "overflows"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,-4]})", 4),
                 {"data_offsets[1]", "negative"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[4,0]})", 4),
                 {"data_offsets", "begin 4 > end 0"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,4,8]})", 8),
                 {"data_offsets", "more than two"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0]})", 4),
                 {"data_offsets", "1 value"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,4]})", 3),
                 {"past the data region"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,4]})", 5), {"trailing"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[1,5]})", 5),
                 {"hole", "[0, 1)"});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2]})", 4),
                 {"tensor \"t\"", "missing field \"data_offsets\""});
  ExpectRejected(one(R"({"shape":[2],"data_offsets":[0,4]})", 4), {"missing field \"dtype\""});
  ExpectRejected(one(R"({"dtype":"BF16","data_offsets":[0,4]})", 4), {"missing field \"shape\""});
  ExpectRejected(one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,4],"x":1})", 4),
                 {"unknown field \"x\""});
  ExpectRejected(one(R"({"dtype":"BF16","dtype":"BF16","shape":[2],"data_offsets":[0,4]})", 4),
                 {"\"dtype\"", "duplicate field"});
  {
    std::string rank65 = "[";
    for (int i = 0; i < 65; ++i) rank65 += i ? ",1" : "1";
    rank65 += "]";
    ExpectRejected(one(R"({"dtype":"U8","shape":)" + rank65 + R"(,"data_offsets":[0,1]})", 1),
                   {"dimensions"});
  }

  // Layout across tensors.
  const std::string b_ok = R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]})";
  ASSERT_THAT(SafetensorsFile::FromBytes(Image("{" + ok_a + "," + b_ok + "}", 12)), IsOk());
  ExpectRejected(Image("{" + ok_a + "," + ok_a + "}", 8), {"duplicate tensor name", "\"a\""});
  ExpectRejected(Image("{" + ok_a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 {"overlaps", "\"a\""});
  ExpectRejected(
      Image("{" + ok_a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16),
      {"hole", "[8, 12)"});
  ExpectRejected(Image("{" + ok_a + R"(,"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", 8),
                 {"overlaps"});  // a zero-sized tensor inside another one
  ASSERT_THAT(SafetensorsFile::FromBytes(Image(
                  "{" + ok_a + R"(,"z":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})", 8)),
              IsOk());
}

TEST(Safetensors, OpenReportsFileErrors) {
  auto missing = SafetensorsFile::Open(TempPath("does-not-exist"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("does-not-exist"), absl::string_view::npos);
  auto dir = SafetensorsFile::Open(::testing::TempDir());
  EXPECT_THAT(dir, Not(IsOk()));
  const std::string path = TempPath("zero.safetensors");
  WriteFile(path, {});
  auto zero = SafetensorsFile::Open(path);
  ASSERT_THAT(zero, Not(IsOk()));
  EXPECT_NE(zero.status().message().find(path), absl::string_view::npos) << zero.status();
  EXPECT_NE(zero.status().message().find("too short"), absl::string_view::npos) << zero.status();
  std::remove(path.c_str());
}

TEST(Safetensors, EveryTruncationIsRejected) {
  const std::vector<uint8_t> a = Bytes(6, 1), b = Bytes(4, 2);
  const SafetensorsTensorRef refs[] = {
      {"a", DType::kBF16, {3}, a}, {"b", DType::kF32, {1}, b}, {"c", DType::kU8, {0}, {}}};
  const std::string path = TempPath("full.safetensors");
  ASSERT_THAT(WriteSafetensors(path, refs, {{"k", "v"}}), IsOk());
  const std::vector<uint8_t> full = ReadFile(path);
  ASSERT_THAT(SafetensorsFile::FromBytes(full), IsOk());
  const std::string cut = TempPath("cut.safetensors");
  for (size_t len = 0; len < full.size(); ++len) {
    std::vector<uint8_t> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len));
    EXPECT_THAT(SafetensorsFile::FromBytes(prefix), Not(IsOk())) << "len " << len;
    WriteFile(cut, prefix);
    EXPECT_THAT(SafetensorsFile::Open(cut), Not(IsOk())) << "len " << len;
  }
  // Flipping any byte to a few values never crashes (it may or may not stay valid).
  for (size_t i = 0; i < full.size(); ++i) {
    for (uint8_t v : {uint8_t{0x00}, uint8_t{0x22}, uint8_t{0x5C}, uint8_t{0x7F}, uint8_t{0xFF},
                      static_cast<uint8_t>(full[i] ^ 1)}) {
      std::vector<uint8_t> bad = full;
      bad[i] = v;
      auto f = SafetensorsFile::FromBytes(bad);
      if (f.ok()) {
        for (size_t t = 0; t < f->tensors().size(); ++t)
          EXPECT_LE(f->tensors()[t].offset + f->data(t).size(), bad.size());
      }
    }
  }
  std::remove(path.c_str());
  std::remove(cut.c_str());
}

TEST(Safetensors, WriteValidatesAndIsAtomic) {
  const std::vector<uint8_t> four = Bytes(4, 3);
  const std::string path = TempPath("w.safetensors");
  auto write = [&](std::vector<SafetensorsTensorRef> refs,
                   std::map<std::string, std::string> meta = {}) {
    return WriteSafetensors(path, refs, meta);
  };
  auto expect_error = [](const absl::Status& s, const std::string& needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
  };
  expect_error(write({{"x", DType::kBF16, {3}, four}}), "need 6 bytes");
  expect_error(write({{"x", DType::kBF16, {-2}, four}}), "negative");
  expect_error(write({{"x", DType::kBF16, {2}, four}, {"x", DType::kU8, {4}, four}}), "duplicate");
  expect_error(write({{"__metadata__", DType::kBF16, {2}, four}}), "reserved");
  expect_error(write({{"bad\xFF", DType::kBF16, {2}, four}}), "UTF-8");
  expect_error(write({{"x", static_cast<DType>(99), {2}, four}}), "dtype");
  expect_error(write({}, {{"k", "\xC0\x80"}}), "UTF-8");
  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "a rejected write must not create the file";

  // Overwrite: the new contents replace the old, no temporary files remain.
  ASSERT_THAT(write({{"x", DType::kBF16, {2}, four}}), IsOk());
  ASSERT_THAT(write({{"y", DType::kU8, {4}, four}}), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::Open(path));
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.tensors()[0].name, "y");
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const std::string base = path.substr(path.rfind('/') + 1);
  DIR* d = ::opendir(::testing::TempDir().c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* ent = ::readdir(d)) {
    const std::string name = ent->d_name;
    EXPECT_FALSE(name.rfind("." + base + ".tmp", 0) == 0) << "leftover " << name;
  }
  ::closedir(d);

  // A directory that does not exist: error, nothing written.
  const absl::Status s = WriteSafetensors(TempPath("no-such-dir") + "/x.safetensors", {});
  EXPECT_THAT(s, Not(IsOk()));
  EXPECT_NE(s.message().find("no-such-dir"), absl::string_view::npos) << s;
  std::remove(path.c_str());
}

// The 8-byte length field of a file that is not a safetensors file holds its first bytes: they
// must not appear in the error (hostile input: a publish of /etc/shadow must not leak it).
TEST(Safetensors, ErrorsNeverQuoteTheLengthFieldOfAForeignFile) {
  const std::string text = "root:$6$secret-hash-here:19000:0:99999:7:::\n";
  std::vector<uint8_t> bytes(text.begin(), text.end());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  auto f = SafetensorsFile::FromBytes(bytes, "foreign");
  ASSERT_THAT(f, Not(IsOk()));
  EXPECT_EQ(f.status().message().find(absl::StrCat(n)), absl::string_view::npos) << f.status();
  EXPECT_EQ(f.status().message().find("root"), absl::string_view::npos) << f.status();
  EXPECT_NE(f.status().message().find("header length field exceeds"), absl::string_view::npos)
      << f.status();
  // Small enough to pass the 100 MiB limit, larger than the file.
  std::vector<uint8_t> mid = {0x10, 0x27, 0, 0, 0, 0, 0, 0, 'x', 'y'};  // 10000
  auto g = SafetensorsFile::FromBytes(mid, "foreign");
  ASSERT_THAT(g, Not(IsOk()));
  EXPECT_EQ(g.status().message().find("10000"), absl::string_view::npos) << g.status();
}

// A file truncated by another process while it is read is an error, not SIGBUS (the reader used
// to mmap the file).
TEST(Safetensors, AFileTruncatedWhileReadIsAnErrorNotACrash) {
  const std::vector<uint8_t> big = Bytes(4 << 20, 5);
  const SafetensorsTensorRef refs[] = {{"w", DType::kU8, {4 << 20}, big}};
  const std::string path = TempPath("shrinking.safetensors");
  ASSERT_THAT(WriteSafetensors(path, refs), IsOk());
  SetReadHookForTesting([&](const std::string& p, uint64_t) {
    if (p == path) ::truncate(path.c_str(), 64);
  });
  auto f = SafetensorsFile::Open(path);
  SetReadHookForTesting(nullptr);
  ASSERT_THAT(f, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shrank while being read")));
  std::remove(path.c_str());
}

TEST(Safetensors, AFifoIsRefusedWithoutBlocking) {
  const std::string path = TempPath("fifo");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  auto f = SafetensorsFile::Open(path);  // no writer: a blocking open() would hang here
  ASSERT_THAT(f, Not(IsOk()));
  EXPECT_NE(f.status().message().find("is a FIFO"), absl::string_view::npos) << f.status();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace refit::model
