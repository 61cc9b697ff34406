// system.h: facts about the host that sizing and `strata info` rely on: RAM, the
// pinned-memory limit, the CPU and its SIMD level, whether io_uring works, and which
// mounted filesystems could hold NVMe swap (and whether they take O_DIRECT).
//
// Probes report what they find and never throw for a missing feature (a container that
// blocks io_uring, a filesystem that refuses O_DIRECT): the answer says so. Only an
// unreadable /proc (memory_info) is an Error. Linux only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// From /proc/meminfo, in bytes.
struct MemoryInfo {
  uint64_t total = 0;
  uint64_t available = 0;
};
MemoryInfo memory_info();

// The soft RLIMIT_MEMLOCK (what `ulimit -l` shows) in bytes; kUnlimited when unlimited.
inline constexpr uint64_t kUnlimited = UINT64_MAX;
uint64_t memlock_limit();
// Bytes this process has locked now (VmLck in /proc/self/status).
uint64_t locked_bytes();
// True when the process may lock memory past RLIMIT_MEMLOCK (CAP_IPC_LOCK is effective).
bool can_lock_past_limit();

// "AMD EPYC 7763 64-Core Processor" from /proc/cpuinfo; the machine name (uname -m) when
// there is no model name (some ARM kernels).
std::string cpu_model();
std::string machine_arch();  // uname -m: "x86_64", "aarch64"

// The SIMD level xsimd selects at run time ("avx512bw", "fma3+avx2", "sse4.2", "neon") and
// every level this CPU offers, best first.
struct SimdInfo {
  std::string best;
  std::vector<std::string> available;
};
SimdInfo cpu_simd();

// Sets up a small ring, round-trips a NOP, and asks which opcodes the kernel supports.
struct IoUringProbe {
  bool works = false;
  std::string detail;  // what worked, or the failing call and errno
  bool read = false;   // IORING_OP_READ supported
  bool write = false;  // IORING_OP_WRITE supported
};
IoUringProbe probe_io_uring();

enum class ODirect { yes, no, not_writable };
struct ODirectProbe {
  ODirect result = ODirect::no;
  std::string detail;  // the refusing call and errno when result is not yes
};
// Opens an unnamed temporary file in directory `dir` with O_DIRECT (O_TMPFILE, else
// mkostemp + unlink) and writes one aligned 4 KiB block. Leaves nothing behind.
ODirectProbe probe_o_direct(const std::string& dir);

struct Filesystem {
  std::string mount_point;
  std::string type;    // "ext4", "xfs", "tmpfs", "overlay"
  std::string device;  // "/dev/nvme0n1p1"
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;  // available to unprivileged users (statvfs f_bavail)
  bool writable = false;
  ODirectProbe o_direct;
};
// Each mounted filesystem (from /proc/self/mounts) that could hold swap: pseudo
// filesystems (proc, sysfs, cgroup, devtmpfs...), anything mounted under /proc or /sys,
// and mount points that are not directories are skipped; a mount point mounted twice is listed once
// (the visible one). Probes O_DIRECT on each writable one.
std::vector<Filesystem> swap_filesystems();

}  // namespace strata
