// The input language of data_plane_fuzzer (read with a FuzzedDataProvider), shared with its
// seed corpus generator (make_data_plane_corpus). For fuzzing tools only.
//
// An input is one subscriber's Sync session with an in-process DataPlaneService whose
// PublisherCore has published versions 1..3 of a small model: a sequence of operations, each an
// Op (ConsumeIntegralInRange<uint8_t>(0, kOpCount - 1)) followed by its arguments:
//   kHello           protocol (0..2), name (string, <= 16), version (VersionPick), digest
//                    (0: the publisher's digest of that version, 1: 0, 2: any u64), tensor
//                    digests (bool: send the publisher's), stripes (0..3), max_frame_bytes
//                    (0: 64 KiB, 1: 1 MiB, 2: any u32), patch format 1 (bool), lz4 (bool),
//                    want_keyframe (bool)
//   kAck             version (0: the last header's, 1: number), result (0..3), applied version
//                    (0: the last header's, 1: its base, 2: number), digest (0: the last
//                    VersionEnd's, 1: any u64), mismatched tensors (count 0..2, each a TensorPick)
//   kKeyframeRequest version (number), tensors (count 0..2, TensorPick), all_tensors (bool),
//                    reason (string, <= 16)
//   kEmpty           an empty SubscriberMessage
//   kWait            until (WaitFor), bounded by kWaitMillis
//   kStripe          session id (0: Welcome's, 1: any u64), index (0..4): a Stripe call, drained
//   kWritesDone      half-closes the Sync stream
//   kResync          DataPlaneService::RequestResync: all (bool), tensors (count 0..2, TensorPick)
//   kRaw             length (u16, <= 512) then that many bytes parsed as a SubscriberMessage
// VersionPick: 0..3 -> that version, 4 -> number. TensorPick: 0..3 -> a tensor of the model
// (3: the one version 3 adds), 4 -> string (<= 16). A number: any u64.
#ifndef REFIT_DAEMON_SERVING_DATA_PLANE_FUZZ_INPUT_H_
#define REFIT_DAEMON_SERVING_DATA_PLANE_FUZZ_INPUT_H_

#include <cstdint>

namespace refit::publisher::fuzz {

enum Op : uint8_t {
  kHello,
  kAck,
  kKeyframeRequest,
  kEmpty,
  kWait,
  kStripe,
  kWritesDone,
  kResync,
  kRaw,
  kOpCount
};

enum WaitFor : uint8_t {
  kWaitMessage,  // the next PublisherMessage
  kWaitEnd,      // the next VersionEnd
  kWaitClosed,   // the stream's end
  kWaitForCount
};

inline constexpr int kWaitMillis = 100;
inline constexpr uint16_t kMaxRawBytes = 512;
inline constexpr int kMaxStringBytes = 16;

}  // namespace refit::publisher::fuzz

#endif  // REFIT_DAEMON_SERVING_DATA_PLANE_FUZZ_INPUT_H_
