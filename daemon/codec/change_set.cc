#include "daemon/codec/change_set.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/codec.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

// Changes per worker chunk when writing: large enough that threads do not share cache lines
// often, small enough to spread a 1% change set over every thread.
constexpr size_t kWriteChunk = 1 << 15;

// One decoded block's part of a change set.
struct BlockPart {
  std::vector<uint64_t> positions;
  std::vector<uint8_t> values;
  std::vector<uint8_t> old_values;
  DigestV2Delta delta;
};

// Concatenates the parts in order into one change set.
TensorChanges Join(DType dtype, uint64_t num_elements, std::vector<BlockPart>& parts) {
  TensorChanges out;
  out.dtype = dtype;
  out.num_elements = num_elements;
  size_t n = 0;
  for (const BlockPart& p : parts) n += p.positions.size();
  out.positions.reserve(n);
  out.values.reserve(n * DTypeSize(dtype));
  out.old_values.reserve(n * DTypeSize(dtype));
  for (BlockPart& p : parts) {
    out.positions.insert(out.positions.end(), p.positions.begin(), p.positions.end());
    out.values.insert(out.values.end(), p.values.begin(), p.values.end());
    out.old_values.insert(out.old_values.end(), p.old_values.begin(), p.old_values.end());
    out.digest_delta.Merge(p.delta);
    p = BlockPart{};
  }
  return out;
}

// How many changes ahead the writer prefetches the elements it will overwrite: the positions are
// known in advance but too irregular for the hardware prefetcher, and each changed cache line
// is a miss (about 40% of a model's lines at 1.65% changed).
constexpr size_t kPrefetchAhead = 32;

// Scatters values[lo, hi) (T each) at c's positions [lo, hi) of `data`.
template <typename T>
void ScatterRange(const TensorChanges& c, const uint8_t* values, uint8_t* data, size_t lo,
                  size_t hi) {
  T* d = reinterpret_cast<T*>(data);
  const uint64_t* pos = c.positions.data();
  for (size_t j = lo; j < hi && j < lo + kPrefetchAhead; ++j) __builtin_prefetch(&d[pos[j]], 1);
  for (size_t j = lo; j < hi; ++j) {
    if (j + kPrefetchAhead < hi) __builtin_prefetch(&d[pos[j + kPrefetchAhead]], 1);
    T v;
    std::memcpy(&v, values + j * sizeof(T), sizeof(T));
    d[pos[j]] = v;
  }
}

void Scatter(const TensorChanges& c, const uint8_t* values, uint8_t* data, size_t lo, size_t hi) {
  switch (DTypeSize(c.dtype)) {
    case 1: ScatterRange<uint8_t>(c, values, data, lo, hi); break;
    case 2: ScatterRange<uint16_t>(c, values, data, lo, hi); break;
    case 4: ScatterRange<uint32_t>(c, values, data, lo, hi); break;
    default: ScatterRange<uint64_t>(c, values, data, lo, hi); break;
  }
}

absl::Status CheckOldValues(const TensorChanges& changes) {
  if (changes.old_values.size() == changes.values.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("change set has ", changes.old_values.size(),
                                                 " bytes of old values (the undo record), its "
                                                 "values ", changes.values.size()));
}

}  // namespace

absl::Status WriteChangesOfTensors(std::span<const TensorChanges* const> sets,
                                   std::span<const std::span<uint8_t>> data, bool old_values,
                                   int threads) {
  if (sets.size() != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("WriteChangesOfTensors: ", sets.size(),
                                                   " change sets for ", data.size(), " tensors"));
  }
  std::vector<uint64_t> first(sets.size() + 1, 0);  // global index of each set's first change
  for (size_t i = 0; i < sets.size(); ++i) {
    absl::Status st = CheckChanges(*sets[i], sets[i]->dtype, data[i].size());
    if (st.ok() && old_values) st = CheckOldValues(*sets[i]);
    if (!st.ok() && sets.size() > 1) {
      return Annotate(st, "tensor ", i);
    }
    REFIT_RETURN_IF_ERROR(st);
    first[i + 1] = first[i] + sets[i]->count();
  }
  ParallelFor(first.back(), threads, kWriteChunk, [&](size_t lo, size_t hi) {
    size_t i = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), lo) -
                                   first.begin()) - 1;
    for (; i < sets.size() && first[i] < hi; ++i) {
      const TensorChanges& c = *sets[i];
      const size_t b = std::max<uint64_t>(lo, first[i]) - first[i];
      const size_t e = std::min<uint64_t>(hi, first[i + 1]) - first[i];
      Scatter(c, old_values ? c.old_values.data() : c.values.data(), data[i].data(), b, e);
    }
  });
  return absl::OkStatus();
}

