// test_plan_cli.cpp: `strata plan` and `strata estimate` as a user runs them: tiny and
// llama2-70b on hardware this machine does not have (answered within a second), a placement
// that does not fit (exit 1, the table on stderr), a DeepSpeed config, and the JSON forms.
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;
using Result = test::CommandResult;
using nlohmann::json;

Result strata(const std::string& args, const std::string& redirect = "2>&1") {
  return test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " " + redirect);
}

json parse_json(const Result& r) {
  EXPECT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

// A lane's predicted busy time in a plan's --json output.
double busy(const json& plan, const std::string& lane) {
  for (const json& l : plan["lanes"])
    if (l["lane"] == lane) return l["busy_s"].get<double>();
  ADD_FAILURE() << lane << " missing from " << plan["lanes"];
  return 0.0;
}

const std::string k70b =
    "plan --model llama2-70b --gpus 4 --gpu-memory 24GiB --cpu-memory 256GiB --nvme 2x3.5TB ";

TEST(PlanCli, TinyPrintsPlacementScheduleAndPrediction) {
  const Result r = strata(
      "plan --model tiny --gpu-memory 1GiB --cpu-memory 1GiB "
      "--offload-optimizer cpu --print-schedule");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* part :
       {"placement: model tiny", "optimizer", "pinned buffers: 5 x", "schedule:", "cpu.adam",
        "predicted step:", "tokens/s", "critical lane:", "assumed: H100", " adam u=0"})
    EXPECT_NE(r.out.find(part), std::string::npos) << "'" << part << "' missing from:\n" << r.out;
}

TEST(PlanCli, Llama2_70bOnHardwareThisMachineLacksAnswersWithinASecond) {
  const auto start = std::chrono::steady_clock::now();
  const Result r = strata(k70b +
                              "--offload-param nvme --offload-optimizer nvme --grad-dtype bf16 "
                              "--json",
                          "2>/dev/null");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 1.0);
  const json j = parse_json(r);
  EXPECT_EQ(j["model"], "llama2-70b");
  EXPECT_EQ(j["gpus"], 4);
  EXPECT_EQ(j["assumed"], true);
  EXPECT_EQ(j["budgets"]["nvme_free"].get<uint64_t>(), 7'000'000'000'000ull);
  // 69B parameters: bf16 P and 12-byte O on NVMe; bf16 gradients on the GPUs for the units
  // whose fit beside the rest, in host RAM for the others.
  const uint64_t n = 68'976'648'192ull;
  EXPECT_GE(j["memory"]["nvme"]["parameters"].get<uint64_t>(), 2 * n);
  EXPECT_GE(j["memory"]["nvme"]["optimizer"].get<uint64_t>(), 12 * n);
  const uint64_t g_gpu = j["memory"]["gpu"]["gradients"].get<uint64_t>();
  EXPECT_GT(g_gpu, 0u);
  EXPECT_GE(j["memory"]["cpu"]["gradients"].get<uint64_t>() + 4 * g_gpu, 2 * n);
  EXPECT_LT(4 * g_gpu, n);
  EXPECT_LE(j["memory"]["gpu"]["total"].get<uint64_t>(), 24ull << 30);
  EXPECT_GT(j["step_s"].get<double>(), 0.0);
  EXPECT_NEAR(j["tokens_per_s"].get<double>(), 4 * 4096 / j["step_s"].get<double>(), 1e-6);
  EXPECT_FALSE(j["critical_lane"].get<std::string>().empty());
  EXPECT_EQ(j["lanes"].size(), j["schedule"]["lanes"].get<size_t>());
}

