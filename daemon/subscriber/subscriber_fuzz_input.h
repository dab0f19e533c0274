// The input language of subscriber_fuzzer (read with a FuzzedDataProvider) and the real
// transfers it mutates, shared with the seed corpus generator (make_subscriber_corpus). For
// fuzzing tools only.
//
// An input is a sequence of operations on one SubscriberCore that starts holding version 1 of a
// small BF16 model. Each operation is an Op (ConsumeIntegralInRange<uint8_t>(0, kOpCount - 1)),
// then its arguments:
//   kHeader        wire (u8 in range), mutations: count (0..3), each a HeaderMutation + values
//   kFrame         wire, frame index (u32 in range), mutation (FrameMutation + values)
//   kEnd           wire, mutation (EndMutation + values)
//   kAbort         -
//   kFrameLimit    u32 (SetMaxFrameBytes)
//   kWholeTransfer wire: header, every frame, end, unmutated
//   kRawHeader / kRawFrame / kRawEnd: length (u16, <= kMaxRawBytes) then that many bytes (from
//                  the front) parsed as the proto message
// A "number" argument is a selector (0..2) then: 0 -> 0..8, 1 -> any u64, 2 -> any u32.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_FUZZ_INPUT_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_FUZZ_INPUT_H_

#include <cstdint>
#include <vector>

#include "refit/v1/data.pb.h"

namespace refit::subscriber::fuzz {

enum Op : uint8_t {
  kHeader,
  kFrame,
  kEnd,
  kAbort,
  kFrameLimit,
  kWholeTransfer,
  kRawHeader,
  kRawFrame,
  kRawEnd,
  kOpCount
};

enum HeaderMutation : uint8_t {
  kHeaderVersion,       // number
  kHeaderBase,          // number
  kHeaderDelivery,      // tensor (u8), delivery (0..4)
  kHeaderDType,         // tensor, dtype code (0..20)
  kHeaderShape,         // tensor, dimension (0..3), number (dimension past the end: appended)
  kHeaderDropTensor,    // tensor
  kHeaderCopyTensor,    // tensor (appended again)
  kHeaderSwapTensors,   // tensor, tensor
  kHeaderStep,          // tensor, step (0..3; past the end: appended), base number, target number
  kHeaderRename,        // tensor, string (ConsumeRandomLengthString(16))
  kHeaderMutationCount
};

enum FrameMutation : uint8_t {
  kFrameNone,
  kFrameVersion,      // number
  kFrameTensorIndex,  // number
  kFramePart,         // number
  kFrameObjectBytes,  // number
  kFrameChunkCount,   // number
  kFrameChunkIndex,   // number
  kFrameOffset,       // number
  kFrameRawBytes,     // number
  kFrameCompression,  // 0..4
  kFrameFlipByte,     // position (u32, modulo the payload size), bit (0..7), re-sign (bool)
  kFrameTruncate,     // length (u32, modulo the payload size + 1), re-sign (bool)
  kFrameChecksum,     // any u64
  kFrameMutationCount
};

enum EndMutation : uint8_t {
  kEndNone,
  kEndVersion,        // number
  kEndDigest,         // index (u8, modulo the count), any u64
  kEndDropDigest,     // -
  kEndVersionDigest,  // any u64
  kEndMutationCount
};

inline constexpr uint16_t kMaxRawBytes = 1024;
inline constexpr uint32_t kFrameBytes = 1024;  // Welcome.frame_bytes of every transfer

// What travels for one transfer, as the publisher's core cut it.
struct Wire {
  v1::VersionHeader header;
  std::vector<v1::DataFrame> frames;
  v1::VersionEnd end;
};

// The transfers an input picks from, made once by a PublisherCore publishing versions 1..3 of
// a small model (version 3 adds a tensor: a manifest change):
//   0: 0 -> 1 (bootstrap; every input starts by applying it), 1: 1 -> 2, 2: 0 -> 2 (keyframes),
//   3: 2 -> 3, 4: 1 -> 3 (patch chain), 5: 1 -> 3 all keyframes, 6: 1 -> 3 one tensor keyframed.
// Aborts if the publisher cannot make them.
const std::vector<Wire>& GetWires();

}  // namespace refit::subscriber::fuzz

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_FUZZ_INPUT_H_