namespace {

// A decoded block's changes written into `out` from change `at` on: positions, the new values
// (T each, little-endian) and the old ones read from `base` (the undo record).
template <typename T>
void FillBlock(const PatchBlockChanges& c, const uint8_t* base, uint64_t at, TensorChanges& out) {
  uint64_t* pos = out.positions.data() + at;
  uint8_t* val = out.values.data() + at * sizeof(T);
  uint8_t* old = out.old_values.data() + at * sizeof(T);
  for (size_t j = 0; j < c.positions.size(); ++j) {
    const uint64_t e = c.first_element + c.positions[j];
    pos[j] = e;
    const T v = static_cast<T>(c.values[j]);
    std::memcpy(val + j * sizeof(T), &v, sizeof(T));
    std::memcpy(old + j * sizeof(T), base + e * sizeof(T), sizeof(T));
  }
}

void FillBlockOf(int width, const PatchBlockChanges& c, const uint8_t* base, uint64_t at,
                 TensorChanges& out) {
  switch (width) {
    case 1: FillBlock<uint8_t>(c, base, at, out); break;
    case 2: FillBlock<uint16_t>(c, base, at, out); break;
    case 4: FillBlock<uint32_t>(c, base, at, out); break;
    default: FillBlock<uint64_t>(c, base, at, out); break;
  }
}

// Closes the gaps of blocks that changed fewer elements than their room (DENSE blocks are
// compared with the base), keeping block order; `room[b]` and `got[b]` per block.
void Compact(const std::vector<uint64_t>& room, const std::vector<uint64_t>& got, int width,
             TensorChanges& out) {
  uint64_t from = 0, to = 0;
  for (size_t b = 0; b < room.size(); ++b) {
    if (to != from && got[b] > 0) {
      std::memmove(&out.positions[to], &out.positions[from], got[b] * sizeof(uint64_t));
      std::memmove(&out.values[to * width], &out.values[from * width], got[b] * width);
      std::memmove(&out.old_values[to * width], &out.old_values[from * width], got[b] * width);
    }
    from += room[b];
    to += got[b];
  }
  out.positions.resize(to);
  out.values.resize(to * width);
  out.old_values.resize(to * width);
}

}  // namespace

// The change set is sized from the block table (a SPARSE or CONTEXT block's count, a DENSE
// block's elements at most) and each block's changes are written straight into their place by
// the thread that decoded it: no per-block buffers to join.
absl::StatusOr<TensorChanges> ChangesOfPatch(std::span<const uint8_t> patch, DType dtype,
                                             std::span<const uint8_t> base, int threads) {
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatchFor(patch, dtype, base.size()));
  const int w = DTypeSize(dtype);
  const size_t nb = layout.blocks.size();
  std::vector<uint64_t> first(nb + 1, 0), room(nb, 0), got(nb, 0);
  for (size_t b = 0; b < nb; ++b) {
    const BlockDesc& d = layout.blocks[b];
    room[b] = d.mode == format::kUnchanged ? 0
              : d.mode == format::kDense   ? d.num_elements
                                           : d.count;
    first[b + 1] = first[b] + room[b];
  }
  TensorChanges out;
  out.dtype = dtype;
  out.num_elements = layout.num_elements;
  out.positions.resize(first[nb]);
  out.values.resize(first[nb] * w);
  out.old_values.resize(first[nb] * w);
  std::vector<DigestV2Delta> deltas(nb);
  REFIT_RETURN_IF_ERROR(VisitPatchChanges(
      patch, dtype, base,
      [&](const PatchBlockChanges& c) {
        const size_t b = c.block_index;  // each block is visited once
        if (b >= nb || c.positions.size() > room[b]) {
          return absl::InternalError(absl::StrCat("block ", b, " decoded ", c.positions.size(),
                                                  " changes, its table entry allows ",
                                                  b < nb ? room[b] : 0));
        }
        FillBlockOf(w, c, base.data(), first[b], out);
        got[b] = c.positions.size();
        deltas[b] = c.digest_delta;
        return absl::OkStatus();
      },
      threads, /*prev=*/nullptr, /*digest_delta=*/true));
  if (got != room) Compact(room, got, w, out);
  for (const DigestV2Delta& d : deltas) out.digest_delta.Merge(d);
  return out;
}

