// ds_config.cpp: see ds_config.h. Each section is read by one function that walks its keys:
// a key it knows is checked and stored, any other key is recorded in `ignored`. "auto" is
// taken only where Hugging Face's integration writes it (the `Auto::ok` arguments below).
#include "train/ds_config.h"

#include "core/error.h"
#include "model/file_io.h"
#include "nvme/swap_store.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

namespace strata {
namespace {

using nlohmann::json;

enum class Auto { no, ok };

// The path of `key` inside `parent` ("zero_optimization.offload_param.device").
std::string path_of(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

class Reader {
 public:
  Reader(std::string_view source, std::vector<std::string>& ignored,
         std::vector<std::string>& autos)
      : source_(source), ignored_(ignored), autos_(autos) {}

  [[noreturn]] void bad(const std::string& path, const json& v, std::string_view expected) const {
    fail("DeepSpeed config {}: {} is {}; expected {}", source_, path, v.dump(), expected);
  }
  bool is_auto(const json& v, const std::string& path, Auto a, std::string_view expected) const {
    if (!v.is_string() || v.get<std::string>() != "auto") return false;
    if (a == Auto::no)
      fail(
          "DeepSpeed config {}: {} is \"auto\", which strata cannot resolve here (Hugging Face "
          "writes \"auto\" only for batch sizes, precision, optimizer and scheduler values and "
          "the stage-3 bucket sizes); expected {}",
          source_, path, expected);
    autos_.push_back(path);
    return true;
  }
  const json& object(const json& v, const std::string& path) const {
    if (!v.is_object()) bad(path, v, "an object");
    return v;
  }
  void ignore(const std::string& path) { ignored_.push_back(path); }

  std::optional<bool> boolean(const json& v, const std::string& path, Auto a = Auto::no) const {
    if (is_auto(v, path, a, "true or false")) return std::nullopt;
    if (!v.is_boolean()) bad(path, v, a == Auto::ok ? "true, false or \"auto\"" : "true or false");
    return v.get<bool>();
  }
  // A whole number within [lo, hi]; 1e9 and 5.0 count (DeepSpeed configs write sizes so).
  std::optional<int64_t> integer(const json& v, const std::string& path, int64_t lo, int64_t hi,
                                 Auto a = Auto::no) const {
    const std::string expected =
        hi == std::numeric_limits<int64_t>::max()
            ? fmt::format("a whole number >= {}{}", lo, a == Auto::ok ? " or \"auto\"" : "")
            : fmt::format("a whole number in {}..{}{}", lo, hi,
                          a == Auto::ok ? " or \"auto\"" : "");
    if (is_auto(v, path, a, expected)) return std::nullopt;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() &&
          v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        bad(path, v, expected);
      const int64_t n = v.get<int64_t>();
      if (n < lo || n > hi) bad(path, v, expected);
      return n;
    }
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || d < double(lo) || d > double(hi) ||
          d >= 9.2e18)
        bad(path, v, expected);
      return static_cast<int64_t>(d);
    }
    bad(path, v, expected);
  }
  std::optional<uint64_t> count(const json& v, const std::string& path, Auto a = Auto::no) const {
    const auto n = integer(v, path, 0, std::numeric_limits<int64_t>::max(), a);
    if (!n) return std::nullopt;
    return static_cast<uint64_t>(*n);
  }
  std::optional<int> small(const json& v, const std::string& path, int lo, int hi,
                           Auto a = Auto::no) const {
    const auto n = integer(v, path, lo, hi, a);
    if (!n) return std::nullopt;
    return static_cast<int>(*n);
  }
  std::optional<double> real(const json& v, const std::string& path, double lo, Auto a = Auto::no,
                             bool lo_open = false) const {
    const std::string expected = fmt::format("a number {} {}{}", lo_open ? ">" : ">=", lo,
                                             a == Auto::ok ? " or \"auto\"" : "");
    if (is_auto(v, path, a, expected)) return std::nullopt;
    if (!v.is_number()) bad(path, v, expected);
    const double d = v.get<double>();
    if (!std::isfinite(d) || d < lo || (lo_open && d == lo)) bad(path, v, expected);
    return d;
  }
  std::string text(const json& v, const std::string& path, std::string_view expected) const {
    if (!v.is_string()) bad(path, v, expected);
    return v.get<std::string>();
  }
  std::string one_of(const json& v, const std::string& path,
                     std::initializer_list<std::string_view> allowed, bool any_case = false) const {
    std::string expected;
    for (std::string_view a : allowed)
      expected += fmt::format("{}\"{}\"", expected.empty() ? "one of " : ", ", a);
    if (!v.is_string()) bad(path, v, expected);
    std::string s = v.get<std::string>();
    for (std::string_view a : allowed) {
      const bool same =
          any_case ? std::equal(s.begin(), s.end(), a.begin(), a.end(),
                                [](char x, char y) { return std::tolower(x) == std::tolower(y); })
                   : s == a;
      if (same) return std::string(a);
    }
    bad(path, v, expected);
  }

