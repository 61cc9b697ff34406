// test_train_cli.cpp: `strata train` and `strata export` as a user runs them, on the host
// backend with the tiny model: the loss falls on real text, checkpoints are complete, a run
// stopped and resumed gives the uninterrupted run's files byte for byte with every placement
// tried, the export loads back (f32 from the master weights, bf16 equal to the run's
// parameters), checkpoints and exports carry the model directory's tokenizer files, a DeepSpeed
// config as Hugging Face writes it is accepted, and bad input is named.
#include "hf_tokenizer_testing.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "train_cli_testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using test::make_data;
using test::metrics;
using test::slurp;
using test::strata;

const std::string kTiny = "--model tiny --init random --seed 5 --seq-len 32 --micro-batch 2 ";

TEST(TrainCli, LossFallsAndCheckpointsAreComplete) {
  const test::TempDir dir("strata-train");
  const fs::path data = make_data(dir.path), run = dir.path / "run";
  const test::CommandResult r =
      strata("train " + kTiny + "--data " + data.string() + " --steps 30 --lr 3e-3 --run-dir " +
             run.string() + " --save-every 10 --keep 2 --offload-optimizer nvme");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 30u);
  // The byte model starts at about ln(257) = 5.55 and learns the words' letters quickly.
  EXPECT_GT(m.front()["loss"].get<double>(), 5.0);
  EXPECT_LT(m.back()["loss"].get<double>(), 0.7 * m.front()["loss"].get<double>()) << r.out;
  for (const json& j : m)
    for (const char* key : {"lr", "grad_norm", "loss_scale", "tokens_per_s", "lane_busy_s"})
      EXPECT_TRUE(j.contains(key)) << key;
  // --keep 2: steps 20 and 30 remain, each complete, with the optimizer state copied out of
  // the swap directory.
  EXPECT_FALSE(fs::exists(run / "checkpoints/step-10"));
  for (const char* step : {"step-20", "step-30"})
    for (const char* file : {"COMPLETE", "config.json", "model.safetensors",
                             "optimizer.safetensors", "trainer_state.json"})
      EXPECT_TRUE(fs::exists(run / "checkpoints" / step / file)) << step << "/" << file;
  EXPECT_NE(r.out.find("checkpoint: "), std::string::npos) << r.out;
  // A checkpoint is a Hugging Face model directory: strata eval reads it.
  const test::CommandResult e =
      strata("eval --model " + (run / "checkpoints/step-30").string() + " --data " + data.string() +
             " --seq-len 32 --max-sequences 8 --json");
  ASSERT_EQ(e.status, 0) << e.out;
}

// Trains `steps` uninterrupted, and again stopped at `stop` and resumed: the final
// checkpoint's files and every step's loss must be the same.
void expect_resume_identical(const std::string& placement, int steps, int stop) {
  SCOPED_TRACE(placement);
  const test::TempDir dir("strata-resume");
  const fs::path data = make_data(dir.path);
  const std::string base = "train " + kTiny + "--data " + data.string() + " --lr 2e-3 " +
                           "--clip 0.5 --grad-accum 2 --threads 1 " + placement;
  const fs::path a = dir.path / "a", b = dir.path / "b";
  test::CommandResult r =
      strata(base + " --steps " + std::to_string(steps) + " --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps " + std::to_string(stop) + " --run-dir " + b.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps " + std::to_string(steps) + " --run-dir " + b.string() + " --resume");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("step " + std::to_string(stop + 1) + "/"), std::string::npos) << r.out;
  const std::string last = "checkpoints/step-" + std::to_string(steps);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(slurp(a / last / file) == slurp(b / last / file)) << file << " differs";
  const std::vector<json> ma = metrics(a), mb = metrics(b);
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"], mb[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(ma[i]["grad_norm"], mb[i]["grad_norm"]) << "step " << i + 1;
  }
}

TEST(TrainCli, ResumeIsBitIdenticalWithEveryPlacement) {
  expect_resume_identical("", 6, 2);
  expect_resume_identical("--offload-param cpu --offload-optimizer nvme", 6, 3);
  expect_resume_identical(
      "--devices host:2 --persistence-threshold 0 --offload-param nvme --offload-optimizer cpu", 5,
      4);
  // The gradients summed on NVMe too (not part of a checkpoint: each step writes them afresh).
  expect_resume_identical(
      "--devices host:2 --persistence-threshold 0 --offload-param cpu --offload-optimizer nvme "
      "--offload-gradients nvme",
      5, 3);
  expect_resume_identical(
      "--devices host:3 --persistence-threshold 0 --lr-schedule WarmupLR "
      "--warmup-steps 4",
      6, 1);
  // The embedding and the head in vocabulary pieces (units of their own), offloaded.
  expect_resume_identical(
      "--vocab-pieces 3 --devices host:3 --persistence-threshold 0 --offload-param cpu "
      "--offload-optimizer cpu",
      4, 2);
}

// --resume-from (Hugging Face's resume_from_checkpoint): an earlier checkpoint of another run
// starts a new run directory, a run directory stands for its newest checkpoint, and an earlier
// checkpoint of the same run rolls it back, the later ones set aside whole rather than taken for
// the new timeline's or overwritten. Each continues bit for bit. Paths that are no checkpoint,
// and a run directory that holds a run of its own, are refused by name.
TEST(TrainCli, ResumeFromAnEarlierCheckpointOrAnotherRun) {
  const test::TempDir dir("strata-resume-from");
  const fs::path data = make_data(dir.path);
  const std::string base = "train " + kTiny + "--data " + data.string() +
                           " --lr 2e-3 --save-every 2 --keep 0 --threads 1 --steps ";
  const fs::path a = dir.path / "a", b = dir.path / "b", c = dir.path / "c";
  const fs::path a2 = a / "checkpoints/step-2";
  test::CommandResult r = strata(base + "6 --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> ma = metrics(a);
  ASSERT_EQ(ma.size(), 6u);
  const std::string model6 = slurp(a / "checkpoints/step-6/model.safetensors");
  const std::string optimizer6 = slurp(a / "checkpoints/step-6/optimizer.safetensors");

  // Another run's step 2 into a new run directory: steps 3 to 6, as run a trained them.
  r = strata(base + "6 --run-dir " + b.string() + " --resume-from " + a2.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + a2.string() + " at step 2"), std::string::npos) << r.out;
  EXPECT_TRUE(slurp(b / "checkpoints/step-6/model.safetensors") == model6);
  EXPECT_TRUE(slurp(b / "checkpoints/step-6/optimizer.safetensors") == optimizer6);
  const std::vector<json> mb = metrics(b);
  ASSERT_EQ(mb.size(), 4u);
  for (size_t i = 0; i < mb.size(); ++i) {
    EXPECT_EQ(mb[i]["step"], ma[i + 2]["step"]);
    EXPECT_EQ(mb[i]["loss"], ma[i + 2]["loss"]) << "step " << i + 3;
  }
  // Again into b, which now holds a run of its own: refused, b untouched.
  r = strata(base + "6 --run-dir " + b.string() + " --resume-from " + a2.string());
  EXPECT_NE(r.status, 0) << r.out;
  for (const char* part : {"already holds a run", "step-6", "name a new --run-dir", "--resume"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
  EXPECT_EQ(metrics(b).size(), 4u);

  // A run directory stands for its newest checkpoint (Hugging Face's spelling of the flag).
  r = strata(base + "8 --run-dir " + c.string() + " --resume-from-checkpoint " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("at step 6"), std::string::npos) << r.out;
  EXPECT_EQ(metrics(c).size(), 2u);

  // Run a rolled back to its step 2: steps 4 and 6 are set aside whole, the run trains 3 to 6
  // again to the same bits and logs each step once.
  r = strata(base + "6 --run-dir " + a.string() + " --resume-from " + a2.string());
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* aside : {"abandoned-step-4", "abandoned-step-6"}) {
    EXPECT_TRUE(fs::exists(a / "checkpoints" / aside / "COMPLETE")) << aside;
    EXPECT_NE(r.out.find("set aside " + (a / "checkpoints" / aside).string()), std::string::npos)
        << r.out;
  }
  EXPECT_TRUE(slurp(a / "checkpoints/abandoned-step-6/model.safetensors") == model6);
  EXPECT_TRUE(slurp(a / "checkpoints/step-6/model.safetensors") == model6);
  const std::vector<json> again = metrics(a);
  ASSERT_EQ(again.size(), 6u);
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i]["loss"], ma[i]["loss"]);
  // Once more: the names taken get a suffix, nothing is replaced.
  r = strata(base + "6 --run-dir " + a.string() + " --resume-from " + a2.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(fs::exists(a / "checkpoints/abandoned-step-6.2/COMPLETE"));
  EXPECT_TRUE(fs::exists(a / "checkpoints/abandoned-step-6/COMPLETE"));

  // What is not a checkpoint.
  fs::create_directories(dir.path / "plain");
  fs::create_directories(dir.path / "half/checkpoints/step-3");
  const std::string d = " --run-dir " + (dir.path / "d").string() + " --resume-from ";
  struct Case {
    std::string path, says;
  };
  for (const Case& cs : {Case{(dir.path / "missing").string(), "no such directory"},
                         Case{(dir.path / "plain").string(), "neither a checkpoint directory"},
                         Case{(dir.path / "half/checkpoints/step-3").string(), "no COMPLETE"},
                         Case{(dir.path / "half").string(), "no complete checkpoint"}}) {
    r = strata(base + "6" + d + cs.path);
    EXPECT_NE(r.status, 0) << cs.path;
    EXPECT_NE(r.out.find(cs.says), std::string::npos) << cs.says << " in " << r.out;
    EXPECT_NE(r.out.find(cs.path), std::string::npos) << r.out;
  }
  EXPECT_FALSE(fs::exists(dir.path / "d" / "metrics.jsonl"));
}

// Trains `steps` with `args` in `dir`, with activation checkpointing on and off: the final
// checkpoint's files and every step's loss must be the same bits.
// Two runs of `args` for `steps` steps, the second with `flags` added: the same checkpoint files
// and losses bit for bit. `outs`, when given, gets the two runs' output.
void expect_flags_keep_the_bits(const fs::path& dir, const std::string& args,
                                const std::string& flags, int steps,
                                std::array<std::string, 2>* outs = nullptr) {
  const fs::path a = dir / "without", b = dir / "with";
  fs::remove_all(a);
  fs::remove_all(b);
  const std::string base = args + " --steps " + std::to_string(steps);
  test::CommandResult r = strata(base + " --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  if (outs) (*outs)[0] = r.out;
  r = strata(base + " " + flags + " --run-dir " + b.string());
  ASSERT_EQ(r.status, 0) << r.out;
  if (outs) (*outs)[1] = r.out;
  const std::string last = "checkpoints/step-" + std::to_string(steps);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(slurp(a / last / file) == slurp(b / last / file)) << file << " differs";
  const std::vector<json> ma = metrics(a), mb = metrics(b);
  ASSERT_EQ(ma.size(), static_cast<size_t>(steps));
  ASSERT_EQ(mb.size(), static_cast<size_t>(steps));
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_EQ(ma[i]["loss"], mb[i]["loss"]) << i;
}

// expect_flags_keep_the_bits for tiny with each of `placements` (2 steps of 3 micro-batches at
// lr 2e-3 on one thread), the run with `flag` saying `said` and the run without it not.
void expect_flag_keeps_the_bits_and_says(const fs::path& dir, const fs::path& data,
                                         const std::vector<std::string>& placements,
                                         const std::string& flag, const std::string& said) {
  for (const std::string& placement : placements) {
    SCOPED_TRACE(placement);
    std::array<std::string, 2> out;
    expect_flags_keep_the_bits(dir,
                               "train " + kTiny + "--data " + data.string() +
                                   " --lr 2e-3 --grad-accum 3 --threads 1 " + placement,
                               flag, 2, &out);
    EXPECT_NE(out[1].find(said), std::string::npos) << out[1];
    EXPECT_EQ(out[0].find(said), std::string::npos) << out[0];
  }
}

// --activation-checkpointing off keeps each block's activations instead of recomputing them:
// the same kernels on the same inputs, so the same files and losses bit for bit, on one device
// and on two with the state offloaded.
TEST(TrainCli, ActivationCheckpointingOffGivesTheSameBits) {
  const test::TempDir dir("strata-recompute");
  const fs::path data = make_data(dir.path);
  for (const std::string& placement :
       {std::string(""), std::string("--devices host:2 --persistence-threshold 0 "
                                     "--offload-param cpu --offload-optimizer nvme")}) {
    SCOPED_TRACE(placement);
    expect_flags_keep_the_bits(dir.path,
                               "train " + kTiny + "--data " + data.string() +
                                   " --lr 2e-3 --grad-accum 2 --threads 1 " + placement,
                               "--activation-checkpointing off", 3);
  }
  const test::CommandResult bad = strata(
      "train " + kTiny + "--data " + data.string() +
      " --steps 1 --activation-checkpointing sometimes --run-dir " + (dir.path / "bad").string());
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--activation-checkpointing"), std::string::npos) << bad.out;
}

// --micro-batch-group runs a step's micro-batches unit by unit: each unit fetched once per
// group, every micro-batch's gradients added as before, so the same files and losses bit for
// bit, on one device and on two with the state offloaded; a group beyond --grad-accum is refused.
TEST(TrainCli, MicroBatchGroupsGiveTheSameBits) {
  const test::TempDir dir("strata-groups");
  const fs::path data = make_data(dir.path);
  for (const std::string& placement :
       {std::string(""), std::string("--devices host:2 --persistence-threshold 0 "
                                     "--offload-param nvme --offload-optimizer cpu")}) {
    SCOPED_TRACE(placement);
    std::array<std::string, 2> out;
    expect_flags_keep_the_bits(dir.path,
                               "train " + kTiny + "--data " + data.string() +
                                   " --lr 2e-3 --grad-accum 3 --threads 1 " + placement,
                               "--micro-batch-group 2", 2, &out);
    EXPECT_NE(out[1].find("in groups of 2 run unit by unit"), std::string::npos) << out[1];
  }
  const test::CommandResult bad = strata(
      "train " + kTiny + "--data " + data.string() +
      " --steps 1 --grad-accum 2 --micro-batch-group 4 --run-dir " + (dir.path / "bad").string());
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--micro-batch-group 4"), std::string::npos) << bad.out;
}

// --offload-activations cpu copies each block's input to host RAM after its forward and back
// before its backward, the devices keeping a ring of 2: the same files and losses bit for bit,
// on one device and on two with the state offloaded and micro-batches in groups (a model of 4
// layers, so 3 of its block inputs go out); without recompute it is refused naming both flags.
TEST(TrainCli, OffloadedActivationCheckpointsGiveTheSameBits) {
  const test::TempDir dir("strata-act-offload");
  const fs::path data = make_data(dir.path);
  const fs::path config = dir.path / "config.json";
  std::ofstream(config) << R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})";
  const std::string model = "--model " + dir.path.string() +
                            " --init random --seed 5 --seq-len 32 --micro-batch 2 --data " +
                            data.string() + " --lr 2e-3 --grad-accum 3 --threads 1 ";
  for (const std::string& placement :
       {std::string(""), std::string("--devices host:2 --persistence-threshold 0 "
                                     "--offload-param nvme --offload-optimizer cpu "
                                     "--micro-batch-group 2")}) {
    SCOPED_TRACE(placement);
    std::array<std::string, 2> out;
    expect_flags_keep_the_bits(dir.path, "train " + model + placement, "--offload-activations cpu",
                               2, &out);
    const char* said = "activation checkpoints: 3 block input(s) per micro-batch go to host RAM";
    EXPECT_NE(out[1].find(said), std::string::npos) << out[1];
    EXPECT_EQ(out[0].find(said), std::string::npos) << out[0];
  }
  const test::CommandResult bad =
      strata("train " + model +
             "--steps 1 --offload-activations cpu --activation-checkpointing "
             "off --run-dir " +
             (dir.path / "bad").string());
  EXPECT_NE(bad.status, 0);
  for (const char* part : {"--offload-activations", "--activation-checkpointing on"})
    EXPECT_NE(bad.out.find(part), std::string::npos) << part << " missing from " << bad.out;
}

