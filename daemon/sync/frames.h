// Cutting objects (codec patches, dense keyframes) into DataFrames and reassembling them.
// Semantics: proto/refit/v1/data.proto, message DataFrame.
#ifndef REFIT_DAEMON_SYNC_FRAMES_H_
#define REFIT_DAEMON_SYNC_FRAMES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "refit/v1/data.pb.h"

namespace refit::sync {

// Where an object goes: VersionHeader.version, DataFrame.tensor_index and part.
struct FrameTarget {
  uint64_t version = 0;
  uint32_t tensor_index = 0;
  uint32_t part = 0;
};

struct SplitOptions {
  // Largest payload (and raw chunk size) per frame: Welcome.frame_bytes. 1 .. kMaxFrameBytes.
  uint32_t frame_bytes = 4u << 20;
  // Compress chunks with LZ4 (keyframes only): MakeFrame compresses its chunk and sends it with
  // COMPRESSION_NONE when it does not shrink. Whether an object is worth it is decided once per
  // object by Lz4Pays (SplitObject does; a lazy sender decides when it plans the object).
  bool lz4 = false;
};

// Bytes of an object's start that Lz4Pays compresses as its sample.
inline constexpr uint32_t kLz4SampleBytes = 64 * 1024;
// LZ4 pays for an object when its sample (the first min(kLz4SampleBytes, size) bytes) shrinks
// by at least 1/kLz4MinSavingDivisor (~3%). Random-looking BF16 weights do not (LZ4 saves
// ~0.01% on them and costs a compression pass per chunk); zeros, constant norms, masks do.
// Deterministic in the object's bytes, so every chunk of an object decides alike.
inline constexpr uint32_t kLz4MinSavingDivisor = 32;
bool Lz4Pays(std::span<const uint8_t> object);

// LZ4's block input limit; larger frame sizes are rejected.
inline constexpr uint32_t kMaxFrameBytes = 0x7E000000u;

// Number of chunks an object of object_bytes is cut into (>= 1; 1 for an empty object).
// InvalidArgument if frame_bytes is 0 / too large or the count does not fit in u32.
absl::StatusOr<uint32_t> ChunkCount(uint64_t object_bytes, uint32_t frame_bytes);

// Builds frame `chunk_index` of `object`: chunk i covers [i * frame_bytes, min(+frame_bytes,
// size)). Lets a sender produce frames lazily, spread over stripes.
absl::StatusOr<v1::DataFrame> MakeFrame(std::span<const uint8_t> object, const FrameTarget& target,
                                        const SplitOptions& options, uint32_t chunk_index);

// All frames of `object`, in chunk order; LZ4 only when options.lz4 and Lz4Pays(object).
absl::StatusOr<std::vector<v1::DataFrame>> SplitObject(std::span<const uint8_t> object,
                                                       const FrameTarget& target,
                                                       const SplitOptions& options);

// What the receiver expects for one object of the transfer (from VersionHeader).
struct ObjectSpec {
  uint32_t tensor_index = 0;
  uint32_t part = 0;
  std::string tensor_name;  // for error messages
  // exact_size: object_bytes must equal `bytes` (keyframes: the tensor's byte size).
  // Otherwise object_bytes must be <= `bytes` (patches: MaxPatchBytes of the tensor).
  uint64_t bytes = 0;
  bool exact_size = false;
  bool allow_lz4 = false;  // keyframes only
  // Optional destination (e.g. the staging area of a keyframe tensor); must hold `bytes` bytes.
  // Empty: the assembler allocates object_bytes on the first valid frame.
  std::span<uint8_t> buffer;
  // Sum the object's digest v2 (codec/digest_v2.h) as its chunks are written, reading each
  // chunk back from the destination right after writing it (while it is in cache): the digest
  // of what the destination holds, without a second pass over the object (ObjectDigestV2).
  bool digest_v2 = false;
};

// The objects a receiver expects for tensor `tensor_index` of a VersionHeader: a KEYFRAME's
// dense bytes (exact size, LZ4 allowed), one patch per PATCH step (at most MaxPatchBytes), none
// for UNCHANGED. InvalidArgument for an invalid spec.
absl::StatusOr<std::vector<ObjectSpec>> ObjectsOf(const v1::TensorPlan& tp, uint32_t tensor_index);

// Upper bound on the size of a valid codec patch (daemon/codec/format.h) for a tensor of
// num_elements elements and tensor_bytes bytes: header + 16 bytes of table per block of the
// smallest block size + the dense bytes. Caps a patch object's size field.
uint64_t MaxPatchBytes(uint64_t num_elements, uint64_t tensor_bytes);

// Receives the DataFrames of one transfer, in any order, and reassembles its objects.
// Not thread-safe: callers serialise Add (e.g. one mutex per transfer).
class FrameAssembler {
 public:
  // version: VersionHeader.version; max_frame_bytes: Welcome.frame_bytes (payload and
  // raw_bytes limit per frame).
  FrameAssembler(uint64_t version, uint32_t max_frame_bytes);

