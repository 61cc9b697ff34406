// test_nvme.cpp: the NVMe tier. The engine is swept over flag combinations with a bitmask
// loop (O_DIRECT or buffered, registered buffers and files, an unaligned buffer, queue
// depths 1/8/64, on /tmp where O_DIRECT works and /dev/shm where it falls back) with odd
// lengths and unaligned tails, verifying every byte. The swap store round-trips over 1, 2
// and 3 paths; each injected fault, a lost file and on-disk corruption must be an Error that
// names the operation, the file and the offset, with nothing left hanging or held. Neither
// the engine nor the store allocates from the heap per request once running (this binary
// replaces operator new to count).
#include "core/pinned_pool.h"
#include "core/system.h"
#include "nvme/io_ring.h"
#include "nvme/swap_store.h"
#include "testing.h"

#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

// Every operator new of this program, counted on the asking thread while it counts
// (AllocationCount below). The array and nothrow forms call this one. TSan's runtime defines
// operator new itself (ASan's lets a program replace it), so under TSan nothing is counted and
// the allocation tests skip.
namespace {
thread_local bool t_count_allocations = false;
thread_local uint64_t t_allocations = 0;
}  // namespace
#if !defined(STRATA_TEST_TSAN)
// GCC takes free() inside a replacement operator delete for a mismatch with operator new.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t bytes) {
  if (t_count_allocations) ++t_allocations;
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // !STRATA_TEST_TSAN

