// subscriber_bench: the subscriber's work per delta (OnHeader .. OnEnd on a SubscriberCore, frames
// made by a PublisherCore beforehand, no network) at a fixed number of changed elements, for
// several model sizes, with in-place staging (the standby slot brought forward
// by retained patches) against the full-copy staging before it (store.retained_patch_bytes 0),
// both in the same run on the same transfers. Also: ShmStore creation with and without
// pre-faulting, and the first versions after the keyframe (the warm-up penalty). The in-place
// core refreshes its standby slot after each commit (SubscriberOptions::refresh_standby): that
// runs untimed between transfers, as in the idle time before the next one, and is reported as
// refresh_after_ms; the timed transfer then applies only its own patches. A third core runs
// the in-place path in a digest v2 session (SubscriberCore::SetDigestFormat, transfers with v2
// digests): its deltas are verified from the slots' verified digests and the patches' deltas
// (digests_full 0), so its OnHeader..OnEnd should not grow with the model at a fixed number of
// changed elements ("ratios": in_place_v2_total against size_ratio).
//
//   subscriber_bench [--sizes-mb 128,512] [--changed 1073742] [--versions 8] [--threads 2]
//                    [--slots 2] [--region ELEMENTS]
//
// --changed: elements changed per version, placed uniformly at random over the whole model
// (default: 1.6% of a 64M-element model's worth), or over its first --region elements (e.g.
// 67108864: the same 64M elements change in every model size, the rest is frozen). Each
// changed element moves by one ULP.
// Prints one JSON object per line ("version" rows, then one "summary" per size, then "ratios")
// with /proc/loadavg beside; exits 1 printing FAIL when a version is not APPLIED.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/store/shm_store.h"
#include "daemon/subscriber/subscriber_core.h"

