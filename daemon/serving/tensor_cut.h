// Tensor-parallel cuts on the publisher (config publisher.cut): before a version is validated and
// encoded, every input whose name matches a `rows` pattern is replaced by `parts` parts along dim
// 0, one matching a `columns` pattern by `parts` parts along dim 1; part r holds the indices
// sync::RankRange(dim size, r, parts) of that dim (TensorSpec.part). Each part is then encoded,
// digested, kept and persisted as a tensor of its own, so a version's delta is per part and a
// tensor-parallel subscriber fetches only its part (docs/ARCHITECTURE.md "Tensor-parallel cuts
// (publisher side)").
#ifndef REFIT_DAEMON_SERVING_TENSOR_CUT_H_
#define REFIT_DAEMON_SERVING_TENSOR_CUT_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace refit::publisher {

struct TensorInput;

// Config publisher.cut. Patterns are fnmatch(3) globs without flags (as tensor selections).
struct CutOptions {
  uint32_t parts = 0;                // 0: no cut
  std::vector<std::string> rows;     // tensors cut along dim 0
  std::vector<std::string> columns;  // tensors cut along dim 1
};

// `given` with every matched input replaced by its parts (in part order, where the input was).
// A part along dim 0 is a subspan of the input's bytes (no copy, no `owned`); a part along
// another dim is gathered into a new owned buffer (the part's own row-major bytes). Unmatched
// inputs are passed through as they are. The result's spans point into `given`'s bytes and its
// own buffers: valid while both are. Errors (nothing cut), naming the tensor and the pattern:
// INVALID_ARGUMENT for a matched tensor whose rank does not have the dim, whose dim has fewer
// indices than parts, that both lists match, or that already is a part; FAILED_PRECONDITION for
// a matched input in device memory (cuts need host inputs). `where` prefixes messages.
// How a row-major tensor of `shape` (elements of `element_bytes`) lies along `dim`: `outer`
// slabs (the product of the dims before it), each `slab` bytes, in which one index of `dim` is
// `inner` bytes (the dims after it). A part along `dim` is `outer` runs of (its count x inner)
// bytes, one per slab. `dim` < shape.size().
struct DimStrides {
  uint64_t outer = 1;
  uint64_t inner = 0;
  uint64_t slab = 0;
};
DimStrides StridesAlong(std::span<const uint64_t> shape, uint32_t dim, uint64_t element_bytes);

absl::StatusOr<std::vector<TensorInput>> CutInputs(const CutOptions& cut,
                                                   std::span<const TensorInput> given,
                                                   const std::string& where);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_TENSOR_CUT_H_