namespace strata::nvme {
namespace {

#if defined(STRATA_TEST_TSAN)
constexpr bool kCountsAllocations = false;
#else
constexpr bool kCountsAllocations = true;
#endif

// Counts this thread's heap allocations from construction to count().
class AllocationCount {
 public:
  AllocationCount() {
    t_allocations = 0;
    t_count_allocations = true;
  }
  ~AllocationCount() { t_count_allocations = false; }
  AllocationCount(const AllocationCount&) = delete;
  AllocationCount& operator=(const AllocationCount&) = delete;
  uint64_t count() const { return t_allocations; }
};

namespace fs = std::filesystem;
using test::expect_error;

// A fresh directory under `base`, removed with everything in it.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& base) {
    std::string tmpl = base + "/strata-nvme-test-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp under " << base;
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

// 4 KiB-aligned memory, optionally handed out `shift` bytes past an aligned address.
struct Buffer {
  std::unique_ptr<char, decltype(&std::free)> mem{nullptr, &std::free};
  char* data = nullptr;
  uint64_t size = 0;  // of mem
  Buffer(uint64_t bytes, uint64_t shift = 0) {
    size = (bytes + shift + 4095) / 4096 * 4096 + 4096;
    mem.reset(static_cast<char*>(std::aligned_alloc(4096, size)));
    data = mem.get() + shift;
    std::memset(mem.get(), 0, size);
  }
};

// Bytes that differ at every position and between seeds: xorshift64*, eight bytes a step (a
// byte a step made the flag sweep's filling most of its time under TSan).
void fill(char* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint64_t v = x * 0x2545f4914f6cdd1dull;
    std::memcpy(p + i, &v, std::min<uint64_t>(8, n - i));
  }
}

// Index of the first differing byte, or -1.
int64_t first_difference(const char* a, const char* b, uint64_t n) {
  if (std::memcmp(a, b, n) == 0) return -1;
  for (uint64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

// Segment lengths chosen to leave unaligned offsets and odd tails everywhere.
const std::vector<uint64_t> kLengths = {1 << 20, 4096, 777, 8192 + 13, 1, 65536 - 5, 3 * 4096};

struct Segment {
  uint64_t offset, len;
};
std::vector<Segment> segments(int rounds) {
  std::vector<Segment> out;
  uint64_t at = 0;
  for (int r = 0; r < rounds; ++r)
    for (uint64_t len : kLengths) {
      out.push_back({at, len});
      at += len;
    }
  return out;
}

void run_all(IoRing& ring, IoOp op, int file, char* base, const std::vector<Segment>& segs) {
  for (const Segment& s : segs) ring.submit(IoRequest{op, file, s.offset, base + s.offset, s.len});
  ring.wait_all();
}

TEST(IoRing, FlagSweepRoundTripsEveryByte) {
  const std::vector<Segment> segs = segments(2);
  const uint64_t total = segs.back().offset + segs.back().len;
  // One set of buffers for the sweep, cleared before each use: fresh ones each time spent more
  // of the test's time faulting pages in than moving data.
  Buffer src_mem(total, 1), back_mem(total, 1), whole(total);
  for (const char* base : {"/tmp", "/dev/shm"}) {
    TempDir dir(base);
    // tmpfs takes O_DIRECT since Linux 6.6; older kernels exercise the fallback here too.
    const bool direct_works = probe_o_direct(dir.path).result == ODirect::yes;
    for (unsigned qd : {1u, 8u, 64u}) {
      for (unsigned mask = 0; mask < 32; ++mask) {
        const bool direct = mask & 1, fixed_buffers = mask & 2, fixed_files = mask & 4;
        const uint64_t shift = (mask & 8) ? 1 : 0;  // an unaligned buffer
        const bool refused = mask & 16;  // the filesystem refuses O_DIRECT: buffered fallback
        SCOPED_TRACE(::testing::Message()
                     << base << " qd " << qd << " direct " << direct << " fixed buffers "
                     << fixed_buffers << " fixed files " << fixed_files << " shift " << shift);
        IoOptions o;
        o.queue_depth = qd;
        o.direct = direct;
        o.register_buffers = fixed_buffers;
        o.register_files = fixed_files;
        if (refused) o.faults = {{FaultKind::o_direct_refused, 0}};
        IoRing ring(o);
        const std::string path =
            dir.file("sweep." + std::to_string(qd) + "." + std::to_string(mask));
        const int file = ring.add_file(path, true);
        EXPECT_EQ(ring.is_direct(file), direct && !refused && direct_works);
        char* const src = src_mem.mem.get() + shift;
        char* const back = back_mem.mem.get() + shift;
        std::memset(back_mem.mem.get(), 0, back_mem.size);
        std::memset(whole.mem.get(), 0, whole.size);
        ring.register_buffer(src_mem.mem.get(), src_mem.size);
        ring.register_buffer(back_mem.mem.get(), back_mem.size);
        fill(src, total, qd * 100 + mask);
        run_all(ring, IoOp::write, file, src, segs);
        run_all(ring, IoOp::read, file, back, segs);
        EXPECT_EQ(first_difference(src, back, total), -1);
        // Read again cut differently: aligned 256 KiB pieces and a short tail.
        for (uint64_t at = 0; at < total; at += 256 << 10)
          ring.submit(IoRequest{IoOp::read, file, at, whole.data + at,
                                std::min<uint64_t>(256 << 10, total - at)});
        ring.wait_all();
        EXPECT_EQ(first_difference(src, whole.data, total), -1);
        EXPECT_EQ(ring.stats().bytes, 3 * total);
        EXPECT_EQ(ring.stats().fixed_buffers > 0, fixed_buffers);
        EXPECT_EQ(ring.stats().buffered_parts > 0, ring.is_direct(file));  // the odd tails
        EXPECT_EQ(ring.in_flight(), 0u);
      }
    }
  }
}

struct RingFixture {
  TempDir dir{"/tmp"};
  std::vector<Segment> segs = segments(3);
  uint64_t total = segs.back().offset + segs.back().len;
  Buffer src{total}, back{total};
  std::unique_ptr<IoRing> ring;
  int file = 0;
  explicit RingFixture(std::vector<Fault> faults, unsigned qd = 8) {
    IoOptions o;
    o.queue_depth = qd;
    o.faults = std::move(faults);
    ring = std::make_unique<IoRing>(o);
    file = ring->add_file(dir.file("data"), true);
    fill(src.data, total, 7);
  }
};

// Once a ring runs, a request takes a preallocated slot: none allocates, whether it queues
// behind a full ring, is split into an aligned part and a buffered tail, or uses registered
// buffers and files.
TEST(IoRing, RequestsAllocateNothingOnceRunning) {
  if (!kCountsAllocations)
    GTEST_SKIP() << "TSan's runtime owns operator new: allocations are not counted under TSan";
  TempDir dir("/tmp");
  const std::vector<Segment> segs = segments(2);  // 14 requests, twice the depth; odd tails
  const uint64_t total = segs.back().offset + segs.back().len;
  for (unsigned mask = 0; mask < 4; ++mask) {
    const bool direct = mask & 1, fixed = mask & 2;
    SCOPED_TRACE(::testing::Message() << "direct " << direct << " fixed " << fixed);
    IoOptions o;
    o.queue_depth = 7;
    o.direct = direct;
    o.register_buffers = fixed;
    o.register_files = fixed;
    IoRing ring(o);
    const int file = ring.add_file(dir.file("steady." + std::to_string(mask)), true);
    Buffer src(total), back(total);
    ring.register_buffer(src.mem.get(), src.size);
    ring.register_buffer(back.mem.get(), back.size);
    uint64_t completed = 0;
    ring.on_complete([&completed](const IoRequest& r) { completed += r.len; });
    fill(src.data, total, mask);
    run_all(ring, IoOp::write, file, src.data, segs);  // the file's first write extends it
    uint64_t allocations = 0;
    {
      AllocationCount count;
      for (int round = 0; round < 3; ++round) {
        run_all(ring, IoOp::write, file, src.data, segs);
        run_all(ring, IoOp::read, file, back.data, segs);
      }
      allocations = count.count();
    }
    EXPECT_EQ(allocations, 0u) << "over " << 6 * segs.size() << " requests";
    EXPECT_EQ(first_difference(src.data, back.data, total), -1);
    EXPECT_EQ(completed, 7 * total);
    EXPECT_EQ(ring.stats().buffered_parts > 0, ring.is_direct(file));  // tails went buffered
  }
}

TEST(IoRing, ShortTransfersAreResumed) {
  RingFixture f({{FaultKind::short_io, 0},
                 {FaultKind::short_io, 2},
                 {FaultKind::short_io, 3},
                 {FaultKind::short_io, 22},
                 {FaultKind::short_io, 30}});
  run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs);
  run_all(*f.ring, IoOp::read, f.file, f.back.data, f.segs);
  EXPECT_EQ(first_difference(f.src.data, f.back.data, f.total), -1);
  EXPECT_GE(f.ring->stats().resumed, 5u);
}

// A completion of -EAGAIN (or -EINTR) queues the part again unchanged: writes 1 and 4 and
// reads 22 and 30 of the 21 + 21 below; an injected read clears its buffer first, so only a
// real second read gives the bytes back.
TEST(IoRing, EagainIsQueuedAgainUnchanged) {
  RingFixture f({{FaultKind::eagain, 1},
                 {FaultKind::eagain, 4},
                 {FaultKind::eagain, 22},
                 {FaultKind::eagain, 30}});
  ASSERT_EQ(f.segs.size(), 21u);
  run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs);
  run_all(*f.ring, IoOp::read, f.file, f.back.data, f.segs);
  EXPECT_EQ(first_difference(f.src.data, f.back.data, f.total), -1);
  EXPECT_EQ(f.ring->stats().requeued, 4u);
  EXPECT_EQ(f.ring->stats().bytes, 2 * f.total);
}

TEST(IoRing, InjectedEioNamesTheOperationAndLeavesTheRingUsable) {
  RingFixture f({{FaultKind::eio, 5}});
  expect_error(
      [&] { run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs); },
      {"write of", "offset", f.dir.file("data"), "Input/output error", "injected", "dmesg"});
  EXPECT_EQ(f.ring->in_flight(), 0u);
  run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs);  // usable again
  run_all(*f.ring, IoOp::read, f.file, f.back.data, f.segs);
  EXPECT_EQ(first_difference(f.src.data, f.back.data, f.total), -1);
}

