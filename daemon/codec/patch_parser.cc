// The patch parser: a patch's header, block table and checksums checked and laid out
// (ParsePatch, ParsePatchFor), with every error naming the block and what is wrong.
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/codec_internal.h"
#include "daemon/codec/format.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/status_macros.h"

namespace refit {

using codec_internal::BlockChecksum;
using codec_internal::LoadU32;
using codec_internal::LoadU64;
using codec_internal::Scratch;
using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;

namespace {

// ---------------------------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------------------------

class TableReader {
 public:
  TableReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t offset() const { return off_; }
  bool Varint(uint64_t* v) {
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      if (off_ >= n_) return false;
      const uint8_t byte = p_[off_++];
      if (i == 9 && byte > 1) return false;  // would overflow 64 bits
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        if (i > 0 && byte == 0) return false;  // non-minimal encoding
        *v = result;
        return true;
      }
    }
    return false;
  }
  bool U16(uint16_t* v) {
    if (n_ - off_ < 2) return false;
    *v = static_cast<uint16_t>(p_[off_] | (p_[off_ + 1] << 8));
    off_ += 2;
    return true;
  }
  bool U32(uint32_t* v) {
    if (n_ - off_ < 4) return false;
    *v = LoadU32(p_ + off_);
    off_ += 4;
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
};

}  // namespace

std::string DescribeBlock(uint64_t index, const BlockDesc& d) {
  return absl::StrCat("block ", index, " (elements [", d.first_element, ", ",
                      d.first_element + d.num_elements, "))");
}

namespace {

// ParsePatch's first step: the 32-byte header (magic, version, dtype, block_log2, reserved
// bytes, element count), the block table's size and the checksum over header and table.
// Returns the table's size; `layout` gets dtype, block_log2 and num_elements.
absl::StatusOr<uint64_t> ParsePatchHeader(std::span<const uint8_t> patch, PatchLayout& layout) {
  if (patch.size() < static_cast<size_t>(format::kHeaderBytes)) {
    return absl::DataLossError(
        absl::StrCat("patch: ", patch.size(), " bytes is shorter than the 32-byte header"));
  }
  const uint8_t* h = patch.data();
  if (LoadU32(h) != format::kMagic) {
    return absl::DataLossError("patch: bad magic at offset 0 (not a refitd patch)");
  }
  if (h[4] != format::kVersion && h[4] != format::kVersion2) {
    return absl::DataLossError(absl::StrCat("patch: unsupported format version ", int{h[4]},
                                            " at offset 4 (this build reads versions 1 and 2)"));
  }
  layout.version = h[4];
  if (!IsValidDType(h[5])) {
    return absl::DataLossError(
        absl::StrCat("patch: unknown dtype code ", int{h[5]}, " at offset 5"));
  }
  layout.dtype = static_cast<DType>(h[5]);
  layout.block_log2 = h[6];
  if (layout.block_log2 < format::kMinBlockLog2 || layout.block_log2 > format::kMaxBlockLog2) {
    return absl::DataLossError(absl::StrCat("patch: block_log2 ", layout.block_log2,
                                            " at offset 6 outside [", format::kMinBlockLog2, ", ",
                                            format::kMaxBlockLog2, "]"));
  }
  if (layout.version == format::kVersion && (h[7] != 0 || LoadU32(h + 28) != 0)) {
    return absl::DataLossError("patch: reserved header bytes (offset 7 or 28) are not zero");
  }
  if (layout.version == format::kVersion2) {
    if ((h[7] & ~format::kFlagConditioned) != 0) {
      return absl::DataLossError(absl::StrCat("patch: unknown flags ", int{h[7]}, " at offset 7"));
    }
    layout.conditioned = (h[7] & format::kFlagConditioned) != 0;
    layout.prev_fingerprint = LoadU32(h + 28);
    if (!layout.conditioned && layout.prev_fingerprint != 0) {
      return absl::DataLossError("patch: a fingerprint at offset 28 without the conditioned flag");
    }
  }
  layout.num_elements = LoadU64(h + 8);
  if (layout.num_elements > (std::numeric_limits<uint64_t>::max() >> 4)) {
    return absl::DataLossError(absl::StrCat("patch: element count ", layout.num_elements,
                                            " at offset 8 is implausibly large"));
  }
  const uint64_t table_bytes = LoadU64(h + 16);
  if (table_bytes > patch.size() - format::kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("patch: block table of ", table_bytes,
                                            " bytes (offset 16) exceeds the patch's ", patch.size(),
                                            " bytes"));
  }
  const uint64_t block = 1ull << layout.block_log2;
  const uint64_t num_blocks = (layout.num_elements + block - 1) / block;
  if (num_blocks > table_bytes) {  // every entry takes at least one byte
    return absl::DataLossError(absl::StrCat("patch: ", num_blocks, " blocks cannot fit a ",
                                            table_bytes, "-byte block table"));
  }
  const uint32_t want = LoadU32(h + 24);
  const uint32_t got = HeaderChecksum(patch.first(format::kHeaderBytes + table_bytes));
  if (want != got) {
    return absl::DataLossError(absl::StrCat("patch: header checksum mismatch (offset 24 says ",
                                            want, ", header and table hash to ", got, ")"));
  }
  return table_bytes;
}

// A SPARSE or CONTEXT entry's change count (head >> 2), in [1, block length].
template <typename Bad>
absl::Status ParseCount(uint64_t head, BlockDesc& d, const Bad& bad) {
  const uint64_t count = head >> 2;
  if (count == 0 || count > d.num_elements) {
    return bad(absl::StrCat("change count ", count, " outside [1, ", d.num_elements, "]"));
  }
  d.count = static_cast<uint32_t>(count);
  return absl::OkStatus();
}