// Without clipping, CPU Adam updating each unit during the backward gives the same files and
// losses bit for bit: on one device with the optimizer on the CPU (bf16, a group of the whole
// step) and on two with P and O on NVMe.
TEST(TrainCli, UpdatingDuringTheBackwardGivesTheSameBits) {
  const test::TempDir dir("strata-udb");
  const fs::path data = make_data(dir.path);
  expect_flag_keeps_the_bits_and_says(
      dir.path, data,
      {"--offload-optimizer cpu --dtype bf16 --micro-batch-group 3",
       "--devices host:2 --persistence-threshold 0 --offload-param nvme --offload-optimizer nvme"},
      "--update-during-backward on", "CPU Adam updates each of");
  // Clipping and fp16 loss scaling need every gradient before any update: refused, naming the
  // settings, before anything runs.
  for (const auto& [flags, words] :
       {std::pair{std::string("--clip 1.0"),
                  std::vector<std::string>{"gradient clipping at 1", "--clip 0",
                                           "--update-during-backward off"}},
        std::pair{
            std::string("--dtype f16"),
            std::vector<std::string>{"--dtype f16", "bf16", "--update-during-backward off"}}}) {
    const test::CommandResult bad =
        strata("train " + kTiny + "--data " + data.string() +
               " --steps 1 --offload-optimizer cpu --update-during-backward on " + flags +
               " --run-dir " + (dir.path / "bad").string());
    EXPECT_NE(bad.status, 0) << flags;
    for (const std::string& w : words) EXPECT_NE(bad.out.find(w), std::string::npos) << bad.out;
    EXPECT_FALSE(fs::exists(dir.path / "bad" / "checkpoints")) << flags;
  }
}