  // Declares an object. InvalidArgument for a duplicate (tensor_index, part) or a too small
  // caller buffer.
  absl::Status Expect(ObjectSpec spec);

  // Validates and stores one frame. Returns true when this frame completed its object.
  // InvalidArgument (structure: version, unknown object, chunk index/offset/sizes, duplicate
  // chunk, compression) or DataLoss (checksum, corrupt LZ4); messages name version, tensor,
  // part and chunk. A rejected frame changes no state except, for a corrupt LZ4 block, bytes
  // inside its own (still missing) chunk range.
  absl::StatusOr<bool> Add(const v1::DataFrame& frame);

  bool ObjectComplete(uint32_t tensor_index, uint32_t part) const;
  bool AllComplete() const { return complete_objects_ == objects_.size(); }
  // OK when every expected object is complete; otherwise FailedPrecondition naming the first
  // incomplete object and how many chunks it lacks (for VersionEnd).
  absl::Status CheckAllComplete() const;
  // The bytes of a complete object (a view of the caller's buffer or the internal one).
  // FailedPrecondition if incomplete, NotFound if not expected.
  absl::StatusOr<std::span<const uint8_t>> Object(uint32_t tensor_index, uint32_t part) const;
  // The digest v2 of a complete object whose spec asked for it (ObjectSpec::digest_v2), as its
  // destination held each chunk once written; nullopt when not asked for, incomplete, or when a
  // chunk did not start on an 8-byte word of the object (then the caller reads it whole).
  std::optional<uint64_t> ObjectDigestV2(uint32_t tensor_index, uint32_t part) const;
  // Moves out an internally owned complete object (empty vector for caller-provided buffers).
  absl::StatusOr<std::vector<uint8_t>> TakeObject(uint32_t tensor_index, uint32_t part);

  uint64_t frames() const { return frames_; }
  uint64_t payload_bytes() const { return payload_bytes_; }

 private:
  struct State {
    ObjectSpec spec;
    bool started = false;
    uint64_t object_bytes = 0;
    uint32_t chunk_count = 0;
    uint32_t chunks_received = 0;
    uint64_t bytes_received = 0;
    std::vector<bool> received;             // by chunk index
    std::map<uint64_t, std::pair<uint32_t, uint64_t>> by_offset;  // offset -> (index, raw_bytes)
    std::vector<uint8_t> owned;
    std::span<uint8_t> dest;
    bool complete = false;
    uint64_t v2_sum = 0;   // spec.digest_v2: the mix sums of the chunks written so far
    bool v2_exact = true;  // false once a chunk did not start on a word of the object
  };
  static uint64_t Key(uint32_t tensor_index, uint32_t part) {
    return (static_cast<uint64_t>(tensor_index) << 32) | part;
  }
  std::string Where(const State* st, uint32_t tensor_index, uint32_t part,
                    const v1::DataFrame& f) const;
  // Add's steps, in order: a frame's object-wide fields against its object, its chunk's own
  // fields, its place among the chunks received (InvalidArgument prefixed `where` at the first
  // violation), then writing it (DataLoss for a corrupt LZ4 block).
  absl::Status CheckObjectFields(const State& st, const v1::DataFrame& f,
                                 const std::string& where) const;
  absl::Status CheckChunk(const State& st, const v1::DataFrame& f,
                          const std::string& where) const;
  static absl::Status CheckPlacement(const State& st, const v1::DataFrame& f,
                                     const std::string& where);
  static absl::Status WriteChunk(State& st, const v1::DataFrame& f, const std::string& where);

  uint64_t version_;
  uint32_t max_frame_bytes_;
  std::map<uint64_t, State> objects_;
  size_t complete_objects_ = 0;
  uint64_t frames_ = 0;
  uint64_t payload_bytes_ = 0;
};

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_FRAMES_H_