TEST(PlanCli, APlacementThatDoesNotFitIsRefusedWithTheTable) {
  // The optimizer in 256 GiB of host RAM: 69B x (12 + 4 + 2) bytes does not fit.
  const Result r = strata(k70b + "--offload-param cpu --offload-optimizer cpu", "2>&1 >/dev/null");
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"does not fit", "needed", "available", "over by", "cpu", "256 GiB",
                           "--offload-optimizer nvme"})
    EXPECT_NE(r.out.find(part), std::string::npos) << "'" << part << "' missing from:\n" << r.out;
  // Nothing on stdout: no plan was printed for it.
  EXPECT_EQ(strata(k70b + "--offload-param cpu --offload-optimizer cpu", "2>/dev/null").out, "");
}

TEST(PlanCli, ReadsADeepSpeedConfigAndFlagsOverrideIt) {
  const fs::path dir =
      fs::temp_directory_path() / ("strata_plan_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path config = dir / "ds_config.json";
  std::ofstream(config) << R"({
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": "auto", "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")"
                        << dir.string() << R"(", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true},
      "reduce_bucket_size": 5e8},
    "wall_clock_breakdown": false})";
  const std::string base =
      "plan --model tiny --gpus 2 --gpu-memory 1GiB --cpu-memory 1GiB --config '" +
      config.string() + "' --persistence-threshold 0 --json";
  json j = parse_json(strata(base, "2>/dev/null"));
  EXPECT_EQ(j["micro_batch"], 2);
  EXPECT_EQ(j["grad_accum"], 4);  // 16 = 2 x 4 x 2 GPUs
  EXPECT_EQ(j["dtype"], "bf16");
  EXPECT_EQ(j["homes"][1]["param"], "cpu");
  EXPECT_EQ(j["homes"][1]["optimizer"], "nvme");
  EXPECT_GT(j["budgets"]["nvme_free"].get<uint64_t>(), 0u);  // the directory's free space
  EXPECT_EQ(j["ignored_config_keys"],
            json({"wall_clock_breakdown", "zero_optimization.reduce_bucket_size"}));
  // The ignored keys are listed once, on stderr.
  const Result err = strata(base, "2>&1 >/dev/null");
  EXPECT_NE(err.out.find("zero_optimization.reduce_bucket_size"), std::string::npos) << err.out;
  EXPECT_EQ(err.out.find("as stage 3"), std::string::npos) << err.out;

  j = parse_json(strata(base + " --offload-optimizer cpu --micro-batch 1", "2>/dev/null"));
  EXPECT_EQ(j["homes"][1]["optimizer"], "cpu");
  EXPECT_EQ(j["micro_batch"], 1);
  // Another ZeRO stage runs as stage 3, and says so.
  std::ofstream(config) << R"({"zero_optimization": {"stage": 2,
    "offload_optimizer": {"device": "cpu"}}})";
  const Result stage2 = strata(base, "2>&1 >/dev/null");
  EXPECT_EQ(stage2.status, 0) << stage2.out;
  EXPECT_NE(stage2.out.find("zero_optimization.stage is 2; strata runs every stage as stage 3"),
            std::string::npos)
      << stage2.out;
  // A wrong value in the config names its path.
  std::ofstream(config) << R"({"zero_optimization": {"offload_param": {"device": "tape"}}})";
  const Result bad = strata(base);
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("zero_optimization.offload_param.device"), std::string::npos) << bad.out;
  fs::remove_all(dir);
}

