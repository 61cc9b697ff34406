// test_arena.cpp: strata::Arena, the offset allocator under every device arena and the
// pinned pool. Layouts are built so that a first-fit or non-coalescing allocator fails.
#include "core/arena.h"
#include "core/bytes.h"
#include "core/error.h"

#include <gtest/gtest.h>
#include "testing.h"

#include <array>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

using test::error_message;

Arena make_arena(uint64_t capacity, uint64_t alignment = 256) {
  return Arena(capacity, alignment, "device host:0", "raise --device-memory");
}

TEST(Arena, FirstBlockStartsAtZeroAndBlocksDoNotOverlap) {
  Arena a = make_arena(4096);
  EXPECT_EQ(a.allocate(1000, "x"), 0u);
  EXPECT_EQ(a.allocate(256, "y"), 1024u);
  EXPECT_EQ(a.allocate(512, "z"), 1280u);
  EXPECT_EQ(a.stats().allocations, 3u);
  EXPECT_EQ(a.name(), "device host:0");
}

TEST(Arena, RoundsRequestsUpToTheAlignment) {
  Arena a = make_arena(1 << 20, 512);
  std::vector<uint64_t> sizes = {1, 511, 512, 513, 1000, 0};
  uint64_t expected_in_use = 0;
  for (uint64_t s : sizes) {
    const uint64_t off = a.allocate(s, "x");
    EXPECT_EQ(off % 512, 0u) << "request " << s;
    expected_in_use += s <= 512 ? 512 : (s + 511) / 512 * 512;
    EXPECT_EQ(a.stats().in_use, expected_in_use) << "request " << s;
  }
  // A zero-byte request still gets a block of its own, distinct from every other.
  const uint64_t z1 = a.allocate(0, "empty"), z2 = a.allocate(0, "empty");
  EXPECT_NE(z1, z2);
}

TEST(Arena, RejectsAnAlignmentThatIsNotAPowerOfTwo) {
  const std::string msg = error_message([] { Arena(4096, 48, "pinned pool", "x"); });
  EXPECT_NE(msg.find("pinned pool"), std::string::npos) << msg;
  EXPECT_NE(msg.find("48"), std::string::npos) << msg;
  EXPECT_NE(error_message([] { Arena(4096, 0, "p", "x"); }), "");
}

TEST(Arena, PicksTheSmallestHoleThatFits) {
  Arena a = make_arena(8192);
  const uint64_t big = a.allocate(1024, "big");  // [0, 1024)
  a.allocate(256, "sep1");                       // [1024, 1280)
  const uint64_t mid = a.allocate(512, "mid");   // [1280, 1792)
  a.allocate(256, "sep2");                       // [1792, 2048); tail [2048, 8192) free
  a.release(big);
  a.release(mid);
  // Holes: 1024 at 0, 512 at 1280, 6144 at 2048. First fit would return 0.
  EXPECT_EQ(a.allocate(512, "fits mid exactly"), mid);
  // 768 fits only the 1024-byte hole and the tail; the hole is the smaller.
  EXPECT_EQ(a.allocate(768, "fits big"), big);
  // The remaining 256 bytes of that hole are the best fit for 256.
  EXPECT_EQ(a.allocate(200, "remainder"), big + 768);
}

TEST(Arena, CoalescesWithBothNeighbours) {
  Arena a = make_arena(768);
  const uint64_t x = a.allocate(256, "x"), y = a.allocate(256, "y"), z = a.allocate(256, "z");
  EXPECT_EQ(a.stats().largest_free, 0u);
  a.release(x);
  a.release(z);
  EXPECT_EQ(a.stats().largest_free, 256u);
  a.release(y);  // joins x on its left and z on its right
  EXPECT_EQ(a.stats().largest_free, 768u);
  EXPECT_EQ(a.allocate(768, "all"), 0u);
}

TEST(Arena, CoalescesWithTheLeftNeighbourOnly) {
  Arena a = make_arena(768);
  const uint64_t x = a.allocate(256, "x"), y = a.allocate(256, "y");
  a.allocate(256, "z");
  a.release(x);
  a.release(y);
  EXPECT_EQ(a.stats().largest_free, 512u);
  EXPECT_EQ(a.allocate(512, "xy"), 0u);
}

TEST(Arena, CoalescesWithTheRightNeighbourOnly) {
  Arena a = make_arena(768);
  a.allocate(256, "x");
  const uint64_t y = a.allocate(256, "y"), z = a.allocate(256, "z");
  a.release(z);
  a.release(y);
  EXPECT_EQ(a.stats().largest_free, 512u);
  EXPECT_EQ(a.allocate(512, "yz"), 256u);
}

