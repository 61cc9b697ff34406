// bench_io.cpp: `strata bench io`, the io_uring engine's bandwidth and IOPS on one file in
// --path, to set beside fio's (bench/io_vs_fio.sh runs both with the same size, block size
// and queue depth).
//
// Every byte is checked: each 4 KiB page of the file holds its own offset in its first 8
// bytes and a fixed random pattern after it, so writes only stamp offsets into ready
// buffers and reads are checked inside the timed loop, as each block lands, at memcmp speed.
// Write runs are read back and checked (untimed) before the speed is printed; a wrong byte
// is an error, not a result. Each thread has its own ring and its own slice of the file.
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/system.h"
#include "nvme/io_ring.h"
#include "nvme/swap_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <latch>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

namespace strata::cli {

namespace {

using nvme::IoOp;
using nvme::IoRequest;
using nvme::IoRing;
constexpr uint64_t kPage = 4096;

struct IoBench {
  std::vector<std::string> paths;
  std::string size = "1GiB";
  std::string block = "1MiB";
  unsigned qd = 32;
  unsigned threads = 1;
  std::string rw = "read";
  bool buffered = false;
  bool store = false;
  bool json = false;
};

// The fixed bytes after each page's offset stamp.
const std::vector<char>& page_pattern() {
  static const std::vector<char> pattern = [] {
    std::vector<char> p(kPage - 8);
    std::mt19937_64 rng(0x5354524154ull);
    for (char& c : p) c = static_cast<char>(rng());
    return p;
  }();
  return pattern;
}

void stamp(char* buf, uint64_t offset, uint64_t len) {
  for (uint64_t p = 0; p < len; p += kPage) {
    const uint64_t at = offset + p;
    std::memcpy(buf + p, &at, 8);
  }
}

void check(const char* buf, uint64_t offset, uint64_t len, const std::string& file) {
  const std::vector<char>& pattern = page_pattern();
  for (uint64_t p = 0; p < len; p += kPage) {
    uint64_t at = 0;
    std::memcpy(&at, buf + p, 8);
    if (at != offset + p || std::memcmp(buf + p + 8, pattern.data(), pattern.size()) != 0)
      fail(
          "bench io: {} read back wrong at offset {} (page stamp {}, expected {}); the drive "
          "or the I/O engine returned bad data, so no speed is reported",
          file, offset + p, at, offset + p);
  }
}

// One pass of one thread over blocks [first, last) of the file, in order or shuffled.
void pass(const IoBench& o, const std::string& file, IoOp op, bool random, bool verify,
          uint64_t block, uint64_t first, uint64_t last, unsigned thread, std::latch* start,
          bool* arrived, bool* direct) {
  nvme::IoOptions io;
  io.queue_depth = o.qd;
  io.direct = !o.buffered;
  io.register_buffers = true;
  io.register_files = true;
  IoRing ring(io);
  const int f = ring.add_file(file, false);
  if (direct != nullptr) *direct = ring.is_direct(f);
  const uint64_t slots = std::min<uint64_t>(o.qd, std::max<uint64_t>(last - first, 1));
  std::unique_ptr<char, decltype(&std::free)> mem(
      static_cast<char*>(std::aligned_alloc(kPage, slots * block)), &std::free);
  if (!mem) fail("bench io: cannot allocate {} of buffers", format_bytes(slots * block));
  for (uint64_t b = 0; b < slots * block; b += kPage) {
    std::memcpy(mem.get() + b + 8, page_pattern().data(), kPage - 8);
  }
  ring.register_buffer(mem.get(), slots * block);
  std::vector<uint64_t> order(last - first);
  for (uint64_t i = 0; i < order.size(); ++i) order[i] = first + i;
  if (random) std::shuffle(order.begin(), order.end(), std::mt19937_64(1234 + thread));
  std::vector<char*> free_slots;
  for (uint64_t s = 0; s < slots; ++s) free_slots.push_back(mem.get() + s * block);
  ring.on_complete([&](const IoRequest& r) {
    char* buf = static_cast<char*>(r.buf);
    if (op == IoOp::read && verify) check(buf, r.offset, r.len, file);
    free_slots.push_back(buf);
  });
  if (start != nullptr) {
    start->arrive_and_wait();
    *arrived = true;
  }
  for (uint64_t b : order) {
    while (free_slots.empty()) ring.wait_one();
    char* buf = free_slots.back();
    free_slots.pop_back();
    if (op == IoOp::write) stamp(buf, b * block, block);
    ring.submit(IoRequest{op, f, b * block, buf, block});
  }
  ring.wait_all();
}

// Runs `threads` passes over the whole file at once; returns seconds from the common start.
double run_threads(const IoBench& o, const std::string& file, IoOp op, bool random, bool verify,
                   uint64_t block, uint64_t blocks, bool* direct) {
  std::latch start(o.threads + 1);
  std::vector<std::exception_ptr> errors(o.threads);
  std::unique_ptr<bool[]> arrived(new bool[o.threads]());
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < o.threads; ++t)
    workers.emplace_back([&, t] {
      try {
        pass(o, file, op, random, verify, block, blocks * t / o.threads,
             blocks * (t + 1) / o.threads, t, &start, &arrived[t], t == 0 ? direct : nullptr);
      } catch (...) {
        errors[t] = std::current_exception();
        if (!arrived[t]) start.count_down();  // let the others (and the clock) start
      }
    });
  start.arrive_and_wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (std::thread& w : workers) w.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return seconds;
}

// --store: the swap store end to end (striping, checksums, verification) over every --path,
// stripe = --block, in shards of up to 64 MiB written from and read into one buffer per
// thread. With --threads T the store has T channels (a ring each) and thread t moves shards
// t, t + T, ... on channel t, all at once. Only the store's calls are timed, per thread; the
// content check after each read is not (the store's own checksum check is). Returns the
// slowest thread's timed seconds.
double run_store(const IoBench& o, uint64_t size, uint64_t block, IoOp op, bool* direct) {
  if (o.rw != "read" && o.rw != "write")
    fail("bench io: --store measures --rw read or write, not {}", o.rw);
  if (o.threads > 64) fail("bench io: --store --threads {}: the store takes 1 to 64", o.threads);
  nvme::SwapStoreOptions so;
  so.paths = o.paths;
  so.capacity = size;
  so.stripe = block;
  so.io.queue_depth = o.qd;
  so.io.direct = !o.buffered;
  so.io.register_files = true;
  so.channels = o.threads;
  nvme::SwapStore store(so);
  const uint64_t shard =
      std::min<uint64_t>(size / o.threads, std::max<uint64_t>(block, 64ull << 20)) / block * block;
  if (shard == 0)
    fail(
        "bench io: --store: --size {} gives {} threads less than one --block {} each; raise "
        "--size or lower --threads",
        format_bytes(size), o.threads, format_bytes(block));
  const uint64_t shards = size / shard;
  for (uint64_t i = 0; i < shards; ++i) store.add_shard(fmt::format("s{}", i), shard);
  using clock = std::chrono::steady_clock;
  std::vector<double> timed(o.threads, 0.0);
  std::vector<std::exception_ptr> errors(o.threads);
  std::latch start(o.threads);
  auto worker = [&](unsigned t) {
    bool arrived = false;
    try {
      std::unique_ptr<char, decltype(&std::free)> mem(
          static_cast<char*>(std::aligned_alloc(kPage, shard)), &std::free);
      if (!mem) fail("bench io: cannot allocate a {} buffer", format_bytes(shard));
      for (uint64_t b = 0; b < shard; b += kPage)
        std::memcpy(mem.get() + b + 8, page_pattern().data(), kPage - 8);
      arrived = true;
      start.arrive_and_wait();
      clock::duration spent{};
      for (uint64_t i = t; i < shards; i += o.threads) {
        stamp(mem.get(), i * shard, shard);
        const auto t0 = clock::now();
        store.write(fmt::format("s{}", i), mem.get(), t);
        if (op == IoOp::write) spent += clock::now() - t0;
      }
      for (uint64_t i = t; i < shards; i += o.threads) {
        std::memset(mem.get(), 0, kPage);
        const auto t0 = clock::now();
        store.read(fmt::format("s{}", i), mem.get(), t);
        if (op == IoOp::read) spent += clock::now() - t0;
        check(mem.get(), i * shard, shard, store.files()[0]);
      }
      timed[t] = std::chrono::duration<double>(spent).count();
    } catch (...) {
      errors[t] = std::current_exception();
      if (!arrived) start.count_down();  // let the others start
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < o.threads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  // Whether the first path took O_DIRECT, as the ring would report it.
  *direct = !o.buffered && probe_o_direct(o.paths[0]).result == ODirect::yes;
  return *std::max_element(timed.begin(), timed.end());
}

double run_file(const IoBench& o, uint64_t size, uint64_t block, bool write, bool random,
                bool* direct) {
  const std::string file =
      (std::filesystem::path(o.paths[0]) / fmt::format("strata-bench-io.{}.bin", getpid()))
          .string();
  struct Remove {
    std::string f;
    ~Remove() { unlink(f.c_str()); }
  } remove{file};
  const int fd = open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail("bench io: cannot create {}: {}", file, errno_text(errno));
  const int rc = fallocate(fd, 0, 0, static_cast<off_t>(size));
  const int err = errno;
  close(fd);
  if (rc != 0)
    fail("bench io: preallocating {} for {} failed: {}; use a smaller --size or another --path",
         format_bytes(size), file, errno_text(err));

  const uint64_t blocks = size / block;
  double seconds = 0;
  if (write) {
    seconds = run_threads(o, file, IoOp::write, random, false, block, blocks, direct);
    run_threads(o, file, IoOp::read, false, true, block, blocks, nullptr);  // check it all
  } else {
    run_threads(o, file, IoOp::write, false, false, block, blocks, nullptr);  // untimed fill
    seconds = run_threads(o, file, IoOp::read, random, true, block, blocks, direct);
  }
  return seconds;
}

void report(const IoBench& o, uint64_t size, uint64_t block, uint64_t blocks, double seconds,
            bool direct) {
  const double bytes_per_s = static_cast<double>(size) / seconds;
  const double iops = static_cast<double>(blocks) / seconds;
  if (o.json) {
    const nlohmann::ordered_json j = {{"rw", o.rw},           {"paths", o.paths},
                                      {"store", o.store},     {"size_bytes", size},
                                      {"block_bytes", block}, {"queue_depth", o.qd},
                                      {"threads", o.threads}, {"direct", direct},
                                      {"seconds", seconds},   {"bytes_per_s", bytes_per_s},
                                      {"iops", iops},         {"verified", true}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("strata bench io: {}{} {} in {} blocks, qd {}, {} thread(s), {} on {}\n",
               o.store ? "swap store " : "", o.rw, format_bytes(size), format_bytes(block), o.qd,
               o.threads, direct ? "O_DIRECT" : "buffered", fmt::join(o.paths, ", "));
    fmt::print("  {:.3f} GB/s, {:.0f} IOPS, {:.3f} s (every byte verified)\n", bytes_per_s / 1e9,
               iops, seconds);
  }
}

int run_io(const IoBench& o) {
  const uint64_t size = parse_bytes(o.size);
  const uint64_t block = parse_bytes(o.block);
  if (block == 0 || block % kPage != 0)
    fail("bench io: --block {} is not a positive multiple of 4 KiB; use e.g. 4KiB or 1MiB",
         o.block);
  if (size < block || size % block != 0)
    fail("bench io: --size {} is not a whole number of --block {} blocks", o.size, o.block);
  if (o.threads == 0 || o.threads > 256) fail("bench io: --threads {}: use 1 to 256", o.threads);
  const bool write = o.rw == "write" || o.rw == "randwrite";
  const bool random = o.rw == "randread" || o.rw == "randwrite";
  for (const std::string& p : o.paths)
    if (!std::filesystem::is_directory(p))
      fail("bench io: --path {} is not a directory; name a directory on the drive to measure", p);
  if (o.paths.size() > 1 && !o.store)
    fail("bench io: {} --path given; striping over several needs --store", o.paths.size());
  const uint64_t blocks = size / block;
  bool direct = false;
  double seconds = 0;
  if (o.store) {
    seconds = run_store(o, size, block, write ? IoOp::write : IoOp::read, &direct);
  } else {
    seconds = run_file(o, size, block, write, random, &direct);
  }
  report(o, size, block, blocks, seconds, direct);
  return 0;
}

}  // namespace

Command add_bench_io(CLI::App& bench) {
  auto o = std::make_shared<IoBench>();
  CLI::App* app = bench.add_subcommand(
      "io", "io_uring read/write speed on a file in --path (compare: bench/io_vs_fio.sh)");
  app->add_option("--path", o->paths,
                  "directory on the drive to measure (a temporary file); repeat with --store")
      ->required();
  app->add_option("--size", o->size, "file size (default 1GiB)");
  app->add_option("--block", o->block, "block size, a multiple of 4 KiB (default 1MiB)");
  app->add_option("--qd", o->qd, "queue depth per thread (default 32)");
  app->add_option("--threads", o->threads, "I/O threads, one ring each (default 1)");
  app->add_option("--rw", o->rw, "read, write, randread or randwrite (default read)")
      ->check(CLI::IsMember({"read", "write", "randread", "randwrite"}));
  app->add_flag("--buffered", o->buffered, "no O_DIRECT (through the page cache)");
  app->add_flag("--store", o->store,
                "through the swap store: striped over every --path, checksummed, stripe = --block; "
                "--threads channels");
  app->add_flag("--json", o->json, "one JSON object (bytes_per_s, iops, ...)");
  return {app, [o] { return run_io(*o); }};
}

}  // namespace strata::cli
