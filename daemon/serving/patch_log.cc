#include "daemon/serving/patch_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <span>

#include "absl/strings/str_cat.h"
#include "daemon/codec/hash.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

void PutU8(std::vector<uint8_t>& out, uint8_t v) { out.push_back(v); }
void PutU16(std::vector<uint8_t>& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutU64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutBytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint32_t GetU32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// Sequential little-endian reads with bounds checks.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> data) : data_(data) {}
  bool U8(uint8_t* v) {
    return Take(1, [&](const uint8_t* p) { *v = p[0]; });
  }
  bool U16(uint16_t* v) {
    return Take(2, [&](const uint8_t* p) { *v = static_cast<uint16_t>(p[0] | p[1] << 8); });
  }
  bool U32(uint32_t* v) {
    return Take(4, [&](const uint8_t* p) { *v = GetU32(p); });
  }
  bool U64(uint64_t* v) {
    return Take(8, [&](const uint8_t* p) { *v = GetU64(p); });
  }
  bool Bytes(uint64_t n, std::span<const uint8_t>* out) {
    if (n > data_.size() - pos_) return false;
    *out = data_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == data_.size(); }

 private:
  template <typename F>
  bool Take(size_t n, F f) {
    if (n > data_.size() - pos_) return false;
    f(data_.data() + pos_);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> data_;
  size_t pos_ = 0;
};

absl::Status WriteAll(int fd, std::span<const uint8_t> data, uint64_t offset,
                      const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("write ", Quoted(path), ": ", ErrnoText(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads exactly data.size() bytes at `offset`; false at end of file.
absl::StatusOr<bool> ReadAt(int fd, std::span<uint8_t> data, uint64_t offset,
                            const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::pread(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::DataLossError(absl::StrCat("read ", Quoted(path), ": ", ErrnoText(errno)));
    }
    if (n == 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

absl::Status SyncDir(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    return absl::InternalError(absl::StrCat("open ", Quoted(dir), ": ", ErrnoText(errno)));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0)
    return absl::InternalError(absl::StrCat("fsync ", Quoted(dir), ": ", ErrnoText(err)));
  return absl::OkStatus();
}

// Record version 3 for v2 digests, else 2 when a tensor of the record is a part, else 1
// (patch_log.h).
uint32_t RecordVersion(const LogRecord& r) {
  if (r.digests_v2) return 3;
  for (const LogTensor& t : r.tensors) {
    if (sync::IsPart(t.spec)) return 2;
  }
  return 1;
}

// A tensor entry's part (record version 2): u8 flag 0 (none), 1 (a part along dim 0) or 2 (a
// part along another dim), then u64 first_row, with flag 2 a u8 dim, then u8 whole rank and the
// whole dimensions. Row parts keep flag 1, so logs written before parts had a dim read unchanged.
void PutPart(std::vector<uint8_t>& out, const v1::TensorSpec& spec) {
  if (!sync::IsPart(spec)) {
    PutU8(out, 0);
    return;
  }
  const uint32_t dim = spec.part().dim();
  PutU8(out, dim == 0 ? 1 : 2);
  PutU64(out, spec.part().first_row());
  if (dim != 0) PutU8(out, static_cast<uint8_t>(dim));
  PutU8(out, static_cast<uint8_t>(spec.part().whole_shape_size()));
  for (uint64_t d : spec.part().whole_shape()) PutU64(out, d);
}

// An upper bound of the body's bytes: its fixed fields, each entry's fixed fields (at most 64),
// name, dims, part dims and bytes.
uint64_t BodyBytesBound(const LogRecord& r) {
  uint64_t n = 64 + r.payload_bytes();
  for (const LogTensor& t : r.tensors) {
    n += 64 + t.spec.name().size() + 8 * static_cast<uint64_t>(t.spec.shape_size()) +
         8 * static_cast<uint64_t>(t.spec.part().whole_shape_size());
  }
  return n;
}

// Appends the record's body to `out` (reserved by the caller: the patch and dense bytes are
// copied once, into their place in the record).
void AppendBody(const LogRecord& r, uint32_t record_version, std::vector<uint8_t>& out) {
  PutU64(out, r.version);
  PutU64(out, r.base_version);
  PutU64(out, r.version_digest);
  PutU64(out, r.lineage);
  PutU64(out, r.snapshot_unix_nanos);
  PutU32(out, static_cast<uint32_t>(r.tensors.size()));
  for (const LogTensor& t : r.tensors) {
    PutU16(out, static_cast<uint16_t>(t.spec.name().size()));
    PutBytes(out, t.spec.name().data(), t.spec.name().size());
    PutU8(out, static_cast<uint8_t>(t.spec.dtype()));
    PutU8(out, static_cast<uint8_t>(t.kind));
    PutU8(out, static_cast<uint8_t>(t.spec.shape_size()));
    for (uint64_t d : t.spec.shape()) PutU64(out, d);
    if (record_version >= 2) PutPart(out, t.spec);
    PutU64(out, t.digest);
    PutU64(out, t.changed_elements);
    const uint64_t n = t.bytes != nullptr ? t.bytes->size() : 0;
    PutU64(out, n);
    if (n > 0) PutBytes(out, t.bytes->data(), n);
  }
}

// A tensor entry's part (PutPart); false when truncated, the flag is not 0, 1 or 2, or flag 2
// gives dim 0 (which flag 1 encodes).
bool GetPart(Reader& in, v1::TensorSpec& spec) {
  uint8_t flag = 0;
  if (!in.U8(&flag) || flag > 2) return false;
  if (flag == 0) return true;
  uint64_t first_row = 0;
  uint8_t dim = 0;
  uint8_t rank = 0;
  if (!in.U64(&first_row)) return false;
  if (flag == 2 && (!in.U8(&dim) || dim == 0)) return false;
  if (!in.U8(&rank)) return false;
  v1::TensorPart* part = spec.mutable_part();
  part->set_first_row(first_row);
  part->set_dim(dim);
  for (uint8_t i = 0; i < rank; ++i) {
    uint64_t d = 0;
    if (!in.U64(&d)) return false;
    part->add_whole_shape(d);
  }
  return true;
}

// Entry `i` after the one before it: manifest order (name, then parts by dim and first index;
// sync::SpecBefore), several entries of one name only as parts that tile along one dim without
// overlapping (sync::CheckNextPart).
absl::Status CheckEntryOrder(const v1::TensorSpec& before, const v1::TensorSpec& spec, uint32_t i,
                             const std::string& where) {
  if (before.name() != spec.name()) {
    if (before.name() < spec.name()) return absl::OkStatus();
    return absl::DataLossError(
        absl::StrCat(where, ": tensor entry ", i, ": names not in ascending order"));
  }
  if (absl::Status st = sync::CheckNextPart(before, spec); !st.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": tensor entry ", i, ": ", st.message()));
  }
  return absl::OkStatus();
}

// One tensor entry of a record body (see AppendBody).
absl::StatusOr<LogTensor> DecodeTensor(Reader& in, uint32_t index, const std::string& where,
                                       uint32_t record_version) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(where, ": tensor entry ", index, ": ", why));
  };
  uint16_t name_len = 0;
  uint8_t dtype = 0, kind = 0, rank = 0;
  std::span<const uint8_t> name;
  if (!in.U16(&name_len) || !in.Bytes(name_len, &name) || !in.U8(&dtype) || !in.U8(&kind) ||
      !in.U8(&rank)) {
    return bad("truncated");
  }
  LogTensor t;
  t.spec.set_name(std::string(name.begin(), name.end()));
  t.spec.set_dtype(static_cast<v1::DType>(dtype));
  for (uint8_t i = 0; i < rank; ++i) {
    uint64_t d = 0;
    if (!in.U64(&d)) return bad("truncated shape");
    t.spec.add_shape(d);
  }
  if (record_version >= 2 && !GetPart(in, t.spec)) return bad("truncated or bad part");
  uint64_t n = 0;
  if (!in.U64(&t.digest) || !in.U64(&t.changed_elements) || !in.U64(&n)) return bad("truncated");
  if (absl::Status st = sync::ValidateTensorSpec(t.spec); !st.ok())
    return bad(std::string(st.message()));
  if (kind > static_cast<uint8_t>(LogTensorKind::kDense)) return bad(absl::StrCat("kind ", kind));
  t.kind = static_cast<LogTensorKind>(kind);
  const uint64_t tensor_bytes = *sync::TensorByteSize(t.spec);
  if ((t.kind == LogTensorKind::kUnchanged && n != 0) ||
      (t.kind == LogTensorKind::kDense && n != tensor_bytes) ||
      (t.kind == LogTensorKind::kPatch && n == 0)) {
    return bad(absl::StrCat(n, " bytes for kind ", kind, " of a ", tensor_bytes, "-byte tensor"));
  }
  std::span<const uint8_t> bytes;
  if (!in.Bytes(n, &bytes)) return bad("truncated bytes");
  if (t.kind != LogTensorKind::kUnchanged) {
    t.bytes = std::make_shared<const std::vector<uint8_t>>(bytes.begin(), bytes.end());
  }
  return t;
}

}  // namespace

