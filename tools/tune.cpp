// tune.cpp: `strata tune`, this machine measured into a hardware profile and, given a model, the
// fastest configuration that fits it, written as a DeepSpeed config for `strata train`.
//
// Order: check the arguments (nvme paths exist and are writable directories, the model, the
// batch); with a model, whether any placement fits at all (placing needs no rates, so a model
// that fits nowhere is refused with the numbers before anything is measured); measure every
// lane with the code that lane runs, each figure verified before it is kept (measure.h); write
// the profile and read it back with the simulator's reader; then place, check and simulate
// every candidate (tune.h), print the ranked table, write the best as a DeepSpeed config and
// read that back with the reader `strata train --config` uses, refusing to finish if it does
// not mean the configuration chosen.
//
// Without a GPU the devices are host devices: the compute and copy figures are then the host
// backend's, the profile's notes say so, and the recommendation is for a run on the host
// backend. Nothing is assumed in place of a figure that could not be measured: it stays 0 with
// a note saying why (one device: no all-gather; no --nvme-path: no NVMe).
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/system.h"
#include "device_args.h"
#include "gpu/runtime.h"
#include "model/config.h"
#include "model/file_io.h"
#include "model/llama.h"
#include "partition/communicator.h"
#include "schedule/measure.h"
#include "schedule/schedule.h"
#include "schedule/simulator.h"
#include "schedule/tune.h"
#include "tier/placement.h"
#include "train/ds_config.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <thread>

