#include "daemon/codec/dtype.h"

#include <array>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "daemon/common/printable.h"

namespace refit {
namespace {

struct DTypeInfo {
  DType type;
  int size;
  ValueCoding coding;
  absl::string_view name;
  absl::string_view safetensors;
};

constexpr std::array<DTypeInfo, 15> kInfo = {{
    {DType::kBF16, 2, ValueCoding::kOrderedDiff, "bf16", "BF16"},
    {DType::kF16, 2, ValueCoding::kOrderedDiff, "f16", "F16"},
    {DType::kF32, 4, ValueCoding::kOrderedDiff, "f32", "F32"},
    {DType::kF64, 8, ValueCoding::kOrderedDiff, "f64", "F64"},
    {DType::kF8E4M3, 1, ValueCoding::kOrderedDiff, "f8e4m3", "F8_E4M3"},
    {DType::kF8E5M2, 1, ValueCoding::kOrderedDiff, "f8e5m2", "F8_E5M2"},
    {DType::kI8, 1, ValueCoding::kIntDiff, "i8", "I8"},
    {DType::kI16, 2, ValueCoding::kIntDiff, "i16", "I16"},
    {DType::kI32, 4, ValueCoding::kIntDiff, "i32", "I32"},
    {DType::kI64, 8, ValueCoding::kIntDiff, "i64", "I64"},
    {DType::kU8, 1, ValueCoding::kIntDiff, "u8", "U8"},
    {DType::kU16, 2, ValueCoding::kIntDiff, "u16", "U16"},
    {DType::kU32, 4, ValueCoding::kIntDiff, "u32", "U32"},
    {DType::kU64, 8, ValueCoding::kIntDiff, "u64", "U64"},
    {DType::kBool, 1, ValueCoding::kRaw, "bool", "BOOL"},
}};

const DTypeInfo& Info(DType t) { return kInfo[static_cast<uint8_t>(t) - 1]; }

}  // namespace

bool IsValidDType(uint8_t code) { return code >= 1 && code <= kInfo.size(); }
int DTypeSize(DType t) { return Info(t).size; }
ValueCoding DTypeValueCoding(DType t) { return Info(t).coding; }
absl::string_view DTypeName(DType t) { return Info(t).name; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const auto& i : kInfo) {
    if (name == i.name || name == i.safetensors) return i.type;
  }
  std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bfloat16") return DType::kBF16;
  if (lower == "float16" || lower == "half") return DType::kF16;
  if (lower == "float32" || lower == "float") return DType::kF32;
  if (lower == "float64" || lower == "double") return DType::kF64;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype ", Quoted(name),
      " (expected one of bf16 f16 f32 f64 f8e4m3 f8e5m2 i8 i16 i32 i64 u8 u16 u32 u64 bool, "
      "or a safetensors dtype such as BF16)"));
}

}  // namespace refit
