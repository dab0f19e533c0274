#include "cuda/emu/emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

// Context switching: a minimal register switch on x86-64 (glibc's swapcontext makes a system call
// per switch to save the signal mask, which makes the emulator ~30x slower), ucontext elsewhere and
// where control-flow protection (shadow stacks) may be on.
#if defined(__x86_64__) && !defined(__CET__)
#define REFIT_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define REFIT_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REFIT_EMU_ASAN 1
#endif
#endif
#if defined(REFIT_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(REFIT_EMU_ASM_SWITCH)
// void refit_emu_switch(void** save_sp, void* load_sp): saves the callee-saved registers, the x87
// control word and MXCSR on the current stack, stores the stack pointer in *save_sp, loads
// load_sp and restores the same from there.
extern "C" void refit_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl refit_emu_switch
  .hidden refit_emu_switch
  .type refit_emu_switch, @function
refit_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size refit_emu_switch, .-refit_emu_switch
)");
#endif

namespace refit::cuda::emu {
namespace {

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "refit CUDA emulator: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

constexpr size_t kStackBytes = 256 * 1024;
constexpr uint32_t kMaxThreads = 1024;

enum class State { kRunnable, kBlockBarrier, kWarpCollective, kDone };
enum class Op { kShuffleUp, kShuffleDown, kReduceAdd };

struct Context {
#if defined(REFIT_EMU_ASM_SWITCH)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct Fiber {
  Context ctx;
  char* stack_lo = nullptr;  // usable stack [stack_lo, stack_lo + kStackBytes)
  void* mapping = nullptr;   // guard page + stack
  void* asan_fake_stack = nullptr;
  State state = State::kDone;
  uint32_t tid = 0;
  // Collective in flight.
  Op op = Op::kReduceAdd;
  int delta = 0;
  size_t bytes = 0;
  unsigned char in[16] = {};
  unsigned char out[16] = {};
  bool predicate = false;
};

struct Emulator {
  std::mutex mu;  // one launch at a time
  std::vector<std::unique_ptr<Fiber>> fibers;
  Context scheduler;
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  Fiber* current = nullptr;
  uint32_t threads = 0;
  uint64_t block = 0;
  const std::function<void()>* body = nullptr;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  uint64_t switches = 0;
};

Emulator& E() {
  static Emulator* e = new Emulator;  // never destroyed: fibers may outlive static destruction order
  return *e;
}

uint64_t NextRandom(uint64_t& s) {  // xorshift64*
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 0x2545F4914F6CDD1Dull;
}

void StartSwitch(void** fake_save, const void* bottom, size_t size) {
#if defined(REFIT_EMU_ASAN)
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save;
  (void)bottom;
  (void)size;
#endif
}
void FinishSwitch(void* fake_save, const void** bottom_old, size_t* size_old) {
#if defined(REFIT_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
  (void)fake_save;
  (void)bottom_old;
  (void)size_old;
#endif
}

void RawSwitch(Context& from, Context& to) {
  ++E().switches;
#if defined(REFIT_EMU_ASM_SWITCH)
  refit_emu_switch(&from.sp, to.sp);
#else
  if (swapcontext(&from.uc, &to.uc) != 0) Die("swapcontext failed");
#endif
}

// Scheduler -> fiber.
void RunFiber(Fiber& f) {
  Emulator& e = E();
  e.current = &f;
  StartSwitch(&e.scheduler_fake_stack, f.stack_lo, kStackBytes);
  RawSwitch(e.scheduler, f.ctx);
  FinishSwitch(e.scheduler_fake_stack, nullptr, nullptr);
  e.current = nullptr;
}

// Fiber -> scheduler; returns when the scheduler resumes this fiber.
void Yield(State s) {
  Emulator& e = E();
  Fiber* f = e.current;
  if (f == nullptr) Die("device primitive called outside a kernel");
  f->state = s;
  StartSwitch(&f->asan_fake_stack, e.scheduler_stack_bottom, e.scheduler_stack_size);
  RawSwitch(f->ctx, e.scheduler);
  FinishSwitch(f->asan_fake_stack, nullptr, nullptr);
}

[[noreturn]] void FiberEntry() {
  Emulator& e = E();
  FinishSwitch(nullptr, &e.scheduler_stack_bottom, &e.scheduler_stack_size);
  (*e.body)();
  Fiber* f = e.current;
  f->state = State::kDone;
  StartSwitch(nullptr, e.scheduler_stack_bottom, e.scheduler_stack_size);  // this stack is done
  RawSwitch(f->ctx, e.scheduler);
  Die("finished fiber resumed");
}

void PrepareFiber(Fiber& f) {
  if (f.mapping == nullptr) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) Die("cannot map a fiber stack");
    if (mprotect(m, page, PROT_NONE) != 0) Die("cannot protect a fiber stack guard page");
    f.mapping = m;
    f.stack_lo = static_cast<char*>(m) + page;
  }
#if defined(REFIT_EMU_ASM_SWITCH)
  // Initial frame, as refit_emu_switch leaves it: [x87 cw, pad, mxcsr, pad] r15 r14 r13 r12 rbx
  // rbp, return address = FiberEntry, then a dummy slot so that FiberEntry starts with the stack
  // aligned as after a call (rsp % 16 == 8).
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack_lo + kStackBytes) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                             // dummy return address of FiberEntry
  *--sp = reinterpret_cast<uint64_t>(&FiberEntry);       // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = 0;                 // rbp rbx r12 r13 r14 r15
  sp -= 2;
  const uint16_t fpu_cw = 0x037f;  // x87 default: all exceptions masked, 64-bit precision
  const uint32_t mxcsr = 0x1f80;   // SSE default: all exceptions masked, round to nearest
  std::memset(sp, 0, 16);
  std::memcpy(sp, &fpu_cw, sizeof fpu_cw);
  std::memcpy(reinterpret_cast<char*>(sp) + 8, &mxcsr, sizeof mxcsr);
  f.ctx.sp = sp;