 private:
  std::string source_;
  std::vector<std::string>& ignored_;
  std::vector<std::string>& autos_;
};

void read_offload(Reader& r, const json& v, const std::string& path, DsOffload& o) {
  r.object(v, path);
  o.present = true;
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of(path, key);
    if (key == "device") {
      if (value.is_string() && value.get<std::string>() == "auto") {
        o.device_auto = true;
        continue;
      }
      o.device = parse_tier(r.one_of(value, p, {"none", "cpu", "nvme"}));
    } else if (key == "nvme_path") {
      if (value.is_string()) {
        o.nvme_path = {value.get<std::string>()};
      } else if (value.is_array() && !value.empty() &&
                 std::all_of(value.begin(), value.end(),
                             [](const json& e) { return e.is_string(); })) {
        for (const json& e : value) o.nvme_path.push_back(e.get<std::string>());
      } else {
        r.bad(p, value, "a directory, or a list of directories (one per drive)");
      }
      for (const std::string& d : o.nvme_path)
        if (d.empty()) r.bad(p, value, "a non-empty directory");
    } else if (key == "pin_memory") {
      o.pin_memory = r.boolean(value, p);
    } else if (key == "buffer_count") {
      o.buffer_count = r.small(value, p, 1, 1 << 16);
    } else if (key == "buffer_size") {
      // Checked, then listed as not acted on: a pinned buffer carries a unit's whole transfer
      // (placement.h), so its size follows from the model, not from this key.
      o.buffer_size = r.count(value, p);
      if (*o.buffer_size == 0) r.bad(p, value, "a number of elements >= 1");
      r.ignore(p);
    } else if (key == "max_in_cpu") {
      o.max_in_cpu = r.count(value, p);
    } else {
      r.ignore(p);  // ratio, fast_init, pipeline_read, ...
    }
  }
  // DeepSpeed reads max_in_cpu only for parameters homed on NVMe (params_in_nvme_and_cpu);
  // strata's `auto` takes it as a cap on the parameters it places in host RAM.
  const bool acted_on =
      path.ends_with("offload_param") && (o.device == Tier::nvme || o.device_auto);
  if (o.max_in_cpu && !acted_on) {
    o.max_in_cpu.reset();
    r.ignore(path_of(path, "max_in_cpu"));
  }
}

void read_zero(Reader& r, const json& v, DsConfig::Zero& z) {
  const std::string path = "zero_optimization";
  r.object(v, path);
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of(path, key);
    if (key == "stage")
      z.stage = r.small(value, p, 0, 3);
    else if (key == "offload_param")
      read_offload(r, value, p, z.offload_param);
    else if (key == "offload_optimizer")
      read_offload(r, value, p, z.offload_optimizer);
    else if (key == "stage3_prefetch_bucket_size")
      z.stage3_prefetch_bucket_size = r.count(value, p, Auto::ok);
    else if (key == "stage3_max_live_parameters")
      z.stage3_max_live_parameters = r.count(value, p);
    else if (key == "stage3_param_persistence_threshold")
      z.stage3_param_persistence_threshold = r.count(value, p, Auto::ok);
    else if (key == "sub_group_size") {  // checked, not acted on: CPU Adam goes unit by unit
      r.count(value, p);
      r.ignore(p);
    } else if (key == "overlap_comm") {  // checked, not acted on: strata always overlaps
      r.boolean(value, p);
      r.ignore(p);
    } else
      r.ignore(p);  // contiguous_gradients, reduce_bucket_size, stage3_max_reuse_distance, ...
  }
}

