// train.cpp: `strata train`, the command line over src/train/trainer.h.
//
// Every setting comes from, in order: its flag, the DeepSpeed config (--config; "auto" counts
// as unset), then a default (DeepSpeed's where it has one). Keys of the config strata does not
// act on are listed once on stderr. The resolved settings are saved in every checkpoint.
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "device_args.h"
#include "model/config.h"
#include "model/tokens.h"
#include "train/ds_config.h"
#include "train/trainer.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>

namespace strata::cli {
namespace {

namespace fs = std::filesystem;

struct TrainArgs {
  std::string model, init, config, data_dtype, run_dir, dtype, grad_dtype, devices, device_memory;
  std::string loss_mask = "auto", packing = "auto";
  std::vector<std::string> data, nvme_paths;
  uint64_t seed = 1;
  int64_t steps = 0, micro_batch = kUnsetFlag, grad_accum = kUnsetFlag, seq_len = kUnsetFlag;
  int64_t vocab_pieces = 0;
  double epochs = 0;
  double lr = NAN, weight_decay = NAN, clip = NAN, eps = NAN;  // NaN: not given
  double adam_beta1 = NAN, adam_beta2 = NAN;
  std::string optimizer, optim, lr_schedule, lr_scheduler_kwargs;
  std::string save_strategy, eval_strategy;  // Hugging Face's; empty: not given
  int64_t warmup_steps = kUnsetFlag;
  double warmup_ratio = NAN;  // NaN: not given
  std::string offload_param, offload_optimizer, offload_gradients, cpu_memory, pinned_memory;
  int64_t prefetch_depth = kUnsetFlag;
  bool recompute = true;  // --activation-checkpointing
  bool recompute_given = false;
  // Hugging Face's booleans (--bf16, --bf16 True, --bf16 false); empty: not given.
  std::string hf_bf16, hf_fp16, hf_tf32, hf_gradient_checkpointing;
  std::string offload_activations;
  int64_t micro_batch_group = kUnsetFlag;
  bool update_during_backward = false;
  bool reduce_per_group = false;
  int64_t persistence_threshold = -1;
  int threads = 0;
  int64_t save_every = 0, steps_per_print = 0;
  int keep = 3;
  bool resume = false, resume_fallback = false;
  std::string resume_from;
  std::string trace, tensorboard_dir, csv_monitor_dir;
  std::vector<std::string> report_to;  // Hugging Face's; with logging_dir, its TensorBoard's
  std::string logging_dir;
  std::vector<std::string> eval_data;
  int64_t eval_every = 0, eval_sequences = 0;
};

// The numbers a user can get wrong by sign: each flag given must be finite and >= 0 (a
// negative count or rate has no meaning; 0 is each one's "none").
void check_train_numbers(const TrainArgs& a) {
  for (const auto& [flag, v] :
       {std::pair{"--lr", a.lr}, std::pair{"--weight-decay", a.weight_decay},
        std::pair{"--clip", a.clip}, std::pair{"--eps", a.eps}})
    if (!std::isnan(v) && !(v >= 0 && std::isfinite(v)))
      fail("{} {}: it must be a finite number >= 0", flag, v);
  for (const auto& [flag, v] :
       {std::pair{"--adam-beta1", a.adam_beta1}, std::pair{"--adam-beta2", a.adam_beta2}})
    if (!std::isnan(v) && !(v >= 0 && v < 1))
      fail("{} {}: Adam's betas must be in [0, 1) (Hugging Face's defaults: 0.9 and 0.999)", flag,
           v);
  for (const auto& [flag, v] :
       {std::pair{"--warmup-steps", a.warmup_steps == kUnsetFlag ? 0 : a.warmup_steps},
        std::pair{"--save-every", a.save_every}, std::pair{"--keep", int64_t{a.keep}},
        std::pair{"--steps-per-print", a.steps_per_print}, std::pair{"--eval-every", a.eval_every},
        std::pair{"--eval-sequences", a.eval_sequences}})
    if (v < 0) fail("{} {}: it counts steps or checkpoints, so it must be 0 or more", flag, v);
  if (!std::isnan(a.warmup_ratio) && !(a.warmup_ratio > 0 && a.warmup_ratio < 1))
    fail(
        "--warmup-ratio {}: it is the fraction of the run's steps spent warming up, above 0 and "
        "below 1 (e.g. 0.03)",
        a.warmup_ratio);
  if (!std::isnan(a.warmup_ratio) && a.warmup_steps != kUnsetFlag)
    fail("--warmup-steps {} and --warmup-ratio {}: give one of them, not both", a.warmup_steps,
         a.warmup_ratio);
  if (a.steps != 0 && a.epochs != 0)
    fail("--steps {} and --epochs {}: give one of them, not both", a.steps, a.epochs);
  if (a.steps == 0 && a.epochs == 0)
    fail("give --steps N (optimizer steps in all) or --epochs E (passes over the --data files)");
  if (a.epochs != 0 && !(a.epochs > 0 && std::isfinite(a.epochs)))
    fail("--epochs {}: it must be a finite number above 0 (e.g. 3, or 0.5 for half the data)",
         a.epochs);
}

// --epochs E as optimizer steps: E passes over the data's sequences, `per_step` of them a step,
// rounded up. Every step is whole, a step at an epoch's end taking its last sequences from the
// next pass; Hugging Face's Trainer instead ends each epoch on a short step (ceil(batches /
// accumulation) updates an epoch, times E, rounded up), so where the data is not a multiple of
// a step the two counts differ past the first epoch.
// The training data's sequences. Wrapped sequences follow from the files' sizes; documents
// need their indexes read (the trainer's loader validates every token again, so the wrapped
// count does not scan them).
int64_t count_sequences(const TrainSettings& s, int64_t vocab_size) {
  if (s.packing != Packing::wrapped)
    return TokenSequences(s.data, s.seq_len, vocab_size, s.data_width, "training token file",
                          s.loss_masks, s.packing)
        .size();
  int64_t sequences = 0;
  for (const fs::path& f : s.data)
    sequences += TokenFile::open(f, s.data_width).num_sequences(s.seq_len);
  return sequences;
}

int64_t steps_for_epochs(double epochs, const TrainSettings& s, int64_t sequences,
                         int64_t per_step) {
  const double want =
      std::ceil(epochs * static_cast<double>(sequences) / static_cast<double>(per_step));
  if (!(want <= 1e12))
    fail(
        "--epochs {}: {} sequences, {} a step, make {:.3g} steps; give a number of epochs a run "
        "can finish",
        epochs, sequences, per_step, want);
  const auto steps = static_cast<int64_t>(want);
  fmt::print("--epochs {}: {} sequences of {} tokens, {} a step: {} steps\n", epochs, sequences,
             s.seq_len, per_step, std::max<int64_t>(steps, 1));
  return std::max<int64_t>(steps, 1);
}

// Hugging Face's save_strategy and eval_strategy: "steps" (every --save-steps / --eval-steps,
// the latter --logging-steps where unset, as Hugging Face's eval_steps defaults), "no" (only the
// final checkpoint, which `strata export` needs; no evaluation), "epoch" (every epoch's updates
// as Hugging Face's Trainer counts them: ceil(ceil(sequences / devices) / micro-batch) batches a
// device, over the accumulation, rounded down, at least 1).
void apply_strategies(const TrainArgs& a, TrainSettings& s,
                      const std::function<int64_t()>& sequences, int world) {
  if (a.save_strategy.empty() && a.eval_strategy.empty()) return;
  const auto check = [](const char* flag, const std::string& v) {
    if (!v.empty() && v != "steps" && v != "no" && v != "epoch")
      fail("{} {}: expected steps, no or epoch (Hugging Face's strategies)", flag, v);
  };
  check("--save-strategy", a.save_strategy);
  check("--eval-strategy", a.eval_strategy);
  int64_t epoch_steps = 0;
  if (a.save_strategy == "epoch" || a.eval_strategy == "epoch") {
    const int64_t per_device = (sequences() + world - 1) / world;
    const int64_t batches = (per_device + s.micro_batch - 1) / s.micro_batch;
    epoch_steps = std::max<int64_t>(1, batches / s.grad_accum);
    fmt::print("an epoch is {} steps, as Hugging Face's Trainer counts its updates\n", epoch_steps);
  }
  if (a.save_strategy == "no") {
    s.save_every = 0;
    fmt::print("--save-strategy no: only the final checkpoint is written\n");
  } else if (a.save_strategy == "epoch") {
    s.save_every = epoch_steps;
  }
  if (a.eval_strategy == "no") {
    if (!s.eval_data.empty())
      fmt::print("--eval-strategy no: the held-out data (--eval-data) is not evaluated\n");
    s.eval_data.clear();
    s.eval_every = 0;
  } else if (!a.eval_strategy.empty()) {
    if (s.eval_data.empty())
      fail("--eval-strategy {}: there is no held-out data to evaluate; give --eval-data FILE",
           a.eval_strategy);
    s.eval_every = a.eval_strategy == "epoch" ? epoch_steps
                   : a.eval_every > 0         ? a.eval_every
                                              : s.steps_per_print;
  }
}

// strata trains as one process over the GPUs of one node (--devices). Under a multi-process
// launcher (torchrun, deepspeed, srun with WORLD_SIZE > 1) every process would otherwise train
// its own copy into the same run directory: refused, saying what to run instead.
void check_single_process() {
  const char* world = std::getenv("WORLD_SIZE");
  if (world == nullptr || std::string_view(world).empty() || std::string_view(world) == "1") return;
  const char* rank = std::getenv("RANK");
  fail(
      "WORLD_SIZE={} (RANK={}): strata train runs as one process that drives every local GPU "
      "itself and does not span processes or nodes; start it once, without torchrun or the "
      "deepspeed launcher, with --devices cuda:0,1,... for the GPUs to use",
      world, rank != nullptr ? rank : "unset");
}

// Hugging Face's report_to: "tensorboard" (or "all": TensorBoard is the one integration strata
// has) writes TensorBoard events to --logging-dir, else RUN/runs (--tensorboard-dir wins); "none"
// adds nothing; any other integration (wandb, mlflow, ...) is said not to be available, and the
// run goes on, its metrics in metrics.jsonl. A --logging-dir without --report-to writes there, as
// transformers 4's default report_to ("all") does wherever TensorBoard is installed.
void apply_report_to(const TrainArgs& a, TrainSettings& s) {
  bool tensorboard = false;
  for (const std::string& to : a.report_to) {
    if (to == "tensorboard" || to == "all") {
      tensorboard = true;
    } else if (to != "none") {
      log_warn(
          "--report-to {}: strata reports to TensorBoard alone (--report-to tensorboard); this "
          "run's metrics are in {}/metrics.jsonl",
          to, s.run_dir.string());
    }
  }
  if (!a.logging_dir.empty() && a.report_to.empty()) tensorboard = true;
  if (!a.logging_dir.empty() && !tensorboard)
    log_warn("--logging-dir {}: unused, since --report-to names no tensorboard", a.logging_dir);
  if (!tensorboard || !a.tensorboard_dir.empty()) return;
  s.monitor.tensorboard.enabled = true;
  s.monitor.tensorboard.directory =
      a.logging_dir.empty() ? s.run_dir / "runs" : fs::path(a.logging_dir);
}

// A Hugging Face boolean flag's value as its string_to_bool reads it.
bool hf_bool(const char* flag, const std::string& v) {
  std::string s = v;
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "true" || s == "t" || s == "yes" || s == "y" || s == "1") return true;
  if (s == "false" || s == "f" || s == "no" || s == "n" || s == "0") return false;
  fail("{} {}: expected true or false (or nothing, for true), as Hugging Face's flag", flag, v);
}

// Hugging Face Trainer's mixed-precision and checkpointing booleans as strata's settings:
// --bf16 / --fp16 true are --dtype bf16 / f16 (DeepSpeed's bf16 and fp16 sections: 16-bit
// parameters and activations, f32 master weights in the optimizer), --gradient-checkpointing
// is --activation-checkpointing, and --tf32 is accepted and said to change nothing.
void apply_hugging_face_booleans(TrainArgs& a) {
  const bool bf16 = !a.hf_bf16.empty() && hf_bool("--bf16", a.hf_bf16);
  const bool fp16 = !a.hf_fp16.empty() && hf_bool("--fp16", a.hf_fp16);
  if (bf16 && fp16) fail("--bf16 and --fp16 are both true; give one (as Hugging Face requires)");
  if (bf16 || fp16) {
    const std::string want = bf16 ? "bf16" : "f16";
    if (!a.dtype.empty() && a.dtype != want)
      fail("--{} true and --dtype {} disagree; give one of them", bf16 ? "bf16" : "fp16", a.dtype);
    a.dtype = want;
  }
  if (!a.hf_gradient_checkpointing.empty()) {
    const bool on = hf_bool("--gradient-checkpointing", a.hf_gradient_checkpointing);
    if (a.recompute_given && a.recompute != on)
      fail("--gradient-checkpointing {} and --activation-checkpointing {} disagree; give one", on,
           a.recompute ? "on" : "off");
    a.recompute = on;
  }
  if (!a.hf_tf32.empty() && hf_bool("--tf32", a.hf_tf32))
    fmt::print(
        "--tf32: ignored; strata's f32 matmuls keep f32 precision, and its bf16 ones (the "
        "usual --bf16 run) accumulate in f32 either way\n");
}

int run_train(TrainArgs& a) {
  check_single_process();
  check_train_numbers(a);
  apply_hugging_face_booleans(a);
  const std::optional<DsConfig> ds = load_cli_config(a.config);
  weights_from_model_dir(a.model, a.init, "train from");
  LlamaConfig model = resolve_model(a.model);
  apply_vocab_pieces(a.vocab_pieces, model);
  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  std::vector<Device*> ptrs;
  for (auto& d : devices) ptrs.push_back(d.get());
  const int world = static_cast<int>(ptrs.size());

  TrainSettings s;
  s.model = a.model;
  s.vocab_pieces = a.vocab_pieces;
  s.init_random = !a.init.empty();
  s.seed = a.seed;
  for (const std::string& f : a.data) s.data.emplace_back(f);
  s.data_width = parse_token_width(a.data_dtype);
  s.loss_masks = a.loss_mask == "auto";
  s.packing = a.packing == "auto" ? auto_packing(s.data, s.loss_masks) : parse_packing(a.packing);
  if (a.eval_data.empty() && (a.eval_every > 0 || a.eval_sequences > 0))
    fail("--eval-every/--eval-sequences: there is no held-out data; give --eval-data FILE");
  for (const std::string& f : a.eval_data) s.eval_data.emplace_back(f);
  s.eval_every = a.eval_every;
  s.eval_sequences = a.eval_sequences;
  s.run_dir = a.run_dir.empty() ? fs::path("runs") / model.name : fs::path(a.run_dir);
  s.steps = a.steps;
  DsPlanSettings plan;
  if (ds) plan = ds_plan_settings(*ds, world, model);
  std::tie(s.micro_batch, s.grad_accum) =
      resolve_batch(ds, plan.batch, world, a.micro_batch, a.grad_accum);
  s.seq_len =
      count_flag("--seq-len", a.seq_len, std::min<int64_t>(model.max_position_embeddings, 1024),
                 "tokens per sequence");
  if (s.seq_len > model.max_position_embeddings)
    fail("--seq-len {}: the model's max_position_embeddings is {}; use at most that", s.seq_len,
         model.max_position_embeddings);
  // The training data's sequences, counted once (documents need their token files scanned) and
  // only where --epochs or an epoch strategy asks.
  std::optional<int64_t> sequence_count;
  const std::function<int64_t()> sequences = [&] {
    if (!sequence_count) sequence_count = count_sequences(s, model.vocab_size);
    return *sequence_count;
  };
  if (a.epochs > 0)
    s.steps = steps_for_epochs(a.epochs, s, sequences(), s.micro_batch * s.grad_accum * world);
  if (!a.dtype.empty()) {
    s.dtype = model_dtype(*ptrs.front(), a.dtype);
  } else if (plan.param_dtype) {
    s.dtype = *plan.param_dtype;
    check_model_dtype(*ptrs.front(), s.dtype,
                      fmt::format("{}: fp16.enabled", a.config.empty() ? "config" : a.config));
  } else {
    s.dtype = model_dtype(*ptrs.front(), "");
  }
  s.grad_dtype = grad_dtype_for(a.grad_dtype, plan.grad_dtype, s.dtype,
                                a.config.empty() ? "config" : a.config);

  // The optimizer: the config's type (DeepSpeed's Adam is AdamW unless adam_w_mode is false),
  // or --optimizer's.
  const DsConfig::Optimizer opt = ds ? ds->optimizer : DsConfig::Optimizer{};
  bool adamw = opt.decoupled_weight_decay();
  s.adam.type = opt.optimizer_type();
  // Hugging Face's --optim, which its Trainer uses only without a config optimizer section
  // (DeepSpeed's optimizer wins): its fp32 AdamWs (bitsandbytes' paged 32-bit one too, the same
  // update), Adagrad and bitsandbytes' 32-bit Lion are strata's; the 8-bit and factored states
  // are not.
  std::string optimizer = a.optimizer;
  if (!a.optim.empty()) {
    static const std::pair<const char*, const char*> kOptim[] = {
        {"adamw_torch", "adamw"},       {"adamw_torch_fused", "adamw"},
        {"adamw_hf", "adamw"},          {"adamw_apex_fused", "adamw"},
        {"adamw_torch_xla", "adamw"},   {"adamw_torch_npu_fused", "adamw"},
        {"paged_adamw_32bit", "adamw"}, {"adagrad", "adagrad"},
        {"lion_32bit", "lion"},         {"paged_lion_32bit", "lion"}};
    const char* mapped = nullptr;
    for (const auto& [hf, ours] : kOptim)
      if (a.optim == hf) mapped = ours;
    if (opt.present)
      log_warn(
          "--optim {}: ignored, as Hugging Face's Trainer ignores it beside the config's "
          "optimizer section ({})",
          a.optim, opt.type.value_or("Adam"));
    else if (mapped == nullptr)
      fail(
          "--optim {}: strata's optimizers are Hugging Face's adamw_torch (and the other fp32 "
          "AdamWs), adagrad and lion_32bit; 8-bit and factored states (adafactor), SGD and "
          "RMSprop are not supported; pick one of those, or --optimizer",
          a.optim);
    else if (!optimizer.empty() && optimizer != mapped)
      fail("--optim {} and --optimizer {} disagree; pass one of them", a.optim, optimizer);
    else
      optimizer = mapped;
  }
  if (!optimizer.empty()) {
    if (optimizer == "adamw" || optimizer == "adam")
      s.adam.type = OptimizerType::adam;
    else if (optimizer == "lion")
      s.adam.type = OptimizerType::lion;
    else if (optimizer == "adagrad")
      s.adam.type = OptimizerType::adagrad;
    else
      fail("--optimizer '{}': expected adamw, adam, lion or adagrad", optimizer);
    if (opt.type && opt.optimizer_type() != s.adam.type)
      fail(
          "--optimizer {}: the config {} asks for {} (optimizer.type); pass one of them, or the "
          "same in both",
          optimizer, a.config, *opt.type);
    adamw = optimizer == "adamw" || optimizer == "lion";
  }
  s.adam.adamw = adamw;
  const double lr = !std::isnan(a.lr) ? a.lr : opt.lr.value_or(1e-3);
  s.adam.lr = static_cast<float>(lr);
  if (opt.betas) {
    s.adam.beta1 = static_cast<float>((*opt.betas)[0]);
    s.adam.beta2 = static_cast<float>((*opt.betas)[1]);
  }
  // Hugging Face's adam_beta1 and adam_beta2, which fill a config's "auto" betas; as the other
  // flags, they win over the config's numbers.
  if (!std::isnan(a.adam_beta1)) s.adam.beta1 = static_cast<float>(a.adam_beta1);
  if (!std::isnan(a.adam_beta2)) s.adam.beta2 = static_cast<float>(a.adam_beta2);
  // Adagrad's default eps is torch's and DeepSpeed's, 1e-10; Lion has none.
  s.adam.eps = static_cast<float>(
      !std::isnan(a.eps) ? a.eps
                         : opt.eps.value_or(s.adam.type == OptimizerType::adagrad ? 1e-10 : 1e-8));
  if (s.adam.type == OptimizerType::lion && !std::isnan(a.eps))
    fail("--eps {}: Lion has no eps (it steps by the sign of its momentum); remove --eps", a.eps);
  if (s.adam.type == OptimizerType::adagrad &&
      (!std::isnan(a.adam_beta1) || !std::isnan(a.adam_beta2)))
    fail("--adam-beta1/--adam-beta2: Adagrad has no betas; remove them");
  s.adam.bias_correction = opt.bias_correction.value_or(true);
  s.adam.weight_decay = static_cast<float>(
      !std::isnan(a.weight_decay) ? a.weight_decay : opt.weight_decay.value_or(0.0));
  // Which parameters decay. A config's optimizer section has DeepSpeed make the optimizer,
  // which decays every parameter it is given, and Hugging Face's Trainer gives it all of them;
  // without one the Trainer makes it, with the 1-D tensors (norm weights, biases) in a group of
  // their own that takes none.
  s.decay_every_parameter = opt.present;
  if (s.decay_every_parameter && s.adam.weight_decay > 0)
    fmt::print(
        "config {}: weight decay {} on every parameter, norm weights and biases too, as "
        "DeepSpeed applies it with the optimizer of the config's optimizer section (and as "
        "Hugging Face's Trainer runs this config); without that section the 1-D tensors take "
        "none, as the Trainer's own optimizer has it\n",
        a.config, s.adam.weight_decay);
  const bool hugging_face_schedule = is_hugging_face_schedule_type(a.lr_schedule);
  nlohmann::json scheduler_kwargs = nlohmann::json::object();
  if (!a.lr_scheduler_kwargs.empty()) {
    if (!hugging_face_schedule)
      fail(
          "--lr-scheduler-kwargs: it is for Hugging Face's lr_scheduler_type (--lr-scheduler-type "
          "cosine_with_min_lr, ...), and {}; DeepSpeed's schedulers take their settings from the "
          "config's scheduler.params",
          a.lr_schedule.empty() ? std::string("none is given")
                                : fmt::format("\"{}\" is DeepSpeed's", a.lr_schedule));
    scheduler_kwargs = nlohmann::json::parse(a.lr_scheduler_kwargs, nullptr, false);
    if (scheduler_kwargs.is_discarded() || !scheduler_kwargs.is_object())
      fail(
          "--lr-scheduler-kwargs '{}': not a JSON object; give one as Hugging Face's "
          "lr_scheduler_kwargs, e.g. '{{\"min_lr_rate\": 0.1}}'",
          a.lr_scheduler_kwargs);
  }
  if (hugging_face_schedule) {
    // Hugging Face's lr_scheduler_type, what its Trainer runs where the DeepSpeed config has no
    // scheduler: a warmup of --warmup-steps, or ceil(--warmup-ratio x steps), 0 by default.
    int64_t warmup = 0;
    if (a.warmup_steps != kUnsetFlag)
      warmup = a.warmup_steps;
    else if (!std::isnan(a.warmup_ratio))
      warmup = static_cast<int64_t>(std::ceil(a.warmup_ratio * static_cast<double>(s.steps)));
    s.schedule = hugging_face_lr_schedule(a.lr_schedule, lr, warmup, s.steps, scheduler_kwargs);
  } else {
    DsConfig::Scheduler sched = ds ? ds->scheduler : DsConfig::Scheduler{};
    // --lr-schedule names the type; the config's scheduler.params stay (each type reads the
    // ones it takes), so naming the config's own type changes nothing.
    if (a.lr_schedule == "none")
      sched = DsConfig::Scheduler{};
    else if (!a.lr_schedule.empty())
      sched.type = a.lr_schedule;
    const bool warmup_flag = a.warmup_steps != kUnsetFlag || !std::isnan(a.warmup_ratio);
    if (warmup_flag && !sched.type)
      fail(
          "{}: there is no learning-rate schedule to warm up (the config has no scheduler and "
          "--lr-schedule is not given); add --lr-schedule WarmupLR, WarmupDecayLR or "
          "WarmupCosineLR (DeepSpeed's), or linear, cosine or constant_with_warmup (Hugging "
          "Face's)",
          a.warmup_steps != kUnsetFlag ? "--warmup-steps" : "--warmup-ratio");
    const bool cyclic = sched.type == "OneCycle" || sched.type == "LRRangeTest";
    if (warmup_flag && cyclic)
      fail(
          "{}: the learning-rate schedule is {}, which has no warmup; its rise is set by "
          "scheduler.params ({}) in the config; drop the flag",
          a.warmup_steps != kUnsetFlag ? "--warmup-steps" : "--warmup-ratio", *sched.type,
          *sched.type == "OneCycle" ? "cycle_first_step_size" : "lr_range_test_step_size");
    if (a.warmup_steps != kUnsetFlag) sched.warmup_num_steps = a.warmup_steps;
    // Hugging Face's warmup_ratio: ceil(ratio x the run's steps) steps.
    if (!std::isnan(a.warmup_ratio))
      sched.warmup_num_steps =
          static_cast<int64_t>(std::ceil(a.warmup_ratio * static_cast<double>(s.steps)));
    if (sched.type && !cyclic && !sched.warmup_num_steps && !sched.warmup_num_steps_auto)
      fmt::print(
          "lr schedule: warmup_num_steps is DeepSpeed's default, 1000, since neither the config "
          "nor a flag sets it{}; --warmup-steps or --warmup-ratio sets it\n",
          s.steps <= 1000 ? fmt::format(" (this run's {} steps are all warmup)", s.steps) : "");
    // DeepSpeed's OneCycle turns cycle_momentum off, with a warning, for an optimizer without
    // betas.
    if (sched.type && *sched.type == "OneCycle" && s.adam.type == OptimizerType::adagrad &&
        sched.cycle_momentum.value_or(true)) {
      log_warn(
          "lr schedule OneCycle: cycle_momentum is off, as DeepSpeed turns it off for an "
          "optimizer without betas (Adagrad); only the rate cycles");
      sched.cycle_momentum = false;
    }
    s.schedule = lr_schedule_from_config(sched, lr, s.steps);
    if (s.schedule.betas_at(-1))
      fmt::print(
          "lr schedule OneCycle: cycle_momentum is on, so each update's Adam betas are the "
          "cycle's momentum (cycle_max_mom {} down to cycle_min_mom {} as the rate rises, and "
          "back) and 0.99, as DeepSpeed's OneCycle sets them, in place of the optimizer's ({}, "
          "{}); metrics.jsonl logs each update's beta1\n",
          s.schedule.cycle_max_mom, s.schedule.cycle_min_mom, s.adam.beta1, s.adam.beta2);
  }
  s.scaling = loss_scale_settings(ds ? ds->fp16 : DsConfig::Fp16{}, s.dtype == DType::f16);
  s.max_grad_norm = !std::isnan(a.clip) ? a.clip : (ds ? ds->gradient_clipping.value_or(0.0) : 0.0);
  // "auto" is Hugging Face's, filled from its TrainingArguments: say what strata took instead
  // where no flag sets it, and what Hugging Face's defaults would have been.
  if (ds && std::isnan(a.lr) && ds->is_auto("optimizer.params.lr"))
    fmt::print(
        "config {}: optimizer.params.lr is \"auto\" and no --learning-rate is given: {} "
        "(strata's default; Hugging Face's Trainer fills in its learning_rate, 5e-05 unless "
        "given)\n",
        a.config, lr);
  if (ds && std::isnan(a.clip) && ds->is_auto("gradient_clipping"))
    fmt::print(
        "config {}: gradient_clipping is \"auto\" and no --max-grad-norm is given: no clipping "
        "(strata's default; Hugging Face's Trainer fills in its max_grad_norm, 1.0 unless "
        "given)\n",
        a.config);
  s.steps_per_print =
      a.steps_per_print > 0 ? a.steps_per_print : (ds ? ds->steps_per_print.value_or(10) : 10);

  s.offload = plan.offload;
  apply_offload_flags(s.offload, a.offload_param, a.offload_optimizer, a.offload_gradients);
  if (!a.nvme_paths.empty()) s.offload.nvme_paths = a.nvme_paths;
  const bool nvme = s.offload.param == Tier::nvme || s.offload.optimizer == Tier::nvme ||
                    s.offload.automatic || s.offload.grads == GradHome::nvme;
  if (nvme && s.offload.nvme_paths.empty()) s.offload.nvme_paths = {(s.run_dir / "swap").string()};
  s.prefetch_depth = prefetch_depth_flag(a.prefetch_depth, plan.prefetch_depth.value_or(1));
  s.recompute = a.recompute;
  s.offload_activations = offload_activations_flag(a.offload_activations, plan.offload_activations);
  s.micro_batch_group = micro_batch_group_flag(a.micro_batch_group, s.grad_accum);
  s.update_during_backward = a.update_during_backward;
  s.reduce_per_group = a.reduce_per_group;
  s.persistence_threshold = a.persistence_threshold >= 0
                                ? static_cast<uint64_t>(a.persistence_threshold)
                                : plan.persistence_threshold.value_or(100000);
  s.cpu_memory = budget_flag("--cpu-memory", a.cpu_memory, "host RAM", "64GiB");
  s.pinned_memory = budget_flag("--pinned-memory", a.pinned_memory, "page-locked memory", "2GiB");
  s.cpu_adam_threads = a.threads;
  s.save_every = a.save_every;
  s.keep = a.keep;
  apply_strategies(a, s, sequences, world);
  s.resume = a.resume || a.resume_fallback || !a.resume_from.empty();
  s.resume_fallback = a.resume_fallback;
  s.resume_from = a.resume_from;
  s.trace = a.trace;
  // The config's monitor sections, each flag enabling its monitor in the directory it names.
  if (ds) s.monitor = ds->monitor;
  for (const auto& [flag, target] : {std::pair{&a.tensorboard_dir, &s.monitor.tensorboard},
                                     std::pair{&a.csv_monitor_dir, &s.monitor.csv}})
    if (!flag->empty()) {
      target->enabled = true;
      target->directory = *flag;
    }
  apply_report_to(a, s);
  s.echo = {{"model", a.model},
            {"data", a.data},
            {"seed", a.seed},
            {"steps", s.steps},
            {"micro_batch", s.micro_batch},
            {"grad_accum", s.grad_accum},
            {"micro_batch_group", s.micro_batch_group},
            {"update_during_backward", s.update_during_backward},
            {"reduce_per_group", s.reduce_per_group},
            {"seq_len", s.seq_len},
            {"packing", packing_name(s.packing)},
            {"dtype", dtype_name(s.dtype)},
            {"grad_dtype", dtype_name(s.grad_dtype)},
            {"vocab_pieces", vocab_pieces_for(model)},
            {"optimizer", s.adam.type != OptimizerType::adam ? optimizer_type_name(s.adam.type)
                          : adamw                            ? "adamw"
                                                             : "adam"},
            {"lr", lr},
            {"lr_schedule", lr_schedule_name(s.schedule.kind)},
            {"warmup_num_steps", s.schedule.kind == LrScheduleKind::constant ||
                                         s.schedule.kind == LrScheduleKind::one_cycle ||
                                         s.schedule.kind == LrScheduleKind::lr_range_test
                                     ? nlohmann::json(nullptr)
                                     : nlohmann::json(s.schedule.warmup_num_steps)},
            {"weight_decay", s.adam.weight_decay},
            {"weight_decay_on", s.decay_every_parameter ? "every parameter" : "2-D tensors"},
            {"betas", {s.adam.beta1, s.adam.beta2}},
            {"eps", s.adam.eps},
            {"bias_correction", s.adam.bias_correction},
            {"gradient_clipping", s.max_grad_norm},
            {"offload_param", tier_name(s.offload.param)},
            {"offload_optimizer", tier_name(s.offload.optimizer)},
            {"offload_gradients", grad_home_name(s.offload.grads)},
            {"activation_checkpointing", s.recompute ? "on" : "off"},
            {"offload_activations", s.offload_activations ? "cpu" : "none"},
            {"nvme_path", s.offload.nvme_paths},
            {"devices", world},
            {"config", a.config}};
  if (!a.lr_scheduler_kwargs.empty()) s.echo["lr_scheduler_kwargs"] = scheduler_kwargs;
  if (!s.eval_data.empty())
    s.echo["eval"] = {
        {"data", a.eval_data}, {"every", s.eval_every}, {"sequences", a.eval_sequences}};
  for (const auto& [key, target] :
       {std::pair{"tensorboard", &s.monitor.tensorboard}, std::pair{"csv_monitor", &s.monitor.csv}})
    if (target->enabled) s.echo[key] = target->dir().string();
  s.echo["aio"] = {{"block_size", s.offload.nvme_stripe},
                   {"queue_depth", s.offload.nvme_queue_depth}};
  const double loss = train(s, ptrs);
  fmt::print(
      "done: loss {:.4f}; resume with --resume --run-dir {}, export with `strata export "
      "{}`\n",
      loss, s.run_dir.string(), s.run_dir.string());
  return 0;
}

}  // namespace

