// libFuzzer target for SubscriberCore (subscriber_core.h): transfer headers, frames and ends,
// real ones cut by a PublisherCore and mutated field by field, or parsed from raw bytes, fed in
// any order to a core whose store holds version 1 of a small model. The input language is in
// subscriber_fuzz_input.h.
//
// Invariant (no torn version, BRIEF section 3): after every operation the store's current
// version is the last one committed, bit for bit -- applied_version, applied_digest and every
// tensor's bytes read under a lease are unchanged by any failed, aborted or still open transfer.
// A committed version (OnEnd answered APPLIED) must hold bytes whose digests are the ones it was
// verified against. A violation abort()s, so libFuzzer reports it; so do crashes and sanitizer
// reports.
// Build: cmake -DREFIT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ...; run: subscriber_fuzzer DIR
// (make_subscriber_corpus DIR writes seeds: real transfers, whole and with one fault each).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "daemon/codec/hash.h"
#include "daemon/store/shm_store.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/subscriber_fuzz_input.h"
#include "daemon/sync/version_digest.h"
#include "google/protobuf/stubs/logging.h"

namespace refit::subscriber::fuzz {
namespace {

// REFIT_FUZZ_TRACE=1 prints every operation's outcome (for reading a finding or a seed).
const bool kTrace = std::getenv("REFIT_FUZZ_TRACE") != nullptr;

void Trace(const std::string& what, const absl::Status& st) {
  if (kTrace) std::fprintf(stderr, "%s: %s\n", what.c_str(), st.ToString().c_str());
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "subscriber_fuzzer invariant violated: %s\n", what.c_str());
  std::abort();
}

// What the store must show: the last committed version.
struct Snapshot {
  uint64_t version = 0;
  uint64_t digest = 0;
  std::map<std::string, std::vector<uint8_t>> tensors;
};

Snapshot Read(SubscriberCore& core) {
  Snapshot s;
  s.version = core.applied_version();
  s.digest = core.applied_digest();
  auto lease = core.generations().AcquireLease("fuzz-reader");
  if (!lease.ok()) Fail("no lease on the current version: " + lease.status().ToString());
  if (lease->lease.version != s.version) Fail("the lease is not on the applied version");
  const store::Layout& layout = lease->store->layout();
  for (size_t i = 0; i < layout.size(); ++i) {
    std::vector<uint8_t> bytes(lease->lease.spans[i].size());
    absl::Status st = lease->store->memory().Download(bytes, lease->lease.spans[i]);
    if (!st.ok()) Fail("reading " + layout.tensor(i).name + ": " + st.ToString());
    s.tensors[layout.tensor(i).name] = std::move(bytes);
  }
  if (!core.generations().ReleaseLease(lease->lease.lease_id).ok()) Fail("lease release");
  return s;
}

void ExpectHolds(SubscriberCore& core, const Snapshot& want, const char* after) {
  Snapshot got = Read(core);
  if (got.version != want.version || got.digest != want.digest || got.tensors != want.tensors) {
    Fail(std::string("the store no longer holds version ") + std::to_string(want.version) +
         " bit-exact after " + after + " (now version " + std::to_string(got.version) + ")");
  }
}

// A committed version: its bytes hash to the digests it was verified against.
Snapshot ExpectCommitted(SubscriberCore& core, const v1::Ack& ack) {
  Snapshot s = Read(core);
  if (ack.applied_version() != ack.version() || s.version != ack.version() ||
      s.digest != ack.applied_version_digest()) {
    Fail("APPLIED ack disagrees with the core's applied version");
  }
  VersionRecord rec = core.records().applied();
  if (rec.version != s.version || rec.version_digest != s.digest ||
      rec.tensors.size() != s.tensors.size()) {
    Fail("applied record disagrees with the store");
  }
  for (const v1::TensorDigest& t : rec.tensors) {
    auto it = s.tensors.find(t.name());
    if (it == s.tensors.end() || TensorDigest(it->second, 1) != t.digest()) {
      Fail("committed tensor " + t.name() + " does not match its verified digest");
    }
  }
  return s;
}

uint64_t Number(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<uint8_t>(0, 2)) {
    case 0: return in.ConsumeIntegralInRange<uint64_t>(0, 8);
    case 1: return in.ConsumeIntegral<uint64_t>();
    default: return in.ConsumeIntegral<uint32_t>();
  }
}

const Wire& PickWire(FuzzedDataProvider& in) {
  const auto& wires = GetWires();
  return wires[in.ConsumeIntegralInRange<uint8_t>(0, static_cast<uint8_t>(wires.size() - 1))];
}

