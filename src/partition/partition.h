// partition.h: how each unit of the model is split across the local ranks (DESIGN §2).
//
// Every unit's flat buffer is padded to a multiple of ranks × align elements and cut into
// `ranks` equal shards, rank r holding elements [r·shard, (r+1)·shard) of the padded unit, so
// every shard starts aligned and all-gather/reduce-scatter move equal counts. Units of at most
// the persistence threshold (DeepSpeed's stage3_param_persistence_threshold, in elements;
// 0 shards everything) are not split: they stay whole and resident on every rank, and their
// gradients are all-reduced instead of reduce-scattered. Plain data: the partitioner, the planner
// and the tests all read it.
#pragma once

#include "model/llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct UnitPartition {
  std::string name;         // the unit's name ("embedding", "layers.3", "head")
  uint64_t numel = 0;       // elements of the unit's flat buffer (ModelLayout's numel)
  uint64_t padded = 0;      // sharded: numel rounded up to ranks × align; replicated: numel
  uint64_t shard = 0;       // sharded: padded / ranks; replicated: numel (the whole unit)
  bool replicated = false;  // numel <= persistence threshold: whole on every rank

  // Elements of this unit that every rank keeps resident (its shard, or the whole unit).
  uint64_t resident() const { return shard; }
  // First element of rank r's shard within the padded unit (0 when replicated).
  uint64_t shard_offset(int rank) const {
    return replicated ? 0 : static_cast<uint64_t>(rank) * shard;
  }
  // Elements of the real unit (not padding) that lie in rank r's shard.
  uint64_t shard_real(int rank) const;
};

struct Partition {
  int ranks = 1;
  uint64_t align = 1;                  // elements; every shard is a multiple of it
  uint64_t persistence_threshold = 0;  // elements; units of at most this are replicated
  std::vector<UnitPartition> units;    // in the layout's order

  // Throws Error when ranks < 1, align < 1, or a unit is empty, naming the value.
  static Partition build(const ModelLayout& layout, int ranks, uint64_t align_elements,
                         uint64_t persistence_threshold);

  int num_units() const { return static_cast<int>(units.size()); }
  // Elements every rank keeps resident: sum of resident() over the units.
  uint64_t resident_numel() const;
  // Elements of the sharded units (padding included) and of the replicated ones.
  uint64_t sharded_padded_numel() const;
  uint64_t replicated_numel() const;
  // The largest full unit (padded for sharded units).
  uint64_t max_unit_numel() const;
  // The largest sharded unit, padded: what a working buffer gathers (0 when none).
  uint64_t max_gathered_numel() const;
  uint64_t max_shard_numel() const;  // of the sharded units only (0 when none)

  // One line per unit, then the totals, for logs and `strata plan`.
  std::string str() const;
};

}  // namespace strata
