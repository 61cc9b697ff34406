// test_tune_cli.cpp: `strata tune` as a user runs it: the machine measured (--quick) into a
// profile that the simulator's reader loads and simulates from, with what could not be
// measured left 0 and said so; a recommendation for the tiny model on the host backend written
// as a DeepSpeed config that the ds_config reader maps back to the configuration chosen and
// that `strata train` runs; a model that fits nowhere refused with the numbers before anything
// is measured; bad input named.
#include "model/config.h"
#include "schedule/schedule.h"
#include "schedule/simulator.h"
#include "tier/placement.h"
#include "train/ds_config.h"
#include "train_cli_testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::CommandResult;

// `strata ARGS` with stdout alone (stderr dropped) for --json runs.
CommandResult strata_stdout(const std::string& args) {
  return test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " 2>/dev/null");
}

json parse(const CommandResult& r) {
  EXPECT_EQ(r.status, 0) << r.out;
  json j = json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

TEST(TuneCli, MeasuresThisMachineIntoAProfileTheSimulatorReads) {
  const test::TempDir dir("strata-tune");
  const fs::path a = dir.path / "a", b = dir.path / "b", profile = dir.path / "profile.json";
  fs::create_directories(a);
  fs::create_directories(b);
  const auto start = std::chrono::steady_clock::now();
  const json j =
      parse(strata_stdout("tune --quick --devices host:2 --threads 1 --nvme-path " + a.string() +
                          "," + b.string() + " --out-profile " + profile.string() + " --json"));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 30.0) << "--quick is meant to take seconds";
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["measured"], true);
  EXPECT_EQ(j["devices"]["count"], 2);
  EXPECT_EQ(j["gpu"]["present"], false);   // host devices: the device figures are the host's
  EXPECT_FALSE(j.contains("candidates"));  // no --model: measuring only

  // Read back by the simulator's reader: the file is what was reported.
  const HardwareProfile p = HardwareProfile::load(profile.string());
  EXPECT_EQ(json::parse(p.to_json()), j["profile"]);
  for (const auto& [name, v] : {std::pair{"gpu_flops", p.gpu_flops},
                                {"h2d_bytes_per_s", p.h2d_bytes_per_s},
                                {"d2h_bytes_per_s", p.d2h_bytes_per_s},
                                {"comm_bytes_per_s", p.comm_bytes_per_s},
                                {"reduce_bytes_per_s", p.reduce_bytes_per_s},
                                {"adam_elements_per_s", p.adam_elements_per_s},
                                {"stats_elements_per_s", p.stats_elements_per_s},
                                {"gpu_adam_elements_per_s", p.gpu_adam_elements_per_s},
                                {"gpu_stats_elements_per_s", p.gpu_stats_elements_per_s},
                                {"nvme_read_bytes_per_s", p.nvme_read_bytes_per_s},
                                {"nvme_write_bytes_per_s", p.nvme_write_bytes_per_s},
                                {"device_copy_bytes_per_s", p.device_copy_bytes_per_s},
                                {"host_cpu_mixed", p.host_cpu_mixed},
                                {"task_latency_s", p.task_latency_s}}) {
    EXPECT_GT(v, 0.0) << name;
    EXPECT_TRUE(std::isfinite(v)) << name;
    ASSERT_EQ(p.notes.count(name), 1u) << name << " has no note";
    EXPECT_NE(p.notes.at(name).find("measured"), std::string::npos) << p.notes.at(name);
  }
  // Host devices: the device lanes run on the host's cores, shared as measured.
  EXPECT_GE(p.host_cpu_mixed, 1.0);
  EXPECT_LE(p.host_cpu_mixed, 2.0);
  EXPECT_NE(p.notes.at("host_cpu_mixed").find("CPU Adam"), std::string::npos);
  // Two host devices compute at once as well, which shares the cores worse: measured too.
  EXPECT_NE(p.notes.at("host_cpu_mixed").find("on both devices at once"), std::string::npos)
      << p.notes.at("host_cpu_mixed");
  // ... and a task's fixed cost is timed where the lanes' threads wait for busy cores.
  EXPECT_NE(p.notes.at("task_latency_s").find("beside the model's forward"), std::string::npos)
      << p.notes.at("task_latency_s");
  // Verified, and honest that the compute is the host backend's.
  EXPECT_NE(p.notes.at("gpu_flops").find("verified"), std::string::npos);
  EXPECT_NE(p.notes.at("gpu_flops").find("host backend"), std::string::npos);
  EXPECT_NE(p.notes.at("gpu_stats_elements_per_s").find("grad_stats bit for bit"),
            std::string::npos);
  EXPECT_NE(p.notes.at("nvme_read_bytes_per_s").find("every byte"), std::string::npos);
  // The per-call cost of the swap store, fitted through two transfer sizes (8 and 1 MiB).
  for (const double l : {p.nvme_read_latency_s, p.nvme_write_latency_s}) {
    EXPECT_GE(l, 0.0);
    EXPECT_LT(l, 1.0);
  }
  EXPECT_NE(p.notes.at("nvme_read_latency_s").find("fitted through 8 MiB transfers"),
            std::string::npos)
      << p.notes.at("nvme_read_latency_s");
  EXPECT_NE(p.notes.at("reduce_bytes_per_s").find("verified: every rank's shard"),
            std::string::npos);
  // NVMe per path, read and write separately, and the settings measured with.
  ASSERT_EQ(p.nvme_paths.size(), 2u);
  EXPECT_EQ(p.nvme_paths[0].path, a.string());
  EXPECT_EQ(p.nvme_paths[1].path, b.string());
  for (const NvmePathRate& r : p.nvme_paths) {
    EXPECT_GT(r.read_bytes_per_s, 0.0) << r.path;
    EXPECT_GT(r.write_bytes_per_s, 0.0) << r.path;
  }
  EXPECT_EQ(p.nvme_block_size, 1u << 20);
  EXPECT_EQ(p.nvme_queue_depth, 32u);
  // No test files are left behind in the measured directories.
  EXPECT_TRUE(fs::is_empty(a));
  EXPECT_TRUE(fs::is_empty(b));

  // The simulator predicts from it: tiny with its optimizer on NVMe on 2 ranks.
  RunShape shape;
  shape.model = *find_preset("tiny");
  shape.ranks = 2;
  shape.param_dtype = DType::f32;
  shape.seq_len = 64;
  OffloadRequest req;
  req.optimizer = Tier::nvme;
  req.nvme_paths = {a.string(), b.string()};
  const Placement pl = Placement::make(shape, req, TierBudgets{});
  const Prediction pred = simulate(Schedule::build(pl, ScheduleOptions{}), p, 1);
  EXPECT_GT(pred.step_s, 0.0);
}