uint64_t LogRecord::payload_bytes() const {
  uint64_t n = 0;
  for (const LogTensor& t : tensors) n += t.bytes != nullptr ? t.bytes->size() : 0;
  return n;
}

std::vector<uint8_t> EncodeLogHeader(const LogHeader& header) {
  std::vector<uint8_t> out;
  PutBytes(out, kPatchLogMagic, sizeof(kPatchLogMagic));
  PutU32(out, kPatchLogFormat);
  PutU32(out, 0);
  PutU64(out, header.lineage);
  PutU64(out, header.base_version);
  PutU64(out, Hash64(out, kPatchLogHeaderSeed));
  return out;
}

std::vector<uint8_t> EncodeLogRecord(const LogRecord& record) {
  const uint32_t record_version = RecordVersion(record);
  // One buffer: the frame's room, then the body written behind it, then the frame.
  std::vector<uint8_t> out;
  out.reserve(kPatchRecordFrameBytes + BodyBytesBound(record));
  out.resize(kPatchRecordFrameBytes);
  AppendBody(record, record_version, out);
  const std::span<const uint8_t> body(out.data() + kPatchRecordFrameBytes,
                                      out.size() - kPatchRecordFrameBytes);
  const char* magic = record_version == 1   ? kPatchRecordMagic
                      : record_version == 2 ? kPatchRecordMagicV2
                                            : kPatchRecordMagicV3;
  std::vector<uint8_t> frame;
  PutBytes(frame, magic, sizeof(kPatchRecordMagic));
  PutU64(frame, body.size());
  PutU64(frame, Hash64(body, kPatchRecordBodySeed));
  PutU64(frame, Hash64(frame, kPatchRecordFrameSeed));
  std::memcpy(out.data(), frame.data(), kPatchRecordFrameBytes);
  return out;
}