TEST(IoRing, InjectedEnospcSaysToFreeSpace) {
  RingFixture f({{FaultKind::enospc, 0}}, 64);
  expect_error([&] { run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs); },
               {"write of 1 MiB at offset 0", "No space left", "add another nvme_path"});
  EXPECT_EQ(f.ring->in_flight(), 0u);
}

TEST(IoRing, ReadPastTheEndIsAnError) {
  RingFixture f({});
  run_all(*f.ring, IoOp::write, f.file, f.src.data, {{0, 4096}});
  expect_error(
      [&] {
        run_all(*f.ring, IoOp::read, f.file, f.back.data, {{0, 8192}});
      },
      {"read of 8 KiB at offset 0", "end of the file at offset 4096", "truncated"});
}

TEST(IoRing, AFailingCompletionHookFailsTheBatch) {
  RingFixture f({});
  int calls = 0;
  f.ring->on_complete([&](const IoRequest& r) {
    if (++calls == 3) fail("hook refused request with tag {}", r.tag);
  });
  expect_error([&] { run_all(*f.ring, IoOp::write, f.file, f.src.data, f.segs); },
               {"hook refused"});
  EXPECT_GE(calls, 3);  // what was in flight still completed; nothing more was queued
  EXPECT_LT(calls, static_cast<int>(f.segs.size()));
  EXPECT_EQ(f.ring->in_flight(), 0u);
}

