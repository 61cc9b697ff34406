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
#include <string>
#include <string_view>

struct XXH3_state_s;  // xxhash's, kept out of this header

namespace strata {

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

 private:
  void unmap();
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
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
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, uint64_t bytes);
  // Overwrites bytes already written (a header whose counts are known only at the end). The
  // running checksum no longer describes the file then: digest() refuses.
  void write_at(uint64_t offset, const void* data, uint64_t bytes);
  void commit();
  uint64_t size() const { return written_; }
  // Size and XXH3-64 of everything written so far (tensors left empty).
  FileDigest digest() const;

 private:
  void put(uint64_t offset, const void* data, uint64_t bytes);  // pwrite, resumed when short

  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool rewritten_ = false;
  XXH3_state_s* hash_ = nullptr;
};

}  // namespace strata
