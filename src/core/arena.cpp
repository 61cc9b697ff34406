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

uint64_t Arena::allocate(uint64_t bytes, std::string_view what) {
  const uint64_t size =
      std::max<uint64_t>(alignment_, (bytes + alignment_ - 1) & ~(alignment_ - 1));
  std::lock_guard lock(mutex_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
  if (best == free_.end() || bytes > capacity_) {
    uint64_t largest = 0;
    for (auto& [off, sz] : free_) largest = std::max(largest, sz);
    fail(
        "{}: out of memory allocating {} for {}: cap {}, in use {}, free {} (largest free "
        "block {}); {}",
        name_, format_bytes(bytes), what, format_bytes(capacity_), format_bytes(in_use_),
        format_bytes(capacity_ - in_use_), format_bytes(largest), remedy_);
  }
  const uint64_t offset = best->first;
  const uint64_t remaining = best->second - size;
  free_.erase(best);
  if (remaining > 0) free_.emplace(offset + size, remaining);
  used_.emplace(offset, size);
  in_use_ += size;
  high_water_ = std::max(high_water_, in_use_);
  return offset;
}

void Arena::release(uint64_t offset) {
  std::lock_guard lock(mutex_);
  auto it = used_.find(offset);
  if (it == used_.end())
    fail("{}: release of offset {} that was never allocated (or released twice)", name_, offset);
  uint64_t start = offset, size = it->second;
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
  ArenaStats s{capacity_, in_use_, high_water_, 0, used_.size()};
  for (auto& [off, sz] : free_) s.largest_free = std::max(s.largest_free, sz);
  return s;
}

}  // namespace strata
