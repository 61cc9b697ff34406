// system.cpp: reads /proc, getrlimit, cpuid (through xsimd), a throwaway io_uring, and
// statvfs. Each probe cleans up after itself: the io_uring is torn down and the O_DIRECT
// test file is unnamed (O_TMPFILE) or unlinked before it is written.
#include "core/system.h"

#include "core/error.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/capability.h>
#include <mntent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <xsimd/xsimd.hpp>

namespace strata {
namespace {

// The value of "key:" in a /proc file of "key: value" lines, or "" when absent.
std::string proc_field(const char* path, std::string_view key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0) {
      size_t i = key.size();
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      if (i < line.size() && line[i] != ':') continue;  // a longer key with this prefix
      ++i;
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      return line.substr(i);
    }
  }
  return "";
}

// "24683620 kB" -> bytes.
uint64_t kib_field(const char* path, std::string_view key) {
  const std::string v = proc_field(path, key);
  if (v.empty()) return 0;
  return std::strtoull(v.c_str(), nullptr, 10) * 1024;
}

}  // namespace

MemoryInfo memory_info() {
  std::ifstream probe("/proc/meminfo");
  if (!probe)
    fail("cannot read /proc/meminfo ({}); strata needs a Linux /proc to size host memory",
         errno_text(errno));
  MemoryInfo m;
  m.total = kib_field("/proc/meminfo", "MemTotal");
  m.available = kib_field("/proc/meminfo", "MemAvailable");
  if (m.available == 0) m.available = kib_field("/proc/meminfo", "MemFree");  // kernels < 3.14
  return m;
}

