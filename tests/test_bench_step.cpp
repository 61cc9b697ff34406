// test_bench_step.cpp: `strata bench step` run small on host devices: it verifies the weights
// against the all-device run before it reports, writes a trace with one track per lane, reads
// back the profile it saved, and names bad settings. Speeds are not judged (a shared machine).
#include "model/config.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

test::CommandResult strata(const std::string& args, const std::string& redirect = "") {
  return test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " " + redirect);
}

TEST(BenchStepCli, VerifiesThenReportsMeasuredAndPredicted) {
  const test::TempDir dir("strata-bench-step");
  const std::string path = dir.path.string();
  const std::string trace = path + "/trace.json", profile = path + "/profile.json";
  const test::CommandResult r = strata(
      "bench step --devices host:2 --offload-param cpu --offload-optimizer nvme --steps 2 "
      "--grad-accum 2 --threads 1 --nvme-path " +
      path + " --trace " + trace + " --save-profile " + profile + " --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["devices"], 2);
  EXPECT_GT(j["step_s"].get<double>(), 0.0);
  EXPECT_GT(j["predicted_step_s"].get<double>(), 0.0);
  const double overlap = j["overlap"].get<double>();
  EXPECT_GT(overlap, 0.0);
  EXPECT_LE(overlap, 1.0 + 1e-9);  // a lane cannot be busy longer than the step
  // What the executor holds on a device: the plan's figure, give or take its own small buffers
  // (token ids, targets, chunk sums, the in-process communicator's staging).
  const auto held = j["device_bytes"].get<uint64_t>();
  const auto planned = j["planned_device_bytes"].get<uint64_t>();
  EXPECT_GT(held, planned / 2) << r.out;
  EXPECT_LE(held, planned + (256u << 10)) << r.out;
  // Both the measured and the predicted busy time of every lane of the schedule.
  std::set<std::string> lanes;
  for (const json& l : j["lanes"]) {
    lanes.insert(l["lane"].get<std::string>());
    EXPECT_GE(l["busy_s"].get<double>(), 0.0);
    EXPECT_GE(l["predicted_busy_s"].get<double>(), 0.0);
  }
  for (const char* lane : {"gpu[0].compute", "gpu[1].comm", "cpu.adam", "nvme.read", "nvme.write"})
    EXPECT_EQ(lanes.count(lane), 1u) << lane << " missing from " << r.out;
  // The profile saved is the one reported, and every rate this run needs was measured.
  std::ifstream pf(profile);
  const json p = json::parse(pf, nullptr, false);
  ASSERT_FALSE(p.is_discarded());
  for (const char* rate : {"gpu_flops", "h2d_bytes_per_s", "comm_bytes_per_s",
                           "adam_elements_per_s", "nvme_read_bytes_per_s"}) {
    EXPECT_GT(p[rate].get<double>(), 0.0) << rate;
    EXPECT_EQ(p[rate], j["profile"][rate]) << rate;
  }
  // The trace: a thread-name track per lane and complete events for the tasks.
  std::ifstream tf(trace);
  const json t = json::parse(tf, nullptr, false);
  ASSERT_FALSE(t.is_discarded());
  const json& events = t.is_array() ? t : t["traceEvents"];
  std::set<std::string> tracks;
  size_t complete = 0;
  for (const json& e : events) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks.insert(e["args"]["name"]);
    if (e["ph"] == "X") ++complete;
  }
  EXPECT_EQ(tracks, lanes);
  EXPECT_GT(complete, 10u);

  ASSERT_EQ(j["rounds"].size(), 1u);
  EXPECT_EQ(j["rounds"][0]["prediction_error"], j["prediction_error"]);

  // Predicting from the saved profile instead of measuring gives the same prediction inputs,
  // in each of two rounds; the round reported is the one with the median (here the upper)
  // error.
  const test::CommandResult again = strata(
      "bench step --devices host:2 --offload-param cpu --offload-optimizer nvme --steps 1 "
      "--rounds 2 --grad-accum 2 --threads 1 --nvme-path " +
      path + " --hardware " + profile + " --predicted-trace " + path + "/predicted.json --json");
  ASSERT_EQ(again.status, 0) << again.out;
  // The simulator's timeline beside the measured one: the same tracks, four steps of the same
  // tasks, each task once per step.
  std::ifstream ptf(path + "/predicted.json");
  const json pt = json::parse(ptf, nullptr, false);
  ASSERT_FALSE(pt.is_discarded());
  std::set<std::string> predicted_tracks;
  std::map<int, std::multiset<std::string>> per_step;
  for (const json& e : pt.is_array() ? pt : pt["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") predicted_tracks.insert(e["args"]["name"]);
    if (e["ph"] == "X") per_step[e["args"]["step"].get<int>()].insert(e["name"]);
  }
  EXPECT_EQ(predicted_tracks, lanes);
  ASSERT_EQ(per_step.size(), 4u);
  EXPECT_GT(per_step[0].size(), 10u);
  for (const auto& [step, names] : per_step) EXPECT_EQ(names, per_step[0]) << "step " << step;
  const json k = json::parse(again.out, nullptr, false);
  EXPECT_EQ(k["predicted_step_s"], j["predicted_step_s"]);
  ASSERT_EQ(k["rounds"].size(), 2u);
  double worst = -1e9;
  for (const json& rd : k["rounds"]) {
    EXPECT_EQ(rd["predicted_step_s"], j["predicted_step_s"]);
    EXPECT_GT(rd["step_s"].get<double>(), 0.0);
    worst = std::max(worst, rd["prediction_error"].get<double>());
  }
  EXPECT_EQ(k["prediction_error"].get<double>(), worst);
}

