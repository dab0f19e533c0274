// Writes the patch wire format v1 golden vectors (patch_golden.h) to stdout:
//   make_patch_golden > daemon/codec/testdata/patch_v1_golden.txt
// Only for adding cases: patch_golden_test.cc fails if a checked-in case would change.
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_golden.h"

int main() {
  std::vector<refit::GoldenPatchCase> cases = refit::GoldenPatchInputs();
  for (refit::GoldenPatchCase& c : cases) {
    refit::EncodeOptions opts;
    opts.block_log2 = c.block_log2;
    opts.threads = 1;
    auto patch = refit::EncodePatch(c.dtype, c.base, c.target, opts);
    if (!patch.ok()) {
      std::fprintf(stderr, "case %s: %s\n", c.name.c_str(), patch.status().ToString().c_str());
      return 1;
    }
    c.patch = *patch;
    auto layout = refit::ParsePatch(c.patch);
    if (!layout.ok()) {
      std::fprintf(stderr, "case %s: %s\n", c.name.c_str(), layout.status().ToString().c_str());
      return 1;
    }
    for (const refit::BlockDesc& b : layout->blocks) {
      c.modes.push_back(b.mode == refit::format::kUnchanged ? 'U'
                        : b.mode == refit::format::kSparse  ? 'S'
                                                            : 'D');
    }
    c.base_digest = refit::TensorDigest(c.base, 1);
    c.base_digest_v2 = refit::TensorDigestV2(c.base, 1);
    c.target_digest = refit::TensorDigest(c.target, 1);
    c.target_digest_v2 = refit::TensorDigestV2(c.target, 1);
  }
  const std::string text = refit::FormatGoldenPatches(cases);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}
