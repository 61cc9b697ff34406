// test_eval_cli.cpp: `strata eval` as a user runs it, on the tiny preset with random weights
// (the checkpoint path, compared with PyTorch, is in test_llama_reference).
#include "model/config.h"
#include "model/tokens.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace strata {
namespace {

namespace fs = std::filesystem;
using Result = test::CommandResult;

class EvalCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_eval_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    tokens_.resize(16 * 5 + 1);
    for (size_t i = 0; i < tokens_.size(); ++i)
      tokens_[i] = static_cast<uint32_t>((i * 37 + 11) % 512);
    write_llmc_tokens(dir_ / "tokens.bin", tokens_, TokenWidth::u16);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Result eval(const std::string& args, const std::string& devices = "host") const {
    return test::run_command(std::string("'") + STRATA_BINARY +
                             "' eval --model tiny --init random --devices " + devices +
                             " --device-memory 512MiB " + args + " 2>&1");
  }
  nlohmann::json eval_json(const std::string& args, const std::string& devices = "host") const {
    const Result r = eval(args + " --json", devices);
    EXPECT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    return j;
  }
  std::string data() const { return "--data '" + (dir_ / "tokens.bin").string() + "'"; }

  fs::path dir_;
  std::vector<uint32_t> tokens_;
};

TEST_F(EvalCli, JsonReportsLossPerplexityAndTokens) {
  const auto j = eval_json("--seed 1 --seq-len 16 --batch 2 " + data());
  ASSERT_TRUE(j.contains("loss") && j.contains("perplexity") && j.contains("tokens")) << j;
  EXPECT_EQ(j["tokens"].get<int64_t>(), 80);  // 81 tokens: five sequences of 16
  const double loss = j["loss"].get<double>();
  EXPECT_NEAR(loss, std::log(512.0), 0.3);  // random weights predict nothing
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(loss), 1e-9 * std::exp(loss));

  // Deterministic; another seed is another model; batching changes nothing.
  EXPECT_EQ(eval_json("--seed 1 --seq-len 16 --batch 2 " + data())["loss"], j["loss"]);
  EXPECT_NE(eval_json("--seed 2 --seq-len 16 --batch 2 " + data())["loss"], j["loss"]);
  EXPECT_NEAR(eval_json("--seed 1 --seq-len 16 --batch 3 " + data())["loss"].get<double>(), loss,
              1e-5 * loss);
  EXPECT_EQ(eval_json("--seed 1 --seq-len 16 --max-sequences 2 " + data())["tokens"], 32);

  // The same tokens as a raw uint16 file give the same loss.
  {
    std::ofstream f(dir_ / "tokens.u16", std::ios::binary);
    for (uint32_t t : tokens_) {
      const auto v = static_cast<uint16_t>(t);
      f.write(reinterpret_cast<const char*>(&v), 2);
    }
  }
  const auto raw = eval_json("--seed 1 --seq-len 16 --batch 2 --data-dtype uint16 --data '" +
                             (dir_ / "tokens.u16").string() + "'");
  EXPECT_EQ(raw["loss"], j["loss"]);

  // Shards, as strata tokenize --shard-tokens writes them: the whole file cut where a sequence
  // starts (the first keeps the one token the last of its sequences needs as a target) gives
  // the same sequences in the same order, so the same loss.
  const std::span<const uint32_t> all(tokens_);
  write_llmc_tokens(dir_ / "a.bin", all.subspan(0, 2 * 16 + 1), TokenWidth::u16);
  write_llmc_tokens(dir_ / "b.bin", all.subspan(2 * 16), TokenWidth::u16);
  const auto shards = eval_json("--seed 1 --seq-len 16 --batch 2 --data '" +
                                (dir_ / "a.bin").string() + "," + (dir_ / "b.bin").string() + "'");
  EXPECT_EQ(shards["loss"], j["loss"]);
  EXPECT_EQ(shards["tokens"], 80);

  const Result text = eval("--seed 1 --seq-len 16 " + data());
  EXPECT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("perplexity"), std::string::npos) << text.out;
}

