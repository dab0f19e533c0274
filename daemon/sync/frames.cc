#include "daemon/sync/frames.h"

#include <lz4.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/version_digest.h"

namespace refit::sync {

absl::StatusOr<uint32_t> ChunkCount(uint64_t object_bytes, uint32_t frame_bytes) {
  if (frame_bytes == 0 || frame_bytes > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame_bytes ", frame_bytes, " out of range 1..", kMaxFrameBytes));
  }
  if (object_bytes == 0) return 1;
  const uint64_t n = (object_bytes - 1) / frame_bytes + 1;
  if (n > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("object of ", object_bytes, " bytes needs ", n,
                                                   " chunks of ", frame_bytes,
                                                   " bytes (more than 2^32 - 1)"));
  }
  return static_cast<uint32_t>(n);
}

bool Lz4Pays(std::span<const uint8_t> object) {
  const size_t n = std::min<size_t>(object.size(), kLz4SampleBytes);
  if (n < 2) return false;
  const size_t limit = n - n / kLz4MinSavingDivisor;  // output must fit strictly below this
  std::string out(limit, '\0');
  const int got = LZ4_compress_default(reinterpret_cast<const char*>(object.data()), out.data(),
                                       static_cast<int>(n), static_cast<int>(limit - 1));
  return got > 0;
}

absl::StatusOr<v1::DataFrame> MakeFrame(std::span<const uint8_t> object, const FrameTarget& target,
                                        const SplitOptions& options, uint32_t chunk_index) {
  auto count = ChunkCount(object.size(), options.frame_bytes);
  if (!count.ok()) return count.status();
  if (chunk_index >= *count) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk_index, " out of range (object has ", *count, " chunks)"));
  }
  const uint64_t offset = static_cast<uint64_t>(chunk_index) * options.frame_bytes;
  const uint64_t raw = std::min<uint64_t>(options.frame_bytes, object.size() - offset);
  v1::DataFrame f;
  f.set_version(target.version);
  f.set_tensor_index(target.tensor_index);
  f.set_part(target.part);
  f.set_object_bytes(object.size());
  f.set_chunk_count(*count);
  f.set_chunk_index(chunk_index);
  f.set_offset(offset);
  f.set_raw_bytes(raw);
  const char* src = reinterpret_cast<const char*>(object.data() + offset);
  bool compressed = false;
  if (options.lz4 && raw > 0) {
    std::string out;
    // Only a block strictly smaller than the raw chunk is worth sending; a destination of
    // raw - 1 bytes makes LZ4 fail (return 0) otherwise.
    out.resize(raw - 1);
    const int n = raw > 1 ? LZ4_compress_default(src, out.data(), static_cast<int>(raw),
                                                 static_cast<int>(raw - 1))
                          : 0;
    if (n > 0) {
      out.resize(static_cast<size_t>(n));
      f.set_compression(v1::COMPRESSION_LZ4);
      f.set_payload(std::move(out));
      compressed = true;
    }
  }
  if (!compressed) {
    f.set_compression(v1::COMPRESSION_NONE);
    f.set_payload(std::string(src, raw));
  }
  f.set_checksum(FrameChecksum(f.payload()));
  return f;
}

absl::StatusOr<std::vector<v1::DataFrame>> SplitObject(std::span<const uint8_t> object,
                                                       const FrameTarget& target,
                                                       const SplitOptions& options) {
  auto count = ChunkCount(object.size(), options.frame_bytes);
  if (!count.ok()) return count.status();
  SplitOptions chunk_options = options;
  chunk_options.lz4 = options.lz4 && Lz4Pays(object);  // once per object, not per chunk
  std::vector<v1::DataFrame> frames;
  frames.reserve(*count);
  for (uint32_t i = 0; i < *count; ++i) {
    auto f = MakeFrame(object, target, chunk_options, i);
    if (!f.ok()) return f.status();
    frames.push_back(std::move(*f));
  }
  return frames;
}

uint64_t MaxPatchBytes(uint64_t num_elements, uint64_t tensor_bytes) {
  const uint64_t block = 1ull << format::kMinBlockLog2;
  const uint64_t blocks = num_elements / block + 1;
  uint64_t table = 0, total = 0;
  if (__builtin_mul_overflow(blocks, 16ull, &table) ||
      __builtin_add_overflow(table, tensor_bytes, &total) ||
      __builtin_add_overflow(total, static_cast<uint64_t>(format::kHeaderBytes), &total)) {
    return UINT64_MAX;
  }
  return total;
}