void read_optimizer(Reader& r, const json& v, DsConfig::Optimizer& o) {
  r.object(v, "optimizer");
  o.present = true;
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of("optimizer", key);
    if (key == "type") {
      o.type = r.one_of(value, p, {"Adam", "AdamW", "Lion", "Adagrad"}, true);
    } else if (key == "params") {
      r.object(value, p);
      for (const auto& [k, x] : value.items()) {
        const std::string q = path_of(p, k);
        if (k == "lr") {
          o.lr = r.real(x, q, 0.0, Auto::ok);
        } else if (k == "betas") {
          if (r.is_auto(x, q, Auto::ok, "")) continue;
          if (!x.is_array() || x.size() != 2 || !x[0].is_number() || !x[1].is_number())
            r.bad(q, x, "two numbers in [0, 1), e.g. [0.9, 0.999], or \"auto\"");
          const double b1 = x[0].get<double>(), b2 = x[1].get<double>();
          if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1))
            r.bad(q, x, "two numbers in [0, 1), e.g. [0.9, 0.999], or \"auto\"");
          o.betas = std::array<double, 2>{b1, b2};
        } else if (k == "eps") {
          o.eps = r.real(x, q, 0.0, Auto::ok, true);
        } else if (k == "weight_decay") {
          o.weight_decay = r.real(x, q, 0.0, Auto::ok);
        } else if (k == "adam_w_mode") {
          o.adam_w_mode = r.boolean(x, q);
        } else if (k == "bias_correction") {
          o.bias_correction = r.boolean(x, q);
        } else if (k == "lr_decay") {  // Adagrad's (torch's; DeepSpeed's CPU Adagrad ignores it)
          if (r.real(x, q, 0.0) != 0.0)
            r.bad(q, x,
                  "0: strata's Adagrad, as DeepSpeed's CPU Adagrad, runs without lr_decay; "
                  "shape the rate with a scheduler instead");
        } else if (k == "amsgrad") {
          if (r.boolean(x, q).value_or(false))
            r.bad(q, x,
                  "false: DeepSpeed's Adam (CPU and fused alike) does not run AMSGrad, and "
                  "neither does strata; set it false or remove it");
        } else {
          r.ignore(q);  // torch_adam, ...
        }
      }
    } else {
      r.ignore(p);
    }
  }
  // Each type takes the params of its DeepSpeed constructor; another is a TypeError there.
  const std::string type = o.type.value_or("Adam");
  if ((type == "Lion" || type == "Adagrad") && v.contains("params")) {
    const json& params = v["params"];
    const std::vector<const char*> refused =
        type == "Lion" ? std::vector<const char*>{"eps", "adam_w_mode", "bias_correction",
                                                  "amsgrad", "lr_decay"}
                       : std::vector<const char*>{"betas", "adam_w_mode", "bias_correction"};
    for (const char* k : refused)
      if (params.is_object() && params.contains(k))
        r.bad(path_of(path_of("optimizer", "params"), k), params[k],
              type == "Lion"
                  ? "no such setting: DeepSpeed's Lion takes lr, betas and weight_decay (decay "
                    "always decoupled, no eps); remove it"
                  : "no such setting: DeepSpeed's Adagrad takes lr, eps and weight_decay (decay "
                    "always added to the gradient, no betas); remove it");
  }
}

