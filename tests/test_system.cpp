// test_system.cpp: hwloc topology, the host probes behind `strata info`, and the pinned pool.
//
// The `ulimit -l` cases run in a forked child (gtest death tests) that lowers
// RLIMIT_MEMLOCK and drops CAP_IPC_LOCK, so they behave the same as root and as a user.
#include "core/bytes.h"
#include "core/error.h"
#include "core/pinned_pool.h"
#include "core/system.h"
#include "core/topology.h"

#include <dirent.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include "testing.h"

namespace strata {
namespace {

using test::error_message;

constexpr uint64_t MiB = 1024 * 1024;

TEST(Topology, LoadsCoresAndNumaNodes) {
  const Topology& t = topology();
  EXPECT_GE(t.packages, 1);
  EXPECT_GE(t.cores, 1);
  EXPECT_GE(t.processing_units, t.cores);
  ASSERT_GE(t.numa_nodes.size(), 1u);
  size_t cpus = 0;
  for (const NumaNode& n : t.numa_nodes) {
    EXPECT_GE(n.os_index, 0);
    cpus += n.cpus.size();
  }
  EXPECT_GE(cpus, 1u);
  EXPECT_EQ(&topology(), &t) << "the topology is loaded once and cached";
}

TEST(Topology, UnknownPciDeviceHasNoNode) {
  EXPECT_EQ(numa_node_of_pci("ffff:ff:1f.7"), -1);
  EXPECT_EQ(numa_node_of_pci("not a bus id"), -1);
}

TEST(Topology, PciDevicesMapToKnownNodes) {
  std::set<int> nodes;
  for (const NumaNode& n : topology().numa_nodes) nodes.insert(n.os_index);
  DIR* d = opendir("/sys/bus/pci/devices");
  if (d == nullptr) GTEST_SKIP() << "no /sys/bus/pci here";
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const int node = numa_node_of_pci(e->d_name);  // -1 for devices hwloc does not keep
    EXPECT_TRUE(node == -1 || nodes.contains(node)) << e->d_name << " -> " << node;
  }
  closedir(d);
}

TEST(Topology, CpuListNotation) {
  EXPECT_EQ(format_cpu_list({}), "");
  EXPECT_EQ(format_cpu_list({3}), "3");
  EXPECT_EQ(format_cpu_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
}

TEST(System, MemoryAndLimits) {
  const MemoryInfo m = memory_info();
  EXPECT_GT(m.total, 0u);
  EXPECT_GT(m.available, 0u);
  EXPECT_LE(m.available, m.total);
  EXPECT_GT(memlock_limit(), 0u);
  EXPECT_FALSE(cpu_model().empty());
  EXPECT_FALSE(machine_arch().empty());
}

TEST(System, SimdLevelIsTheBestAvailable) {
  const SimdInfo s = cpu_simd();
  ASSERT_FALSE(s.best.empty());
#if defined(__x86_64__) || defined(__aarch64__)
  ASSERT_FALSE(s.available.empty());
  EXPECT_EQ(s.best, s.available.front());
#endif
}

TEST(System, IoUringProbeReportsInsteadOfThrowing) {
  const IoUringProbe p = probe_io_uring();
  EXPECT_FALSE(p.detail.empty());
  if (!p.works) GTEST_SKIP() << "io_uring does not work here: " << p.detail;
  EXPECT_TRUE(p.read);
  EXPECT_TRUE(p.write);
}

int entries_in(const std::string& dir) {
  int n = 0;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ++n;
  closedir(d);
  return n;
}

TEST(System, ODirectProbeLeavesNothingBehind) {
  const char* base = std::getenv("TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/strata-odirect-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const ODirectProbe p = probe_o_direct(dir);
  EXPECT_NE(p.result, ODirect::not_writable) << p.detail;
  if (p.result == ODirect::no) {
    EXPECT_FALSE(p.detail.empty());
  }
  EXPECT_EQ(entries_in(dir), 0);
  rmdir(dir.c_str());

  const ODirectProbe missing = probe_o_direct("/nonexistent/strata");
  EXPECT_NE(missing.result, ODirect::yes);
  EXPECT_FALSE(missing.detail.empty());
}

TEST(System, SwapFilesystemsSkipPseudoAndDuplicates) {
  std::set<std::string> mounts;
  for (const Filesystem& fs : swap_filesystems()) {
    EXPECT_TRUE(mounts.insert(fs.mount_point).second) << fs.mount_point << " listed twice";
    for (const char* pseudo : {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "devtmpfs"})
      EXPECT_NE(fs.type, pseudo) << fs.mount_point;
    EXPECT_GT(fs.total_bytes, 0u) << fs.mount_point;
    EXPECT_LE(fs.free_bytes, fs.total_bytes) << fs.mount_point;
    if (!fs.writable) {
      EXPECT_EQ(fs.o_direct.result, ODirect::not_writable) << fs.mount_point;
    }
  }
}

// ---- pinned pool ----

PinnedPoolOptions host_pool(uint64_t capacity, bool require_locked = false) {
  PinnedPoolOptions o;
  o.capacity = capacity;
  o.require_locked = require_locked;
  o.cuda = false;  // the mlock path is what these tests are about
  return o;
}

TEST(PinnedPool, AllocateReleaseReuse) {
  PinnedPool pool(host_pool(1 * MiB));
  EXPECT_EQ(pool.capacity(), 1 * MiB);
  char* a = static_cast<char*>(pool.allocate(256 * 1024, "buffer a"));
  char* b = static_cast<char*>(pool.allocate(100, "buffer b"));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % PinnedPool::kAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % PinnedPool::kAlignment, 0u);
  EXPECT_NE(a, b);
  std::memset(a, 0xab, 256 * 1024);  // the memory is real and writable
  std::memset(b, 0xcd, 100);
  EXPECT_EQ(pool.stats().allocations, 2u);
  pool.release(a);
  char* again = static_cast<char*>(pool.allocate(256 * 1024, "buffer c"));
  EXPECT_EQ(again, a) << "a released block is reused";
  pool.release(again);
  pool.release(b);
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_GE(pool.stats().high_water, 256u * 1024 + 4096);
}

TEST(PinnedPool, LockedWhenTheLimitAllows) {
  PinnedPool pool(host_pool(1 * MiB));
  const uint64_t limit = memlock_limit();
  if (!can_lock_past_limit() && limit != kUnlimited && limit < 2 * MiB + locked_bytes())
    GTEST_SKIP() << "ulimit -l is " << format_bytes(limit) << ": too low to lock 1 MiB here";
  EXPECT_EQ(pool.pinning(), Pinning::locked);
  EXPECT_EQ(pinning_name(pool.pinning()), "locked");
}

TEST(PinnedPool, ExhaustionNamesTheCap) {
  PinnedPool pool(host_pool(1 * MiB));
  void* a = pool.allocate(768 * 1024, "first");
  const std::string e = error_message([&] { pool.allocate(512 * 1024, "optimizer buffer"); });
  EXPECT_NE(e.find("pinned pool"), std::string::npos) << e;
  EXPECT_NE(e.find("cap 1 MiB"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer buffer"), std::string::npos) << e;
  EXPECT_NE(e.find("--cpu-memory"), std::string::npos) << e;
  pool.release(a);
  const std::string big = error_message([&] { pool.allocate(2 * MiB, "too big"); });
  EXPECT_NE(big.find("cap 1 MiB"), std::string::npos) << big;
}

TEST(PinnedPool, ForeignPointersAndZeroCapacityAreErrors) {
  PinnedPool pool(host_pool(64 * 1024));
  int outside = 0;
  EXPECT_NE(error_message([&] { pool.release(&outside); }).find("not in the pool"),
            std::string::npos);
  EXPECT_NE(error_message([] { PinnedPool p(host_pool(0)); }).find("capacity is 0"),
            std::string::npos);
}

TEST(PinnedPool, MoreThanMemAvailableIsRefusedWithTheNumbers) {
  const MemoryInfo m = memory_info();
  const std::string e = error_message([&] { PinnedPool p(host_pool(m.available + 1024 * MiB)); });
  EXPECT_NE(e.find("MemAvailable"), std::string::npos) << e;
  EXPECT_NE(e.find("--cpu-memory"), std::string::npos) << e;
}

TEST(PinnedPool, NumaPlacement) {
  PinnedPoolOptions o = host_pool(1 * MiB);
  o.numa_node = topology().numa_nodes.front().os_index;
  PinnedPool pool(o);  // binding is best effort: it may warn, never fail, on a real node
  std::memset(pool.allocate(4096, "probe"), 1, 4096);
  o.numa_node = 100000;
  const std::string e = error_message([&] { PinnedPool p(o); });
  EXPECT_NE(e.find("NUMA node 100000 does not exist"), std::string::npos) << e;
}

// In a forked child: make `ulimit -l` 64 KiB binding, even for root.
void limit_memlock_to_64k() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2]{};
  if (syscall(SYS_capget, &header, caps) == 0) {
    caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    syscall(SYS_capset, &header, caps);
  }
  rlimit r{};
  getrlimit(RLIMIT_MEMLOCK, &r);
  r.rlim_cur = 64 * 1024;
  if (r.rlim_max != RLIM_INFINITY && r.rlim_max < r.rlim_cur) r.rlim_cur = r.rlim_max;
  setrlimit(RLIMIT_MEMLOCK, &r);
}

TEST(PinnedPoolDeathTest, RequireLockedPastUlimitNamesIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        limit_memlock_to_64k();
        const std::string e = error_message([] { PinnedPool p(host_pool(8 * MiB, true)); });
        std::fprintf(stderr, "%s\n", e.c_str());
        std::exit(e.find("cannot lock 8 MiB: ulimit -l is 64 KiB") != std::string::npos ? 0 : 1);
      },
      testing::ExitedWithCode(0), "ulimit -l unlimited.*pin_memory false");
}

TEST(PinnedPoolDeathTest, PastUlimitFallsBackToUnlockedMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        limit_memlock_to_64k();
        PinnedPool pool(host_pool(8 * MiB, false));
        std::memset(pool.allocate(8 * MiB, "all of it"), 7, 8 * MiB);
        std::exit(pool.pinning() == Pinning::unlocked ? 0 : 1);
      },
      testing::ExitedWithCode(0), "using 8 MiB of unlocked memory");
}

}  // namespace
}  // namespace strata