// Index of a tensor of the header, -1 when it has none.
int PickTensor(FuzzedDataProvider& in, const v1::VersionHeader& h) {
  const uint8_t i = in.ConsumeIntegral<uint8_t>();
  return h.tensors_size() == 0 ? -1 : i % h.tensors_size();
}

void MutateHeader(FuzzedDataProvider& in, v1::VersionHeader& h) {
  const auto m = in.ConsumeIntegralInRange<uint8_t>(0, kHeaderMutationCount - 1);
  if (m == kHeaderVersion) return h.set_version(Number(in));
  if (m == kHeaderBase) return h.set_base_version(Number(in));
  const int ti = PickTensor(in, h);
  if (ti < 0) return;
  v1::TensorPlan* t = h.mutable_tensors(ti);
  switch (m) {
    case kHeaderDelivery:
      t->set_delivery(static_cast<v1::Delivery>(in.ConsumeIntegralInRange<int>(0, 4)));
      break;
    case kHeaderDType:
      t->mutable_spec()->set_dtype(static_cast<v1::DType>(in.ConsumeIntegralInRange<int>(0, 20)));
      break;
    case kHeaderShape: {
      const int d = in.ConsumeIntegralInRange<int>(0, 3);
      const uint64_t n = Number(in);
      if (d < t->spec().shape_size()) {
        t->mutable_spec()->set_shape(d, n);
      } else {
        t->mutable_spec()->add_shape(n);
      }
      break;
    }
    case kHeaderDropTensor:
      h.mutable_tensors()->erase(h.mutable_tensors()->begin() + ti);
      break;
    case kHeaderCopyTensor: {
      const v1::TensorPlan copy = *t;
      *h.add_tensors() = copy;
      break;
    }
    case kHeaderSwapTensors: h.mutable_tensors()->SwapElements(ti, PickTensor(in, h)); break;
    case kHeaderStep: {
      const int k = in.ConsumeIntegralInRange<int>(0, 3);
      v1::PatchStep* s = k < t->steps_size() ? t->mutable_steps(k) : t->add_steps();
      s->set_base_version(Number(in));
      s->set_target_version(Number(in));
      break;
    }
    case kHeaderRename: t->mutable_spec()->set_name(in.ConsumeRandomLengthString(16)); break;
    default: break;
  }
}

void Resign(FuzzedDataProvider& in, v1::DataFrame& f) {
  if (in.ConsumeBool()) f.set_checksum(sync::FrameChecksum(f.payload()));
}

void MutateFrame(FuzzedDataProvider& in, v1::DataFrame& f) {
  switch (in.ConsumeIntegralInRange<uint8_t>(0, kFrameMutationCount - 1)) {
    case kFrameVersion: f.set_version(Number(in)); break;
    case kFrameTensorIndex: f.set_tensor_index(static_cast<uint32_t>(Number(in))); break;
    case kFramePart: f.set_part(static_cast<uint32_t>(Number(in))); break;
    case kFrameObjectBytes: f.set_object_bytes(Number(in)); break;
    case kFrameChunkCount: f.set_chunk_count(static_cast<uint32_t>(Number(in))); break;
    case kFrameChunkIndex: f.set_chunk_index(static_cast<uint32_t>(Number(in))); break;
    case kFrameOffset: f.set_offset(Number(in)); break;
    case kFrameRawBytes: f.set_raw_bytes(Number(in)); break;
    case kFrameCompression:
      f.set_compression(static_cast<v1::Compression>(in.ConsumeIntegralInRange<int>(0, 4)));
      break;
    case kFrameFlipByte: {
      const uint32_t pos = in.ConsumeIntegral<uint32_t>();
      const int bit = in.ConsumeIntegralInRange<int>(0, 7);
      if (!f.payload().empty()) {
        (*f.mutable_payload())[pos % f.payload().size()] ^= static_cast<char>(1 << bit);
      }
      Resign(in, f);
      break;
    }
    case kFrameTruncate: {
      const uint32_t len = in.ConsumeIntegral<uint32_t>();
      f.mutable_payload()->resize(len % (f.payload().size() + 1));
      Resign(in, f);
      break;
    }
    case kFrameChecksum: f.set_checksum(in.ConsumeIntegral<uint64_t>()); break;
    default: break;
  }
}

void MutateEnd(FuzzedDataProvider& in, v1::VersionEnd& e) {
  switch (in.ConsumeIntegralInRange<uint8_t>(0, kEndMutationCount - 1)) {
    case kEndVersion: e.set_version(Number(in)); break;
    case kEndDigest: {
      const uint8_t i = in.ConsumeIntegral<uint8_t>();
      const uint64_t d = in.ConsumeIntegral<uint64_t>();
      if (e.digests_size() > 0) e.set_digests(i % e.digests_size(), d);
      break;
    }
    case kEndDropDigest:
      if (e.digests_size() > 0) e.mutable_digests()->RemoveLast();
      break;
    case kEndVersionDigest: e.set_version_digest(in.ConsumeIntegral<uint64_t>()); break;
    default: break;
  }
}