// --reduce-per-group on sums each group's gradients on every device before one reduce-scatter:
// placements still agree bit for bit (two devices, state on the devices or P on NVMe and O on
// the CPU), and the losses stay those of reducing every micro-batch to rounding.
TEST(TrainCli, ReducingOncePerGroupKeepsPlacementsBitIdentical) {
  const test::TempDir dir("strata-rpg");
  const fs::path data = make_data(dir.path);
  const std::string args = "train " + kTiny + "--data " + data.string() +
                           " --lr 2e-3 --grad-accum 3 --threads 1 --devices host:2 "
                           "--persistence-threshold 0 --micro-batch-group 3";
  std::array<std::string, 2> out;
  expect_flags_keep_the_bits(dir.path, args + " --reduce-per-group on",
                             "--offload-param nvme --offload-optimizer cpu", 2, &out);
  for (const std::string& o : out)
    EXPECT_NE(o.find("in groups of 3 run unit by unit, gradients reduced once per group"),
              std::string::npos)
        << o;
  const fs::path each = dir.path / "each";
  const test::CommandResult r = strata(args + " --steps 2 --run-dir " + each.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> once = metrics(dir.path / "without"), per = metrics(each);
  ASSERT_EQ(once.size(), per.size());
  for (size_t i = 0; i < once.size(); ++i)
    EXPECT_NEAR(once[i]["loss"].get<double>(), per[i]["loss"].get<double>(),
                1e-5 * per[i]["loss"].get<double>())
        << i;
  // With groups of one it changes nothing, and says so.
  const test::CommandResult one =
      strata("train " + kTiny + "--data " + data.string() + " --steps 1 --reduce-per-group on " +
             "--run-dir " + (dir.path / "one").string());
  ASSERT_EQ(one.status, 0) << one.out;
  EXPECT_NE(one.out.find("--reduce-per-group on changes nothing"), std::string::npos) << one.out;
}

// A model directory in `dir` holding the tiny preset's config.json with tied embeddings.
fs::path tied_tiny(const fs::path& dir) {
  LlamaConfig tied = *find_preset("tiny");
  tied.tie_word_embeddings = true;
  const fs::path model = dir / "tied";
  fs::create_directories(model);
  std::ofstream(model / "config.json") << to_hf_config_json(tied).dump(2);
  return model;
}

// Tied embeddings in micro-batch groups: the head adds the whole group's gradients into the
// embedding's before the embedding's own, so the run needs them reduced once per group. With
// --reduce-per-group on, placements agree bit for bit (two devices, P on NVMe and O on the CPU);
// without it the run is refused before it starts, naming the flag.
TEST(TrainCli, TiedEmbeddingsTrainInGroupsReducedOncePerGroup) {
  const test::TempDir dir("strata-tied-groups");
  const fs::path data = make_data(dir.path), model = tied_tiny(dir.path);
  const std::string args = "train --model " + model.string() +
                           " --init random --seed 5 --seq-len 32 --micro-batch 2 --data " +
                           data.string() +
                           " --lr 2e-3 --grad-accum 3 --threads 1 --devices host:2 "
                           "--persistence-threshold 0 --micro-batch-group 3";
  std::array<std::string, 2> out;
  expect_flags_keep_the_bits(dir.path, args + " --reduce-per-group on",
                             "--offload-param nvme --offload-optimizer cpu", 2, &out);
  EXPECT_NE(out[1].find("in groups of 3 run unit by unit, gradients reduced once per group"),
            std::string::npos)
      << out[1];
  const fs::path bad = dir.path / "bad";
  const test::CommandResult r = strata(args + " --steps 1 --run-dir " + bad.string());
  EXPECT_NE(r.status, 0) << r.out;
  for (const char* part : {"ties its embeddings", "--reduce-per-group on", "--micro-batch-group 1"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
  EXPECT_FALSE(fs::exists(bad / "checkpoints"));
}

TEST(TrainCli, ExportWritesAHuggingFaceDirectory) {
  const test::TempDir dir("strata-export");
  const fs::path data = make_data(dir.path), run = dir.path / "run";
  ASSERT_EQ(strata("train " + kTiny + "--data " + data.string() + " --steps 3 --dtype bf16 " +
                   "--run-dir " + run.string())
                .status,
            0);
  // bf16: the run's parameters, bit for bit (they are the master rounded to nearest even).
  const fs::path bf16 = dir.path / "bf16", f32 = dir.path / "f32";
  test::CommandResult r = strata("export " + run.string() + " --out " + bf16.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const SafetensorsReader got = SafetensorsReader::open(bf16 / "model.safetensors");
  const SafetensorsReader want =
      SafetensorsReader::open(run / "checkpoints/step-3/model.safetensors");
  ASSERT_EQ(got.names(), want.names());
  for (const SafetensorsEntry& e : want.tensors()) {
    const SafetensorsEntry* g = got.find(e.name);
    ASSERT_NE(g, nullptr) << e.name;
    EXPECT_EQ(g->dtype, DType::bf16) << e.name;
    std::vector<uint16_t> x(static_cast<size_t>(e.numel())), y(x.size());
    want.read(e.name, x.data(), DType::bf16);
    got.read(e.name, y.data(), DType::bf16);
    EXPECT_EQ(x, y) << e.name;
  }
  // f32 from the master weights; sharded past a small size; both load in strata eval.
  r = strata("export " + (run / "checkpoints/step-3").string() + " --out " + f32.string() +
             " --dtype f32 --max-shard-size 200KB");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(fs::exists(f32 / "model.safetensors.index.json"));
  const json cfg = json::parse(slurp(f32 / "config.json"));
  EXPECT_EQ(cfg["torch_dtype"], "float32");
  for (const fs::path& m : {bf16, f32}) {
    r = strata("eval --model " + m.string() + " --data " + data.string() +
               " --seq-len 32 --max-sequences 4");
    EXPECT_EQ(r.status, 0) << r.out;
  }
}

// A Qwen2 checkpoint (biases on q, k and v, tied embeddings, as its small models): it trains,
// its biases move from the 0 they start at, and the export is a Qwen2ForCausalLM directory
// with the biases that loads back.
TEST(TrainCli, Qwen2TrainsAndExportsAsQwen2AndAMistralWindowIsHonoured) {
  const test::TempDir dir("strata-qwen2");
  const fs::path data = make_data(dir.path), model = dir.path / "qwen2", run = dir.path / "run";
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::qwen2;
  c.qkv_bias = true;
  c.tie_word_embeddings = true;
  fs::create_directories(model);
  std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
  const std::string args =
      " --init random --seed 5 --seq-len 32 --micro-batch 2 --lr 1e-2 --data " + data.string();
  test::CommandResult r =
      strata("train --model " + model.string() + args + " --steps 3 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path out = dir.path / "hf";
  r = strata("export " + run.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  const json cfg = json::parse(slurp(out / "config.json"));
  EXPECT_EQ(cfg["architectures"], json::array({"Qwen2ForCausalLM"}));
  EXPECT_EQ(cfg["model_type"], "qwen2");
  const SafetensorsReader st = SafetensorsReader::open(out / "model.safetensors");
  EXPECT_EQ(st.find("lm_head.weight"), nullptr);
  EXPECT_EQ(st.find("model.layers.0.self_attn.o_proj.bias"), nullptr);
  for (const char* name :
       {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
        "model.layers.1.self_attn.v_proj.bias"}) {
    const SafetensorsEntry* e = st.find(name);
    ASSERT_NE(e, nullptr) << name;
    std::vector<float> b(static_cast<size_t>(e->numel()));
    st.read(name, b.data(), DType::f32);
    EXPECT_TRUE(std::any_of(b.begin(), b.end(), [](float x) { return x != 0.0f; }))
        << name << " never left 0";
  }
  r = strata("eval --model " + out.string() + " --data " + data.string() +
             " --seq-len 32 --max-sequences 4");
  EXPECT_EQ(r.status, 0) << r.out;

  // Mistral with a window of 16 in sequences of 32: the window slides (the first loss differs
  // from a window the sequences never outrun, which is full causal attention); generation past
  // it slides the window over its cache (test_llama checks the logits against the whole
  // forward's).
  std::vector<double> first_loss;
  for (const int64_t window : {16, 32}) {
    LlamaConfig m = *find_preset("tiny");
    m.architecture = Architecture::mistral;
    m.sliding_window = window;
    const fs::path mistral = dir.path / fmt::format("mistral-{}", window),
                   mrun = dir.path / fmt::format("mistral-run-{}", window);
    fs::create_directories(mistral);
    std::ofstream(mistral / "config.json") << to_hf_config_json(m).dump(2);
    r = strata("train --model " + mistral.string() + args + " --steps 1 --run-dir " +
               mrun.string());
    ASSERT_EQ(r.status, 0) << r.out;
    first_loss.push_back(metrics(mrun).at(0)["loss"].get<double>());
    if (window == 16) {
      r = strata("generate --model " + mistral.string() +
                 " --init random --prompt 'the quick brown fox' --max-new-tokens 20 --json");
      ASSERT_EQ(r.status, 0) << r.out;
      const json g = json::parse(r.out);
      EXPECT_GT(g.at("prompt_tokens").size(), 16u) << "the prompt alone outruns the window";
      EXPECT_GE(g.at("new_tokens").get<int64_t>(), 1) << r.out;
    }
  }
  EXPECT_NE(first_loss[0], first_loss[1]) << "the window of 16 changed nothing";
}

// A Phi-3 checkpoint (fused projections in its files): it trains on 2 devices with its
// parameters on NVMe, its checkpoints and export hold qkv_proj and gate_up_proj (and no
// q_proj), the export's rows of q, k and v are the checkpoint's f32 master weights, and the
// export evaluates; a checkpoint whose fused tensor has another shape is named.
TEST(TrainCli, Phi3TrainsAndExportsItsFusedProjections) {
  const test::TempDir dir("strata-phi3");
  const fs::path data = make_data(dir.path), model = dir.path / "phi3", run = dir.path / "run";
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::phi3;
  c.sliding_window = 16;
  fs::create_directories(model);
  std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
  test::CommandResult r = strata(
      "train --model " + model.string() + " --init random --seed 5 --seq-len 32 --micro-batch 2 " +
      "--lr 1e-2 --data " + data.string() + " --steps 2 --devices host:2 --offload-param nvme " +
      "--persistence-threshold 0 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path out = dir.path / "hf";
  r = strata("export " + run.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(slurp(out / "config.json"))["architectures"],
            json::array({"Phi3ForCausalLM"}));
  const SafetensorsReader st = SafetensorsReader::open(out / "model.safetensors");
  const int64_t D = c.hidden_size, Hq = c.num_attention_heads * c.head_dim,
                Hk = c.num_key_value_heads * c.head_dim, F = c.intermediate_size;
  for (const char* gone :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"})
    EXPECT_EQ(st.find(gone), nullptr) << gone;
  const SafetensorsEntry* qkv = st.find("model.layers.1.self_attn.qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{Hq + 2 * Hk, D}));
  ASSERT_NE(st.find("model.layers.0.mlp.gate_up_proj.weight"), nullptr);
  EXPECT_EQ(st.find("model.layers.0.mlp.gate_up_proj.weight")->shape,
            (std::vector<int64_t>{2 * F, D}));
  // The fused rows are the unit's parameters in order: q, k, v as the master weights hold them.
  const fs::path ckpt = run / "checkpoints/step-2";
  const SafetensorsReader opt = SafetensorsReader::open(ckpt / "optimizer.safetensors");
  std::vector<float> master(static_cast<size_t>(opt.find("layers.1.master")->numel()));
  opt.read("layers.1.master", master.data(), DType::f32);
  std::vector<float> fused(static_cast<size_t>(qkv->numel()));
  st.read(qkv->name, fused.data(), DType::f32);
  const ModelLayout layout = ModelLayout::build(c);
  for (const char* part : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}) {
    const ParamSlot& p = layout.units[2].slot(part);
    EXPECT_TRUE(std::equal(fused.begin() + p.file_row * D,
                           fused.begin() + (p.file_row + p.shape.dims[0]) * D,
                           master.begin() + static_cast<int64_t>(p.offset)))
        << part;
  }
  r = strata("eval --model " + out.string() + " --data " + data.string() +
             " --seq-len 32 --max-sequences 4");
  EXPECT_EQ(r.status, 0) << r.out;

  // The checkpoint's own model file, with one fused tensor cut short, is refused by name.
  const fs::path bad = dir.path / "bad";
  fs::create_directories(bad);
  fs::copy_file(out / "config.json", bad / "config.json");
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<float>> values;
  values.reserve(st.tensors().size());
  for (const SafetensorsEntry& e : st.tensors()) {
    std::vector<float>& v = values.emplace_back(static_cast<size_t>(e.numel()));
    st.read(e.name, v.data(), DType::f32);
    std::vector<int64_t> shape = e.shape;
    if (e.name == qkv->name) shape[0] -= Hk;  // v's rows missing
    tensors.push_back({e.name, DType::f32, shape, v.data()});
  }
  write_safetensors(bad / "model.safetensors", tensors);
  r = strata("eval --model " + bad.string() + " --data " + data.string() +
             " --seq-len 32 --max-sequences 4");
  EXPECT_NE(r.status, 0);
  for (const std::string& part :
       {qkv->name, fmt::format("[{}, {}]", Hq + Hk, D), fmt::format("[{}, {}]", Hq + 2 * Hk, D)})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
}

// Gemma, Gemma 2 and Gemma 3 through the executor with their parameters on NVMe: the norms start at
// 0 (they multiply by 1 + w), the export names the class and both activation keys (and Gemma 2's
// caps, scale and sliding layers), the head is the embedding, and the export evaluates to the
// loss the run's checkpoint gives.
TEST(TrainCli, GemmaTrainsAndExportsAsItsClass) {
  for (const Architecture arch :
       {Architecture::gemma, Architecture::gemma2, Architecture::gemma3}) {
    SCOPED_TRACE(architecture_class(arch));
    const test::TempDir dir("strata-gemma");
    const fs::path data = make_data(dir.path), model = dir.path / "gemma", run = dir.path / "run";
    LlamaConfig c = *find_preset("tiny");
    c.architecture = arch;
    c.hidden_act = Activation::gelu_tanh;
    c.tie_word_embeddings = true;
    c.head_dim = 24;  // not hidden / heads, as Gemma's 256
    if (arch != Architecture::gemma) {
      c.sliding_window = 8;
      c.sliding_layers = {true, false};
      c.query_pre_attn_scalar = 16;
      c.attn_logit_softcapping = 50;
      c.final_logit_softcapping = 30;
    }
    if (arch == Architecture::gemma3) {
      c.qk_norm = true;
      c.attn_logit_softcapping = 0;
      c.rope_local_base_freq = 100.0;
    }
    fs::create_directories(model);
    std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
    test::CommandResult r = strata(
        "train --model " + model.string() + " --init random --seed 5 --seq-len 32 " +
        "--micro-batch 2 --lr 1e-3 --data " + data.string() + " --steps 2 --devices host:2 " +
        "--offload-param nvme --persistence-threshold 0 --run-dir " + run.string());
    ASSERT_EQ(r.status, 0) << r.out;
    const fs::path out = dir.path / "hf";
    r = strata("export " + run.string() + " --out " + out.string() + " --dtype f32");
    ASSERT_EQ(r.status, 0) << r.out;
    const json config = json::parse(slurp(out / "config.json"));
    EXPECT_EQ(config["architectures"], json::array({architecture_class(arch)}));
    EXPECT_EQ(config["hidden_act"], "gelu_pytorch_tanh");
    EXPECT_EQ(config["hidden_activation"], "gelu_pytorch_tanh");
    if (arch != Architecture::gemma) {
      EXPECT_EQ(config["final_logit_softcapping"], 30.0);
      EXPECT_EQ(config["query_pre_attn_scalar"], 16.0);
      EXPECT_EQ(config["layer_types"], json::array({"sliding_attention", "full_attention"}));
    }
    const SafetensorsReader st = SafetensorsReader::open(out / "model.safetensors");
    EXPECT_EQ(st.find("lm_head.weight"), nullptr);
    std::vector<std::string> norms = {"model.norm.weight", "model.layers.1.input_layernorm.weight"};
    if (arch != Architecture::gemma)
      norms.push_back("model.layers.0.post_feedforward_layernorm.weight");
    if (arch == Architecture::gemma3) norms.push_back("model.layers.1.self_attn.q_norm.weight");
    for (const std::string& norm : norms) {
      ASSERT_NE(st.find(norm), nullptr) << norm;
      std::vector<float> w(static_cast<size_t>(st.find(norm)->numel()));
      st.read(norm, w.data(), DType::f32);
      // Two AdamW steps of 1e-3 from 0: each weight moved by at most about 2e-3.
      for (const float x : w) EXPECT_LT(std::abs(x), 0.01f) << norm;
    }
    r = strata("eval --model " + out.string() + " --data " + data.string() +
               " --seq-len 32 --max-sequences 4 --json 2>/dev/null");
    ASSERT_EQ(r.status, 0) << r.out;
    const double exported = json::parse(r.out)["loss"].get<double>();
    r = strata("eval --model " + (run / "checkpoints/step-2").string() + " --data " +
               data.string() + " --seq-len 32 --max-sequences 4 --json 2>/dev/null");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), exported);
    EXPECT_NEAR(exported, std::log(static_cast<double>(c.vocab_size)), 1.0);
  }
}

// An export evaluates to its checkpoint's loss bit for bit, near ln(vocab) after a short run
// from random weights.
void expect_export_evaluates_as_checkpoint(const fs::path& data, const fs::path& exported,
                                           const fs::path& checkpoint, int64_t vocab) {
  const std::string eval = " --data " + data.string() + " --seq-len 32 --max-sequences 4 --json";
  test::CommandResult r = strata("eval --model " + exported.string() + eval);
  ASSERT_EQ(r.status, 0) << r.out;
  const double loss = json::parse(r.out)["loss"].get<double>();
  r = strata("eval --model " + checkpoint.string() + eval);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), loss);
  EXPECT_NEAR(loss, std::log(static_cast<double>(vocab)), 1.0);
}

// Trains one step from the Hugging Face model directory `model` with its tables whole and in 4
// vocabulary pieces (each piece reading its rows of the file's tensors): the same first loss,
// which it returns.
double expect_read_into_pieces_as_whole(const fs::path& dir, const fs::path& model,
                                        const fs::path& data) {
  double first[2] = {};
  for (int k = 0; k < 2; ++k) {
    const fs::path run = dir / (k == 0 ? "load-whole" : "load-cut");
    const test::CommandResult r =
        strata("train --model " + model.string() + " --seq-len 32 --micro-batch 2 --data " +
               data.string() + " --lr 2e-3 --threads 1 --steps 1 --vocab-pieces " +
               (k == 0 ? "1" : "4") + " --run-dir " + run.string());
    EXPECT_EQ(r.status, 0) << r.out;
    if (r.status != 0) return 0;
    first[k] = metrics(run).front()["loss"].get<double>();
  }
  EXPECT_NEAR(first[1], first[0], 1e-6 * first[0]);
  return first[0];
}

// --vocab-pieces: checkpoints hold the tables whole, as Hugging Face names them (an export
// evaluates to the checkpoint's loss), and a run resumes in another cut: each parameter's
// optimizer state is carried over row by row, so the resumed run follows the uninterrupted
// one to rounding (state lost would move the next steps' losses by far more). Bad counts are
// refused naming the flag; plan and train echo the cut.
TEST(TrainCli, VocabularyPiecesCheckpointWholeTablesAndResumeInAnotherCut) {
  const test::TempDir dir("strata-pieces");
  const fs::path data = make_data(dir.path);
  const std::string base = "train " + kTiny + "--data " + data.string() +
                           " --lr 2e-3 --offload-optimizer cpu --threads 1";
  const fs::path whole = dir.path / "whole", cut = dir.path / "cut";
  test::CommandResult r = strata(base + " --steps 4 --run-dir " + whole.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps 2 --vocab-pieces 3 --run-dir " + cut.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const json settings = json::parse(slurp(cut / "checkpoints/step-2/trainer_state.json"));
  EXPECT_EQ(settings["settings"]["vocab_pieces"], 3) << settings.dump();
  const SafetensorsReader st =
      SafetensorsReader::open(cut / "checkpoints/step-2/model.safetensors");
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    const SafetensorsEntry* e = st.find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->shape, (std::vector<int64_t>{512, 64})) << name;
  }
  const fs::path out = dir.path / "hf";
  r = strata("export " + cut.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  expect_export_evaluates_as_checkpoint(data, out, cut / "checkpoints/step-2", 512);
  // Hugging Face weights read into pieces (each piece's rows of the file's tensor): the first
  // step's loss is the whole model's.
  const double first = expect_read_into_pieces_as_whole(dir.path, out, data);
  EXPECT_LT(first, metrics(cut).front()["loss"].get<double>());  // trained: lower than step 1

  // The whole run's step 2, resumed in three pieces; the cut run's, resumed whole.
  const fs::path a = dir.path / "a", b = dir.path / "b";
  r = strata(base + " --steps 2 --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps 4 --vocab-pieces 3 --resume --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("carried over row by row"), std::string::npos) << r.out;
  const std::vector<json> mw = metrics(whole), ma = metrics(a);
  ASSERT_EQ(ma.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double w = mw[i]["loss"].get<double>(), got = ma[i]["loss"].get<double>();
    EXPECT_NEAR(got, w, 2e-5 * w) << "step " << i + 1;
  }
  r = strata(base + " --steps 4 --vocab-pieces 1 --resume --run-dir " + cut.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("carried over row by row"), std::string::npos) << r.out;
  const std::vector<json> mc = metrics(cut);
  ASSERT_EQ(mc.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double w = mw[i]["loss"].get<double>(), got = mc[i]["loss"].get<double>();
    EXPECT_NEAR(got, w, 2e-5 * w) << "step " << i + 1;
  }

  r = strata(base + " --steps 1 --vocab-pieces 28 --run-dir " + (dir.path / "bad").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--vocab-pieces 28"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("choose 27"), std::string::npos) << r.out;
  r = strata(
      "plan --model llama3-8b --gpus 1 --gpu-memory 80GiB --cpu-memory 512GiB --json "
      "--offload-optimizer cpu");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["vocab_pieces"], 3);
  r = strata(
      "plan --model llama3-8b --gpus 1 --gpu-memory 80GiB --cpu-memory 512GiB --json "
      "--offload-optimizer cpu --vocab-pieces 1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["vocab_pieces"], 1);
  r = strata(
      "plan --model llama3-8b --gpus 1 --gpu-memory 80GiB --cpu-memory 512GiB "
      "--offload-optimizer cpu");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("38 units"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("each in 3 vocabulary pieces of 42752 rows"), std::string::npos) << r.out;
}

// A tied table cut into vocabulary pieces (which the head's pieces read): the checkpoint holds
// the one whole table and no lm_head, the export evaluates to the checkpoint's loss and reads
// into pieces to the whole model's first loss, a resume in pieces of a whole run (and the cut
// run's resumed whole) keeps to the uninterrupted whole run's losses, and plan says so.
TEST(TrainCli, TiedTableInPiecesCheckpointsWholeAndResumesInAnotherCut) {
  const test::TempDir dir("strata-tied-pieces");
  const fs::path data = make_data(dir.path), model = tied_tiny(dir.path);
  const std::string base = "train --model " + model.string() +
                           " --init random --seed 5 --seq-len 32 --micro-batch 2 --data " +
                           data.string() + " --lr 2e-3 --offload-optimizer cpu --threads 1";
  const fs::path whole = dir.path / "whole", cut = dir.path / "cut";
  test::CommandResult r = strata(base + " --steps 4 --run-dir " + whole.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps 2 --vocab-pieces 3 --run-dir " + cut.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const SafetensorsReader st =
      SafetensorsReader::open(cut / "checkpoints/step-2/model.safetensors");
  const SafetensorsEntry* e = st.find("model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(st.find("lm_head.weight"), nullptr);
  const fs::path out = dir.path / "hf";
  r = strata("export " + cut.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  expect_export_evaluates_as_checkpoint(data, out, cut / "checkpoints/step-2", 512);
  // The exported weights read into 4 pieces (each its rows of the one table).
  expect_read_into_pieces_as_whole(dir.path, out, data);
  const std::vector<json> mw = metrics(whole);
  ASSERT_EQ(mw.size(), 4u);
  // The cut run's first two steps are the whole run's to rounding.
  const std::vector<json> first = metrics(cut);
  ASSERT_EQ(first.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(first[i]["loss"].get<double>(), mw[i]["loss"].get<double>(),
                2e-5 * mw[i]["loss"].get<double>())
        << "step " << i + 1;
  r = strata(base + " --steps 4 --vocab-pieces 1 --resume --run-dir " + cut.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("carried over row by row"), std::string::npos) << r.out;
  // And a whole run's step 2 resumed in pieces.
  const fs::path a = dir.path / "a";
  r = strata(base + " --steps 2 --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --steps 4 --vocab-pieces 3 --resume --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("carried over row by row"), std::string::npos) << r.out;
  for (const fs::path& run : {cut, a}) {
    const std::vector<json> mc = metrics(run);
    ASSERT_EQ(mc.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      const double w = mw[i]["loss"].get<double>(), got = mc[i]["loss"].get<double>();
      EXPECT_NEAR(got, w, 2e-5 * w) << run.filename() << " step " << i + 1;
    }
  }
  r = strata("plan --model " + model.string() +
             " --gpus 1 --gpu-memory 1GiB --cpu-memory 4GiB --seq-len 32 --vocab-pieces 4 "
             "--offload-optimizer cpu");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("the tied embedding table in 4 vocabulary pieces of 128 rows"),
            std::string::npos)
      << r.out;
}

// SmolLM3 through the executor with its parameters on NVMe: its NoPE layer and window written
// back, the export evaluating to the checkpoint's loss.
TEST(TrainCli, SmolLM3TrainsAndExportsAsItsClass) {
  const test::TempDir dir("strata-smollm3");
  const fs::path data = make_data(dir.path), model = dir.path / "smol", run = dir.path / "run";
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::smollm3;
  c.tie_word_embeddings = true;
  c.nope_layers = {false, true};
  c.sliding_window = 8;
  c.sliding_layers = {false, true};
  fs::create_directories(model);
  std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
  test::CommandResult r = strata(
      "train --model " + model.string() + " --init random --seed 5 --seq-len 32 --micro-batch 2 " +
      "--lr 1e-3 --data " + data.string() + " --steps 2 --devices host:2 --offload-param nvme " +
      "--persistence-threshold 0 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path out = dir.path / "hf";
  r = strata("export " + run.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  const json config = json::parse(slurp(out / "config.json"));
  EXPECT_EQ(config["architectures"], json::array({"SmolLM3ForCausalLM"}));
  EXPECT_EQ(config["no_rope_layers"], json::array({1, 0}));
  EXPECT_EQ(config["layer_types"], json::array({"full_attention", "sliding_attention"}));
  EXPECT_EQ(config["sliding_window"], 8);
  r = strata("export " + run.string() + " --out " + (dir.path / "t").string() + " --text-only");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--text-only is for a checkpoint of an image-text Gemma 3"),
            std::string::npos)
      << r.out;
  expect_export_evaluates_as_checkpoint(data, out, run / "checkpoints/step-2", c.vocab_size);
}

// Granite: its multipliers trained on one device with the optimizer on the CPU, and exported as
// its class with them; the export evaluates to the checkpoint's loss.
TEST(TrainCli, GraniteTrainsAndExportsAsItsClass) {
  const test::TempDir dir("strata-granite");
  const fs::path data = make_data(dir.path), model = dir.path / "granite", run = dir.path / "run";
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::granite;
  c.tie_word_embeddings = true;
  c.embedding_multiplier = 6.0;
  c.residual_multiplier = 0.3;
  c.attention_multiplier = 1.0 / 16;
  c.logits_scaling = 4.0;
  fs::create_directories(model);
  std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
  test::CommandResult r = strata(
      "train --model " + model.string() + " --init random --seed 5 --seq-len 32 --micro-batch 2 " +
      "--lr 1e-3 --data " + data.string() + " --steps 2 --offload-param cpu " +
      "--offload-optimizer cpu --persistence-threshold 0 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path out = dir.path / "hf";
  r = strata("export " + run.string() + " --out " + out.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  const json config = json::parse(slurp(out / "config.json"));
  EXPECT_EQ(config["architectures"], json::array({"GraniteForCausalLM"}));
  EXPECT_EQ(config["embedding_multiplier"], 6.0);
  EXPECT_EQ(config["residual_multiplier"], 0.3);
  EXPECT_EQ(config["attention_multiplier"], 1.0 / 16);
  EXPECT_EQ(config["logits_scaling"], 4.0);
  expect_export_evaluates_as_checkpoint(data, out, run / "checkpoints/step-2", c.vocab_size);
}

// 16-bit gradients and accumulators: from --grad-dtype, or from a DeepSpeed config's
// data_types.grad_accum_dtype, the same run (the same weights bit for bit), recorded in the
// checkpoint's settings and counted by plan; refused beside parameters of another dtype.
TEST(TrainCli, SixteenBitGradientsFromTheFlagOrTheConfig) {
  const test::TempDir dir("strata-grad-dtype");
  const fs::path data = make_data(dir.path);
  const fs::path config = dir.path / "ds.json";
  std::ofstream(config) << R"({"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 2,
                               "data_types": {"grad_accum_dtype": "bf16"}})";
  const std::string base =
      "train --model tiny --init random --seed 5 --seq-len 32 --lr 1e-3 "
      "--steps 2 --grad-accum 2 --offload-optimizer cpu --data " +
      data.string();
  test::CommandResult r = strata(base + " --micro-batch 2 --dtype bf16 --grad-dtype bf16 " +
                                 "--run-dir " + (dir.path / "flag").string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(base + " --config " + config.string() + " --run-dir " + (dir.path / "cfg").string());
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* run : {"flag", "cfg"}) {
    const json state = json::parse(slurp(dir.path / run / "checkpoints/step-2/trainer_state.json"));
    EXPECT_EQ(state["settings"]["grad_dtype"], "bf16") << run;
    EXPECT_EQ(state["settings"]["dtype"], "bf16") << run;
  }
  EXPECT_EQ(slurp(dir.path / "flag/checkpoints/step-2/model.safetensors"),
            slurp(dir.path / "cfg/checkpoints/step-2/model.safetensors"));
  r = strata(base + " --micro-batch 2 --dtype f32 --grad-dtype bf16 --run-dir " +
             (dir.path / "bad").string());
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--grad-dtype bf16: bf16 gradients with f32 parameters"), std::string::npos)
      << r.out;
  r = strata("plan --model tiny --gpu-memory 1GiB --config " + config.string() + " --json");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["grad_dtype"], "bf16");
}

// The language model of an image-text Gemma 3 (Gemma3ForConditionalGeneration, as 4B, 12B and
// 27B ship) in either layout transformers saves: it evaluates to the text model's loss bit for
// bit and trains (the vision tower frozen, with a warning), and its checkpoints, resumed ones
// too, and exports are that image-text model again: its config whole, the language model under
// the same names, the vision tower's tensors unchanged.
TEST(TrainCli, Gemma3sImageTextCheckpointTrainsItsLanguageModel) {
  const test::TempDir dir("strata-gemma3-image-text");
  const fs::path data = make_data(dir.path), text = dir.path / "text", run = dir.path / "run";
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::gemma3;
  c.hidden_act = Activation::gelu_tanh;
  c.tie_word_embeddings = c.qk_norm = true;
  c.head_dim = 24;
  c.sliding_window = 8;
  c.sliding_layers = {true, false};
  c.query_pre_attn_scalar = 16;
  c.rope_local_base_freq = 100.0;
  fs::create_directories(text);
  std::ofstream(text / "config.json") << to_hf_config_json(c).dump(2);
  test::CommandResult r =
      strata("train --model " + text.string() +
             " --init random --seed 3 --seq-len 32 --micro-batch 2 --data " + data.string() +
             " --steps 1 --run-dir " + (dir.path / "r0").string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata("export " + (dir.path / "r0").string() + " --out " + text.string() + " --dtype f32");
  ASSERT_EQ(r.status, 0) << r.out;
  const json text_config = json::parse(slurp(text / "config.json"));
  const SafetensorsReader st = SafetensorsReader::open(text / "model.safetensors");
  std::vector<std::vector<float>> values;
  values.reserve(st.tensors().size() + 2);
  const std::vector<float> vision(8, 0.5f), projector = {1, 2, 3, 4, 5, 6, 7, 8};
  // transformers 4.50's layout and 4.52's.
  for (const bool nested : {false, true}) {
    SCOPED_TRACE(nested ? "model.language_model.*" : "language_model.model.*");
    const fs::path mm = dir.path / (nested ? "mm-new" : "mm-old");
    fs::create_directories(mm);
    json cfg = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                {"model_type", "gemma3"},
                {"mm_tokens_per_image", 4},
                {"torch_dtype", "float32"},
                {"vision_config", {{"hidden_size", 8}, {"model_type", "siglip_vision_model"}}},
                {"text_config", text_config}};
    cfg["text_config"].erase("architectures");
    std::ofstream(mm / "config.json") << cfg.dump(2);
    std::vector<SafetensorsTensor> tensors;
    for (const SafetensorsEntry& e : st.tensors()) {
      std::vector<float>& v = values.emplace_back(static_cast<size_t>(e.numel()));
      st.read(e.name, v.data(), DType::f32);
      const std::string name =
          nested ? "model.language_model." + e.name.substr(6) : "language_model." + e.name;
      tensors.push_back({name, DType::f32, e.shape, v.data()});
    }
    const std::string pre = nested ? "model." : "";
    tensors.push_back(
        {pre + "vision_tower.vision_model.post_layernorm.weight", DType::f32, {8}, vision.data()});
    tensors.push_back(
        {pre + "multi_modal_projector.mm_soft_emb_norm.weight", DType::f32, {8}, projector.data()});
    // The second layout sharded (model.safetensors.index.json): the vision tower's tensors are
    // carried out of several files.
    if (nested)
      write_safetensors_sharded(mm, tensors, 64 * 1024);
    else
      write_safetensors(mm / "model.safetensors", tensors);

    // --log error: the warning below goes to stderr, which strata() keeps beside the JSON.
    const std::string eval =
        " --data " + data.string() + " --seq-len 32 --max-sequences 4 --json --devices host";
    r = strata("--log error eval --model " + text.string() + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    const double want = json::parse(r.out)["loss"].get<double>();
    r = strata("--log error eval --model " + mm.string() + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), want);
    // And samples the text model's tokens.
    const std::string sample =
        " --prompt 'to be' --max-new-tokens 6 --temperature 0 --json --devices host";
    r = strata("--log error generate --model " + text.string() + sample);
    ASSERT_EQ(r.status, 0) << r.out;
    const json text_sample = json::parse(r.out)["tokens"];
    ASSERT_TRUE(text_sample.is_array() && text_sample.size() == 6u) << r.out;
    r = strata("--log error generate --model " + mm.string() + sample);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(r.out)["tokens"], text_sample);

    const fs::path run_dir = run / (nested ? "new" : "old");
    // The second layout's run ZeRO-3 partitioned over 2 devices with its parameters on NVMe:
    // each rank loads its shards from the renamed tensors.
    const std::string train =
        "train --model " + mm.string() + " --seq-len 32 --micro-batch 2 --lr 1e-3 --data " +
        data.string() + " --run-dir " + run_dir.string() +
        (nested ? " --devices host:2 --offload-param nvme --persistence-threshold 0" : "");
    r = strata(train + " --steps 1");
    ASSERT_EQ(r.status, 0) << r.out;
    for (const char* part : {"image-text checkpoint", "vision tower and projector (2 tensors)",
                             nested ? "transformers 4.52+" : "transformers 4.50"})
      EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
    // Resumed, the vision tower comes from the checkpoint.
    r = strata(train + " --steps 2 --resume");
    ASSERT_EQ(r.status, 0) << r.out;
    const std::string lm = nested ? "model.language_model." : "language_model.model.";
    const fs::path out = dir.path / (nested ? "hf-new" : "hf-old");
    r = strata("export " + run_dir.string() + " --out " + out.string() + " --dtype f32");
    ASSERT_EQ(r.status, 0) << r.out;
    for (const fs::path& model : {run_dir / "checkpoints/step-2", out}) {
      SCOPED_TRACE(model.string());
      const json written = json::parse(slurp(model / "config.json"));
      EXPECT_EQ(written["architectures"], json::array({"Gemma3ForConditionalGeneration"}));
      EXPECT_EQ(written["vision_config"], cfg["vision_config"]);
      EXPECT_EQ(written["mm_tokens_per_image"], 4);
      EXPECT_EQ(written["text_config"]["num_attention_heads"], 4);
      EXPECT_EQ(written["text_config"]["model_type"], "gemma3_text");
      EXPECT_EQ(written["torch_dtype"], "float32");
      EXPECT_EQ(written["text_config"]["torch_dtype"], "float32");
      const SafetensorsReader got = SafetensorsReader::open(model / "model.safetensors");
      EXPECT_EQ(got.names().size(), st.names().size() + 2);
      EXPECT_NE(got.find(lm + "layers.1.self_attn.q_norm.weight"), nullptr);
      EXPECT_EQ(got.find("model.layers.1.self_attn.q_norm.weight"), nullptr);
      // The vision tower's tensors unchanged, in the dtype they were read in.
      for (const auto& [name, want_values] :
           {std::pair{pre + "vision_tower.vision_model.post_layernorm.weight", &vision},
            std::pair{pre + "multi_modal_projector.mm_soft_emb_norm.weight", &projector}}) {
        const SafetensorsEntry* e = got.find(name);
        ASSERT_NE(e, nullptr) << name;
        EXPECT_EQ(e->dtype, DType::f32) << name;
        std::vector<float> v(8);
        got.read(name, v.data(), DType::f32);
        EXPECT_EQ(v, *want_values) << name;
      }
    }
    r = strata("--log error eval --model " + out.string() + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    const double trained = json::parse(r.out)["loss"].get<double>();
    EXPECT_NE(trained, want);
    EXPECT_NEAR(trained, want, 0.5);
    r = strata("--log error eval --model " + (run_dir / "checkpoints/step-2").string() + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), trained);
    // --text-only: the language model alone, which evaluates alike.
    const fs::path text_out = dir.path / (nested ? "text-new" : "text-old");
    r = strata("export " + run_dir.string() + " --out " + text_out.string() +
               " --dtype f32 --text-only");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(slurp(text_out / "config.json"))["architectures"],
              json::array({"Gemma3ForCausalLM"}));
    const SafetensorsReader text_st = SafetensorsReader::open(text_out / "model.safetensors");
    EXPECT_EQ(text_st.names(), st.names());
    r = strata("--log error eval --model " + text_out.string() + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), trained);
  }
  // From --init random there is no vision tower to carry: the language model alone.
  r = strata("train --model " + (dir.path / "mm-old").string() +
             " --init random --seq-len 32 --micro-batch 2 --data " + data.string() +
             " --steps 1 --run-dir " + (run / "random").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(slurp(run / "random/checkpoints/step-1/config.json"))["architectures"],
            json::array({"Gemma3ForCausalLM"}));
  // Files without the language model under either name are refused, naming both.
  const fs::path empty = dir.path / "mm-none";
  fs::create_directories(empty);
  fs::copy_file(dir.path / "mm-old/config.json", empty / "config.json");
  const std::vector<SafetensorsTensor> only_vision = {
      {"vision_tower.vision_model.post_layernorm.weight", DType::f32, {8}, vision.data()}};
  write_safetensors(empty / "model.safetensors", only_vision);
  r = strata("eval --model " + empty.string() + " --data " + data.string() + " --seq-len 32");
  EXPECT_NE(r.status, 0);
  for (const char* part : {"Gemma3ForConditionalGeneration", "language_model.model.embed_tokens",
                           "model.language_model.embed_tokens"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
}

TEST(TrainCli, CheckpointsAndExportsCarryTheModelsTokenizer) {
  const test::TempDir dir("strata-carry-tokenizer");
  const fs::path data = make_data(dir.path), model = dir.path / "hf", run = dir.path / "run";
  test::write_tokenizer_json(model, test::with_begin_of_text(test::gpt2_like_tokenizer()));
  LlamaConfig source = *find_preset("tiny");
  source.torch_dtype = DType::bf16;  // the weights this run writes are f32 (host's default)
  source.token_ids = {{"bos_token_id", 260}, {"eos_token_id", {256, 259}}};
  std::ofstream(model / "config.json") << to_hf_config_json(source).dump(2);
  // The slow byte-level BPE tokenizer's files, which Qwen's repositories ship too.
  std::ofstream(model / "vocab.json") << R"({"a": 0})";
  std::ofstream(model / "merges.txt") << "#version: 0.2\n";
  std::ofstream(model / "added_tokens.json") << R"({"<|endoftext|>": 256})";
  std::ofstream(model / "tokenizer_config.json") << R"({"eos_token": "<|endoftext|>"})";
  std::ofstream(model / "generation_config.json") << R"({"bos_token_id": 260})";
  std::ofstream(model / "chat_template.jinja")
      << "{% for m in messages %}{{ m.content }}{% endfor %}";
  test::CommandResult r = strata("train --model " + model.string() +
                                 " --init random --seed 5 --seq-len 32 --micro-batch 2 --data " +
                                 data.string() + " --steps 2 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path ckpt = run / "checkpoints/step-2";
  const json complete = json::parse(slurp(ckpt / "COMPLETE"));
  for (const char* file :
       {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
        "vocab.json", "merges.txt", "added_tokens.json"}) {
    EXPECT_EQ(slurp(ckpt / file), slurp(model / file)) << file;
    EXPECT_TRUE(complete["files"].contains(file)) << file;
  }
  // The checkpoint's config.json keeps the model's token ids and names its weights' dtype, as
  // save_pretrained writes them.
  const json saved = json::parse(slurp(ckpt / "config.json"));
  EXPECT_EQ(saved["bos_token_id"], 260);
  EXPECT_EQ(saved["eos_token_id"], json::array({256, 259}));
  EXPECT_FALSE(saved.contains("pad_token_id"));
  EXPECT_EQ(saved["torch_dtype"], "float32");
  EXPECT_FALSE(fs::exists(ckpt / "tokenizer.model"));
  // generate on the run finds the tokenizer in its newest checkpoint and starts with its
  // begin-of-text (260) before " the" (258).
  r = test::run_command(std::string("'") + STRATA_BINARY + "' generate --devices host --json " +
                        "--model " + run.string() +
                        " --prompt ' the' --temperature 0 --max-new-tokens 2 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.out;
  const json g = json::parse(r.out);
  EXPECT_EQ(g["tokenizer"], (ckpt / "tokenizer.json").string());
  EXPECT_EQ(g["prompt_tokens"], json::array({260, 258}));
  // and its chat template: --chat renders " the" alone (this template writes no begin-of-text).
  r = test::run_command(std::string("'") + STRATA_BINARY + "' generate --devices host --json " +
                        "--model " + run.string() +
                        " --chat --prompt ' the' --temperature 0 --max-new-tokens 2 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["prompt_tokens"], json::array({258}));
  // The export is a model directory with its tokenizer.
  const fs::path out = dir.path / "export";
  r = strata("export " + run.string() + " --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer.json, tokenizer_config.json, chat_template.jinja, "
                       "generation_config.json"),
            std::string::npos)
      << r.out;
  for (const char* file :
       {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
        "vocab.json", "merges.txt", "added_tokens.json"})
    EXPECT_EQ(slurp(out / file), slurp(model / file)) << file;
  const json exported = json::parse(slurp(out / "config.json"));
  EXPECT_EQ(exported["eos_token_id"], json::array({256, 259}));
  EXPECT_EQ(exported["torch_dtype"], "bfloat16");  // export's default dtype
  // A carried file is checked like the others: changed, it stops the export, named.
  std::ofstream(ckpt / "tokenizer_config.json", std::ios::app) << " ";
  r = strata("export " + run.string() + " --out " + (dir.path / "never").string());
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer_config.json"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir.path / "never" / "model.safetensors"));
}

// Hugging Face Trainer's flag names, as a user of its scripts types them, run what strata's
// own names run: the same checkpoint files bit for bit, the same steps logged and saved.
TEST(TrainCli, HuggingFaceTrainersFlagNamesAreStratasFlags) {
  const test::TempDir dir("strata-hf-flags");
  const fs::path data = make_data(dir.path), a = dir.path / "a", b = dir.path / "b";
  const std::string common = "train --model tiny --init random --seed 5 --data " + data.string() +
                             " --weight-decay 0.1 --warmup-steps 1 --lr-schedule WarmupLR";
  test::CommandResult r = strata(
      common + " --seq-len 24 --micro-batch 2 --grad-accum 2 --lr 3e-3 --eps 1e-6 --clip 0.5 " +
      "--steps 4 --save-every 2 --keep 1 --steps-per-print 2 --eval-data " + data.string() +
      " --eval-every 2 --eval-sequences 2 --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(common +
             " --max-seq-length 24 --per-device-train-batch-size 2 "
             "--gradient-accumulation-steps 2 --learning-rate 3e-3 --adam-epsilon 1e-6 "
             "--max-grad-norm 0.5 --max-steps 4 --save-steps 2 --save-total-limit 1 "
             "--logging-steps 2 --eval-data " +
             data.string() + " --eval-steps 2 --eval-sequences 2 --output-dir " + b.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_FALSE(fs::exists(b / "checkpoints/step-2")) << "--save-total-limit 1 keeps one";
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(slurp(a / "checkpoints/step-4" / file) == slurp(b / "checkpoints/step-4" / file))
        << file << " differs";
  const std::vector<json> ma = metrics(a), mb = metrics(b);
  ASSERT_EQ(ma.size(), 4u);
  ASSERT_EQ(mb.size(), 4u);
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"], mb[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(ma[i].contains("eval_loss"), mb[i].contains("eval_loss")) << "step " << i + 1;
  }
  EXPECT_TRUE(mb[1].contains("eval_loss")) << "--eval-steps 2 evaluates at step 2";
  // --num-train-epochs is --epochs.
  r = strata(common + " --seq-len 24 --micro-batch 2 --num-train-epochs 0.5 --output-dir " +
             (dir.path / "c").string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(common + " --seq-len 24 --micro-batch 2 --epochs 0.5 --run-dir " +
             (dir.path / "d").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(metrics(dir.path / "c").size(), metrics(dir.path / "d").size());
  EXPECT_GT(metrics(dir.path / "c").size(), 1u);
  // Hugging Face's lr_scheduler_type: cosine after a warmup of ceil(0.25 x 4) = 1 update, which
  // runs at 0 as in Hugging Face; then 1, (1 + cos(pi / 3)) / 2 and (1 + cos(2 pi / 3)) / 2.
  r = strata("train --model tiny --init random --seed 5 --data " + data.string() +
             " --seq-len 24 --micro-batch 2 --max-steps 4 --learning-rate 2e-3 "
             "--lr-scheduler-type cosine --warmup-ratio 0.25 --output-dir " +
             (dir.path / "e").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find("DeepSpeed's default"), std::string::npos) << r.out;
  const std::vector<json> me = metrics(dir.path / "e");
  ASSERT_EQ(me.size(), 4u);
  const double want[] = {0.0, 2e-3, 2e-3 * 0.75, 2e-3 * 0.25};
  for (size_t i = 0; i < 4; ++i)
    EXPECT_FLOAT_EQ(static_cast<float>(me[i]["lr"].get<double>()), static_cast<float>(want[i]))
        << "update " << i << " (the rate Adam takes, in f32)";
}

// DeepSpeed's optimizer.params.bias_correction false reaches the optimizer: after one update
// from the same weights, each weight moved by lr x (1 - beta1) / sqrt(1 - beta2) = 3.162 x lr
// instead of lr x 1 (eps, weight decay and clipping out of the way), so the moves are 3.162
// times the bias-corrected run's.
TEST(TrainCli, DeepSpeedsBiasCorrectionFalseReachesAdam) {
  const test::TempDir dir("strata-train-bias-correction");
  const fs::path data = make_data(dir.path);
  const auto run = [&](const std::string& name, const std::string& lr, bool correct) {
    const fs::path cfg = dir.path / (name + ".json"), out = dir.path / name;
    std::ofstream(cfg) << fmt::format(R"({{"optimizer": {{"type": "AdamW", "params": {{
        "lr": {}, "eps": 1e-30, "weight_decay": 0, "bias_correction": {}}}}}}})",
                                      lr, correct);
    const test::CommandResult r =
        strata("train " + kTiny + "--data " + data.string() + " --steps 1 --clip 0 --config " +
               cfg.string() + " --run-dir " + out.string());
    EXPECT_EQ(r.status, 0) << r.out;
    return SafetensorsReader::open(out / "checkpoints/step-1/model.safetensors");
  };
  const SafetensorsReader init = run("init", "0", true), with = run("with", "1e-4", true),
                          without = run("without", "1e-4", false);
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const auto read_f32 = [&](const SafetensorsReader& st) {
    std::vector<float> v(static_cast<size_t>(st.find(name)->numel()));
    st.read(name, v.data(), DType::f32);
    return v;
  };
  const std::vector<float> w0 = read_f32(init), w1 = read_f32(with), w2 = read_f32(without);
  std::vector<double> ratios;
  for (size_t i = 0; i < w0.size(); ++i)
    if (w1[i] != w0[i]) ratios.push_back((double(w2[i]) - w0[i]) / (double(w1[i]) - w0[i]));
  ASSERT_GT(ratios.size(), w0.size() / 2);
  std::sort(ratios.begin(), ratios.end());
  EXPECT_NEAR(ratios[ratios.size() / 2], 0.1 / std::sqrt(0.001), 0.02);
  const json state = json::parse(slurp(dir.path / "without/checkpoints/step-1/trainer_state.json"));
  EXPECT_EQ(state["settings"]["bias_correction"], false);
}

// DeepSpeed's Lion and Adagrad (a config's optimizer.type, or --optimizer): Lion's first update
// moves every weight by exactly the rate or not at all (the sign of its momentum, AdamW's would
// be a thousand different sizes); a run stopped and resumed trains the same bits, its state on
// NVMe or in host RAM, the checkpoint holding the one moment each keeps and naming the
// optimizer; resuming it with another optimizer, and settings the optimizer has no use for, are
// refused by name.
TEST(TrainCli, DeepSpeedsLionAndAdagradTrainAndResume) {
  expect_resume_identical("--optimizer lion --offload-optimizer nvme", 4, 2);
  expect_resume_identical(
      "--optimizer adagrad --devices host:2 --persistence-threshold 0 --offload-optimizer cpu", 4,
      2);
  const test::TempDir dir("strata-train-lion");
  const fs::path data = make_data(dir.path);
  const auto run = [&](const std::string& name, const std::string& lr) {
    const fs::path cfg = dir.path / (name + ".json"), out = dir.path / name;
    std::ofstream(cfg) << fmt::format(R"({{"optimizer": {{"type": "Lion", "params": {{
        "lr": {}, "betas": [0.9, 0.99], "weight_decay": 0}}}}}})",
                                      lr);
    const test::CommandResult r =
        strata("train " + kTiny + "--data " + data.string() + " --steps 1 --clip 0 --config " +
               cfg.string() + " --run-dir " + out.string());
    EXPECT_EQ(r.status, 0) << r.out;
    return out / "checkpoints/step-1";
  };
  const fs::path init = run("init", "0"), moved = run("moved", "1e-3");
  const SafetensorsReader w0 = SafetensorsReader::open(init / "model.safetensors"),
                          w1 = SafetensorsReader::open(moved / "model.safetensors");
  for (const std::string name : {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}) {
    std::vector<float> a(static_cast<size_t>(w0.find(name)->numel())), b(a.size());
    w0.read(name, a.data(), DType::f32);
    w1.read(name, b.data(), DType::f32);
    size_t steps = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = std::abs(double(b[i]) - a[i]);
      if (d == 0) continue;
      EXPECT_NEAR(d, 1e-3, 1e-6) << name << " element " << i;
      ++steps;
    }
    EXPECT_GT(steps, a.size() * 9 / 10) << name;
  }
  const SafetensorsReader state = SafetensorsReader::open(moved / "optimizer.safetensors");
  EXPECT_EQ(state.metadata().at("optimizer"), "lion");
  size_t exp_avg = 0;
  for (const std::string& name : state.names()) {
    EXPECT_EQ(name.find(".exp_avg_sq"), std::string::npos) << name;
    exp_avg += name.ends_with(".exp_avg") ? 1 : 0;
  }
  EXPECT_GT(exp_avg, 0u);
  EXPECT_EQ(json::parse(slurp(moved / "trainer_state.json"))["settings"]["optimizer"], "lion");

  const std::string base = "train " + kTiny + "--data " + data.string() + " --run-dir ";
  test::CommandResult r = strata(base + (dir.path / "l").string() + " --steps 2 --optimizer lion");
  ASSERT_EQ(r.status, 0) << r.out;
  // Hugging Face's name for it: the same bits.
  r = strata(base + (dir.path / "hf").string() + " --steps 2 --optim lion_32bit");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(slurp(dir.path / "l/checkpoints/step-2/model.safetensors") ==
              slurp(dir.path / "hf/checkpoints/step-2/model.safetensors"));
  r = strata(base + (dir.path / "l").string() + " --optimizer adagrad --steps 3 --resume");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("its optimizer state is lion's, and this run's optimizer is adagrad"),
            std::string::npos)
      << r.out;
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"--optimizer lion --eps 1e-8", {"--eps 1e-08", "Lion has no eps"}},
      {"--optimizer adagrad --adam-beta1 0.8", {"Adagrad has no betas"}},
      {"--optimizer sgd", {"--optimizer 'sgd'", "adamw, adam, lion or adagrad"}},
      {"--optim adamw_8bit", {"--optim adamw_8bit", "8-bit", "not supported"}},
      {"--optim adagrad --optimizer lion", {"disagree"}},
      {"--optimizer adamw --config " + (dir.path / "moved.json").string(),
       {"--optimizer adamw", "asks for Lion"}},
  };
  for (const auto& [flags, parts] : bad) {
    r = strata(base + (dir.path / "bad").string() + " --steps 2 " + flags);
    EXPECT_EQ(r.status, 1) << flags << "\n" << r.out;
    for (const std::string& part : parts)
      EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  }
}

