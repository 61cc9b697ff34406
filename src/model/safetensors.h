// safetensors.h: Hugging Face's safetensors checkpoints, read and written.
//
// A file is an 8-byte little-endian header length n, n bytes of JSON (name -> dtype, shape,
// data_offsets relative to the data section; "__metadata__" a string map), then the data. A
// checkpoint is one such file or several shards listed by model.safetensors.index.json.
//
// The reader maps each file and checks its whole header when it opens it, so a damaged or
// foreign checkpoint fails before any weight is loaded, with the file and tensor named. A read
// converts straight from the mapping into the caller's buffer (no intermediate copy of the
// tensor) and then drops the pages it read from our mapping: loading a 70B model streams
// through the page cache without keeping it in our resident set.
#pragma once

#include "core/dtype.h"
#include "model/file_io.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// "F32", "BF16", "F16": the dtypes strata reads and writes.
std::string_view safetensors_dtype_name(DType t);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::string file;     // the file that holds it
  uint64_t offset = 0;  // of its first byte within that file
  uint64_t bytes = 0;
  int file_index = 0;  // internal: which mapping holds it

  int64_t numel() const;
  std::string shape_str() const;  // "[4096, 11008]"
};

class SafetensorsReader {
 public:
  // A .safetensors file, a model.safetensors.index.json, or a directory holding
  // model.safetensors or model.safetensors.index.json (the single file wins when both exist,
  // as in Hugging Face).
  static SafetensorsReader open(const std::filesystem::path& path);

  const std::string& source() const { return source_; }  // the path open() was given
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }  // sorted by name
  std::vector<std::string> names() const;
  // The tensor, or null when the checkpoint has none of that name.
  const SafetensorsEntry* find(std::string_view name) const;
  // The tensor's bytes as stored (e.bytes of them, in e.dtype), valid while the reader lives:
  // for copying a tensor into another file unchanged.
  const void* stored_bytes(const SafetensorsEntry& e) const;
  // Drops the pages stored_bytes' readers faulted in from this process's mappings (they stay in
  // the page cache): a long run that copies tensors into each checkpoint keeps its RSS.
  void release_pages() const;
  // Keeps the tensors `rename` gives a name, under that name, and drops the rest: a model nested
  // in a bigger checkpoint (Gemma 3's language model beside its vision tower) read under the
  // names of the model alone. Two tensors given one name are an Error naming both files.
  void select(const std::function<std::optional<std::string>(const std::string&)>& rename);
  // String metadata of the files ("format": "pt", ...); with shards, the first one's value of
  // a key wins.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Converts the tensor into `dst` (numel elements of dst_dtype). Throws naming the tensor and
  // the checkpoint when there is no such tensor. Safe to call from several threads at once.
  void read(std::string_view name, void* dst, DType dst_dtype) const;
  // read(), after checking the shape; a mismatch names the file, tensor and both shapes.
  void read_checked(std::string_view name, void* dst, DType dst_dtype,
                    std::span<const int64_t> expected_shape) const;
  // read() of rows [row_begin, row_begin + rows) of a tensor (its first dimension): a part of a
  // fused tensor. Rows outside the tensor are an Error naming it.
  void read_rows(std::string_view name, int64_t row_begin, int64_t rows, void* dst,
                 DType dst_dtype) const;

 private:
  const SafetensorsEntry& at(std::string_view name) const;
  // Elements [first, first + count) of `e`, converted into dst.
  void read_elements(const SafetensorsEntry& e, uint64_t first, uint64_t count, void* dst,
                     DType dst_dtype) const;
  void add_file(const std::filesystem::path& file);
  void sort_and_check_unique();

  std::string source_;
  std::vector<MappedFile> files_;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel elements of dtype, row-major
  // Instead of data, for a file bigger than RAM: called once, when the writer reaches this
  // tensor (in file order), for a pointer to its bytes that stays valid until the next call of
  // any source. A checkpoint of a 70B model streams through this one unit at a time.
  std::function<const void*()> source;
  // Or, for a tensor whose bytes lie in several places (a table cut into vocabulary pieces,
  // Phi-3's fused projections): called once, when the writer reaches it, to hand its bytes over
  // in order through `put`, each span read only during its call; so it is never assembled.
  using Put = std::function<void(const void* bytes, uint64_t size)>;
  std::function<void(const Put& put)> parts;
};

// Writes one file atomically (path.tmp, fsync, rename). The header is padded with spaces to a
// multiple of 8 bytes; data is ordered by element size, then name, so that every tensor is
// aligned to its element size and the same tensors always give the same bytes. Returns the
// file's size and checksums, the whole file's and each tensor's (computed as it writes).
// Nothing is assembled: each tensor's bytes go from its data (or its source's pointer, or its
// parts) to the file's staging chunks (AtomicFile).
FileDigest write_safetensors(const std::filesystem::path& path,
                             std::span<const SafetensorsTensor> tensors,
                             const std::map<std::string, std::string>& metadata = {});
// Whether write_safetensors writes a's data before b's: the order its sources are called in.
bool safetensors_before(const SafetensorsTensor& a, const SafetensorsTensor& b);

// Writes `dir`/model.safetensors when everything fits in max_shard_bytes, otherwise shards
// model-0000k-of-0000N.safetensors (filled in the given order; a tensor larger than the limit
// gets a shard of its own) and model.safetensors.index.json (metadata.total_size, weight_map).
// Checkpoint files left in `dir` by an earlier save with another layout are removed, so that a
// reader never picks up a stale one. Returns the files written, index last.
std::vector<std::filesystem::path> write_safetensors_sharded(
    const std::filesystem::path& dir, std::span<const SafetensorsTensor> tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

}  // namespace strata