void read_scheduler(Reader& r, const json& v, DsConfig::Scheduler& s) {
  r.object(v, "scheduler");
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of("scheduler", key);
    if (key == "type") {
      s.type = r.one_of(value, p,
                        {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"});
    } else if (key == "params") {
      r.object(value, p);
      for (const auto& [k, x] : value.items()) {
        const std::string q = path_of(p, k);
        if (k == "warmup_min_lr") {
          s.warmup_min_lr = r.real(x, q, 0.0, Auto::ok);
        } else if (k == "warmup_max_lr") {
          s.warmup_max_lr = r.real(x, q, 0.0, Auto::ok);
          s.warmup_max_lr_auto = !s.warmup_max_lr;
        } else if (k == "warmup_num_steps") {
          s.warmup_num_steps = r.integer(x, q, 0, std::numeric_limits<int64_t>::max(), Auto::ok);
          s.warmup_num_steps_auto = !s.warmup_num_steps;
        } else if (k == "total_num_steps") {
          s.total_num_steps = r.integer(x, q, 1, std::numeric_limits<int64_t>::max(), Auto::ok);
        } else if (k == "warmup_type") {
          s.warmup_type = r.one_of(x, q, {"log", "linear"});
        } else if (k == "warmup_min_ratio") {
          s.warmup_min_ratio = r.real(x, q, 0.0, Auto::ok);
        } else if (k == "cos_min_ratio") {
          s.cos_min_ratio = r.real(x, q, 0.0, Auto::ok);
        } else if (k == "cycle_min_lr") {  // OneCycle's: Hugging Face fills no "auto" here
          s.cycle_min_lr = r.real(x, q, 0.0);
        } else if (k == "cycle_max_lr") {
          s.cycle_max_lr = r.real(x, q, 0.0);
        } else if (k == "decay_lr_rate") {
          s.decay_lr_rate = r.real(x, q, 0.0);
        } else if (k == "cycle_first_step_size") {
          s.cycle_first_step_size = r.integer(x, q, 1, std::numeric_limits<int64_t>::max());
        } else if (k == "cycle_second_step_size") {
          if (!x.is_null())  // DeepSpeed's default: the first's
            s.cycle_second_step_size = r.integer(x, q, 0, std::numeric_limits<int64_t>::max());
        } else if (k == "decay_step_size") {
          s.decay_step_size = r.integer(x, q, 0, std::numeric_limits<int64_t>::max());
        } else if (k == "cycle_momentum") {
          s.cycle_momentum = r.boolean(x, q);
        } else if (k == "cycle_min_mom") {
          s.cycle_min_mom = r.real(x, q, 0.0);
        } else if (k == "cycle_max_mom") {
          s.cycle_max_mom = r.real(x, q, 0.0);
        } else if (k == "decay_mom_rate") {
          s.decay_mom_rate = r.real(x, q, 0.0);
        } else if (k == "cycle_first_stair_count" || k == "cycle_second_stair_count") {
          if (!x.is_null()) r.integer(x, q, 0, std::numeric_limits<int64_t>::max());
          r.ignore(q);  // kept by DeepSpeed's OneCycle, and used nowhere
        } else if (k == "lr_range_test_min_lr") {
          s.lr_range_test_min_lr = r.real(x, q, 0.0);
        } else if (k == "lr_range_test_step_size") {
          s.lr_range_test_step_size = r.integer(x, q, 1, std::numeric_limits<int64_t>::max());
        } else if (k == "lr_range_test_step_rate") {
          s.lr_range_test_step_rate = r.real(x, q, 0.0);
        } else if (k == "lr_range_test_staircase") {
          s.lr_range_test_staircase = r.boolean(x, q);
        } else {
          r.ignore(q);  // last_batch_iteration, ...
        }
      }
    } else {
      r.ignore(p);
    }
  }
}

void read_fp16(Reader& r, const json& v, DsConfig::Fp16& f) {
  r.object(v, "fp16");
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of("fp16", key);
    if (key == "enabled")
      f.enabled = r.boolean(value, p, Auto::ok);
    else if (key == "loss_scale")
      f.loss_scale = r.real(value, p, 0.0);
    else if (key == "initial_scale_power")
      f.initial_scale_power = r.small(value, p, 0, 127);
    else if (key == "loss_scale_window")
      f.loss_scale_window = r.integer(value, p, 1, std::numeric_limits<int64_t>::max());
    else if (key == "hysteresis")
      f.hysteresis = r.small(value, p, 1, 1 << 20);
    else if (key == "consecutive_hysteresis")
      f.consecutive_hysteresis = r.boolean(value, p);
    else if (key == "min_loss_scale")
      f.min_loss_scale = r.real(value, p, 0.0, Auto::no, true);
    else
      r.ignore(p);  // auto_cast, ...
  }
}