absl::StatusOr<LogRecord> DecodeLogRecordBody(std::span<const uint8_t> body,
                                              const std::string& where, uint32_t record_version) {
  if (record_version < 1 || record_version > 3) {
    return absl::DataLossError(absl::StrCat(where, ": unknown record version ", record_version));
  }
  Reader in(body);
  LogRecord r;
  r.digests_v2 = record_version == 3;
  uint32_t count = 0;
  if (!in.U64(&r.version) || !in.U64(&r.base_version) || !in.U64(&r.version_digest) ||
      !in.U64(&r.lineage) || !in.U64(&r.snapshot_unix_nanos) || !in.U32(&count)) {
    return absl::DataLossError(absl::StrCat(where, ": truncated record header"));
  }
  if (r.version == 0 || r.version > sync::kMaxVersion || r.base_version >= r.version ||
      r.lineage == 0 || count == 0) {
    return absl::DataLossError(absl::StrCat(where, ": bad record (version ", r.version, ", base ",
                                            r.base_version, ", ", count, " tensors)"));
  }
  if (count > body.size() / 30) {  // every entry takes at least 30 bytes
    return absl::DataLossError(absl::StrCat(where, ": ", count, " tensors do not fit"));
  }
  r.tensors.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    REFIT_ASSIGN_OR_RETURN(LogTensor t, DecodeTensor(in, i, where, record_version));
    if (i > 0) REFIT_RETURN_IF_ERROR(CheckEntryOrder(r.tensors.back().spec, t.spec, i, where));
    r.tensors.push_back(std::move(t));
  }
  if (!in.done()) return absl::DataLossError(absl::StrCat(where, ": trailing bytes in the record"));
  return r;
}

