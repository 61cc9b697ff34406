// pinned_pool.h: the one block of page-locked host memory that every host<->GPU and
// NVMe transfer buffer is carved from (DESIGN §3: "allocated once and reused").
//
// The block is allocated in the constructor: cudaHostAlloc when a CUDA device exists,
// otherwise page-aligned anonymous memory, mlock'ed when `ulimit -l` allows. Sub-blocks
// come from an Arena (4 KiB aligned, so they also serve as O_DIRECT buffers); nothing is
// allocated from the system after construction. Whether the memory really is pinned is
// reported by pinning(): unlocked memory still works, but copies from it are synchronous
// and its pages may be swapped out. Thread-safe.
#pragma once

#include "core/arena.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

enum class Pinning {
  cuda,     // cudaHostAlloc: pinned and registered with the CUDA driver
  locked,   // mmap + mlock: resident, but not registered with CUDA
  unlocked  // mmap only: `ulimit -l` was too low and require_locked was false
};
std::string_view pinning_name(Pinning p);  // "cuda", "locked", "unlocked"

struct PinnedPoolOptions {
  uint64_t capacity = 0;        // bytes; rounded up to whole pages
  bool require_locked = false;  // true: throw rather than fall back to unlocked memory
  int numa_node = -1;           // os index of the node to place the pool on; -1: anywhere
  bool cuda = true;             // false: never cudaHostAlloc (runs on host devices only)
};

class PinnedPool {
 public:
  static constexpr uint64_t kAlignment = 4096;

  // Throws Error when RAM cannot hold `capacity` (naming MemAvailable), and, with
  // require_locked, when `ulimit -l` refuses to lock it (naming the limit).
  explicit PinnedPool(const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A 4 KiB-aligned block of at least `bytes`; throws Error naming the pool's capacity
  // when it does not fit. `what` names the buffer in that error.
  void* allocate(uint64_t bytes, std::string_view what);
  // Returns a block allocate() gave; throws Error on a pointer it did not give.
  void release(void* ptr);

  // How often allocate() has handed out a block since construction (released ones included):
  // a trainer whose buffers are allocated once sees this stay the same from step to step.
  uint64_t allocations_made() const { return allocations_made_.load(); }
  // PinnedPools constructed in this process so far: each is one request to the system for
  // page-locked memory (cudaHostAlloc or mmap + mlock).
  static uint64_t pools_created();

  Pinning pinning() const { return pinning_; }
  void* base() const { return base_; }  // for registering the whole pool with io_uring
  uint64_t capacity() const { return capacity_; }
  ArenaStats stats() const { return arena_.stats(); }

 private:
  uint64_t capacity_ = 0;
  char* base_ = nullptr;
  Pinning pinning_ = Pinning::unlocked;
  Arena arena_;
  std::atomic<uint64_t> allocations_made_{0};
};

}  // namespace strata