TEST(TuneCli, RecommendsAConfigStrataTrainAccepts) {
  const test::TempDir dir("strata-tune");
  const fs::path swap = dir.path / "swap", profile = dir.path / "profile.json";
  const fs::path config = dir.path / "ds_config.json", run = dir.path / "run";
  fs::create_directories(swap);
  // The optimizer on NVMe (asked for), the rest chosen: the config then carries nvme_path,
  // pin_memory, buffer_count and aio.
  const json j = parse(strata_stdout(
      "tune --quick --devices host:1 --threads 1 --model tiny --seq-len 64 --global-batch 4 "
      "--nvme-path " +
      swap.string() + " --offload-optimizer nvme --out-profile " + profile.string() +
      " --out-config " + config.string() + " --all --json"));
  ASSERT_TRUE(j.contains("recommended")) << j.dump(2);
  const json& best = j["recommended"];
  EXPECT_EQ(best["offload_optimizer"], "nvme");
  EXPECT_EQ(best["fits"], true);
  const int64_t micro = best["micro_batch"], accum = best["grad_accum"];
  EXPECT_EQ(micro * accum, 4);
  EXPECT_GT(best["tokens_per_s"].get<double>(), 0.0);
  // One device: no all-gather to time, and the profile says so instead of inventing a rate.
  const HardwareProfile p = HardwareProfile::load(profile.string());
  EXPECT_EQ(p.comm_bytes_per_s, 0.0);
  EXPECT_NE(p.notes.at("comm_bytes_per_s").find("absent"), std::string::npos);
  EXPECT_EQ(p.reduce_bytes_per_s, 0.0);
  EXPECT_NE(p.notes.at("reduce_bytes_per_s").find("absent"), std::string::npos);
  // Ranked: the first is the fastest (within the 1% ties are broken in).
  ASSERT_GE(j["candidates"].size(), 2u);
  for (const json& c : j["candidates"]) {
    EXPECT_EQ(c["offload_optimizer"], "nvme");
    EXPECT_LE(c["tokens_per_s"].get<double>(), best["tokens_per_s"].get<double>() * 1.0101);
    EXPECT_EQ(c["micro_batch"].get<int64_t>() * c["grad_accum"].get<int64_t>(), 4);
  }
  EXPECT_EQ(j["candidates"][0], best);
  // Both activation checkpointing choices ranked (--all lists them); the command to train says
  // which one was picked.
  std::set<bool> checkpointing;
  for (const json& c : j["candidates"])
    checkpointing.insert(c["activation_checkpointing"].get<bool>());
  EXPECT_EQ(checkpointing.size(), 2u);
  const bool recompute = best["activation_checkpointing"];
  EXPECT_EQ(j["train_command"].get<std::string>().find("--activation-checkpointing off") ==
                std::string::npos,
            recompute);

  // Read back by the reader `strata train --config` uses: the configuration chosen.
  const DsConfig ds = load_ds_config(config);
  EXPECT_TRUE(ds.ignored.empty()) << json(ds.ignored).dump();
  const DsPlanSettings s = ds_plan_settings(ds, 1, *find_preset("tiny"));
  EXPECT_EQ(s.batch.micro_batch, micro);
  EXPECT_EQ(s.batch.grad_accum, accum);
  EXPECT_EQ(ds.train_batch_size, 4);
  EXPECT_EQ(ds.zero.stage, 3);
  EXPECT_EQ(s.offload.optimizer, Tier::nvme);
  EXPECT_EQ(tier_name(s.offload.param),
            best["offload_param"] == "none" ? "gpu" : best["offload_param"].get<std::string>());
  EXPECT_EQ(s.offload.nvme_paths, std::vector<std::string>{swap.string()});
  EXPECT_EQ(s.offload.buffer_count, best["buffer_count"].get<int>());
  EXPECT_EQ(s.offload.pin_memory, best["pin_memory"].get<bool>());
  EXPECT_EQ(s.prefetch_depth.value_or(-1), best["prefetch_depth"].get<int>());
  EXPECT_EQ(s.param_dtype, DType::f32);  // the host backend's precision: bf16 and fp16 off
  EXPECT_EQ(ds.aio.block_size, p.nvme_block_size);
  EXPECT_EQ(ds.aio.queue_depth, static_cast<int>(p.nvme_queue_depth));
  EXPECT_EQ(j["config"], json::parse(test::slurp(config)));

  // `strata plan` of the config written, from the same profile, predicts the step tune ranked it
  // by: both simulate the steady state, in which each step's optimizer overlaps the next
  // step's forwards as the executor runs them.
  const CommandResult plan =
      strata_stdout("plan --model tiny --config " + config.string() + " --hardware " +
                    profile.string() + " --seq-len 64 --gpu-memory 1GiB --json" +
                    (recompute ? "" : " --activation-checkpointing off"));
  ASSERT_EQ(plan.status, 0) << plan.out;
  EXPECT_DOUBLE_EQ(parse(plan)["step_s"].get<double>(), best["step_s"].get<double>());

  // `strata train` runs it: two steps of tiny on the host backend, nothing in it ignored.
  const fs::path data = test::make_data(dir.path);
  const CommandResult t = test::strata(
      "train --model tiny --init random --data " + data.string() + " --steps 2 --config " +
      config.string() + " --seq-len 64 --devices host:1 --threads 1 --run-dir " + run.string() +
      (recompute ? "" : " --activation-checkpointing off"));
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_EQ(t.out.find("not acted on"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find(fmt::format("{} micro-batch(es) of {} x 64 tokens", accum, micro)),
            std::string::npos)
      << t.out;
  const std::vector<json> m = test::metrics(run);
  ASSERT_EQ(m.size(), 2u);
  for (const json& line : m) EXPECT_TRUE(std::isfinite(line["loss"].get<double>())) << line;
  // Its optimizer state lived in the swap directory the config names (removed at the end).
  EXPECT_NE(j["train_command"].get<std::string>().find("--config " + config.string()),
            std::string::npos);
}

// A device too small for a model's activation checkpoints (12 layers at 1024 tokens) but not for
// the rest: tune tries the checkpoints in host RAM, recommends them (they fit where keeping them
// does not), writes activation_checkpointing.cpu_checkpointing, and `strata train` runs that
// config on a device of that size; asked to keep them on the device it refuses, as train does.
// On a roomy device keeping them is preferred (the same speed, no copies).
TEST(TuneCli, OffloadsTheActivationCheckpointsWhereTheDeviceIsShort) {
  const test::TempDir dir("strata-tune-act");
  const fs::path profile = dir.path / "profile.json", config = dir.path / "ds.json";
  const fs::path model = dir.path / "model";
  fs::create_directories(model);
  LlamaConfig c = *find_preset("tiny");
  c.num_hidden_layers = 12;
  c.max_position_embeddings = 1024;
  std::ofstream(model / "config.json") << to_hf_config_json(c).dump(2);
  ASSERT_EQ(
      strata_stdout("tune --quick --devices host:1 --threads 1 --out-profile " + profile.string())
          .status,
      0);
  // The GPU bytes both ways, from `strata plan` (the same placement tune checks).
  const std::string shape = " --seq-len 1024 --offload-param none --offload-optimizer none ";
  auto gpu = [&](const char* act) {
    return parse(strata_stdout("plan --model " + model.string() + shape +
                               "--gpus 1 --gpu-memory 1GiB --dtype f32 --json "
                               "--offload-activations " +
                               act))["memory"]["gpu"]["total"]
        .get<uint64_t>();
  };
  const uint64_t kept = gpu("none"), off = gpu("cpu");
  ASSERT_LT(off, kept);
  const std::string tune = "tune --hardware " + profile.string() + " --devices host:1 --model " +
                           model.string() + shape +
                           "--global-batch 1 --max-micro-batch 1 --prefetch-depth 1 --out-config " +
                           config.string() + " --json --device-memory ";
  const std::string short_device = std::to_string((kept + off) / 2);
  const json j = parse(strata_stdout(tune + short_device));
  EXPECT_EQ(j["recommended"]["offload_activations"], "cpu") << j.dump(2);
  EXPECT_EQ(j["recommended"]["memory"]["gpu_per_device"], off);
  const DsConfig ds = load_ds_config(config);
  EXPECT_EQ(ds.cpu_checkpointing, true);
  EXPECT_TRUE(ds.ignored.empty()) << json(ds.ignored).dump();
  const fs::path data = test::make_data(dir.path);
  const std::string train = "train --model " + model.string() + " --init random --data " +
                            data.string() +
                            " --steps 1 --seq-len 1024 --devices host:1 --threads 1 "
                            "--device-memory " +
                            short_device + " --config " + config.string();
  CommandResult t = test::strata(train + " --run-dir " + (dir.path / "run").string());
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_NE(t.out.find("activation checkpoints: 11 block input(s)"), std::string::npos) << t.out;
  t = test::strata(train + " --offload-activations none --run-dir " + (dir.path / "kept").string());
  EXPECT_NE(t.status, 0);
  EXPECT_NE(t.out.find("--offload-activations cpu"), std::string::npos) << t.out;
  const CommandResult refused = test::strata(tune + short_device + " --offload-activations none");
  EXPECT_NE(refused.status, 0);
  EXPECT_NE(refused.out.find("fits no placement"), std::string::npos) << refused.out;
  const json roomy = parse(strata_stdout(tune + std::to_string(2 * kept)));
  EXPECT_EQ(roomy["recommended"]["offload_activations"], "none") << roomy.dump(2);
  // Without recompute there is nothing to offload: only keeping them is tried (and fits on the
  // roomy device); asking for nothing but the offload then is refused by name.
  const json off_only = parse(
      strata_stdout(tune + std::to_string(4 * kept) + " --activation-checkpointing off --all"));
  for (const json& cand : off_only["candidates"]) {
    EXPECT_EQ(cand["activation_checkpointing"], false) << cand.dump();
    EXPECT_EQ(cand["offload_activations"], "none") << cand.dump();
  }
  const CommandResult nothing = test::strata(tune + std::to_string(4 * kept) +
                                             " --activation-checkpointing off "
                                             "--offload-activations cpu");
  EXPECT_NE(nothing.status, 0);
  EXPECT_NE(nothing.out.find("--activation-checkpointing on"), std::string::npos) << nothing.out;
}

TEST(TuneCli, SearchesEveryChoiceFromASavedProfileAndPrintsTheTable) {
  const test::TempDir dir("strata-tune");
  const fs::path swap = dir.path / "swap", profile = dir.path / "profile.json";
  const fs::path config = dir.path / "ds.json";
  fs::create_directories(swap);
  ASSERT_EQ(strata_stdout("tune --quick --devices host:1 --threads 1 --nvme-path " + swap.string() +
                          " --out-profile " + profile.string())
                .status,
            0);
  const std::string before = test::slurp(profile);
  // No measuring this time: the saved profile is used and left as it was.
  const CommandResult r = test::strata("tune --hardware " + profile.string() +
                                       " --devices host:1 --model tiny --seq-len 32 "
                                       "--global-batch 8 --nvme-path " +
                                       swap.string() + " --out-config " + config.string());
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* part : {"profile read from", "placements checked", "tokens/s", "critical lane",
                           "recommended:", "strata train --model tiny --config", "--seq-len 32"})
    EXPECT_NE(r.out.find(part), std::string::npos) << "'" << part << "' missing from:\n" << r.out;
  EXPECT_EQ(r.out.find("measured in"), std::string::npos) << r.out;
  EXPECT_EQ(test::slurp(profile), before);
  const DsConfig ds = load_ds_config(config);
  EXPECT_EQ(ds.train_batch_size, 8);
  EXPECT_TRUE(ds.ignored.empty());
  // Every parameter/optimizer choice was tried, and with every unit sharded (persistence
  // threshold 0) each places the state differently: nine rows, the best of each.
  const json j =
      parse(strata_stdout("tune --hardware " + profile.string() +
                          " --devices host:1 --model tiny --seq-len 32 "
                          "--global-batch 8 --persistence-threshold 0 --nvme-path " +
                          swap.string() + " --out-config " + config.string() + " --json"));
  std::set<std::pair<std::string, std::string>> choices;
  for (const json& c : j["candidates"])
    choices.insert(
        {c["offload_param"].get<std::string>(), c["offload_optimizer"].get<std::string>()});
  EXPECT_EQ(choices.size(), 9u) << j["candidates"].dump();
  EXPECT_EQ(j["candidates"].size(), 9u);
  EXPECT_EQ(j["measured"], false);
  EXPECT_EQ(j["candidates"][0], j["recommended"]);
  EXPECT_NE(j["train_command"].get<std::string>().find("--persistence-threshold 0"),
            std::string::npos);
  // Tuned for Lion: its state sized (8 bytes a parameter), and the command trains with it.
  const json lion =
      parse(strata_stdout("tune --hardware " + profile.string() +
                          " --devices host:1 --model tiny --seq-len 32 --global-batch 8 "
                          "--optimizer lion --out-config " +
                          config.string() + " --json"));
  EXPECT_NE(lion["train_command"].get<std::string>().find("--optimizer lion"), std::string::npos)
      << lion["train_command"];
  // With the default threshold every unit of tiny is replicated on the devices, so offloading
  // the parameters changes nothing: those choices are said to be the same, not ranked.
  const CommandResult same = test::strata(
      "tune --hardware " + profile.string() + " --devices host:1 --model tiny --seq-len 32 " +
      "--global-batch 8 --nvme-path " + swap.string() + " --out-config " + config.string());
  EXPECT_NE(same.out.find("P cpu, O none places everything as P none, O none does"),
            std::string::npos)
      << same.out;
}