uint64_t memlock_limit() {
  rlimit r{};
  if (getrlimit(RLIMIT_MEMLOCK, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return kUnlimited;
  return static_cast<uint64_t>(r.rlim_cur);
}

uint64_t locked_bytes() {
  return kib_field("/proc/self/status", "VmLck");
}

bool can_lock_past_limit() {
  const std::string eff = proc_field("/proc/self/status", "CapEff");
  if (eff.empty()) return false;
  const uint64_t caps = std::strtoull(eff.c_str(), nullptr, 16);
  return (caps >> CAP_IPC_LOCK) & 1u;
}

std::string machine_arch() {
  utsname u{};
  return uname(&u) == 0 ? std::string(u.machine) : std::string("unknown");
}

std::string cpu_model() {
  std::string model = proc_field("/proc/cpuinfo", "model name");
  if (model.empty()) model = proc_field("/proc/cpuinfo", "Model");  // Raspberry Pi and friends
  return model.empty() ? machine_arch() : model;
}

SimdInfo cpu_simd() {
  const auto a = xsimd::available_architectures();
  SimdInfo s;
  // xsimd's own choice: the architecture whose version is the best available.
  xsimd::all_architectures::for_each([&](auto arch) {
    using Arch = decltype(arch);
    if (s.best.empty() && a.best != 0 && Arch::version() == a.best) s.best = Arch::name();
  });
  if (s.best == "arm64+neon" || s.best == "arm32+neon") s.best = "neon";
  if (s.best.empty()) s.best = "none";
  const struct {
    const char* name;
    bool on;
  } levels[] = {
      {"avx512bw", a.avx512bw && a.avx512dq && a.avx512cd && a.avx512f},
      {"avx512dq", a.avx512dq && a.avx512cd && a.avx512f},
      {"avx512cd", a.avx512cd && a.avx512f},
      {"avx512f", a.avx512f != 0},
      {"fma3+avx2", a.fma3_avx2 != 0},
      {"avx2", a.avx2 != 0},
      {"fma3+avx", a.fma3_avx != 0},
      {"avx", a.avx != 0},
      {"fma4", a.fma4 != 0},
      {"fma3+sse4.2", a.fma3_sse && a.sse4_2},
      {"sse4.2", a.sse4_2 != 0},
      {"sse4.1", a.sse4_1 != 0},
      {"ssse3", a.ssse3 != 0},
      {"sse3", a.sse3 != 0},
      {"sse2", a.sse2 != 0},
      {"neon", a.neon || a.neon64},
  };
  for (const auto& l : levels)
    if (l.on) s.available.emplace_back(l.name);
  return s;
}

IoUringProbe probe_io_uring() {
  IoUringProbe p;
  io_uring ring{};
  int rc = io_uring_queue_init(8, &ring, 0);
  if (rc < 0) {
    p.detail = "io_uring_queue_init: " + errno_text(-rc);
    if (-rc == ENOSYS) p.detail += " (this kernel has no io_uring; it needs Linux 5.1+)";
    if (-rc == EPERM) {
      std::ifstream sysctl("/proc/sys/kernel/io_uring_disabled");
      int value = 0;
      if (sysctl >> value && value != 0)
        p.detail += " (sysctl kernel.io_uring_disabled=" + std::to_string(value) + ")";
      else
        p.detail += " (blocked, usually by a container's seccomp profile)";
    }
    return p;
  }
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, 0x5354524154ull);
  rc = io_uring_submit(&ring);
  io_uring_cqe* cqe = nullptr;
  if (rc != 1) {
    p.detail = "io_uring_submit of a NOP: " + (rc < 0 ? errno_text(-rc) : std::to_string(rc));
  } else if ((rc = io_uring_wait_cqe(&ring, &cqe)) < 0) {
    p.detail = "io_uring_wait_cqe for a NOP: " + errno_text(-rc);
  } else if (cqe->res < 0 || io_uring_cqe_get_data64(cqe) != 0x5354524154ull) {
    p.detail = "NOP completed with " + (cqe->res < 0 ? errno_text(-cqe->res) : "wrong user data");
    io_uring_cqe_seen(&ring, cqe);
  } else {
    io_uring_cqe_seen(&ring, cqe);
    p.works = true;
    p.detail = "NOP round trip on an 8-entry ring";
  }
  if (io_uring_probe* probe = io_uring_get_probe_ring(&ring)) {
    p.read = io_uring_opcode_supported(probe, IORING_OP_READ) != 0;
    p.write = io_uring_opcode_supported(probe, IORING_OP_WRITE) != 0;
    io_uring_free_probe(probe);
  } else if (p.works) {
    p.detail += "; opcode probe unsupported (kernel older than 5.6)";
  }
  io_uring_queue_exit(&ring);
  return p;
}

namespace {

bool refused_for_permission(int err) {
  return err == EACCES || err == EPERM || err == EROFS;
}

// Writes one aligned 4 KiB block to `fd` (opened with O_DIRECT) and closes it.
ODirectProbe write_direct(int fd) {
  ODirectProbe p;
  void* block = std::aligned_alloc(4096, 4096);
  std::memset(block, 0, 4096);
  const ssize_t n = pwrite(fd, block, 4096, 0);
  const int err = errno;
  std::free(block);
  close(fd);
  if (n == 4096) {
    p.result = ODirect::yes;
  } else {
    p.result = n < 0 && refused_for_permission(err) ? ODirect::not_writable : ODirect::no;
    p.detail = "4 KiB O_DIRECT write: " + (n < 0 ? errno_text(err) : "short write");
  }
  return p;
}

ODirectProbe refused(ODirect result, std::string what, int err) {
  return ODirectProbe{result, std::move(what) + ": " + errno_text(err)};
}

}  // namespace

ODirectProbe probe_o_direct(const std::string& dir) {
  int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) return write_direct(fd);
  int err = errno;
  if (refused_for_permission(err)) return refused(ODirect::not_writable, "create a file", err);
  // Is O_TMPFILE or O_DIRECT the problem? A plain O_TMPFILE open tells them apart.
  fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) {
    close(fd);
    return refused(ODirect::no, "open with O_DIRECT", err);
  }
  // No O_TMPFILE here (older kernels, some network and FUSE filesystems): a named file,
  // unlinked as soon as it exists.
  std::string name = dir + (dir.ends_with('/') ? "" : "/") + ".strata-odirect-XXXXXX";
  fd = mkostemp(name.data(), O_DIRECT | O_CLOEXEC);
  if (fd >= 0) {
    unlink(name.c_str());
    return write_direct(fd);
  }
  err = errno;
  if (refused_for_permission(err)) return refused(ODirect::not_writable, "create a file", err);
  name = dir + (dir.ends_with('/') ? "" : "/") + ".strata-odirect-XXXXXX";
  fd = mkostemp(name.data(), O_CLOEXEC);
  if (fd >= 0) {
    unlink(name.c_str());
    close(fd);
    return refused(ODirect::no, "open with O_DIRECT", err);
  }
  const int plain_err = errno;
  return refused(refused_for_permission(plain_err) ? ODirect::not_writable : ODirect::no,
                 "create a file", plain_err);
}