// A 7B model on one 80 GB GPU with the optimizer in host RAM and 8 micro-batches a step: by
// default the gradients sum on the GPU and cross PCIe once a step, where DeepSpeed's offload
// (--offload-gradients cpu) brings every micro-batch's to host RAM, 8 times the d2h traffic and
// 25 GB of f32 accumulators in RAM.
TEST(PlanCli, AnOffloadedOptimizersGradientsSumOnTheGpu) {
  const std::string args =
      "plan --model llama2-7b --gpus 1 --gpu-memory 80GB --cpu-memory 112GiB --seq-len 2048 "
      "--micro-batch 2 --grad-accum 8 --offload-optimizer cpu --activation-checkpointing off "
      "--json";
  const json gpu = parse_json(strata(args, "2>/dev/null"));
  const json cpu = parse_json(strata(args + " --offload-gradients cpu", "2>/dev/null"));
  for (const json& h : gpu["homes"]) EXPECT_EQ(h["grad"], "gpu") << h;
  for (const json& h : cpu["homes"]) EXPECT_EQ(h["grad"], "cpu") << h;
  const uint64_t n = 6'738'415'616ull;
  EXPECT_EQ(gpu["memory"]["cpu"]["gradients"].get<uint64_t>(), 0u);
  EXPECT_GE(gpu["memory"]["gpu"]["gradients"].get<uint64_t>(), 4 * n);
  EXPECT_GE(cpu["memory"]["cpu"]["gradients"].get<uint64_t>(), 4 * n);
  EXPECT_LE(gpu["memory"]["gpu"]["total"].get<uint64_t>(), 80'000'000'000ull);
  // One step's d2h: 8 x 27 GB with the accumulators in RAM, 27 GB with them on the GPU.
  EXPECT_LT(busy(gpu, "gpu[0].d2h") * 6, busy(cpu, "gpu[0].d2h"));
  EXPECT_EQ(cpu["critical_lane"], "gpu[0].d2h");
  EXPECT_EQ(gpu["critical_lane"], "gpu[0].compute");
  EXPECT_LT(gpu["step_s"].get<double>() * 1.5, cpu["step_s"].get<double>());
}

// Llama 3 70B on a workstation: 4 x 24 GiB GPUs and 128 GiB of RAM. Its f32 gradient
// accumulators alone (259 GiB) cannot live in host RAM: asked to, the plan is refused naming
// NVMe; by default (auto) the last units' sum on NVMe, as ZeRO-Infinity swaps them, and the plan
// fits, with the traffic that costs on the drives predicted.
TEST(PlanCli, A70bModelsGradientsGoToNvmeWhereRamIsShort) {
  const std::string args =
      "plan --model llama3-70b --gpus 4 --gpu-memory 24GiB --cpu-memory 128GiB --nvme 2x3.5TB "
      "--offload-param auto --offload-optimizer auto --json";
  const json fit = parse_json(strata(args, "2>/dev/null"));
  int on_nvme = 0;
  std::string last_home;
  for (const json& h : fit["homes"]) {
    on_nvme += h["grad"] == "nvme" ? 1 : 0;
    last_home = h["grad"];
  }
  EXPECT_GT(on_nvme, 40) << fit["homes"];
  EXPECT_EQ(last_home, "nvme");  // the last units first
  EXPECT_LE(fit["memory"]["cpu"]["total"].get<uint64_t>(), 128ull << 30);
  EXPECT_GT(fit["memory"]["nvme"]["gradients"].get<uint64_t>(), 100ull << 30);
  EXPECT_GT(fit["step_s"].get<double>(), 0.0);
  EXPECT_EQ(fit["critical_lane"], "nvme.write");
  // Every offloaded unit's on NVMe when asked; the plan fits, the drives busier.
  const json all = parse_json(strata(args + " --offload-gradients nvme", "2>/dev/null"));
  for (const json& h : all["homes"]) {
    if (h["optimizer"] != "gpu") {
      EXPECT_EQ(h["grad"], "nvme") << h;
    }
  }
  EXPECT_GE(busy(all, "nvme.write"), busy(fit, "nvme.write"));
  const Result refused = strata(
      "plan --model llama3-70b --gpus 4 --gpu-memory 24GiB --cpu-memory 128GiB --nvme 2x3.5TB "
      "--offload-param auto --offload-optimizer auto --offload-gradients cpu");
  EXPECT_NE(refused.status, 0);
  for (const char* part : {"cpu: gradients", "--offload-gradients nvme", "--grad-dtype bf16"})
    EXPECT_NE(refused.out.find(part), std::string::npos) << part << " missing from " << refused.out;
}

// Parameters on NVMe and 8 micro-batches: in one group of 8 each unit is read once for the
// forwards and once for the backwards instead of 8 times each, for 8 micro-batches'
// activations on the GPU, which the plan counts.
TEST(PlanCli, MicroBatchGroupsReadEachUnitOncePerGroup) {
  const std::string args =
      "plan --model llama2-13b --gpus 1 --gpu-memory 80GB --cpu-memory 128GiB --nvme 1x3.5TB "
      "--seq-len 2048 --micro-batch 2 --grad-accum 8 --offload-param nvme --offload-optimizer "
      "nvme --json";
  const json one = parse_json(strata(args, "2>/dev/null"));
  const json eight = parse_json(strata(args + " --micro-batch-group 8", "2>/dev/null"));
  EXPECT_EQ(one["micro_batch_group"], 1);
  EXPECT_EQ(eight["micro_batch_group"], 8);
  EXPECT_LT(busy(eight, "gpu[0].h2d") * 6, busy(one, "gpu[0].h2d"));
  EXPECT_LT(busy(eight, "nvme.read"), busy(one, "nvme.read"));
  EXPECT_LT(eight["step_s"].get<double>() * 1.3, one["step_s"].get<double>());
  const uint64_t act1 = one["memory"]["gpu"]["activations"].get<uint64_t>();
  const uint64_t act8 = eight["memory"]["gpu"]["activations"].get<uint64_t>();
  // 41 checkpoints (40 blocks and the head's input) of 2 x 2048 x 5120 bf16 per micro-batch.
  EXPECT_GE(act8 - act1, 7ull * 41 * 2 * 2048 * 5120 * 2);
  // A group larger than the step, or of none, is refused naming the flag.
  Result r = strata(args + " --micro-batch-group 9");
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"--micro-batch-group 9", "8 micro-batch", "--grad-accum"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  r = strata(args + " --micro-batch-group 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("--micro-batch-group 0"), std::string::npos) << r.out;
  // estimate counts the group's activations too.
  const json e1 =
      parse_json(strata("estimate --model llama2-13b --seq-len 2048 --micro-batch 2 "
                        "--json",
                        "2>/dev/null"));
  const json e8 =
      parse_json(strata("estimate --model llama2-13b --seq-len 2048 --micro-batch 2 "
                        "--micro-batch-group 8 --json",
                        "2>/dev/null"));
  EXPECT_EQ(e8[0]["gpu_per_device"]["activations"].get<uint64_t>() -
                e1[0]["gpu_per_device"]["activations"].get<uint64_t>(),
            act8 - act1);
}

// `strata plan args --json` without and with `flag`, whose JSON field `key` must say which.
std::pair<json, json> plan_without_and_with(const std::string& args, const std::string& flag,
                                            const char* key) {
  std::pair<json, json> out{parse_json(strata(args, "2>/dev/null")),
                            parse_json(strata(args + " " + flag, "2>/dev/null"))};
  EXPECT_EQ(out.first[key], false);
  EXPECT_EQ(out.second[key], true);
  return out;
}

TEST(PlanCli, UpdatingDuringTheBackwardHidesCpuAdam) {
  // llama2-7b in bf16, optimizer on the CPU, one group of 4 micro-batches: updating during the
  // backward overlaps CPU Adam with it, the same work in a shorter step.
  const std::string args =
      "plan --model llama2-7b --dtype bf16 --gpus 1 --gpu-memory 80GB --cpu-memory 256GiB "
      "--seq-len 2048 --micro-batch 2 --grad-accum 4 --micro-batch-group 4 --offload-optimizer "
      "cpu --json";
  const auto [after, during] =
      plan_without_and_with(args, "--update-during-backward on", "update_during_backward");
  for (const char* lane : {"cpu.adam", "gpu[0].compute"})  // summed in another order
    EXPECT_NEAR(busy(during, lane), busy(after, lane), 1e-9 * busy(after, lane)) << lane;
  EXPECT_LT(during["step_s"].get<double>() * 1.2, after["step_s"].get<double>());
  // Clipping (from the config) and fp16 need every gradient before any update: refused.
  const test::TempDir dir("strata-plan-udb");
  const fs::path config = dir.path / "ds_config.json";
  std::ofstream(config) << R"({"gradient_clipping": 1.0})";
  Result r = strata(args + " --update-during-backward on --config '" + config.string() + "'");
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"gradient_clipping", "--update-during-backward off"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  r = strata(
      "plan --model llama2-7b --dtype f16 --gpus 1 --gpu-memory 80GB --cpu-memory 256GiB "
      "--offload-optimizer cpu --update-during-backward on");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("fp16"), std::string::npos) << r.out;
}

TEST(PlanCli, ReducingOncePerGroupUnloadsTheLinksBetweenGpus) {
  // llama2-13b on 4 GPUs with P and O on the CPU, 4 micro-batches in one group: the comm lanes,
  // the busiest, reduce-scatter the f32 gradients once per group instead of once per
  // micro-batch, and the step gets shorter.
  const std::string args =
      "plan --model llama2-13b --dtype bf16 --gpus 4 --gpu-memory 48GiB --cpu-memory 512GiB "
      "--seq-len 4096 --micro-batch 1 --grad-accum 4 --micro-batch-group 4 --offload-param cpu "
      "--offload-optimizer cpu --json";
  const auto [each, once] =
      plan_without_and_with(args, "--reduce-per-group on", "reduce_per_group");
  EXPECT_EQ(each["critical_lane"], "gpu[0].comm");
  EXPECT_LT(busy(once, "gpu[0].comm") * 2, busy(each, "gpu[0].comm"));
  EXPECT_LT(once["step_s"].get<double>() * 1.5, each["step_s"].get<double>());
  const Result r = strata(args.substr(0, args.size() - 7) + " --reduce-per-group sometimes");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("sometimes"), std::string::npos) << r.out;
}

