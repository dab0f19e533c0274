// Writes the patch wire format v1 golden vectors (patch_golden.h) to stdout:
//   make_patch_golden > daemon/codec/testdata/patch_v1_golden.txt
// Only for adding cases: patch_golden_test.cc fails if a checked-in case would change.
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/codec/patch_golden.h"

int main() {
  std::vector<refit::GoldenPatchCase> cases = refit::GoldenPatchInputs();
  for (refit::GoldenPatchCase& c : cases) {
    if (absl::Status st = refit::CompleteGoldenCase(c); !st.ok()) {
      std::fprintf(stderr, "case %s: %s\n", c.name.c_str(), st.ToString().c_str());
      return 1;
    }
  }
  const std::string text = refit::FormatGoldenPatches(cases);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}
