// The manifest entry of a layout's unit (a whole tensor, or a part of one: TensorSpec.part), as
// the version digest and the records name it.
#ifndef REFIT_DAEMON_SUBSCRIBER_UNIT_SPEC_H_
#define REFIT_DAEMON_SUBSCRIBER_UNIT_SPEC_H_

#include <cstddef>

#include "daemon/store/tensor_store.h"
#include "daemon/sync/version_digest.h"
#include "refit/v1/common.pb.h"

namespace refit::subscriber {

inline v1::TensorSpec UnitSpec(const store::Layout& layout, size_t u) {
  const store::UnitInfo& unit = layout.unit(u);
  const store::TensorInfo& tensor = layout.tensor(unit.tensor);
  v1::TensorSpec spec;
  spec.set_name(tensor.name);
  spec.set_dtype(sync::ToProtoDType(tensor.dtype));
  for (uint64_t d : unit.shape) spec.add_shape(d);
  if (tensor.slice.has_value()) {  // a part held alone: the tensor is the part
    spec.mutable_part()->set_first_row(tensor.slice->first_row);
    spec.mutable_part()->set_dim(tensor.slice->dim);
    for (uint64_t d : tensor.slice->whole_shape) spec.mutable_part()->add_whole_shape(d);
  } else if (unit.first_row.has_value()) {
    spec.mutable_part()->set_first_row(*unit.first_row);
    for (uint64_t d : tensor.shape) spec.mutable_part()->add_whole_shape(d);
  }
  return spec;
}

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_UNIT_SPEC_H_