// A loss mask beside the token file (strata tokenize writes one for prompts): the loss is the
// mean over the targets it counts. Masking out whole sequences 1, 3 and 4 gives the loss of
// sequences 0 and 2 alone, as shards of their own; --loss-mask off gives every target's.
TEST_F(EvalCli, LossMasksLeaveOutTheTargetsTheyDoNotCount) {
  const std::string args = "--seed 1 --seq-len 16 --batch 2 ";
  const auto whole = eval_json(args + data());
  std::vector<uint8_t> flags(tokens_.size(), 0);
  for (int64_t seq : {0, 2})
    for (int64_t i = seq * 16 + 1; i <= seq * 16 + 16; ++i) flags[size_t(i)] = 1;
  {
    LossMaskWriter w(dir_ / "tokens.bin", 0);
    w.write(flags);
    w.finish();
  }
  const std::span<const uint32_t> all(tokens_);
  write_llmc_tokens(dir_ / "s0.bin", all.subspan(0, 17), TokenWidth::u16);
  write_llmc_tokens(dir_ / "s2.bin", all.subspan(32, 17), TokenWidth::u16);
  const auto alone = eval_json(args + "--data '" + (dir_ / "s0.bin").string() + "," +
                               (dir_ / "s2.bin").string() + "'");
  const auto masked = eval_json(args + data());
  EXPECT_EQ(masked["tokens"], 32);
  EXPECT_EQ(alone["tokens"], 32);
  EXPECT_NEAR(masked["loss"].get<double>(), alone["loss"].get<double>(),
              1e-6 * alone["loss"].get<double>());
  EXPECT_NE(masked["loss"], whole["loss"]);
  const auto off = eval_json(args + "--loss-mask off " + data());
  EXPECT_EQ(off["loss"], whole["loss"]);
  EXPECT_EQ(off["tokens"], 80);

  // Sequence 1 alone counts nothing: refused, not a loss of 0.
  const Result none = eval(args + "--max-sequences 1 " + data());
  EXPECT_EQ(none.status, 0) << none.out;  // sequence 0 counts
  for (int64_t i = 1; i <= 16; ++i) flags[size_t(i)] = 0;
  {
    LossMaskWriter w(dir_ / "tokens.bin", 0);
    w.write(flags);
    w.finish();
  }
  const Result nothing = eval(args + "--max-sequences 1 " + data());
  EXPECT_NE(nothing.status, 0);
  EXPECT_NE(nothing.out.find("no target of the 1 sequences evaluated counts"), std::string::npos)
      << nothing.out;
  EXPECT_NE(nothing.out.find("--loss-mask off"), std::string::npos) << nothing.out;
  const Result bad = eval(args + "--loss-mask maybe " + data());
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("maybe"), std::string::npos) << bad.out;
}

