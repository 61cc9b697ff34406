#include "model/weights.h"

#include "core/error.h"
#include "core/log.h"
#include "model/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

namespace strata {

ResidentWeights::ResidentWeights(const ModelLayout& layout, Device& device, DType param_dtype,
                                 DType grad_dtype, bool with_grads)
    : layout_(layout), device_(device), param_dtype_(param_dtype), grad_dtype_(grad_dtype) {
  for (const UnitLayout& u : layout.units) {
    params_.emplace_back(device, u.numel * dtype_size(param_dtype),
                         fmt::format("parameters of unit {}", u.name), MemoryKind::parameters);
    if (with_grads)
      grads_.emplace_back(device, u.numel * dtype_size(grad_dtype),
                          fmt::format("gradients of unit {}", u.name), MemoryKind::gradients);
  }
}

std::vector<UnitBuffers> ResidentWeights::units() const {
  std::vector<UnitBuffers> out(params_.size());
  for (size_t u = 0; u < params_.size(); ++u) {
    out[u].params = params_[u].data();
    out[u].grads = grads_.empty() ? nullptr : grads_[u].data();
  }
  return out;
}

uint64_t ResidentWeights::param_bytes() const {
  uint64_t n = 0;
  for (const DeviceBuffer& b : params_) n += b.bytes();
  return n;
}

void ResidentWeights::init_random(uint64_t seed, Stream& stream) {
  uint64_t largest = 0;
  for (const UnitLayout& u : layout_.units) largest = std::max(largest, u.numel);
  std::vector<char> staging(largest * dtype_size(param_dtype_));
  for (int u = 0; u < layout_.num_units(); ++u) {
    init_unit_random(layout_, u, seed, param_dtype_, staging.data());
    device_.copy_to_device(params_[static_cast<size_t>(u)].data(), staging.data(),
                           params_[static_cast<size_t>(u)].bytes(), stream);
    stream.synchronize();  // the staging buffer is reused by the next unit
  }
}

namespace {

// transformers 4.50 and 4.51 save Gemma3ForConditionalGeneration's language model as
// language_model (a Gemma3ForCausalLM) beside vision_tower and multi_modal_projector; 4.52 and
// later as model.language_model (a Gemma3TextModel) beside model.vision_tower, with lm_head at
// the top (tied, so usually absent).
struct ImageTextNames {
  std::string model, head, part;  // model.* and lm_head.weight's names; the language model's part
  explicit ImageTextNames(bool nested)
      : model(nested ? "model.language_model." : "language_model.model."),
        head(nested ? "lm_head.weight" : "language_model.lm_head.weight"),
        part(nested ? "model.language_model" : "language_model") {}
  bool language(const std::string& name) const { return name == head || name.starts_with(part); }
};

}  // namespace

std::optional<bool> image_text_nested_names(const SafetensorsReader& reader) {
  if (reader.find("model.language_model.embed_tokens.weight") != nullptr) return true;
  if (reader.find("language_model.model.embed_tokens.weight") != nullptr) return false;
  return std::nullopt;
}

std::vector<SafetensorsTensor> image_text_extras(const SafetensorsReader& reader) {
  std::vector<SafetensorsTensor> extras;
  const std::optional<bool> nested = image_text_nested_names(reader);
  if (!nested) return extras;
  const ImageTextNames names(*nested);
  for (const SafetensorsEntry& e : reader.tensors())
    if (!names.language(e.name))
      extras.push_back({e.name, e.dtype, e.shape, reader.stored_bytes(e)});
  return extras;
}

void nest_language_model(std::vector<SafetensorsTensor>& tensors, bool nested) {
  const ImageTextNames names(nested);
  for (SafetensorsTensor& t : tensors) {
    if (t.name == "lm_head.weight")
      t.name = names.head;
    else if (t.name.starts_with("model."))
      t.name = names.model + t.name.substr(6);
    else
      fail("image-text checkpoint: tensor '{}' is no Gemma3ForCausalLM's; this is a bug in strata",
           t.name);
  }
}

SafetensorsReader open_model_weights(const std::filesystem::path& path, const LlamaConfig& config) {
  SafetensorsReader reader = SafetensorsReader::open(path);
  if (!config.image_text_checkpoint()) return reader;
  const std::optional<bool> nested = image_text_nested_names(reader);
  if (!nested)
    fail(
        "checkpoint {}: config.json describes a Gemma3ForConditionalGeneration, but its files "
        "hold neither language_model.model.embed_tokens.weight nor "
        "model.language_model.embed_tokens.weight; check that config.json and the safetensors "
        "files belong to the same model",
        reader.source());
  const ImageTextNames names(*nested);
  int64_t others = 0;
  reader.select([&](const std::string& name) -> std::optional<std::string> {
    if (name.starts_with(names.model)) return "model." + name.substr(names.model.size());
    if (name == names.head) return std::string("lm_head.weight");
    // What else the language model's part holds stays, for check_tensor_names to name.
    if (names.language(name)) return name;
    ++others;
    return std::nullopt;
  });
  log_warn(
      "{}: Gemma 3's image-text checkpoint: its language model is read ({} layout) and trained; "
      "its vision tower and projector ({} tensors) are not trained: checkpoints and exports "
      "carry them unchanged",
      reader.source(), *nested ? "transformers 4.52+" : "transformers 4.50", others);
  return reader;
}

void check_tensor_names(const ModelLayout& layout, const SafetensorsReader& reader) {
  std::set<std::string> expected;
  for (const UnitLayout& u : layout.units)
    for (const ParamSlot& p : u.params) expected.insert(p.file_name);
  for (const std::string& name : reader.names())
    if (!expected.contains(name) && !name.ends_with("rotary_emb.inv_freq"))
      fail(
          "checkpoint {}: tensor '{}' is not part of a Llama model with this config; check "
          "that config.json and the safetensors files belong to the same model",
          reader.source(), name);
}

void read_parameter(const SafetensorsReader& reader, const ParamSlot& p, void* dst, DType dtype) {
  if (p.file_name == p.name) {
    const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.rank);
    reader.read_checked(p.name, dst, dtype, shape);
    return;
  }
  // A part of a fused tensor: the whole tensor's shape is checked, then its rows read.
  const SafetensorsEntry* e = reader.find(p.file_name);
  if (e == nullptr)
    fail(
        "checkpoint {}: no tensor '{}' (which holds {}); check that config.json and the "
        "safetensors files belong to the same model",
        reader.source(), p.file_name, p.name);
  if (e->shape != p.file_shape)
    fail(
        "checkpoint {}: tensor '{}' has shape {}, but the model config expects [{}]; check that "
        "config.json and the safetensors files belong to the same model",
        e->file, e->name, e->shape_str(), fmt::format("{}", fmt::join(p.file_shape, ", ")));
  reader.read_rows(p.file_name, p.file_row, p.shape.dims[0], dst, dtype);
}

