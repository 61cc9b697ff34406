// weights.h: a whole model's parameters (and gradients) resident on one device.
//
// What `strata eval` and the tests use; the trainer keeps ZeRO-3 shards in their home tiers
// instead (src/partition, src/tier). Loading streams one unit at a time through one host
// staging buffer the size of the largest unit, so it never holds a second copy of the model.
#pragma once

#include "core/device.h"
#include "model/llama.h"

#include <filesystem>
#include <optional>
#include <vector>

namespace strata {

class SafetensorsReader;
struct SafetensorsTensor;

// The weights of the model `config` describes, from `path` (a model directory, or what
// SafetensorsReader::open takes). For a Gemma3ForConditionalGeneration checkpoint
// (config.image_text_checkpoint()) the language model's tensors, under the names of a
// Gemma3ForCausalLM's (model.*, lm_head.weight), from either layout transformers saves
// (language_model.model.*, or model.language_model.* since 4.52); the vision tower and its
// projector are left out of this reader (they are not trained, which is logged as a warning;
// checkpoints carry them through image_text_extras).
SafetensorsReader open_model_weights(const std::filesystem::path& path, const LlamaConfig& config);

// How an image-text Gemma 3's files name its language model: true for model.language_model.*
// (transformers 4.52 and later), false for language_model.model.* (4.50, 4.51, the published
// checkpoints); nullopt where `reader` holds neither's embeddings.
std::optional<bool> image_text_nested_names(const SafetensorsReader& reader);
// The tensors of an image-text Gemma 3's files that are not its language model's (the vision
// tower and projector), as stored: their bytes point into `reader`'s mapping. Empty where the
// reader holds no image-text checkpoint.
std::vector<SafetensorsTensor> image_text_extras(const SafetensorsReader& reader);
// Renames a Gemma3ForCausalLM's tensors (model.*, lm_head.weight) to those of the language model
// inside an image-text checkpoint of that layout (image_text_nested_names).
void nest_language_model(std::vector<SafetensorsTensor>& tensors, bool nested);

// Throws Error naming the first tensor of `reader` that is no part of a model of `layout`
// (rotary_emb.inv_freq, which some checkpoints carry, aside).
void check_tensor_names(const ModelLayout& layout, const SafetensorsReader& reader);

// Parameter `p` from a checkpoint into dst (p.numel() elements of dtype): the tensor of its own
// name, or its rows of a fused one (ParamSlot::file_name). A missing tensor, or one of another
// shape, is an Error naming the file and tensor (and both shapes).
void read_parameter(const SafetensorsReader& reader, const ParamSlot& p, void* dst, DType dtype);

class ResidentWeights {
 public:
  // Allocates every unit's parameters in `param_dtype` (and gradients in `grad_dtype` when
  // with_grads) from `device`'s arena; contents undefined until loaded or initialised.
  ResidentWeights(const ModelLayout& layout, Device& device, DType param_dtype, DType grad_dtype,
                  bool with_grads);

  std::vector<UnitBuffers> units() const;
  const ModelLayout& layout() const { return layout_; }

  // Hugging Face's initialisation from `seed` (init_unit_random), the same bits every time.
  void init_random(uint64_t seed, Stream& stream);
  // Every tensor of the layout from a checkpoint, converted to param_dtype; a missing tensor
  // or a shape that differs from the config is an error naming both. Tensors the model has no
  // use for are an error too (a checkpoint of another architecture), except rotary caches.
  void load(const SafetensorsReader& reader, Stream& stream);
  void zero_grads(Stream& stream);

  // Unit u's parameters (or gradients) as f32 in host memory, padding included.
  std::vector<float> download(int u, bool grad, Stream& stream) const;
  // Replaces unit u's parameters with `values` (f32, the unit's numel), converted.
  void upload(int u, const std::vector<float>& values, Stream& stream);

  uint64_t param_bytes() const;

 private:
  const ModelLayout& layout_;
  Device& device_;
  DType param_dtype_, grad_dtype_;
  std::vector<DeviceBuffer> params_, grads_;
};

}  // namespace strata
