// arena.h: offsets within one fixed block of memory, handed out and taken back.
//
// Every device arena (host-simulated or cudaMalloc'ed) and the pinned host pool is one
// allocation made up front and carved by an Arena, so capacity is exact and a failure
// names the cap. Best fit over a free list ordered by offset; neighbours coalesce on
// release. Thread-safe. The arena never touches the memory it describes.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

namespace strata {

struct ArenaStats {
  uint64_t capacity = 0;
  uint64_t in_use = 0;
  uint64_t high_water = 0;
  uint64_t largest_free = 0;
  uint64_t allocations = 0;  // live
};

class Arena {
 public:
  // `name` names the arena in errors ("device host:0"), `remedy` says what to do when it is
  // full ("raise --device-memory or lower the micro-batch").
  Arena(uint64_t capacity, uint64_t alignment, std::string name, std::string remedy);

  // Returns the offset of a block of at least `bytes` (rounded up to the alignment).
  // Throws Error naming the arena, `what`, the request, the cap and the free space.
  uint64_t allocate(uint64_t bytes, std::string_view what);
  // Returns a block by the offset allocate() gave; throws Error on an unknown offset.
  void release(uint64_t offset);
  ArenaStats stats() const;
  const std::string& name() const { return name_; }

 private:
  uint64_t capacity_, alignment_;
  std::string name_, remedy_;
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_;  // offset -> size
  std::map<uint64_t, uint64_t> used_;  // offset -> size
  uint64_t in_use_ = 0, high_water_ = 0;
};

}  // namespace strata
