// kernel.cpp (CUDA emulator): kernels run as fibers, one thread block at a time.
//
// launch_grid checks the configuration as the GPU does (sizes, the dynamic shared memory
// against 48 KiB or the kernel's cudaFuncSetAttribute limit) and queues the grid on the stream.
// On the stream's worker thread each block gets one fiber per CUDA thread. The scheduler runs
// every runnable fiber until it blocks (at __syncthreads or a shuffle) or returns, then:
// - completes the shuffles of every warp whose lanes named in the mask have all arrived;
// - otherwise, if every live thread waits at __syncthreads, releases them all;
// - otherwise the block cannot go on (a barrier some threads never reach while others wait in
//   a shuffle, a shuffle whose lanes are not all there): a Fault naming the kernel's block and
//   threads, which the runtime turns into a sticky launch failure, as a hung or trapped kernel
//   would be on a GPU.
// - completes the warp-wide operations (wmma loads, stores and products) of every warp whose 32
//   lanes have all arrived at the same one, running it once for the warp;
// Threads that have returned do not hold up a barrier (as on sm_70 and later).
//
// Fibers switch with a few instructions on x86-64 (callee-saved registers and the stack
// pointer; no signal-mask system call as swapcontext makes), with ucontext elsewhere.
#include "emu_internal.h"

#include <cuda_runtime.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_emu {

thread_local const ThreadCoords* current_coords = nullptr;