// Hugging Face's scripts' spelling: flags with underscores, the config as --deepspeed, and
// adam_beta1/adam_beta2 filling a config's "auto" betas, train what strata's dashed flags and a
// config with those betas train, bit for bit; the betas matter (the defaults give other bits).
TEST(TrainCli, HuggingFaceUnderscoreFlagsAndAdamBetas) {
  const test::TempDir dir("strata-hf-underscores");
  const fs::path data = make_data(dir.path), a = dir.path / "a", b = dir.path / "b",
                 c = dir.path / "c", given = dir.path / "given.json",
                 filled = dir.path / "auto.json";
  std::ofstream(given) << R"({"optimizer": {"type": "AdamW", "params": {"lr": 3e-3,
      "betas": [0.8, 0.95], "weight_decay": 0.1}}})";
  std::ofstream(filled) << R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto",
      "betas": "auto", "weight_decay": "auto"}}})";
  const std::string model = "train --model tiny --init random --seed 5 --data " + data.string();
  test::CommandResult r =
      strata(model + " --seq-len 24 --micro-batch 2 --grad-accum 2 --steps 3 --config " +
             given.string() + " --run-dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(model +
             " --max_seq_length 24 --per_device_train_batch_size 2 "
             "--gradient_accumulation_steps 2 --max_steps=3 --learning_rate 3e-3 "
             "--weight_decay 0.1 --adam_beta1 0.8 --adam_beta2 0.95 --deepspeed " +
             filled.string() + " --output_dir " + b.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(model + " --seq-len 24 --micro-batch 2 --grad-accum 2 --steps 3 --config " +
             filled.string() + " --lr 3e-3 --weight-decay 0.1 --run-dir " + c.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const std::string ckpt = "checkpoints/step-3/model.safetensors";
  EXPECT_TRUE(slurp(a / ckpt) == slurp(b / ckpt)) << "the underscored flags train other bits";
  EXPECT_FALSE(slurp(a / ckpt) == slurp(c / ckpt)) << "betas (0.8, 0.95) train the defaults' bits";
  const json state = json::parse(slurp(b / "checkpoints/step-3/trainer_state.json"));
  EXPECT_FLOAT_EQ(state["settings"]["betas"][0].get<float>(), 0.8f);
  EXPECT_FLOAT_EQ(state["settings"]["betas"][1].get<float>(), 0.95f);
  r = strata(model + " --steps 1 --adam_beta2 1.0 --run-dir " + (dir.path / "d").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--adam-beta2 1: Adam's betas must be in [0, 1)"), std::string::npos)
      << r.out;
}

// A Hugging Face fine-tuning command line as Stanford Alpaca's and FastChat's scripts write it
// (underscores, booleans given as "True", --tf32) trains what strata's own flags train, bit for
// bit: --bf16 True is --dtype bf16, --gradient_checkpointing True/False is
// --activation-checkpointing on/off. Conflicting or malformed booleans are refused.
TEST(TrainCli, AnAlpacaStyleCommandLineRuns) {
  const test::TempDir dir("strata-hf-alpaca");
  const fs::path data = make_data(dir.path), a = dir.path / "a", b = dir.path / "b",
                 c = dir.path / "c";
  const std::string model = "train --model tiny --init random --seed 5 --data " + data.string();
  test::CommandResult r = strata(
      model + " --dtype bf16 --run-dir " + a.string() +
      " --steps 3 --micro-batch 2 --grad-accum 2 --lr 2e-3 --weight-decay 0 --warmup-ratio 0.3 "
      "--lr-schedule cosine --steps-per-print 1 --activation-checkpointing on --seq-len 24");
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(model + " --bf16 True --output_dir " + b.string() +
             " --max_steps 3 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 "
             "--learning_rate 2e-3 --weight_decay 0. --warmup_ratio 0.3 --lr_scheduler_type "
             "\"cosine\" --logging_steps 1 --tf32 True --gradient_checkpointing True "
             "--max_seq_length 24 --evaluation_strategy \"no\" --save_strategy \"steps\" "
             "--save_steps 2000 --save_total_limit 1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("--tf32: ignored"), std::string::npos) << r.out;
  const std::string ckpt = "checkpoints/step-3/";
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(slurp(a / ckpt / file) == slurp(b / ckpt / file)) << file << " differs";
  json state = json::parse(slurp(b / ckpt / "trainer_state.json"));
  EXPECT_EQ(state["settings"]["dtype"], "bf16");
  EXPECT_EQ(state["settings"]["activation_checkpointing"], "on");
  // A bare --bf16 is true; --gradient_checkpointing false keeps the activations.
  r = strata(model +
             " --max_steps 1 --seq-len 24 --gradient_checkpointing false --bf16 "
             "--output_dir " +
             c.string());
  ASSERT_EQ(r.status, 0) << r.out;
  state = json::parse(slurp(c / "checkpoints/step-1/trainer_state.json"));
  EXPECT_EQ(state["settings"]["dtype"], "bf16");
  EXPECT_EQ(state["settings"]["activation_checkpointing"], "off");

  const std::pair<std::string, std::vector<std::string>> bad[] = {
      {" --bf16 True --fp16 True", {"--bf16 and --fp16 are both true"}},
      {" --bf16 --dtype f32", {"--bf16 true and --dtype f32 disagree"}},
      {" --gradient_checkpointing True --activation-checkpointing off",
       {"--gradient-checkpointing true and --activation-checkpointing off disagree"}},
      {" --bf16 maybe", {"--bf16 maybe", "expected true or false"}}};
  for (const auto& [flags, parts] : bad) {
    r = strata(model + " --max_steps 1" + flags + " --output_dir " + (dir.path / "x").string());
    EXPECT_NE(r.status, 0) << flags;
    for (const std::string& part : parts)
      EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(dir.path / "x"));
}

// Hugging Face's save_strategy and eval_strategy: "epoch" checkpoints and evaluates after each
// epoch's updates as its Trainer counts them (batches of a device over the accumulation, rounded
// down), "no" writes the final checkpoint alone and evaluates nothing, "steps" evaluates every
// logging step where --eval-steps is unset; bad values and evaluation without data refused.
TEST(TrainCli, HuggingFaceSaveAndEvalStrategies) {
  const test::TempDir dir("strata-hf-strategies");
  const fs::path data = make_data(dir.path), a = dir.path / "a", b = dir.path / "b",
                 c = dir.path / "c";
  const std::string base = "train --model tiny --init random --seed 5 --data " + data.string() +
                           " --max_seq_length 24 --per_device_train_batch_size 3 "
                           "--gradient_accumulation_steps 2 ";
  const std::string eval = "--eval_sequences 2 --eval-data " + data.string();
  test::CommandResult r = strata(base +
                                 "--num_train_epochs 2 --save_strategy epoch --eval_strategy epoch "
                                 "--eval-data " +
                                 data.string() + " --output_dir " + a.string());
  ASSERT_EQ(r.status, 0) << r.out;
  // "--epochs 2: N sequences of 24 tokens, 6 a step: S steps"
  const size_t at = r.out.find("--epochs 2: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const int64_t sequences = std::stoll(r.out.substr(at + 12));
  const int64_t epoch = std::max<int64_t>(1, (sequences + 2) / 3 / 2);
  const std::vector<json> m = metrics(a);
  ASSERT_GT(static_cast<int64_t>(m.size()), epoch) << "two epochs run past the first";
  for (const json& j : m) {
    const int64_t step = j["step"].get<int64_t>();
    const bool boundary = step % epoch == 0;
    EXPECT_EQ(j.contains("eval_loss"), boundary || step == static_cast<int64_t>(m.size()))
        << "step " << step << ", epochs of " << epoch;
    EXPECT_EQ(fs::exists(a / "checkpoints" / ("step-" + std::to_string(step))),
              boundary || step == static_cast<int64_t>(m.size()))
        << "step " << step << ", epochs of " << epoch;
  }
  r = strata(base +
             "--max_steps 4 --save_steps 1 --save_strategy no --eval_strategy no "
             "--eval-data " +
             data.string() + " --output_dir " + b.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("only the final checkpoint"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(b / "checkpoints/step-3"));
  EXPECT_TRUE(fs::exists(b / "checkpoints/step-4"));
  for (const json& j : metrics(b)) EXPECT_FALSE(j.contains("eval_loss")) << j.dump();
  r = strata(base + "--max_steps 4 --logging_steps 2 --eval_strategy steps " + eval +
             " --output_dir " + c.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> mc = metrics(c);
  ASSERT_EQ(mc.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(mc[i].contains("eval_loss"), i % 2 == 1) << i;

  for (const auto& [flags, part] :
       {std::pair{"--save_strategy best", "--save-strategy best: expected steps, no or epoch"},
        std::pair{"--eval_strategy steps", "--eval-strategy steps: there is no held-out data"}}) {
    r = strata(base + "--max_steps 1 " + flags + " --output_dir " + (dir.path / "x").string());
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.out.find(part), std::string::npos) << r.out;
  }
}

// Hugging Face's lr_scheduler_kwargs (--lr-scheduler-kwargs, a JSON object): cosine_with_min_lr
// over 5 updates after a warmup of 1, down to 0.1 x the rate at the last; the kwargs kept in the
// checkpoint's settings; kwargs for a DeepSpeed scheduler, or not a JSON object, refused.
TEST(TrainCli, HuggingFaceSchedulerKwargsShapeTheRate) {
  const test::TempDir dir("strata-train-hf-kwargs");
  const fs::path data = make_data(dir.path), run = dir.path / "run";
  const std::string base = "train " + kTiny + "--data " + data.string() + " --max-steps 5 " +
                           "--learning-rate 2e-3 --warmup-steps 1 ";
  test::CommandResult r = strata(base +
                                 "--lr-scheduler-type cosine_with_min_lr "
                                 "--lr-scheduler-kwargs '{\"min_lr_rate\": 0.1}' --output-dir " +
                                 run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 5u);
  // Update k after the warmup: 0.1 + 0.9 x (1 + cos(pi (k - 1) / 4)) / 2 of the rate.
  for (size_t k = 1; k < 5; ++k) {
    const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * double(k - 1) / 4.0));
    EXPECT_NEAR(m[k]["lr"].get<double>(), 2e-3 * (0.1 + 0.9 * cosine), 1e-12) << "update " << k;
  }
  EXPECT_EQ(m[0]["lr"].get<double>(), 0.0);  // the warmup's first update
  const json state = json::parse(slurp(run / "checkpoints/step-5/trainer_state.json"));
  EXPECT_EQ(state["settings"]["lr_schedule"], "cosine_with_min_lr");
  EXPECT_EQ(state["settings"]["lr_scheduler_kwargs"]["min_lr_rate"], 0.1);

  r = strata(base + "--lr-schedule WarmupLR --lr-scheduler-kwargs '{\"num_cycles\": 2}'");
  EXPECT_NE(r.status, 0);
  for (const char* part :
       {"--lr-scheduler-kwargs", "\"WarmupLR\" is DeepSpeed's", "scheduler.params"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  r = strata(base + "--lr-scheduler-type cosine --lr-scheduler-kwargs 'num_cycles=2'");
  EXPECT_NE(r.status, 0);
  for (const char* part : {"--lr-scheduler-kwargs 'num_cycles=2'", "not a JSON object"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  r = strata(base + "--lr-scheduler-type polynomial --lr-scheduler-kwargs '{\"lr_end\": 0.5}'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("lr_end (0.5) must be smaller than the learning rate (0.002)"),
            std::string::npos)
      << r.out;
}

TEST(TrainCli, HuggingFaceDeepSpeedConfigIsAccepted) {
  const test::TempDir dir("strata-train-ds");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 cfg = dir.path / "ds_config.json";
  std::ofstream(cfg) << R"({
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": false},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": "auto", "eps": "auto",
                  "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                  "warmup_num_steps": 2, "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "offload_param": {"device": "cpu", "pin_memory": true},
                          "overlap_comm": true, "contiguous_gradients": true,
                          "stage3_gather_16bit_weights_on_model_save": true},
    "gradient_accumulation_steps": 2, "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "steps_per_print": 2, "wall_clock_breakdown": false
  })";
  const test::CommandResult r =
      strata("train " + kTiny + "--data " + data.string() + " --steps 6 --run-dir " + run.string() +
             " --config " + cfg.string());
  ASSERT_EQ(r.status, 0) << r.out;
  // Keys strata does not act on are named once.
  EXPECT_NE(r.out.find("stage3_gather_16bit_weights_on_model_save"), std::string::npos) << r.out;
  // An "auto" no flag fills is said, with what Hugging Face would have filled in; the lr is
  // given, so only the clipping is.
  EXPECT_NE(r.out.find("gradient_clipping is \"auto\" and no --max-grad-norm is given: no "
                       "clipping (strata's default; Hugging Face's Trainer fills in its "
                       "max_grad_norm, 1.0"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("optimizer.params.lr is \"auto\""), std::string::npos) << r.out;
  // The optimizer section makes DeepSpeed's optimizer, which decays every parameter.
  EXPECT_NE(r.out.find("weight decay 0.01 on every parameter, norm weights and biases too"),
            std::string::npos)
      << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 6u);
  // WarmupDecayLR (DeepSpeed's indexing: update k runs at k - 1): 0 for the first two updates,
  // the optimizer's lr at the end of the 2-step warmup, then linearly down toward 0 at the
  // run's 6 steps (total_num_steps "auto").
  EXPECT_EQ(m[0]["lr"].get<double>(), 0.0);
  EXPECT_FLOAT_EQ(m[2]["lr"].get<float>(), 0.002f);
  EXPECT_FLOAT_EQ(m[4]["lr"].get<float>(), 0.0015f);
  EXPECT_FLOAT_EQ(m[5]["lr"].get<float>(), 0.001f);
  const json state = json::parse(slurp(run / "checkpoints/step-6/trainer_state.json"));
  EXPECT_EQ(state["settings"]["grad_accum"], 2);
  EXPECT_EQ(state["settings"]["offload_optimizer"], "cpu");
  EXPECT_EQ(state["settings"]["weight_decay_on"], "every parameter");
}

// DeepSpeed's OneCycle from a config: each update's rate and Adam's beta1 (logged in
// metrics.jsonl) as its scheduler sets them, the first update at cycle_min_lr and cycle_min_mom
// (set when the scheduler is made), then up and back over 2 + 2 updates, then held; a run
// stopped mid-cycle resumes to the same bits; a warmup flag and a momentum decay that takes
// beta1 to 1 within the run are refused before anything starts.
TEST(TrainCli, DeepSpeedsOneCycleCyclesTheRateAndAdamsBeta1) {
  const test::TempDir dir("strata-train-one-cycle");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 cfg = dir.path / "ds_config.json";
  std::ofstream(cfg) << R"({
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 4e-3,
                  "cycle_first_step_size": 2, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}})";
  const std::string base =
      "train " + kTiny + "--data " + data.string() + " --config " + cfg.string();
  test::CommandResult r = strata(base + " --steps 6 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("each update's Adam betas are the cycle's momentum"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("in place of the optimizer's (0.9, 0.95)"), std::string::npos) << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 6u);
  const double lr[] = {1e-3, 2.5e-3, 4e-3, 2.5e-3, 1e-3, 1e-3};
  const double beta1[] = {0.85, 0.9, 0.85, 0.9, 0.95, 0.95};
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_DOUBLE_EQ(m[i]["lr"].get<double>(), lr[i]) << "update " << i;
    ASSERT_TRUE(m[i].contains("beta1")) << m[i].dump();
    EXPECT_DOUBLE_EQ(m[i]["beta1"].get<double>(), beta1[i]) << "update " << i;
  }
  expect_resume_identical("--config " + cfg.string() + " --offload-optimizer cpu", 6, 3);

  r = strata(base + " --steps 6 --warmup-steps 2 --run-dir " + (dir.path / "w").string());
  EXPECT_NE(r.status, 0);
  for (const char* part : {"--warmup-steps", "OneCycle", "has no warmup", "cycle_first_step_size"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  // DeepSpeed's default cycle_max_mom, 0.9, x (1 + 0.05 x n) passes 1 at n = 3 updates after
  // the cycle's 4: index 6, update 8.
  const fs::path decaying = dir.path / "decaying.json";
  std::ofstream(decaying) << R"({"scheduler": {"type": "OneCycle", "params": {
      "cycle_min_lr": 1e-3, "cycle_max_lr": 4e-3, "cycle_first_step_size": 2,
      "decay_step_size": 1, "decay_mom_rate": 0.05}}})";
  r = strata("train " + kTiny + "--data " + data.string() + " --config " + decaying.string() +
             " --steps 10 --run-dir " + (dir.path / "d").string());
  EXPECT_NE(r.status, 0);
  for (const char* part :
       {"beta1", "reaches 1.035 at update 8 of this run's 10", "lower decay_mom_rate"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_FALSE(fs::exists(dir.path / "d")) << "nothing starts";
}

// fp16 with DeepSpeed's dynamic loss scaling, f16 parameters and activations on the host
// backend: a scale of 2^32 overflows the f16 backward, so the first steps are skipped, each
// halving the scale (hysteresis 1) and changing no weight or optimizer state, until the scale
// fits; then steps apply and the loss falls.
TEST(TrainCli, Fp16SkipsOverflowedStepsAndHalvesTheScale) {
  const test::TempDir dir("strata-train-fp16");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 cfg = dir.path / "ds_config.json";
  std::ofstream(cfg) << R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 32,
                            "hysteresis": 1, "loss_scale_window": 1000}})";
  const test::CommandResult r =
      strata("train " + kTiny + "--data " + data.string() + " --steps 20 --save-every 1 --keep 0 " +
             "--config " + cfg.string() + " --run-dir " + run.string() + " --devices host:1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("(skipped: overflow)"), std::string::npos) << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 20u);
  EXPECT_EQ(m[0]["loss_scale"].get<double>(), 4294967296.0);
  int skipped = 0, first_applied = -1;
  for (size_t i = 0; i < m.size(); ++i) {
    const bool skip = m[i]["skipped"].get<bool>();
    if (skip) {
      ++skipped;
      EXPECT_TRUE(m[i]["grad_norm"].is_null()) << "step " << i + 1;
    } else if (first_applied < 0) {
      first_applied = static_cast<int>(i) + 1;
    }
    if (i + 1 < m.size()) {
      const double scale = m[i]["loss_scale"].get<double>();
      EXPECT_EQ(m[i + 1]["loss_scale"].get<double>(), skip ? scale / 2 : scale) << "step " << i + 1;
    }
  }
  EXPECT_GE(skipped, 8);
  ASSERT_GT(first_applied, 2) << "the first steps should overflow at 2^32";
  EXPECT_LT(m.back()["loss"].get<double>(), m[size_t(first_applied - 1)]["loss"].get<double>());
  // Skipped steps change nothing: the checkpoints before the first applied step hold the
  // initial weights and zero moments, byte for byte; the one after it does not.
  const auto ckpt = [&](int step, const char* file) {
    return slurp(run / "checkpoints" / fmt::format("step-{}", step) / file);
  };
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(ckpt(1, f), ckpt(first_applied - 1, f)) << f;
    EXPECT_NE(ckpt(1, f), ckpt(first_applied, f)) << f;
  }
}