// Activation checkpoints in host RAM (--offload-activations cpu, DeepSpeed's
// activation_checkpointing.cpu_checkpointing): llama3-70b at 8192 tokens on 4 x 24 GiB GPUs
// does not fit with them on the GPUs, the refusal says how much offloading them frees, and with
// them offloaded it fits. On 80 GB the GPU keeps a ring of 2 block inputs instead of all 80 (and
// the head's): 79 fewer of [8192, 8192] bf16, each of the 4 ranks' 79 in host RAM, copied out
// and back over the GPU's PCIe lanes once a micro-batch.
TEST(PlanCli, OffloadedActivationCheckpointsFit70bAt8kTokensOn24GiB) {
  const std::string args =
      "plan --model llama3-70b --gpus 4 --cpu-memory 1TiB --nvme 2x3.5TB --seq-len 8192 "
      "--offload-param cpu --offload-optimizer nvme ";
  const Result refused = strata(args + "--gpu-memory 24GiB", "2>&1 >/dev/null");
  EXPECT_EQ(refused.status, 1);
  for (const char* part : {"does not fit", "--offload-activations cpu", "frees 9.88 GiB"})
    EXPECT_NE(refused.out.find(part), std::string::npos) << part << " missing from " << refused.out;
  const json fits = parse_json(
      strata(args + "--gpu-memory 24GiB --offload-activations cpu --json", "2>/dev/null"));
  EXPECT_EQ(fits["offload_activations"], true);
  EXPECT_LE(fits["memory"]["gpu"]["total"].get<uint64_t>(), 24ull << 30);
  const auto [kept, off] = plan_without_and_with(
      args + "--gpu-memory 80GB --json", "--offload-activations cpu", "offload_activations");
  const uint64_t one = 8192ull * 8192 * 2;
  EXPECT_EQ(kept["memory"]["gpu"]["activations"].get<uint64_t>() -
                off["memory"]["gpu"]["activations"].get<uint64_t>(),
            79 * one);
  EXPECT_EQ(off["memory"]["cpu"]["activations"].get<uint64_t>(), 4 * 79 * one);
  EXPECT_EQ(kept["memory"]["cpu"]["activations"], 0);
  EXPECT_GT(busy(off, "gpu[0].d2h"), busy(kept, "gpu[0].d2h") + 79 * one / 100e9);
  // From a DeepSpeed config, and the flag over it.
  const test::TempDir dir("strata-plan-act");
  const fs::path config = dir.path / "ds.json";
  std::ofstream(config) << R"({"activation_checkpointing": {"partition_activations": true,
    "cpu_checkpointing": true, "contiguous_memory_optimization": false}})";
  const std::string from_config =
      args + "--gpu-memory 80GB --json --config '" + config.string() + "'";
  json j = parse_json(strata(from_config, "2>/dev/null"));
  EXPECT_EQ(j["offload_activations"], true);
  EXPECT_EQ(j["memory"]["cpu"]["activations"], off["memory"]["cpu"]["activations"]);
  EXPECT_EQ(j["ignored_config_keys"],
            json({"activation_checkpointing.contiguous_memory_optimization",
                  "activation_checkpointing.partition_activations"}));
  j = parse_json(strata(from_config + " --offload-activations none", "2>/dev/null"));
  EXPECT_EQ(j["offload_activations"], false);
  // Without recompute there are no checkpoints to offload; an unknown tier is named.
  Result r =
      strata(args + "--gpu-memory 80GB --offload-activations cpu --activation-checkpointing off");
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"--offload-activations", "--activation-checkpointing on"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  r = strata(args + "--gpu-memory 80GB --offload-activations disk");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("--offload-activations disk"), std::string::npos) << r.out;
  // estimate counts them in host RAM for every option.
  const json e = parse_json(
      strata("estimate --model llama3-70b --gpus 4 --seq-len 8192 --offload-activations cpu --json",
             "2>/dev/null"));
  for (const json& row : e)
    EXPECT_EQ(row["cpu"]["activations"], off["memory"]["cpu"]["activations"]);
}

