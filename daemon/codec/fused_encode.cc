#include "daemon/codec/fused_encode.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_macros.h"

namespace refit {

absl::StatusOr<FusedEncoding> EncodeFusedCpu(DType dtype, std::span<uint8_t> base,
                                             std::span<const uint8_t> target,
                                             const EncodeOptions& options, bool update_base) {
  FusedEncoding out;
  REFIT_ASSIGN_OR_RETURN(out.patch, EncodePatch(dtype, base, target, options, &out.stats));
  out.digest_v2 = TensorDigestV2(target, options.threads);
  if (update_base && out.stats.changed_elements > 0) {
    // Our own patch of these sizes: a failure here is a codec bug, reported as such.
    absl::Status st = ApplyPatch(out.patch, dtype, base, base, options.threads);
    if (!st.ok()) {
      return AnnotateAs(absl::StatusCode::kInternal, st,
                        "EncodeFusedCpu: applying its own patch in place failed");
    }
  }
  return out;
}

}  // namespace refit
