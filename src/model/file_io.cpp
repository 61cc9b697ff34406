#include "model/file_io.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "nvme/io_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include <tbb/parallel_invoke.h>

namespace strata {

namespace {

uint64_t page_size() {
  static const uint64_t size = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return size;
}

// The page-aligned range of the mapping that covers [offset, offset + bytes), clamped to it.
std::pair<uint8_t*, size_t> page_range(const uint8_t* base, uint64_t size, uint64_t offset,
                                       uint64_t bytes) {
  if (base == nullptr || offset >= size || bytes == 0) return {nullptr, 0};
  const uint64_t end = std::min(size, offset + bytes);
  const uint64_t first = offset / page_size() * page_size();
  const uint64_t last = (end + page_size() - 1) / page_size() * page_size();
  return {const_cast<uint8_t*>(base) + first, static_cast<size_t>(last - first)};
}

}  // namespace

MappedFile MappedFile::open(const std::filesystem::path& path, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail("{} {}: cannot open: {}; check the path and its permissions", what, path.string(),
         errno_text(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{} {}: not a regular file; pass the path of the file itself", what, path.string());
  }
  MappedFile f;
  f.path_ = path.string();
  f.size_ = static_cast<uint64_t>(st.st_size);
  if (f.size_ > 0) {
    // MAP_SHARED and read-only: the pages are the page cache's, never copied.
    void* p = mmap(nullptr, f.size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail("{} {}: mmap of {} bytes failed: {}; check the file system supports mmap", what,
           path.string(), f.size_, errno_text(err));
    }
    f.data_ = static_cast<const uint8_t*>(p);
  }
  f.fd_ = fd;
  return f;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

void MappedFile::read_at(uint64_t offset, void* dst, uint64_t bytes) const {
  auto* p = static_cast<uint8_t*>(dst);
  const uint64_t end = offset + bytes;
  while (offset < end) {
    const ssize_t n =
        ::pread(fd_, p, std::min<uint64_t>(end - offset, 1ull << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      fail("{}: reading {} bytes at offset {} failed: {}; check the drive", path_, end - offset,
           offset, errno_text(err));
    }
    if (n == 0)
      fail(
          "{}: the file ends at byte {}, before the {} bytes asked for at offset {}; it was "
          "truncated or replaced while being read",
          path_, offset, end - offset, offset);
    p += n;
    offset += static_cast<uint64_t>(n);
  }
}

MappedFile::~MappedFile() {
  unmap();
}

void MappedFile::unmap() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
}

void MappedFile::advise_sequential(uint64_t offset, uint64_t bytes) const {
  const auto [p, n] = page_range(data_, size_, offset, bytes);
  if (n > 0) (void)madvise(p, n, MADV_SEQUENTIAL);  // a hint: failure changes nothing
}

void MappedFile::release(uint64_t offset, uint64_t bytes) const {
  // Widening to whole pages may drop a neighbour's pages too; they simply fault in again.
  const auto [p, n] = page_range(data_, size_, offset, bytes);
  if (n > 0) (void)madvise(p, n, MADV_DONTNEED);
}

nlohmann::json parse_json_strict(std::string_view text, std::string_view source) {
  using json = nlohmann::json;
  // Deeper nesting is damage, not a config or a header (theirs is a few levels), and values
  // nested without bound would overflow the stack of recursive walks such as dump().
  constexpr int kMaxDepth = 64;
  // One set of seen keys per open object (a set: a header may hold many thousands of keys);
  // the first repeated key is reported after the parse.
  std::vector<std::set<std::string, std::less<>>> open_objects;
  std::string duplicate;
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxDepth)
          fail(
              "{}: JSON nested more than {} levels deep; the file is damaged or not the JSON "
              "file expected here",
              source, kMaxDepth);
        if (event == json::parse_event_t::object_start) open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() &&
            !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), check);
  } catch (const json::parse_error& e) {
    fail("{}: not valid JSON (at byte {}): {}; the file is damaged or not JSON", source, e.byte,
         e.what());
  } catch (const json::exception& e) {
    // out_of_range: a number past a double's range (1e400); found by fuzz/fuzz_safetensors.
    fail("{}: not valid JSON: {}; the file is damaged or not JSON", source, e.what());
  }
  if (!duplicate.empty())
    fail("{}: key '{}' appears twice in one JSON object; remove the duplicate", source, duplicate);
  return j;
}

nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} {}: cannot open; check the path and its permissions", what, path.string());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{} {}: read failed; check the file and the disk", what, path.string());
  return parse_json_strict(text.str(), path.string());
}

uint64_t xxh3_64(const void* data, uint64_t bytes) {
  return XXH3_64bits(data, bytes);
}

namespace {
std::vector<nvme::Fault> g_atomic_file_faults;

// What to do about a write that failed with `err`.
std::string write_advice(int err) {
  if (err == EFBIG)
    return "the file would pass the largest its filesystem or this process's file-size limit "
           "(ulimit -f) allows: raise the limit or write it elsewhere";
  if (err == ENOSPC) return "free space on its file system or write it elsewhere";
  return "check the file system and the drive";
}  // tests only (atomic_file_faults_for_testing)
}  // namespace