// The CUDA backend has no f16 kernels: a DeepSpeed config with fp16 enabled, or --dtype f16, on
// a GPU is refused before anything is allocated, naming the source and what to use instead
// (before, step 1 failed inside the executor at the first embedding).
TEST(TrainCli, Fp16OnAGpuIsRefusedBeforeTraining) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const test::TempDir dir("strata-train-fp16-gpu");
  const fs::path data = make_data(dir.path), cfg = dir.path / "ds_config.json";
  std::ofstream(cfg) << R"({"fp16": {"enabled": true}})";
  for (const std::string& how : {"--config " + cfg.string(), std::string("--dtype f16")}) {
    SCOPED_TRACE(how);
    const fs::path run = dir.path / ("run-" + std::to_string(how.size()));
    const test::CommandResult r = strata("train " + kTiny + "--data " + data.string() +
                                         " --steps 2 --devices cuda:0 --device-memory 1GiB " + how +
                                         " --run-dir " + run.string());
    EXPECT_EQ(r.status, 1) << r.out;
    for (const char* want : {"f16 kernels", "bf16", "--devices host:N"})
      EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
    EXPECT_NE(r.out.find(how.starts_with("--dtype") ? "--dtype f16" : "fp16.enabled"),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << "refused before training\n" << r.out;
  }
}