// --packing none: each document is a row of its own, padded, so its loss is what the document
// alone gives: the mean over documents (cut after --seq-len + 1 tokens) of each one evaluated
// by itself as a file of exactly its tokens. A one-token document has no target and is left out.
// auto picks none only where a loss mask says the data are fine-tuning rows.
TEST_F(EvalCli, WithoutPackingEachDocumentScoresAsItDoesAlone) {
  {
    DocumentIndexWriter w(dir_ / "tokens.bin", 0);
    for (uint64_t at : {0, 10, 30, 31, 60}) w.add(at);
    w.finish({dir_ / "tokens.bin"});
  }
  const std::string args = "--seed 1 --seq-len 16 --batch 3 ";
  const auto rows = eval_json(args + "--packing none " + data());
  EXPECT_EQ(rows["packing"], "none");
  double sum = 0;
  int64_t count = 0;
  const std::span<const uint32_t> all(tokens_);
  for (const auto& [a, b] :
       std::vector<std::pair<size_t, size_t>>{{0, 10}, {10, 30}, {31, 60}, {60, 81}}) {
    const size_t n = std::min<size_t>(b - a, 17);
    const fs::path f = dir_ / fmt::format("doc{}.bin", a);
    write_llmc_tokens(f, all.subspan(a, n), TokenWidth::u16);
    const auto alone =
        eval_json(fmt::format("--seed 1 --seq-len {} --data '{}'", n - 1, f.string()));
    ASSERT_EQ(alone["tokens"], n - 1);
    sum += alone["loss"].get<double>() * static_cast<double>(n - 1);
    count += static_cast<int64_t>(n - 1);
  }
  EXPECT_EQ(rows["tokens"], count);
  EXPECT_EQ(count, 9 + 16 + 16 + 16);
  EXPECT_NEAR(rows["loss"].get<double>(), sum / static_cast<double>(count), 1e-5 * sum / count);
  // bfd packs the same documents whole into rows, each attending to itself alone: at --seq-len
  // 16 they take 9, 16, 16 and 16 positions, a row each; at 30, 9, 19, 28 and 20, and the 9
  // goes in beside the 20 (the least room that holds it): 3 rows. The loss is none's.
  for (const int64_t T : {16, 30}) {
    const std::string at = fmt::format("--seed 1 --batch 3 --seq-len {} ", T);
    const auto one = eval_json(at + "--packing none " + data());
    const auto packed = eval_json(at + "--packing bfd " + data());
    EXPECT_EQ(packed["packing"], "bfd");
    EXPECT_EQ(packed["sequences"], T == 16 ? 4 : 3);
    EXPECT_EQ(packed["tokens"], T == 16 ? count : 9 + 19 + 28 + 20);
    EXPECT_EQ(packed["tokens"], one["tokens"]);
    EXPECT_NEAR(packed["loss"].get<double>(), one["loss"].get<double>(),
                1e-5 * one["loss"].get<double>());
  }
  const auto wrapped = eval_json(args + "--packing wrapped " + data());
  EXPECT_EQ(wrapped["tokens"], 80);
  EXPECT_NE(wrapped["loss"], rows["loss"]);
  EXPECT_EQ(eval_json(args + data())["packing"], "wrapped");  // no loss mask: not fine-tuning rows
  const Result text = eval(args + "--packing none " + data());
  EXPECT_NE(text.out.find("4 documents, one per sequence (--packing none); 3 cut after "
                          "--seq-len + 1 = 17 tokens"),
            std::string::npos)
      << text.out;
  {
    LossMaskWriter w(dir_ / "tokens.bin", 0);
    w.write_ones(tokens_.size());
    w.finish();
  }
  EXPECT_EQ(eval_json(args + data())["loss"], rows["loss"]);  // auto: none
  fs::remove(document_index_path(dir_ / "tokens.bin"));
  EXPECT_EQ(eval_json(args + data())["packing"], "wrapped");
  const Result missing = eval(args + "--packing none " + data());
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.out.find("no document index (tokens.bin.docs)"), std::string::npos)
      << missing.out;
}

// ZeRO-3 over several host devices: sequences dealt to ranks, the units sharded (or, under the
// persistence threshold, replicated); the loss is the one device's to f32 rounding.
TEST_F(EvalCli, SeveralDevicesGiveTheOneDeviceLoss) {
  const std::string args = "--seed 1 --seq-len 16 " + data();
  for (const char* batch : {" --batch 1", " --batch 2"}) {
    const auto one = eval_json(args + batch);
    const double loss = one["loss"].get<double>();
    for (const char* devices : {"host:2", "host:3", "host:4"})
      for (const char* threshold : {" --persistence-threshold 0", ""}) {
        SCOPED_TRACE(std::string(devices) + batch + threshold);
        const auto j = eval_json(args + batch + threshold, devices);
        EXPECT_NEAR(j["loss"].get<double>(), loss, 1e-6 * loss);
        EXPECT_EQ(j["tokens"], one["tokens"]);
        EXPECT_EQ(j["devices"].size(), static_cast<size_t>(devices[5] - '0'));
      }
  }
  // Fewer sequences than devices: the idle device still takes part in every gather.
  const auto two = eval_json(args + " --max-sequences 2");
  const auto three = eval_json(args + " --max-sequences 2 --persistence-threshold 0", "host:3");
  EXPECT_EQ(three["tokens"], 32);
  EXPECT_NEAR(three["loss"].get<double>(), two["loss"].get<double>(),
              1e-6 * two["loss"].get<double>());
  EXPECT_EQ(three["device"], "host:0,host:1,host:2");
}