namespace strata::cli {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct TuneArgs {
  std::vector<std::string> nvme_paths;
  std::string devices, device_memory;
  std::string out_profile = "strata-profile.json";
  bool out_profile_given = false;  // --out-profile on the command line
  std::string hardware;
  std::string model;
  int64_t seq_len = kUnsetFlag, global_batch = kUnsetFlag, max_micro_batch = 16;
  std::string dtype;
  std::string optimizer;
  std::vector<std::string> offload_param, offload_optimizer;
  std::vector<int> prefetch_depths{1, 2, 3};
  std::vector<bool> recompute{true, false};  // --activation-checkpointing choices
  std::vector<std::string> offload_activations{"none", "cpu"};  // --offload-activations choices
  std::vector<bool> update_during_backward{false};              // --update-during-backward choices
  std::string cpu_memory, pinned_memory;
  int64_t persistence_threshold = -1;
  int threads = 0;
  bool all = false;  // every candidate, not only the best of each parameter/optimizer choice
  std::string out_config = "ds_config.json";
  bool quick = false;
  bool json = false;
};

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string duration_text(double s) {
  if (s >= 86400.0) return fmt::format("{:.1f} days", s / 86400.0);
  if (s >= 3600.0) return fmt::format("{:.2f} h", s / 3600.0);
  if (s >= 1.0) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string per_second(double x, const char* unit) {
  if (x <= 0) return "absent";
  const char* sep = std::strcmp(unit, "elements") == 0 ? " " : "";
  if (x >= 1e12) return fmt::format("{:.2f} T{}{}/s", x / 1e12, sep, unit);
  if (x >= 1e9) return fmt::format("{:.2f} G{}{}/s", x / 1e9, sep, unit);
  if (x >= 1e6) return fmt::format("{:.1f} M{}{}/s", x / 1e6, sep, unit);
  return fmt::format("{:.0f} {}/s", x, unit);
}

// The --nvme-path directories: each must exist, be a directory and be writable (tune writes its
// test files there), and be named once.
void check_nvme_paths(const std::vector<std::string>& paths) {
  std::set<std::string> seen;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (p.empty()) fail("--nvme-path '': name a directory on the drive to measure");
    if (!fs::exists(p, ec))
      fail(
          "--nvme-path {}: does not exist; create the directory on the drive to measure "
          "(mkdir -p {}) or name an existing one",
          p, p);
    if (!fs::is_directory(p, ec))
      fail("--nvme-path {}: is a {}, not a directory; name a directory on the drive to measure", p,
           fs::is_regular_file(p, ec) ? "file" : "special file");
    if (::access(p.c_str(), W_OK | X_OK) != 0)
      fail("--nvme-path {}: not writable ({}); name a directory you may write to", p,
           errno_text(errno));
    const std::string canonical = fs::weakly_canonical(p, ec).string();
    if (!seen.insert(ec ? p : canonical).second)
      fail("--nvme-path {}: named twice; name each directory once (one per drive)", p);
  }
}

// --offload-param none,cpu: the tiers to try.
std::vector<Tier> tiers_flag(const char* flag, const std::vector<std::string>& values) {
  std::vector<Tier> out;
  if (values.empty()) return {Tier::gpu, Tier::cpu, Tier::nvme};
  for (const std::string& v : values) {
    if (v != "none" && v != "cpu" && v != "nvme")
      fail("{} '{}': expected none, cpu or nvme (a comma-separated list of those to try)", flag, v);
    const Tier t = parse_tier(v);
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

// The model whose forward and backward calibrate the compute rate, cut so that measuring stays
// quick: the target's own layer shape on a GPU (one or two layers, vocabulary at most 32768);
// on the host backend the shape scaled down to a hidden size of at most 512 (256 with --quick)
// and the tokens halved until the timed work is about 2 GFLOP (0.5 with --quick). The
// micro-batch then doubles, up to the largest the search tries, while the work stays within
// that (about 4096 tokens on a GPU): the rate is taken at the batch sizes that win, where
// per-kernel overheads weigh least. Without a model: tiny on the host backend, a llama2-7b
// layer on a GPU.
struct Calibration {
  LlamaConfig config;
  int64_t micro_batch = 1;
  int64_t tokens = 0;
  std::string note;
};

Calibration calibration_for(const std::optional<LlamaConfig>& target, int64_t seq_len,
                            int64_t max_micro, bool host, bool quick) {
  Calibration c;
  LlamaConfig m = target ? *target : *find_preset(host ? "tiny" : "llama2-7b");
  m.num_hidden_layers = std::min<int64_t>(m.num_hidden_layers, 2);
  m.vocab_size = std::min<int64_t>(m.vocab_size, host ? 4096 : 32768);
  std::string scaled;
  const int64_t cap = quick ? 256 : 512;
  if (host && m.hidden_size > cap) {
    const int64_t heads = std::max<int64_t>(cap / m.head_dim, 1);
    int64_t kv = std::max<int64_t>(m.num_key_value_heads * heads / m.num_attention_heads, 1);
    while (heads % kv != 0) --kv;
    m.intermediate_size =
        std::max<int64_t>(m.intermediate_size * heads * m.head_dim / m.hidden_size, 8);
    m.num_attention_heads = heads;
    m.num_key_value_heads = kv;
    m.hidden_size = heads * m.head_dim;
    scaled = fmt::format(", scaled to hidden {} to keep tune quick", m.hidden_size);
  }
  validate_llama_config(m, "strata tune (calibration model)");
  int64_t tokens =
      seq_len > 0 ? seq_len : std::min<int64_t>(m.max_position_embeddings, host ? 128 : 1024);
  tokens = std::min<int64_t>(tokens, host ? (quick ? 64 : 128) : 2048);
  const ModelLayout layout = ModelLayout::build(m);
  auto flops = [&](int64_t micro, int64_t t) {
    double f = 0;
    for (const UnitLayout& unit : layout.units) f += 4.0 * unit_forward_flops(m, unit, micro, t);
    return f;
  };
  const double budget = quick ? 5e8 : 2e9;
  while (host && tokens > 16 && flops(1, tokens) > budget) tokens /= 2;
  int64_t micro = 1;
  while (micro * 2 <= max_micro &&
         (host ? flops(micro * 2, tokens) <= budget : micro * 2 * tokens <= 4096))
    micro *= 2;
  c.config = m;
  c.micro_batch = micro;
  c.tokens = tokens;
  c.note =
      fmt::format("{}{}{}", target ? target->name : m.name, target ? "'s layer shape" : "", scaled);
  return c;
}

// "host backend (no GPU: CUDA not compiled)".
std::string no_gpu_reason() {
  const CudaRuntime& cuda = cuda_runtime();
  if (!cuda.compiled) return "this strata is built without CUDA";
  if (cuda.gpus.empty())
    return fmt::format("CUDA {}{}", cuda.status, cuda.detail.empty() ? "" : ": " + cuda.detail);
  return "--devices names host devices";
}

void write_text_atomic(const std::string& path, const std::string& text, const char* flag) {
  try {
    AtomicFile f{fs::path(path)};
    f.write(text.data(), text.size());
    f.commit();
  } catch (const Error& e) {
    fail("{} {}: cannot write it ({}); name a writable file", flag, path, e.what());
  }
}

// The written config read back by the reader `strata train --config` uses: it must mean the
// configuration chosen, or this is a bug and nothing is recommended.
void verify_config(const std::string& path, const TuneSpace& s, const TuneCandidate& c,
                   unsigned queue_depth) {
  const DsConfig ds = load_ds_config(path);
  const DsPlanSettings p = ds_plan_settings(ds, s.ranks, s.model);
  std::vector<std::string> wrong;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) wrong.push_back(what);
  };
  expect(ds.ignored.empty(), fmt::format("keys strata ignores: {}", fmt::join(ds.ignored, ", ")));
  expect(p.batch.micro_batch == c.micro_batch, "micro-batch");
  expect(p.batch.grad_accum == c.grad_accum, "gradient accumulation");
  expect(p.offload.param == c.param && p.offload.optimizer == c.optimizer && !p.offload.automatic,
         "offload devices");
  expect(p.offload.max_in_cpu == 0, "max_in_cpu");
  expect(p.prefetch_depth.value_or(1) == c.prefetch_depth, "prefetch depth");
  expect(p.offload_activations.value_or(false) == c.offload_activations,
         "activation_checkpointing.cpu_checkpointing");
  expect(p.param_dtype == s.param_dtype, "precision");
  expect(p.persistence_threshold == s.persistence_threshold, "persistence threshold");
  const bool off = c.param != Tier::gpu || c.optimizer != Tier::gpu;
  if (off) {
    expect(p.offload.buffer_count == c.buffer_count, "buffer_count");
    expect(p.offload.pin_memory == c.pin_memory, "pin_memory");
  }
  if (c.param == Tier::nvme || c.optimizer == Tier::nvme) {
    expect(p.offload.nvme_paths == s.nvme_paths, "nvme paths");
    expect(p.offload.nvme_stripe == s.nvme_stripe, "aio.block_size");
    if (queue_depth > 0) expect(p.offload.nvme_queue_depth == queue_depth, "aio.queue_depth");
  }
  if (!wrong.empty())
    fail(
        "the DeepSpeed config written to {} reads back with another {} than the configuration "
        "chosen ({}); this is a bug in strata tune, do not use the file",
        path, fmt::join(wrong, ", "), c.label());
}

std::string quote(const std::string& s) {
  if (s.find_first_of(" \t'\"$\\") == std::string::npos) return s;
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

ojson candidate_json(const TuneCandidate& c) {
  ojson j;
  j["offload_param"] = TuneCandidate::offload_name(c.param);
  j["offload_optimizer"] = TuneCandidate::offload_name(c.optimizer);
  j["micro_batch"] = c.micro_batch;
  j["grad_accum"] = c.grad_accum;
  j["prefetch_depth"] = c.prefetch_depth;
  j["buffer_count"] = c.buffer_count;
  j["pin_memory"] = c.pin_memory;
  j["activation_checkpointing"] = c.recompute;
  j["offload_activations"] = c.offload_activations ? "cpu" : "none";
  j["micro_batch_group"] = c.micro_batch_group;
  j["reduce_per_group"] = c.micro_batch_group > 1;
  j["update_during_backward"] = c.update_during_backward;
  j["fits"] = c.fits;
  if (!c.fits) j["why_not"] = c.why_not;
  j["memory"] = {{"gpu_per_device", c.needs.total(Tier::gpu)},
                 {"cpu", c.needs.total(Tier::cpu)},
                 {"nvme", c.needs.total(Tier::nvme)},
                 {"pinned", c.pinned_bytes},
                 {"host_ram", c.host_ram}};
  if (c.simulated) {
    j["step_s"] = c.step_s;
    j["tokens_per_s"] = c.tokens_per_s;
    j["critical_lane"] = c.critical_lane;
    j["overlap"] = c.overlap;
    j["extrapolated"] = c.extrapolated;
  }
  return j;
}

// What a model that fits nowhere would need, one line per choice, with the numbers.
[[noreturn]] void refuse(const TuneSpace& s, const TuneResult& r, const TierBudgets& b) {
  std::string m = fmt::format(
      "{} ({:.3g}B parameters) fits no placement on this machine at micro-batch 1 x {} tokens "
      "on {} {} device(s); nothing was measured. Per choice, its smallest setting and the first "
      "tier over budget:\n",
      s.model.name, double(parameter_count(s.model)) / 1e9, s.seq_len, s.ranks,
      s.host_devices ? "host" : "GPU");
  for (const TuneCandidate& c : r.refused)
    m += fmt::format("  P {:<4} O {:<4}  {}\n", TuneCandidate::offload_name(c.param),
                     TuneCandidate::offload_name(c.optimizer), c.why_not);
  for (const std::string& x : r.skipped) m += fmt::format("  skipped: {}\n", x);
  m += fmt::format(
      "budgets: {} per device, cpu {}, nvme {} free{}. To make it fit: add --nvme-path "
      "directories on drives with room (the parameters and optimizer state on NVMe need about "
      "{} B each parameter), a shorter --seq-len, more devices, or more memory "
      "(--cpu-memory, --device-memory)",
      format_bytes(b.gpu_memory), format_bytes(b.cpu_memory), format_bytes(b.nvme_free),
      s.nvme_paths.empty() ? " (no --nvme-path given)" : "", dtype_size(s.param_dtype) + 12);
  throw Error(m);
}

int run_tune(const TuneArgs& a) {
  const auto start = Clock::now();
  check_nvme_paths(a.nvme_paths);
  const bool tuning = !a.model.empty();
  if (!tuning) {
    for (const auto& [given, flag] : {std::pair{a.seq_len != kUnsetFlag, "--seq-len"},
                                      {a.global_batch != kUnsetFlag, "--global-batch"},
                                      {!a.offload_param.empty(), "--offload-param"},
                                      {!a.offload_optimizer.empty(), "--offload-optimizer"}})
      if (given) fail("{} describes the run to tune for; give --model too", flag);
  }
  std::optional<LlamaConfig> model;
  if (tuning) model = resolve_model(a.model);
  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  std::vector<Device*> ptrs;
  for (auto& d : devices) ptrs.push_back(d.get());
  const int R = static_cast<int>(ptrs.size());
  const bool host = ptrs.front()->backend() == Backend::host;
  const std::string device_text = a.devices.empty() ? (host ? "host" : "cuda:0") : a.devices;

  // ---- the run to tune for, and whether it fits anywhere (no rates needed) ----
  TuneSpace space;
  TierBudgets budgets;
  if (tuning) {
    space.model = *model;
    space.ranks = R;
    space.param_dtype = model_dtype(*ptrs.front(), a.dtype);
    space.optimizer = optimizer_flag(a.optimizer);
    if (space.param_dtype != DType::f32 && space.param_dtype != DType::bf16 &&
        space.param_dtype != DType::f16)
      fail("--dtype {}: expected f32, bf16 or f16", a.dtype);
    space.seq_len =
        count_flag("--seq-len", a.seq_len, std::min<int64_t>(model->max_position_embeddings, 1024),
                   "tokens per sequence");
    if (space.seq_len > model->max_position_embeddings)
      fail("--seq-len {}: the model's max_position_embeddings is {}; use at most that",
           space.seq_len, model->max_position_embeddings);
    space.global_batch = count_flag("--global-batch", a.global_batch, 0, "sequences per step");
    space.max_micro_batch =
        count_flag("--max-micro-batch", a.max_micro_batch, 16, "sequences per device");
    if (a.persistence_threshold >= 0)
      space.persistence_threshold = static_cast<uint64_t>(a.persistence_threshold);
    space.param_tiers = tiers_flag("--offload-param", a.offload_param);
    space.optimizer_tiers = tiers_flag("--offload-optimizer", a.offload_optimizer);
    for (int d : a.prefetch_depths)
      if (d < 1 || d > 4)
        fail(
            "--prefetch-depth {}: tune tries depths 1..4 (what stage3_prefetch_bucket_size "
            "expresses)",
            d);
    space.prefetch_depths = a.prefetch_depths;
    space.recompute = a.recompute;
    space.offload_activations.clear();
    for (const std::string& x : a.offload_activations)
      space.offload_activations.push_back(offload_activations_flag(x, std::nullopt));
    space.update_during_backward = a.update_during_backward;
    if (std::find(a.update_during_backward.begin(), a.update_during_backward.end(), true) !=
        a.update_during_backward.end())
      check_update_during_backward(0.0, space.param_dtype, "");  // fp16 is refused
    space.nvme_paths = a.nvme_paths;
    space.host_devices = host;
    budgets = local_budgets(ptrs.front()->memory().capacity, a.nvme_paths,
                            budget_flag("--cpu-memory", a.cpu_memory, "host RAM", "64GiB"));
    if (!a.pinned_memory.empty()) {
      const uint64_t cap =
          budget_flag("--pinned-memory", a.pinned_memory, "page-locked memory", "2GiB");
      if (budgets.pinned_limit == 0 || budgets.pinned_limit == kUnlimited ||
          cap < budgets.pinned_limit)
        budgets.pinned_limit = cap;
    }
    const TuneResult feasible = tune_search(space, budgets, nullptr);
    if (feasible.ranked.empty()) refuse(space, feasible, budgets);
  }

  // ---- measure (or read) the profile ----
  HardwareProfile profile;
  double measure_s = 0;
  if (!a.hardware.empty()) {
    profile = HardwareProfile::load(a.hardware);
  } else {
    const auto t0 = Clock::now();
    auto comm = make_communicator(ptrs);
    int64_t max_micro = 4;
    if (tuning) {
      max_micro = space.max_micro_batch;
      if (space.global_batch > 0) max_micro = std::min(max_micro, space.global_batch / R);
    }
    const Calibration cal =
        calibration_for(model, tuning ? space.seq_len : 0, max_micro, host, a.quick);
    MeasureSetup ms;
    ms.devices = ptrs;
    ms.comm = comm.get();
    ms.model = cal.config;
    ms.compute_note = cal.note;
    ms.micro_batch = cal.micro_batch;
    ms.seq_len = cal.tokens;
    ms.param_dtype = tuning ? space.param_dtype : model_dtype(*ptrs.front(), a.dtype);
    ms.grad_dtype = DType::f32;
    ms.nvme_paths = a.nvme_paths;
    ms.nvme_per_path = true;
    ms.cpu_adam_threads = a.threads;
    if (a.quick) {
      ms.transfer_bytes = 8ull << 20;
      ms.adam_elements = 1ull << 18;
      ms.repeats = 2;
      ms.nvme_min_seconds = 0.1;
      ms.nvme_settings = {{1ull << 20, 32}};
    } else {
      ms.transfer_bytes = 32ull << 20;
      ms.adam_elements = 1ull << 22;
      ms.repeats = 3;
      // DeepSpeed's aio default (1 MiB, 8), a deeper queue, and smaller blocks.
      ms.nvme_settings = {{128ull << 10, 32}, {1ull << 20, 8}, {1ull << 20, 32}};
    }
    profile = measure_hardware(ms);
    measure_s = since(t0);
    profile.name = fmt::format(
        "strata tune on {}: {} x {}{}", cpu_model(), R, ptrs.front()->name(),
        host ? fmt::format(" (host backend, no GPU: {})", no_gpu_reason()) : std::string());
    if (host) {
      // Honest about what these are: the host backend's lanes, not a GPU's.
      const std::string why =
          fmt::format("host backend (no GPU: {}); the rate of strata's host devices, not a GPU's: ",
                      no_gpu_reason());
      for (const char* k :
           {"gpu_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "gpu_adam_elements_per_s",
            "gpu_stats_elements_per_s", "task_latency_s"})
        profile.notes[k] = why + profile.notes[k];
    }
  }
  // Written, then read back by the simulator's reader.
  const bool write_profile = a.hardware.empty() || a.out_profile_given;
  if (write_profile) {
    write_text_atomic(a.out_profile, profile.to_json(), "--out-profile");
    const HardwareProfile back = HardwareProfile::load(a.out_profile);
    if (back.to_json() != profile.to_json())
      fail("--out-profile {}: the profile read back differs from the one written; do not use it",
           a.out_profile);
  }

  // ---- search ----
  TuneResult result;
  std::optional<TuneCandidate> best;
  ojson config;
  double search_s = 0;
  if (tuning) {
    if (profile.nvme_block_size > 0) space.nvme_stripe = profile.nvme_block_size;
    const auto t0 = Clock::now();
    result = tune_search(space, budgets, &profile);
    search_s = since(t0);
    if (result.ranked.empty() && !result.unsimulated.empty())
      fail("no configuration of {} that fits could be predicted from the profile {}: {}",
           space.model.name, a.hardware.empty() ? a.out_profile : a.hardware,
           fmt::join(result.unsimulated, "; "));
    if (result.ranked.empty())
      fail("no configuration of {} fits after measuring (budgets changed?); run strata tune again",
           space.model.name);
    best = result.ranked.front();
    config = tune_ds_config(space, *best, profile.nvme_queue_depth);
    write_text_atomic(a.out_config, config.dump(2) + "\n", "--out-config");
    verify_config(a.out_config, space, *best, profile.nvme_queue_depth);
  }

  // The table: the best of each parameter/optimizer choice (every candidate with --all), best
  // first.
  std::vector<TuneCandidate> shown;
  for (const TuneCandidate& c : result.ranked)
    if (a.all || std::none_of(shown.begin(), shown.end(), [&](const TuneCandidate& x) {
          return x.param == c.param && x.optimizer == c.optimizer;
        }))
      shown.push_back(c);

  std::string train_cmd;
  if (tuning) {
    train_cmd = fmt::format("strata train --model {} --config {} --seq-len {} --devices {}",
                            quote(a.model), quote(a.out_config), space.seq_len, device_text);
    if (!a.device_memory.empty()) train_cmd += " --device-memory " + a.device_memory;
    if (!a.dtype.empty()) train_cmd += " --dtype " + a.dtype;
    if (!a.optimizer.empty()) train_cmd += " --optimizer " + a.optimizer;
    if (!a.cpu_memory.empty()) train_cmd += " --cpu-memory " + a.cpu_memory;
    if (a.persistence_threshold >= 0)
      train_cmd += fmt::format(" --persistence-threshold {}", a.persistence_threshold);
    if (!best->recompute) train_cmd += " --activation-checkpointing off";
    if (best->micro_batch_group > 1)
      train_cmd +=
          fmt::format(" --micro-batch-group {} --reduce-per-group on", best->micro_batch_group);
    if (best->update_during_backward) train_cmd += " --update-during-backward on";
    train_cmd += " --data FILE --steps N";
    if (!fs::is_directory(a.model)) train_cmd += " --init random";
  }

  // ---- report ----
  if (a.json) {
    ojson j;
    j["devices"] = {{"spec", device_text},
                    {"count", R},
                    {"backend", host ? "host" : "cuda"},
                    {"name", ptrs.front()->name()}};
    j["gpu"] = host ? ojson{{"present", false}, {"why", no_gpu_reason()}}
                    : ojson{{"present", true}, {"name", cuda_runtime().gpus.front().name}};
    j["profile_file"] = write_profile ? a.out_profile : a.hardware;
    j["measured"] = a.hardware.empty();
    j["measure_s"] = measure_s;
    j["profile"] = ojson::parse(profile.to_json());
    if (tuning) {
      j["model"] = space.model.name;
      j["seq_len"] = space.seq_len;
      j["global_batch"] = space.global_batch;
      j["dtype"] = dtype_name(space.param_dtype);
      j["placed"] = result.placements;
      j["simulated"] = result.simulations;
      j["search_s"] = search_s;
      j["fitting"] = result.ranked.size();
      ojson cands = ojson::array();
      for (const TuneCandidate& c : shown) cands.push_back(candidate_json(c));
      j["candidates"] = cands;
      j["same_as"] = result.same_as;
      j["unsimulated"] = result.unsimulated;
      ojson refused = ojson::array();
      for (const TuneCandidate& c : result.refused) refused.push_back(candidate_json(c));
      j["refused"] = refused;
      j["skipped"] = result.skipped;
      j["recommended"] = candidate_json(*best);
      j["config_file"] = a.out_config;
      j["config"] = config;
      j["train_command"] = train_cmd;
    }
    j["total_s"] = since(start);
    fmt::print("{}\n", j.dump(2));
    return 0;
  }

  fmt::print("strata tune: {} device(s) {} ({}), CPU {} ({} threads), RAM {} available\n", R,
             device_text, host ? "host backend" : ptrs.front()->name(), cpu_model(),
             std::max(1u, std::thread::hardware_concurrency()),
             format_bytes(memory_info().available));
  if (host)
    fmt::print("  no GPU: {}; the device figures below are the host backend's\n", no_gpu_reason());
  if (a.hardware.empty())
    fmt::print("measured in {:.1f} s, every figure verified before it is kept{}:\n", measure_s,
               a.quick ? " (--quick: small transfers, 2 repeats)" : "");
  else
    fmt::print("profile read from {} ({}):\n", a.hardware, profile.name);
  const auto note_of = [&](const char* k) {
    const auto it = profile.notes.find(k);
    return it == profile.notes.end() ? std::string() : it->second;
  };
  const auto absent = [&](double v, const char* k) {
    std::string n = note_of(k);
    if (n.starts_with("absent: ")) n = n.substr(8);
    return v > 0 ? std::string() : "  (" + n + ")";
  };
  fmt::print("  {:<22} {:>16}{}\n", "compute", per_second(profile.gpu_flops, "FLOP"),
             absent(profile.gpu_flops, "gpu_flops"));
  fmt::print("  {:<22} {:>16}{}\n", "host -> device", per_second(profile.h2d_bytes_per_s, "B"),
             absent(profile.h2d_bytes_per_s, "h2d_bytes_per_s"));
  fmt::print("  {:<22} {:>16}{}\n", "device -> host", per_second(profile.d2h_bytes_per_s, "B"),
             absent(profile.d2h_bytes_per_s, "d2h_bytes_per_s"));
  fmt::print("  {:<22} {:>16}{}\n", "all-gather", per_second(profile.comm_bytes_per_s, "B"),
             absent(profile.comm_bytes_per_s, "comm_bytes_per_s"));
  fmt::print("  {:<22} {:>16}{}\n", "reduce-scatter", per_second(profile.reduce_bytes_per_s, "B"),
             profile.reduce_bytes_per_s > 0 || profile.comm_bytes_per_s == 0
                 ? absent(profile.reduce_bytes_per_s, "reduce_bytes_per_s")
                 : std::string("  (none of its own: at the all-gather's rate)"));
  fmt::print("  {:<22} {:>16}  (grad stats {})\n", "CPU Adam",
             per_second(profile.adam_elements_per_s, "elements"),
             per_second(profile.stats_elements_per_s, "elements"));
  fmt::print("  {:<22} {:>16}  (grad stats {}){}\n", "Adam on the device",
             per_second(profile.gpu_adam_elements_per_s, "elements"),
             per_second(profile.gpu_stats_elements_per_s, "elements"),
             absent(profile.gpu_adam_elements_per_s, "gpu_adam_elements_per_s"));
  if (profile.nvme_read_bytes_per_s > 0 || profile.nvme_write_bytes_per_s > 0) {
    fmt::print(
        "  {:<22} read {} + {} a call, write {} + {} a call (stripe {} KiB, queue depth {})\n",
        "nvme, all paths", per_second(profile.nvme_read_bytes_per_s, "B"),
        duration_text(profile.nvme_read_latency_s), per_second(profile.nvme_write_bytes_per_s, "B"),
        duration_text(profile.nvme_write_latency_s), profile.nvme_block_size / 1024,
        profile.nvme_queue_depth);
    for (const NvmePathRate& p : profile.nvme_paths)
      fmt::print("    {}: read {}, write {}{}\n", p.path, per_second(p.read_bytes_per_s, "B"),
                 per_second(p.write_bytes_per_s, "B"),
                 p.direct ? " (O_DIRECT)" : " (no O_DIRECT here: the page cache's speed)");
  } else {
    fmt::print("  {:<22} {:>16}{}\n", "nvme", "absent", absent(0, "nvme_read_bytes_per_s"));
  }
  fmt::print("  {:<22} {:>16}\n", "task latency", duration_text(profile.task_latency_s));
  if (write_profile)
    fmt::print("profile written to {} (notes say how each figure was measured)\n", a.out_profile);
  if (!tuning) {
    fmt::print("give --model (and --global-batch, --seq-len) for a recommended DeepSpeed config\n");
    return 0;
  }

  fmt::print(
      "\n{} on {} {} device(s), {}, seq-len {}, {}: {} placements checked, {} distinct fit, {} "
      "simulated in {:.2f} s (one step as the executor runs it)\n",
      space.model.name, R, host ? "host" : "GPU", dtype_name(space.param_dtype), space.seq_len,
      space.global_batch > 0 ? fmt::format("global batch {} sequences", space.global_batch)
                             : std::string("no --global-batch (accumulation 1)"),
      result.placements, result.ranked.size(), result.simulations, search_s);
  fmt::print("  {:>3} {:<5} {:<5} {:>12} {:>5} {:>4} {:>10} {:>10} {:>10} {:>10} {:>10}  {}\n", "#",
             "param", "optim", "micro x acc", "depth", "buf", "step", "tokens/s",
             host ? "device" : "gpu/dev", "cpu", "nvme", "critical lane");
  for (size_t i = 0; i < shown.size(); ++i) {
    const TuneCandidate& c = shown[i];
    const bool off = c.param != Tier::gpu || c.optimizer != Tier::gpu;
    fmt::print(
        "  {:>3} {:<5} {:<5} {:>12} {:>5} {:>4} {:>10} {:>10.4g} {:>10} {:>10} {:>10}  "
        "{}{}{}{}{}\n",
        i + 1, TuneCandidate::offload_name(c.param), TuneCandidate::offload_name(c.optimizer),
        fmt::format("{} x {}", c.micro_batch, c.grad_accum), c.prefetch_depth,
        off ? std::to_string(c.buffer_count) : std::string("-"),
        duration_text(c.step_s) + (c.extrapolated ? "*" : ""), c.tokens_per_s,
        format_bytes(c.needs.total(Tier::gpu)), format_bytes(c.needs.total(Tier::cpu)),
        format_bytes(c.needs.total(Tier::nvme)), c.critical_lane,
        c.pin_memory || !off ? "" : " (pin_memory false)",
        c.recompute ? (c.offload_activations ? " (activations in host RAM)" : "")
                    : " (no recompute)",
        c.micro_batch_group > 1 ? fmt::format(" (groups of {}, reduced once)", c.micro_batch_group)
                                : "",
        c.update_during_backward ? " (Adam during the backward)" : "");
  }
  if (!a.all && result.ranked.size() > shown.size())
    fmt::print("  (the best of each choice; {} candidates fit in all, --all lists them)\n",
               result.ranked.size());
  if (std::any_of(shown.begin(), shown.end(),
                  [](const TuneCandidate& c) { return c.extrapolated; }))
    fmt::print("  * extrapolated from {} micro-batches\n", kMaxSimulatedAccum);
  for (const TuneCandidate& c : result.refused)
    fmt::print("  does not fit: P {} O {} (micro-batch {}): {}\n",
               TuneCandidate::offload_name(c.param), TuneCandidate::offload_name(c.optimizer),
               c.micro_batch, c.why_not);
  for (const std::string& x : result.same_as) fmt::print("  not ranked: {}\n", x);
  for (const std::string& x : result.skipped) fmt::print("  not tried: {}\n", x);
  for (const std::string& x : result.unsimulated) fmt::print("  not predicted: {}\n", x);
  fmt::print("recommended: {}: predicted {} per step, {:.4g} tokens/s, critical lane {}\n",
             best->label(), duration_text(best->step_s), best->tokens_per_s, best->critical_lane);
  fmt::print(
      "DeepSpeed config written to {} (read back as strata train reads it); train with:\n  {}\n",
      a.out_config, train_cmd);
  return 0;
}

}  // namespace

Command add_tune(CLI::App& app) {
  auto a = std::make_shared<TuneArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "measure this machine (CPU Adam, NVMe per path, device copies and compute) into a hardware "
      "profile; with --model, recommend the fastest configuration that fits, as a DeepSpeed "
      "config for strata train");
  cmd->add_option("--nvme-path", a->nvme_paths,
                  "directories on the drives to measure and to swap to (one per drive)")
      ->delimiter(',');
  cmd->add_option("--devices", a->devices, "host:N, cuda or cuda:0,1 (default: cuda:0, else host)");
  cmd->add_option("--device-memory", a->device_memory, "cap of each device's memory");
  CLI::Option* out_profile =
      cmd->add_option("--out-profile", a->out_profile, "where the hardware profile JSON goes")
          ->capture_default_str();
  cmd->add_option("--hardware", a->hardware,
                  "use this profile (from an earlier strata tune) instead of measuring");
  cmd->add_option("--model", a->model, "Hugging Face checkpoint directory or preset to tune for");
  cmd->add_option("--seq-len", a->seq_len, "tokens per sequence (default: context, <= 1024)");
  cmd->add_option("--global-batch", a->global_batch,
                  "sequences per optimizer step over all devices (train_batch_size); default: "
                  "not fixed, accumulation 1");
  cmd->add_option("--max-micro-batch", a->max_micro_batch, "largest micro-batch to try")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "parameters: f32, bf16, f16 (default: f32 host, bf16 cuda)");
  cmd->add_option("--optimizer", a->optimizer,
                  "adamw (default), lion or adagrad: the optimizer state's bytes, and the command "
                  "it recommends");
  cmd->add_option("--offload-param", a->offload_param,
                  "parameter homes to try: none, cpu, nvme (default all)")
      ->delimiter(',');
  cmd->add_option("--offload-optimizer", a->offload_optimizer,
                  "optimizer homes to try: none, cpu, nvme (default all)")
      ->delimiter(',');
  cmd->add_option("--prefetch-depth", a->prefetch_depths, "prefetch depths to try (1..4)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--activation-checkpointing", a->recompute,
                  "activation checkpointing to try: on (recompute each block in backward), off "
                  "(keep its activations on the GPU) (default on,off)")
      ->delimiter(',')
      ->check(CLI::IsMember({"on", "off", "true", "false"}));
  cmd->add_option("--offload-activations", a->offload_activations,
                  "where the activation checkpoints may live, to try: none (on the GPU), cpu "
                  "(host RAM, copied out and back each micro-batch) (default none,cpu)")
      ->delimiter(',')
      ->check(CLI::IsMember({"none", "cpu"}));
  cmd->add_option("--update-during-backward", a->update_during_backward,
                  "CPU Adam updating each unit during the backward, to try: off, on, or on,off "
                  "(default off; on means no gradient clipping, and a non-finite gradient stops "
                  "the run instead of skipping the step)")
      ->delimiter(',')
      ->check(CLI::IsMember({"on", "off", "true", "false"}));
  cmd->add_option("--cpu-memory", a->cpu_memory,
                  "host RAM a run may use (default: 80% of what is available)");
  cmd->add_option("--pinned-memory", a->pinned_memory,
                  "page-locked memory a run may use (default and most: ulimit -l)");
  cmd->add_option("--persistence-threshold", a->persistence_threshold,
                  "units of at most this many elements stay whole on every device (100000)");
  cmd->add_option("--threads", a->threads, "CPU Adam threads (0: every CPU)");
  cmd->add_flag("--all", a->all,
                "list every candidate that fits, not only the best of each offload choice");
  cmd->add_option("--out-config", a->out_config, "where the recommended DeepSpeed config goes")
      ->capture_default_str();
  cmd->add_flag("--quick", a->quick, "small transfers and 2 repeats: about a second");
  cmd->add_flag("--json", a->json, "one JSON object: the profile, candidates, recommendation");
  return {cmd, [a, out_profile] {
            a->out_profile_given = out_profile->count() > 0;
            return run_tune(*a);
          }};
}

}  // namespace strata::cli
