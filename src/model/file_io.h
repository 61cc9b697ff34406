// file_io.h: the file plumbing the model's readers and writers share (safetensors, token files,
// config.json): read-only mappings, strict JSON, and atomic writes.
//
// A MappedFile is read through the page cache without a copy; release() drops pages already
// consumed from this process's mapping, so streaming a 140 GB checkpoint does not leave it all
// counted in our resident set. Writers go through AtomicFile: a crash leaves the old file (or
// none), never a half-written one.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

struct XXH3_state_s;  // xxhash's, kept out of this header

namespace strata {

namespace nvme {
struct Fault;
}

class MappedFile {
 public:
  // Maps `path` read-only; `what` says what the file is for in error messages ("token file").
  static MappedFile open(const std::filesystem::path& path, std::string_view what);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }  // null for an empty file
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Hints that [offset, offset + bytes) is about to be read front to back.
  void advise_sequential(uint64_t offset, uint64_t bytes) const;
  // Drops the pages covering [offset, offset + bytes) from this process's mapping; they stay in
  // the page cache and fault back in if read again.
  void release(uint64_t offset, uint64_t bytes) const;
  // Copies [offset, offset + bytes) into dst with pread, past the mapping: a large tensor read
  // this way costs no page faults on the mapping and no TLB shootdowns for releasing it, which
  // made reading a checkpoint's optimizer state through the mapping 3x slower than its disk.
  // A file that ends early (truncated under us) is an Error naming it.
  void read_at(uint64_t offset, void* dst, uint64_t bytes) const;

 private:
  void unmap();
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;  // kept open for read_at
  std::string path_;
};

// Parses `text` as JSON. Errors name `source` and the byte offset; an object holding the same
// key twice is an error naming the key (nlohmann would silently keep the last one).
nlohmann::json parse_json_strict(std::string_view text, std::string_view source);
// Reads and parses a whole (small) JSON file with parse_json_strict.
nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view what);

// XXH3-64 of a byte range: the checksum strata's checkpoints and swap files carry.
uint64_t xxh3_64(const void* data, uint64_t bytes);

// What a writer put into a file: its size, the XXH3-64 of all of its bytes and, for a
// safetensors file, of each tensor's data by name. A checkpoint keeps these to verify itself.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;
  std::map<std::string, uint64_t> tensors;
};

// Writes `path` atomically: data goes to `path.tmp`; commit() fsyncs it, renames it over `path`
// and fsyncs the directory. Destroyed without commit(), it removes the temporary file. The
// bytes written are checksummed on the way (digest()), so a caller need not read them back.
//
// Writes are gathered in page-aligned staging chunks. Once a file fills its first chunk, its
// chunks go to the disk with O_DIRECT through an io_uring (nvme::IoRing), each written while
// the next fills: a checkpoint moves at the drive's speed and leaves the page cache alone. A
// buffered writer of gigabytes spends its time copying into the page cache and waiting for its
// writeback (0.55 GB/s on the 2-core VM's disk, where O_DIRECT writes 2.2). Files smaller than
// a chunk, filesystems that refuse O_DIRECT (tmpfs) and processes without io_uring (a
// container's seccomp profile) write through the page cache, one chunk per pwrite.
class AtomicFile {
 public:
  static constexpr uint64_t kStagingChunk = 8ull << 20;
  static constexpr int kStagingChunks = 4;  // in flight at once, at most
  // What a writer holds in RAM besides its source, at most.
  static constexpr uint64_t kStagingBytes = kStagingChunk * kStagingChunks;
  // Writes at least this large are checksummed on one core while copied on another.
  static constexpr uint64_t kParallelBytes = 1ull << 20;

  explicit AtomicFile(std::filesystem::path path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // Allocates the file's blocks for `bytes` up front (its size unchanged): a file that cannot
  // fit fails here, naming the bytes needed and free, before anything is written, and the
  // drive writes into allocated extents. Filesystems without fallocate go on without it.
  void reserve(uint64_t bytes);
  void write(const void* data, uint64_t bytes);
  // Overwrites bytes already written (a header whose counts are known only at the end). The
  // running checksum no longer describes the file then: digest() refuses.
  void write_at(uint64_t offset, const void* data, uint64_t bytes);
  void commit();
  uint64_t size() const { return written_; }
  // Size and XXH3-64 of everything written so far (tensors left empty).
  FileDigest digest() const;
  // Whether chunks have gone to the disk with O_DIRECT (false until the first chunk fills).
  bool direct() const { return direct_; }

 private:
  struct Staging;
  void put(uint64_t offset, const void* data, uint64_t bytes);  // pwrite, resumed when short
  void stage(const void* data, uint64_t bytes);                 // into the chunks
  void flush_chunk();  // the current chunk to the disk (queued on the ring, or written)
  void drain();        // waits for every queued chunk

  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool rewritten_ = false;
  bool direct_ = false;
  XXH3_state_s* hash_ = nullptr;
  std::unique_ptr<Staging> staging_;
};

// Tests only: the faults every later AtomicFile's ring injects (nvme::Fault's request counted
// per file from 0: its staging chunks in order). Empty: none.
void atomic_file_faults_for_testing(std::vector<nvme::Fault> faults);

}  // namespace strata
