// Patch format 2 in the encoder: the CONTEXT jobs (changed blocks that could be smaller
// context-coded), their waves and kernel, and the choice of the blocks that become CONTEXT; with
// the device copies of a dtype's class field and of a previous-change record (apply uses them
// too).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/format.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {
namespace internal {

kern::ContextField FieldArgs(DType dtype) {
  const ClassField cf = ClassFieldOf(dtype);
  kern::ContextField fl;
  fl.mask = cf.mask;
  fl.shift = cf.shift;
  fl.bits = cf.bits;
  fl.is_float = cf.is_float;
  fl.is_signed = cf.is_signed;
  return fl;
}

// A previous-change record's words on the device: changed[], then down[].
absl::Status UploadRecord(const ChangeRecord& r, DeviceBuffer& buf, void* stream) {
  const uint64_t words = r.changed.size();
  REFIT_RETURN_IF_ERROR(Reserve(buf, std::max<uint64_t>(2 * words, 1) * sizeof(uint64_t)));
  if (words == 0) return absl::OkStatus();
  REFIT_RETURN_IF_ERROR(
      rt::CopyToDeviceAsync(buf.data(), r.changed.data(), words * sizeof(uint64_t), stream));
  return rt::CopyToDeviceAsync(Ptr<uint64_t>(buf) + words, r.down.data(), words * sizeof(uint64_t),
                               stream);
}

}  // namespace internal

using format::kContext;
using format::kUnchanged;
using internal::FieldArgs;
using internal::kContextChangeBytes;
using internal::Ptr;
using internal::Reserve;
using internal::StageClock;
using internal::UploadRecord;

// Format 2's candidates [codec.cc TryContextBlock]: each changed block whose CONTEXT entry and
// payload could be strictly smaller than its v1 form, with the capacity that leaves its stream.
// v1_total gets each job's v1 entry plus payload bytes.
static std::vector<kern::ContextJob> PlanContextJobs(const std::vector<kern::EncBlock>& blocks,
                                                     uint64_t num_elements, int log2, int width,
                                                     std::vector<uint64_t>* v1_total,
                                                     uint64_t* out_total) {
  std::vector<kern::ContextJob> jobs;
  for (uint64_t b = 0; b < blocks.size(); ++b) {
    const kern::EncBlock& m = blocks[b];
    if (m.mode == kUnchanged || m.count == 0) continue;
    const uint64_t len = std::min<uint64_t>(uint64_t{1} << log2, num_elements - (b << log2));
    const uint64_t dense_bytes = len * static_cast<uint64_t>(width);
    const uint64_t total =
        EntryBytes(BlockRecord{m.mode, m.kg, m.kr, m.ke, m.count, 0, m.payload_bytes}) +
        m.payload_bytes;
    const uint64_t least_entry = EntryBytes(BlockRecord{kContext, 0, 0, 0, m.count, 0, 1});
    if (total <= least_entry + 1) continue;
    const uint64_t capacity = std::min(total - least_entry - 1, dense_bytes - 1);
    if (capacity == 0) continue;
    jobs.push_back(kern::ContextJob{b, 0, *out_total, capacity, m.count, 0});
    v1_total->push_back(total);
    *out_total += capacity;
  }
  return jobs;
}

// The jobs' scratch slots, in waves of at most `wave_changes` changes (a job always fits alone).
static std::vector<std::pair<uint64_t, uint64_t>> PlanContextWaves(
    std::vector<kern::ContextJob>& jobs, uint64_t wave_changes, uint64_t* max_wave) {
  std::vector<std::pair<uint64_t, uint64_t>> waves;
  uint64_t lo = 0, used = 0;
  for (uint64_t j = 0; j < jobs.size(); ++j) {
    if (used > 0 && used + jobs[j].count > wave_changes) {
      waves.emplace_back(lo, j);
      lo = j;
      used = 0;
    }
    jobs[j].scratch_off = used;
    used += jobs[j].count;
    *max_wave = std::max(*max_wave, used);
  }
  if (lo < jobs.size()) waves.emplace_back(lo, jobs.size());
  return waves;
}