TEST(PlanCli, BadFlagsAreNamed) {
  Result r = strata("plan --model tiny --gpu-memory 1GiB --offload-param disk");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("--offload-param disk"), std::string::npos) << r.out;
  r = strata("plan --model tiny --gpu-memory 1GiB --nvme 2xlots");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("lots"), std::string::npos) << r.out;
  r = strata("plan --model tiny --gpu-memory 1GiB --offload-optimizer nvme");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("nvme_path"), std::string::npos) << r.out;
  r = strata("plan --model tiny --gpu-memory 1GiB --offload-optimizer cpu --offload-gradients ssd");
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"--offload-gradients ssd", "auto", "none", "cpu"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  // A negative depth is named, not taken for "not given"; no budget of 0 bytes.
  for (const auto& [args, parts] :
       {std::pair{"--prefetch-depth -5", std::vector<std::string>{"--prefetch-depth -5", "0..64"}},
        std::pair{"--prefetch-depth 65", std::vector<std::string>{"--prefetch-depth 65", "0..64"}},
        std::pair{"--cpu-memory 0", std::vector<std::string>{"--cpu-memory 0", "give a size"}},
        std::pair{"--pinned-memory 0",
                  std::vector<std::string>{"--pinned-memory 0", "give a size"}}}) {
    r = strata(std::string("plan --model tiny --gpu-memory 1GiB ") + args);
    EXPECT_EQ(r.status, 1) << args;
    for (const std::string& part : parts)
      EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
  }
}