// The parameters in host RAM or on NVMe (the executor fetching each unit ahead of its use) give
// the loss of parameters on the devices bit for bit, on one device and on three.
TEST_F(EvalCli, OffloadedParametersGiveTheSameLoss) {
  const std::string args = "--seed 1 --seq-len 16 --batch 2 --persistence-threshold 0 " + data();
  const std::string nvme = " --nvme-path '" + (dir_ / "swap").string() + "'";
  for (const char* devices : {"host", "host:3"}) {
    SCOPED_TRACE(devices);
    const auto base = eval_json(args, devices);
    const int units = base["parameter_homes"]["gpu"].get<int>();
    EXPECT_GE(units, 4) << base;  // embedding, two blocks, final norm + head
    for (const std::string tier : {"cpu", "nvme"}) {
      SCOPED_TRACE(tier);
      const auto j =
          eval_json(args + " --offload-param " + tier + (tier == "nvme" ? nvme : ""), devices);
      EXPECT_EQ(j["loss"].get<double>(), base["loss"].get<double>());
      EXPECT_EQ(j["tokens"], base["tokens"]);
      EXPECT_EQ(j["parameter_homes"][tier].get<int>(), units) << j;
      EXPECT_EQ(j["parameter_homes"]["gpu"].get<int>(), 0) << j;
      // Only parameters: no gradients or optimizer state in any tier.
      for (const char* t : {"gpu_per_device", "cpu", "nvme"}) {
        EXPECT_EQ(j["memory"][t]["gradients"].get<uint64_t>(), 0u) << t;
        EXPECT_EQ(j["memory"][t]["optimizer"].get<uint64_t>(), 0u) << t;
      }
      EXPECT_GT(j["memory"][tier]["parameters"].get<uint64_t>(), 0u) << j;
      EXPECT_LT(j["memory"]["gpu_per_device"]["total"].get<uint64_t>(),
                base["memory"]["gpu_per_device"]["total"].get<uint64_t>());
    }
  }
  // The swap files (and their lock) go with the run.
  ASSERT_TRUE(fs::is_directory(dir_ / "swap"));
  EXPECT_TRUE(fs::is_empty(dir_ / "swap"));

  // The DeepSpeed config's offload_param is read as `strata train` reads it; the flag wins.
  // The optimizer's section is a training run's business: its swap directory is not made.
  {
    std::ofstream f(dir_ / "ds.json");
    f << R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},)"
      << R"( "offload_optimizer": {"device": "nvme", "nvme_path": ")"
      << (dir_ / "optimizer-swap").string() << R"("}}})";
  }
  const std::string cfg = " --config '" + (dir_ / "ds.json").string() + "'";
  const auto from_config = eval_json(args + cfg);
  EXPECT_GE(from_config["parameter_homes"]["cpu"].get<int>(), 4) << from_config;
  EXPECT_EQ(eval_json(args + cfg + " --offload-param none")["parameter_homes"]["cpu"], 0);
  EXPECT_FALSE(fs::exists(dir_ / "optimizer-swap"));
}

// The same on a GPU (bf16): parameters on the device, in pinned host RAM and on NVMe give one
// loss bit for bit, near the host backend's f32 loss.
TEST_F(EvalCli, OnAGpuOffloadedParametersGiveTheSameLoss) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const std::string args = "--seed 1 --seq-len 16 --batch 2 --persistence-threshold 0 " + data();
  const double host = eval_json(args)["loss"].get<double>();
  const auto base = eval_json(args, "cuda:0");
  EXPECT_EQ(base["dtype"], "bf16");
  EXPECT_NEAR(base["loss"].get<double>(), host, 2e-2 * host);
  const std::string nvme = " --nvme-path '" + (dir_ / "swap").string() + "'";
  for (const std::string tier : {"cpu", "nvme"}) {
    SCOPED_TRACE(tier);
    const auto j =
        eval_json(args + " --offload-param " + tier + (tier == "nvme" ? nvme : ""), "cuda:0");
    EXPECT_EQ(j["loss"].get<double>(), base["loss"].get<double>());
    EXPECT_EQ(j["parameter_homes"]["gpu"].get<int>(), 0) << j;
  }
}

