#include "partition/partition.h"

#include "core/error.h"

#include <algorithm>
#include <limits>

namespace strata {

uint64_t UnitPartition::shard_real(int rank) const {
  if (replicated) return numel;
  const uint64_t begin = shard_offset(rank);
  if (begin >= numel) return 0;
  return std::min(shard, numel - begin);
}

Partition Partition::build(const ModelLayout& layout, int ranks, uint64_t align_elements,
                           uint64_t persistence_threshold) {
  if (ranks < 1) fail("partition over {} ranks: need at least one device", ranks);
  if (align_elements < 1)
    fail("partition alignment of {} elements: use at least 1 (ModelLayout::kAlign is usual)",
         align_elements);
  const uint64_t quantum = static_cast<uint64_t>(ranks) * align_elements;
  if (quantum / static_cast<uint64_t>(ranks) != align_elements)
    fail("partition over {} ranks with alignment {}: ranks × alignment overflows; lower both",
         ranks, align_elements);
  Partition p;
  p.ranks = ranks;
  p.align = align_elements;
  p.persistence_threshold = persistence_threshold;
  for (const UnitLayout& u : layout.units) {
    if (u.numel == 0) fail("unit {} has no parameters; a layout unit cannot be empty", u.name);
    UnitPartition up;
    up.name = u.name;
    up.numel = u.numel;
    // As DeepSpeed's stage3_param_persistence_threshold: a unit of at most that many
    // elements persists (0 shards every unit).
    up.replicated = u.numel <= persistence_threshold;
    if (up.replicated) {
      up.padded = u.numel;
      up.shard = u.numel;
    } else {
      if (u.numel > std::numeric_limits<uint64_t>::max() - quantum)
        fail("unit {} of {} elements cannot be padded to {}; this is not a real model", u.name,
             u.numel, quantum);
      up.padded = (u.numel + quantum - 1) / quantum * quantum;
      up.shard = up.padded / static_cast<uint64_t>(ranks);
    }
    p.units.push_back(std::move(up));
  }
  return p;
}

uint64_t Partition::resident_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units) n += u.resident();
  return n;
}

uint64_t Partition::sharded_padded_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units)
    if (!u.replicated) n += u.padded;
  return n;
}

uint64_t Partition::replicated_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units)
    if (u.replicated) n += u.numel;
  return n;
}

uint64_t Partition::max_unit_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units) n = std::max(n, u.padded);
  return n;
}

uint64_t Partition::max_gathered_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units)
    if (!u.replicated) n = std::max(n, u.padded);
  return n;
}

uint64_t Partition::max_shard_numel() const {
  uint64_t n = 0;
  for (const UnitPartition& u : units)
    if (!u.replicated) n = std::max(n, u.shard);
  return n;
}

std::string Partition::str() const {
  std::string s = fmt::format("partition over {} rank(s), align {}, persistence threshold {}\n",
                              ranks, align, persistence_threshold);
  for (const UnitPartition& u : units) {
    if (u.replicated)
      s += fmt::format("  {:<12} {:>12} elements  replicated\n", u.name, u.numel);
    else
      s += fmt::format("  {:<12} {:>12} elements  padded {:>12}  shard {:>12}\n", u.name, u.numel,
                       u.padded, u.shard);
  }
  s += fmt::format("  resident per rank {} elements (sharded {} / {} + replicated {})",
                   resident_numel(), sharded_padded_numel(), ranks, replicated_numel());
  return s;
}

}  // namespace strata