void ResidentWeights::load(const SafetensorsReader& reader, Stream& stream) {
  check_tensor_names(layout_, reader);

  uint64_t largest = 0;
  for (const UnitLayout& u : layout_.units) largest = std::max(largest, u.numel);
  std::vector<char> staging(largest * dtype_size(param_dtype_));
  for (int u = 0; u < layout_.num_units(); ++u) {
    const UnitLayout& unit = layout_.units[static_cast<size_t>(u)];
    std::fill(staging.begin(), staging.end(), char{0});
    for (const ParamSlot& p : unit.params)
      read_parameter(reader, p, staging.data() + p.offset * dtype_size(param_dtype_), param_dtype_);
    device_.copy_to_device(params_[static_cast<size_t>(u)].data(), staging.data(),
                           params_[static_cast<size_t>(u)].bytes(), stream);
    stream.synchronize();
  }
}

void ResidentWeights::zero_grads(Stream& stream) {
  for (DeviceBuffer& g : grads_) device_.fill_zero(g.data(), g.bytes(), stream);
}

std::vector<float> ResidentWeights::download(int u, bool grad, Stream& stream) const {
  if (grad && grads_.empty())
    fail("download of unit {}'s gradients: these weights were made without gradients",
         layout_.units.at(static_cast<size_t>(u)).name);
  const DeviceBuffer& b = (grad ? grads_ : params_).at(static_cast<size_t>(u));
  const DType t = grad ? grad_dtype_ : param_dtype_;
  std::vector<char> raw(b.bytes());
  device_.copy_to_host(raw.data(), b.data(), b.bytes(), stream);
  stream.synchronize();
  std::vector<float> out(b.bytes() / dtype_size(t));
  convert(out.data(), DType::f32, raw.data(), t, out.size());
  return out;
}

void ResidentWeights::upload(int u, const std::vector<float>& values, Stream& stream) {
  const DeviceBuffer& b = params_.at(static_cast<size_t>(u));
  const uint64_t n = b.bytes() / dtype_size(param_dtype_);
  if (values.size() != n)
    fail("upload to unit {}: {} values given for {} elements",
         layout_.units.at(static_cast<size_t>(u)).name, values.size(), n);
  std::vector<char> raw(b.bytes());
  convert(raw.data(), param_dtype_, values.data(), DType::f32, n);
  device_.copy_to_device(b.data(), raw.data(), b.bytes(), stream);
  stream.synchronize();
}

}  // namespace strata