#else
  if (getcontext(&f.ctx.uc) != 0) Die("getcontext failed");
  f.ctx.uc.uc_stack.ss_sp = f.stack_lo;
  f.ctx.uc.uc_stack.ss_size = kStackBytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, &FiberEntry, 0);
#endif
  f.asan_fake_stack = nullptr;
  f.state = State::kRunnable;
}

void ReleaseWarp(Fiber* const* lanes) {
  const Fiber& f0 = *lanes[0];
  for (int l = 1; l < 32; ++l) {
    const Fiber& f = *lanes[l];
    if (f.op != f0.op || f.delta != f0.delta || f.bytes != f0.bytes) {
      Die("lanes of a warp reached different warp collectives");
    }
  }
  if (f0.op == Op::kReduceAdd) {
    uint32_t sum = 0;
    for (int l = 0; l < 32; ++l) {
      uint32_t v;
      std::memcpy(&v, lanes[l]->in, 4);
      sum += v;
    }
    for (int l = 0; l < 32; ++l) std::memcpy(lanes[l]->out, &sum, 4);
  } else {
    for (int l = 0; l < 32; ++l) {
      const int src = f0.op == Op::kShuffleUp ? l - f0.delta : l + f0.delta;
      const Fiber& from = (src >= 0 && src < 32) ? *lanes[src] : *lanes[l];
      std::memcpy(lanes[l]->out, from.in, f0.bytes);
    }
  }
  for (int l = 0; l < 32; ++l) lanes[l]->state = State::kRunnable;
}

