// Writes a seed corpus for subscriber_fuzzer (input language: subscriber_fuzz_input.h): every
// real transfer fed operation by operation (header, each frame, end), chains of them (1 -> 2
// -> 3 across the manifest change), and each with one fault (a corrupt or re-signed frame, a
// wrong digest, an abort halfway) followed by the good transfer. Usage: make_subscriber_corpus DIR
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "daemon/common/fuzz_input_writer.h"
#include "daemon/subscriber/subscriber_fuzz_input.h"

namespace {

using refit::FuzzInputWriter;
namespace fz = refit::subscriber::fuzz;

void Op(FuzzInputWriter& w, fz::Op op) { w.Integral<uint8_t>(0, fz::kOpCount - 1, op); }

void Wire(FuzzInputWriter& w, size_t i) {
  w.Integral<uint8_t>(0, static_cast<uint8_t>(fz::GetWires().size() - 1), static_cast<uint8_t>(i));
}

void Header(FuzzInputWriter& w, size_t i) {
  Op(w, fz::kHeader);
  Wire(w, i);
  w.Integral<int>(0, 3, 0);  // no mutation
}

// Frame k of wire i; `mutate` writes a mutation (default: none).
void Frame(FuzzInputWriter& w, size_t i, size_t k,
           const std::function<void(FuzzInputWriter&)>& mutate = nullptr) {
  Op(w, fz::kFrame);
  Wire(w, i);
  w.Integral<uint32_t>(0, static_cast<uint32_t>(fz::GetWires()[i].frames.size() - 1),
                       static_cast<uint32_t>(k));
  if (mutate) {
    mutate(w);
  } else {
    w.Integral<uint8_t>(0, fz::kFrameMutationCount - 1, fz::kFrameNone);
  }
}

void End(FuzzInputWriter& w, size_t i, bool bad_digest = false) {
  Op(w, fz::kEnd);
  Wire(w, i);
  if (bad_digest) {
    w.Integral<uint8_t>(0, fz::kEndMutationCount - 1, fz::kEndDigest);
    w.Integral<uint8_t>(0);
    w.Integral<uint64_t>(0x0123456789ABCDEFull);
  } else {
    w.Integral<uint8_t>(0, fz::kEndMutationCount - 1, fz::kEndNone);
  }
}

// Wire i operation by operation; frame `fault` (if any) mutated by `mutate`.
void Transfer(FuzzInputWriter& w, size_t i, size_t fault = SIZE_MAX,
              const std::function<void(FuzzInputWriter&)>& mutate = nullptr) {
  Header(w, i);
  for (size_t k = 0; k < fz::GetWires()[i].frames.size(); ++k) {
    Frame(w, i, k, k == fault ? mutate : nullptr);
  }
  End(w, i);
}

void Whole(FuzzInputWriter& w, size_t i) {
  Op(w, fz::kWholeTransfer);
  Wire(w, i);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_subscriber_corpus DIR\n");
    return 2;
  }
  refit::SeedFiles seeds(argv[1]);
  auto write = [&](const FuzzInputWriter& w) { seeds.Write(w); };
  const auto& wires = fz::GetWires();
  // From version 1: every transfer whose base is 1 or 0.
  for (size_t i : {1u, 2u, 4u, 5u, 6u}) {
    FuzzInputWriter w;
    Transfer(w, i);
    write(w);
  }
  {  // 1 -> 2 -> 3 (manifest change), step by step.
    FuzzInputWriter w;
    Transfer(w, 1);
    Transfer(w, 3);
    write(w);
  }
  const auto flip = [](bool resign) {
    return [resign](FuzzInputWriter& w) {
      w.Integral<uint8_t>(0, fz::kFrameMutationCount - 1, fz::kFrameFlipByte);
      w.Integral<uint32_t>(3);
      w.Integral<int>(0, 7, 1);
      w.Bool(resign);
    };
  };
  for (size_t i : {1u, 4u, 5u}) {
    for (bool resign : {false, true}) {  // checksum error; corrupt patch / keyframe bytes
      FuzzInputWriter w;
      Transfer(w, i, wires[i].frames.size() / 2, flip(resign));
      Transfer(w, i);
      write(w);
    }
    FuzzInputWriter w;  // digest mismatch, then the good transfer
    Header(w, i);
    for (size_t k = 0; k < wires[i].frames.size(); ++k) Frame(w, i, k);
    End(w, i, /*bad_digest=*/true);
    Transfer(w, i);
    write(w);
    FuzzInputWriter a;  // abort halfway
    Header(a, i);
    for (size_t k = 0; k < wires[i].frames.size() / 2; ++k) Frame(a, i, k);
    Op(a, fz::kAbort);
    Transfer(a, i);
    write(a);
  }
  {  // whole transfers to 2, then the manifest change step by step with a missing frame
    FuzzInputWriter w;
    Whole(w, 1);
    Header(w, 3);
    for (size_t k = 1; k < wires[3].frames.size(); ++k) Frame(w, 3, k);
    End(w, 3);
    Transfer(w, 3);
    write(w);
  }
  std::printf("wrote %d seeds to %s\n", seeds.written(), argv[1]);
  return 0;
}
