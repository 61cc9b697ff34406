#include "model/safetensors.h"

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <tbb/parallel_invoke.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <system_error>

namespace strata {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The format's own bound (as Hugging Face's reader): a larger header is damage, not a model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Converted per step of a read; the pages behind each step are released before the next.
constexpr uint64_t kReadChunkBytes = 8ull << 20;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool parse_safetensors_dtype(std::string_view text, DType* out) {
  if (text == "F32")
    *out = DType::f32;
  else if (text == "BF16")
    *out = DType::bf16;
  else if (text == "F16")
    *out = DType::f16;
  else
    return false;
  return true;
}

std::string shape_text(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Product of the dims, or false on overflow past 2^63.
bool checked_numel(std::span<const int64_t> shape, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = n;
  return true;
}

// The file name of a shard written by Hugging Face or by us: model-00001-of-00004.safetensors.
bool is_shard_name(std::string_view n) {
  auto digits = [&](size_t at) {
    for (size_t i = at; i < at + 5; ++i)
      if (n[i] < '0' || n[i] > '9') return false;
    return true;
  };
  return n.size() == 32 && n.starts_with("model-") && digits(6) && n.substr(11, 4) == "-of-" &&
         digits(15) && n.ends_with(".safetensors");
}

}  // namespace

bool safetensors_before(const SafetensorsTensor& a, const SafetensorsTensor& b) {
  if (dtype_size(a.dtype) != dtype_size(b.dtype)) return dtype_size(a.dtype) > dtype_size(b.dtype);
  return a.name < b.name;
}

namespace {

// The tensors checked and in the order their data is written (safetensors_before).
std::vector<const SafetensorsTensor*> checked_order(std::span<const SafetensorsTensor> tensors,
                                                    const fs::path& path) {
  std::vector<const SafetensorsTensor*> order;
  std::set<std::string_view> names;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail("writing {}: a tensor is named '{}'; give every tensor a real name", path.string(),
           t.name);
    if (!names.insert(t.name).second)
      fail("writing {}: tensor '{}' is given twice; names in a checkpoint are unique",
           path.string(), t.name);
    uint64_t n = 0;
    if (!checked_numel(t.shape, &n))
      fail("writing {}: tensor '{}' has an invalid shape {}; dims must be non-negative",
           path.string(), t.name, shape_text(t.shape));
    if (n > 0 && t.data == nullptr && !t.source && !t.parts)
      fail("writing {}: tensor '{}' {} has no data; this is a bug in the caller", path.string(),
           t.name, shape_text(t.shape));
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return safetensors_before(*a, *b);
  });
  return order;
}

uint64_t tensor_bytes(const SafetensorsTensor& t) {
  uint64_t n = 0;
  checked_numel(t.shape, &n);
  return n * dtype_size(t.dtype);
}

}  // namespace