// A SPARSE or CONTEXT entry's payload size (smaller than the dense form) and checksum.
template <typename Bad>
absl::Status ParseSizeAndChecksum(TableReader& tr, const char* kind, uint64_t dense_bytes,
                                  BlockDesc& d, const Bad& bad) {
  if (!tr.Varint(&d.payload_bytes)) return bad("truncated payload size");
  if (d.payload_bytes == 0 || d.payload_bytes >= dense_bytes) {
    return bad(absl::StrCat(kind, " payload of ", d.payload_bytes,
                            " bytes is not smaller than the dense form (", dense_bytes, ")"));
  }
  d.checksum_offset = format::kHeaderBytes + tr.offset();
  if (!tr.U32(&d.checksum)) return bad("truncated checksum");
  return absl::OkStatus();
}

// ParsePatch's per-block step: block i's table entry (mode, count, coding parameters, payload
// size, checksum), its payload placed at *payload_off (advanced past it).
absl::Status ParseBlockEntry(TableReader& tr, const PatchLayout& layout, uint64_t i,
                             size_t patch_size, BlockDesc& d, uint64_t* payload_off) {
  const uint64_t block = 1ull << layout.block_log2;
  d.first_element = i * block;
  d.num_elements =
      static_cast<uint32_t>(std::min<uint64_t>(block, layout.num_elements - i * block));
  const uint64_t dense_bytes = static_cast<uint64_t>(d.num_elements) * DTypeSize(layout.dtype);
  const size_t entry_off = format::kHeaderBytes + tr.offset();
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("patch: table entry for ", DescribeBlock(i, d),
                                            " at offset ", entry_off, ": ", what));
  };
  uint64_t head;
  if (!tr.Varint(&head)) return bad("truncated or malformed varint");
  d.mode = static_cast<uint8_t>(head & 3);
  if (d.mode == kUnchanged) {
    if (head != 0) return bad("unchanged block with nonzero count");
  } else if (d.mode == kDense) {
    if (head != kDense) return bad("dense block with nonzero count");
    d.checksum_offset = format::kHeaderBytes + tr.offset();
    if (!tr.U32(&d.checksum)) return bad("truncated checksum");
    d.payload_bytes = dense_bytes;
  } else if (d.mode == kSparse) {
    REFIT_RETURN_IF_ERROR(ParseCount(head, d, bad));
    uint16_t params;
    if (!tr.U16(&params)) return bad("truncated parameters");
    d.kg = params & 31;
    d.kr = (params >> 5) & 31;
    d.ke = (params >> 10) & 63;
    if (d.kg > layout.block_log2 || d.kr > layout.block_log2 || d.ke > format::kMaxKe) {
      return bad(absl::StrCat("coding parameters kg=", int{d.kg}, " kr=", int{d.kr},
                              " ke=", int{d.ke}, " out of range"));
    }
    if (DTypeValueCoding(layout.dtype) == ValueCoding::kRaw && (d.kr != 0 || d.ke != 0)) {
      return bad("raw-coded dtype with run/exception parameters");
    }
    REFIT_RETURN_IF_ERROR(ParseSizeAndChecksum(tr, "sparse", dense_bytes, d, bad));
  } else if (layout.version == format::kVersion2) {  // CONTEXT
    REFIT_RETURN_IF_ERROR(ParseCount(head, d, bad));
    REFIT_RETURN_IF_ERROR(ParseSizeAndChecksum(tr, "context", dense_bytes, d, bad));
  } else {
    return bad("block mode 3 (CONTEXT) in a version-1 patch");
  }
  if (d.payload_bytes > patch_size - *payload_off) {
    return bad(absl::StrCat("payload of ", d.payload_bytes, " bytes at offset ", *payload_off,
                            " runs past the end of the ", patch_size, "-byte patch"));
  }
  d.payload_offset = *payload_off;
  *payload_off += d.payload_bytes;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PatchLayout> ParsePatch(std::span<const uint8_t> patch) {
  PatchLayout layout;
  REFIT_ASSIGN_OR_RETURN(const uint64_t table_bytes, ParsePatchHeader(patch, layout));
  const uint64_t block = 1ull << layout.block_log2;
  const uint64_t num_blocks = (layout.num_elements + block - 1) / block;
  TableReader tr(patch.data() + format::kHeaderBytes, table_bytes);
  layout.blocks.resize(num_blocks);
  uint64_t payload_off = format::kHeaderBytes + table_bytes;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    REFIT_RETURN_IF_ERROR(
        ParseBlockEntry(tr, layout, i, patch.size(), layout.blocks[i], &payload_off));
  }
  if (tr.offset() != table_bytes) {
    return absl::DataLossError(absl::StrCat("patch: block table has ", table_bytes - tr.offset(),
                                            " trailing bytes after ", num_blocks, " entries"));
  }
  if (payload_off != patch.size()) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size() - payload_off,
                                            " trailing bytes after the last payload (offset ",
                                            payload_off, ")"));
  }
  return layout;
}

absl::StatusOr<PatchLayout> ParsePatchFor(std::span<const uint8_t> patch, DType dtype,
                                          uint64_t tensor_bytes) {
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  if (layout.dtype != dtype) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is for dtype ", DTypeName(layout.dtype), " but the tensor is ", DTypeName(dtype)));
  }
  const int w = DTypeSize(dtype);
  if (tensor_bytes % w != 0 || tensor_bytes / w != layout.num_elements) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is for ", layout.num_elements, " elements but the base tensor has ", tensor_bytes,
        " bytes (", tensor_bytes / w, " ", DTypeName(dtype), " elements)"));
  }
  return layout;
}

}  // namespace refit