TEST(TuneCli, TriesTheWholeStepAsOneMicroBatchGroup) {
  // A step of several micro-batches is tried one micro-batch at a time and as one group. With
  // the parameters on a drive far slower than the rest, a group reads each unit once for the
  // step's forwards and once for its backwards instead of per micro-batch: it wins, and the
  // train command carries it.
  const test::TempDir dir("strata-tune");
  const fs::path swap = dir.path / "swap", measured = dir.path / "measured.json";
  const fs::path slow = dir.path / "slow.json", config = dir.path / "ds.json";
  fs::create_directories(swap);
  ASSERT_EQ(strata_stdout("tune --quick --devices host:1 --threads 1 --nvme-path " + swap.string() +
                          " --out-profile " + measured.string())
                .status,
            0);
  json profile = json::parse(test::slurp(measured));
  profile["nvme_read_bytes_per_s"] = 5e6;
  profile["nvme_write_bytes_per_s"] = 5e6;
  std::ofstream(slow) << profile.dump();
  // A model with tied embeddings too, which groups only with its gradients reduced once per
  // group, as tune's grouped candidates are.
  const fs::path tied = dir.path / "tied";
  LlamaConfig c = *find_preset("tiny");
  c.tie_word_embeddings = true;
  fs::create_directories(tied);
  std::ofstream(tied / "config.json") << to_hf_config_json(c).dump(2);
  for (const std::string& model : {std::string("tiny"), tied.string()}) {
    SCOPED_TRACE(model);
    const json j = parse(strata_stdout(
        "tune --hardware " + slow.string() + " --devices host:1 --model " + model +
        " --seq-len 32 --global-batch 4 --max-micro-batch 1 --persistence-threshold 0 "
        "--offload-param nvme --offload-optimizer none --nvme-path " +
        swap.string() + " --out-config " + config.string() + " --all --json"));
    std::set<int> groups;
    for (const json& cand : j["candidates"]) {
      EXPECT_EQ(cand["grad_accum"], 4) << cand.dump();
      groups.insert(cand["micro_batch_group"].get<int>());
    }
    EXPECT_EQ(groups, (std::set<int>{1, 4})) << j["candidates"].dump();
    EXPECT_EQ(j["recommended"]["micro_batch_group"], 4) << j["candidates"].dump();
    EXPECT_EQ(j["recommended"]["reduce_per_group"], true);
    EXPECT_NE(
        j["train_command"].get<std::string>().find("--micro-batch-group 4 --reduce-per-group on"),
        std::string::npos)
        << j["train_command"];
  }
}