// ---- PatchLogWriter ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PatchLogWriter>> PatchLogWriter::Create(const std::string& path,
                                                                       const LogHeader& header,
                                                                       bool fsync) {
  std::string tmp = absl::StrCat(path, ".tmp-XXXXXX");
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("patch log ", Quoted(path), ": cannot create ",
                                            Quoted(tmp), ": ", ErrnoText(errno)));
  }
  const std::vector<uint8_t> head = EncodeLogHeader(header);
  absl::Status st = WriteAll(fd, head, 0, tmp);
  if (st.ok() && fsync && ::fsync(fd) != 0) {
    st = absl::InternalError(absl::StrCat("fsync ", Quoted(tmp), ": ", ErrnoText(errno)));
  }
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = absl::InternalError(
        absl::StrCat("rename ", Quoted(tmp), " to ", Quoted(path), ": ", ErrnoText(errno)));
  }
  if (st.ok() && fsync) st = SyncDir(path);
  if (!st.ok()) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return Annotate(st, "patch log");
  }
  return std::unique_ptr<PatchLogWriter>(new PatchLogWriter(path, fd, head.size(), fsync));
}

absl::StatusOr<std::unique_ptr<PatchLogWriter>> PatchLogWriter::OpenForAppend(
    const std::string& path, uint64_t end, bool fsync) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("patch log ", Quoted(path), ": cannot open: ", ErrnoText(errno)));
  }
  if (::ftruncate(fd, static_cast<off_t>(end)) != 0 || (fsync && ::fsync(fd) != 0)) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("patch log ", Quoted(path), ": truncating to ", end,
                                            " bytes: ", ErrnoText(err)));
  }
  return std::unique_ptr<PatchLogWriter>(new PatchLogWriter(path, fd, end, fsync));
}

PatchLogWriter::~PatchLogWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status PatchLogWriter::Append(const LogRecord& record) {
  if (broken_) {
    return absl::FailedPreconditionError(
        absl::StrCat("patch log ", Quoted(path_), ": an earlier append failed"));
  }
  const std::vector<uint8_t> bytes = EncodeLogRecord(record);
  absl::Status st = WriteAll(fd_, bytes, end_, path_);
  if (st.ok() && fsync_ && ::fdatasync(fd_) != 0) {
    st = absl::InternalError(absl::StrCat("fdatasync ", Quoted(path_), ": ", ErrnoText(errno)));
  }
  if (!st.ok()) {
    broken_ = true;
    return Annotate(st, "appending version ", record.version, " to the patch log");
  }
  end_ += bytes.size();
  return absl::OkStatus();
}

// ---- ReadPatchLog -----------------------------------------------------------------------------

namespace {

absl::StatusOr<LogHeader> ReadHeader(int fd, const std::string& path) {
  std::vector<uint8_t> h(kPatchLogHeaderBytes);
  REFIT_ASSIGN_OR_RETURN(bool full, ReadAt(fd, h, 0, path));
  const auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("patch log ", Quoted(path), ": ", why));
  };
  if (!full) return bad("shorter than its 40-byte header");
  if (std::memcmp(h.data(), kPatchLogMagic, sizeof(kPatchLogMagic)) != 0) {
    return bad("not a patch log (bad magic)");
  }
  if (GetU64(h.data() + 32) !=
      Hash64(std::span<const uint8_t>(h.data(), 32), kPatchLogHeaderSeed)) {
    return bad("header checksum mismatch");
  }
  if (GetU32(h.data() + 8) != kPatchLogFormat || GetU32(h.data() + 12) != 0) {
    return bad(absl::StrCat("unsupported format ", GetU32(h.data() + 8), " (expected ",
                            kPatchLogFormat, ")"));
  }
  LogHeader out{.lineage = GetU64(h.data() + 16), .base_version = GetU64(h.data() + 24)};
  if (out.lineage == 0) return bad("lineage 0");
  return out;
}

// True when every byte of [offset, end) is zero (space allocated by a crashed append).
absl::StatusOr<bool> AllZero(int fd, uint64_t offset, uint64_t end, const std::string& path) {
  std::vector<uint8_t> buf(1 << 16);
  while (offset < end) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - offset));
    REFIT_ASSIGN_OR_RETURN(bool full, ReadAt(fd, std::span<uint8_t>(buf.data(), n), offset, path));
    if (!full) return true;
    if (std::any_of(buf.begin(), buf.begin() + n, [](uint8_t b) { return b != 0; })) return false;
    offset += n;
  }
  return true;
}