void atomic_file_faults_for_testing(std::vector<nvme::Fault> faults) {
  g_atomic_file_faults = std::move(faults);
}

// The staging chunks and, once a file fills its first chunk, the ring that writes them.
// Chunks are in one of three states: filling (`current`), idle, or in flight on the ring
// (handed back to idle by its completion). Without a ring there is one chunk, written with
// pwrite as soon as it is full.
struct AtomicFile::Staging {
  // Mapped, not malloc'd: freed chunks go back to the system at once. (From malloc, glibc's
  // sliding mmap threshold serves every chunk after the first freed one from its heap, which
  // keeps what later units leave there: a run's peak RSS then grew by a few chunks at random.)
  struct Free {
    void operator()(uint8_t* p) const { ::munmap(p, kStagingChunk); }
  };
  std::vector<std::unique_ptr<uint8_t, Free>> chunks;  // allocated as they are first needed
  std::vector<int> idle;
  int current = -1;
  uint64_t base = 0;   // the file offset of the current chunk's first byte
  uint64_t fill = 0;   // bytes in it
  bool tried = false;  // whether O_DIRECT through a ring was tried (it is, once)
  int file = -1;       // the ring's index of the temporary file
  // Last, so that it is destroyed first: its destructor waits for the writes in flight, which
  // read the chunks.
  std::unique_ptr<nvme::IoRing> ring;
};

AtomicFile::AtomicFile(std::filesystem::path path)
    : path_(std::move(path)), staging_(std::make_unique<Staging>()) {
  tmp_ = path_;
  tmp_ += ".tmp";
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int err = errno;
    fail("cannot create {}: {}; check that the directory exists and is writable", tmp_.string(),
         errno_text(err));
  }
  hash_ = XXH3_createState();
  if (hash_ == nullptr) fail("writing {}: out of memory for its checksum state", tmp_.string());
  XXH3_64bits_reset(hash_);
}

AtomicFile::~AtomicFile() {
  staging_.reset();  // waits for writes in flight before the file goes
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
  XXH3_freeState(hash_);
}

FileDigest AtomicFile::digest() const {
  if (rewritten_)
    fail(
        "{}: part of it was overwritten, so its running checksum is void; this is a bug in "
        "strata",
        tmp_.string());
  FileDigest d;
  d.bytes = written_;
  d.xxh3 = XXH3_64bits_digest(hash_);
  return d;
}

void AtomicFile::put(uint64_t offset, const void* data, uint64_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; loop on short writes.
    const ssize_t n = ::pwrite(fd_, p, std::min<uint64_t>(bytes, 1ull << 30), off_t(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      fail("writing {} failed: {}; {}", tmp_.string(), errno_text(err), write_advice(err));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
}

void AtomicFile::reserve(uint64_t bytes) {
  if (fd_ < 0 || bytes == 0) return;
  const auto no_room = [&](uint64_t free_bytes) {
    fail(
        "writing {}: it needs {} and its filesystem has {} free; free space there or write it "
        "elsewhere",
        tmp_.string(), format_bytes(bytes), format_bytes(free_bytes));
  };
  // Refused before fallocate where the filesystem says it cannot fit: ext4's fallocate takes
  // every free block before it gives up, so for that moment every other writer there (another
  // process, this run's swap store) would find the disk full too.
  struct statvfs fs {};
  const bool known = ::fstatvfs(fd_, &fs) == 0 && fs.f_frsize > 0;
  if (known && bytes > uint64_t{fs.f_bavail} * fs.f_frsize)
    no_room(uint64_t{fs.f_bavail} * fs.f_frsize);
  int rc;
  do rc = ::fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes));
  while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  const int err = errno;
  if (err == ENOSPC) {
    // Another writer took the room meanwhile: what fallocate did take past the end goes back at
    // once (the file itself is left as it was).
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) < bytes) {
      const int punched = ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size,
                                      static_cast<off_t>(bytes) - st.st_size);
      (void)punched;  // where it cannot, the blocks go back when the file is removed
    }
    no_room(::fstatvfs(fd_, &fs) == 0 ? uint64_t{fs.f_bavail} * fs.f_frsize : 0);
  }
  if (err != EOPNOTSUPP && err != ENOSYS)
    fail("writing {}: reserving {} failed: {}; {}", tmp_.string(), format_bytes(bytes),
         errno_text(err), write_advice(err));
}

void AtomicFile::write(const void* data, uint64_t bytes) {
  if (fd_ < 0) fail("{}: written after commit; this is a bug in strata", tmp_.string());
  // The checksum beside the copy into the chunks: a checkpoint's writer is bound by the CPU's
  // passes over its bytes, not by the drive, until they run on more than one core.
  if (bytes >= kParallelBytes) {
    tbb::parallel_invoke([&] { XXH3_64bits_update(hash_, data, bytes); },
                         [&] { stage(data, bytes); });
  } else {
    XXH3_64bits_update(hash_, data, bytes);
    stage(data, bytes);
  }
}