namespace {

// The little-endian bytes of `v`'s low sizeof(T) bytes appended to `out`.
template <typename T>
void AppendValue(std::vector<uint8_t>& out, uint64_t v) {
  const T t = static_cast<T>(v);
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &t, sizeof(T));
}

// Words [first, end) of two versions of a tensor of `bytes` bytes compared: each differing
// element listed in `part` (with its new and old value) and each differing word's digest-v2
// term added to part.delta. Runs of four equal words are skipped with one test.
template <typename T>
void CompareWords(const uint8_t* base, const uint8_t* target, uint64_t bytes, uint64_t first,
                  uint64_t end, BlockPart& part) {
  constexpr uint64_t kPer = 8 / sizeof(T);
  const uint64_t whole = bytes / 8;
  const uint64_t elements = bytes / sizeof(T);
  auto word = [&](const uint8_t* p, uint64_t k) {
    uint64_t w = 0;
    if (k < whole) {
      std::memcpy(&w, p + 8 * k, 8);
    } else {
      std::memcpy(&w, p + 8 * k, bytes - 8 * k);  // the last, partial word, zero-padded
    }
    return w;
  };
  uint64_t k = first;
  while (k < end) {
    if (k + 4 <= end && k + 4 <= whole) {
      uint64_t o[4], n[4];
      std::memcpy(o, base + 8 * k, 32);
      std::memcpy(n, target + 8 * k, 32);
      if (((o[0] ^ n[0]) | (o[1] ^ n[1]) | (o[2] ^ n[2]) | (o[3] ^ n[3])) == 0) {
        k += 4;
        continue;
      }
    }
    const uint64_t ow = word(base, k), nw = word(target, k);
    if (ow != nw) {
      part.delta.Add(k, ow, nw);
      for (uint64_t j = 0; j < kPer; ++j) {
        const unsigned shift = static_cast<unsigned>(j * 8 * sizeof(T)) % 64;
        const uint64_t o = ow >> shift, t = nw >> shift;
        if (static_cast<T>(o) == static_cast<T>(t)) continue;
        const uint64_t e = k * kPer + j;
        if (e >= elements) break;  // zero padding past the tensor: equal anyway
        part.positions.push_back(e);
        AppendValue<T>(part.values, t);
        AppendValue<T>(part.old_values, o);
      }
    }
    ++k;
  }
}

}  // namespace

// One pass over both versions, word by word: the changed elements and the digest-v2 delta of
// the changed words together.
absl::StatusOr<TensorChanges> ChangesBetween(DType dtype, std::span<const uint8_t> base,
                                             std::span<const uint8_t> target, int threads) {
  const int w = DTypeSize(dtype);
  if (base.size() != target.size() || base.size() % w != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ChangesBetween: base has ", base.size(), " bytes, target ", target.size(),
                     " (equal sizes, a multiple of ", w, " bytes, expected)"));
  }
  const uint64_t n = base.size() / w;
  const uint64_t words = (base.size() + 7) / 8;
  constexpr uint64_t kChunkWords = 1 << 15;
  std::vector<BlockPart> parts((words + kChunkWords - 1) / kChunkWords);
  ParallelFor(parts.size(), threads, 1, [&](size_t lo, size_t hi) {
    for (size_t b = lo; b < hi; ++b) {
      const uint64_t first = b * kChunkWords, end = std::min(words, first + kChunkWords);
      const uint8_t* bp = base.data();
      const uint8_t* tp = target.data();
      switch (w) {
        case 1: CompareWords<uint8_t>(bp, tp, base.size(), first, end, parts[b]); break;
        case 2: CompareWords<uint16_t>(bp, tp, base.size(), first, end, parts[b]); break;
        case 4: CompareWords<uint32_t>(bp, tp, base.size(), first, end, parts[b]); break;
        default: CompareWords<uint64_t>(bp, tp, base.size(), first, end, parts[b]); break;
      }
    }
  });
  return Join(dtype, n, parts);
}