TEST(IoRing, SqpollRoundTripsWhenTheKernelAllowsIt) {
  IoOptions o;
  o.sqpoll = true;
  std::unique_ptr<IoRing> ring;
  try {
    ring = std::make_unique<IoRing>(o);
  } catch (const Error& e) {
    GTEST_SKIP() << "sqpoll refused here: " << e.what();
  }
  TempDir dir("/tmp");
  const std::vector<Segment> segs = segments(1);
  const uint64_t total = segs.back().offset + segs.back().len;
  Buffer src(total), back(total);
  fill(src.data, total, 11);
  const int file = ring->add_file(dir.file("sq"), true);
  run_all(*ring, IoOp::write, file, src.data, segs);
  run_all(*ring, IoOp::read, file, back.data, segs);
  EXPECT_EQ(first_difference(src.data, back.data, total), -1);
}

TEST(IoRing, BadQueueDepthIsAnError) {
  IoOptions o;
  o.queue_depth = 0;
  expect_error([&] { IoRing ring(o); }, {"queue depth 0", "1 to 4096"});
}

// ---- swap store ----

struct Paths {
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::string> names;
  Paths(int k, const char* base = "/tmp") {
    for (int i = 0; i < k; ++i) {
      dirs.push_back(std::make_unique<TempDir>(base));
      names.push_back(dirs.back()->path);
    }
  }
};

SwapStoreOptions store_options(const Paths& p, uint64_t capacity = 4 << 20) {
  SwapStoreOptions o;
  o.paths = p.names;
  o.capacity = capacity;
  o.stripe = 64 << 10;
  o.io.queue_depth = 8;
  return o;
}

const std::vector<uint64_t> kShardBytes = {100000, 65536, 1, 300001, 4096 * 5};

void round_trip(SwapStore& store, uint64_t shift, uint64_t seed) {
  for (size_t i = 0; i < kShardBytes.size(); ++i) {
    const std::string name = "shard" + std::to_string(i);
    const uint64_t n = kShardBytes[i];
    Buffer src(n, shift), back(n, shift);
    fill(src.data, n, seed + i);
    store.write(name, src.data);
    store.read(name, back.data);
    ASSERT_EQ(first_difference(src.data, back.data, n), -1) << name;
  }
}