// Lion and Adagrad keep one moment beside the master, 8 bytes a parameter where Adam keeps 12:
// the plan sizes host RAM and NVMe for that, from --optimizer or a config's optimizer.type
// alike, and so does the estimate, which names the optimizer.
TEST(PlanCli, LionAndAdagradNeedTwoThirdsOfAdamsOptimizerState) {
  const test::TempDir dir("strata-plan-lion");
  const std::string config = (dir.path / "lion.json").string();
  std::ofstream(config) << R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})";
  const std::string args =
      "plan --model llama2-7b --gpus 1 --gpu-memory 80GB --cpu-memory 200GiB --seq-len 2048 "
      "--offload-optimizer cpu --json";
  const json adam = parse_json(strata(args, "2>/dev/null"));
  const json lion = parse_json(strata(args + " --optimizer lion", "2>/dev/null"));
  const json from_config = parse_json(strata(args + " --config " + config, "2>/dev/null"));
  const json adagrad = parse_json(strata(args + " --optimizer adagrad", "2>/dev/null"));
  const uint64_t a = adam["memory"]["cpu"]["optimizer"].get<uint64_t>();
  const uint64_t n = 6'738'415'616ull;
  EXPECT_GE(a, 12 * n);
  EXPECT_EQ(lion["memory"]["cpu"]["optimizer"].get<uint64_t>() * 3, a * 2);
  EXPECT_EQ(from_config["memory"]["cpu"]["optimizer"], lion["memory"]["cpu"]["optimizer"]);
  EXPECT_EQ(adagrad["memory"]["cpu"]["optimizer"], lion["memory"]["cpu"]["optimizer"]);
  // The CPU optimizer's time: the assumed rate is Adam's, and the update is memory-bound, so
  // Lion's takes its bytes a parameter over Adam's: (4 + 16 + 2) / (4 + 24 + 2) of the update.
  const double update_share = busy(lion, "cpu.adam") / busy(adam, "cpu.adam");
  EXPECT_LT(update_share, 0.9) << lion["lanes"];
  EXPECT_GE(update_share, 22.0 / 30.0 - 1e-3) << lion["lanes"];
  // On NVMe (each shard rounded up to the stripe): two thirds, to that rounding.
  const std::string nvme =
      "plan --model llama2-7b --gpus 1 --gpu-memory 80GB --cpu-memory 200GiB --nvme 1x3.5TB "
      "--seq-len 2048 --offload-optimizer nvme --json";
  const double adam_nvme = parse_json(strata(nvme, "2>/dev/null"))["memory"]["nvme"]["optimizer"];
  const double lion_nvme =
      parse_json(strata(nvme + " --optimizer lion", "2>/dev/null"))["memory"]["nvme"]["optimizer"];
  EXPECT_NEAR(lion_nvme / adam_nvme, 2.0 / 3.0, 1e-3);
  const Result text = strata("estimate --model llama2-7b --optimizer adagrad");
  EXPECT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("fp32 Adagrad (8 B per parameter)"), std::string::npos) << text.out;
  const Result bad = strata("plan --model tiny --gpu-memory 1GiB --optimizer sgd");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("--optimizer 'sgd' is not one of adamw, adam, lion, adagrad"),
            std::string::npos)
      << bad.out;
}