std::vector<Filesystem> swap_filesystems() {
  static const std::set<std::string, std::less<>> pseudo = {"proc",
                                                            "sysfs",
                                                            "cgroup",
                                                            "cgroup2",
                                                            "devpts",
                                                            "mqueue",
                                                            "debugfs",
                                                            "tracefs",
                                                            "securityfs",
                                                            "pstore",
                                                            "bpf",
                                                            "configfs",
                                                            "fusectl",
                                                            "hugetlbfs",
                                                            "autofs",
                                                            "binfmt_misc",
                                                            "nsfs",
                                                            "devtmpfs",
                                                            "rpc_pipefs",
                                                            "efivarfs",
                                                            "selinuxfs",
                                                            "fuse.lxcfs",
                                                            "fuse.gvfsd-fuse",
                                                            "fuse.portal",
                                                            "squashfs",
                                                            "iso9660",
                                                            "nfsd",
                                                            "ramfs"};
  std::vector<Filesystem> out;
  std::map<std::string, size_t> seen;  // mount point -> index in out
  FILE* mounts = setmntent("/proc/self/mounts", "r");
  if (mounts == nullptr) return out;
  mntent entry{};
  char buf[4096];
  while (getmntent_r(mounts, &entry, buf, sizeof buf) != nullptr) {
    if (pseudo.contains(entry.mnt_type)) continue;
    const std::string_view dir = entry.mnt_dir;
    if (dir.starts_with("/proc/") || dir.starts_with("/sys/")) continue;  // kernel interfaces
    struct stat st {};
    if (stat(entry.mnt_dir, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    Filesystem fs;
    fs.mount_point = entry.mnt_dir;
    fs.type = entry.mnt_type;
    fs.device = entry.mnt_fsname;
    auto [it, fresh] = seen.emplace(fs.mount_point, out.size());
    if (fresh)
      out.push_back(std::move(fs));
    else
      out[it->second] = std::move(fs);  // mounted over: the later mount is the visible one
  }
  endmntent(mounts);

  std::vector<Filesystem> usable;
  for (Filesystem& fs : out) {
    struct statvfs v {};
    if (statvfs(fs.mount_point.c_str(), &v) != 0 || v.f_blocks == 0) continue;
    fs.total_bytes = static_cast<uint64_t>(v.f_blocks) * v.f_frsize;
    fs.free_bytes = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
    fs.writable = (v.f_flag & ST_RDONLY) == 0 && access(fs.mount_point.c_str(), W_OK) == 0;
    if (fs.writable)
      fs.o_direct = probe_o_direct(fs.mount_point);
    else
      fs.o_direct = {ODirect::not_writable, "mounted read-only or not writable by this user"};
    if (fs.o_direct.result == ODirect::not_writable) fs.writable = false;
    usable.push_back(std::move(fs));
  }
  return usable;
}

}  // namespace strata