absl::StatusOr<std::vector<ObjectSpec>> ObjectsOf(const v1::TensorPlan& tp, uint32_t tensor_index) {
  std::vector<ObjectSpec> out;
  if (tp.delivery() != v1::DELIVERY_KEYFRAME && tp.delivery() != v1::DELIVERY_PATCH) return out;
  REFIT_ASSIGN_OR_RETURN(const uint64_t bytes, TensorByteSize(tp.spec()));
  if (tp.delivery() == v1::DELIVERY_KEYFRAME) {
    out.push_back({tensor_index, 0, tp.spec().name(), bytes, /*exact_size=*/true,
                   /*allow_lz4=*/true, {}});
    return out;
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t elements, ElementCount(tp.spec()));
  for (int p = 0; p < tp.steps_size(); ++p) {
    out.push_back({tensor_index, static_cast<uint32_t>(p), tp.spec().name(),
                   MaxPatchBytes(elements, bytes), false, false, {}});
  }
  return out;
}

FrameAssembler::FrameAssembler(uint64_t version, uint32_t max_frame_bytes)
    : version_(version), max_frame_bytes_(max_frame_bytes) {}

absl::Status FrameAssembler::Expect(ObjectSpec spec) {
  const uint64_t key = Key(spec.tensor_index, spec.part);
  if (objects_.count(key) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "version ", version_, " ", DescribeTensor(spec.tensor_index, spec.tensor_name), " part ",
        spec.part, ": object declared twice"));
  }
  if (!spec.buffer.empty() && spec.buffer.size() < spec.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "version ", version_, " ", DescribeTensor(spec.tensor_index, spec.tensor_name), " part ",
        spec.part, ": buffer of ", spec.buffer.size(), " bytes is smaller than ", spec.bytes));
  }
  State st;
  st.spec = std::move(spec);
  objects_.emplace(key, std::move(st));
  return absl::OkStatus();
}

std::string FrameAssembler::Where(const State* st, uint32_t tensor_index, uint32_t part,
                                  const v1::DataFrame& f) const {
  return absl::StrCat("version ", f.version(), " ",
                      st != nullptr ? DescribeTensor(tensor_index, st->spec.tensor_name)
                                    : absl::StrCat("tensor ", tensor_index),
                      " part ", part, " chunk ", f.chunk_index(), "/", f.chunk_count(), ": ");
}

namespace {

template <typename... Args>
absl::Status Invalid(const std::string& where, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(where, args...));
}

}  // namespace

// Object-wide fields: fixed by the first accepted frame, equal in all others.
absl::Status FrameAssembler::CheckObjectFields(const State& st, const v1::DataFrame& f,
                                               const std::string& where) const {
  const ObjectSpec& spec = st.spec;
  if (!st.started) {
    if (spec.exact_size ? f.object_bytes() != spec.bytes : f.object_bytes() > spec.bytes) {
      return Invalid(where, "object_bytes ", f.object_bytes(),
                     spec.exact_size ? " != expected " : " > limit ", spec.bytes);
    }
    const uint64_t min_chunks =
        f.object_bytes() == 0 ? 1 : (f.object_bytes() - 1) / std::max<uint32_t>(max_frame_bytes_, 1) + 1;
    const uint64_t max_chunks = std::max<uint64_t>(f.object_bytes(), 1);
    if (f.chunk_count() < min_chunks || f.chunk_count() > max_chunks) {
      return Invalid(where, "chunk_count ", f.chunk_count(), " impossible for ", f.object_bytes(),
                     " bytes in frames of at most ", max_frame_bytes_, " bytes");
    }
  } else if (f.object_bytes() != st.object_bytes || f.chunk_count() != st.chunk_count) {
    return Invalid(where, "object_bytes/chunk_count ", f.object_bytes(), "/", f.chunk_count(),
                   " differ from earlier frames' ", st.object_bytes, "/", st.chunk_count);
  }
  return absl::OkStatus();
}