void read_aio(Reader& r, const json& v, DsConfig::Aio& a) {
  r.object(v, "aio");
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of("aio", key);
    if (key == "block_size") {
      a.block_size = r.count(value, p);
      // At most the swap store's largest stripe (nvme/swap_store.h).
      if (*a.block_size == 0 || *a.block_size % 4096 != 0 ||
          *a.block_size > nvme::SwapStore::kMaxStripe)
        r.bad(p, value,
              "a positive multiple of 4096 bytes up to 268435456 (256 MiB), e.g. 1048576");
    } else if (key == "queue_depth") {
      a.queue_depth = r.small(value, p, 1, 4096);
    } else if (key == "intra_op_parallelism" || key == "thread_count") {
      // Checked, then not acted on: the swap store runs one ring per lane that moves data.
      r.small(value, p, 1, 1024);
      r.ignore(p);
    } else if (key == "single_submit" || key == "overlap_events") {
      r.boolean(value, p);  // checked; io_uring submits in batches and overlaps always
      r.ignore(p);
    } else {
      r.ignore(p);  // use_gds, ...
    }
  }
}

// "tensorboard" or "csv_monitor": DeepSpeed's monitor sections. Writing where no one asked is
// never done: without enabled true the section changes nothing.
void read_monitor(Reader& r, const json& v, const std::string& section, MonitorTarget& m) {
  r.object(v, section);
  for (const auto& [key, value] : v.items()) {
    const std::string p = path_of(section, key);
    if (key == "enabled") {
      m.enabled = *r.boolean(value, p);
    } else if (key == "output_path") {
      m.output_path = r.text(value, p, "a directory, as a string");
    } else if (key == "job_name") {
      m.job_name = r.text(value, p, "a directory name, as a string");
      if (m.job_name.empty() || m.job_name.find('/') != std::string::npos || m.job_name == "." ||
          m.job_name == "..")
        r.bad(p, value, "one directory's name (no '/'; output_path says where it goes)");
    } else {
      r.ignore(p);
    }
  }
}

}  // namespace

bool DsConfig::Optimizer::decoupled_weight_decay() const {
  if (type && (*type == "AdamW" || *type == "Lion")) return true;
  if (type && *type == "Adagrad") return false;
  return adam_w_mode.value_or(true);
}

OptimizerType DsConfig::Optimizer::optimizer_type() const {
  if (type && *type == "Lion") return OptimizerType::lion;
  if (type && *type == "Adagrad") return OptimizerType::adagrad;
  return OptimizerType::adam;
}

DsConfig parse_ds_config(const json& j, std::string_view source) {
  DsConfig c;
  c.source = std::string(source);
  Reader r(source, c.ignored, c.autos);
  if (!j.is_object())
    fail("DeepSpeed config {}: the top level is {}; expected a JSON object", source, j.type_name());
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  bool saw_bf16 = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "train_batch_size") {
      c.train_batch_size = r.integer(value, key, 1, kMax, Auto::ok);
    } else if (key == "train_micro_batch_size_per_gpu") {
      c.train_micro_batch_size_per_gpu = r.integer(value, key, 1, kMax, Auto::ok);
    } else if (key == "gradient_accumulation_steps") {
      c.gradient_accumulation_steps = r.integer(value, key, 1, kMax, Auto::ok);
    } else if (key == "gradient_clipping") {
      c.gradient_clipping = r.real(value, key, 0.0, Auto::ok);
    } else if (key == "steps_per_print") {
      c.steps_per_print = r.integer(value, key, 1, kMax);
    } else if (key == "bf16" || key == "bfloat16") {
      if (saw_bf16)
        fail(
            "DeepSpeed config {}: both bf16 and bfloat16 are given; they are the same section, "
            "keep one",
            source);
      saw_bf16 = true;
      r.object(value, key);
      for (const auto& [k, x] : value.items()) {
        if (k == "enabled")
          c.bf16_enabled = r.boolean(x, path_of(key, k), Auto::ok);
        else
          r.ignore(path_of(key, k));  // immediate_grad_update, ...
      }
    } else if (key == "fp16") {
      read_fp16(r, value, c.fp16);
    } else if (key == "data_types") {
      r.object(value, key);
      for (const auto& [k, x] : value.items()) {
        const std::string p = path_of(key, k);
        if (k != "grad_accum_dtype") {
          r.ignore(p);
          continue;
        }
        const std::string t = r.text(x, p, "\"fp32\", \"bf16\" or \"fp16\"");
        if (t == "fp32" || t == "float32")
          c.grad_accum_dtype = DType::f32;
        else if (t == "bf16" || t == "bfloat16")
          c.grad_accum_dtype = DType::bf16;
        else if (t == "fp16" || t == "float16")
          c.grad_accum_dtype = DType::f16;
        else
          fail("DeepSpeed config {}: {} is '{}'; expected \"fp32\", \"bf16\" or \"fp16\"", source,
               p, t);
      }
    } else if (key == "optimizer") {
      read_optimizer(r, value, c.optimizer);
    } else if (key == "scheduler") {
      read_scheduler(r, value, c.scheduler);
    } else if (key == "zero_optimization") {
      read_zero(r, value, c.zero);
    } else if (key == "aio") {
      read_aio(r, value, c.aio);
    } else if (key == "activation_checkpointing") {
      r.object(value, key);
      for (const auto& [k, x] : value.items()) {
        if (k == "cpu_checkpointing")
          c.cpu_checkpointing = r.boolean(x, path_of(key, k));
        else
          r.ignore(path_of(key, k));  // partition_activations, number_checkpoints, ...
      }
    } else if (key == "tensorboard") {
      read_monitor(r, value, key, c.monitor.tensorboard);
    } else if (key == "csv_monitor") {
      read_monitor(r, value, key, c.monitor.csv);
    } else {
      r.ignore(key);  // wall_clock_breakdown, zero_allow_untested_optimizer, ...
    }
  }
  if (c.bf16_enabled.value_or(false) && c.fp16.enabled.value_or(false))
    fail(
        "DeepSpeed config {}: bf16.enabled and fp16.enabled are both true; enable one "
        "precision",
        source);
  return c;
}