// A model whose state does not fit on the devices all at once has no all-device run to compare
// with: its placement is verified on a two-layer copy instead, and the report says so. Here
// 8 MiB of device memory holds the 8-layer model offloaded but not all of it on the device.
// Also: activation checkpointing off, and MFU against a given peak.
TEST(BenchStepCli, AModelTooBigForTheDevicesIsVerifiedOnTwoLayers) {
  const test::TempDir dir("strata-bench-step");
  const std::string profile = (dir.path / "profile.json").string();
  ASSERT_EQ(strata("tune --quick --devices host:1 --threads 1 --out-profile " + profile).status, 0);
  const std::string base =
      "bench step --devices host:1 --offload-param cpu --offload-optimizer cpu --layers 8 "
      "--steps 1 --threads 1 --activation-checkpointing off --peak-tflops 2 --hardware " +
      profile;
  const test::CommandResult r = strata(base + " --device-memory 8MiB --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["verified_on_two_layers"], true);
  EXPECT_EQ(j["activation_checkpointing"], false);
  EXPECT_GT(j["model_tflops"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), j["model_tflops"].get<double>() / 2);
  const test::CommandResult text = strata(base + " --device-memory 8MiB");
  ASSERT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("a two-layer copy of it"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("% of 2 TFLOP/s"), std::string::npos) << text.out;
  // With room for everything, the full model is its own reference.
  const test::CommandResult roomy = strata(base + " --device-memory 64MiB --json");
  ASSERT_EQ(roomy.status, 0) << roomy.out;
  EXPECT_EQ(json::parse(roomy.out, nullptr, false)["verified_on_two_layers"], false);
}

// Micro-batches in a group run unit by unit are verified against the all-device run without
// groups, and the report says so.
TEST(BenchStepCli, MicroBatchGroupsAreVerifiedAgainstNoGroups) {
  const test::TempDir dir("strata-bench-step");
  const test::CommandResult r = strata(
      "bench step --devices host:1 --grad-accum 3 --micro-batch-group 3 --steps 1 "
      "--threads 1 --nvme-path " +
      dir.path.string() + " --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["micro_batch_group"], 3);
  const test::CommandResult bad = strata("bench step --grad-accum 2 --micro-batch-group 3", "2>&1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--micro-batch-group 3"), std::string::npos) << bad.out;
}

// The embedding and the head cut into vocabulary pieces: verified against the all-device run
// of the same cut, and the device memory held, as the plan counts it, falls with the buffers:
// with a vocabulary of 4096 the tiny model's tables are 262K elements to a block's 45K, and
// every landing buffer and working gradient was table-sized (every unit sharded: pieces under
// the persistence threshold would be replicated, resident on the device).
void vocabulary_pieces_are_verified_and_hold_less(const fs::path& model) {
  const std::string base = "bench step --model " + model.string() +
                           " --devices host:1 --offload-param cpu --offload-optimizer cpu "
                           "--offload-gradients cpu --hidden 256 --vocab 4096 --steps 1 --threads "
                           "1 --persistence-threshold 0 "
                           "--json --vocab-pieces ";
  json got[2];
  for (int k = 0; k < 2; ++k) {
    const test::CommandResult r = strata(base + (k == 0 ? "1" : "6"));
    ASSERT_EQ(r.status, 0) << r.out;
    got[k] = json::parse(r.out, nullptr, false);
    ASSERT_FALSE(got[k].is_discarded()) << r.out;
    EXPECT_EQ(got[k]["verified"], true);
    EXPECT_NEAR(got[k]["device_bytes"].get<double>(), got[k]["planned_device_bytes"].get<double>(),
                16384.0);
  }
  EXPECT_EQ(got[0]["vocab_pieces"], 1);
  EXPECT_EQ(got[1]["vocab_pieces"], 6);
  EXPECT_LT(got[1]["device_bytes"].get<double>(), 0.5 * got[0]["device_bytes"].get<double>());
}

// Untied and tied (the head's pieces reading the embedding's, the later ones padding alone and
// smaller than the final norm at hidden 256: the compute measurement checks a unit with
// parameters).
TEST(BenchStepCli, VocabularyPiecesAreVerifiedAndHoldLess) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const test::TempDir dir("strata-bench-pieces");
    LlamaConfig c = *find_preset("tiny");
    c.tie_word_embeddings = tied;
    std::ofstream(dir.path / "config.json") << to_hf_config_json(c).dump(2);
    vocabulary_pieces_are_verified_and_hold_less(dir.path);
  }
}