Command add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "train or fine-tune a Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma (1, 2 or 3), SmolLM3 or "
      "Granite model with ZeRO-3 state in GPU, CPU or NVMe tiers; checkpoints in Hugging Face "
      "format, bit-identical resume. Hugging "
      "Face Trainer's flag names are accepted beside strata's (--learning-rate, "
      "--max-grad-norm, --per-device-train-batch-size, --gradient-accumulation-steps, "
      "--num-train-epochs, --max-steps, --save-steps, --save-total-limit, --logging-steps, "
      "--eval-steps, --output-dir, --adam-epsilon, --max-seq-length, --deepspeed, --bf16, ...; "
      "with underscores too)");
  cmd->add_option("--model", a->model, "Hugging Face checkpoint directory or preset")->required();
  cmd->add_option("--init", a->init, "'random': initialise instead of loading weights");
  cmd->add_option("--seed", a->seed, "seed of the initialisation and of the data order")
      ->capture_default_str();
  cmd->add_option("--data", a->data, "token files (llm.c format; strata tokenize makes them)")
      ->required()
      ->delimiter(',');
  cmd->add_option("--data-dtype", a->data_dtype, "raw token files: uint16 or uint32");
  cmd->add_option("--loss-mask", a->loss_mask,
                  "auto: where a token file has a loss mask beside it (FILE.mask, written by "
                  "strata tokenize for prompt/completion rows), only the targets it marks count; "
                  "off: every target counts")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  cmd->add_option("--packing", a->packing,
                  "how sequences are cut from the token files: wrapped (documents end to end, "
                  "cut into --seq-len windows), none (one document per sequence, padded, cut "
                  "after --seq-len + 1 tokens; needs the document index strata tokenize writes "
                  "beside each file), bfd (those documents packed whole into sequences by best "
                  "fit decreasing, each attending to itself alone: no padding but the rest of a "
                  "sequence), auto (none for files with loss masks and document indexes, as "
                  "fine-tuning rows, else wrapped); held-out data is cut the same way")
      ->check(CLI::IsMember({"auto", "wrapped", "none", "bfd"}))
      ->capture_default_str();
  cmd->add_option("--eval-data", a->eval_data,
                  "held-out token files (their sequences in order): the loss every "
                  "--eval-every steps and at the end")
      ->delimiter(',');
  cmd->add_option("--eval-every,--eval-steps", a->eval_every,
                  "evaluate every N steps (0: at the end only)");
  cmd->add_option("--eval-sequences", a->eval_sequences,
                  "evaluate on at most N held-out sequences (0: all of them)");
  cmd->add_option("--config,--deepspeed", a->config,
                  "DeepSpeed JSON config (--deepspeed: Hugging Face's name)");
  cmd->add_option("--run-dir,--output-dir", a->run_dir, "run directory (default runs/<model>)");
  cmd->add_option("--steps,--max-steps", a->steps, "optimizer steps in all (or --epochs)");
  cmd->add_option("--epochs,--num-train-epochs", a->epochs,
                  "passes over the --data files instead of --steps: steps = ceil(E x sequences / "
                  "(micro-batch x grad-accum x devices)); fractions allowed");
  cmd->add_option("--micro-batch,--per-device-train-batch-size", a->micro_batch,
                  "sequences per device per micro-batch");
  cmd->add_option("--grad-accum,--gradient-accumulation-steps", a->grad_accum,
                  "micro-batches per optimizer step");
  cmd->add_option("--seq-len,--max-seq-length", a->seq_len,
                  "tokens per sequence (default: context, <= 1024)");
  cmd->add_option("--dtype", a->dtype,
                  "parameters: f32, bf16 (default: the config's bf16 or fp16 section where one is "
                  "enabled, f32 where one is turned off and neither is on, as DeepSpeed; else f32 "
                  "on host, bf16 on cuda)");
  cmd->add_option("--grad-dtype", a->grad_dtype,
                  "gradients and their accumulators: f32 (default; DeepSpeed's "
                  "data_types.grad_accum_dtype where the config sets it), or the parameters' "
                  "bf16/f16 (half the memory of both, for runs that accumulate little)");
  add_vocab_pieces_option(cmd, a->vocab_pieces);
  cmd->add_option("--optim", a->optim,
                  "Hugging Face's optimizer name: adamw_torch (and its other fp32 AdamWs), "
                  "adagrad, lion_32bit");
  cmd->add_option("--optimizer", a->optimizer,
                  "adamw, adam (L2 decay), lion or adagrad (default: the config's optimizer.type, "
                  "else adamw)");
  cmd->add_option("--lr,--learning-rate", a->lr,
                  "learning rate (default: the config's, else 1e-3)");
  cmd->add_option("--lr-schedule,--lr-scheduler-type", a->lr_schedule,
                  "none, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest "
                  "(DeepSpeed's), or linear, cosine, constant, constant_with_warmup, "
                  "cosine_with_restarts, polynomial, inverse_sqrt, cosine_with_min_lr or "
                  "warmup_stable_decay (Hugging Face's lr_scheduler_type, from 0 over the warmup, "
                  "then as transformers' schedule of that name); overrides the config's type (a "
                  "DeepSpeed one keeps the config's scheduler.params)");
  cmd->add_option("--lr-scheduler-kwargs", a->lr_scheduler_kwargs,
                  "Hugging Face's lr_scheduler_kwargs, a JSON object: num_cycles (cosine, "
                  "cosine_with_restarts), lr_end and power (polynomial), min_lr or min_lr_rate "
                  "(cosine_with_min_lr), num_decay_steps, num_stable_steps, warmup_type, "
                  "decay_type, min_lr_ratio (warmup_stable_decay)");
  cmd->add_option("--warmup-steps", a->warmup_steps, "warmup_num_steps of the schedule");
  cmd->add_option("--warmup-ratio", a->warmup_ratio,
                  "warm up for this fraction of the run's steps (Hugging Face's warmup_ratio: "
                  "ceil(ratio x steps)) instead of --warmup-steps");
  cmd->add_option("--weight-decay", a->weight_decay, "weight decay (default 0)");
  cmd->add_option("--eps,--adam-epsilon", a->eps, "Adam's epsilon (default 1e-8)");
  cmd->add_option("--adam-beta1", a->adam_beta1,
                  "Adam's beta1 (default: the config's optimizer betas, else 0.9)");
  cmd->add_option("--adam-beta2", a->adam_beta2,
                  "Adam's beta2 (default: the config's optimizer betas, else 0.999)");
  cmd->add_option("--clip,--max-grad-norm", a->clip, "gradient clipping by global norm (0: none)");
  cmd->add_option("--offload-param", a->offload_param, "none, cpu, nvme or auto");
  cmd->add_option("--offload-optimizer", a->offload_optimizer, "none, cpu, nvme or auto");
  add_gradients_option(cmd, a->offload_gradients);
  cmd->add_option("--nvme-path", a->nvme_paths, "NVMe directories (default RUN/swap)")
      ->delimiter(',');
  cmd->add_option("--prefetch-depth", a->prefetch_depth, "units fetched ahead (default 1)");
  CLI::Option* checkpointing = add_checkpointing_option(cmd, a->recompute);
  for (const auto& [name, target, help] :
       {std::tuple{"--bf16", &a->hf_bf16, "Hugging Face's: true (or no value) is --dtype bf16"},
        std::tuple{"--fp16", &a->hf_fp16, "Hugging Face's: true (or no value) is --dtype f16"},
        std::tuple{"--gradient-checkpointing", &a->hf_gradient_checkpointing,
                   "Hugging Face's: true or false is --activation-checkpointing on or off"},
        std::tuple{"--tf32", &a->hf_tf32, "Hugging Face's: accepted, changes nothing"}})
    cmd->add_option(name, *target, help)
        ->expected(0, 1)
        ->default_str("true")  // the value of the bare flag
        ->option_text("[true|false]");
  add_offload_activations_option(cmd, a->offload_activations);
  add_micro_batch_group_option(cmd, a->micro_batch_group);
  add_update_during_backward_option(cmd, a->update_during_backward);
  add_reduce_per_group_option(cmd, a->reduce_per_group);
  cmd->add_option("--persistence-threshold", a->persistence_threshold,
                  "units of at most this many elements stay whole on every device (100000)");
  cmd->add_option("--cpu-memory", a->cpu_memory, "host RAM the run may use");
  cmd->add_option("--pinned-memory", a->pinned_memory,
                  "page-locked memory the run may use (default and most: ulimit -l)");
  cmd->add_option("--devices", a->devices, "host:N, cuda or cuda:0,1");
  cmd->add_option("--device-memory", a->device_memory, "cap of each device's memory");
  cmd->add_option("--threads", a->threads, "CPU Adam threads (0: every CPU)");
  cmd->add_option("--save-every,--save-steps", a->save_every,
                  "checkpoint every N steps (and at the end)");
  cmd->add_option("--save-strategy", a->save_strategy,
                  "Hugging Face's: steps (every --save-steps), no (the final checkpoint only) or "
                  "epoch (every epoch's steps)");
  cmd->add_option("--eval-strategy,--evaluation-strategy", a->eval_strategy,
                  "Hugging Face's: no (no evaluation), steps (every --eval-steps, else "
                  "--logging-steps) or epoch, with --eval-data");
  cmd->add_option("--keep,--save-total-limit", a->keep, "complete checkpoints kept (0: all)")
      ->capture_default_str();
  cmd->add_flag("--resume", a->resume,
                "continue from the run directory's newest checkpoint (verified first)");
  cmd->add_flag("--resume-fallback", a->resume_fallback,
                "--resume, from the newest checkpoint that verifies when newer ones are damaged");
  cmd->add_option("--resume-from,--resume-from-checkpoint", a->resume_from,
                  "continue from this checkpoint (RUN/checkpoints/step-N, verified first) or run "
                  "directory's newest: an earlier one of this run (the later ones are set aside "
                  "as abandoned-step-M) or another run's, into a new --run-dir");
  cmd->add_option("--steps-per-print,--logging-steps", a->steps_per_print,
                  "log every N steps (default 10)");
  cmd->add_option("--trace", a->trace, "write a Chrome/Perfetto trace of the run's steps here");
  cmd->add_option("--tensorboard-dir", a->tensorboard_dir,
                  "write each step's loss, lr and gradient norm as TensorBoard events here (as "
                  "the config's tensorboard section does in output_path/job_name)");
  cmd->add_option("--report-to", a->report_to,
                  "Hugging Face's: tensorboard (or all) writes TensorBoard events to "
                  "--logging-dir, else RUN/runs; none; others are said not to be available")
      ->delimiter(',');
  cmd->add_option("--logging-dir", a->logging_dir,
                  "Hugging Face's: the TensorBoard directory of --report-to tensorboard");
  cmd->add_option("--csv-monitor-dir", a->csv_monitor_dir,
                  "write each step's loss, lr and gradient norm as one CSV file per scalar here "
                  "(as the config's csv_monitor section does in output_path/job_name)");
  return {cmd, [a, checkpointing] {
            a->recompute_given = checkpointing->count() > 0;
            return run_train(*a);
          }};
}

}  // namespace strata::cli
