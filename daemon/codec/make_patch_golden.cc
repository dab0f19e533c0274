// Writes the patch format golden vectors (patch_golden.h) to stdout:
//   make_patch_golden > daemon/codec/testdata/patch_v1_golden.txt
//   make_patch_golden v2 > daemon/codec/testdata/patch_v2_golden.txt
// Only for adding cases: patch_golden_test.cc fails if a checked-in case would change.
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/codec/patch_golden.h"

int main(int argc, char** argv) {
  const bool v2 = argc > 1 && std::string(argv[1]) == "v2";
  if (argc > 2 || (argc == 2 && !v2)) {
    std::fprintf(stderr, "usage: make_patch_golden [v2] > FILE\n");
    return 2;
  }
  std::vector<refit::GoldenPatchCase> cases =
      v2 ? refit::GoldenPatchInputsV2() : refit::GoldenPatchInputs();
  for (refit::GoldenPatchCase& c : cases) {
    if (absl::Status st = refit::CompleteGoldenCase(c); !st.ok()) {
      std::fprintf(stderr, "case %s: %s\n", c.name.c_str(), st.ToString().c_str());
      return 1;
    }
  }
  const std::string text = refit::FormatGoldenPatches(cases, v2 ? 2 : 1);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}
