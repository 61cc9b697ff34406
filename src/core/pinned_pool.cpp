// pinned_pool.cpp: the one-time allocation behind PinnedPool and its fallbacks.
//
// The `ulimit -l` check is done here, before mlock, from RLIMIT_MEMLOCK and what the process
// has locked already, so the outcome does not depend on the kernel's accounting. Only a
// process with CAP_IPC_LOCK (root, usually) skips it, because mlock ignores the limit then.
#include "core/pinned_pool.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/system.h"
#include "core/topology.h"
#include "gpu/runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <optional>

namespace strata {
namespace {

std::atomic<uint64_t> g_pools_created{0};

constexpr const char* kName = "pinned pool";
constexpr const char* kRemedy =
    "raise the pinned pool size (--cpu-memory) or lower the buffer sizes (prefetch depth, "
    "micro-batch)";

uint64_t round_to_pages(uint64_t bytes) {
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t unit = page > PinnedPool::kAlignment ? page : PinnedPool::kAlignment;
  return (bytes + unit - 1) / unit * unit;
}

std::string limit_text(uint64_t limit) {
  return limit == kUnlimited ? "unlimited" : format_bytes(limit);
}

[[noreturn]] void fail_ram(uint64_t capacity, const MemoryInfo& mem, std::string_view why) {
  fail(
      "pinned pool: cannot allocate {} of host memory{}: MemAvailable is {} (MemTotal {}); "
      "lower --cpu-memory or the buffer sizes (prefetch depth, micro-batch), or free memory",
      format_bytes(capacity), why, format_bytes(mem.available), format_bytes(mem.total));
}

// Why mlock of `bytes` would be refused by `ulimit -l`, or nothing when it is allowed.
std::optional<std::string> memlock_refusal(uint64_t bytes) {
  if (can_lock_past_limit()) return std::nullopt;
  const uint64_t limit = memlock_limit();
  if (limit == kUnlimited) return std::nullopt;
  const uint64_t locked = locked_bytes();
  if (locked <= limit && bytes <= limit - locked) return std::nullopt;
  std::string text = "ulimit -l is " + format_bytes(limit);
  if (locked > 0) text += " and " + format_bytes(locked) + " is locked already";
  return text;
}

}  // namespace

std::string_view pinning_name(Pinning p) {
  switch (p) {
    case Pinning::cuda:
      return "cuda";
    case Pinning::locked:
      return "locked";
    case Pinning::unlocked:
      return "unlocked";
  }
  return "unknown";
}

PinnedPool::PinnedPool(const PinnedPoolOptions& options)
    : capacity_(round_to_pages(options.capacity)), arena_(capacity_, kAlignment, kName, kRemedy) {
  if (options.capacity == 0)
    fail(
        "pinned pool: capacity is 0 bytes; give it the size of the transfer buffers it serves "
        "(for example --cpu-memory 8GiB)");
  const MemoryInfo mem = memory_info();
  if (capacity_ > mem.available) fail_ram(capacity_, mem, "");
  g_pools_created.fetch_add(1);

  // 1. With a CUDA device: cudaHostAlloc, placed on the GPU's node by binding this thread.
  if (options.cuda) {
    std::optional<ThreadMemoryBinding> binding;
    if (options.numa_node >= 0) binding.emplace(options.numa_node);
    if (void* p = cuda_host_alloc(capacity_)) {
      base_ = static_cast<char*>(p);
      pinning_ = Pinning::cuda;
      if (binding && !binding->error().empty())
        warn_once("pinned-pool-numa", "pinned pool: not placed on NUMA node {}: {}",
                  options.numa_node, binding->error());
      return;
    }
  }

  // 2. Without: anonymous pages, bound to the node before they are touched, then locked.
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) fail_ram(capacity_, mem, " (mmap: out of memory)");
    fail("pinned pool: mmap of {} failed: {}; lower --cpu-memory or the buffer sizes",
         format_bytes(capacity_), errno_text(err));
  }
  base_ = static_cast<char*>(p);
  if (options.numa_node >= 0) {
    std::string why;
    try {
      why = bind_memory_to_numa_node(p, capacity_, options.numa_node);
    } catch (...) {
      munmap(p, capacity_);
      throw;
    }
    if (!why.empty())
      warn_once("pinned-pool-numa", "pinned pool: not placed on NUMA node {}: {}",
                options.numa_node, why);
  }

  std::optional<std::string> refusal = memlock_refusal(capacity_);
  if (!refusal) {
    if (mlock(p, capacity_) == 0) {
      pinning_ = Pinning::locked;
      return;
    }
    const int err = errno;
    refusal = "mlock: " + errno_text(err) + " (ulimit -l is " + limit_text(memlock_limit()) + ")";
  }
  if (options.require_locked) {
    munmap(p, capacity_);
    base_ = nullptr;
    fail(
        "pinned pool: cannot lock {}: {}; raise it (ulimit -l unlimited, or memlock in "
        "/etc/security/limits.conf) or set pin_memory false",
        format_bytes(capacity_), *refusal);
  }
  warn_once("pinned-pool-unlocked",
            "pinned pool: using {} of unlocked memory (cannot lock it: {}); transfers will be "
            "slower; raise ulimit -l (unlimited, or memlock in /etc/security/limits.conf)",
            format_bytes(capacity_), *refusal);
  pinning_ = Pinning::unlocked;
}

PinnedPool::~PinnedPool() {
  if (base_ == nullptr) return;
  if (pinning_ == Pinning::cuda)
    cuda_host_free(base_);
  else
    munmap(base_, capacity_);  // also unlocks
}

uint64_t PinnedPool::pools_created() {
  return g_pools_created.load();
}

void* PinnedPool::allocate(uint64_t bytes, std::string_view what) {
  char* p = base_ + arena_.allocate(bytes, what);
  allocations_made_.fetch_add(1);
  return p;
}

void PinnedPool::release(void* ptr) {
  const auto* p = static_cast<const char*>(ptr);
  if (p < base_ || p >= base_ + capacity_)
    fail(
        "pinned pool: release of {} which is not in the pool ({} bytes at {}); release only "
        "what this pool's allocate() returned",
        ptr, capacity_, static_cast<const void*>(base_));
  arena_.release(static_cast<uint64_t>(p - base_));
}

}  // namespace strata