std::string_view safetensors_dtype_name(DType t) {
  return t == DType::f32 ? "F32" : t == DType::bf16 ? "BF16" : "F16";
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string SafetensorsEntry::shape_str() const {
  return shape_text(shape);
}

// ---- reader ----

void SafetensorsReader::add_file(const fs::path& path) {
  MappedFile f = MappedFile::open(path, "safetensors file");
  const std::string& file = f.path();
  if (f.size() < 8)
    fail(
        "safetensors file {}: truncated: {} bytes, but the file starts with an 8-byte header "
        "length; the file is damaged or not a safetensors file",
        file, f.size());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{f.data()[i]} << (8 * i);
  if (n > kMaxHeaderBytes)
    fail(
        "safetensors file {}: header length {} is over the format's limit of {} bytes; the file "
        "is damaged or not a safetensors file",
        file, n, kMaxHeaderBytes);
  if (n > f.size() - 8)
    fail(
        "safetensors file {}: header length {} runs past the end of the file ({} bytes follow "
        "the length); the file is truncated",
        file, n, f.size() - 8);
  const std::string_view text(reinterpret_cast<const char*>(f.data() + 8), n);
  if (text.empty() || text.front() != '{')
    fail("safetensors file {}: the header does not start with '{{'; the file is damaged", file);
  const json header = parse_json_strict(text, fmt::format("safetensors file {} header", file));
  if (!header.is_object())
    fail("safetensors file {}: the header is JSON {}, not an object; the file is damaged", file,
         header.type_name());

  const uint64_t data_begin = 8 + n, data_size = f.size() - data_begin;
  const int index = static_cast<int>(files_.size());
  std::vector<SafetensorsEntry> entries;
  for (const auto& item : header.items()) {
    // Named references, not a structured binding: the lambda below captures them (clang 14, the
    // fuzz build's compiler, cannot capture structured bindings).
    const std::string& name = item.key();
    const json& info = item.value();
    if (name == "__metadata__") {
      if (!info.is_object())
        fail("safetensors file {}: __metadata__ is {}, not an object of strings", file,
             info.type_name());
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string())
          fail("safetensors file {}: __metadata__ entry '{}' is {}, not a string", file, key,
               value.type_name());
        metadata_.emplace(key, value.get<std::string>());  // the first shard's value wins
      }
      continue;
    }
    auto bad = [&](std::string_view what) {
      fail("safetensors file {}: tensor '{}': {}; the file is damaged or not a safetensors file",
           file, name, what);
    };
    if (!info.is_object()) bad(fmt::format("its entry is {}, not an object", info.type_name()));
    for (const auto& [key, value] : info.items())
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        bad(fmt::format("unknown key '{}' (expected dtype, shape, data_offsets)", key));
    const auto dt = info.find("dtype");
    const auto sh = info.find("shape");
    const auto off = info.find("data_offsets");
    if (dt == info.end() || sh == info.end() || off == info.end())
      bad("its entry needs dtype, shape and data_offsets");
    if (!dt->is_string()) bad(fmt::format("dtype is {}, not a string", dt->type_name()));
    SafetensorsEntry e;
    e.name = name;
    e.file = file;
    e.file_index = index;
    const std::string& dtype_text = dt->get_ref<const std::string&>();
    if (!parse_safetensors_dtype(dtype_text, &e.dtype))
      fail(
          "safetensors file {}: tensor '{}' has dtype {}; strata reads F32, BF16 and F16 only, "
          "convert the checkpoint to one of them",
          file, name, dtype_text);
    if (!sh->is_array()) bad(fmt::format("shape is {}, not a list", sh->type_name()));
    for (const json& d : *sh) {
      if (!d.is_number_integer() || (!d.is_number_unsigned() && d.get<int64_t>() < 0) ||
          (d.is_number_unsigned() &&
           d.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}))
        bad(fmt::format("shape {} holds {}, not a non-negative integer", sh->dump(), d.dump()));
      e.shape.push_back(d.get<int64_t>());
    }
    uint64_t numel = 0;
    if (!checked_numel(e.shape, &numel) ||
        __builtin_mul_overflow(numel, dtype_size(e.dtype), &e.bytes))
      bad(fmt::format("shape {} is too large", sh->dump()));
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      bad(fmt::format("data_offsets {} is not [begin, end] with non-negative integers",
                      off->dump()));
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end) bad(fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    if (end > data_size)
      bad(fmt::format("data_offsets [{}, {}] run past the data section of {} bytes (truncated?)",
                      begin, end, data_size));
    if (end - begin != e.bytes)
      bad(fmt::format("data_offsets [{}, {}] hold {} bytes, but {} {} needs {}", begin, end,
                      end - begin, dtype_text, e.shape_str(), e.bytes));
    e.offset = data_begin + begin;
    entries.push_back(std::move(e));
  }

  // No two tensors may share a byte (empty tensors occupy none).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : entries)
    if (e.bytes > 0) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry& a = *by_offset[i - 1];
    const SafetensorsEntry& b = *by_offset[i];
    if (b.offset < a.offset + a.bytes)
      fail(
          "safetensors file {}: tensors '{}' (data_offsets [{}, {}]) and '{}' ([{}, {}]) "
          "overlap; the file is damaged",
          file, a.name, a.offset - data_begin, a.offset - data_begin + a.bytes, b.name,
          b.offset - data_begin, b.offset - data_begin + b.bytes);
  }
  // Tensors are read front to back, so readahead helps; release() drops what was read.
  f.advise_sequential(data_begin, data_size);
  files_.push_back(std::move(f));
  for (SafetensorsEntry& e : entries) tensors_.push_back(std::move(e));
}