// Documents packed into sequences on the GPU: the attention kernels keep each document to
// itself, so --packing bfd gives --packing none's loss (one document per row) to bf16 rounding,
// and both the host's.
TEST_F(EvalCli, OnAGpuPackedDocumentsScoreAsEachAlone) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  {
    DocumentIndexWriter w(dir_ / "tokens.bin", 0);
    for (uint64_t at : {0, 10, 30, 31, 60, 70}) w.add(at);
    w.finish({dir_ / "tokens.bin"});
  }
  const std::string args = "--seed 1 --seq-len 24 --batch 3 " + data();
  const double host = eval_json(args + " --packing none")["loss"].get<double>();
  const auto none = eval_json(args + " --packing none", "cuda:0");
  const auto bfd = eval_json(args + " --packing bfd", "cuda:0");
  EXPECT_LT(bfd["sequences"].get<int>(), none["sequences"].get<int>());
  EXPECT_EQ(bfd["tokens"], none["tokens"]);
  EXPECT_NEAR(none["loss"].get<double>(), host, 2e-2 * host);
  EXPECT_NEAR(bfd["loss"].get<double>(), none["loss"].get<double>(), 5e-3 * host);
}

// A model whose parameters do not fit is refused before anything is allocated, with the table
// of bytes and what to change; offloading makes the same evaluation fit.
TEST_F(EvalCli, AModelThatDoesNotFitIsRefusedBeforeItStarts) {
  const std::string run = std::string("'") + STRATA_BINARY +
                          "' eval --model llama2-7b --init random --devices host --seq-len 16 " +
                          data() + " --device-memory 4GiB";
  Result r = test::run_command(run + " 2>&1");
  EXPECT_EQ(r.status, 1) << r.out;
  for (const char* what : {"placement does not fit", "llama2-7b", "gpu (per device)", "4 GiB",
                           "nothing was allocated", "--offload-param cpu or nvme"})
    EXPECT_NE(r.out.find(what), std::string::npos) << what << "\n" << r.out;
  EXPECT_EQ(r.out.find("offload the optimizer"), std::string::npos) << r.out;

  // Parameters in host RAM, but not enough of it: the cpu row, and NVMe as the way out.
  r = test::run_command(run + " --offload-param cpu --cpu-memory 2GiB 2>&1");
  EXPECT_EQ(r.status, 1) << r.out;
  for (const char* what : {"placement does not fit", "cpu", "--offload-param nvme"})
    EXPECT_NE(r.out.find(what), std::string::npos) << what << "\n" << r.out;

  // A bad tier or prefetch depth is named.
  r = eval("--seq-len 16 " + data() + " --offload-param disk");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("disk"), std::string::npos) << r.out;
  r = eval("--seq-len 16 " + data() + " --prefetch-depth 99");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--prefetch-depth 99"), std::string::npos) << r.out;
  r = eval("--seq-len 16 " + data() + " --offload-param nvme");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--nvme-path"), std::string::npos) << r.out;
}