// The chunk's own fields: index, sizes, range inside the object, payload and its compression.
absl::Status FrameAssembler::CheckChunk(const State& st, const v1::DataFrame& f,
                                        const std::string& where) const {
  const uint64_t object_bytes = f.object_bytes();
  if (f.chunk_index() >= f.chunk_count()) return Invalid(where, "chunk_index out of range");
  if (st.started && st.received[f.chunk_index()]) return Invalid(where, "duplicate chunk");
  if (f.raw_bytes() > max_frame_bytes_) {
    return Invalid(where, "raw_bytes ", f.raw_bytes(), " exceeds frame size ", max_frame_bytes_);
  }
  if (object_bytes > 0 && f.raw_bytes() == 0) {
    return Invalid(where, "empty chunk of a non-empty object");
  }
  if (f.offset() > object_bytes || f.raw_bytes() > object_bytes - f.offset()) {
    return Invalid(where, "range [", f.offset(), ", +", f.raw_bytes(), ") outside the object of ",
                   object_bytes, " bytes");
  }
  if (f.payload().size() > max_frame_bytes_) {
    return Invalid(where, "payload of ", f.payload().size(), " bytes exceeds frame size ",
                   max_frame_bytes_);
  }
  if (f.compression() == v1::COMPRESSION_NONE) {
    if (f.payload().size() != f.raw_bytes()) {
      return Invalid(where, "payload of ", f.payload().size(), " bytes, raw_bytes ",
                     f.raw_bytes());
    }
  } else if (f.compression() == v1::COMPRESSION_LZ4) {
    if (!st.spec.allow_lz4) return Invalid(where, "LZ4 compression not allowed for this object");
    if (f.payload().empty()) return Invalid(where, "empty LZ4 payload");
  } else {
    return Invalid(where, "unknown compression ", static_cast<int>(f.compression()));
  }
  return absl::OkStatus();
}

// Chunks must not overlap and must be ordered by index along the object.
absl::Status FrameAssembler::CheckPlacement(const State& st, const v1::DataFrame& f,
                                            const std::string& where) {
  if (!st.started || f.object_bytes() == 0) return absl::OkStatus();
  auto next = st.by_offset.lower_bound(f.offset());
  if (next != st.by_offset.end()) {
    if (next->first < f.offset() + f.raw_bytes()) {
      return Invalid(where, "overlaps chunk ", next->second.first);
    }
    if (next->second.first < f.chunk_index()) {
      return Invalid(where, "offset ", f.offset(), " out of order with chunk ",
                     next->second.first);
    }
  }
  if (next != st.by_offset.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.second > f.offset()) {
      return Invalid(where, "overlaps chunk ", prev->second.first);
    }
    if (prev->second.first > f.chunk_index()) {
      return Invalid(where, "offset ", f.offset(), " out of order with chunk ",
                     prev->second.first);
    }
  }
  return absl::OkStatus();
}