TEST(Arena, ReleasingEverythingInAnyOrderRestoresOneBlock) {
  Arena a = make_arena(64 * 256);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 64; ++i) offs.push_back(a.allocate(256, "b"));
  // Odd ones first (no neighbour is free yet), then the even ones join them.
  for (size_t i = 1; i < offs.size(); i += 2) a.release(offs[i]);
  EXPECT_EQ(a.stats().largest_free, 256u);
  for (size_t i = 0; i < offs.size(); i += 2) a.release(offs[i]);
  const ArenaStats s = a.stats();
  EXPECT_EQ(s.largest_free, 64u * 256u);
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.allocations, 0u);
}

TEST(Arena, TracksTheHighWaterMark) {
  Arena a = make_arena(1 << 20);
  const uint64_t p = a.allocate(1024, "p");
  const uint64_t q = a.allocate(2048, "q");
  a.release(q);
  a.allocate(256, "r");
  ArenaStats s = a.stats();
  EXPECT_EQ(s.capacity, 1u << 20);
  EXPECT_EQ(s.in_use, 1024u + 256u);
  EXPECT_EQ(s.high_water, 1024u + 2048u);
  EXPECT_EQ(s.allocations, 2u);
  a.release(p);
  a.allocate(4096, "s");
  s = a.stats();
  EXPECT_EQ(s.in_use, 256u + 4096u);
  EXPECT_EQ(s.high_water, 256u + 4096u);
}

TEST(Arena, CountsEveryBlockUnderItsKind) {
  Arena a = make_arena(1 << 20);
  auto sum = [](const std::array<uint64_t, kMemoryKinds>& v) {
    uint64_t n = 0;
    for (uint64_t x : v) n += x;
    return n;
  };
  const uint64_t p = a.allocate(1000, "shard", MemoryKind::parameters);  // 1024 after rounding
  const uint64_t g = a.allocate(4096, "gathered unit", MemoryKind::gathered);
  const uint64_t x = a.allocate(300, "untyped");  // 512; the two-argument form is `other`
  ArenaStats s = a.stats();
  EXPECT_EQ(s.in_use_of(MemoryKind::parameters), 1024u);
  EXPECT_EQ(s.in_use_of(MemoryKind::gathered), 4096u);
  EXPECT_EQ(s.in_use_of(MemoryKind::other), 512u);
  EXPECT_EQ(s.in_use_of(MemoryKind::activations), 0u);
  EXPECT_EQ(sum(s.in_use_by_kind), s.in_use);

  // The gathered buffer goes; activations grow past the old total. The overall high-water
  // mark moves, and its split is the one at that moment: no gathered bytes then, although
  // gathered's own peak is still 4096.
  a.release(g);
  const uint64_t act = a.allocate(8192, "activations", MemoryKind::activations);
  s = a.stats();
  EXPECT_EQ(s.in_use, 1024u + 512u + 8192u);
  EXPECT_EQ(s.high_water, s.in_use);
  EXPECT_EQ(s.high_water_by_kind[static_cast<size_t>(MemoryKind::gathered)], 0u);
  EXPECT_EQ(s.high_water_by_kind[static_cast<size_t>(MemoryKind::activations)], 8192u);
  EXPECT_EQ(sum(s.high_water_by_kind), s.high_water);
  EXPECT_EQ(s.peak_of(MemoryKind::gathered), 4096u);
  EXPECT_EQ(s.in_use_of(MemoryKind::gathered), 0u);

  // Releasing below the high-water mark keeps its split; a kind's peak stays its maximum.
  a.release(act);
  a.allocate(256, "more activations", MemoryKind::activations);
  s = a.stats();
  EXPECT_EQ(s.in_use_of(MemoryKind::activations), 256u);
  EXPECT_EQ(s.peak_of(MemoryKind::activations), 8192u);
  EXPECT_EQ(s.high_water_by_kind[static_cast<size_t>(MemoryKind::activations)], 8192u);
  EXPECT_EQ(sum(s.high_water_by_kind), s.high_water);
  a.release(p);
  a.release(x);
  EXPECT_EQ(a.stats().in_use_of(MemoryKind::parameters), 0u);
  EXPECT_EQ(a.stats().in_use_of(MemoryKind::other), 0u);
  EXPECT_EQ(a.stats().peak_of(MemoryKind::parameters), 1024u);
}

TEST(Arena, KindNamesAndOutOfMemorySplit) {
  EXPECT_EQ(memory_kind_name(MemoryKind::parameters), "parameters");
  EXPECT_EQ(memory_kind_name(MemoryKind::gathered), "gathered");
  EXPECT_EQ(memory_kind_name(MemoryKind::gradients), "gradients");
  EXPECT_EQ(memory_kind_name(MemoryKind::optimizer), "optimizer");
  EXPECT_EQ(memory_kind_name(MemoryKind::activations), "activations");
  EXPECT_EQ(memory_kind_name(MemoryKind::communication), "communication");
  EXPECT_EQ(memory_kind_name(MemoryKind::other), "other");
  Arena a = make_arena(4096);
  a.allocate(1024, "p", MemoryKind::parameters);
  a.allocate(2048, "c", MemoryKind::communication);
  const std::string msg = error_message([&] { a.allocate(2048, "act", MemoryKind::activations); });
  EXPECT_NE(msg.find("in use 3 KiB (parameters 1 KiB, communication 2 KiB)"), std::string::npos)
      << msg;
  // An out-of-range kind is refused, naming the allocation.
  const std::string bad =
      error_message([&] { a.allocate(16, "odd", static_cast<MemoryKind>(kMemoryKinds)); });
  EXPECT_NE(bad.find("odd"), std::string::npos) << bad;
  EXPECT_EQ(a.stats().in_use, 3072u);
}