TEST(EstimateCli, JsonRowsInOrderWithEveryTier) {
  const json j = parse_json(strata("estimate --model llama2-7b --gpus 2 --json", "2>/dev/null"));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 5u);
  const char* order[] = {"none", "optimizer->cpu", "optimizer->nvme", "params+optimizer->cpu",
                         "params+optimizer->nvme"};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(j[i]["option"], order[i]);
    for (const char* tier : {"gpu_per_device", "cpu", "nvme"})
      EXPECT_TRUE(j[i][tier].contains("total")) << tier;
  }
  // Each step moves state off the GPU: GPU bytes never grow down the table.
  for (size_t i = 1; i < 5; ++i)
    EXPECT_LE(j[i]["gpu_per_device"]["total"].get<uint64_t>(),
              j[i - 1]["gpu_per_device"]["total"].get<uint64_t>())
        << i;
  // Nothing in host RAM with everything on the GPU but what a checkpoint stages, a unit at a
  // time: the largest unit (a block: q, k, v, o, gate, up, down and two norms, 202,383,360
  // elements, more than the 4096 x 32000 embedding) at 24 + 2 x 2 bytes each, and the
  // writer's 32 MiB of chunks.
  EXPECT_EQ(j[0]["cpu"]["total"], j[0]["cpu"]["checkpoint"]);
  const uint64_t block = 4ull * 4096 * 4096 + 3ull * 4096 * 11008 + 2 * 4096;
  EXPECT_EQ(j[0]["cpu"]["checkpoint"].get<uint64_t>(), 28 * block + (32ull << 20));
  for (size_t i = 1; i < 5; ++i) EXPECT_EQ(j[i]["cpu"]["checkpoint"], j[0]["cpu"]["checkpoint"]);
  EXPECT_EQ(j[0]["pinned_buffers"], 0);
  EXPECT_GT(j[1]["pinned_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j[2]["nvme"]["optimizer"].get<uint64_t>(), j[1]["cpu"]["optimizer"].get<uint64_t>());
  EXPECT_EQ(j[2]["nvme"]["parameters"], 0);
  EXPECT_GT(j[4]["nvme"]["parameters"].get<uint64_t>(), 0u);
  // The f32 accumulators are where DeepSpeed keeps them: in host RAM beside an optimizer on
  // the CPU, in the swap files beside one on NVMe (host RAM keeps the replicated norms').
  const uint64_t n = 6'738'415'616ull;
  for (size_t i : {1, 3}) {
    EXPECT_GE(j[i]["cpu"]["gradients"].get<uint64_t>(), 4 * n) << i;
    EXPECT_EQ(j[i]["nvme"]["gradients"], 0) << i;
    EXPECT_EQ(j[i]["offload_gradients"], "cpu") << i;
  }
  for (size_t i : {2, 4}) {
    EXPECT_GE(j[i]["nvme"]["gradients"].get<uint64_t>(), 4 * n) << i;
    EXPECT_LT(j[i]["cpu"]["gradients"].get<uint64_t>(), n / 1000) << i;
    EXPECT_EQ(j[i]["offload_gradients"], "nvme") << i;
  }
  EXPECT_EQ(j[1]["nvme"]["total"], 0);
  // Activations are counted, the same in every row.
  EXPECT_GT(j[0]["gpu_per_device"]["activations"].get<uint64_t>(), 0u);
  EXPECT_EQ(j[4]["gpu_per_device"]["activations"], j[0]["gpu_per_device"]["activations"]);

  // Without activation checkpointing every block keeps its activations: llama2-7b's 32 blocks
  // at 4096 tokens keep q, k, v, attention out, residual (5 x 4096) and gate, up (2 x 11008)
  // bf16 values a token each, where one block's worth was scratch before: at least 31 blocks'
  // worth more (the log-sum-exps come on top). The plan says which it planned.
  const json off = parse_json(strata(
      "estimate --model llama2-7b --gpus 2 --activation-checkpointing off --json", "2>/dev/null"));
  const uint64_t kept = 4096ull * 32 * (5 * 4096 + 2 * 11008) * 2;
  EXPECT_GE(off[0]["gpu_per_device"]["activations"].get<uint64_t>(),
            j[0]["gpu_per_device"]["activations"].get<uint64_t>() + kept / 32 * 31);
  const json plan = parse_json(strata(
      "plan --model tiny --gpu-memory 1GiB --activation-checkpointing off --json", "2>/dev/null"));
  EXPECT_EQ(plan["activation_checkpointing"], false);

  const Result text = strata("estimate --model tiny");
  EXPECT_EQ(text.status, 0);
  EXPECT_NE(text.out.find("params+optimizer->nvme"), std::string::npos) << text.out;
}

}  // namespace
}  // namespace strata