SafetensorsReader SafetensorsReader::open(const fs::path& path) {
  SafetensorsReader r;
  r.source_ = path.string();
  std::error_code ec;
  fs::path file = path, index;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / kSingleFile, ec)) {
      file = path / kSingleFile;
    } else if (fs::exists(path / kIndexFile, ec)) {
      index = path / kIndexFile;
    } else {
      std::vector<std::string> found;
      for (const auto& de : fs::directory_iterator(path, ec))
        if (de.path().extension() == ".safetensors" || de.path().extension() == ".bin")
          found.push_back(de.path().filename().string());
      std::sort(found.begin(), found.end());
      fail(
          "checkpoint {}: neither {} nor {} is in this directory (found: {}); strata reads "
          "Hugging Face safetensors checkpoints, convert .bin weights with safetensors first",
          path.string(), kSingleFile, kIndexFile,
          found.empty() ? std::string("no weight files")
                        : fmt::format("{}", fmt::join(found, ", ")));
    }
  } else if (path.filename().string().ends_with(".index.json")) {
    index = path;
  }

  if (index.empty()) {
    r.add_file(file);
  } else {
    std::vector<std::string> shard_names;  // per file index: its name in the weight_map
    const json idx = read_json_file(index, "safetensors index");
    const std::string src = index.string();
    if (!idx.is_object())
      fail("safetensors index {}: holds JSON {}, not an object; the file is damaged", src,
           idx.type_name());
    const auto wm = idx.find("weight_map");
    if (wm == idx.end() || !wm->is_object())
      fail("safetensors index {}: no weight_map object; the file is damaged or not an index", src);
    if (const auto md = idx.find("metadata"); md != idx.end() && !md->is_object() && !md->is_null())
      fail("safetensors index {}: metadata is {}, not an object", src, md->type_name());
    // Shard -> the tensors the index puts there.
    std::map<std::string, std::vector<std::string>> shards;
    for (const auto& [name, shard] : wm->items()) {
      if (!shard.is_string())
        fail("safetensors index {}: weight_map entry for tensor '{}' is {}, not a file name", src,
             name, shard.type_name());
      const fs::path rel(shard.get<std::string>());
      const bool escapes =
          rel.is_absolute() ||
          std::any_of(rel.begin(), rel.end(), [](const fs::path& p) { return p == ".."; });
      if (rel.empty() || escapes)
        fail(
            "safetensors index {}: tensor '{}' is mapped to '{}', which is not a file inside "
            "the checkpoint directory",
            src, name, rel.string());
      shards[rel.string()].push_back(name);
    }
    if (shards.empty())
      fail("safetensors index {}: weight_map is empty; the checkpoint has no tensors", src);
    const fs::path dir = index.parent_path();
    for (const auto& [shard, names] : shards) {
      if (!fs::exists(dir / shard, ec))
        fail(
            "safetensors index {}: shard {} (tensor '{}' and {} more) does not exist; the "
            "checkpoint is incomplete, fetch the missing shard",
            src, (dir / shard).string(), names.front(), names.size() - 1);
      r.add_file(dir / shard);
      shard_names.push_back(shard);
    }
    r.sort_and_check_unique();
    // The index and the shards must agree both ways.
    for (const SafetensorsEntry& e : r.tensors_) {
      const auto it = wm->find(e.name);
      if (it == wm->end())
        fail(
            "safetensors index {}: shard {} holds tensor '{}', which the weight_map does not "
            "list; the index and the shards do not belong together",
            src, e.file, e.name);
      if (it->get<std::string>() != shard_names[static_cast<size_t>(e.file_index)])
        fail(
            "safetensors index {}: tensor '{}' is in shard {} but mapped to {}; the index and "
            "the shards do not belong together",
            src, e.name, e.file, it->get<std::string>());
    }
    for (const auto& [shard, names] : shards)
      for (const std::string& name : names)
        if (r.find(name) == nullptr)
          fail(
              "safetensors index {}: weight_map puts tensor '{}' in {}, which does not hold "
              "it; the shard is damaged or from another checkpoint",
              src, name, (dir / shard).string());
    return r;
  }
  r.sort_and_check_unique();
  return r;
}

void SafetensorsReader::sort_and_check_unique() {
  std::sort(tensors_.begin(), tensors_.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (size_t i = 1; i < tensors_.size(); ++i)
    if (tensors_[i].name == tensors_[i - 1].name)
      fail("checkpoint {}: tensor '{}' appears twice, in {} and in {}; remove one of them", source_,
           tensors_[i].name, tensors_[i - 1].file, tensors_[i].file);
}

const void* SafetensorsReader::stored_bytes(const SafetensorsEntry& e) const {
  return files_.at(static_cast<size_t>(e.file_index)).data() + e.offset;
}

void SafetensorsReader::release_pages() const {
  for (const MappedFile& f : files_) f.release(0, f.size());
}

void SafetensorsReader::select(
    const std::function<std::optional<std::string>(const std::string&)>& rename) {
  std::vector<SafetensorsEntry> kept;
  for (SafetensorsEntry& e : tensors_)
    if (std::optional<std::string> name = rename(e.name)) {
      e.name = std::move(*name);
      kept.push_back(std::move(e));
    }
  tensors_ = std::move(kept);
  sort_and_check_unique();
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const SafetensorsEntry& e : tensors_) names.push_back(e.name);
  return names;
}

