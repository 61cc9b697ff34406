// checkpoint.cpp: writing and reading checkpoints (see checkpoint.h).
#include "train/checkpoint.h"

#include "core/error.h"
#include "core/log.h"
#include "model/file_io.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "schedule/executor.h"
#include "train/checkpoint_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <memory>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>
#include <xxhash.h>

namespace strata {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainerState = "trainer_state.json";
constexpr const char* kOptimizer = "optimizer.safetensors";
// Each unit's tensors in it: the fp32 master weights, m and v (UnitOptimizerState's order), those
// the optimizer keeps (core/optimizer.h: Lion no exp_avg_sq, Adagrad no exp_avg, its sum of
// squares being DeepSpeed's exp_avg_sq). The file's metadata names the optimizer.
constexpr std::array<const char*, 3> kOptimizerSuffixes = {".master", ".exp_avg", ".exp_avg_sq"};

bool keeps_field(OptimizerType t, size_t k) {
  return k == 0 || (k == 1 && optimizer_keeps_m(t)) || (k == 2 && optimizer_keeps_v(t));
}

// The optimizer whose state `reader` holds: its metadata's "optimizer", adam when absent (the
// files written before Lion and Adagrad).
OptimizerType saved_optimizer(const SafetensorsReader& reader, const fs::path& file) {
  const auto it = reader.metadata().find("optimizer");
  if (it == reader.metadata().end() || it->second == "adam") return OptimizerType::adam;
  if (it->second == "lion") return OptimizerType::lion;
  if (it->second == "adagrad") return OptimizerType::adagrad;
  fail(
      "checkpoint: {} holds the state of optimizer \"{}\", which this strata does not know "
      "(adam, lion, adagrad); resume it with the strata that wrote it",
      file.string(), it->second);
}
constexpr const char* kModel = "model.safetensors";
constexpr const char* kConfig = "config.json";

FileDigest write_text(const fs::path& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
  return f.digest();
}

// Removes a checkpoint directory so that no crash can leave it looking complete with files
// missing: it is first renamed out of the step-N namespace (atomic), then deleted.
void retire(const fs::path& checkpoint) {
  std::error_code ec;
  if (!fs::exists(checkpoint, ec)) return;
  const fs::path old = checkpoint.parent_path() / (".old-" + checkpoint.filename().string());
  fs::remove_all(old, ec);
  fs::rename(checkpoint, old, ec);
  if (ec)
    fail("checkpoint: cannot rename {} out of the way: {}; check the run directory's permissions",
         checkpoint.string(), ec.message());
  fsync_path(checkpoint.parent_path());
  fs::remove_all(old, ec);
}

std::string hex64(uint64_t v) {
  return fmt::format("{:016x}", v);
}

nlohmann::json digest_json(const FileDigest& d) {
  nlohmann::json j = {{"bytes", d.bytes}, {"xxh3", hex64(d.xxh3)}};
  if (!d.tensors.empty()) {
    nlohmann::json t = nlohmann::json::object();
    for (const auto& [name, h] : d.tensors) t[name] = hex64(h);
    j["tensors"] = std::move(t);
  }
  return j;
}

// XXH3-64 of [offset, offset + bytes) of a mapped file, dropping the pages as it goes so that
// verifying a large checkpoint does not stay in our resident set.
uint64_t hash_range(const MappedFile& f, uint64_t offset, uint64_t bytes) {
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) fail("verifying {}: out of memory for a checksum state", f.path());
  XXH3_64bits_reset(st);
  constexpr uint64_t kChunk = 64ull << 20;
  f.advise_sequential(offset, bytes);
  for (uint64_t at = offset; at < offset + bytes; at += kChunk) {
    const uint64_t n = std::min(kChunk, offset + bytes - at);
    XXH3_64bits_update(st, f.data() + at, n);
    f.release(at, n);
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

// A checkpoint's COMPLETE marker, checked against its own checksum, or its problem in `problem`.
nlohmann::json read_marker(const fs::path& checkpoint, std::string& problem) {
  const fs::path marker_path = checkpoint / kCheckpointCompleteMarker;
  std::ifstream in(marker_path, std::ios::binary);
  if (!in) {
    problem = fmt::format("{} is missing", kCheckpointCompleteMarker);
    return {};
  }
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  nlohmann::json m = nlohmann::json::parse(text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || !m.contains("files") || !m["files"].is_object() ||
      !m.contains("step") || !m.contains("xxh3") || !m["xxh3"].is_string() || m.size() != 3) {
    problem = fmt::format(
        "{} is not the checksum list strata writes (damaged, or written by an older strata)",
        kCheckpointCompleteMarker);
    return {};
  }
  const std::string self = m["xxh3"].get<std::string>();
  m.erase("xxh3");
  const std::string listed = m.dump();
  if (hex64(xxh3_64(listed.data(), listed.size())) != self)
    problem =
        fmt::format("{}: its checksum list fails its own checksum", kCheckpointCompleteMarker);
  return m;
}

// A file of a checkpoint missing, or of another size than its manifest entry says; or "".
std::string size_damage(const fs::path& path, const std::string& name, const nlohmann::json& want) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return fmt::format("{} is missing", name);
  const auto bytes = want.at("bytes").get<uint64_t>();
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return fmt::format("{} cannot be read: {}", name, ec.message());
  if (size != bytes)
    return fmt::format("{} is {} bytes, but {} bytes were written (truncated or overwritten)", name,
                       size, bytes);
  return "";
}

std::string tensor_damage(const std::string& name, const std::string& tensor,
                          const SafetensorsEntry& e) {
  return fmt::format("{}: the data of tensor {} (bytes {}..{}) fail their checksum", name, tensor,
                     e.offset, e.offset + e.bytes);
}

// The problem with a safetensors file of a checkpoint whose data is checked as it is read
// (restore_checkpoint): its size, a header that parses, and every tensor the manifest sums.
std::string header_damage(const fs::path& dir, const std::string& name,
                          const nlohmann::json& want) {
  const fs::path path = dir / name;
  if (std::string d = size_damage(path, name, want); !d.empty()) return d;
  std::optional<SafetensorsReader> reader;
  try {
    reader.emplace(SafetensorsReader::open(path));
  } catch (const Error& e) {
    return fmt::format("{}: its header is damaged ({})", name, e.what());
  }
  for (const auto& [tensor, sum] : want.at("tensors").items())
    if (reader->find(tensor) == nullptr)
      return fmt::format("{}: tensor {} is missing from its header", name, tensor);
  return "";
}

// The problem with one file of a checkpoint against its manifest entry, or "".
std::string file_damage(const fs::path& dir, const std::string& name, const nlohmann::json& want) {
  const fs::path path = dir / name;
  if (std::string d = size_damage(path, name, want); !d.empty()) return d;
  const auto size = want.at("bytes").get<uint64_t>();
  MappedFile f;
  try {
    f = MappedFile::open(path, "checkpoint file");
  } catch (const Error& e) {
    return fmt::format("{} cannot be read: {}", name, e.what());
  }
  if (hex64(hash_range(f, 0, size)) == want.at("xxh3").get<std::string>()) return "";
  // Name the tensor when the file is a safetensors file whose header still parses.
  if (want.contains("tensors")) {
    std::optional<SafetensorsReader> reader;
    try {
      reader.emplace(SafetensorsReader::open(path));
    } catch (const Error& e) {
      return fmt::format("{}: its header is damaged ({})", name, e.what());
    }
    for (const auto& [tensor, sum] : want.at("tensors").items()) {
      const SafetensorsEntry* e = reader->find(tensor);
      if (e == nullptr)
        return fmt::format("{}: tensor {} is missing from its header", name, tensor);
      if (hex64(hash_range(f, e->offset, e->bytes)) != sum.get<std::string>())
        return tensor_damage(name, tensor, *e);
    }
    return fmt::format("{}: its header fails the file's checksum", name);
  }
  return fmt::format("{} fails its checksum", name);
}

}  // namespace

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("fsync {}: cannot open it: {}", path.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("fsync {}: {}; the data may not be on disk", path.string(), std::strerror(err));
}

