// The publisher's patch log (persist_dir/patches.log): an append-only file of one record per
// published version, holding what the patch history holds for it (per tensor: spec, digest, and
// the codec patch from the previous version, or the dense bytes of a keyframe tensor). A
// restarted publisher loads persist_dir/baseline.safetensors (version b) and replays the records
// above b in order. The format, version 1, is specified normatively in docs/ARCHITECTURE.md
// ("Patch log format, version 1", with record version 2 for parts); a golden file freezes it
// (testdata/patch_log_v1.bin).
//
// This file only encodes, writes and reads the format; BaselinePersister decides when to append
// and when to compact, PublisherCore replays.
#ifndef REFIT_DAEMON_SERVING_PATCH_LOG_H_
#define REFIT_DAEMON_SERVING_PATCH_LOG_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "refit/v1/common.pb.h"

namespace refit::publisher {

inline constexpr char kPatchLogFile[] = "patches.log";
inline constexpr char kPatchLogMagic[8] = {'R', 'E', 'F', 'I', 'T', 'L', 'O', 'G'};
// A record's frame magic is its record version: "RREC" version 1, "RRE2" version 2 (tensor
// entries may be parts, TensorSpec.part), "RRE3" version 3 (as version 2, but its digests are
// digest v2: LogRecord::digests_v2). A record is written as version 1 unless it holds a part or
// v2 digests, so a log without either is byte for byte a version-1 log; readers take every
// version in any mix.
inline constexpr char kPatchRecordMagic[4] = {'R', 'R', 'E', 'C'};
inline constexpr char kPatchRecordMagicV2[4] = {'R', 'R', 'E', '2'};
inline constexpr char kPatchRecordMagicV3[4] = {'R', 'R', 'E', '3'};
inline constexpr uint32_t kPatchLogFormat = 1;
inline constexpr uint64_t kPatchLogHeaderBytes = 40;
inline constexpr uint64_t kPatchRecordFrameBytes = 28;
// Hash64 seeds of the header and of a record's frame and body ("RFLGHEAD", "RFLGFRAM",
// "RFLGBODY" as little-endian integers).
inline constexpr uint64_t kPatchLogHeaderSeed = 0x44414548474c4652ull;
inline constexpr uint64_t kPatchRecordFrameSeed = 0x4d415246474c4652ull;
inline constexpr uint64_t kPatchRecordBodySeed = 0x59444f42474c4652ull;
// A record body is at most this large (larger lengths are corrupt, not torn).
inline constexpr uint64_t kMaxPatchRecordBytes = 1ull << 44;

enum class LogTensorKind : uint8_t {
  kUnchanged = 0,  // same spec and digest as at the previous version: no bytes
  kPatch = 1,      // codec patch from the previous version's bytes
  kDense = 2,      // the tensor's whole bytes (new, dtype/shape changed, or not encoded)
};

struct LogTensor {
  v1::TensorSpec spec;  // name, dtype, shape, part
  LogTensorKind kind = LogTensorKind::kUnchanged;
  uint64_t digest = 0;  // full-tensor digest at this version (v1, or v2 in a digests_v2 record)
  uint64_t changed_elements = 0;  // encoder's count (patch), every element (dense), 0 unchanged
  std::shared_ptr<const std::vector<uint8_t>> bytes;  // patch or dense bytes; null when unchanged
};

// One published version.
struct LogRecord {
  uint64_t version = 0;
  uint64_t base_version = 0;  // the version published before it (the patches' base)
  uint64_t version_digest = 0;  // over the tensors' digests (v1, or v2 with digests_v2)
  uint64_t lineage = 0;
  uint64_t snapshot_unix_nanos = 0;
  std::vector<LogTensor> tensors;  // the whole manifest, manifest order
  // The digests are digest v2 (TensorDigestV2 and its version digest): written by a publisher
  // that left the version's v1 digests pending (PublisherOptions::lazy_v1_digests); record
  // version 3.
  bool digests_v2 = false;

  // Bytes the record holds (patch + dense bytes), for queue bounds.
  uint64_t payload_bytes() const;
};

struct LogHeader {
  uint64_t lineage = 0;
  uint64_t base_version = 0;  // the baseline version the log was started after
};

// The header's and a record's bytes (frame + body), as appended.
std::vector<uint8_t> EncodeLogHeader(const LogHeader& header);
std::vector<uint8_t> EncodeLogRecord(const LogRecord& record);

// Appends records to one log file. Not thread-safe (the persister's thread owns it).
class PatchLogWriter {
 public:
  // Starts a new log at `path` holding only the header: written to a temporary file
  // (`path`.tmp-XXXXXX), fsynced with `fsync`, renamed over `path`, directory fsynced.
  static absl::StatusOr<std::unique_ptr<PatchLogWriter>> Create(const std::string& path,
                                                                const LogHeader& header,
                                                                bool fsync);
  // Continues an existing log whose valid content ends at `end` (ReadPatchLog's valid_end):
  // truncates anything after it, appends from there.
  static absl::StatusOr<std::unique_ptr<PatchLogWriter>> OpenForAppend(const std::string& path,
                                                                       uint64_t end, bool fsync);
  ~PatchLogWriter();
  PatchLogWriter(const PatchLogWriter&) = delete;
  PatchLogWriter& operator=(const PatchLogWriter&) = delete;

  // Writes the record at the end and (with fsync) fdatasyncs. On error the file may hold a torn
  // record at its end: the writer is then unusable (Append fails), the reader truncates it.
  absl::Status Append(const LogRecord& record);
  uint64_t bytes() const { return end_; }
  const std::string& path() const { return path_; }

 private:
  PatchLogWriter(std::string path, int fd, uint64_t end, bool fsync)
      : path_(std::move(path)), fd_(fd), end_(end), fsync_(fsync) {}
  const std::string path_;
  int fd_ = -1;
  uint64_t end_ = 0;
  const bool fsync_;
  bool broken_ = false;
};

struct LogReadResult {
  LogHeader header;
  std::vector<LogRecord> records;  // every valid record before the end or the first bad one
  std::vector<uint64_t> offsets;   // file offset of each record
  uint64_t valid_end = 0;          // offset just after the last valid record
  uint64_t file_bytes = 0;
  // Bytes after valid_end that are a torn append (docs: "torn tail"); the log is usable.
  bool torn_tail = false;
  // Not OK: a corrupt record at `valid_end` (DataLoss naming the file and the offset); the
  // records before it are valid.
  absl::Status corrupt;
};

// Reads a whole log. NotFound when absent; DataLoss naming the file when the header is not a
// version-1 patch log header (nothing usable).
absl::StatusOr<LogReadResult> ReadPatchLog(const std::string& path);

// Decodes one record body (the bytes after the frame) of record version `record_version` (1, 2
// or 3: the frame's magic). DataLoss naming `where` when malformed.
absl::StatusOr<LogRecord> DecodeLogRecordBody(std::span<const uint8_t> body,
                                              const std::string& where,
                                              uint32_t record_version = 1);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PATCH_LOG_H_