const SafetensorsEntry* SafetensorsReader::find(std::string_view name) const {
  const auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const SafetensorsEntry& e, std::string_view n) { return std::string_view(e.name) < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const SafetensorsEntry& SafetensorsReader::at(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr)
    fail(
        "checkpoint {}: no tensor '{}' (it holds {} tensors); check that the checkpoint belongs "
        "to this model",
        source_, name, tensors_.size());
  return *e;
}

void SafetensorsReader::read(std::string_view name, void* dst, DType dst_dtype) const {
  const SafetensorsEntry& e = at(name);
  read_elements(e, 0, static_cast<uint64_t>(e.numel()), dst, dst_dtype);
}

void SafetensorsReader::read_rows(std::string_view name, int64_t row_begin, int64_t rows, void* dst,
                                  DType dst_dtype) const {
  const SafetensorsEntry& e = at(name);
  const int64_t total = e.shape.empty() ? 1 : e.shape[0];
  if (row_begin < 0 || rows < 0 || row_begin + rows > total)
    fail(
        "checkpoint {}: rows [{}, {}) of tensor '{}' are asked for, but it has {} ({}); this is "
        "a bug in strata",
        e.file, row_begin, row_begin + rows, e.name, total, e.shape_str());
  const auto row = total == 0 ? uint64_t{0} : static_cast<uint64_t>(e.numel() / total);
  read_elements(e, static_cast<uint64_t>(row_begin) * row, static_cast<uint64_t>(rows) * row, dst,
                dst_dtype);
}

void SafetensorsReader::read_elements(const SafetensorsEntry& e, uint64_t first, uint64_t n,
                                      void* dst, DType dst_dtype) const {
  const MappedFile& f = files_[static_cast<size_t>(e.file_index)];
  const uint64_t src_size = dtype_size(e.dtype);
  if (n == 0) return;
  const uint8_t* src = f.data() + e.offset + first * src_size;
  auto* out = static_cast<uint8_t*>(dst);
  const uint64_t chunk = kReadChunkBytes / src_size;
  if (n * src_size >= kReadChunkBytes) {
    // Large: read past the mapping (MappedFile::read_at), straight into dst when the dtypes
    // agree, else a chunk at a time through one buffer.
    const uint64_t at = e.offset + first * src_size;
    if (dst_dtype == e.dtype) {
      f.read_at(at, out, n * src_size);
      return;
    }
    std::vector<uint64_t> buffer((kReadChunkBytes + 7) / 8);
    for (uint64_t i = 0; i < n; i += chunk) {
      const uint64_t m = std::min(chunk, n - i);
      f.read_at(at + i * src_size, buffer.data(), m * src_size);
      convert(out + i * dtype_size(dst_dtype), dst_dtype, buffer.data(), e.dtype, m);
    }
    return;
  }
  // A header whose length is not a multiple of 8 (legal, but not what writers produce) leaves
  // the data unaligned; such chunks go through a small aligned copy.
  const bool aligned = reinterpret_cast<uintptr_t>(src) % src_size == 0;
  // As large as one step's data, not a whole step's 8 MiB: small tensors are the common case.
  std::vector<uint32_t> bounce(aligned ? 0 : (std::min(chunk, n) * src_size + 3) / 4);
  for (uint64_t i = 0; i < n; i += chunk) {
    const uint64_t m = std::min(chunk, n - i);
    const void* p = src + i * src_size;
    if (!aligned) {
      std::memcpy(bounce.data(), p, m * src_size);
      p = bounce.data();
    }
    convert(out + i * dtype_size(dst_dtype), dst_dtype, p, e.dtype, m);
    f.release(e.offset + (first + i) * src_size, m * src_size);
  }
}

void SafetensorsReader::read_checked(std::string_view name, void* dst, DType dst_dtype,
                                     std::span<const int64_t> expected_shape) const {
  const SafetensorsEntry& e = at(name);
  if (!std::equal(e.shape.begin(), e.shape.end(), expected_shape.begin(), expected_shape.end()))
    fail(
        "checkpoint {}: tensor '{}' has shape {}, but the model config expects {}; check that "
        "config.json and the safetensors files belong to the same model",
        e.file, e.name, e.shape_str(), shape_text(expected_shape));
  read(name, dst, dst_dtype);
}

// ---- writer ----