UnitVisits::UnitVisits(std::span<const SafetensorsTensor> tensors,
                       const std::vector<std::vector<int>>& units) {
  if (units.size() != tensors.size())
    fail("unit visits: {} tensors but units for {}; this is a bug in strata", tensors.size(),
         units.size());
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return safetensors_before(tensors[a], tensors[b]); });
  for (size_t i : order)
    for (int u : units[i])
      if (order_.empty() || order_.back() != u) order_.push_back(u);
}

int UnitVisits::next(int u) {
  if (at_ >= order_.size() || order_[at_] != u) {
    at_ = order_.size();  // off the foreseen order: no more reading ahead
    return -1;
  }
  ++at_;
  return at_ < order_.size() ? order_[at_] : -1;
}

std::vector<SafetensorsTensor> streamed_model_tensors(
    const ModelLayout& layout, DType dtype,
    std::function<void(int, std::vector<float>&, int)> unit_values) {
  struct Held {
    int unit = -1;
    std::vector<float> values;  // that unit's parameters
    std::vector<char> raw;      // and in dtype; both reused from unit to unit
    UnitVisits visits;          // the order the writer asks for units in
  };
  auto held = std::make_shared<Held>();
  auto unit_bytes = [held, dtype, values = std::move(unit_values)](int u) -> const char* {
    if (held->unit != u) {
      held->unit = -1;
      values(u, held->values, held->visits.next(u));
      held->raw.resize(held->values.size() * dtype_size(dtype));
      convert(held->raw.data(), dtype, held->values.data(), DType::f32, held->values.size());
      held->unit = u;
    }
    return held->raw.data();
  };
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<int>> units;  // each tensor's, in the order it asks for them
  for (int u = 0; u < layout.num_units(); ++u)
    for (const ParamSlot& s : layout.units[static_cast<size_t>(u)].params) {
      if (s.file_name != s.name) {
        // Phi-3's fused projections, and tables cut into vocabulary pieces (units of their
        // own, in order): written once, from the part that opens them, as the parts' rows one
        // after another, each handed to the writer from its unit.
        if (s.file_row != 0) continue;
        std::vector<std::pair<int, const ParamSlot*>> parts;
        for (int v = u; v < layout.num_units(); ++v)
          for (const ParamSlot& p : layout.units[static_cast<size_t>(v)].params)
            if (p.file_name == s.file_name) parts.emplace_back(v, &p);
        SafetensorsTensor t{s.file_name, dtype, s.file_shape, nullptr, {}, {}};
        t.parts = [unit_bytes, parts, dtype](const SafetensorsTensor::Put& put) {
          const uint64_t e = dtype_size(dtype);
          for (const auto& [v, part] : parts)
            put(unit_bytes(v) + part->offset * e, static_cast<uint64_t>(part->numel()) * e);
        };
        tensors.push_back(std::move(t));
        units.emplace_back();
        for (const auto& part : parts) units.back().push_back(part.first);
        continue;
      }
      const uint64_t end = s.offset + static_cast<uint64_t>(s.numel());
      tensors.push_back(
          {s.name, dtype,
           std::vector<int64_t>(s.shape.dims.begin(), s.shape.dims.begin() + s.shape.rank), nullptr,
           [unit_bytes, held, u, end, dtype, offset = s.offset * dtype_size(dtype), &s] {
             const char* p = unit_bytes(u);
             if (held->raw.size() < end * dtype_size(dtype))
               fail(
                   "writing {}: its unit gave {} values, too few for the tensor, which ends at "
                   "{}; this is a bug in strata",
                   s.name, held->raw.size() / dtype_size(dtype), end);
             return static_cast<const void*>(p + offset);
           }});
      units.push_back({u});
    }
  held->visits = UnitVisits(tensors, units);
  return tensors;
}