// Accepts the chunk: allocates the object at its first frame (bounded by the spec), writes it.
absl::Status FrameAssembler::WriteChunk(State& st, const v1::DataFrame& f,
                                        const std::string& where) {
  if (!st.started) {
    st.object_bytes = f.object_bytes();
    st.chunk_count = f.chunk_count();
    st.received.assign(f.chunk_count(), false);
    if (!st.spec.buffer.empty()) {
      st.dest = st.spec.buffer.subspan(0, st.object_bytes);
    } else {
      st.owned.resize(st.object_bytes);
      st.dest = std::span<uint8_t>(st.owned);
    }
    st.started = true;
  }
  if (f.raw_bytes() == 0) return absl::OkStatus();
  uint8_t* dst = st.dest.data() + f.offset();
  if (f.compression() == v1::COMPRESSION_NONE) {
    std::memcpy(dst, f.payload().data(), f.raw_bytes());
  } else {
    const int n =
        LZ4_decompress_safe(f.payload().data(), reinterpret_cast<char*>(dst),
                            static_cast<int>(f.payload().size()), static_cast<int>(f.raw_bytes()));
    if (n < 0 || static_cast<uint64_t>(n) != f.raw_bytes()) {
      return absl::DataLossError(absl::StrCat(where, "corrupt LZ4 block (", f.payload().size(),
                                              " bytes, decoded ", n < 0 ? 0 : n, " of ",
                                              f.raw_bytes(), ")"));
    }
  }
  if (st.spec.digest_v2) {
    // Chunks tile the object (checked when the last arrives), so the sums add up to the
    // object's when each starts on a word: only the object's last chunk may end mid-word.
    if (f.offset() % 8 == 0) {
      st.v2_sum += DigestV2Sum(std::span<const uint8_t>(dst, f.raw_bytes()), f.offset() / 8);
    } else {
      st.v2_exact = false;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> FrameAssembler::Add(const v1::DataFrame& f) {
  auto it = objects_.find(Key(f.tensor_index(), f.part()));
  State* st = it == objects_.end() ? nullptr : &it->second;
  const std::string where = Where(st, f.tensor_index(), f.part(), f);
  if (f.version() != version_) {
    return Invalid(where, "frame for version ", f.version(), " in the transfer of version ",
                   version_);
  }
  // The transport checksum comes before anything else is done with the payload.
  if (FrameChecksum(f.payload()) != f.checksum()) {
    return absl::DataLossError(absl::StrCat(where, "frame checksum mismatch (", f.payload().size(),
                                            " payload bytes)"));
  }
  if (st == nullptr) return Invalid(where, "no such object in this transfer");
  if (st->complete) return Invalid(where, "object already complete (duplicate frame)");
  REFIT_RETURN_IF_ERROR(CheckObjectFields(*st, f, where));
  REFIT_RETURN_IF_ERROR(CheckChunk(*st, f, where));
  REFIT_RETURN_IF_ERROR(CheckPlacement(*st, f, where));
  REFIT_RETURN_IF_ERROR(WriteChunk(*st, f, where));
  st->received[f.chunk_index()] = true;
  st->by_offset.emplace(f.offset(), std::make_pair(f.chunk_index(), f.raw_bytes()));
  ++st->chunks_received;
  st->bytes_received += f.raw_bytes();
  ++frames_;
  payload_bytes_ += f.payload().size();
  if (st->chunks_received != st->chunk_count) return false;
  // Non-overlapping chunks inside the object whose sizes sum to it tile it exactly.
  if (st->bytes_received != st->object_bytes) {
    return Invalid(where, "all ", st->chunk_count, " chunks received but they cover ",
                   st->bytes_received, " of ", st->object_bytes, " bytes");
  }
  st->complete = true;
  st->by_offset.clear();
  ++complete_objects_;
  return true;
}

bool FrameAssembler::ObjectComplete(uint32_t tensor_index, uint32_t part) const {
  auto it = objects_.find(Key(tensor_index, part));
  return it != objects_.end() && it->second.complete;
}

absl::Status FrameAssembler::CheckAllComplete() const {
  for (const auto& [key, st] : objects_) {
    if (st.complete) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", version_, " ", DescribeTensor(st.spec.tensor_index, st.spec.tensor_name),
        " part ", st.spec.part, ": incomplete, ",
        st.started ? absl::StrCat(st.chunks_received, " of ", st.chunk_count, " chunks received")
                   : std::string("no frames received")));
  }
  return absl::OkStatus();
}

std::optional<uint64_t> FrameAssembler::ObjectDigestV2(uint32_t tensor_index, uint32_t part) const {
  auto it = objects_.find(Key(tensor_index, part));
  if (it == objects_.end()) return std::nullopt;
  const State& st = it->second;
  if (!st.spec.digest_v2 || !st.complete || !st.v2_exact) return std::nullopt;
  return format::DigestV2Final(st.v2_sum, st.object_bytes);
}

absl::StatusOr<std::span<const uint8_t>> FrameAssembler::Object(uint32_t tensor_index,
                                                                uint32_t part) const {
  auto it = objects_.find(Key(tensor_index, part));
  if (it == objects_.end()) {
    return absl::NotFoundError(absl::StrCat("version ", version_, " tensor ", tensor_index,
                                            " part ", part, ": not in this transfer"));
  }
  if (!it->second.complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", version_, " ", DescribeTensor(tensor_index, it->second.spec.tensor_name),
        " part ", part, ": incomplete"));
  }
  return std::span<const uint8_t>(it->second.dest);
}

absl::StatusOr<std::vector<uint8_t>> FrameAssembler::TakeObject(uint32_t tensor_index,
                                                                uint32_t part) {
  auto span = Object(tensor_index, part);
  if (!span.ok()) return span.status();
  State& st = objects_.find(Key(tensor_index, part))->second;
  std::vector<uint8_t> out = std::move(st.owned);
  st.owned.clear();
  st.dest = {};
  return out;
}

}  // namespace refit::sync
