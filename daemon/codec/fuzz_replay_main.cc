// Runs LLVMFuzzerTestOneInput over every file in the given directories (or files), plus simple
// deterministic mutations of each (bit flips, truncations), without libFuzzer. Used by ctest on
// compilers without -fsanitize=fuzzer.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  size_t runs = 0;
  for (int a = 1; a < argc; ++a) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(argv[a])) {
      for (auto& e : std::filesystem::directory_iterator(argv[a])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[a]);
    }
    for (auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      std::vector<uint8_t> d((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(d.data(), d.size());
      ++runs;
      for (size_t i = 1; i < d.size(); i += 1 + d.size() / 64) {
        auto m = d;
        m[i] ^= static_cast<uint8_t>(1u << (i % 8));
        LLVMFuzzerTestOneInput(m.data(), m.size());
        LLVMFuzzerTestOneInput(d.data(), i);
        runs += 2;
      }
    }
  }
  std::printf("replayed %zu inputs\n", runs);
  return runs > 0 ? 0 : 1;
}