TEST(Arena, DoubleOrUnknownReleaseIsAnError) {
  Arena a = make_arena(4096);
  const uint64_t p = a.allocate(256, "p");
  const uint64_t q = a.allocate(256, "q");
  a.release(p);
  std::string msg = error_message([&] { a.release(p); });
  EXPECT_NE(msg.find("device host:0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("released twice"), std::string::npos) << msg;
  msg = error_message([&] { a.release(q + 16); });  // inside a block, not its start
  EXPECT_NE(msg.find("offset 272"), std::string::npos) << msg;
  // The failed releases changed nothing.
  EXPECT_EQ(a.stats().in_use, 256u);
  a.release(q);
  EXPECT_EQ(a.stats().largest_free, 4096u);
}

TEST(Arena, ExhaustionNamesTheArenaRequestCapAndRemedy) {
  const uint64_t cap = 3ull << 20;
  Arena a = make_arena(cap);
  a.allocate(2ull << 20, "weights");
  const uint64_t request = 1536ull << 10;  // 1.5 MiB
  const std::string msg = error_message([&] { a.allocate(request, "activations"); });
  for (const std::string& part :
       {std::string("device host:0"), std::string("activations"), format_bytes(request),
        "cap " + format_bytes(cap), "in use " + format_bytes(2ull << 20),
        "free " + format_bytes(1ull << 20), std::string("raise --device-memory")})
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
  EXPECT_NE(msg.find("1.5 MiB"), std::string::npos) << msg;
}

TEST(Arena, FragmentationIsReportedAsTheLargestFreeBlock) {
  Arena a = make_arena(1024);
  const uint64_t b0 = a.allocate(256, "b0");
  a.allocate(256, "b1");
  const uint64_t b2 = a.allocate(256, "b2");
  a.allocate(256, "b3");
  a.release(b0);
  a.release(b2);
  // 512 bytes are free, but in two 256-byte holes.
  const std::string msg = error_message([&] { a.allocate(512, "x"); });
  EXPECT_NE(msg.find("free 512 B"), std::string::npos) << msg;
  EXPECT_NE(msg.find("largest free block 256 B"), std::string::npos) << msg;
}

TEST(Arena, HugeRequestsFailInsteadOfWrapping) {
  Arena a = make_arena(4096);
  for (uint64_t bytes : {uint64_t{4097}, std::numeric_limits<uint64_t>::max(),
                         std::numeric_limits<uint64_t>::max() - 100})
    EXPECT_NE(error_message([&] { a.allocate(bytes, "huge"); }).find("out of memory"),
              std::string::npos)
        << bytes;
  EXPECT_EQ(a.stats().in_use, 0u);
  EXPECT_EQ(a.allocate(4096, "all"), 0u);
}

TEST(Arena, ZeroCapacityRefusesEverything) {
  Arena a = make_arena(0);
  EXPECT_NE(error_message([&] { a.allocate(0, "x"); }), "");
  EXPECT_EQ(a.stats().largest_free, 0u);
}

TEST(Arena, ConcurrentUseKeepsBlocksDisjoint) {
  Arena a = make_arena(1 << 20);
  constexpr int kThreads = 4, kRounds = 2000;
  std::vector<std::vector<uint64_t>> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&a, &kept, t] {
      for (int i = 0; i < kRounds; ++i) {
        const uint64_t off = a.allocate(256 * (1 + (i + t) % 4), "t");
        if (i % 2 == 0)
          a.release(off);
        else if (i % 100 == 1)
          kept[static_cast<size_t>(t)].push_back(off);
        else
          a.release(off);
      }
    });
  for (auto& th : threads) th.join();
  std::set<uint64_t> all;
  size_t count = 0;
  for (const auto& v : kept)
    for (uint64_t off : v) {
      all.insert(off);
      ++count;
    }
  EXPECT_EQ(all.size(), count) << "two threads were given the same block";
  EXPECT_EQ(a.stats().allocations, count);
  for (const auto& v : kept)
    for (uint64_t off : v) a.release(off);
  EXPECT_EQ(a.stats().largest_free, 1u << 20);
  EXPECT_EQ(a.stats().in_use, 0u);
}

}  // namespace
}  // namespace strata