void AtomicFile::stage(const void* data, uint64_t bytes) {
  Staging& s = *staging_;
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    if (s.current < 0) {
      const size_t most = s.ring != nullptr ? kStagingChunks : 1;
      if (s.idle.empty() && s.chunks.size() < most) {
        void* mapped = ::mmap(nullptr, kStagingChunk, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        auto* chunk = mapped == MAP_FAILED ? nullptr : static_cast<uint8_t*>(mapped);
        if (chunk == nullptr)
          fail(
              "writing {}: {} of host memory for a staging chunk could not be allocated; free "
              "host memory",
              tmp_.string(), format_bytes(kStagingChunk));
        s.chunks.emplace_back(chunk);
        s.idle.push_back(static_cast<int>(s.chunks.size()) - 1);
      }
      while (s.idle.empty()) s.ring->wait_one();  // its completion hands a chunk back
      s.current = s.idle.back();
      s.idle.pop_back();
    }
    const uint64_t n = std::min(bytes, kStagingChunk - s.fill);
    std::memcpy(s.chunks[static_cast<size_t>(s.current)].get() + s.fill, p, n);
    s.fill += n;
    p += n;
    bytes -= n;
    written_ += n;
    if (s.fill == kStagingChunk) flush_chunk();
  }
}

void AtomicFile::flush_chunk() {
  Staging& s = *staging_;
  if (s.current < 0) return;
  if (!s.tried && s.fill == kStagingChunk) {
    // The first full chunk: this file is large enough for O_DIRECT, if the filesystem takes it
    // (a tmpfs run directory does not, and is no fault: the chunks go through the page cache).
    s.tried = true;
    try {
      nvme::IoOptions o;
      o.queue_depth = kStagingChunks;
      o.faults = g_atomic_file_faults;
      o.warn_if_buffered = false;
      o.enospc_advice = "free space on that filesystem";
      auto ring = std::make_unique<nvme::IoRing>(std::move(o));
      const int file = ring->add_file(tmp_.string(), false);
      if (ring->is_direct(file)) {
        ring->on_complete([&s](const nvme::IoRequest& r) { s.idle.push_back(int(r.tag)); });
        s.ring = std::move(ring);
        s.file = file;
        direct_ = true;
      }
    } catch (const Error& e) {
      if (first_time("atomic-file-io-uring"))
        log_debug("large files written through the page cache: {}", e.what());
    }
  }
  const int chunk = std::exchange(s.current, -1);
  const uint64_t offset = s.base, bytes = std::exchange(s.fill, 0);
  s.base += bytes;
  if (s.ring != nullptr && bytes > 0) {
    // An unaligned tail (the last chunk's) goes through the ring's buffered descriptor.
    nvme::IoRequest r;
    r.op = nvme::IoOp::write;
    r.file = s.file;
    r.offset = offset;
    r.buf = s.chunks[static_cast<size_t>(chunk)].get();
    r.len = bytes;
    r.tag = static_cast<uint64_t>(chunk);
    s.ring->submit(r);
    return;
  }
  put(offset, s.chunks[static_cast<size_t>(chunk)].get(), bytes);
  s.idle.push_back(chunk);
}

void AtomicFile::drain() {
  if (staging_->ring != nullptr) staging_->ring->wait_all();
}

void AtomicFile::write_at(uint64_t offset, const void* data, uint64_t bytes) {
  if (offset + bytes > written_)
    fail("{}: overwriting bytes {}..{} past the {} written; this is a bug in strata", tmp_.string(),
         offset, offset + bytes, written_);
  if (fd_ < 0) fail("{}: written after commit; this is a bug in strata", tmp_.string());
  rewritten_ = true;
  Staging& s = *staging_;
  const auto* p = static_cast<const uint8_t*>(data);
  if (offset < s.base) {  // bytes already handed on: once on the disk, overwritten in place
    const uint64_t n = std::min(bytes, s.base - offset);
    drain();
    put(offset, p, n);
    offset += n;
    p += n;
    bytes -= n;
  }
  if (bytes > 0)
    std::memcpy(s.chunks[static_cast<size_t>(s.current)].get() + (offset - s.base), p, bytes);
}

void AtomicFile::commit() {
  if (fd_ < 0) fail("{}: committed twice; this is a bug in strata", tmp_.string());
  flush_chunk();
  drain();
  staging_.reset();  // the ring's descriptors closed, the chunks freed
  if (fsync(fd_) != 0) {
    const int err = errno;
    fail("fsync of {} failed: {}; the data may not be on disk, check the device", tmp_.string(),
         errno_text(err));
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    fail("closing {} failed: {}; check free space on its file system", tmp_.string(),
         errno_text(err));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    fail("renaming {} to {} failed: {}; check the directory's permissions", tmp_.string(),
         path_.string(), errno_text(err));
  }
  // The rename is durable only once the directory itself is synced.
  std::filesystem::path dir = path_.parent_path();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace strata