DsConfig load_ds_config(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail("DeepSpeed config {}: is a directory; give --config the JSON file itself", path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in)
    fail("DeepSpeed config {}: cannot be opened; check the path given to --config", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad())
    fail("DeepSpeed config {}: read failed; check the file and the disk", path.string());
  // Strict JSON: a key given twice (one of the two values would be ignored) or nesting no
  // config has is an error naming the file.
  const json j = parse_json_strict(text.str(), fmt::format("DeepSpeed config {}", path.string()));
  return parse_ds_config(j, path.string());
}

namespace {

// a x b for the batch checks; the config's counts go up to 2^63 - 1, so the product may not
// fit, and no run has batches that large.
int64_t batch_product(const DsConfig& c, std::string_view what, int64_t a, int64_t b) {
  int64_t p = 0;
  if (__builtin_mul_overflow(a, b, &p))
    fail(
        "DeepSpeed config {}: {} = {} x {} does not fit a 64-bit count; no run has batches "
        "that large, fix the batch sizes",
        c.source, what, a, b);
  return p;
}

}  // namespace

DsBatch resolve_ds_batch(const DsConfig& c, int world) {
  if (world < 1) fail("world size {}: at least 1 GPU", world);
  const int64_t w = world;
  const auto& tb = c.train_batch_size;
  const auto& mb = c.train_micro_batch_size_per_gpu;
  const auto& ga = c.gradient_accumulation_steps;
  DsBatch b;
  if (tb && mb && ga) {
    const int64_t per_gpu =
        batch_product(c, "train_micro_batch_size_per_gpu x gradient_accumulation_steps", *mb, *ga);
    const int64_t all = batch_product(
        c, "train_micro_batch_size_per_gpu x gradient_accumulation_steps x GPUs", per_gpu, w);
    if (*tb != all)
      fail(
          "DeepSpeed config {}: train_batch_size {} != train_micro_batch_size_per_gpu {} x "
          "gradient_accumulation_steps {} x {} GPU(s) = {}; make the three agree (or set one "
          "to \"auto\")",
          c.source, *tb, *mb, *ga, w, all);
    b.micro_batch = mb;
    b.grad_accum = ga;
  } else if (tb && mb) {
    const int64_t all = batch_product(c, "train_micro_batch_size_per_gpu x GPUs", *mb, w);
    if (*tb % all != 0)
      fail(
          "DeepSpeed config {}: train_batch_size {} is not a multiple of "
          "train_micro_batch_size_per_gpu {} x {} GPU(s); change one of them",
          c.source, *tb, *mb, w);
    b.micro_batch = mb;
    b.grad_accum = *tb / all;
  } else if (tb && ga) {
    const int64_t all = batch_product(c, "gradient_accumulation_steps x GPUs", *ga, w);
    if (*tb % all != 0)
      fail(
          "DeepSpeed config {}: train_batch_size {} is not a multiple of "
          "gradient_accumulation_steps {} x {} GPU(s); change one of them",
          c.source, *tb, *ga, w);
    b.micro_batch = *tb / all;
    b.grad_accum = ga;
  } else if (tb) {
    if (*tb % w != 0)
      fail(
          "DeepSpeed config {}: train_batch_size {} is not a multiple of the {} GPU(s); change "
          "it",
          c.source, *tb, w);
    b.micro_batch = *tb / w;
    b.grad_accum = 1;
  } else {
    b.micro_batch = mb;
    b.grad_accum = ga;
  }
  return b;
}

