// The safetensors format (https://github.com/huggingface/safetensors) as refitd reads and writes
// it (safetensors_reader.h, safetensors_writer.h; safetensors.h includes both):
//
// Layout: u64 little-endian N, then N bytes of UTF-8 JSON, then the data region. The JSON is an
// object mapping each tensor name to {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}
// (offsets relative to the first byte after the header) plus an optional "__metadata__" object of
// string -> string. Tensors must tile the data region exactly: sorted by offsets, each begins where
// the previous one ends, the first at 0 and the last ends at the end of the file.
#ifndef REFIT_DAEMON_MODEL_SAFETENSORS_FORMAT_H_
#define REFIT_DAEMON_MODEL_SAFETENSORS_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "daemon/codec/dtype.h"

namespace refit::model {

// Largest header a reader accepts (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull << 20;
// Largest number of dimensions a reader accepts for one tensor.
inline constexpr int kSafetensorsMaxRank = 64;
// The header key of the metadata object (no tensor may be called this).
inline constexpr absl::string_view kSafetensorsMetadataKey = "__metadata__";

// The safetensors name of a dtype ("BF16", "F8_E4M3", "BOOL", ...).
absl::string_view SafetensorsDTypeName(DType t);

}  // namespace refit::model

#endif  // REFIT_DAEMON_MODEL_SAFETENSORS_FORMAT_H_