TEST(SwapStore, StripesOverOneTwoAndThreePathsAndRoundTrips) {
  for (const char* base : {"/tmp", "/dev/shm"}) {
    for (int k = 1; k <= 3; ++k) {
      SCOPED_TRACE(::testing::Message() << base << " paths " << k);
      Paths p(k, base);
      std::vector<std::string> files;
      {
        SwapStore store(store_options(p));
        files = store.files();
        ASSERT_EQ(files.size(), static_cast<size_t>(k));
        for (const std::string& f : files) EXPECT_TRUE(fs::exists(f));
        for (size_t i = 0; i < kShardBytes.size(); ++i)
          store.add_shard("shard" + std::to_string(i), kShardBytes[i]);
        // Consecutive stripe units go to consecutive paths.
        const std::vector<Extent> e = store.extents("shard3");
        ASSERT_EQ(e.size(), 5u);
        for (size_t i = 1; i < e.size(); ++i)
          EXPECT_EQ(
              e[i].file,
              files[(std::find(files.begin(), files.end(), e[0].file) - files.begin() + i) % k]);
        EXPECT_EQ(e.back().bytes, 300001u - 4 * (64 << 10));
        round_trip(store, 0, 1);
        round_trip(store, 3, 2);  // unaligned buffers go through bounce buffers
        EXPECT_EQ(fs::file_size(files[0]), store.file_bytes());  // preallocated
      }
      for (const std::string& f : files) EXPECT_FALSE(fs::exists(f)) << f << " left behind";
      for (const std::string& d : p.names) EXPECT_TRUE(fs::is_empty(d)) << d;
    }
  }
}

// A store's reads and writes of page-aligned buffers (the executor's pinned buffers are)
// allocate nothing once its shards are placed, over several paths and blocks of every size.
TEST(SwapStore, TransfersAllocateNothingOnceRunning) {
  if (!kCountsAllocations)
    GTEST_SKIP() << "TSan's runtime owns operator new: allocations are not counted under TSan";
  Paths p(2);
  SwapStore store(store_options(p));
  std::vector<std::string> names;
  std::vector<std::unique_ptr<Buffer>> src, back;
  for (size_t i = 0; i < kShardBytes.size(); ++i) {
    names.push_back("shard" + std::to_string(i));
    store.add_shard(names.back(), kShardBytes[i]);
    src.push_back(std::make_unique<Buffer>(kShardBytes[i]));
    back.push_back(std::make_unique<Buffer>(kShardBytes[i]));
    fill(src.back()->data, kShardBytes[i], 40 + i);
    store.write(names[i], src[i]->data);
  }
  uint64_t allocations = 0;
  {
    AllocationCount count;
    for (int round = 0; round < 3; ++round)
      for (size_t i = 0; i < names.size(); ++i) {
        store.write(names[i], src[i]->data);
        store.read(names[i], back[i]->data);
      }
    allocations = count.count();
  }
  EXPECT_EQ(allocations, 0u);
  for (size_t i = 0; i < names.size(); ++i)
    EXPECT_EQ(first_difference(src[i]->data, back[i]->data, kShardBytes[i]), -1) << names[i];
  EXPECT_EQ(store.own_staging_bytes(), 0u);
}

