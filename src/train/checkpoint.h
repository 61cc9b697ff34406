// checkpoint.h: a training run's checkpoints, written so that a completed one survives
// anything, and read back so that a resumed run continues bit for bit.
//
// A checkpoint is a directory RUN/checkpoints/step-N/ holding:
//   config.json, model.safetensors  the model as Hugging Face writes it (loadable by PyTorch and
//                                   by `strata eval --model`), parameters in the run's dtype;
//   optimizer.safetensors           every unit's fp32 master weights, Adam m and v (tensors
//                                   "<unit>.master", "<unit>.exp_avg", "<unit>.exp_avg_sq", flat),
//                                   copied from wherever they lived (NVMe-homed state included:
//                                   a checkpoint never points into a swap file);
//   trainer_state.json              what the trainer needs besides (step, data position, loss
//                                   scale, the settings), written by the trainer;
//   tokenizer.json, ...             the model directory's tokenizer and generation files
//                                   (model_side_files), copied in when the run started from a
//                                   Hugging Face directory that has them, so that a checkpoint
//                                   and its export stay a model directory others can load;
//   COMPLETE                        written last: JSON listing every file above with its size
//                                   and XXH3-64 (and each tensor's, for the safetensors files),
//                                   plus a checksum of that list; resume verifies it all.
// Writing goes to checkpoints/.tmp-step-N/ (every file fsync'ed), which is renamed to step-N
// and the parent directory fsync'ed before COMPLETE is written and fsync'ed: a directory
// without COMPLETE is never chosen (checkpoint_dir.h). The one thing to know before editing:
// resume sets only the optimizer state; the parameters are its master weights rounded to the
// run's dtype (what every Adam step leaves them as), so model.safetensors is for export and
// inspection, not for resuming.
#pragma once

#include "core/dtype.h"
#include "core/error.h"
#include "model/config.h"
#include "model/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace strata {

class Executor;

struct ModelLayout;

// The model's tensors as Hugging Face names and shapes them (Phi-3's fused projections too:
// hf_file_tensors), in `dtype`, for write_safetensors
// to stream: each one's source fetches its unit's f32 values with unit_values(u, values, next)
// (the flat buffer of ModelLayout, into a vector reused from unit to unit; `next` the unit the
// writer will fetch after it, or -1: see UnitVisits) when the writer first needs a tensor of
// it, and holds that one unit only. Writing a 70B model this way needs RAM
// for its largest unit, not for the model. The
// file orders tensors by name, which keeps a unit's tensors together except the last unit's
// (lm_head first, model.norm last), so at most one unit is fetched twice. `layout` must
// outlive the tensors.
std::vector<SafetensorsTensor> streamed_model_tensors(
    const ModelLayout& layout, DType dtype,
    std::function<void(int, std::vector<float>&, int)> unit_values);

// The order in which write_safetensors, writing `tensors` (tensor i's bytes fetched from units
// units[i], in that order), fetches units, a run of fetches of one unit counted once. A
// streamed writer tells each fetch which unit comes next (next(u), -1 after the last or once
// the fetches leave this order), so the executor can read that one from NVMe while this one is
// written.
class UnitVisits {
 public:
  UnitVisits() = default;
  UnitVisits(std::span<const SafetensorsTensor> tensors,
             const std::vector<std::vector<int>>& units);
  int next(int u);

 private:
  std::vector<int> order_;
  size_t at_ = 0;
};

// The files a Hugging Face model directory holds besides its weights and config.json that a
// checkpoint carries along: the tokenizer (tokenizer.json, tokenizer_config.json,
// tokenizer.model, special_tokens_map.json, and the slow byte-level BPE tokenizers' vocab.json,
// merges.txt and added_tokens.json, which Qwen's and GPT-2-style repositories ship beside
// tokenizer.json for use_fast=False), its chat template (chat_template.jinja, where
// transformers keeps it apart, or chat_template.json, where processors do),
// generation_config.json, and an image-text model's processor files (preprocessor_config.json,
// processor_config.json), which its export needs to take images.
inline constexpr const char* kModelSideFiles[] = {"tokenizer.json",
                                                  "tokenizer_config.json",
                                                  "tokenizer.model",
                                                  "special_tokens_map.json",
                                                  "chat_template.jinja",
                                                  "generation_config.json",
                                                  "chat_template.json",
                                                  "preprocessor_config.json",
                                                  "processor_config.json",
                                                  "vocab.json",
                                                  "merges.txt",
                                                  "added_tokens.json"};
// Those of kModelSideFiles present in `model` when it is a directory (none for a preset name).
std::vector<std::filesystem::path> model_side_files(const std::string& model);