namespace {

using refit::DType;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kTensorElements = 4u << 20;  // 8 MiB BF16 tensors

struct Args {
  std::vector<uint64_t> sizes_mb = {128, 512};
  uint64_t changed = 1073742;  // 1.6% of 64M elements
  int versions = 8;
  int threads = 2;
  int slots = 2;
  // Changes placed uniformly over the first `region` elements (0: the whole model). With a
  // region, a bigger model adds tensors that do not change (frozen layers, say): the changed
  // elements and their density stay the same at every size.
  uint64_t region = 0;
};

std::string LoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The model: BF16 tensors of kTensorElements with finite values around N(0, 0.02).
struct Model {
  std::vector<std::vector<uint16_t>> tensors;
  std::vector<refit::publisher::TensorInput> Inputs() const {
    std::vector<refit::publisher::TensorInput> in;
    for (size_t i = 0; i < tensors.size(); ++i) {
      refit::publisher::TensorInput t;
      t.name = absl::StrCat("layer.", i / 10, ".w", i % 10);
      t.dtype = DType::kBF16;
      t.shape = {tensors[i].size() / 1024, 1024};
      t.data = {reinterpret_cast<const uint8_t*>(tensors[i].data()), tensors[i].size() * 2};
      in.push_back(std::move(t));
    }
    return in;
  }
};

Model MakeModel(uint64_t bytes, std::mt19937_64& rng) {
  Model m;
  const uint64_t elements = bytes / 2;
  for (uint64_t at = 0; at < elements; at += kTensorElements) {
    std::vector<uint16_t> t(std::min(kTensorElements, elements - at));
    for (uint16_t& v : t) {
      const uint64_t r = rng();
      v = static_cast<uint16_t>((r & 0x8000) | (0x3C00 + ((r >> 16) & 0x3FF)) | ((r >> 32) & 0x7F));
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

// `changed` elements move by one ULP (mantissa bit flip), at uniform random positions over the
// first `region` elements of the model (0: the whole model).
void Perturb(Model& m, uint64_t changed, uint64_t region, std::mt19937_64& rng) {
  uint64_t total = 0;
  for (const auto& t : m.tensors) total += t.size();
  if (region > 0) total = std::min(total, region);
  for (uint64_t k = 0; k < changed; ++k) {
    uint64_t e = rng() % total;
    size_t ti = static_cast<size_t>(e / kTensorElements);
    m.tensors[ti][e % kTensorElements] ^= 1;
  }
}

struct Run {
  double total_ms = 0, stage_ms = 0, verify_ms = 0;
  double refresh_ms = 0;  // the refresh after the commit (off the critical path)
  refit::subscriber::StageStats stats;
};

// Feeds one transfer (frames made beforehand) to `core`, timing OnHeader .. OnEnd.
absl::StatusOr<Run> Feed(refit::subscriber::SubscriberCore& core,
                         refit::publisher::PublisherCore& pub,
                         refit::sync::DigestFormat format = refit::sync::DigestFormat::kV1) {
  refit::publisher::TransferOptions to;
  to.lz4 = false;
  to.plan.digest_format = format;
  auto tr = pub.MakeTransfer(core.applied_version(), core.applied_digest(), to);
  if (!tr.ok()) return tr.status();
  std::vector<refit::v1::DataFrame> frames;
  uint64_t wire = 0;
  for (uint64_t i = 0; i < (*tr)->frame_count(); ++i) {
    auto f = (*tr)->Frame(i);
    if (!f.ok()) return f.status();
    wire += f->payload().size();
    frames.push_back(std::move(*f));
  }
  const refit::v1::VersionHeader header = (*tr)->Header();
  const refit::v1::VersionEnd end = (*tr)->End(wire);
  const auto t0 = Clock::now();
  if (absl::Status st = core.OnHeader(header); !st.ok()) return st;
  for (const auto& f : frames) {
    if (absl::Status st = core.OnFrame(f); !st.ok()) return st;
  }
  const refit::v1::Ack ack = core.OnEnd(end);
  const auto t1 = Clock::now();
  if (ack.result() != refit::v1::ACK_RESULT_APPLIED) {
    return absl::InternalError(absl::StrCat("version ", end.version(), ": ", ack.error()));
  }
  Run r;
  r.total_ms = Ms(t1 - t0);
  r.stage_ms = ack.timings().stage_micros() / 1e3;
  r.verify_ms = ack.timings().verify_micros() / 1e3;
  r.stats = core.last_stage();
  // The idle time before the next transfer: the refresh thread brings the standby slot forward
  // (SubscriberOptions::refresh_standby). Waited for here, untimed, so that it neither counts in
  // this transfer nor disturbs the other core's.
  if (!core.standby().WaitIdle(absl::Seconds(120))) return absl::DeadlineExceededError("refresh");
  const refit::subscriber::RefreshStats rs = core.standby().stats();
  if (rs.to_version == end.version()) r.refresh_ms = rs.micros / 1e3;
  return r;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Store creation (2 slots of the model) with and without pre-faulting, and the first staging.
void StoreCreation(uint64_t bytes, const Args& a) {
  auto layout = refit::store::Layout::Build({{"m", DType::kBF16, {bytes / 2}}});
  for (bool prefault : {false, true}) {
    refit::store::ShmStoreOptions o;
    o.slots = a.slots;
    o.prefault = prefault;
    const auto t0 = Clock::now();
    auto st = refit::store::ShmStore::Create(*layout, o);
    const auto t1 = Clock::now();
    if (!st.ok()) continue;
    auto h = (*st)->BeginStage(1);
    const auto t2 = Clock::now();
    std::memset(h->out[0].data(), 1, h->out[0].size());
    const auto t3 = Clock::now();
    (void)(*st)->Abort(*h);
    std::printf("{\"kind\":\"store_create\",\"model_mb\":%llu,\"slots\":%d,\"prefault\":\"%s\","
                "\"create_ms\":%.1f,\"first_write_of_a_slot_ms\":%.1f,\"loadavg\":\"%s\"}\n",
                static_cast<unsigned long long>(bytes >> 20), a.slots, (*st)->prefault(),
                Ms(t1 - t0), Ms(t3 - t2), LoadAvg().c_str());
  }
}

struct Summary {
  double inplace_stage = 0, inplace_verify = 0, inplace_total = 0, inplace_catch_up = 0;
  double inplace_refresh = 0;  // after the commit, off the critical path
  double copy_stage = 0, copy_verify = 0, copy_total = 0;
  double v2_stage = 0, v2_verify = 0, v2_total = 0;  // in place, digest v2 session
};

absl::StatusOr<Summary> BenchSize(uint64_t mb, const Args& a) {
  std::mt19937_64 rng(mb);
  Model model = MakeModel(mb << 20, rng);
  refit::publisher::PublisherOptions po;
  po.encode_threads = a.threads;
  po.digest_threads = a.threads;
  po.history_max_versions = 4;
  auto pub = refit::publisher::PublisherCore::Open(po);
  if (!pub.ok()) return pub.status();
  refit::subscriber::SubscriberOptions so;
  so.threads = a.threads;
  so.store.slots = a.slots;
  so.make_store = refit::store::HostStoreFactory();
  so.max_frame_bytes = 4u << 20;
  // Everything applied at OnEnd: the Ack's stage/verify split then covers all the work (frames
  // are fed back to back here, so applying on arrival would overlap nothing).
  so.stage_on_arrival = false;
  refit::subscriber::SubscriberOptions copy = so;
  copy.retained_patch_bytes = 0;  // the full-copy staging (no retained patches)
  refit::subscriber::SubscriberCore in_place(so);
  refit::subscriber::SubscriberCore full(copy);
  refit::subscriber::SubscriberCore in_place_v2(so);
  in_place_v2.SetDigestFormat(refit::sync::DigestFormat::kV2);
  std::vector<double> st[3], ve[3], to[3], cu, rf;
  for (int v = 1; v <= a.versions + 1; ++v) {
    if (v > 1) Perturb(model, a.changed, a.region, rng);
    const auto inputs = model.Inputs();
    auto s = (*pub)->Publish(static_cast<uint64_t>(v), inputs, /*allow_degenerate=*/true);
    if (!s.ok()) return s.status();
    for (int k = 0; k < 3; ++k) {
      // Rotate which core goes first, so none always finds the caches warm.
      const int which = (v + k) % 3;
      refit::subscriber::SubscriberCore& core =
          which == 0 ? in_place : which == 1 ? full : in_place_v2;
      auto r = Feed(core, **pub,
                    which == 2 ? refit::sync::DigestFormat::kV2 : refit::sync::DigestFormat::kV1);
      if (!r.ok()) return r.status();
      std::printf("{\"kind\":\"version\",\"model_mb\":%llu,\"version\":%d,\"path\":\"%s\","
                  "\"changed_elements\":%llu,\"total_ms\":%.2f,\"stage_ms\":%.2f,"
                  "\"verify_ms\":%.2f,\"catch_up_ms\":%.2f,\"refresh_after_ms\":%.2f,"
                  "\"slot_version\":%llu,"
                  "\"tensors_in_place\":%u,"
                  "\"tensors_copied\":%u,\"bytes_copied\":%llu,\"digests_full\":%u,"
                  "\"digests_incremental\":%u,\"loadavg\":\"%s\"}\n",
                  static_cast<unsigned long long>(mb), v,
                  which == 0 ? "in_place" : which == 1 ? "full_copy" : "in_place_v2",
                  static_cast<unsigned long long>(v > 1 ? s->changed_elements : 0), r->total_ms,
                  r->stage_ms, r->verify_ms, r->stats.catch_up_micros / 1e3, r->refresh_ms,
                  static_cast<unsigned long long>(r->stats.slot_version),
                  r->stats.tensors_in_place, r->stats.tensors_copied,
                  static_cast<unsigned long long>(r->stats.bytes_copied), r->stats.digests_full,
                  r->stats.digests_incremental, LoadAvg().c_str());
      if (v > a.slots + 1) {  // steady: every slot has held a version
        st[which].push_back(r->stage_ms);
        ve[which].push_back(r->verify_ms);
        to[which].push_back(r->total_ms);
        if (which == 0) cu.push_back(r->stats.catch_up_micros / 1e3);
        if (which == 0) rf.push_back(r->refresh_ms);
      }
    }
  }
  Summary sum{Median(st[0]), Median(ve[0]), Median(to[0]), Median(cu),
              Median(rf), Median(st[1]), Median(ve[1]), Median(to[1]),
              Median(st[2]), Median(ve[2]), Median(to[2])};
  std::printf("{\"kind\":\"summary\",\"model_mb\":%llu,\"region\":%llu,\"steady_versions\":%zu,"
              "\"in_place\":{\"total_ms\":%.2f,\"stage_ms\":%.2f,\"of_which_catch_up_ms\":%.2f,"
              "\"verify_ms\":%.2f,\"refresh_after_commit_ms\":%.2f},"
              "\"full_copy\":{\"total_ms\":%.2f,\"stage_ms\":%.2f,\"verify_ms\":%.2f},"
              "\"in_place_v2\":{\"total_ms\":%.2f,\"stage_ms\":%.2f,\"verify_ms\":%.2f},"
              "\"stage_speedup\":%.2f,\"total_speedup\":%.2f,\"loadavg\":\"%s\"}\n",
              static_cast<unsigned long long>(mb), static_cast<unsigned long long>(a.region),
              st[0].size(), sum.inplace_total,
              sum.inplace_stage, sum.inplace_catch_up, sum.inplace_verify, sum.inplace_refresh,
              sum.copy_total,
              sum.copy_stage, sum.copy_verify, sum.v2_total, sum.v2_stage, sum.v2_verify,
              sum.copy_stage / std::max(sum.inplace_stage, 1e-3),
              sum.copy_total / std::max(sum.inplace_total, 1e-3), LoadAvg().c_str());
  return sum;
}

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "subscriber_bench: %s\nusage: subscriber_bench [--sizes-mb 128,512] "
               "[--changed N] [--versions N] [--threads T] [--slots S] [--region N]\n",
               why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return Usage(absl::StrCat(arg, " needs a value"));
    const char* v = argv[++i];
    bool ok = true;
    if (arg == "--sizes-mb") {
      a.sizes_mb.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) {
        uint64_t mb = 0;
        ok = ok && absl::SimpleAtoi(p, &mb) && mb > 0;
        a.sizes_mb.push_back(mb);
      }
    } else if (arg == "--changed") {
      ok = absl::SimpleAtoi(v, &a.changed);
    } else if (arg == "--versions") {
      ok = absl::SimpleAtoi(v, &a.versions) && a.versions >= 1;
    } else if (arg == "--threads") {
      ok = absl::SimpleAtoi(v, &a.threads) && a.threads >= 0;
    } else if (arg == "--region") {
      ok = absl::SimpleAtoi(v, &a.region);
    } else if (arg == "--slots") {
      ok = absl::SimpleAtoi(v, &a.slots) && a.slots >= 2;
    } else {
      return Usage(absl::StrCat("unknown flag ", arg));
    }
    if (!ok) return Usage(absl::StrCat("bad value for ", arg));
  }
  std::vector<Summary> sums;
  for (uint64_t mb : a.sizes_mb) {
    StoreCreation(mb << 20, a);
    auto s = BenchSize(mb, a);
    if (!s.ok()) {
      std::printf("FAIL %s\n", std::string(s.status().message()).c_str());
      return 1;
    }
    sums.push_back(*s);
  }
  if (sums.size() >= 2) {
    const Summary& lo = sums.front();
    const Summary& hi = sums.back();
    const double size_ratio =
        static_cast<double>(a.sizes_mb.back()) / static_cast<double>(a.sizes_mb.front());
    std::printf("{\"kind\":\"ratios\",\"size_ratio\":%.2f,\"in_place_stage\":%.2f,"
                "\"in_place_verify\":%.2f,\"in_place_total\":%.2f,\"full_copy_stage\":%.2f,"
                "\"full_copy_total\":%.2f,\"in_place_v2_verify\":%.2f,\"in_place_v2_total\":%.2f,"
                "\"loadavg\":\"%s\"}\n",
                size_ratio, hi.inplace_stage / std::max(lo.inplace_stage, 1e-3),
                hi.inplace_verify / std::max(lo.inplace_verify, 1e-3),
                hi.inplace_total / std::max(lo.inplace_total, 1e-3),
                hi.copy_stage / std::max(lo.copy_stage, 1e-3),
                hi.copy_total / std::max(lo.copy_total, 1e-3),
                hi.v2_verify / std::max(lo.v2_verify, 1e-3),
                hi.v2_total / std::max(lo.v2_total, 1e-3), LoadAvg().c_str());
  }
  return 0;
}