template <typename Fn>
void expect_parts(Fn&& fn, const std::vector<std::string>& parts) {
  const std::string msg = test::error_message(fn);
  for (const std::string& part : parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
}

TEST(SwapStore, FaultsAreErrorsAndBuffersGoBackToThePool) {
  // Shard "a" has 5 blocks on 2 paths: its first write is requests 0..4, its read 5..9.
  struct Case {
    FaultKind kind;
    uint64_t request;
    bool in_read;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {FaultKind::eio,
       2,
       false,
       {"write of 64 KiB at offset 65536", "Input/output error", "injected", "strata-swap.bin"}},
      {FaultKind::enospc, 3, false, {"write of 64 KiB", "No space left", "nvme_path"}},
      {FaultKind::eio, 6, true, {"read of 64 KiB at offset 0", "Input/output error"}},
      {FaultKind::corrupt,
       7,
       true,
       {"checksum mismatch reading shard a block 2", "strata-swap.bin at offset 65536",
        "expected xxh3", "got"}},
  };
  const uint64_t n = 5 * (64 << 10) - 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "fault at request " << c.request);
    Paths p(2);
    PinnedPool pool(PinnedPoolOptions{4 << 20, false, -1, false});
    SwapStoreOptions o = store_options(p);
    o.staging = &pool;
    o.io.faults = {{c.kind, c.request}, {FaultKind::short_io, 1}, {FaultKind::short_io, 8}};
    SwapStore store(o);
    store.add_shard("a", n);
    Buffer src(n, 1), back(n, 1);
    fill(src.data, n, 9);
    if (c.in_read) {
      store.write("a", src.data);
      expect_parts([&] { store.read("a", back.data); }, c.message);
      // Nothing of a block that failed its checksum is copied out.
      if (c.kind == FaultKind::corrupt) {
        EXPECT_NE(first_difference(src.data + 2 * (64 << 10), back.data + 2 * (64 << 10), 100), -1);
      }
    } else {
      expect_parts([&] { store.write("a", src.data); }, c.message);
      expect_error([&] { store.read("a", back.data); }, {"shard a has no data", "write it"});
      store.write("a", src.data);
    }
    EXPECT_EQ(pool.stats().in_use, 0u) << "bounce buffers not returned";
    store.read("a", back.data);  // the store is usable after the error
    EXPECT_EQ(first_difference(src.data, back.data, n), -1);
    EXPECT_GE(store.io_stats().resumed, 1u);
  }
}

TEST(SwapStore, CorruptionOnTheDriveIsAnErrorNamingFileAndOffset) {
  Paths p(3);
  SwapStore store(store_options(p));
  const uint64_t n = 6 * (64 << 10);
  store.add_shard("pad", 1);
  store.add_shard("m", n);
  Buffer src(n), back(n);
  fill(src.data, n, 4);
  store.write("m", src.data);
  const Extent e = store.extents("m")[4];
  const int fd = open(e.file.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, "X", 1, static_cast<off_t>(e.offset + 100)), 1);
  close(fd);
  expect_error([&] { store.read("m", back.data); },
               {"checksum mismatch reading shard m block 4",
                e.file + " at offset " + std::to_string(e.offset), "expected xxh3"});
  // Aligned reads land in the caller's buffer: the bad block is zeroed, not returned.
  EXPECT_EQ(back.data[4 * (64 << 10) + 100], 0);
}

TEST(SwapStore, LostFilesAreErrorsNotGarbage) {
  Paths p(2);
  {
    SwapStore store(store_options(p));
    store.add_shard("s", 200000);
    Buffer src(200000);
    fill(src.data, 200000, 5);
    store.write("s", src.data);
    ASSERT_EQ(unlink(store.files()[1].c_str()), 0);
    expect_error([&] { store.read("s", src.data); },
                 {store.files()[1], "was deleted while in use"});
  }
  {
    SwapStore store(store_options(p));
    store.add_shard("s", 200000);
    Buffer src(200000);
    store.write("s", src.data);
    ASSERT_EQ(truncate(store.files()[0].c_str(), 4096), 0);
    expect_error([&] { store.read("s", src.data); }, {store.files()[0], "truncated"});
  }
}