FileDigest write_safetensors(const fs::path& path, std::span<const SafetensorsTensor> tensors,
                             const std::map<std::string, std::string>& metadata) {
  const std::vector<const SafetensorsTensor*> order = checked_order(tensors, path);
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsTensor* t : order) {
    const uint64_t bytes = tensor_bytes(*t);
    header[t->name] = {{"dtype", safetensors_dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail("writing {}: a tensor name or metadata is not valid UTF-8 ({})", path.string(), e.what());
  }
  // Spaces up to a multiple of 8, so that the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  AtomicFile out(path);
  out.reserve(sizeof(length) + text.size() + offset);
  out.write(length, sizeof(length));
  out.write(text.data(), text.size());
  std::map<std::string, uint64_t> sums;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> sum(XXH3_createState(), XXH3_freeState);
  if (sum == nullptr) fail("writing {}: out of memory for a checksum state", path.string());
  for (const SafetensorsTensor* t : order) {
    const uint64_t bytes = tensor_bytes(*t);
    // Each tensor's bytes, whole or in parts, go to the file with its checksum computed beside
    // the file's and the copy (AtomicFile::write).
    XXH3_64bits_reset(sum.get());
    uint64_t given = 0;
    auto put = [&](const void* part, uint64_t size) {
      if (given + size > bytes)
        fail(
            "writing {}: the parts of tensor '{}' run past its {} bytes; this is a bug in the "
            "caller",
            path.string(), t->name, bytes);
      if (size >= AtomicFile::kParallelBytes) {
        tbb::parallel_invoke([&] { XXH3_64bits_update(sum.get(), part, size); },
                             [&] { out.write(part, size); });
      } else {
        XXH3_64bits_update(sum.get(), part, size);
        out.write(part, size);
      }
      given += size;
    };
    if (t->data == nullptr && bytes > 0 && !t->source) {
      t->parts(put);
    } else {
      const void* data = t->data != nullptr || bytes == 0 ? t->data : t->source();
      if (data == nullptr && bytes > 0)
        fail("writing {}: the source of tensor '{}' gave no data; this is a bug in the caller",
             path.string(), t->name);
      put(data, bytes);
    }
    if (given != bytes)
      fail(
          "writing {}: the parts of tensor '{}' gave {} of its {} bytes; this is a bug in the "
          "caller",
          path.string(), t->name, given, bytes);
    sums[t->name] = XXH3_64bits_digest(sum.get());
  }
  out.commit();
  FileDigest d = out.digest();
  d.tensors = std::move(sums);
  return d;
}

std::vector<fs::path> write_safetensors_sharded(
    const fs::path& dir, std::span<const SafetensorsTensor> tensors, uint64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata) {
  if (max_shard_bytes == 0)
    fail("writing checkpoint {}: the shard size limit is 0 bytes; give a positive size",
         dir.string());
  (void)checked_order(tensors, dir);  // names, shapes and data, checked before any write
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    fail("writing checkpoint {}: cannot create the directory: {}", dir.string(), ec.message());

  // Shards filled in the given order, so a layer's tensors stay together.
  std::vector<std::vector<SafetensorsTensor>> shards;
  uint64_t filled = 0, total = 0;
  for (const SafetensorsTensor& t : tensors) {
    const uint64_t bytes = tensor_bytes(t);
    if (shards.empty() || (filled > 0 && filled + bytes > max_shard_bytes)) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(t);
    filled += bytes;
    total += bytes;
  }
  // Hugging Face refuses a file whose metadata has no "format".
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");

  std::vector<fs::path> written;
  std::set<std::string> keep;
  if (shards.size() <= 1) {
    written.push_back(dir / kSingleFile);
    write_safetensors(
        written.back(),
        shards.empty() ? std::span<const SafetensorsTensor>{} : std::span(shards.front()), meta);
    keep.insert(kSingleFile);
  } else {
    json weight_map = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string name =
          fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
      written.push_back(dir / name);
      write_safetensors(written.back(), shards[s], meta);
      keep.insert(name);
      for (const SafetensorsTensor& t : shards[s]) weight_map[t.name] = name;
    }
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    written.push_back(dir / kIndexFile);
    AtomicFile out(written.back());
    out.write(text.data(), text.size());
    out.commit();
    keep.insert(kIndexFile);
  }
  // Files of an earlier save with another layout would shadow or contradict this one.
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string name = de.path().filename().string();
    const bool ours = name == kSingleFile || name == kIndexFile || is_shard_name(name);
    if (ours && !keep.contains(name)) fs::remove(de.path(), ec);
  }
  return written;
}

}  // namespace strata