namespace {

// STRATA_EMU_PROFILE=1: each kernel's launches, blocks and time on the workers, printed on
// stderr at exit, the longest first: where an emulated suite's minutes go.
struct KernelProfile {
  uint64_t launches = 0, blocks = 0, threads = 0;
  double seconds = 0;
};

class Profile {
 public:
  static Profile& get() {
    static Profile p;
    return p;
  }
  bool on() const { return on_; }
  void add(const std::string& kernel, uint64_t blocks, uint64_t threads, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    KernelProfile& k = kernels_[kernel];
    ++k.launches;
    k.blocks += blocks;
    k.threads += threads;
    k.seconds += seconds;
  }
  ~Profile() {
    if (!on_) return;
    std::vector<std::pair<std::string, KernelProfile>> rows(kernels_.begin(), kernels_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    double total = 0;
    for (const auto& [name, k] : rows) total += k.seconds;
    std::fprintf(stderr, "cuda_emu profile: %.3f s in kernels\n", total);
    std::fprintf(stderr, "%10s %10s %12s %14s %9s  %s\n", "seconds", "launches", "blocks",
                 "threads", "us/block", "kernel");
    for (const auto& [name, k] : rows)
      std::fprintf(
          stderr, "%10.3f %10llu %12llu %14llu %9.2f  %s\n", k.seconds,
          static_cast<unsigned long long>(k.launches), static_cast<unsigned long long>(k.blocks),
          static_cast<unsigned long long>(k.threads),
          k.blocks == 0 ? 0.0 : 1e6 * k.seconds / static_cast<double>(k.blocks), name.c_str());
  }

 private:
  Profile() {
    const char* v = std::getenv("STRATA_EMU_PROFILE");
    on_ = v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }
  bool on_ = false;
  std::mutex mutex_;
  std::map<std::string, KernelProfile> kernels_;
};

constexpr size_t kStackBytes = size_t{128} << 10;
constexpr unsigned kMaxThreads = 1024;
constexpr size_t kDefaultSharedLimit = 48 << 10;
// How far below its stack's end thread `t`'s stack starts: a multiple of 9 cache lines that
// differs between neighbouring threads (16-byte aligned; at most 35 KiB). Stacks 128 KiB apart
// would otherwise put every thread's hot frames in the same set of each cache, and every switch
// missed them (80% of the switch's time, which was a third of the emulator's).
constexpr size_t stack_colour(size_t t) {
  return (t % 64) * 9 * 64;
}

#if defined(__x86_64__)
// switch_stack(&save, next): pushes the callee-saved registers, stores the stack pointer in
// *save, loads `next` and pops the same from there. The SSE and x87 control words are not
// switched: every fiber runs in its worker thread's floating-point environment, since no kernel
// changes a rounding mode.
extern "C" void cuda_emu_switch_stack(void** save, void* next);
asm(R"(
  .text
  .globl cuda_emu_switch_stack
  .type cuda_emu_switch_stack, @function
cuda_emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch_stack, .-cuda_emu_switch_stack
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

enum class State { kRunnable, kAtBarrier, kAtShuffle, kAtCollective, kDone };

struct Fiber {
  ThreadCoords coords;
  State state = State::kRunnable;
  unsigned lane = 0, warp = 0;
  // The shuffle this thread waits in.
  unsigned mask = 0;
  int param = 0, width = 32;
  bool xor_mode = false;
  uint64_t bits = 0, result = 0;
  // The warp-wide operation this thread waits in, and its own argument to it.
  WarpOp op = nullptr;
  void* op_arg = nullptr;
  const char* op_name = nullptr;
  char* stack = nullptr;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

// One worker thread's block in flight.
struct Block {
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  Fiber* running = nullptr;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler;
#endif
  // Dynamic shared memory: `dynamic_bytes` from `dynamic_base`, which is 128-byte aligned (as
  // a GPU's shared window is; `extern __shared__ __align__(128)` asks for no more).
  std::vector<unsigned char> dynamic_shared;
  unsigned char* dynamic_base = nullptr;
  size_t dynamic_bytes = 0;
  // Static shared variables: offsets into a fixed 48 KiB (a GPU's static limit), assigned at a
  // variable's first use in the launch; the used prefix is poisoned again at every block.
  std::map<const void*, size_t> static_offsets;
  std::vector<unsigned char> static_shared;
  size_t static_used = 0, shared_limit = 0;
  std::exception_ptr error;
  std::string kernel_name;
  // The scheduler's pass over the fibers: its order, and the position in it from which
  // next_in_pass looks for the next runnable fiber.
  bool pass_reverse = false;
  size_t pass_pos = 0;
  // How many fibers wait at a barrier, in a warp-wide operation, or have returned; and per
  // warp, how many lanes wait in a shuffle or have returned. Kept as the states change, so the
  // scheduler needs no pass over the fibers to know whether anything waits.
  unsigned at_barrier = 0, at_collective = 0, done = 0, at_shuffle = 0;
  std::vector<unsigned> warp_at_shuffle, warp_done;
};

thread_local Block* current_block = nullptr;

// The fibers' stacks: one mapping per worker thread, grown to the largest block it has run and
// unmapped when the thread exits (untouched pages cost nothing). No guard pages (a mapping
// each would soon exhaust the process's map count with many streams); instead the lowest
// bytes of every stack hold a canary that run_block checks after each block.
constexpr uint64_t kCanary = 0x5a17c0de5a17c0deull;
constexpr size_t kCanaryWords = 8;

class StackPool {
 public:
  ~StackPool() {
    if (region_ != nullptr) munmap(region_, count_ * kStackBytes);
  }
  // Stacks [0, n), canaries set.
  void reserve(unsigned n) {
    if (n > count_) {
      if (region_ != nullptr) munmap(region_, count_ * kStackBytes);
      region_ = nullptr;
      count_ = 0;
      void* p = mmap(nullptr, n * kStackBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED)
        throw Fault("cannot map fiber stacks for " + std::to_string(n) + " threads");
      region_ = static_cast<char*>(p);
      count_ = n;
    }
    for (unsigned i = 0; i < n; ++i)
      for (size_t w = 0; w < kCanaryWords; ++w)
        std::memcpy(stack(i) + w * sizeof kCanary, &kCanary, sizeof kCanary);
  }
  char* stack(unsigned i) const { return region_ + size_t{i} * kStackBytes; }
  bool intact(unsigned i) const {
    for (size_t w = 0; w < kCanaryWords; ++w)
      if (std::memcmp(stack(i) + w * sizeof kCanary, &kCanary, sizeof kCanary) != 0) return false;
    return true;
  }

 private:
  char* region_ = nullptr;
  size_t count_ = 0;
};

thread_local StackPool stacks;

// The next runnable fiber of the scheduler's pass from position b.pass_pos on (moving pass_pos
// past it), or null at the end of the pass or once a fiber has failed.
Fiber* next_in_pass(Block& b) {
  if (b.error) return nullptr;
  const size_t n = b.fibers.size();
  for (size_t k = b.pass_pos; k < n; ++k) {
    Fiber& f = b.fibers[b.pass_reverse ? n - 1 - k : k];
    if (f.state == State::kRunnable) {
      b.pass_pos = k + 1;
      return &f;
    }
  }
  return nullptr;
}

// Leaves fiber `f` (blocked or returned) for the next runnable fiber of the pass, directly, or
// for the scheduler at the end of the pass: one switch per fiber a pass, where going through
// the scheduler each time took two (the switches were half the emulator's time).
void leave_fiber(Fiber& f) {
  Block& b = *current_block;
  Fiber* next = next_in_pass(b);
  b.running = next;
  current_coords = next != nullptr ? &next->coords : nullptr;  // a new fiber starts with them
  if (next == &f) return;  // its own shuffle just completed, and it is next in the pass
#if defined(__x86_64__)
  cuda_emu_switch_stack(&f.sp, next != nullptr ? next->sp : b.scheduler_sp);
#else
  swapcontext(&f.context, next != nullptr ? &next->context : &b.scheduler);
#endif
  current_coords = &f.coords;
}

[[noreturn]] void fiber_main() {
  Block& b = *current_block;
  Fiber& f = *b.running;
  try {
    (*b.body)();
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  f.state = State::kDone;
  ++b.done;
  ++b.warp_done[f.warp];
  leave_fiber(f);
  std::abort();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
void fiber_entry_ucontext() {
  fiber_main();
}
#endif

void start_fiber(Block& b, Fiber& f) {
#if defined(__x86_64__)
  // The new stack, from its top: a slot keeping the ABI's alignment at fiber_main's entry, the
  // address `ret` jumps to, then six zeroed registers; the top moved down by stack_colour.
  const size_t thread = size_t{f.warp} * 32 + f.lane;
  auto* top = reinterpret_cast<uint64_t*>(f.stack + kStackBytes - stack_colour(thread));
  uint64_t* sp = top - 1;
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  f.sp = sp;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, &fiber_entry_ucontext, 0);
#endif
  (void)b;
}

// Runs one pass over the block's fibers in the order `reverse` says: every runnable fiber, each
// until it blocks or returns, chained by leave_fiber. False when none was runnable.
bool run_pass(Block& b, bool reverse) {
  b.pass_reverse = reverse;
  b.pass_pos = 0;
  Fiber* first = next_in_pass(b);
  if (first == nullptr) return false;
  Fiber& f = *first;
  b.running = &f;
  current_coords = &f.coords;
#if defined(__x86_64__)
  cuda_emu_switch_stack(&b.scheduler_sp, f.sp);
#else
  swapcontext(&b.scheduler, &f.context);
#endif
  current_coords = nullptr;
  return true;
}

std::string where(const Block& b, const Fiber& f) {
  const ThreadCoords& c = f.coords;
  return b.kernel_name + " block (" + std::to_string(c.block_idx.x) + "," +
         std::to_string(c.block_idx.y) + "," + std::to_string(c.block_idx.z) + ") thread (" +
         std::to_string(c.thread_idx.x) + "," + std::to_string(c.thread_idx.y) + "," +
         std::to_string(c.thread_idx.z) + ")";
}

// Completes the shuffle of warp `w` if the lanes its waiting lanes name have all arrived;
// false otherwise. The warp's lanes are summed up once as masks (waiting in a shuffle,
// returned, present), so a round costs one pass over the warp rather than 32 checks per lane.
bool complete_warp_shuffle(Block& b, unsigned w) {
  const auto n = static_cast<unsigned>(b.fibers.size());
  const unsigned first = w * 32, last = std::min(n, first + 32);
  unsigned at_shuffle = 0, done = 0, named = 0;  // named: the lanes the waiters' masks name
  for (unsigned i = first; i < last; ++i) {
    const Fiber& f = b.fibers[i];
    if (f.state == State::kAtShuffle) {
      at_shuffle |= 1u << (i - first);
      named |= f.mask;
    }
    if (f.state == State::kDone) done |= 1u << (i - first);
  }
  if (at_shuffle == 0) return false;
  // Whether every live lane the waiting lanes' masks name waits too (CUDA asks that of the
  // non-exited lanes of the mask; a lane that has returned, or that the block does not have,
  // is only an error if some lane reads from it).
  const unsigned present = last - first == 32 ? ~0u : (1u << (last - first)) - 1;
  const bool complete = (named & present & ~(at_shuffle | done)) == 0;
  if (!complete) return false;
  for (unsigned i = first; i < last; ++i) {
    Fiber& f = b.fibers[i];
    if (f.state != State::kAtShuffle) continue;
    if (f.width <= 0 || f.width > 32 || (f.width & (f.width - 1)) != 0)
      throw Fault(where(b, f) + ": shuffle width " + std::to_string(f.width) +
                  " is not a power of two up to 32");
    const auto width = static_cast<unsigned>(f.width);
    const unsigned segment = f.lane & ~(width - 1);
    unsigned source = segment + static_cast<unsigned>(f.param) % width;
    if (f.xor_mode) {
      // A lane may read from its own group of `width` lanes or an earlier one; past the end
      // of its group it gets its own value back (PTX shfl.bfly).
      source = f.lane ^ static_cast<unsigned>(f.param);
      if (source > segment + width - 1) source = f.lane;
    }
    if (first + source >= last)
      throw Fault(where(b, f) + ": shuffle reads lane " + std::to_string(source) +
                  ", which the block does not have");
    const Fiber& s = b.fibers[first + source];
    if (s.state != State::kAtShuffle || !(f.mask >> source & 1u))
      throw Fault(where(b, f) + ": shuffle reads lane " + std::to_string(source) +
                  ", which is not taking part (mask " + std::to_string(f.mask) + ")");
    f.result = s.bits;
  }
  for (unsigned i = first; i < last; ++i)
    if (b.fibers[i].state == State::kAtShuffle) b.fibers[i].state = State::kRunnable;
  b.at_shuffle -= b.warp_at_shuffle[w];
  b.warp_at_shuffle[w] = 0;
  return true;
}

// Completes the shuffles of every warp whose participants have all arrived; false when none.
bool complete_shuffles(Block& b) {
  bool any = false;
  if (b.at_shuffle == 0) return false;
  for (unsigned w = 0; w < b.warp_at_shuffle.size(); ++w)
    if (b.warp_at_shuffle[w] != 0 && complete_warp_shuffle(b, w)) any = true;
  return any;
}

// Runs the warp-wide operation of every warp whose 32 lanes all wait in it; false when none.
// Such an operation (wmma) needs the whole warp: a lane that has returned, a warp the block
// does not fill, or lanes waiting in different operations are faults, as they would hang or
// give undefined results on a GPU.
bool complete_collectives(Block& b) {
  bool any = false;
  if (b.at_collective == 0) return false;
  const auto n = static_cast<unsigned>(b.fibers.size());
  for (unsigned w = 0; w * 32 < n; ++w) {
    const unsigned first = w * 32, last = std::min(n, first + 32);
    const Fiber* waiting = nullptr;
    bool complete = true;
    for (unsigned i = first; i < last; ++i) {
      const Fiber& f = b.fibers[i];
      if (f.state == State::kAtCollective) {
        if (waiting == nullptr) waiting = &f;
      } else {
        complete = false;
      }
    }
    if (waiting == nullptr) continue;
    if (last - first < 32)
      throw Fault(where(b, *waiting) + ": " + waiting->op_name + " in a warp of " +
                  std::to_string(last - first) + " threads; it needs all 32 lanes");
    for (unsigned i = first; i < last; ++i)
      if (b.fibers[i].state == State::kDone)
        throw Fault(where(b, *waiting) + ": " + waiting->op_name + " while lane " +
                    std::to_string(i - first) + " of the warp has returned; it needs all 32");
    if (!complete) continue;
    void* args[32];
    for (unsigned i = first; i < last; ++i) {
      const Fiber& f = b.fibers[i];
      if (f.op != waiting->op || std::strcmp(f.op_name, waiting->op_name) != 0)
        throw Fault(where(b, f) + ": lanes of one warp wait in different warp-wide operations (" +
                    f.op_name + " and " + waiting->op_name + ")");
      args[i - first] = f.op_arg;
    }
    try {
      waiting->op(args);
    } catch (const std::exception& e) {
      throw Fault(where(b, *waiting) + ": " + waiting->op_name + ": " + e.what());
    }
    for (unsigned i = first; i < last; ++i) b.fibers[i].state = State::kRunnable;
    b.at_collective -= last - first;
    any = true;
  }
  return any;
}

// `reverse`: the block starts with its last thread. Between two barriers a GPU runs a block's
// threads in no fixed order, so neither order may change a correct kernel's result; the
// order alternates from block to block and from barrier to barrier, so that a kernel missing
// a barrier (a thread reading shared memory another has yet to write) gets the wrong answer
// here in some block instead of the right one by luck.
void run_block(Block& b, bool reverse) {
  for (;;) {
    const bool ran = run_pass(b, reverse);
    if (b.error) std::rethrow_exception(b.error);
    reverse = !reverse;
    const bool shuffled = complete_shuffles(b);
    if (complete_collectives(b) || shuffled) continue;
    const size_t live = b.fibers.size() - b.done;
    if (live == 0) return;
    if (b.at_barrier == live) {
      for (Fiber& f : b.fibers)
        if (f.state == State::kAtBarrier) f.state = State::kRunnable;
      b.at_barrier = 0;
      continue;
    }
    if (!ran) {
      const Fiber* stuck = nullptr;
      for (const Fiber& f : b.fibers)
        if (f.state != State::kDone && f.state != State::kAtBarrier) stuck = &f;
      throw Fault(where(b, *stuck) +
                  " waits in a warp shuffle or a warp-wide operation that other threads of its "
                  "warp never reach (they wait at __syncthreads or elsewhere): the block would "
                  "hang on a GPU");
    }
  }
}

}  // namespace

void syncthreads() {
  Block* b = current_block;
  if (b == nullptr || b->running == nullptr) throw Fault("__syncthreads outside a kernel");
  Fiber& f = *b->running;
  f.state = State::kAtBarrier;
  ++b->at_barrier;
  leave_fiber(f);
}

uint64_t shuffle(unsigned mask, uint64_t bits, int param, int width, bool xor_mode) {
  Block* b = current_block;
  if (b == nullptr || b->running == nullptr) throw Fault("a warp shuffle outside a kernel");
  Fiber& f = *b->running;
  if (!(mask >> f.lane & 1u))
    throw Fault(where(*b, f) + ": the shuffle's mask leaves out the calling lane");
  f.state = State::kAtShuffle;
  f.mask = mask;
  f.bits = bits;
  f.param = param;
  f.width = width;
  f.xor_mode = xor_mode;
  ++b->at_shuffle;
  // The last of its warp's lanes to arrive completes the shuffle at once, and the pass goes
  // back to the warp's first lane: a warp runs on through its shuffles while its lanes' stacks
  // are warm, instead of one shuffle per pass over the whole block.
  const unsigned w = f.warp,
                 lanes = std::min(32u, static_cast<unsigned>(b->fibers.size()) - w * 32);
  if (++b->warp_at_shuffle[w] + b->warp_done[w] == lanes && complete_warp_shuffle(*b, w)) {
    const size_t n = b->fibers.size();
    const size_t first = b->pass_reverse ? n - (w * 32 + lanes) : w * 32;
    b->pass_pos = std::min(b->pass_pos, first);
  }
  leave_fiber(f);
  return f.result;
}

void warp_collective(const char* name, WarpOp op, void* arg) {
  Block* b = current_block;
  if (b == nullptr || b->running == nullptr) throw Fault(std::string(name) + " outside a kernel");
  Fiber& f = *b->running;
  f.state = State::kAtCollective;
  f.op = op;
  f.op_arg = arg;
  f.op_name = name;
  ++b->at_collective;
  leave_fiber(f);
}

void* block_shared_bytes(const void* tag, size_t bytes, size_t align) {
  Block* b = current_block;
  if (b == nullptr || b->running == nullptr) throw Fault("__shared__ used outside a kernel");
  if (auto it = b->static_offsets.find(tag); it != b->static_offsets.end())
    return b->static_shared.data() + it->second;
  const size_t offset = (b->static_used + align - 1) / align * align;
  if (offset + bytes > b->static_shared.size() ||
      offset + bytes + b->dynamic_bytes > b->shared_limit)
    throw Fault(where(*b, *b->running) + ": " + std::to_string(offset + bytes) +
                " bytes of static shared memory (with " + std::to_string(b->dynamic_bytes) +
                " dynamic) are over the GPU's limits (48 KiB static, " +
                std::to_string(b->shared_limit) + " in all)");
  std::fill(b->static_shared.begin() + static_cast<std::ptrdiff_t>(offset),
            b->static_shared.begin() + static_cast<std::ptrdiff_t>(offset + bytes), 0xff);
  b->static_offsets.emplace(tag, offset);
  b->static_used = offset + bytes;
  return b->static_shared.data() + offset;
}

void* dynamic_shared_memory() {
  Block* b = current_block;
  if (b == nullptr) throw Fault("extern __shared__ outside a kernel");
  return b->dynamic_bytes == 0 ? nullptr : b->dynamic_base;
}

void launch_grid(const char* name, const void* kernel, const LaunchConfig& c,
                 std::function<void()> body) {
  const int device = stream_device(c.stream);
  if (const cudaError_t sticky = sticky_error(device); sticky != cudaSuccess) {
    set_last_error(sticky);
    return;
  }
  const uint64_t threads = uint64_t{c.block.x} * c.block.y * c.block.z;
  const bool bad_block = threads == 0 || threads > kMaxThreads || c.block.x > 1024 ||
                         c.block.y > 1024 || c.block.z > 64;
  const bool bad_grid = c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 0x7fffffffu ||
                        c.grid.y > 65535 || c.grid.z > 65535;
  if (bad_block || bad_grid) {
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  const auto limit =
      std::max<size_t>(kDefaultSharedLimit, static_cast<size_t>(func_max_dynamic_shared(kernel)));
  const auto optin = static_cast<size_t>(max_shared_per_block_optin(device));
  if (c.shared_bytes > limit || c.shared_bytes > optin) {
    set_last_error(cudaErrorInvalidValue);
    return;
  }
  enqueue(c.stream, [c, optin, body = std::move(body), kernel_name = std::string(name)] {
    Block b;
    b.body = &body;
    b.kernel_name = kernel_name;
    b.fibers.resize(static_cast<size_t>(uint64_t{c.block.x} * c.block.y * c.block.z));
    constexpr size_t kAlign = 128;
    b.dynamic_shared.resize(c.shared_bytes + kAlign);
    const auto address = reinterpret_cast<uintptr_t>(b.dynamic_shared.data());
    b.dynamic_base = b.dynamic_shared.data() + (kAlign - address % kAlign) % kAlign;
    b.dynamic_bytes = c.shared_bytes;
    b.static_shared.resize(kDefaultSharedLimit);
    b.shared_limit = optin;
    stacks.reserve(static_cast<unsigned>(b.fibers.size()));
    Block* const outer = current_block;
    current_block = &b;
    struct Restore {
      Block* outer;
      ~Restore() {
        current_block = outer;
        current_coords = nullptr;
      }
    } restore{outer};
    Profile& profile = Profile::get();
    const auto start =
        profile.on() ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    for (unsigned z = 0; z < c.grid.z; ++z)
      for (unsigned y = 0; y < c.grid.y; ++y)
        for (unsigned x = 0; x < c.grid.x; ++x) {
          std::fill(b.dynamic_base, b.dynamic_base + b.dynamic_bytes, 0xff);
          std::fill(b.static_shared.begin(),
                    b.static_shared.begin() + static_cast<std::ptrdiff_t>(b.static_used), 0xff);
          b.error = nullptr;
          b.at_barrier = b.at_collective = b.done = b.at_shuffle = 0;
          b.warp_at_shuffle.assign((b.fibers.size() + 31) / 32, 0);
          b.warp_done.assign((b.fibers.size() + 31) / 32, 0);
          unsigned i = 0;
          for (unsigned tz = 0; tz < c.block.z; ++tz)
            for (unsigned ty = 0; ty < c.block.y; ++ty)
              for (unsigned tx = 0; tx < c.block.x; ++tx, ++i) {
                Fiber& f = b.fibers[i];
                f.coords.thread_idx = uint3{tx, ty, tz};
                f.coords.block_idx = uint3{x, y, z};
                f.coords.block_dim = c.block;
                f.coords.grid_dim = c.grid;
                f.state = State::kRunnable;
                f.lane = i % 32;
                f.warp = i / 32;
                f.stack = stacks.stack(i);
                start_fiber(b, f);
              }
          run_block(b, (x + y + z) % 2 == 1);
          for (unsigned t = 0; t < b.fibers.size(); ++t)
            if (!stacks.intact(t))
              throw Fault(where(b, b.fibers[t]) + " overflowed its " +
                          std::to_string((kStackBytes - stack_colour(t)) >> 10) +
                          " KiB fiber stack");
        }
    if (profile.on()) {
      const uint64_t blocks = uint64_t{c.grid.x} * c.grid.y * c.grid.z;
      profile.add(kernel_name, blocks, blocks * b.fibers.size(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  });
}

}  // namespace cuda_emu