// The same on a GPU in bf16, where the kept activations feed cuBLASLt and the tensor-core
// attention (whose inputs must be 16-byte aligned inside the kept buffers).
TEST(TrainCli, ActivationCheckpointingOffOnAGpuGivesTheSameBits) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const test::TempDir dir("strata-recompute-gpu");
  const fs::path data = make_data(dir.path);
  expect_flags_keep_the_bits(
      dir.path,
      "train " + kTiny + "--data " + data.string() +
          " --grad-accum 2 --devices cuda:0 --device-memory 1GiB --dtype bf16 --threads 1",
      "--activation-checkpointing off", 2);
}

// With the optimizer offloaded, the gradients summed on the devices and brought to CPU Adam
// once a step (the default where they fit) give the bits of every micro-batch's gradients
// added in host RAM (--offload-gradients cpu), and the run says how many units' stayed.
void expect_gradient_homes_same_bits(const std::vector<std::string>& placements) {
  const test::TempDir dir("strata-grads");
  const fs::path data = make_data(dir.path);
  for (const std::string& placement : placements) {
    SCOPED_TRACE(placement);
    std::array<std::string, 2> out;
    expect_flags_keep_the_bits(dir.path,
                               "train " + kTiny + "--data " + data.string() +
                                   " --lr 2e-3 --grad-accum 3 --threads 1 " + placement,
                               "--offload-gradients cpu", 2, &out);
    EXPECT_NE(out[0].find("gradients: 4 of 4 offloaded-optimizer unit(s) sum on the device(s)"),
              std::string::npos)
        << out[0];
    EXPECT_NE(out[1].find("gradients: 0 of 4"), std::string::npos) << out[1];
    // The checkpoints' settings say what was asked.
    auto settings = [&](const char* run) {
      return json::parse(
          slurp(dir.path / run / "checkpoints/step-2/trainer_state.json"))["settings"];
    };
    EXPECT_EQ(settings("with")["offload_gradients"], "cpu");
    EXPECT_EQ(settings("without")["offload_gradients"], "auto");
  }
}

