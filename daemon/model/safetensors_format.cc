#include "daemon/model/safetensors_format.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace refit::model {

absl::string_view SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF8E5M2: return "F8_E5M2";
    case DType::kI8: return "I8";
    case DType::kI16: return "I16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kU16: return "U16";
    case DType::kU32: return "U32";
    case DType::kU64: return "U64";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

}  // namespace refit::model