TEST(TuneCli, TriesCpuAdamDuringTheBackwardWhenAsked) {
  // Only when asked (it means no clipping, and a non-finite gradient stops the run), and only
  // where the optimizer is on the host. With CPU Adam far slower than the rest, updating each
  // unit under the rest of the backward wins, and the train command carries it; strata train
  // runs the config written for it.
  const test::TempDir dir("strata-tune");
  const fs::path measured = dir.path / "measured.json", slow = dir.path / "slow.json";
  const fs::path config = dir.path / "ds.json", run = dir.path / "run";
  ASSERT_EQ(
      strata_stdout("tune --quick --devices host:1 --threads 1 --out-profile " + measured.string())
          .status,
      0);
  json profile = json::parse(test::slurp(measured));
  profile["adam_elements_per_s"] = 2e7;
  // And cores that run the model and CPU Adam at once at full speed each. Measured on a loaded
  // machine (ctest -j with other tune tests), this came out near 1, where the simulator rightly
  // gives updating during the backward nothing: both then share one core's time.
  profile["host_cpu_mixed"] = 2.0;
  std::ofstream(slow) << profile.dump();
  const std::string common = "tune --hardware " + slow.string() +
                             " --devices host:1 --model tiny --seq-len 32 --global-batch 2 "
                             "--max-micro-batch 1 --persistence-threshold 0 --out-config " +
                             config.string() + " --all --json";
  const json off = parse(strata_stdout(common));
  for (const json& c : off["candidates"]) EXPECT_EQ(c["update_during_backward"], false) << c;
  EXPECT_EQ(off["train_command"].get<std::string>().find("--update-during-backward"),
            std::string::npos);

  const json j = parse(strata_stdout(common + " --update-during-backward on,off"));
  std::set<std::pair<std::string, bool>> tried;
  for (const json& c : j["candidates"])
    tried.insert({c["offload_optimizer"].get<std::string>(), c["update_during_backward"]});
  EXPECT_EQ(tried, (std::set<std::pair<std::string, bool>>{
                       {"none", false}, {"cpu", false}, {"cpu", true}}))
      << j["candidates"].dump();
  EXPECT_EQ(j["candidates"].size(),
            off["candidates"].size() * 2 -
                static_cast<size_t>(
                    std::count_if(off["candidates"].begin(), off["candidates"].end(),
                                  [](const json& c) { return c["offload_optimizer"] == "none"; })));
  // The fastest with CPU Adam updates during the backward, ahead of any that does not.
  auto first_on_cpu = [](const json& r) {
    for (const json& c : r["candidates"])
      if (c["offload_optimizer"] == "cpu") return c;
    return json();
  };
  EXPECT_EQ(first_on_cpu(j)["update_during_backward"], true) << j["candidates"].dump();
  EXPECT_LT(first_on_cpu(j)["step_s"].get<double>(), first_on_cpu(off)["step_s"].get<double>());

  // With the optimizer on the CPU, it is recommended and the train command carries it.
  const json cpu = parse(strata_stdout(common + " --offload-optimizer cpu --offload-param none " +
                                       "--update-during-backward on,off"));
  const json& best = cpu["recommended"];
  EXPECT_EQ(best["update_during_backward"], true) << best;
  const std::string cmd = cpu["train_command"];
  EXPECT_NE(cmd.find("--update-during-backward on"), std::string::npos) << cmd;
  const DsConfig ds = load_ds_config(config);
  EXPECT_FALSE(ds.gradient_clipping.has_value() && *ds.gradient_clipping > 0);

  const fs::path data = test::make_data(dir.path);
  const CommandResult t = test::strata(
      "train --model tiny --init random --data " + data.string() + " --steps 2 --config " +
      config.string() + " --seq-len 32 --devices host:1 --threads 1 --persistence-threshold 0 " +
      "--update-during-backward on --run-dir " + run.string() +
      (best["activation_checkpointing"] == true ? "" : " --activation-checkpointing off") +
      (best["micro_batch_group"].get<int>() > 1
           ? fmt::format(" --micro-batch-group {} --reduce-per-group on",
                         best["micro_batch_group"].get<int>())
           : std::string()));
  ASSERT_EQ(t.status, 0) << t.out;
  const std::vector<json> m = test::metrics(run);
  ASSERT_EQ(m.size(), 2u);
  for (const json& line : m) EXPECT_TRUE(std::isfinite(line["loss"].get<double>())) << line;
}