// On one device, and on two with P on the host and O on NVMe.
TEST(TrainCli, GradientsOnTheDeviceOrInHostRamGiveTheSameBits) {
  expect_gradient_homes_same_bits(
      {"--offload-optimizer cpu",
       "--devices host:2 --persistence-threshold 0 --offload-param cpu --offload-optimizer nvme"});
  const test::TempDir dir("strata-grads-bad");
  const fs::path data = make_data(dir.path);
  const test::CommandResult bad =
      strata("train " + kTiny + "--data " + data.string() +
             " --steps 1 --offload-optimizer cpu --offload-gradients disk --run-dir " +
             (dir.path / "bad").string());
  EXPECT_NE(bad.status, 0);
  for (const char* part : {"--offload-gradients disk", "auto", "none", "cpu", "nvme"})
    EXPECT_NE(bad.out.find(part), std::string::npos) << part << " missing from " << bad.out;
  // With the optimizer on the device the gradients are there too: the flag is said to change
  // nothing.
  const test::CommandResult idle =
      strata("train " + kTiny + "--data " + data.string() +
             " --steps 1 --offload-gradients nvme --run-dir " + (dir.path / "idle").string());
  EXPECT_EQ(idle.status, 0) << idle.out;
  EXPECT_NE(idle.out.find("--offload-gradients nvme is for an optimizer offloaded"),
            std::string::npos)
      << idle.out;
}

// Every micro-batch's gradients summed on NVMe (--offload-gradients nvme; the swap files in
// RUN/swap, as for the optimizer) give the bits of summing them on the devices (which the test
// above shows are host RAM's), on one device and on two with P on NVMe too, and the run says
// how many units' went there.
TEST(TrainCli, GradientsOnNvmeGiveTheSameBits) {
  const test::TempDir dir("strata-grads-nvme");
  const fs::path data = make_data(dir.path);
  expect_flag_keeps_the_bits_and_says(
      dir.path, data,
      {"--persistence-threshold 0 --offload-optimizer cpu",
       "--devices host:2 --persistence-threshold 0 --offload-param nvme --offload-optimizer nvme"},
      "--offload-gradients nvme", "4 of them summed on NVMe");
  EXPECT_TRUE(fs::is_empty(dir.path / "with" / "swap")) << "swap files left after a clean exit";
}

// The same on a GPU in bf16: the sums come down from the device by copy, CPU Adam reads them.
TEST(TrainCli, GradientsOnTheDeviceOnAGpuGiveTheSameBits) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  expect_gradient_homes_same_bits(
      {"--devices cuda:0 --device-memory 1GiB --dtype bf16 --offload-optimizer cpu"});
}

// --eval-data: the held-out loss every --eval-every steps and after the last, from the
// parameters wherever they live (here P on the host, O on NVMe, two ranks), equal to what
// `strata eval` gives on the checkpoint of the same step.
TEST(TrainCli, EvalDataGivesTheLossStrataEvalGivesOnTheCheckpoint) {
  const test::TempDir dir("strata-train-eval");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 held_txt = dir.path / "held.txt", held = dir.path / "held.bin";
  {
    std::ofstream f(held_txt);
    for (int i = 0; i < 40; ++i) f << "a lazy dog naps under the brown oak, " << i << " times\n";
  }
  ASSERT_EQ(strata("tokenize --tokenizer byte --input " + held_txt.string() + " --output " +
                   held.string())
                .status,
            0);
  const std::string args = "train " + kTiny + "--data " + data.string() + " --eval-data " +
                           held.string() + " --steps 5 --save-every 2 --keep 0 --devices host:2 " +
                           "--offload-param cpu --offload-optimizer nvme --run-dir " + run.string();
  const test::CommandResult r = strata(args + " --eval-every 2");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 5u);
  for (int step : {1, 3}) EXPECT_FALSE(m[size_t(step - 1)].contains("eval_loss")) << step;
  double previous = INFINITY;
  for (int step : {2, 4, 5}) {
    const json& row = m[size_t(step - 1)];
    ASSERT_TRUE(row.contains("eval_loss")) << step;
    EXPECT_NE(r.out.find(fmt::format("eval: step {} loss", step)), std::string::npos) << r.out;
    const test::CommandResult e =
        strata("eval --model " + (run / "checkpoints" / fmt::format("step-{}", step)).string() +
               " --data " + held.string() + " --seq-len 32 --devices host:1 --json");
    ASSERT_EQ(e.status, 0) << e.out;
    const json ej = json::parse(e.out.substr(e.out.find('{')));
    const double want = ej["loss"].get<double>(), got = row["eval_loss"].get<double>();
    EXPECT_NEAR(got, want, 1e-6 * want) << "step " << step;
    EXPECT_EQ(row["eval_targets"], ej["tokens"]) << "step " << step;
    EXPECT_LT(got, previous) << "the held-out loss should fall on text this close to the data";
    previous = got;
  }
  // --eval-sequences caps the pass; without --eval-every it runs after the last step alone.
  fs::remove_all(run);
  const test::CommandResult capped = strata(args + " --eval-sequences 3");
  ASSERT_EQ(capped.status, 0) << capped.out;
  EXPECT_NE(capped.out.find("eval: step 5 loss"), std::string::npos) << capped.out;
  EXPECT_NE(capped.out.find("over 3 sequences (96 targets)"), std::string::npos) << capped.out;
  EXPECT_EQ(capped.out.find("eval: step 4"), std::string::npos) << capped.out;
  // Asking for evaluation without held-out data, or naming a file that is not there.
  const test::CommandResult no_data =
      strata("train " + kTiny + "--data " + data.string() + " --steps 2 --eval-every 1");
  EXPECT_NE(no_data.status, 0);
  EXPECT_NE(no_data.out.find("give --eval-data FILE"), std::string::npos) << no_data.out;
  const test::CommandResult missing =
      strata("train " + kTiny + "--data " + data.string() + " --steps 2 --eval-data " +
             (dir.path / "nope.bin").string() + " --run-dir " + run.string());
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.out.find("nope.bin"), std::string::npos) << missing.out;
}

// Prompt/completion rows through strata tokenize, then training: the step's loss is the mean
// over the completions' targets only, exactly the loss strata eval gives the same sequence
// with the same initial weights through the same mask; --loss-mask off counts every target.
TEST(TrainCli, LossMasksTrainOnlyOnCompletions) {
  const test::TempDir dir("strata-train-sft");
  const fs::path jsonl = dir.path / "sft.jsonl", sft = dir.path / "sft.bin";
  {
    std::ofstream f(jsonl);
    const char* words[] = {"alpha", "beta", "gamma", "delta", "theta"};
    for (int i = 0; i < 40; ++i)
      f << "{\"prompt\": \"say " << words[i % 5] << " " << words[(i * 3 + 1) % 5]
        << ": \", \"completion\": \"" << words[(i * 3 + 1) % 5] << " " << words[i % 5] << "\"}\n";
  }
  const test::CommandResult t =
      strata("tokenize --append-eos --input " + jsonl.string() + " --output " + sft.string());
  ASSERT_EQ(t.status, 0) << t.out;
  // Its first sequence of 32 alone (33 tokens), with its flags.
  const TokenFile all = TokenFile::open(sft, std::optional<TokenWidth>{});
  const std::optional<LossMask> mask = LossMask::open_beside(all);
  ASSERT_TRUE(mask.has_value());
  std::vector<uint32_t> first;
  std::vector<uint8_t> flags;
  for (int64_t i = 0; i < 33; ++i) {
    first.push_back(all.get(i));
    flags.push_back(mask->counts(i) ? 1 : 0);
  }
  const int64_t counted = std::count(flags.begin() + 1, flags.end(), uint8_t{1});
  ASSERT_GT(counted, 0);
  ASSERT_LT(counted, 32);  // the prompt is left out
  const fs::path one = dir.path / "one.bin";
  write_llmc_tokens(one, first, TokenWidth::u16);
  {
    LossMaskWriter w(one, 0);
    w.write(flags);
    w.finish();
  }
  const std::string model = "--model tiny --init random --seed 5 --seq-len 32 ";
  const auto eval_loss = [&](const std::string& extra) {
    const test::CommandResult e =
        strata("eval " + model + "--data " + one.string() + " --json " + extra);
    EXPECT_EQ(e.status, 0) << e.out;
    return json::parse(e.out.substr(e.out.find('{')));
  };
  const auto step_loss = [&](const std::string& extra, const std::string& name) {
    const fs::path run = dir.path / name;
    const test::CommandResult r = strata("train " + model + "--micro-batch 1 --steps 1 --data " +
                                         one.string() + " --run-dir " + run.string() + " " + extra);
    EXPECT_EQ(r.status, 0) << r.out;
    return std::pair{metrics(run).at(0)["loss"].get<double>(), r.out};
  };
  const json masked = eval_loss(""), unmasked = eval_loss("--loss-mask off");
  EXPECT_EQ(masked["tokens"], counted);
  EXPECT_EQ(unmasked["tokens"], 32);
  const auto [with_mask, out] = step_loss("", "masked");
  EXPECT_NE(out.find(fmt::format("training data: loss masks beside 1 of 1 file(s); {} of 32 "
                                 "targets count",
                                 counted)),
            std::string::npos)
      << out;
  EXPECT_NEAR(with_mask, masked["loss"].get<double>(), 1e-6 * with_mask);
  const auto [without, out_off] = step_loss("--loss-mask off", "off");
  EXPECT_EQ(out_off.find("loss masks"), std::string::npos) << out_off;
  EXPECT_NEAR(without, unmasked["loss"].get<double>(), 1e-6 * without);
  EXPECT_NE(with_mask, without);

  // The whole file trains, its held-out pass counted through the same masks.
  const fs::path run = dir.path / "sft-run";
  const test::CommandResult r =
      strata("train " + model + "--micro-batch 2 --steps 3 --data " + sft.string() +
             " --eval-data " + sft.string() + " --eval-sequences 4 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const test::CommandResult e =
      strata("eval --model " + (run / "checkpoints/step-3").string() + " --data " + sft.string() +
             " --seq-len 32 --max-sequences 4 --json");
  ASSERT_EQ(e.status, 0) << e.out;
  const json ej = json::parse(e.out.substr(e.out.find('{')));
  const json last = metrics(run).back();
  EXPECT_EQ(last["eval_targets"], ej["tokens"]);
  EXPECT_LT(ej["tokens"].get<int64_t>(), 4 * 32);
  EXPECT_NEAR(last["eval_loss"].get<double>(), ej["loss"].get<double>(),
              1e-6 * ej["loss"].get<double>());
}

// Fine-tuning rows (prompts with completions, tokenized with their loss masks and document
// index) train one document per sequence by default, as TRL's SFT trains rows without packing:
// a step over every row has the loss strata eval gives them with the same initial weights;
// --epochs counts rows; --packing wrapped still cuts them as one stream; a run does not resume
// with the other packing.
TEST(TrainCli, FineTuningRowsTrainOneDocumentPerSequence) {
  const test::TempDir dir("strata-train-rows");
  const fs::path jsonl = dir.path / "rows.jsonl", rows = dir.path / "rows.bin";
  {
    std::ofstream f(jsonl);
    for (int i = 0; i < 8; ++i)
      f << "{\"prompt\": \"count to " << i << ": \", \"completion\": \""
        << std::string(size_t(3 + 5 * i), char('a' + i)) << "\"}\n";
  }
  const test::CommandResult t =
      strata("tokenize --append-eos --input " + jsonl.string() + " --output " + rows.string());
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_NE(t.out.find("where each document starts: rows.bin.docs"), std::string::npos) << t.out;
  const std::string model = "--model tiny --init random --seed 5 --seq-len 32 ";
  const test::CommandResult e =
      strata("eval " + model + "--data " + rows.string() + " --batch 8 --json");
  ASSERT_EQ(e.status, 0) << e.out;
  const json ej = json::parse(e.out.substr(e.out.find('{')));
  EXPECT_EQ(ej["packing"], "none");
  EXPECT_EQ(ej["sequences"], 8);
  const fs::path run = dir.path / "run";
  const test::CommandResult r = strata("train " + model + "--micro-batch 8 --steps 1 --data " +
                                       rows.string() + " --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  // Row i is 16 + 5i tokens (its bytes and an end-of-text): rows 4..7 are longer than 33.
  EXPECT_NE(r.out.find("training data: 8 documents, one per sequence (--packing none); 4 cut "
                       "after --seq-len + 1 = 33 tokens"),
            std::string::npos)
      << r.out;
  EXPECT_NEAR(metrics(run).at(0)["loss"].get<double>(), ej["loss"].get<double>(),
              1e-6 * ej["loss"].get<double>());
  const json state = json::parse(slurp(run / "checkpoints/step-1/trainer_state.json"));
  EXPECT_EQ(state["settings"]["packing"], "none");

  const test::CommandResult epochs =
      strata("train " + model + "--micro-batch 2 --epochs 1 --data " + rows.string() +
             " --run-dir " + (dir.path / "epochs").string());
  ASSERT_EQ(epochs.status, 0) << epochs.out;
  EXPECT_NE(epochs.out.find("8 sequences of 32 tokens, 2 a step: 4 steps"), std::string::npos)
      << epochs.out;
  const test::CommandResult wrapped =
      strata("train " + model + "--micro-batch 2 --epochs 1 --packing wrapped --data " +
             rows.string() + " --run-dir " + (dir.path / "wrapped").string());
  ASSERT_EQ(wrapped.status, 0) << wrapped.out;
  EXPECT_EQ(wrapped.out.find("one per sequence"), std::string::npos) << wrapped.out;
  const int64_t stream = TokenFile::open(rows, std::optional<TokenWidth>{}).num_sequences(32);
  EXPECT_NE(wrapped.out.find(fmt::format("{} sequences of 32 tokens", stream)), std::string::npos)
      << wrapped.out;
  const test::CommandResult resume =
      strata("train " + model + "--micro-batch 8 --steps 2 --resume --packing wrapped --data " +
             rows.string() + " --run-dir " + run.string());
  EXPECT_NE(resume.status, 0);
  EXPECT_NE(resume.out.find("cut with --packing none"), std::string::npos) << resume.out;
  EXPECT_NE(resume.out.find("resume with --packing none"), std::string::npos) << resume.out;

  // --packing bfd at --seq-len 64: the rows' 15, 20, ..., 50 positions fill 5 sequences, not 8,
  // and as each document attends to itself alone, steps over every row (micro-batches of all
  // the sequences) have none's losses: the forward's and, through the updates, the backward's.
  // (Attention's backward across the documents moves the second step's loss by ~1e-2.)
  const std::string wide = "--model tiny --init random --seed 5 --seq-len 64 --lr 0.01 --steps 3 ";
  const auto losses = [&](const std::string& packing, int rows_per_step) {
    const fs::path dir_run = dir.path / ("wide-" + packing);
    const test::CommandResult w =
        strata("train " + wide + "--packing " + packing + " --micro-batch " +
               std::to_string(rows_per_step) + " --data " + rows.string() + " --run-dir " +
               dir_run.string());
    EXPECT_EQ(w.status, 0) << w.out;
    std::vector<double> l;
    for (const json& m : metrics(dir_run)) l.push_back(m["loss"].get<double>());
    return std::pair{l, w.out};
  };
  const auto [one_each, out_none] = losses("none", 8);
  const auto [packed, out_bfd] = losses("bfd", 5);
  EXPECT_NE(out_bfd.find("training data: 8 documents packed into 5 sequences by best fit "
                         "decreasing"),
            std::string::npos)
      << out_bfd;
  ASSERT_EQ(one_each.size(), 3u);
  ASSERT_EQ(packed.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(packed[i], one_each[i], 1e-5 * one_each[i]) << i;
}

// DeepSpeed's aio section sets the swap store's stripe and queue depth (the placement sizes the
// swap files by that stripe, and the executor's store uses the same one).
TEST(TrainCli, AioSettingsReachTheSwapStore) {
  const test::TempDir dir("strata-train-aio");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 cfg = dir.path / "ds_config.json", swap = dir.path / "swap";
  const auto train_with = [&](const json& aio) {
    json c;
    c["zero_optimization"] = {
        {"stage", 3}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap.string()}}}};
    c["aio"] = aio;
    std::ofstream(cfg) << c.dump();
    return strata("train " + kTiny + "--data " + data.string() + " --steps 2 --run-dir " +
                  run.string() + " --config " + cfg.string());
  };
  const test::CommandResult r = train_with({{"block_size", 65536}, {"queue_depth", 4}});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("nvme swap: " + swap.string() +
                       "; stripe 64 KiB (aio.block_size), queue depth 4 (aio.queue_depth)"),
            std::string::npos)
      << r.out;
  const json state = json::parse(slurp(run / "checkpoints/step-2/trainer_state.json"));
  EXPECT_EQ(state["settings"]["aio"]["block_size"], 65536);
  EXPECT_EQ(state["settings"]["aio"]["queue_depth"], 4);
  // A queue depth io_uring cannot take is refused before training, naming the key.
  const test::CommandResult bad = train_with({{"queue_depth", 0}});
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("aio.queue_depth"), std::string::npos) << bad.out;
}