TEST(SwapStore, ChannelsTransferAtOnceEachOnItsOwnRing) {
  // Two threads, each on its own channel (as the executor's nvme.read and nvme.write lanes),
  // write and read back their own shards at the same time, aligned and through bounce
  // buffers; every byte is checked. Under TSan (label tsan) this also checks that the store
  // shares nothing unguarded between channels.
  Paths p(2);
  SwapStoreOptions o = store_options(p, 8 << 20);
  o.channels = 2;
  SwapStore store(o);
  EXPECT_EQ(store.channels(), 2u);
  for (int c = 0; c < 2; ++c)
    for (size_t i = 0; i < kShardBytes.size(); ++i)
      store.add_shard(fmt::format("c{}-{}", c, i), kShardBytes[i]);
  constexpr int kRounds = 6;
  std::vector<std::string> failures(2);
  auto worker = [&](unsigned c) {
    try {
      for (int round = 0; round < kRounds; ++round)
        for (size_t i = 0; i < kShardBytes.size(); ++i) {
          const std::string name = fmt::format("c{}-{}", c, i);
          const uint64_t n = kShardBytes[i], shift = round % 2 == 0 ? 0 : 3;
          Buffer src(n, shift), back(n, shift);
          fill(src.data, n, 1000 * c + 10 * static_cast<uint64_t>(round) + i);
          store.write(name, src.data, c);
          store.read(name, back.data, c);
          if (first_difference(src.data, back.data, n) != -1) {
            failures[c] = name + " came back different";
            return;
          }
        }
    } catch (const Error& e) {
      failures[c] = e.what();
    }
  };
  std::thread t0(worker, 0u), t1(worker, 1u);
  t0.join();
  t1.join();
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
  uint64_t requests = 0;
  for (uint64_t n : kShardBytes) requests += 2 * ((n + o.stripe - 1) / o.stripe);
  EXPECT_EQ(store.io_stats().requests, 2 * kRounds * requests);
  Buffer b(1, 0);
  expect_error([&] { store.read("c0-2", b.data, 2); }, {"channel 2", "has 2 (0..1)"});
  Paths q(1);
  expect_error(
      [&] {
        SwapStoreOptions bad = store_options(q);
        bad.channels = 0;
        SwapStore none(bad);
      },
      {"0 channels", "1 to 64"});
}

TEST(SwapStore, SetUpErrorsNameThePathAndWhatToDo) {
  Paths p(1);
  expect_error(
      [&] {
        SwapStoreOptions o = store_options(p);
        o.paths.push_back(p.names[0] + "/missing");
        SwapStore store(o);
      },
      {p.names[0] + "/missing", "does not exist", "create it"});
  expect_error(
      [&] {
        SwapStoreOptions o = store_options(p);
        o.paths.push_back(p.names[0] + "/.");
        SwapStore store(o);
      },
      {"listed twice"});
  for (const uint64_t stripe : {uint64_t{1000}, SwapStore::kMaxStripe * 2})
    expect_error(
        [&] {
          SwapStoreOptions o = store_options(p);
          o.stripe = stripe;
          SwapStore store(o);
        },
        {fmt::format("stripe {} is not a positive multiple of 4 KiB up to 256 MiB", stripe)});
  expect_error([&] { SwapStore store(store_options(p, uint64_t{1} << 50)); },
               {"nvme_path " + p.names[0] + ": no space left (needs 1 PiB, has ", "free space"});
  {
    SwapStore first(store_options(p));
    expect_error([&] { SwapStore second(store_options(p)); },
                 {"nvme_path " + p.names[0] + " is in use by another strata run"});
    EXPECT_TRUE(fs::exists(first.files()[0]));  // the refused run removed nothing of it
  }
  EXPECT_TRUE(fs::is_empty(p.names[0]));
  SwapStore store(store_options(p, 1 << 20));
  store.add_shard("x", 1 << 20);
  expect_error([&] { store.add_shard("y", 1); }, {"no room for shard y", "raise the swap"});
  expect_error([&] { store.add_shard("x", 1); }, {"shard x already exists"});
  expect_error([&] { store.read("z", nullptr); }, {"no shard named z"});
}

}  // namespace
}  // namespace strata::nvme