TEST_F(EvalCli, BadInputsAreNamed) {
  // A token id past the vocabulary names its position.
  std::vector<uint32_t> bad = tokens_;
  bad[40] = 600;
  write_llmc_tokens(dir_ / "bad.bin", bad, TokenWidth::u16);
  Result r = eval("--seq-len 16 --data '" + (dir_ / "bad.bin").string() + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("600"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("40"), std::string::npos) << r.out;

  // Too few tokens for one sequence.
  r = eval("--seq-len 100 " + data());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--seq-len 100"), std::string::npos) << r.out;

  // Past the model's positions.
  r = eval("--seq-len 100000 " + data());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("max_position_embeddings"), std::string::npos) << r.out;

  // A preset has no weights unless asked to initialise.
  r = test::run_command(std::string("'") + STRATA_BINARY + "' eval --model tiny --devices host " +
                        data() + " 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--init random"), std::string::npos) << r.out;

  // Neither a preset nor a directory: the presets are listed.
  r = test::run_command(std::string("'") + STRATA_BINARY + "' eval --model no-such-model " +
                        data() + " 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("no-such-model"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("llama3-8b"), std::string::npos) << r.out;

  // A missing data file.
  r = eval("--data '" + (dir_ / "missing.bin").string() + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("missing.bin"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// `strata bench model` verifies against the host backend, then reports its figures.
// Activation checkpointing off runs (and verifies) the blocks keeping their activations.
TEST(BenchModelCli, VerifiesThenReports) {
  for (const char* dtype : {"f32", "bf16"})
    for (const char* checkpointing : {"on", "off"}) {
      const test::CommandResult r = test::run_command(
          std::string("'") + STRATA_BINARY +
          "' bench model --model tiny --devices host --seq-len 16 --batch 2 --steps 1 --dtype " +
          dtype + " --activation-checkpointing " + checkpointing + " --peak-tflops 1 --json 2>&1");
      ASSERT_EQ(r.status, 0) << r.out;
      const auto j = nlohmann::json::parse(r.out, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << r.out;
      EXPECT_TRUE(j["verified"].get<bool>());
      EXPECT_EQ(j["dtype"], dtype);
      EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
      EXPECT_GT(j["model_tflops"].get<double>(), 0.0);
      EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), j["model_tflops"].get<double>());
      EXPECT_EQ(j["activation_checkpointing"], std::string(checkpointing) == "on");
    }
}

test::CommandResult bench_attention(const std::string& args) {
  return test::run_command(std::string("'") + STRATA_BINARY + "' bench attention " + args +
                           " 2>&1");
}

// `strata bench attention` verifies against the host backend in f32, then reports its figures.
TEST(BenchAttentionCli, VerifiesThenReports) {
  for (const char* dtype : {"f32", "bf16"}) {
    const test::CommandResult r = bench_attention(
        std::string("--devices host --seq-len 70 --heads 4 --kv-heads 2 --head-dim 24 --steps 1 "
                    "--json --dtype ") +
        dtype);
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.out;
    EXPECT_TRUE(j["verified"].get<bool>());
    EXPECT_EQ(j["dtype"], dtype);
    EXPECT_DOUBLE_EQ(j["forward_flops"].get<double>(), 2.0 * 4 * 24 * 70 * 70);
    ASSERT_EQ(j["runs"].size(), 1u) << r.out;
    EXPECT_EQ(j["runs"][0]["kernels"], "host");
    EXPECT_GT(j["runs"][0]["forward_tflops"].get<double>(), 0.0);
    EXPECT_GT(j["runs"][0]["backward_tflops"].get<double>(), 0.0);
  }
}

// `strata bench attention ARGS --json`, which must succeed and report its kernels verified; an
// empty object (failing the caller's checks) where it did not.
nlohmann::json bench_attention_json(const std::string& args) {
  const test::CommandResult r = bench_attention(args + " --json");
  EXPECT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object()) << r.out;
  if (!j.is_object()) return nlohmann::json::object();
  EXPECT_TRUE(j.value("verified", false)) << r.out;
  return j;
}

// Gemma 2's scores, scaled and capped: verified against the host backend's with the same mask.
TEST(BenchAttentionCli, ScaledAndCappedScores) {
  const auto j = bench_attention_json(
      "--devices host --seq-len 40 --heads 2 --kv-heads 1 --head-dim 32 --steps 1 --scale 0.25 "
      "--softcap 1.5");
  EXPECT_DOUBLE_EQ(j.value("scale", 0.0), 0.25);
  EXPECT_DOUBLE_EQ(j.value("softcap", 0.0), 1.5);
  const test::CommandResult text = bench_attention(
      "--devices host --seq-len 20 --heads 2 --kv-heads 1 --head-dim 16 --steps 1 --softcap 2");
  ASSERT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("head_dim 16, softcap 2, f32"), std::string::npos) << text.out;
}