DsPlanSettings ds_plan_settings(const DsConfig& c, int world, const LlamaConfig& model) {
  DsPlanSettings s;
  s.batch = resolve_ds_batch(c, world);
  const DsOffload& op = c.zero.offload_param;
  const DsOffload& oo = c.zero.offload_optimizer;
  OffloadRequest& r = s.offload;
  r.automatic = op.device_auto || oo.device_auto;
  r.param = op.device.value_or(Tier::gpu);
  r.optimizer = oo.device.value_or(Tier::gpu);
  // DeepSpeed's default for parameters on NVMe: each rank keeps its first 1e9 elements in CPU
  // memory. `auto` has no cap unless one is given.
  r.max_in_cpu = op.max_in_cpu.value_or(op.device == Tier::nvme ? kDeepSpeedMaxInCpu : 0);
  // One pool serves both directions: the larger of the two counts the config asks for.
  const bool p_off = r.param != Tier::gpu, o_off = r.optimizer != Tier::gpu;
  int count = 0;
  if (op.buffer_count && (p_off || !o_off)) count = std::max(count, *op.buffer_count);
  if (oo.buffer_count && (o_off || !p_off)) count = std::max(count, *oo.buffer_count);
  if (count > 0) r.buffer_count = count;
  // DeepSpeed pins only when asked (its default is false); with no offload section at all
  // strata keeps its own default.
  if (op.present || oo.present)
    r.pin_memory =
        (p_off && op.pin_memory.value_or(false)) || (o_off && oo.pin_memory.value_or(false)) ||
        (!p_off && !o_off && (op.pin_memory.value_or(false) || oo.pin_memory.value_or(false)));
  for (const DsOffload* o : {&op, &oo})
    for (const std::string& d : o->nvme_path)
      if (std::find(r.nvme_paths.begin(), r.nvme_paths.end(), d) == r.nvme_paths.end())
        r.nvme_paths.push_back(d);
  if (c.aio.block_size) r.nvme_stripe = *c.aio.block_size;
  if (c.aio.queue_depth) r.nvme_queue_depth = static_cast<unsigned>(*c.aio.queue_depth);

  if (c.bf16_enabled.value_or(false))
    s.param_dtype = DType::bf16;
  else if (c.fp16.enabled.value_or(false))
    s.param_dtype = DType::f16;
  else if (c.bf16_enabled.has_value() || c.fp16.enabled.has_value())
    s.param_dtype = DType::f32;  // turned off and neither on: DeepSpeed trains in fp32
  s.grad_dtype = c.grad_accum_dtype;
  s.optimizer = c.optimizer.optimizer_type();
  s.persistence_threshold = c.zero.stage3_param_persistence_threshold;
  s.offload_activations = c.cpu_checkpointing;

  if (c.zero.stage3_prefetch_bucket_size) {
    const ModelLayout layout = ModelLayout::build(model);
    uint64_t largest = 1;
    for (const UnitLayout& u : layout.units) largest = std::max(largest, u.numel);
    uint64_t depth = std::clamp<uint64_t>(*c.zero.stage3_prefetch_bucket_size / largest, 1, 4);
    // max_live_parameters bounds what is gathered at once: the unit in use and those ahead.
    if (c.zero.stage3_max_live_parameters && *c.zero.stage3_max_live_parameters > 0) {
      const uint64_t live = *c.zero.stage3_max_live_parameters / largest;
      depth = std::min(depth, std::max<uint64_t>(live, 2) - 1);
    }
    s.prefetch_depth = static_cast<int>(depth);
  }
  return s;
}

}  // namespace strata