TEST(TuneCli, AModelThatFitsNowhereIsRefusedWithTheNumbers) {
  const test::TempDir dir("strata-tune");
  const fs::path profile = dir.path / "profile.json";
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = test::strata(
      "tune --quick --devices host:1 --device-memory 1GiB --cpu-memory 2GiB --model llama2-70b "
      "--seq-len 128 --nvme-path " +
      dir.path.string() + " --out-profile " + profile.string());
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.status, 1) << r.out;
  for (const char* part :
       {"llama2-70b", "fits no placement", "nothing was measured", "P none O none", "P nvme O nvme",
        "gpu: needs", "1 GiB available", "nvme: needs", "free", "--nvme-path"})
    EXPECT_NE(r.out.find(part), std::string::npos) << "'" << part << "' missing from:\n" << r.out;
  EXPECT_FALSE(fs::exists(profile));  // refused before measuring
  EXPECT_LT(took, 10.0);
}

TEST(TuneCli, BadInputIsNamed) {
  const test::TempDir dir("strata-tune");
  const fs::path file = dir.path / "file";
  std::ofstream(file) << "x";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"tune --nvme-path /nonexistent/strata-tune",
       {"/nonexistent/strata-tune", "does not exist", "mkdir -p"}},
      {"tune --nvme-path " + file.string(), {file.string(), "not a directory"}},
      {"tune --nvme-path " + dir.path.string() + "," + dir.path.string(), {"named twice"}},
      {"tune --seq-len 64", {"--seq-len", "give --model"}},
      {"tune --devices host:2 --model tiny --global-batch 3",
       {"--global-batch 3", "multiple of 2"}},
      {"tune --devices host:1 --model tiny --offload-param disk",
       {"--offload-param 'disk'", "none, cpu or nvme"}},
      {"tune --devices host:1 --model tiny --prefetch-depth 0", {"--prefetch-depth 0", "1..4"}},
      {"tune --devices host:1 --model tiny --dtype f16 --update-during-backward on",
       {"--update-during-backward on", "fp16", "--dtype bf16"}},
      {"tune --devices host:1 --model tiny --cpu-memory 0", {"--cpu-memory 0", "give a size"}},
      {"tune --devices host:1 --model tiny --pinned-memory 0",
       {"--pinned-memory 0", "give a size"}},
      {"tune --devices host:1 --model tiny --update-during-backward maybe",
       {"--update-during-backward", "maybe"}},
      {"tune --devices host:1 --model tiny --seq-len 100000",
       {"--seq-len 100000", "max_position_embeddings"}},
      {"tune --devices host:1 --model no-such-model", {"no-such-model"}},
      {"tune --devices host:1 --hardware " + file.string(), {file.string(), "not valid JSON"}},
  };
  for (const auto& [args, parts] : cases) {
    const CommandResult r = test::strata(args);
    EXPECT_NE(r.status, 0) << args << "\n" << r.out;
    for (const std::string& part : parts)
      EXPECT_NE(r.out.find(part), std::string::npos)
          << "'" << part << "' missing from `" << args << "`:\n"
          << r.out;
  }
}

}  // namespace
}  // namespace strata