// --epochs E: ceil(E x sequences / sequences a step) steps, on one device and on two with
// accumulation.
TEST(TrainCli, EpochsArePassesOverTheData) {
  const test::TempDir dir("strata-train-epochs");
  const fs::path data = make_data(dir.path);
  const int64_t sequences = TokenFile::open(data, std::optional<TokenWidth>{}).num_sequences(32);
  ASSERT_GT(sequences, 100);
  struct Case {
    std::string args;
    double epochs;
    int64_t per_step;
  };
  for (const Case& c : {Case{"", 0.05, 2}, Case{"--devices host:2 --grad-accum 2", 0.1, 8}}) {
    const fs::path run = dir.path / fmt::format("run-{}", c.per_step);
    const test::CommandResult r =
        strata("train " + kTiny + "--data " + data.string() + " --epochs " +
               fmt::format("{}", c.epochs) + " " + c.args + " --run-dir " + run.string());
    ASSERT_EQ(r.status, 0) << r.out;
    const auto want = static_cast<int64_t>(
        std::ceil(c.epochs * static_cast<double>(sequences) / static_cast<double>(c.per_step)));
    const std::vector<json> m = metrics(run);
    EXPECT_EQ(static_cast<int64_t>(m.size()), want) << r.out;
    // Each step's epoch: the passes over the data so far, as Hugging Face's Trainer logs it.
    for (size_t i = 0; i < m.size(); ++i)
      EXPECT_DOUBLE_EQ(m[i]["epoch"].get<double>(),
                       static_cast<double>(static_cast<int64_t>(i + 1) * c.per_step) /
                           static_cast<double>(sequences));
    EXPECT_NE(r.out.find(fmt::format("(epoch {:.2f})", m.back()["epoch"].get<double>())),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(fmt::format("{} sequences of 32 tokens, {} a step: {} steps", sequences,
                                     c.per_step, want)),
              std::string::npos)
        << r.out;
  }
}

// The lines of a CSV file, split at commas.
std::vector<std::vector<std::string>> csv_rows(const fs::path& file) {
  std::vector<std::vector<std::string>> rows;
  std::ifstream f(file);
  for (std::string line; std::getline(f, line);) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

// The config's tensorboard and csv_monitor sections: each step's loss, lr and gradient norm (and
// the held-out loss where it is evaluated) at the samples trained so far, in DeepSpeed's files;
// a resumed run appends, and what a run logged past the checkpoint it resumes from (here the
// last checkpoint is removed, as if the run died before writing it) is dropped, in
// metrics.jsonl too, so each step is logged once. The event files are decoded in test_monitor
// and, independently, by tests/reference/tfevents_reader.py in test_train_reference.
TEST(TrainCli, MonitorsWriteEachStepWhereDeepSpeedsWould) {
  const test::TempDir dir("strata-train-monitor");
  const fs::path data = make_data(dir.path), run = dir.path / "run",
                 cfg = dir.path / "ds_config.json";
  std::ofstream(cfg) << fmt::format(R"({{
    "tensorboard": {{"enabled": true, "output_path": "{0}/tb", "job_name": "sft"}},
    "csv_monitor": {{"enabled": true, "output_path": "{0}/csv", "job_name": "sft"}},
    "wandb": {{"enabled": true, "project": "p"}}
  }})",
                                    dir.path.string());
  const std::string args =
      "train " + kTiny + "--data " + data.string() + " --grad-accum 2 --eval-data " +
      data.string() + " --eval-sequences 2 --eval-every 2 --save-every 2 --config " + cfg.string() +
      " --run-dir " + run.string() + " --lr 1e-3 --lr-schedule WarmupLR --warmup-steps 4";
  test::CommandResult r = strata(args + " --steps 3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(
      r.out.find("monitor: tensorboard " + (dir.path / "tb/sft/events.out.tfevents.").string()),
      std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("csv " + (dir.path / "csv/sft/").string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("wandb"), std::string::npos) << "W&B is listed as not acted on: " << r.out;
  ASSERT_EQ(metrics(run).size(), 3u);
  fs::remove_all(run / "checkpoints/step-3");
  r = strata(args + " --steps 5 --resume");
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_NE(r.out.find("at step 2"), std::string::npos) << r.out;

  const std::vector<json> m = metrics(run);
  ASSERT_EQ(m.size(), 5u);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m[i]["step"], i + 1) << "each step once";
  const fs::path csv = dir.path / "csv/sft";
  for (const auto& [file, key] :
       {std::pair{"Train_Samples_train_loss.csv", "loss"}, std::pair{"Train_Samples_lr.csv", "lr"},
        std::pair{"Train_Samples_grad_norm.csv", "grad_norm"}}) {
    SCOPED_TRACE(file);
    const auto rows = csv_rows(csv / file);
    ASSERT_EQ(rows.size(), 6u) << "one header (not repeated by the resumed run), 5 steps";
    EXPECT_EQ(rows[0],
              (std::vector<std::string>{"step", std::string(key) == "loss" ? "train_loss" : key}));
    for (size_t i = 0; i < 5; ++i) {
      ASSERT_EQ(rows[i + 1].size(), 2u);
      EXPECT_EQ(rows[i + 1][0], std::to_string(4 * (i + 1))) << "samples: 2 x 2 a step";
      // DeepSpeed writes lr once the step has stepped its scheduler: the next update's rate
      // (the warmup's log rise, then warmup_max_lr from update 5 on).
      const double want = std::string(key) != "lr" ? m[i][key].get<double>()
                          : i + 1 < m.size()       ? m[i + 1]["lr"].get<double>()
                                                   : 1e-3;
      EXPECT_EQ(std::stod(rows[i + 1][1]), want) << "step " << i + 1;
    }
    if (std::string(key) == "lr") {
      EXPECT_LT(m[2]["lr"].get<double>(), m[3]["lr"].get<double>()) << "still warming up";
    }
  }
  // Held out: steps 2 and 4 (every 2) and 5 (the last); the first run's step 3 (its last) was
  // dropped with the step.
  const auto eval = csv_rows(csv / "Eval_Samples_eval_loss.csv");
  ASSERT_EQ(eval.size(), 4u);
  EXPECT_EQ(eval[0], (std::vector<std::string>{"step", "eval_loss"}));
  for (const auto& [row, step] : {std::pair{1, 2}, std::pair{2, 4}, std::pair{3, 5}}) {
    EXPECT_EQ(eval[row][0], std::to_string(4 * step));
    EXPECT_EQ(std::stod(eval[row][1]), m[step - 1]["eval_loss"].get<double>());
  }
  EXPECT_FALSE(fs::exists(csv / "Train_Samples_loss_scale.csv")) << "f32: no loss scale";
  // A resume refused for having no steps left opens no event file of its own.
  r = strata(args + " --steps 5 --resume");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("ask for more steps"), std::string::npos) << r.out;
  int event_files = 0;
  for (const auto& e : fs::directory_iterator(dir.path / "tb/sft")) {
    EXPECT_EQ(e.path().filename().string().rfind("events.out.tfevents.", 0), 0u) << e.path();
    EXPECT_GT(fs::file_size(e.path()), 0u);
    ++event_files;
  }
  EXPECT_EQ(event_files, 2) << "the resumed run writes a second file, as a new SummaryWriter";

  // The flags enable a monitor in the directory named; one that cannot be made is refused
  // before training starts, naming it.
  r = strata("train " + kTiny + "--data " + data.string() + " --steps 1 --csv-monitor-dir " +
             (dir.path / "flag-csv").string() + " --run-dir " + (dir.path / "run2").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(csv_rows(dir.path / "flag-csv/Train_Samples_train_loss.csv").size(), 2u);
  r = strata("train " + kTiny + "--data " + data.string() + " --steps 1 --tensorboard-dir " +
             (cfg / "tb").string() + " --run-dir " + (dir.path / "run3").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("tensorboard " + (cfg / "tb").string()), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1/1"), std::string::npos) << "refused before training: " << r.out;
}

// Hugging Face's report_to and logging_dir: tensorboard writes TensorBoard events to the logging
// directory, else RUN/runs, and so does a logging directory alone (transformers 4's default
// "all"); another integration is said not to be available and the run goes on; none adds no
// events.
TEST(TrainCli, HuggingFaceReportToTensorBoard) {
  const test::TempDir dir("strata-train-report-to");
  const fs::path data = make_data(dir.path);
  const std::string base = "train " + kTiny + "--data " + data.string() + " --steps 2 ";
  const auto events = [](const fs::path& d) {
    int n = 0;
    if (fs::is_directory(d))
      for (const auto& e : fs::directory_iterator(d))
        n += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0 &&
             fs::file_size(e.path()) > 0;
    return n;
  };
  test::CommandResult r =
      strata(base + "--report_to tensorboard --logging_dir " + (dir.path / "logs").string() +
             " --output_dir " + (dir.path / "a").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(events(dir.path / "logs"), 1) << r.out;
  r = strata(base + "--report_to all --output_dir " + (dir.path / "b").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(events(dir.path / "b/runs"), 1) << r.out;
  r = strata(base + "--logging_dir " + (dir.path / "alone").string() + " --output_dir " +
             (dir.path / "c").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(events(dir.path / "alone"), 1) << r.out;
  r = strata(base + "--report_to wandb --output_dir " + (dir.path / "d").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("--report-to wandb: strata reports to TensorBoard alone"), std::string::npos)
      << r.out;
  EXPECT_EQ(events(dir.path / "d/runs"), 0);
  r = strata(base + "--report_to none --output_dir " + (dir.path / "e").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_FALSE(fs::exists(dir.path / "e/runs"));
}

// --warmup-ratio is Hugging Face's warmup_ratio: ceil(ratio x steps) warmup steps, so 0.4 of 6
// steps gives the learning rates of --warmup-steps 3; a schedule with its warmup left unset
// says it takes DeepSpeed's default of 1000 steps.
TEST(TrainCli, WarmupRatioIsHuggingFacesCeiling) {
  const test::TempDir dir("strata-train-warmup");
  const fs::path data = make_data(dir.path);
  const std::string args =
      "train " + kTiny + "--data " + data.string() + " --steps 6 --lr-schedule WarmupDecayLR ";
  test::CommandResult r =
      strata(args + "--warmup-ratio 0.4 --run-dir " + (dir.path / "a").string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(args + "--warmup-steps 3 --run-dir " + (dir.path / "b").string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = strata(args + "--run-dir " + (dir.path / "c").string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("warmup_num_steps is DeepSpeed's default, 1000"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("this run's 6 steps are all warmup"), std::string::npos) << r.out;
  const std::vector<json> a = metrics(dir.path / "a"), b = metrics(dir.path / "b"),
                          c = metrics(dir.path / "c");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  ASSERT_EQ(c.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(a[i]["lr"], b[i]["lr"]) << "step " << i + 1;
  EXPECT_NE(a[3]["lr"], c[3]["lr"]) << "1000 warmup steps are another schedule";
  const json state = json::parse(slurp(dir.path / "a/checkpoints/step-6/trainer_state.json"));
  EXPECT_EQ(state["settings"]["warmup_num_steps"], 3);
}

TEST(TrainCli, BadInputIsNamed) {
  const test::TempDir dir("strata-train-bad");
  const fs::path data = make_data(dir.path);
  const std::string d = " --data " + data.string() + " --run-dir " + (dir.path / "r").string();
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : {
           Case{"--model tiny --steps 2" + d, "--init random"},
           Case{kTiny + "--steps 2 --resume" + d, "no checkpoints/ folder"},
           Case{"--model tiny --init random --steps 2 --seq-len 100000" + d, "--seq-len 100000"},
           Case{kTiny + "--steps 2 --data /nonexistent/x.bin", "/nonexistent/x.bin"},
           Case{kTiny + "--steps 2 --offload-param disk" + d, "disk"},
           Case{kTiny + "--steps 0" + d, "give --steps N (optimizer steps in all) or --epochs E"},
           Case{kTiny + "--steps -1" + d, "--steps -1"},
           Case{kTiny + "--steps 2 --epochs 1" + d, "give one of them, not both"},
           Case{kTiny + "--epochs -0.5" + d, "--epochs -0.5: it must be a finite number above 0"},
           Case{kTiny + "--epochs 1e30" + d, "give a number of epochs a run can finish"},
           Case{kTiny + "--steps 2 --lr-schedule WarmupLR --warmup-ratio 1.5" + d,
                "--warmup-ratio 1.5: it is the fraction of the run's steps"},
           Case{kTiny + "--steps 2 --lr-schedule WarmupLR --warmup-ratio 0.1 --warmup-steps 3" + d,
                "give one of them, not both"},
           Case{kTiny + "--steps 2 --warmup-steps 3" + d,
                "--warmup-steps: there is no learning-rate schedule to warm up"},
       }) {
    const test::CommandResult r = strata("train " + c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
  const test::CommandResult e = strata("export " + dir.path.string() + " --out x");
  EXPECT_NE(e.status, 0);
  EXPECT_NE(e.out.find("neither a complete checkpoint"), std::string::npos) << e.out;
  // Under a multi-process launcher (torchrun sets WORLD_SIZE and RANK): refused before anything
  // is written; WORLD_SIZE=1 runs.
  const std::string run = "train " + kTiny + "--steps 1 --devices host" + d;
  const test::CommandResult launched = test::run_command(
      "WORLD_SIZE=4 RANK=2 '" + std::string(STRATA_BINARY) + "' " + run + " 2>&1");
  EXPECT_EQ(launched.status, 1) << launched.out;
  for (const char* part : {"WORLD_SIZE=4 (RANK=2)", "one process", "--devices cuda:0,1"})
    EXPECT_NE(launched.out.find(part), std::string::npos) << part << " in " << launched.out;
  EXPECT_FALSE(fs::exists(dir.path / "r" / "checkpoints"));
  const test::CommandResult single =
      test::run_command("WORLD_SIZE=1 '" + std::string(STRATA_BINARY) + "' " + run + " 2>&1");
  EXPECT_EQ(single.status, 0) << single.out;
}

}  // namespace
}  // namespace strata