std::vector<fs::path> model_side_files(const std::string& model) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(model, ec)) return found;
  for (const char* name : kModelSideFiles)
    if (fs::is_regular_file(fs::path(model) / name, ec)) found.push_back(fs::path(model) / name);
  return found;
}

void add_image_text_parts(const LlamaConfig& config, const SafetensorsReader* image_text,
                          std::vector<SafetensorsTensor>& tensors, nlohmann::json& config_json) {
  if (image_text == nullptr || !config.image_text_checkpoint()) return;
  const std::optional<bool> nested = image_text_nested_names(*image_text);
  if (!nested) return;  // not an image-text model's files: the language model alone
  nest_language_model(tensors, *nested);
  for (SafetensorsTensor& t : image_text_extras(*image_text)) tensors.push_back(std::move(t));
  const nlohmann::json dtype = config_json["torch_dtype"];
  config_json = to_hf_image_text_config_json(config);
  config_json["torch_dtype"] = dtype;
  config_json["text_config"]["torch_dtype"] = dtype;
}

fs::path save_checkpoint(const fs::path& run_dir, int64_t step, const Executor& executor,
                         const LlamaConfig& config, DType model_dtype,
                         const nlohmann::json& trainer_state, int keep,
                         const std::vector<fs::path>& carried,
                         const SafetensorsReader* image_text) {
  const fs::path dir = run_dir / kCheckpointsFolder;
  const fs::path final_dir = dir / checkpoint_dir_name(step);
  const fs::path tmp = dir / fmt::format(".tmp-step-{}", step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    fail("checkpoint: cannot create {}: {}; check the run directory's permissions", dir.string(),
         ec.message());
  // Saves and removals interrupted earlier (a crash, a full disk) leave these behind.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-step-", 0) == 0 || name.rfind(".old-step-", 0) == 0)
      fs::remove_all(e.path(), ec);
  }
  fs::create_directory(tmp, ec);
  if (ec) fail("checkpoint: cannot create {}: {}", tmp.string(), ec.message());

  const ModelLayout layout = ModelLayout::build(config);
  const int U = layout.num_units();
  const OptimizerType otype = executor.placement().shape.optimizer;
  nlohmann::json files = nlohmann::json::object();  // name -> digest, for COMPLETE
  // Both files stream one unit at a time (streamed_model_tensors): a checkpoint of a 70B model
  // with its optimizer state on NVMe needs one unit's state in RAM, not 840 GB.
  // The model, as Hugging Face names and shapes it, in the run's dtype.
  // An image-text Gemma 3's: its language model under that checkpoint's names beside its
  // vision tower, and its config.
  // Its torch_dtype is the weights' (the run's), as save_pretrained writes it: transformers
  // loads a model in that dtype with torch_dtype "auto" (transformers 5's default).
  LlamaConfig saved = config;
  saved.torch_dtype = model_dtype;
  nlohmann::json config_json = to_hf_config_json(saved);
  {  // its unit buffers freed before the optimizer state's are filled
    std::vector<SafetensorsTensor> model_tensors = streamed_model_tensors(
        layout, model_dtype,
        [&](int u, std::vector<float>& out, int next) { executor.parameters(u, out, next); });
    add_image_text_parts(config, image_text, model_tensors, config_json);
    files[kModel] = digest_json(write_safetensors(tmp / kModel, model_tensors, {{"format", "pt"}}));
  }
  if (image_text != nullptr) image_text->release_pages();  // the vision tower's, just copied
  files[kConfig] = digest_json(write_text(tmp / kConfig, config_json.dump(2) + "\n"));
  // The optimizer state, one unit at a time (its three tensors sort together), each tensor
  // handed to the writer in pieces from wherever its shards lie, the next unit read from NVMe
  // while one is written.
  {
    int held = -1;
    Executor::OptimizerStateView view;  // unit `held`'s
    UnitVisits visits;
    std::vector<SafetensorsTensor> tensors;
    std::vector<std::vector<int>> units;
    for (int u = 0; u < U; ++u) {
      const std::string& name = layout.units[static_cast<size_t>(u)].name;
      const auto n = static_cast<int64_t>(layout.units[static_cast<size_t>(u)].numel);
      for (size_t k = 0; k < kOptimizerSuffixes.size(); ++k) {
        if (!keeps_field(otype, k)) continue;
        SafetensorsTensor t{name + kOptimizerSuffixes[k], DType::f32, {n}, nullptr, {}, {}};
        t.parts = [&, u, k](const SafetensorsTensor::Put& put) {
          if (held != u) {
            held = -1;
            view = executor.optimizer_state_view(u, visits.next(u));
            held = u;
          }
          for (const std::span<const float>& part : view.parts[k])
            put(part.data(), part.size_bytes());
        };
        tensors.push_back(std::move(t));
        units.push_back({u});
      }
    }
    visits = UnitVisits(tensors, units);
    files[kOptimizer] = digest_json(write_safetensors(
        tmp / kOptimizer, tensors,
        {{"format", "strata-optimizer"}, {"optimizer", std::string(optimizer_type_name(otype))}}));
  }
  files[kTrainerState] = digest_json(write_text(tmp / kTrainerState, trainer_state.dump(2) + "\n"));
  for (const fs::path& from : carried) {
    const std::string name = from.filename().string();
    if (std::find(std::begin(kModelSideFiles), std::end(kModelSideFiles), name) ==
        std::end(kModelSideFiles))
      fail(
          "checkpoint: {} is not one of the model directory's files a checkpoint carries; this "
          "is a bug in strata",
          from.string());
    std::ifstream in(from, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in || in.bad())
      fail("checkpoint: cannot read {} to carry it into the checkpoint: {}", from.string(),
           std::strerror(errno));
    files[name] = digest_json(write_text(tmp / name, text.str()));
  }
  fsync_path(tmp);

  retire(final_dir);  // an incomplete one, or one a --resume-fallback run found damaged
  fs::rename(tmp, final_dir, ec);
  if (ec)
    fail("checkpoint: cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  fsync_path(dir);
  // The marker lists every file's checksums and carries a checksum of its own content.
  nlohmann::json marker = {{"step", step}, {"files", files}};
  const std::string listed = marker.dump();
  marker["xxh3"] = hex64(xxh3_64(listed.data(), listed.size()));
  write_text(final_dir / kCheckpointCompleteMarker, marker.dump(2) + "\n");
  fsync_path(final_dir);

  if (keep > 0) {
    auto all = complete_checkpoints(run_dir);
    while (static_cast<int>(all.size()) > keep) {
      retire(all.front().second);
      all.erase(all.begin());
    }
  }
  return final_dir;
}

nlohmann::json read_trainer_state(const fs::path& checkpoint) {
  const fs::path path = checkpoint / kTrainerState;
  std::ifstream f(path);
  if (!f)
    fail("checkpoint {}: {} is missing; the checkpoint is incomplete, resume from another one",
         checkpoint.string(), kTrainerState);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    fail("checkpoint {}: {} is not a JSON object; the checkpoint is damaged", checkpoint.string(),
         kTrainerState);
  return j;
}

namespace {

// Whether the optimizer file holds every unit of `layout`, each of its size.
bool holds_layout(const SafetensorsReader& reader, const ModelLayout& layout) {
  const OptimizerType t = saved_optimizer(reader, "optimizer.safetensors");
  for (const UnitLayout& unit : layout.units)
    for (size_t k = 0; k < kOptimizerSuffixes.size(); ++k) {
      if (!keeps_field(t, k)) continue;
      const SafetensorsEntry* e = reader.find(unit.name + kOptimizerSuffixes[k]);
      if (e == nullptr || static_cast<uint64_t>(e->numel()) != unit.numel) return false;
    }
  return true;
}

// Unit u of `layout`'s optimizer state from a file saved with another layout of the same
// model, `saved` (its vocabulary cut into other pieces: a run resumed by a strata that cuts
// them otherwise), parameter by parameter (relaid_unit).
UnitOptimizerState relaid_state(const SafetensorsReader& reader, const ModelLayout& saved,
                                const ModelLayout& layout, int u) {
  UnitOptimizerState st;
  std::array<std::vector<float>*, 3> out = {&st.master, &st.m, &st.v};
  const OptimizerType t = saved_optimizer(reader, "optimizer.safetensors");
  for (size_t k = 0; k < kOptimizerSuffixes.size(); ++k) {
    if (!keeps_field(t, k)) continue;
    int held_unit = -1;
    std::vector<float> held;
    *out[k] = relaid_unit(
        saved,
        [&](int v) -> const std::vector<float>& {
          if (held_unit != v) {
            const UnitLayout& from = saved.units[static_cast<size_t>(v)];
            held.resize(from.numel);
            const std::vector<int64_t> shape{static_cast<int64_t>(from.numel)};
            reader.read_checked(from.name + kOptimizerSuffixes[k], held.data(), DType::f32, shape);
            held_unit = v;
          }
          return held;
        },
        layout, u);
  }
  return st;
}

}  // namespace

ModelLayout saved_layout(const SafetensorsReader& reader, const LlamaConfig& config) {
  ModelLayout layout = ModelLayout::build(config);
  if (holds_layout(reader, layout)) return layout;
  LlamaConfig other = config;
  other.vocab_pieces = 0;
  while (reader.find(other.vocab_pieces == 0
                         ? std::string("embedding.master")
                         : fmt::format("embedding.{}.master", other.vocab_pieces)) != nullptr)
    ++other.vocab_pieces;
  if (other.vocab_pieces < 1 || other.vocab_pieces == layout.vocab_pieces) return layout;
  try {
    ModelLayout saved = ModelLayout::build(other);
    if (holds_layout(reader, saved)) return saved;
  } catch (const Error&) {
    // No such cut of this model: the reader's checks name what is missing.
  }
  return layout;
}

void restore_checkpoint(const fs::path& checkpoint, Executor& executor) {
  // The checksum of each tensor, as COMPLETE lists them: the bytes are checked as they are read
  // (resume_checkpoint verified the rest of the checkpoint, not these).
  std::string problem;
  const nlohmann::json marker = read_marker(checkpoint, problem);
  if (!problem.empty()) throw CheckpointDamaged(checkpoint, problem);
  if (!marker["files"].contains(kOptimizer))
    throw CheckpointDamaged(checkpoint, fmt::format("{} lists no checksum for {}",
                                                    kCheckpointCompleteMarker, kOptimizer));
  const nlohmann::json& want = marker["files"][kOptimizer];
  const nlohmann::json* sums = want.contains("tensors") ? &want["tensors"] : nullptr;
  const SafetensorsReader reader = SafetensorsReader::open(checkpoint / kOptimizer);
  const LlamaConfig& config = executor.placement().shape.model;
  const OptimizerType otype = executor.placement().shape.optimizer;
  if (const OptimizerType had = saved_optimizer(reader, checkpoint / kOptimizer); had != otype)
    fail(
        "resume from {}: its optimizer state is {}'s, and this run's optimizer is {}; resume with "
        "the optimizer it was trained with (optimizer.type in the config), or start a new run "
        "from its weights (--model {})",
        checkpoint.string(), optimizer_type_name(had), optimizer_type_name(otype),
        checkpoint.string());
  const ModelLayout layout = ModelLayout::build(config);
  const ModelLayout saved = saved_layout(reader, config);
  if (sums == nullptr || saved.vocab_pieces != layout.vocab_pieces) {
    // Read otherwise than tensor by tensor: every byte verified first.
    if (std::string d = file_damage(checkpoint, kOptimizer, want); !d.empty())
      throw CheckpointDamaged(checkpoint, d);
    sums = nullptr;
  }
  if (saved.vocab_pieces != layout.vocab_pieces) {
    fmt::print(
        "checkpoint {}: its optimizer state has the vocabulary in {} piece(s), this run {}; "
        "each parameter's state is carried over row by row\n",
        checkpoint.string(), saved.vocab_pieces, layout.vocab_pieces);
    for (int u = 0; u < layout.num_units(); ++u)
      executor.set_optimizer_state(u, relaid_state(reader, saved, layout, u));
    executor.finish();
    return;
  }
  UnitOptimizerState st;  // reused from unit to unit: the largest unit's, allocated once
  const std::array<std::vector<float>*, 3> out = {&st.master, &st.m, &st.v};
  for (int u = 0; u < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[static_cast<size_t>(u)];
    for (size_t k = 0; k < kOptimizerSuffixes.size(); ++k) {
      if (!keeps_field(otype, k)) continue;
      const char* suffix = kOptimizerSuffixes[k];
      std::vector<float>* v = out[k];
      const SafetensorsEntry* e = reader.find(unit.name + suffix);
      if (e == nullptr)
        fail("checkpoint {}: {} has no tensor {}; the checkpoint is damaged or of another model",
             checkpoint.string(), kOptimizer, unit.name + suffix);
      v->resize(static_cast<size_t>(e->numel()));
      const std::vector<int64_t> shape{e->numel()};
      reader.read_checked(unit.name + suffix, v->data(), DType::f32, shape);
      if (sums != nullptr) {
        const auto sum = sums->find(e->name);
        if (sum == sums->end() || !sum->is_string() || e->dtype != DType::f32 ||
            hex64(xxh3_64(v->data(), e->bytes)) != sum->get<std::string>())
          throw CheckpointDamaged(checkpoint, tensor_damage(kOptimizer, e->name, *e));
      }
    }
    executor.set_optimizer_state(u, st);  // written to NVMe while the next unit is read
  }
  executor.finish();  // the last unit's writes, and any error they met
}

CheckpointDamaged::CheckpointDamaged(const fs::path& at, const std::string& why)
    : Error(fmt::format("checkpoint {} is damaged: {}", at.string(), why)),
      checkpoint(at),
      damage(why) {}

std::string checkpoint_damage(const fs::path& checkpoint, bool optimizer_data) {
  std::string problem;
  const nlohmann::json m = read_marker(checkpoint, problem);
  if (!problem.empty()) return problem;
  try {
    for (const char* name : {kConfig, kModel, kOptimizer, kTrainerState})
      if (!m["files"].contains(name))
        return fmt::format("{} lists no checksum for {}", kCheckpointCompleteMarker, name);
    for (const auto& [name, want] : m["files"].items()) {
      std::string d = !optimizer_data && name == kOptimizer && want.contains("tensors")
                          ? header_damage(checkpoint, name, want)
                          : file_damage(checkpoint, name, want);
      if (!d.empty()) return d;
    }
  } catch (const nlohmann::json::exception& e) {
    return fmt::format("{}: malformed checksum entry ({})", kCheckpointCompleteMarker, e.what());
  }
  return "";
}

namespace {

[[noreturn]] void refuse_damaged(const fs::path& checkpoint, const std::string& damage) {
  fail("checkpoint {} is damaged: {}; resume from an earlier checkpoint (--resume-fallback)",
       checkpoint.string(), damage);
}

}  // namespace

void verify_checkpoint(const fs::path& checkpoint) {
  const std::string d = checkpoint_damage(checkpoint);
  if (!d.empty()) refuse_damaged(checkpoint, d);
}

fs::path resume_checkpoint_at(const fs::path& path, bool fallback, const KnownDamage& known) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    fail(
        "--resume-from {}: no such directory; name a checkpoint directory (RUN/checkpoints/"
        "step-N) or a run directory (--run-dir of `strata train`)",
        path.string());
  if (fs::is_regular_file(path / kCheckpointCompleteMarker, ec)) {
    // A damaged one is refused, naming the file and tensor that changed.
    const auto k = known.find(path);
    const std::string d = k != known.end() ? k->second : checkpoint_damage(path, false);
    if (!d.empty()) refuse_damaged(path, d);
    return path;
  }
  if (is_run_dir(path)) return resume_checkpoint(path, fallback, known);
  if (checkpoint_step(path.filename().string()))
    fail(
        "--resume-from {}: the checkpoint has no {} marker, so it was still being written when "
        "its run stopped and cannot be trusted; name a complete one (or the run directory, for "
        "its newest complete one)",
        path.string(), kCheckpointCompleteMarker);
  fail(
      "--resume-from {}: neither a checkpoint directory (one holding {}, as RUN/checkpoints/"
      "step-N does) nor a run directory (one holding {}/); name one of those",
      path.string(), kCheckpointCompleteMarker, kCheckpointsFolder);
}

