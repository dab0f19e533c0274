// Golden vectors of the patch wire formats (testdata/patch_v1_golden.txt, patch_v2_golden.txt):
// base and target tensors with the patch between them and their digests, covering every dtype and
// block mode; format 2 also with the version before the base, whose previous-change record a
// conditioned patch is coded given. The files freeze the formats: patch_golden_test.cc decodes and
// re-encodes every case byte for byte, so a change of the encoder, the decoder, the record or a
// digest that alters a format fails. make_patch_golden writes a file from the cases below; once
// checked in a case never changes (new cases are added).
#ifndef REFIT_DAEMON_CODEC_PATCH_GOLDEN_H_
#define REFIT_DAEMON_CODEC_PATCH_GOLDEN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/dtype.h"

namespace refit {

struct GoldenPatchCase {
  std::string name;
  DType dtype = DType::kBF16;
  int block_log2 = 8;
  std::string modes;  // per block: U (UNCHANGED), S (SPARSE), D (DENSE), C (CONTEXT)
  int format = 1;     // EncodeOptions::format the patch was written with
  // Format 2: the patch is coded given ChangeRecord::Compare(before, base).
  bool conditioned = false;
  std::vector<uint8_t> before;
  std::vector<uint8_t> base, target, patch;
  uint64_t base_digest = 0, base_digest_v2 = 0;      // TensorDigest, TensorDigestV2
  uint64_t target_digest = 0, target_digest_v2 = 0;
};

// The cases make_patch_golden writes: inputs (name, dtype, block_log2, format, before, base,
// target) only. Format 1 (patch_v1_golden.txt) and format 2 (patch_v2_golden.txt).
std::vector<GoldenPatchCase> GoldenPatchInputs();
std::vector<GoldenPatchCase> GoldenPatchInputsV2();

// The record a conditioned case's patch is coded given.
ChangeRecord GoldenRecord(const GoldenPatchCase& c);

// Fills an input case's patch (EncodePatch, one thread), block modes and digests.
absl::Status CompleteGoldenCase(GoldenPatchCase& c);

// The block modes of `layout` as GoldenPatchCase::modes spells them.
std::string BlockModes(const PatchLayout& layout);

// The file's text for `cases` (all fields filled; `format`: the file's, for its comment), and its
// parse. A parse error names the line.
std::string FormatGoldenPatches(const std::vector<GoldenPatchCase>& cases, int format = 1);
absl::StatusOr<std::vector<GoldenPatchCase>> ParseGoldenPatches(const std::string& text);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_PATCH_GOLDEN_H_
