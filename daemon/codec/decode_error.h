// The patch decoder's errors: one code and one text per failure, shared by the CPU decoder and
// the GPU decoder (cuda/), so that both report a corrupt payload with the same words. Plain C++
// (no CUDA types, no abseil): the codes are used in device code, the texts on the host.
#ifndef REFIT_DAEMON_CODEC_DECODE_ERROR_H_
#define REFIT_DAEMON_CODEC_DECODE_ERROR_H_

#include <cstdint>

namespace refit {
namespace decode_error {

// Fixed values: the GPU decoder reports them through device memory.
enum Code : uint32_t {
  kNone = 0,
  // SPARSE blocks (the bit reader's decode, step by step).
  kRunTruncated = 1,
  kRunPastCount = 2,
  kGapTruncated = 3,
  kPosPastEnd = 4,
  kValueTruncated = 5,
  kRawEqualsBase = 6,  // also CONTEXT blocks
  kExcPrefix = 7,
  kExcTooLarge = 8,
  kExcTruncated = 9,
  kDiffRange = 10,  // also CONTEXT blocks
  // The payload's end: its size is not that of the bits its changes use (the message names the
  // sizes), or the padding bits after them are not zero.
  kBadSize = 11,
  kPadding = 12,
  // CONTEXT blocks (range-coded).
  kCtxNotStream = 13,
  kCtxAnchorExp = 14,
  kCtxAnchorWidth = 15,
  kCtxNoClass = 16,
  kCtxK = 17,
  kCtxTruncated = 18,
  kCtxGap = 19,
  kCtxMore = 20,
  kCtxLastGap = 21,
  kCtxEmptyClass = 22,
  kCtxFewer = 23,
  kCtxEnd = 24,
};

}  // namespace decode_error

// The text of a decoder error code (the words after the block and change it names).
constexpr const char* DecodeErrorText(uint32_t code) {
  switch (code) {
    case decode_error::kNone: return "no error";
    case decode_error::kRunTruncated: return "truncated or oversized run length";
    case decode_error::kRunPastCount: return "run length runs past the block's change count";
    case decode_error::kGapTruncated: return "truncated or oversized position gap";
    case decode_error::kPosPastEnd: return "position beyond the end of the block";
    case decode_error::kValueTruncated: return "truncated value";
    case decode_error::kRawEqualsBase: return "raw value equals the base value (not a change)";
    case decode_error::kExcPrefix: return "truncated or oversized exception prefix";
    case decode_error::kExcTooLarge: return "exception magnitude too large for the dtype";
    case decode_error::kExcTruncated: return "truncated exception magnitude";
    case decode_error::kDiffRange: return "difference out of range for the dtype";
    case decode_error::kBadSize: return "payload size differs from the bits its changes use";
    case decode_error::kPadding: return "nonzero padding bits";
    case decode_error::kCtxNotStream:
      return "not a range-coded stream (too short or bad first bytes)";
    case decode_error::kCtxAnchorExp: return "the class anchor exceeds the dtype's exponent field";
    case decode_error::kCtxAnchorWidth: return "the class anchor exceeds the dtype's width";
    case decode_error::kCtxNoClass: return "no class has a change";
    case decode_error::kCtxK: return "a class's gap parameter is out of [0, 24]";
    case decode_error::kCtxTruncated: return "truncated stream";
    case decode_error::kCtxGap: return "truncated or oversized gap";
    case decode_error::kCtxMore: return "more changes than the block's count";
    case decode_error::kCtxLastGap: return "the class's last gap runs past its elements";
    case decode_error::kCtxEmptyClass: return "a class in the mask has no change";
    case decode_error::kCtxFewer: return "fewer changes than the block's count";
    case decode_error::kCtxEnd: return "the stream does not end where its last symbol does";
    default: return "unknown decoder error";
  }
}

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_DECODE_ERROR_H_