template <typename Message>
bool ParseRaw(FuzzedDataProvider& in, Message& m) {
  const uint16_t n = in.ConsumeIntegralInRange<uint16_t>(0, kMaxRawBytes);
  const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(n);
  return m.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
}

// The session under test: a core and what its store must show.
class Run {
 public:
  Run() : core_(Options()) {
    v1::Ack ack = Whole(GetWires()[0]);
    if (ack.result() != v1::ACK_RESULT_APPLIED) Fail("bootstrap rejected: " + ack.error());
    held_ = ExpectCommitted(core_, ack);
  }

  void Step(FuzzedDataProvider& in) {
    const auto op = in.ConsumeIntegralInRange<uint8_t>(0, kOpCount - 1);
    switch (op) {
      case kHeader: {
        v1::VersionHeader h = PickWire(in).header;
        for (int n = in.ConsumeIntegralInRange<int>(0, 3); n > 0; --n) MutateHeader(in, h);
        Header(h);
        break;
      }
      case kFrame: {
        const Wire& w = PickWire(in);
        const uint32_t k = in.ConsumeIntegralInRange<uint32_t>(
            0, static_cast<uint32_t>(w.frames.size() - 1));
        v1::DataFrame f = w.frames[k];
        MutateFrame(in, f);
        Trace("frame " + std::to_string(k), core_.OnFrame(f));  // any answer
        break;
      }
      case kEnd: {
        v1::VersionEnd e = PickWire(in).end;
        MutateEnd(in, e);
        End(e);
        break;
      }
      case kAbort:
        core_.Abort();
        Trace("abort", absl::OkStatus());
        break;
      case kFrameLimit: core_.SetMaxFrameBytes(in.ConsumeIntegral<uint32_t>()); break;
      case kWholeTransfer: Account(Whole(PickWire(in))); break;
      case kRawHeader: {
        v1::VersionHeader h;
        if (ParseRaw(in, h)) Header(h);
        break;
      }
      case kRawFrame: {
        v1::DataFrame f;
        if (ParseRaw(in, f)) Trace("raw frame", core_.OnFrame(f));
        break;
      }
      case kRawEnd: {
        v1::VersionEnd e;
        if (ParseRaw(in, e)) End(e);
        break;
      }
      default: break;
    }
    ExpectHolds(core_, held_, "an operation");
  }

 private:
  static SubscriberOptions Options() {
    SubscriberOptions o;
    o.store.slots = 2;
    o.make_store = store::HostStoreFactory();
    o.max_frame_bytes = kFrameBytes;
    o.threads = 1;
    o.max_slot_bytes = 1 << 20;
    return o;
  }

  void Header(const v1::VersionHeader& h) {
    const bool was_open = core_.transfer_open();
    absl::Status st = core_.OnHeader(h);
    Trace("header of version " + std::to_string(h.version()), st);
    if (!st.ok() && core_.transfer_open() != was_open) Fail("a refused header changed the core");
  }

  void End(const v1::VersionEnd& e) { Account(core_.OnEnd(e)); }

  void Account(const v1::Ack& ack) {
    Trace("end: " + v1::AckResult_Name(ack.result()) + " " + ack.error(), absl::OkStatus());
    if (core_.transfer_open()) Fail("OnEnd left the transfer open");
    if (ack.result() == v1::ACK_RESULT_APPLIED) {
      held_ = ExpectCommitted(core_, ack);
    } else {
      if (ack.applied_version() != held_.version) Fail("REJECTED ack names another version");
      ExpectHolds(core_, held_, "a rejected transfer");
    }
  }

  // Feeds a whole transfer; an Ack even when the header is refused (as REJECTED).
  v1::Ack Whole(const Wire& w) {
    core_.Abort();
    if (!core_.OnHeader(w.header).ok()) {
      v1::Ack refused;
      refused.set_result(v1::ACK_RESULT_REJECTED);
      refused.set_applied_version(core_.applied_version());
      return refused;
    }
    for (const v1::DataFrame& f : w.frames) Trace("whole: frame", core_.OnFrame(f));
    return core_.OnEnd(w.end);
  }

  SubscriberCore core_;
  Snapshot held_;
};

}  // namespace
}  // namespace refit::subscriber::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);  // parse errors of raw messages are expected
    return true;
  }();
  (void)quiet;
  FuzzedDataProvider in(data, size);
  refit::subscriber::fuzz::Run run;
  for (int ops = 0; ops < 64 && in.remaining_bytes() > 0; ++ops) run.Step(in);
  return 0;
}
