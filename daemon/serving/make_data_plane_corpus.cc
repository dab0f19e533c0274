// Writes a seed corpus for data_plane_fuzzer (input language: data_plane_fuzz_input.h): valid
// sessions -- bootstrap from nothing, deltas from versions 1 and 2, up to date at 3, with and
// without stripes and LZ4 -- acked as applied, rejected (with and without mismatched tensors)
// then retried, with keyframe requests, and a few broken ones (wrong digest, bad first message).
// Usage: make_data_plane_corpus DIR
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/common/fuzz_input_writer.h"
#include "daemon/serving/data_plane_fuzz_input.h"

namespace {

using refit::FuzzInputWriter;
namespace fz = refit::publisher::fuzz;

void Op(FuzzInputWriter& w, fz::Op op) { w.Integral<uint8_t>(0, fz::kOpCount - 1, op); }

struct Hello {
  int version = 0;      // 0..3
  int digest = 0;       // 0: the publisher's, 1: zero, 2: garbage
  bool tensors = false;
  uint32_t stripes = 0;
  bool lz4 = true;
  bool want_keyframe = false;
  int protocol = 1;
};

void SendHello(FuzzInputWriter& w, const Hello& h) {
  Op(w, fz::kHello);
  w.Integral<int>(0, 2, h.protocol);
  w.String("fuzz-subscriber");
  w.Integral<int>(0, 4, h.version);
  w.Integral<int>(0, 2, h.digest);
  if (h.digest == 2) w.Integral<uint64_t>(0xBADD16E57ull);
  w.Bool(h.tensors);
  w.Integral<uint32_t>(0, 3, h.stripes);
  w.Integral<int>(0, 2, 0);  // 64 KiB frames
  w.Bool(true);              // patch format 1
  w.Bool(h.lz4);
  w.Bool(h.want_keyframe);
}

void Wait(FuzzInputWriter& w, fz::WaitFor what) {
  Op(w, fz::kWait);
  w.Integral<uint8_t>(0, fz::kWaitForCount - 1, what);
}

// An Ack of the last transfer: applied (its version and digest) or rejected (its base).
void SendAck(FuzzInputWriter& w, bool applied, bool mismatched = false) {
  Op(w, fz::kAck);
  w.Integral<int>(0, 1, 0);
  w.Integral<int>(0, 3, applied ? 1 : 2);
  w.Integral<int>(0, 2, applied ? 0 : 1);
  w.Integral<int>(0, 1, 0);
  w.Integral<int>(0, 2, mismatched ? 1 : 0);
  if (mismatched) w.Integral<int>(0, 4, 0);  // a.weight
}

void Stripes(FuzzInputWriter& w, uint32_t n) {
  for (uint32_t i = 1; i <= n; ++i) {
    Op(w, fz::kStripe);
    w.Integral<int>(0, 1, 0);
    w.Integral<uint32_t>(0, 4, i);
  }
}

// Hello, Welcome, stripes, one transfer acked as `applied`.
void Transfer(FuzzInputWriter& w, const Hello& h, bool applied = true) {
  SendHello(w, h);
  Wait(w, fz::kWaitMessage);
  Stripes(w, h.stripes);
  Wait(w, fz::kWaitEnd);
  SendAck(w, applied);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_data_plane_corpus DIR\n");
    return 2;
  }
  refit::SeedFiles seeds(argv[1]);
  auto write = [&](const FuzzInputWriter& w) { seeds.Write(w); };
  for (int v : {0, 1, 2}) {  // bootstrap / deltas, applied
    for (uint32_t stripes : {0u, 2u}) {
      FuzzInputWriter w;
      Transfer(w, {.version = v, .tensors = v > 0, .stripes = stripes, .lz4 = stripes == 0});
      write(w);
    }
  }
  {  // up to date: nothing to send
    FuzzInputWriter w;
    SendHello(w, {.version = 3, .tensors = true});
    Wait(w, fz::kWaitMessage);
    Wait(w, fz::kWaitMessage);
    write(w);
  }
  {  // rejected with a mismatched tensor, then the retry (a keyframe of it) applied
    FuzzInputWriter w;
    SendHello(w, {.version = 1});
    Wait(w, fz::kWaitMessage);
    Wait(w, fz::kWaitEnd);
    SendAck(w, false, true);
    Wait(w, fz::kWaitEnd);
    SendAck(w, true);
    write(w);
  }
  {  // rejected without a reason, retried, applied; then a keyframe request and resync
    FuzzInputWriter w;
    Transfer(w, {.version = 2}, false);
    Wait(w, fz::kWaitEnd);
    SendAck(w, true);
    Op(w, fz::kKeyframeRequest);
    w.Integral<uint64_t>(0);
    w.Integral<int>(0, 2, 1);
    w.Integral<int>(0, 4, 1);  // b.bias
    w.Bool(false);
    w.String("digest mismatch");
    Op(w, fz::kResync);
    w.Bool(true);
    w.Integral<int>(0, 2, 0);
    Wait(w, fz::kWaitMessage);
    write(w);
  }
  {  // diverged: version 2 with another digest; want_keyframe
    FuzzInputWriter w;
    Transfer(w, {.version = 2, .digest = 2});
    write(w);
    FuzzInputWriter k;
    Transfer(k, {.version = 1, .want_keyframe = true});
    write(k);
  }
  {  // broken: protocol 0; Ack before Hello; a second Hello; half-close mid-transfer
    FuzzInputWriter w;
    SendHello(w, {.protocol = 0});
    Wait(w, fz::kWaitClosed);
    write(w);
    FuzzInputWriter a;
    SendAck(a, true);
    Wait(a, fz::kWaitClosed);
    write(a);
    FuzzInputWriter h;
    SendHello(h, {.version = 1});
    SendHello(h, {.version = 1});
    Wait(h, fz::kWaitClosed);
    write(h);
    FuzzInputWriter d;
    SendHello(d, {.version = 0, .stripes = 1});
    Wait(d, fz::kWaitMessage);
    Stripes(d, 1);
    Op(d, fz::kWritesDone);
    Wait(d, fz::kWaitClosed);
    write(d);
  }
  std::printf("wrote %d seeds to %s\n", seeds.written(), argv[1]);
  return 0;
}
