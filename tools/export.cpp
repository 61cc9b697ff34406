// export.cpp: `strata export CKPT --out DIR`, a checkpoint as a Hugging Face model directory.
//
// CKPT is a checkpoint directory (RUN/checkpoints/step-N) or a run directory (its newest
// complete checkpoint). The weights come from the checkpoint's fp32 master weights, so an f32
// export of a bf16 run keeps the precision the optimizer had, and a bf16 export equals the
// run's parameters bit for bit (they are the master rounded to nearest even). Past
// --max-shard-size the model is sharded with model.safetensors.index.json, as Hugging Face
// writes it. The tokenizer and generation files the checkpoint carries (copied from the model
// directory the run started from) are copied beside them. A checkpoint of an image-text Gemma 3
// exports as that model again: its language model beside the vision tower the checkpoint carries.
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"
#include "train/checkpoint_dir.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <optional>

namespace strata::cli {
namespace {

namespace fs = std::filesystem;

struct ExportArgs {
  std::string checkpoint, out, dtype = "bf16", max_shard_size = "5GB";
  bool text_only = false;
};

int run_export(const ExportArgs& a) {
  fs::path ckpt = a.checkpoint;
  if (!fs::exists(ckpt / "COMPLETE")) {
    if (!fs::is_directory(ckpt / "checkpoints"))
      fail(
          "export {}: neither a complete checkpoint (no COMPLETE file) nor a run directory (no "
          "checkpoints/); name RUN/checkpoints/step-N or RUN",
          ckpt.string());
    ckpt = newest_checkpoint(ckpt);
  }
  verify_checkpoint(ckpt);  // what is exported is what was trained, or an Error naming the file
  const DType dtype = parse_dtype(a.dtype);
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    fail("--dtype {}: expected f32, bf16 or f16", a.dtype);
  const uint64_t max_shard = parse_bytes(a.max_shard_size);
  const LlamaConfig config = resolve_model(ckpt.string());
  const SafetensorsReader optimizer = SafetensorsReader::open(ckpt / "optimizer.safetensors");
  // In the vocabulary pieces the run had (--vocab-pieces), which the file's units show.
  const ModelLayout layout = saved_layout(optimizer, config);
  // Streamed one unit at a time, as a checkpoint is written: a 70B export needs RAM for its
  // largest unit, not for the model.
  for (const UnitLayout& unit : layout.units)
    if (optimizer.find(unit.name + ".master") == nullptr)
      fail("export {}: optimizer.safetensors has no {}.master; the checkpoint is damaged",
           ckpt.string(), unit.name);
  std::vector<SafetensorsTensor> tensors =
      streamed_model_tensors(layout, dtype, [&](int u, std::vector<float>& master, int) {
        const UnitLayout& unit = layout.units[static_cast<size_t>(u)];
        const std::string name = unit.name + ".master";
        const auto n = static_cast<uint64_t>(optimizer.find(name)->numel());
        if (n != unit.numel)
          fail("export {}: {} has {} values where {} has {}; the checkpoint is of another model",
               ckpt.string(), name, n, config.name, unit.numel);
        master.resize(n);
        optimizer.read(name, master.data(), DType::f32);
      });
  LlamaConfig written = config;
  written.torch_dtype = dtype;  // the weights' dtype, as save_pretrained writes it
  nlohmann::json cfg = to_hf_config_json(written);
  // An image-text Gemma 3's checkpoint: its vision tower, as the checkpoint carries it (in the
  // dtype it was read in), beside the language model under the same names, and its config.
  // --text-only: the language model alone, a Gemma3ForCausalLM (as text-only releases of these
  // models ship), whatever the checkpoint carries.
  if (a.text_only && !config.image_text_checkpoint())
    fail(
        "export {}: --text-only is for a checkpoint of an image-text Gemma 3, and this one is of "
        "{} alone; leave --text-only out",
        ckpt.string(), architecture_class(config.architecture));
  std::optional<SafetensorsReader> image_text;
  if (config.image_text_checkpoint() && !a.text_only)
    image_text.emplace(SafetensorsReader::open(ckpt / "model.safetensors"));
  add_image_text_parts(config, image_text ? &*image_text : nullptr, tensors, cfg);
  const fs::path out = a.out;
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) fail("--out {}: cannot create it: {}", out.string(), ec.message());
  const auto files = write_safetensors_sharded(out, tensors, max_shard, {{"format", "pt"}});
  {
    std::ofstream f(out / "config.json");
    f << cfg.dump(2) << "\n";
    if (!f) fail("export: cannot write {}", (out / "config.json").string());
  }
  fsync_path(out / "config.json");
  // The tokenizer and generation files the checkpoint carries (verified above with the rest).
  std::vector<std::string> carried;
  for (const fs::path& from : model_side_files(ckpt.string())) {
    const fs::path to = out / from.filename();
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec) fail("export: cannot copy {} to {}: {}", from.string(), to.string(), ec.message());
    fsync_path(to);
    carried.push_back(from.filename().string());
  }
  fsync_path(out);
  fmt::print("exported {} ({}) to {}: config.json, {} safetensors file(s){}{}\n", ckpt.string(),
             dtype_name(dtype), out.string(), files.size(), carried.empty() ? "" : ", ",
             fmt::join(carried, ", "));
  return 0;
}

}  // namespace

Command add_export(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export", "write a checkpoint as a Hugging Face model directory (config.json + safetensors)");
  cmd->add_option("checkpoint", a->checkpoint, "RUN/checkpoints/step-N, or RUN for its newest")
      ->required();
  cmd->add_option("--out", a->out, "the directory to write")->required();
  cmd->add_option("--dtype", a->dtype, "f32, bf16 or f16")->capture_default_str();
  cmd->add_flag("--text-only", a->text_only,
                "an image-text Gemma 3's language model alone, as Gemma3ForCausalLM");
  cmd->add_option("--max-shard-size", a->max_shard_size, "shard the weights past this size")
      ->capture_default_str();
  return {cmd, [a] { return run_export(*a); }};
}

}  // namespace strata::cli