TEST(BenchAttentionCli, BadShapesAreNamed) {
  test::CommandResult r = bench_attention("--devices host --heads 6 --kv-heads 4");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--heads 6 is not a multiple of --kv-heads 4"), std::string::npos) << r.out;
  r = bench_attention("--devices host --seq-len 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--seq-len 0"), std::string::npos) << r.out;
  r = bench_attention("--devices host --softcap -1");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--softcap -1 must be finite and at least 0"), std::string::npos) << r.out;
}

// On a GPU in bf16: both tensor-core paths and the SIMT kernels, each verified, side by side.
TEST(BenchAttentionCli, OnAGpuTensorCoresBesideSimt) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const auto j = bench_attention_json(
      "--devices cuda:0 --seq-len 130 --heads 4 --kv-heads 1 --head-dim 32 --steps 1");
  EXPECT_EQ(j.value("dtype", ""), "bf16");
  ASSERT_EQ(j.value("runs", nlohmann::json::array()).size(), 3u) << j.dump();
  EXPECT_EQ(j["runs"][0]["kernels"], "mma.sync");
  EXPECT_EQ(j["runs"][1]["kernels"], "wmma");
  EXPECT_EQ(j["runs"][2]["kernels"], "SIMT");
}

// Gemma's head_dim 256 with capped scores: mma.sync beside SIMT (wmma takes neither), each run
// named by the kernels that took its calls.
TEST(BenchAttentionCli, OnAGpuGemmasAttentionOnTensorCores) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const auto j = bench_attention_json(
      "--devices cuda:0 --seq-len 70 --heads 4 --kv-heads 2 --head-dim 256 --steps 1 --scale "
      "0.0625 --softcap 1");
  ASSERT_EQ(j.value("runs", nlohmann::json::array()).size(), 2u) << j.dump();
  EXPECT_EQ(j["runs"][0]["kernels"], "mma.sync");
  EXPECT_EQ(j["runs"][1]["kernels"], "SIMT");
}

test::CommandResult bench_ops(const std::string& args) {
  return test::run_command(std::string("'") + STRATA_BINARY + "' bench ops " + args + " 2>&1");
}

// The figures of `strata bench ops --json` for the tiny model at 2 x 40 tokens: every op of the
// block listed once, each rate what its FLOPs and time give, the block the sum of its ops.
void expect_ops_report(const nlohmann::json& j) {
  EXPECT_TRUE(j["verified"].get<bool>());
  EXPECT_EQ(j["model"], "tiny");
  const auto& ops = j["ops"];
  ASSERT_EQ(ops.size(), 25u) << j.dump();  // square, 5 x 3 matmuls, 2 attention, 7 memory-bound
  EXPECT_EQ(ops[0]["op"], "square matmul (peak)");
  EXPECT_DOUBLE_EQ(ops[0]["of_peak"].get<double>(), 1.0);
  double block = 0, flops = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& o = ops[i];
    SCOPED_TRACE(o.dump());
    const double s = o["seconds"].get<double>();
    ASSERT_GT(s, 0.0);
    if (o["op"] == "q_proj forward") {  // 2 m n k at m 80, n = k = 64
      EXPECT_NEAR(o["tflops"].get<double>() * 1e12 * s, 2.0 * 80 * 64 * 64, 1e-3);
      EXPECT_EQ(o["shape"], "m 80 n 64 k 64");
    }
    if (o["op"] == "attention backward") {
      EXPECT_NEAR(o["tflops"].get<double>() * 1e12 * s, 2 * 2.0 * 2 * 4 * 16 * 40 * 40, 1e-3);
    }
    if (i == 0) continue;
    block += o["count"].get<int>() * s;
    if (o.contains("tflops")) flops += o["count"].get<int>() * o["tflops"].get<double>() * s;
  }
  EXPECT_NEAR(j["block_s"].get<double>(), block, 1e-9 * block);
  EXPECT_NEAR(
      j["matmul_s"].get<double>() + j["attention_s"].get<double>() + j["memory_s"].get<double>(),
      block, 1e-9 * block);
  EXPECT_NEAR(j["block_tflops"].get<double>(), flops / block, 1e-6 * flops / block);
}

