// swap_store.cpp: SwapStore. A transfer walks a shard's stripe units in order and submits
// one request per unit to its channel's ring; the ring's completion hook verifies (reads) and
// copies out of bounce buffers, so a unit is checked the moment it lands. Bounce buffers are
// taken from the staging pool for the length of one call and given back however it ends.
// The store's mutex is held only to look a shard up and flip its flags, never across I/O.
#include "nvme/swap_store.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

namespace strata::nvme {

namespace fs = std::filesystem;

namespace {

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kDirectAlignment == 0;
}

// Locks the swap directory `dir` through its lock file for as long as the returned descriptor
// is open, and writes this process's id into the file. flock is dropped by the kernel when its
// holder dies, so the file a killed run leaves behind does not block the next one. An Error
// names the directory and, when another run holds it, that run's process id.
int lock_swap_directory(const std::string& dir, const std::string& lock) {
  for (int attempt = 0;; ++attempt) {
    const int fd = open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
      fail("nvme_path {}: cannot create lock file {}: {}; make the directory writable", dir, lock,
           errno_text(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char id[32] = {};
      const ssize_t n = pread(fd, id, sizeof(id) - 1, 0);
      close(fd);
      std::string holder = n > 0 ? std::string(id, static_cast<size_t>(n)) : std::string();
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      if (err == EWOULDBLOCK)
        fail(
            "nvme_path {} is in use by another strata run ({} holds the lock {}); two runs on "
            "one swap directory would overwrite each other's state: give this run its own "
            "--nvme-path (or --run-dir), or wait for that run to end",
            dir, holder.empty() ? std::string("a process") : "process " + holder, lock);
      fail("nvme_path {}: flock of {} failed: {}", dir, lock, errno_text(err));
    }
    // A run that ends unlinks the lock file while holding it: a lock taken on that unlinked
    // file locks nothing, so take the file now at the path instead.
    struct stat held {
    }, at_path{};
    if (fstat(fd, &held) == 0 && ::stat(lock.c_str(), &at_path) == 0 &&
        held.st_ino == at_path.st_ino && held.st_dev == at_path.st_dev) {
      const std::string id = std::to_string(getpid()) + "\n";
      if (ftruncate(fd, 0) != 0 ||
          pwrite(fd, id.data(), id.size(), 0) != static_cast<ssize_t>(id.size()))
        log_warn("nvme: cannot write the process id into {}: {}", lock, errno_text(errno));
      return fd;
    }
    close(fd);
    if (attempt == 100)
      fail("nvme_path {}: the lock file {} keeps being replaced; is another run starting there?",
           dir, lock);
  }
}

// Bounce buffers taken from a pool for one call; every one goes back when it ends.
class Staging {
 public:
  Staging(PinnedPool& pool, unsigned count, uint64_t bytes) : pool_(pool) {
    for (unsigned i = 0; i < count; ++i) {
      taken_.push_back(pool_.allocate(bytes, "swap store bounce buffer"));
      free_.push_back(taken_.back());
    }
  }
  ~Staging() {
    for (void* p : taken_) pool_.release(p);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  bool empty() const { return free_.empty(); }
  char* take() {
    char* p = static_cast<char*>(free_.back());
    free_.pop_back();
    return p;
  }
  void give(void* p) { free_.push_back(p); }

 private:
  PinnedPool& pool_;
  std::vector<void*> taken_;
  std::vector<void*> free_;
};

}  // namespace

SwapStore::SwapStore(SwapStoreOptions options) : options_(std::move(options)) {
  const uint64_t stripe = options_.stripe;
  if (options_.paths.empty()) fail("swap store: no nvme_path given; name at least one directory");
  if (stripe == 0 || stripe % kDirectAlignment != 0 || stripe > kMaxStripe)
    fail("swap store: stripe {} is not a positive multiple of 4 KiB up to {}; use e.g. 1 MiB",
         stripe, format_bytes(kMaxStripe));
  if (options_.capacity == 0) fail("swap store: capacity is 0; give the bytes of shards to hold");
  if (options_.channels < 1 || options_.channels > 64)
    fail("swap store: {} channels; give 1 to 64 (one per thread that transfers at once)",
         options_.channels);
  // The channels' rings number their requests together, so a fault names the store's N-th.
  if (!options_.io.request_counter)
    options_.io.request_counter = std::make_shared<std::atomic<uint64_t>>(0);
  const uint64_t k = options_.paths.size();
  const uint64_t per_path_units = (options_.capacity + stripe * k - 1) / (stripe * k);
  units_total_ = per_path_units * k;
  file_bytes_ = per_path_units * stripe;
  try {
    std::vector<fs::path> seen;
    for (const std::string& p : options_.paths) {
      std::error_code ec;
      if (!fs::is_directory(p, ec))
        fail("nvme_path {}: does not exist or is not a directory; create it or fix the path", p);
      const fs::path canonical = fs::canonical(p, ec);
      for (const fs::path& s : seen)
        if (s == canonical)
          fail("nvme_path {} is listed twice (as {}); name each directory once", p, s.string());
      seen.push_back(canonical);
    }
    // Lock every directory before touching anything in it.
    for (const std::string& p : options_.paths) {
      const std::string lock = (fs::path(p) / kLockFile).string();
      const int fd = lock_swap_directory(p, lock);
      lock_fds_.push_back(fd);
      locks_.push_back(lock);
      const std::string file = (fs::path(p) / kSwapFile).string();
      if (unlink(file.c_str()) == 0)
        log_info("nvme: removed a stale swap file {} left by an earlier run", file);
      files_.push_back(file);
    }
    // Free space, per filesystem: several paths may share one.
    std::map<dev_t, uint64_t> needed;
    std::vector<dev_t> devices;
    for (const std::string& p : options_.paths) {
      struct stat st {};
      stat(p.c_str(), &st);
      devices.push_back(st.st_dev);
      needed[st.st_dev] += file_bytes_;
    }
    for (size_t i = 0; i < options_.paths.size(); ++i) {
      struct statvfs vfs {};
      if (statvfs(options_.paths[i].c_str(), &vfs) != 0)
        fail("nvme_path {}: statvfs failed: {}", options_.paths[i], errno_text(errno));
      const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      const uint64_t need = needed[devices[i]];
      if (need > free_bytes)
        fail("nvme_path {}: no space left (needs {}, has {}); free space or add another path",
             options_.paths[i], format_bytes(need), format_bytes(free_bytes));
    }
    for (unsigned c = 0; c < options_.channels; ++c) {
      rings_.push_back(std::make_unique<IoRing>(options_.io));
      for (size_t i = 0; i < files_.size(); ++i) {
        const int index = rings_.back()->add_file(files_[i], true);
        if (c == 0) ring_files_.push_back(index);
        if (index != ring_files_[i])
          fail("swap store: ring {} numbered {} as file {}, ring 0 as {}", c, files_[i], index,
               ring_files_[i]);
      }
      if (options_.staging != nullptr && options_.io.register_buffers)
        rings_.back()->register_buffer(options_.staging->base(), options_.staging->capacity());
    }
    staging_registered_.assign(rings_.size(), 0);
    for (size_t i = 0; i < files_.size(); ++i) {
      const std::string& file = files_[i];
      const int fd = rings_[0]->fd(ring_files_[i]);
      int rc = fallocate(fd, 0, 0, static_cast<off_t>(file_bytes_));
      if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
        warn_once("nvme-fallocate",
                  "nvme: {} does not support fallocate; the swap file is "
                  "sparse and a full disk shows up only when writing",
                  file);
        rc = ftruncate(fd, static_cast<off_t>(file_bytes_));
      }
      if (rc != 0) {
        const int err = errno;
        fail("nvme_path {}: preallocating {} for {} failed: {}; {}",
             fs::path(file).parent_path().string(), format_bytes(file_bytes_), file,
             errno_text(err), err == ENOSPC ? "free space or add another path" : "check the path");
      }
    }
  } catch (...) {
    remove_files();
    throw;
  }
}

SwapStore::~SwapStore() {
  remove_files();
}

void SwapStore::remove_files() noexcept {
  rings_.clear();  // each waits for anything in flight and closes its descriptors
  for (size_t i = 0; i < lock_fds_.size(); ++i) {
    unlink(files_[i].c_str());
    unlink(locks_[i].c_str());
    close(lock_fds_[i]);
  }
  lock_fds_.clear();
}

IoStats SwapStore::io_stats() const {
  IoStats t;
  for (const auto& ring : rings_) {
    const IoStats& s = ring->stats();
    t.requests += s.requests;
    t.bytes += s.bytes;
    t.resumed += s.resumed;
    t.requeued += s.requeued;
    t.buffered_parts += s.buffered_parts;
    t.fixed_buffers += s.fixed_buffers;
  }
  return t;
}

void SwapStore::add_shard(const std::string& name, uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (shards_.contains(name))
    fail("swap store: shard {} already exists; give each shard its own name", name);
  const uint64_t units = (bytes + options_.stripe - 1) / options_.stripe;
  if (units_used_ + units > units_total_)
    fail("swap store: no room for shard {} ({}): {} of {} are taken; raise the swap capacity", name,
         format_bytes(bytes), format_bytes(units_used_ * options_.stripe),
         format_bytes(units_total_ * options_.stripe));
  Shard s;
  s.start = units_used_;
  s.bytes = bytes;
  s.checksums.assign(units, 0);
  shards_.emplace(name, std::move(s));
  units_used_ += units;
}

const SwapStore::Shard& SwapStore::shard(const std::string& name) const {
  const auto it = shards_.find(name);
  if (it == shards_.end()) fail("swap store: no shard named {}; add_shard it first", name);
  return it->second;
}

uint64_t SwapStore::shard_bytes(const std::string& name) const {
  std::lock_guard lock(mu_);
  return shard(name).bytes;
}

uint64_t SwapStore::place(uint64_t unit, int* file) const {
  const uint64_t k = files_.size();
  *file = ring_files_[unit % k];
  return unit / k * options_.stripe;
}

Extent SwapStore::locate(uint64_t unit, uint64_t bytes) const {
  int file = 0;
  const uint64_t offset = place(unit, &file);
  return Extent{files_[unit % files_.size()], offset, bytes};
}

std::vector<Extent> SwapStore::extents(const std::string& name) const {
  std::lock_guard lock(mu_);
  const Shard& s = shard(name);
  std::vector<Extent> out;
  for (uint64_t i = 0; i * options_.stripe < s.bytes; ++i)
    out.push_back(locate(s.start + i, std::min(options_.stripe, s.bytes - i * options_.stripe)));
  return out;
}

void SwapStore::check_files() const {
  for (size_t i = 0; i < files_.size(); ++i) {
    struct stat st {};
    if (fstat(rings_[0]->fd(ring_files_[i]), &st) != 0)
      fail("swap file {}: fstat failed: {}", files_[i], errno_text(errno));
    if (st.st_nlink == 0)
      fail(
          "swap file {} was deleted while in use; the shards on it are lost; never clean an "
          "nvme_path while strata runs",
          files_[i]);
    if (static_cast<uint64_t>(st.st_size) < file_bytes_)
      fail(
          "swap file {} is {} but was preallocated to {}: it was truncated while in use and "
          "the shards on it are lost",
          files_[i], format_bytes(st.st_size), format_bytes(file_bytes_));
  }
}

void SwapStore::write(const std::string& name, const void* src, unsigned channel) {
  transfer(name, IoOp::write, static_cast<char*>(const_cast<void*>(src)), channel);
}

void SwapStore::read(const std::string& name, void* dst, unsigned channel) {
  transfer(name, IoOp::read, static_cast<char*>(dst), channel);
}

// The staging pool for callers whose buffers are not 4 KiB aligned (the caller's, else one of
// the store's own, made on first need with a queue's worth of stripes per channel), registered
// with `channel`'s ring when fixed buffers are asked for. Called by that channel's thread
// between transfers, so its ring is idle.
PinnedPool& SwapStore::staging_pool(unsigned channel) {
  if (options_.staging != nullptr) return *options_.staging;
  std::lock_guard lock(mu_);
  if (!own_staging_) {
    const uint64_t bytes = uint64_t{options_.io.queue_depth} * options_.stripe * rings_.size();
    own_staging_ = std::make_unique<PinnedPool>(PinnedPoolOptions{bytes, false, -1, false});
  }
  if (options_.io.register_buffers && !staging_registered_[channel]) {
    rings_[channel]->register_buffer(own_staging_->base(), own_staging_->capacity());
    staging_registered_[channel] = 1;
  }
  return *own_staging_;
}

uint64_t SwapStore::own_staging_bytes() const {
  std::lock_guard lock(mu_);
  return own_staging_ ? own_staging_->capacity() : 0;
}

void SwapStore::transfer(const std::string& name, IoOp op, char* data, unsigned channel) {
  if (channel >= rings_.size())
    fail("swap store: {} of shard {} on channel {}, but the store has {} (0..{})",
         op == IoOp::read ? "read" : "write", name, channel, rings_.size(), rings_.size() - 1);
  IoRing& ring = *rings_[channel];
  Shard* sp = nullptr;
  {
    std::lock_guard lock(mu_);
    shard(name);  // throws naming an unknown shard
    sp = &shards_.find(name)->second;
    if (op == IoOp::read && !sp->written)
      fail(
          "swap store: shard {} has no data (never written, or its last write failed); write it "
          "before reading it",
          name);
    if (sp->busy)
      fail(
          "swap store: shard {} is being transferred by another thread; reads and writes of one "
          "shard must be ordered by the caller",
          name);
    if (sp->checksums.empty()) {
      sp->written = op == IoOp::write || sp->written;
      return;
    }
    sp->busy = true;
    if (op == IoOp::write) sp->written = false;  // until every block is on the drive
  }
  Shard& s = *sp;
  struct Idle {
    std::mutex& mu;
    Shard& s;
    ~Idle() {
      std::lock_guard lock(mu);
      s.busy = false;
    }
  } idle{mu_, s};
  const uint64_t stripe = options_.stripe;
  const uint64_t units = s.checksums.size();
  check_files();

  std::unique_ptr<Staging> staging;
  if (!aligned(data))
    staging = std::make_unique<Staging>(
        staging_pool(channel),
        static_cast<unsigned>(std::min<uint64_t>(options_.io.queue_depth, units)), stripe);

  auto block_bytes = [&](uint64_t i) { return std::min(stripe, s.bytes - i * stripe); };
  // No allocation per transfer: the hook the ring keeps holds one reference, which
  // std::function stores in place, to this closure on the stack.
  auto complete = [&](const IoRequest& r) {
    const uint64_t i = r.tag;
    char* out = data + i * stripe;
    if (op == IoOp::read) {
      const uint64_t actual = XXH3_64bits(r.buf, r.len);
      if (actual != s.checksums[i]) {
        if (r.buf == out) std::memset(out, 0, r.len);  // never leave corrupt data behind
        if (staging) staging->give(r.buf);
        const Extent e = locate(s.start + i, r.len);
        fail(
            "swap store: checksum mismatch reading shard {} block {}: {} at offset {} ({}): "
            "expected xxh3 {:016x}, got {:016x}; the data on the drive is corrupt (check "
            "`dmesg` and the drive's health) and the shard cannot be used",
            name, i, e.file, e.offset, format_bytes(r.len), s.checksums[i], actual);
      }
      if (r.buf != out) std::memcpy(out, r.buf, r.len);
    }
    if (staging) staging->give(r.buf);
  };
  ring.on_complete([&complete](const IoRequest& r) { complete(r); });
  struct Unhook {
    IoRing& ring;
    ~Unhook() { ring.on_complete(nullptr); }
  } unhook{ring};

  for (uint64_t i = 0; i < units; ++i) {
    const uint64_t len = block_bytes(i);
    char* buf = data + i * stripe;
    if (op == IoOp::write) s.checksums[i] = XXH3_64bits(buf, len);
    if (staging) {
      while (staging->empty()) ring.wait_one();
      char* bounce = staging->take();
      if (op == IoOp::write) std::memcpy(bounce, buf, len);
      buf = bounce;
    }
    int file = 0;
    const uint64_t offset = place(s.start + i, &file);
    ring.submit(IoRequest{op, file, offset, buf, len, i});
  }
  ring.wait_all();
  if (op == IoOp::write) {
    std::lock_guard lock(mu_);
    s.written = true;
  }
}

}  // namespace strata::nvme