absl::Status DeviceCodec::Impl::ContextBlocks(DType dtype, const ChangeRecord* prev,
                                              kern::EncodeArgs& a, StageClock& clock) {
  std::vector<uint64_t> v1_total;
  uint64_t out_total = 0;
  std::vector<kern::ContextJob> jobs =
      PlanContextJobs(host_blocks, a.num_elements, a.block_log2, a.width, &v1_total, &out_total);
  if (jobs.empty()) return absl::OkStatus();
  uint64_t max_wave = 0;
  const auto waves =
      PlanContextWaves(jobs, std::max<uint64_t>(1, decode_limit / kContextChangeBytes), &max_wave);
  const uint64_t nj = jobs.size();
  REFIT_RETURN_IF_ERROR(Reserve(cx_jobs, nj * sizeof(kern::ContextJob)));
  REFIT_RETURN_IF_ERROR(Reserve(cx_out, std::max<uint64_t>(out_total, 8)));
  REFIT_RETURN_IF_ERROR(Reserve(cx_bytes, nj * sizeof(uint64_t)));
  REFIT_RETURN_IF_ERROR(Reserve(cx_pos, max_wave * sizeof(uint32_t)));
  REFIT_RETURN_IF_ERROR(Reserve(cx_rank, max_wave * sizeof(uint32_t)));
  REFIT_RETURN_IF_ERROR(Reserve(cx_cls, max_wave));
  kern::ContextEncodeArgs ca;
  ca.base = a.base;
  ca.target = a.target;
  ca.num_elements = a.num_elements;
  ca.width = a.width;
  ca.coding = a.coding;
  ca.block_log2 = a.block_log2;
  ca.field = FieldArgs(dtype);
  if (prev != nullptr) {
    REFIT_RETURN_IF_ERROR(UploadRecord(*prev, ap_prev, stream));
    ca.prev_changed = Ptr<uint64_t>(ap_prev);
    ca.prev_down = Ptr<uint64_t>(ap_prev) + prev->changed.size();
  }
  ca.jobs = Ptr<kern::ContextJob>(cx_jobs);
  ca.scratch_pos = Ptr<uint32_t>(cx_pos);
  ca.scratch_rank = Ptr<uint32_t>(cx_rank);
  ca.scratch_cls = Ptr<uint8_t>(cx_cls);
  ca.out = Ptr<uint8_t>(cx_out);
  ca.out_bytes = Ptr<uint64_t>(cx_bytes);
  REFIT_RETURN_IF_ERROR(
      rt::CopyToDeviceAsync(cx_jobs.data(), jobs.data(), nj * sizeof(kern::ContextJob), stream));
  REFIT_RETURN_IF_ERROR(clock.Begin("context"));
  for (const auto& [lo, hi] : waves) {
    REFIT_RETURN_IF_ERROR(
        rt::CheckLaunch(kern::LaunchContextEncode(ca, lo, hi, stream), "ContextEncodeKernel"));
  }
  REFIT_RETURN_IF_ERROR(clock.End());
  std::vector<uint64_t> out_bytes(nj);
  REFIT_RETURN_IF_ERROR(
      rt::CopyToHostAsync(out_bytes.data(), ca.out_bytes, nj * sizeof(uint64_t), stream));
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  return AdoptContextBlocks(jobs, v1_total, out_bytes, a);
}

absl::Status DeviceCodec::Impl::AdoptContextBlocks(const std::vector<kern::ContextJob>& jobs,
                                                   const std::vector<uint64_t>& v1_total,
                                                   const std::vector<uint64_t>& out_bytes,
                                                   kern::EncodeArgs& a) {
  std::vector<uint64_t> ctx_off(host_blocks.size(), 0);
  bool any = false;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const uint64_t bytes = out_bytes[j];
    if (bytes == kern::kContextCountMismatch || bytes > jobs[j].capacity) {
      return absl::InternalError(absl::StrCat("EncodePatchDevice: block ", jobs[j].block,
                                              ": the GPU context coder disagrees with the analysis "
                                              "(kernel bug)"));
    }
    if (bytes == 0) continue;
    const BlockRecord ctx{kContext, 0, 0, 0, jobs[j].count, 0, bytes};
    if (EntryBytes(ctx) + bytes >= v1_total[j]) continue;
    kern::EncBlock& m = host_blocks[jobs[j].block];
    m = kern::EncBlock{0, bytes, jobs[j].count, 0, kContext, 0, 0, 0, 0};
    ctx_off[jobs[j].block] = jobs[j].out_off;
    any = true;
  }
  if (!any) return absl::OkStatus();
  REFIT_RETURN_IF_ERROR(Reserve(cx_off, ctx_off.size() * sizeof(uint64_t)));
  REFIT_RETURN_IF_ERROR(rt::CopyToDeviceAsync(cx_off.data(), ctx_off.data(),
                                              ctx_off.size() * sizeof(uint64_t), stream));
  REFIT_RETURN_IF_ERROR(rt::CopyToDeviceAsync(a.blocks, host_blocks.data(),
                                              host_blocks.size() * sizeof(kern::EncBlock), stream));
  a.ctx_out = Ptr<uint8_t>(cx_out);
  a.ctx_off = Ptr<uint64_t>(cx_off);
  return absl::OkStatus();
}

}  // namespace refit::cuda
