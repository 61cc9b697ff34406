// arena.h: offsets within one fixed block of memory, handed out and taken back.
//
// Every device arena (host-simulated or cudaMalloc'ed) and the pinned host pool is one
// allocation made up front and carved by an Arena, so capacity is exact and a failure
// names the cap. Best fit over a free list ordered by offset; neighbours coalesce on
// release. Thread-safe. The arena never touches the memory it describes.
//
// Every block carries a MemoryKind, so a device's high-water mark can be split by what it
// holds (ZeRO-3 shards, gathered working buffers, activations, ...): the question a user asks
// when a placement does not fit.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

namespace strata {

enum class MemoryKind {
  parameters,     // parameter shards (or whole units) at home on the device
  gathered,       // working buffers of all-gathered units (parameters and their gradients)
  gradients,      // gradient accumulators (shards)
  optimizer,      // master weights, Adam moments
  activations,    // activation checkpoints and the model's scratch
  communication,  // collective staging buffers
  other,
};
inline constexpr int kMemoryKinds = 7;
// "parameters", "gathered", ... (the enumerator's name).
std::string_view memory_kind_name(MemoryKind kind);

struct ArenaStats {
  uint64_t capacity = 0;
  uint64_t in_use = 0;
  uint64_t high_water = 0;
  uint64_t largest_free = 0;
  uint64_t allocations = 0;  // live
  // Indexed by MemoryKind. in_use_by_kind sums to in_use. peak_by_kind[k] is kind k's own
  // maximum over time; high_water_by_kind is what was in use, by kind, when in_use last
  // reached high_water (it sums to high_water).
  std::array<uint64_t, kMemoryKinds> in_use_by_kind{};
  std::array<uint64_t, kMemoryKinds> peak_by_kind{};
  std::array<uint64_t, kMemoryKinds> high_water_by_kind{};

  uint64_t in_use_of(MemoryKind k) const { return in_use_by_kind[static_cast<size_t>(k)]; }
  uint64_t peak_of(MemoryKind k) const { return peak_by_kind[static_cast<size_t>(k)]; }
};

class Arena {
 public:
  // `name` names the arena in errors ("device host:0"), `remedy` says what to do when it is
  // full ("raise --device-memory or lower the micro-batch").
  Arena(uint64_t capacity, uint64_t alignment, std::string name, std::string remedy);

  // Returns the offset of a block of at least `bytes` (rounded up to the alignment), counted
  // under `kind`. Throws Error naming the arena, `what`, the request, the cap and the free
  // space.
  uint64_t allocate(uint64_t bytes, std::string_view what, MemoryKind kind = MemoryKind::other);
  // Returns a block by the offset allocate() gave; throws Error on an unknown offset.
  void release(uint64_t offset);
  ArenaStats stats() const;
  const std::string& name() const { return name_; }

 private:
  uint64_t capacity_, alignment_;
  std::string name_, remedy_;
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_;  // offset -> size
  struct Block {
    uint64_t size;
    MemoryKind kind;
  };
  std::map<uint64_t, Block> used_;  // offset -> block
  uint64_t in_use_ = 0, high_water_ = 0;
  std::array<uint64_t, kMemoryKinds> by_kind_{}, peak_by_kind_{}, high_water_by_kind_{};
};

}  // namespace strata
