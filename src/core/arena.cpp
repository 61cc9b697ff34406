#include "core/arena.h"

#include "core/bytes.h"
#include "core/error.h"

#include <algorithm>

namespace strata {

Arena::Arena(uint64_t capacity, uint64_t alignment, std::string name, std::string remedy)
    : capacity_(capacity),
      alignment_(alignment),
      name_(std::move(name)),
      remedy_(std::move(remedy)) {
  if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0)
    fail("{}: arena alignment {} is not a power of two", name_, alignment_);
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::parameters:
      return "parameters";
    case MemoryKind::gathered:
      return "gathered";
    case MemoryKind::gradients:
      return "gradients";
    case MemoryKind::optimizer:
      return "optimizer";
    case MemoryKind::activations:
      return "activations";
    case MemoryKind::communication:
      return "communication";
    case MemoryKind::other:
      return "other";
  }
  return "unknown";
}

uint64_t Arena::allocate(uint64_t bytes, std::string_view what, MemoryKind kind) {
  const auto k = static_cast<size_t>(kind);
  if (k >= static_cast<size_t>(kMemoryKinds))
    fail("{}: allocation of {} for {} has memory kind {}, which is not one of the {} kinds", name_,
         format_bytes(bytes), what, k, kMemoryKinds);
  const uint64_t size =
      std::max<uint64_t>(alignment_, (bytes + alignment_ - 1) & ~(alignment_ - 1));
  std::lock_guard lock(mutex_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
  if (best == free_.end() || bytes > capacity_) {
    uint64_t largest = 0;
    for (auto& [off, sz] : free_) largest = std::max(largest, sz);
    // What holds the memory, so the user knows which knob to turn.
    std::string held;
    for (int i = 0; i < kMemoryKinds; ++i)
      if (by_kind_[static_cast<size_t>(i)] > 0)
        held += fmt::format("{}{} {}", held.empty() ? "" : ", ",
                            memory_kind_name(static_cast<MemoryKind>(i)),
                            format_bytes(by_kind_[static_cast<size_t>(i)]));
    fail(
        "{}: out of memory allocating {} for {}: cap {}, in use {}{}{}{}, free {} (largest free "
        "block {}); {}",
        name_, format_bytes(bytes), what, format_bytes(capacity_), format_bytes(in_use_),
        held.empty() ? "" : " (", held, held.empty() ? "" : ")", format_bytes(capacity_ - in_use_),
        format_bytes(largest), remedy_);
  }
  const uint64_t offset = best->first;
  const uint64_t remaining = best->second - size;
  free_.erase(best);
  if (remaining > 0) free_.emplace(offset + size, remaining);
  used_.emplace(offset, Block{size, kind});
  in_use_ += size;
  by_kind_[k] += size;
  peak_by_kind_[k] = std::max(peak_by_kind_[k], by_kind_[k]);
  if (in_use_ >= high_water_) {
    high_water_ = in_use_;
    high_water_by_kind_ = by_kind_;
  }
  return offset;
}

void Arena::release(uint64_t offset) {
  std::lock_guard lock(mutex_);
  auto it = used_.find(offset);
  if (it == used_.end())
    fail("{}: release of offset {} that was never allocated (or released twice)", name_, offset);
  uint64_t start = offset, size = it->second.size;
  by_kind_[static_cast<size_t>(it->second.kind)] -= size;
  used_.erase(it);
  in_use_ -= size;
  auto next = free_.lower_bound(start);
  if (next != free_.end() && start + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

ArenaStats Arena::stats() const {
  std::lock_guard lock(mutex_);
  ArenaStats s;
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.high_water = high_water_;
  s.allocations = used_.size();
  s.in_use_by_kind = by_kind_;
  s.peak_by_kind = peak_by_kind_;
  s.high_water_by_kind = high_water_by_kind_;
  for (auto& [off, sz] : free_) s.largest_free = std::max(s.largest_free, sz);
  return s;
}

}  // namespace strata