// Writes checkpoint `step` of the executor's state under run_dir/checkpoints/ and removes all
// but the newest `keep` complete checkpoints (keep <= 0: keeps all). `carried` (paths whose
// names are among kModelSideFiles) are copied in and listed in COMPLETE like the rest; one
// that cannot be read is an Error naming it. With `image_text` (the files of the image-text
// Gemma 3 the run's language model was read from: image_text_extras finds its vision tower),
// model.safetensors holds the language model under that checkpoint's names beside the vision
// tower's tensors, unchanged, and config.json is the image-text config: the checkpoint is that
// model again. Returns its directory.
std::filesystem::path save_checkpoint(const std::filesystem::path& run_dir, int64_t step,
                                      const Executor& executor, const LlamaConfig& config,
                                      DType model_dtype, const nlohmann::json& trainer_state,
                                      int keep,
                                      const std::vector<std::filesystem::path>& carried = {},
                                      const SafetensorsReader* image_text = nullptr);

// The model tensors and config.json of a checkpoint or export of `config` (its language model's
// tensors, `tensors`, as streamed_model_tensors gives them): those, or with `image_text` (see
// save_checkpoint) the image-text model's, the vision tower's tensors pointing into its mapping.
void add_image_text_parts(const LlamaConfig& config, const SafetensorsReader* image_text,
                          std::vector<SafetensorsTensor>& tensors, nlohmann::json& config_json);

// The trainer state of a complete checkpoint directory; an Error naming the file when it is
// missing or not JSON.
nlohmann::json read_trainer_state(const std::filesystem::path& checkpoint);

// Puts a checkpoint's optimizer state (and so its parameters) into the executor; an Error
// naming the file and tensor when one is missing or has another size. A checkpoint whose
// vocabulary pieces differ from the run's (LlamaConfig::vocab_pieces) is carried over
// parameter by parameter.
// Each tensor read is checked against the XXH3-64 its COMPLETE marker lists for it (the
// optimizer file's data is verified here, as it is read, not in a pass of its own: see
// checkpoint_damage's `optimizer_data`); one that fails throws CheckpointDamaged.
void restore_checkpoint(const std::filesystem::path& checkpoint, Executor& executor);

// What restore_checkpoint throws when a tensor it read fails its checksum: `damage` says which,
// as checkpoint_damage() would. The executor's state is then partly overwritten: a resume
// takes another checkpoint (resume_checkpoint with the damage known) and restores it whole.
class CheckpointDamaged : public Error {
 public:
  CheckpointDamaged(const std::filesystem::path& checkpoint, const std::string& damage);
  std::filesystem::path checkpoint;
  std::string damage;
};
// Checkpoints found damaged after they were chosen, and why: resume_checkpoint skips them.
using KnownDamage = std::map<std::filesystem::path, std::string>;

// The layout of `config` an optimizer file (optimizer.safetensors) was saved in: `config`'s
// own, or, where the file holds another cut of the vocabulary (as many pieces as it has
// "embedding[.k].master" tensors), that one's; `config`'s when it holds neither (whose
// tensors the reader then finds missing or of another size).
ModelLayout saved_layout(const SafetensorsReader& optimizer, const LlamaConfig& config);

// Why a checkpoint directory cannot be trusted: "" when every file matches the size and
// XXH3-64 checksums its COMPLETE marker lists (the marker checksums its own list too);
// otherwise the first problem, naming the file and, for a safetensors file whose header still
// parses, the tensor whose bytes changed. Reads every byte of the checkpoint once; with
// `optimizer_data` false, every byte but the optimizer file's tensors, whose size, header and
// tensor names are checked (restore_checkpoint checks their bytes as it reads them, so a
// resume reads the largest file once).
std::string checkpoint_damage(const std::filesystem::path& checkpoint, bool optimizer_data = true);
// Throws an Error naming the checkpoint and checkpoint_damage() when it is not "".
void verify_checkpoint(const std::filesystem::path& checkpoint);

// The checkpoint `--resume` continues from: the newest complete one of run_dir, verified
// (checkpoint_damage without the optimizer file's data, which restore_checkpoint checks). A
// damaged one (or one `known` to be) is an Error naming the file and tensor, unless
// `fallback`, which walks back to the newest intact one (warning for each one skipped). An
// Error when there is none.
std::filesystem::path resume_checkpoint(const std::filesystem::path& run_dir, bool fallback,
                                        const KnownDamage& known = {});

// The checkpoint `--resume-from PATH` continues from, verified: PATH itself where it is a
// checkpoint directory (one with the COMPLETE marker: RUN/checkpoints/step-N), or the one
// resume_checkpoint() picks where it is a run directory. An Error names PATH when it is
// neither, or a checkpoint that was never completed, or damaged.
std::filesystem::path resume_checkpoint_at(const std::filesystem::path& path, bool fallback,
                                           const KnownDamage& known = {});

// A resumed run's timeline goes on from `step`: the run directory's checkpoints of later steps
// (complete, damaged or half-written) belong to the run it abandoned, and would otherwise be
// taken for its newest by `--resume` and by the --keep rotation, or replaced when it reaches
// their step. Each is renamed, whole, to checkpoints/abandoned-step-<M> (abandoned-step-<M>.2
// and so on where that name is taken), which nothing of strata reads or removes. Returns the
// new names, oldest step first.
std::vector<std::filesystem::path> set_aside_checkpoints_after(const std::filesystem::path& run_dir,
                                                               int64_t step);

// fsync of a file or directory; an Error naming it on failure.
void fsync_path(const std::filesystem::path& path);

}  // namespace strata