TEST(BenchStepCli, UpdatingDuringTheBackwardIsVerifiedAgainstUpdatingAfterIt) {
  const test::TempDir dir("strata-bench-step");
  const test::CommandResult r = strata(
      "bench step --devices host:1 --grad-accum 2 --micro-batch-group 2 "
      "--update-during-backward on --steps 1 --threads 1 --nvme-path " +
      dir.path.string() + " --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["update_during_backward"], true);
}

// Gradients summed on NVMe, with P and O in host RAM and no --nvme-path: the swap directory is
// made (and removed) as for P or O on NVMe, and the steps are verified against the all-device
// run.
TEST(BenchStepCli, GradientsOnNvmeAreVerified) {
  const test::CommandResult r = strata(
      "bench step --devices host:1 --grad-accum 2 --offload-param cpu --offload-optimizer cpu "
      "--offload-gradients nvme --persistence-threshold 0 --steps 1 --threads 1 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["gradients_on_nvme"], 4);
  EXPECT_GT(j["planned_nvme_bytes"].get<uint64_t>(), 0u);
}

TEST(BenchStepCli, ReducingOncePerGroupIsVerifiedAgainstTheSameGroups) {
  // Two devices, parameters on NVMe: reducing once per group sums in another order than the
  // run without groups, so the all-device reference runs the same groups, and every weight must
  // equal its weights bit for bit.
  const test::TempDir dir("strata-bench-step");
  const test::CommandResult r = strata(
      "bench step --devices host:2 --grad-accum 2 --micro-batch-group 2 --reduce-per-group on "
      "--offload-param nvme --offload-optimizer cpu --steps 1 --threads 1 --nvme-path " +
      dir.path.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("gradients reduced once per group"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all-device run's (groups of 2 too) bit for bit"), std::string::npos)
      << r.out;
}

TEST(BenchStepCli, BadSettingsAreNamed) {
  const test::CommandResult tier = strata("bench step --offload-param disk", "2>&1");
  EXPECT_NE(tier.status, 0);
  EXPECT_NE(tier.out.find("disk"), std::string::npos) << tier.out;
  const test::CommandResult steps = strata("bench step --steps 0", "2>&1");
  EXPECT_NE(steps.status, 0);
  EXPECT_NE(steps.out.find("--steps 0"), std::string::npos) << steps.out;
  const test::CommandResult rounds = strata("bench step --rounds 0", "2>&1");
  EXPECT_NE(rounds.status, 0);
  EXPECT_NE(rounds.out.find("--rounds 0"), std::string::npos) << rounds.out;
  const test::CommandResult hidden = strata("bench step --hidden 30", "2>&1");
  EXPECT_NE(hidden.status, 0);
  EXPECT_NE(hidden.out.find("--hidden 30"), std::string::npos) << hidden.out;
}

}  // namespace
}  // namespace strata