// `strata bench ops` runs every op of a block on the host backend, verified, and reports each.
TEST(BenchOpsCli, VerifiesThenReportsEveryOp) {
  const test::CommandResult r =
      bench_ops("--devices host --model tiny --seq-len 40 --batch 2 --square 64 --steps 1 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  expect_ops_report(j);
  EXPECT_EQ(j["dtype"], "f32");

  const test::CommandResult text =
      bench_ops("--devices host --model tiny --seq-len 40 --square 64 --steps 1");
  ASSERT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("every op verified against the host backend"), std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("block forward+backward:"), std::string::npos) << text.out;
}

// A Qwen3 model with attention_bias adds its biases and its q and k norms to the list, each
// verified like the rest.
TEST(BenchOpsCli, ListsTheBiasesAndQkNormsOfTheModelsThatHaveThem) {
  const test::TempDir dir("strata-bench-ops-qwen3");
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::qwen3;
  c.qk_norm = c.qkv_bias = c.o_bias = true;
  std::ofstream(dir.path / "config.json") << to_hf_config_json(c).dump(2);
  const test::CommandResult r = bench_ops("--devices host --model " + dir.path.string() +
                                          " --seq-len 40 --square 64 --steps 1 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j["verified"].get<bool>());
  std::vector<std::string> names;
  for (const auto& o : j["ops"]) names.push_back(o["op"].get<std::string>());
  for (const char* want :
       {"q_proj bias", "q_proj bias grad", "k_proj v_proj bias", "o_proj bias grad",
        "q norm forward", "q norm backward", "k norm backward"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  EXPECT_EQ(std::find(names.begin(), names.end(), "gate_proj up_proj bias"), names.end());
  EXPECT_EQ(names.size(), 25u + 3 * 2 + 2 * 2);  // Llama's, three biases, two norms
}

// Gemma 2's block: GeGLU, four norms, attention with its scale and cap, each verified against the
// host backend before it is timed.
TEST(BenchOpsCli, Gemma2sBlockHasItsOwnOps) {
  const test::TempDir dir("strata-bench-ops-gemma2");
  LlamaConfig c = *find_preset("tiny");
  c.architecture = Architecture::gemma2;
  c.hidden_act = Activation::gelu_tanh;
  c.tie_word_embeddings = true;
  c.query_pre_attn_scalar = 20;
  c.attn_logit_softcapping = 1.0;  // small: the cap bends the scores
  c.final_logit_softcapping = 30;
  std::ofstream(dir.path / "config.json") << to_hf_config_json(c).dump(2);
  const test::CommandResult r = bench_ops("--devices host --model " + dir.path.string() +
                                          " --seq-len 40 --square 64 --steps 1 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j["verified"].get<bool>());
  std::map<std::string, int> count;
  for (const auto& o : j["ops"]) count[o["op"].get<std::string>()] = o["count"].get<int>();
  EXPECT_EQ(count.count("geglu forward"), 1u);
  EXPECT_EQ(count.count("geglu backward"), 1u);
  EXPECT_EQ(count.count("swiglu forward"), 0u);
  EXPECT_EQ(count["rmsnorm forward"], 4);
}

TEST(BenchOpsCli, BadInputIsNamed) {
  test::CommandResult r = bench_ops("--devices host --seq-len 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--seq-len 0"), std::string::npos) << r.out;
  r = bench_ops("--devices host --steps 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--steps 0 must be at least 1"), std::string::npos) << r.out;
  r = bench_ops("--devices host --model llama5-9b");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("llama5-9b"), std::string::npos) << r.out;
}

// On a GPU in bf16: every CUDA op verified against the host backend in f32, then timed.
TEST(BenchOpsCli, OnAGpuEveryOpVerified) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const test::CommandResult r = bench_ops(
      "--devices cuda:0 --model tiny --seq-len 40 --batch 2 --square 256 --steps 1 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["dtype"], "bf16");
  expect_ops_report(j);
}

}  // namespace
}  // namespace strata