absl::Status CheckChanges(const TensorChanges& c, DType dtype, uint64_t tensor_bytes) {
  const int w = DTypeSize(dtype);
  if (c.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("change set is for dtype ", DTypeName(c.dtype),
                                                   ", the tensor is ", DTypeName(dtype)));
  }
  if (c.num_elements * w != tensor_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("change set is for ", c.num_elements,
                                                   " elements, the tensor has ", tensor_bytes / w));
  }
  if (c.values.size() != c.positions.size() * w) {
    return absl::InvalidArgumentError(absl::StrCat("change set has ", c.positions.size(),
                                                   " positions but ", c.values.size(),
                                                   " value bytes (", w, " per position expected)"));
  }
  for (size_t j = 0; j < c.positions.size(); ++j) {
    if (c.positions[j] >= c.num_elements || (j > 0 && c.positions[j] <= c.positions[j - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("change set position ", j, " (element ", c.positions[j],
                       ") is out of range or not above the one before"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteChanges(const TensorChanges& changes, std::span<uint8_t> data, int threads) {
  const TensorChanges* set = &changes;
  return WriteChangesOfTensors({&set, 1}, {&data, 1}, /*old_values=*/false, threads);
}

absl::Status RevertChanges(const TensorChanges& changes, std::span<uint8_t> data, int threads) {
  const TensorChanges* set = &changes;
  return WriteChangesOfTensors({&set, 1}, {&data, 1}, /*old_values=*/true, threads);
}

absl::StatusOr<TensorChanges> ComposeChanges(const TensorChanges& first,
                                             const TensorChanges& second) {
  if (first.dtype != second.dtype || first.num_elements != second.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot compose change sets of different tensors (", DTypeName(first.dtype), " x ",
        first.num_elements, " then ", DTypeName(second.dtype), " x ", second.num_elements, ")"));
  }
  const int w = DTypeSize(first.dtype);
  TensorChanges out;
  out.dtype = first.dtype;
  out.num_elements = first.num_elements;
  out.positions.reserve(first.count() + second.count());
  out.values.reserve((first.count() + second.count()) * w);
  const bool old = first.old_values.size() == first.values.size() &&
                   second.old_values.size() == second.values.size();
  size_t i = 0, j = 0;
  // Position from `c` (index k), its old value from `o` (index ko): the base's.
  auto take = [&](const TensorChanges& c, size_t k, const TensorChanges& o, size_t ko) {
    out.positions.push_back(c.positions[k]);
    out.values.insert(out.values.end(), c.values.begin() + k * w, c.values.begin() + (k + 1) * w);
    if (old) {
      out.old_values.insert(out.old_values.end(), o.old_values.begin() + ko * w,
                            o.old_values.begin() + (ko + 1) * w);
    }
  };
  while (i < first.count() || j < second.count()) {
    if (j == second.count() || (i < first.count() && first.positions[i] < second.positions[j])) {
      take(first, i, first, i);
      ++i;
    } else if (i < first.count() && first.positions[i] == second.positions[j]) {
      take(second, j, first, i);  // the newer value, the oldest old value
      ++i;
      ++j;
    } else {
      take(second, j, second, j);  // first left it alone: second's old value is the base's
      ++j;
    }
  }
  out.digest_delta = first.digest_delta;
  out.digest_delta.Merge(second.digest_delta);
  return out;
}

}  // namespace refit
