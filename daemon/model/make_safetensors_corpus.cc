// Writes a seed corpus for safetensors_fuzzer: valid files from WriteSafetensors (every dtype,
// scalars, empty tensors, several dimensions, metadata, names that need JSON escapes) and a few
// hand-written headers (whitespace, \u escapes, offsets out of header order).
// Usage: make_safetensors_corpus DIR
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "daemon/model/safetensors.h"

namespace {

using refit::DType;
using refit::model::SafetensorsTensorRef;

int written = 0;

std::string NextPath(const std::string& dir) {
  return dir + "/seed-" + std::to_string(written++) + ".safetensors";
}

void WriteValid(const std::string& dir, const std::vector<SafetensorsTensorRef>& tensors,
                const std::map<std::string, std::string>& metadata = {}) {
  refit::SafeWriteOptions no_fsync;
  no_fsync.durable = false;
  absl::Status st = refit::model::WriteSafetensors(NextPath(dir), tensors, metadata, no_fsync);
  if (!st.ok()) {
    std::fprintf(stderr, "make_safetensors_corpus: %s\n", std::string(st.message()).c_str());
    std::exit(1);
  }
}

// A file image with a hand-written JSON header and `data_bytes` bytes of data.
void WriteRaw(const std::string& dir, const std::string& header, size_t data_bytes) {
  std::string image(8, '\0');
  for (int i = 0; i < 8; ++i) image[i] = static_cast<char>(uint64_t{header.size()} >> (8 * i));
  image += header;
  for (size_t i = 0; i < data_bytes; ++i) image += static_cast<char>(i * 37 + 11);
  FILE* f = std::fopen(NextPath(dir).c_str(), "wb");
  if (f == nullptr || std::fwrite(image.data(), 1, image.size(), f) != image.size()) {
    std::perror(dir.c_str());
    std::exit(1);
  }
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_safetensors_corpus DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<uint8_t> bytes(512);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + 7);
  auto span = [&](size_t n) { return std::span<const uint8_t>(bytes.data(), n); };
  // One small tensor of every dtype, alone.
  for (uint8_t code = 1; refit::IsValidDType(code); ++code) {
    const auto t = static_cast<DType>(code);
    const size_t w = refit::DTypeSize(t);
    WriteValid(dir, {{"t", t, {2, 3}, span(6 * w)}});
  }
  // Several tensors: scalar, empty, rank 4, names with escapes and non-ASCII, metadata.
  WriteValid(dir,
             {{"model.layers.0.weight", DType::kBF16, {4, 8}, span(64)},
              {"scalar", DType::kF32, {}, span(4)},
              {"empty", DType::kF16, {0, 5}, span(0)},
              {"rank4", DType::kU8, {2, 1, 3, 2}, span(12)},
              {"quote\"back\\slash\ttab", DType::kI64, {3}, span(24)},
              {"caf\xc3\xa9.\xe2\x82\xac", DType::kBool, {5}, span(5)}},
             {{"format", "pt"}, {"note", "line\nbreak \"quoted\""}});
  WriteValid(dir, {}, {{"only", "metadata"}});
  WriteValid(dir, {});
  // Hand-written headers: whitespace, escapes, data order different from header order.
  WriteRaw(dir,
           " { \"b\" : { \"dtype\" : \"F32\", \"shape\" : [ 2 ], \"data_offsets\" : [ 8 , 16 ] } ,"
           "\n\t\"a\":{\"data_offsets\":[0,8],\"shape\":[4],\"dtype\":\"BF16\"},"
           "\"__metadata__\":{\"k\\u00e9y\":\"v\\n\\u20ac\\ud83d\\ude00\"}}  ",
           16);
  WriteRaw(dir, "{\"x\":{\"dtype\":\"F8_E4M3\",\"shape\":[1,1,1],\"data_offsets\":[0,1]}}", 1);
  WriteRaw(dir, "{\"x\":{\"dtype\":\"U64\",\"shape\":[],\"data_offsets\":[0,8]}}      ", 8);
  std::printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}