enum class Next { kRecord, kEnd, kTorn, kCorrupt };

// Classifies what starts at `offset` (docs: "Reading a log"); on kRecord fills *body.
absl::StatusOr<Next> ReadFrame(int fd, uint64_t offset, uint64_t file_bytes,
                               const std::string& path, std::vector<uint8_t>* body,
                               uint32_t* record_version, std::string* why) {
  if (offset == file_bytes) return Next::kEnd;
  REFIT_ASSIGN_OR_RETURN(bool zeros, AllZero(fd, offset, file_bytes, path));
  if (zeros || file_bytes - offset < kPatchRecordFrameBytes) return Next::kTorn;
  uint8_t f[kPatchRecordFrameBytes];
  REFIT_ASSIGN_OR_RETURN(bool full, ReadAt(fd, f, offset, path));
  if (!full) return Next::kTorn;
  *record_version = std::memcmp(f, kPatchRecordMagic, sizeof(kPatchRecordMagic)) == 0       ? 1
                    : std::memcmp(f, kPatchRecordMagicV2, sizeof(kPatchRecordMagicV2)) == 0 ? 2
                    : std::memcmp(f, kPatchRecordMagicV3, sizeof(kPatchRecordMagicV3)) == 0 ? 3
                                                                                            : 0;
  if (*record_version == 0 ||
      GetU64(f + 20) != Hash64(std::span<const uint8_t>(f, 20), kPatchRecordFrameSeed)) {
    *why = "bad record frame (magic or frame checksum)";
    return Next::kCorrupt;
  }
  const uint64_t len = GetU64(f + 4);
  if (len > kMaxPatchRecordBytes) {
    *why = absl::StrCat("record length ", len, " above the limit");
    return Next::kCorrupt;
  }
  const uint64_t end = offset + kPatchRecordFrameBytes + len;
  if (end > file_bytes) return Next::kTorn;
  body->resize(len);
  REFIT_ASSIGN_OR_RETURN(full, ReadAt(fd, *body, offset + kPatchRecordFrameBytes, path));
  if (!full) return Next::kTorn;
  if (GetU64(f + 12) != Hash64(*body, kPatchRecordBodySeed)) {
    if (end == file_bytes) return Next::kTorn;  // the last record, not completely on disk
    *why = "record checksum mismatch";
    return Next::kCorrupt;
  }
  return Next::kRecord;
}

}  // namespace

absl::StatusOr<LogReadResult> ReadPatchLog(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT)
      return absl::NotFoundError(absl::StrCat("patch log ", Quoted(path), " absent"));
    return absl::DataLossError(
        absl::StrCat("patch log ", Quoted(path), ": cannot open: ", ErrnoText(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrCat("patch log ", Quoted(path), ": not a regular file"));
  }
  LogReadResult out;
  out.file_bytes = static_cast<uint64_t>(st.st_size);
  REFIT_ASSIGN_OR_RETURN(out.header, ReadHeader(fd, path));
  uint64_t offset = kPatchLogHeaderBytes;
  std::vector<uint8_t> body;
  for (;;) {
    std::string why;
    uint32_t record_version = 0;
    REFIT_ASSIGN_OR_RETURN(
        Next next, ReadFrame(fd, offset, out.file_bytes, path, &body, &record_version, &why));
    if (next == Next::kEnd) break;
    if (next == Next::kTorn) {
      out.torn_tail = true;
      break;
    }
    const std::string where = absl::StrCat("patch log ", Quoted(path), " at offset ", offset);
    absl::StatusOr<LogRecord> rec =
        next == Next::kRecord
            ? DecodeLogRecordBody(body, where, record_version)
            : absl::StatusOr<LogRecord>(absl::DataLossError(absl::StrCat(where, ": ", why)));
    if (!rec.ok()) {
      out.corrupt = rec.status();
      break;
    }
    out.offsets.push_back(offset);
    out.records.push_back(std::move(*rec));
    offset += kPatchRecordFrameBytes + body.size();
  }
  out.valid_end = offset;
  return out;
}

}  // namespace refit::publisher