std::vector<fs::path> set_aside_checkpoints_after(const fs::path& run_dir, int64_t step) {
  const fs::path folder = run_dir / kCheckpointsFolder;
  std::vector<std::pair<int64_t, fs::path>> later;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(folder, ec)) {
    const std::optional<int64_t> s = checkpoint_step(e.path().filename().string());
    if (s && *s > step && e.is_directory(ec)) later.emplace_back(*s, e.path());
  }
  std::sort(later.begin(), later.end());
  std::vector<fs::path> moved;
  for (const auto& [s, from] : later) {
    fs::path to = folder / fmt::format("abandoned-{}", from.filename().string());
    for (int n = 2; fs::exists(to, ec); ++n)
      to = folder / fmt::format("abandoned-{}.{}", from.filename().string(), n);
    fs::rename(from, to, ec);
    if (ec)
      fail(
          "resume: cannot set {} aside as {}: {}; it is of a later step than the checkpoint "
          "resumed from, so the resumed run would mistake it for its own; check the run "
          "directory's permissions, or move it yourself",
          from.string(), to.string(), ec.message());
    moved.push_back(to);
  }
  if (!moved.empty()) fsync_path(folder);
  return moved;
}

fs::path resume_checkpoint(const fs::path& run_dir, bool fallback, const KnownDamage& known) {
  const fs::path newest = newest_checkpoint(run_dir);  // names the run when there is none
  const auto all = complete_checkpoints(run_dir);
  std::vector<std::string> skipped;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const auto k = known.find(it->second);
    const std::string d = k != known.end() ? k->second : checkpoint_damage(it->second, false);
    if (d.empty()) {
      if (!skipped.empty())
        log_warn("--resume-fallback: resuming from {}, the newest intact checkpoint",
                 it->second.string());
      return it->second;
    }
    if (!fallback) {
      const auto prev = std::next(it);
      fail("resume: checkpoint {} is damaged: {}; {}", it->second.string(), d,
           prev == all.rend()
               ? std::string("it is the run's only complete checkpoint, so the run must start "
                             "again (or restore the file from a copy)")
               : fmt::format("add --resume-fallback to resume from the newest intact earlier "
                             "checkpoint ({} is the next one), or restore the file from a copy",
                             prev->second.filename().string()));
    }
    log_warn("--resume-fallback: skipping damaged checkpoint {}: {}", it->second.string(), d);
    skipped.push_back(it->second.filename().string());
  }
  fail(
      "resume: every complete checkpoint of {} is damaged ({} of them, newest {}); the run must "
      "start again",
      run_dir.string(), skipped.size(), newest.filename().string());
}

}  // namespace strata