void RunBlock(Emulator& e) {
  const uint32_t n = e.threads;
  for (uint32_t t = 0; t < n; ++t) {
    e.fibers[t]->tid = t;
    PrepareFiber(*e.fibers[t]);
  }
  std::vector<uint32_t> order(n);
  for (;;) {
    for (uint32_t t = 0; t < n; ++t) order[t] = t;
    for (uint32_t t = n - 1; t > 0; --t) {
      const uint32_t k = static_cast<uint32_t>(NextRandom(e.rng) % (t + 1));
      std::swap(order[t], order[k]);
    }
    for (uint32_t t : order) {
      if (e.fibers[t]->state == State::kRunnable) RunFiber(*e.fibers[t]);
    }
    // Every fiber is now done or waiting at a barrier.
    uint32_t done = 0, at_block = 0;
    for (uint32_t t = 0; t < n; ++t) {
      done += e.fibers[t]->state == State::kDone;
      at_block += e.fibers[t]->state == State::kBlockBarrier;
    }
    if (done == n) return;
    bool released = false;
    if (at_block == n) {
      bool any = false;
      for (uint32_t t = 0; t < n; ++t) any |= e.fibers[t]->predicate;
      for (uint32_t t = 0; t < n; ++t) {
        e.fibers[t]->predicate = any;
        e.fibers[t]->state = State::kRunnable;
      }
      released = true;
    } else if (at_block > 0 && at_block + done == n) {
      Die("__syncthreads reached by only some threads of a block (others returned)");
    }
    for (uint32_t w = 0; w < n / 32; ++w) {
      Fiber* lanes[32];
      int waiting = 0;
      for (int l = 0; l < 32; ++l) {
        lanes[l] = e.fibers[w * 32 + l].get();
        waiting += lanes[l]->state == State::kWarpCollective;
      }
      if (waiting == 32) {
        ReleaseWarp(lanes);
        released = true;
      }
    }
    // A warp collective that some lanes skipped (they returned or sit at __syncthreads) can never
    // complete, and neither can that __syncthreads.
    if (!released) Die("deadlock: threads wait at barriers that can never complete");
  }
}

}  // namespace

uint32_t ThreadIndex() {
  Fiber* f = E().current;
  if (f == nullptr) Die("threadIdx read outside a kernel");
  return f->tid;
}
uint32_t BlockThreads() { return E().threads; }
uint64_t BlockIndex() { return E().block; }

void SyncThreads() {
  E().current->predicate = false;
  Yield(State::kBlockBarrier);
}

bool SyncThreadsOr(bool predicate) {
  Fiber* f = E().current;
  if (f == nullptr) Die("__syncthreads_or outside a kernel");
  f->predicate = predicate;
  Yield(State::kBlockBarrier);
  return f->predicate;
}

void WarpShuffle(const void* in, void* out, size_t bytes, ShuffleKind kind, int delta) {
  Fiber* f = E().current;
  if (f == nullptr) Die("warp shuffle outside a kernel");
  if (bytes > sizeof f->in || delta < 0 || delta > 31) Die("bad warp shuffle");
  f->op = kind == kShuffleUp ? Op::kShuffleUp : Op::kShuffleDown;
  f->delta = delta;
  f->bytes = bytes;
  std::memcpy(f->in, in, bytes);
  Yield(State::kWarpCollective);
  std::memcpy(out, f->out, bytes);
}

uint32_t WarpReduceAdd(uint32_t v) {
  Fiber* f = E().current;
  if (f == nullptr) Die("warp reduction outside a kernel");
  f->op = Op::kReduceAdd;
  f->delta = 0;
  f->bytes = 4;
  std::memcpy(f->in, &v, 4);
  Yield(State::kWarpCollective);
  uint32_t r;
  std::memcpy(&r, f->out, 4);
  return r;
}

void Launch(uint64_t grid, uint32_t block, const std::function<void()>& body) {
  if (block == 0 || block % 32 != 0 || block > kMaxThreads) Die("bad block size");
  Emulator& e = E();
  if (e.current != nullptr) Die("kernel launch from inside a kernel");
  std::lock_guard<std::mutex> lock(e.mu);
  while (e.fibers.size() < block) e.fibers.push_back(std::make_unique<Fiber>());
  if (const char* seed = std::getenv("REFIT_EMU_SEED")) {
    if (e.switches == 0) e.rng = std::strtoull(seed, nullptr, 0) | 1;
  }
  e.threads = block;
  e.body = &body;
  for (uint64_t b = 0; b < grid; ++b) {
    e.block = b;
    RunBlock(e);
  }
  e.body = nullptr;
}

uint64_t SwitchCount() { return E().switches; }

}  // namespace refit::cuda::emu
