// lr_schedule.cpp: see lr_schedule.h. Each formula is written in DeepSpeed's order of
// operations (Python floats are doubles, math.log/math.cos are libm's), so keep the grouping of
// every expression as it is: regrouping changes the last bit.
#include "train/lr_schedule.h"

#include "core/error.h"
#include "core/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

namespace strata {

namespace {

void check_rate(double value, const char* name) {
  if (!std::isfinite(value) || value < 0.0)
    fail("lr schedule: {} is {}; it must be a finite number >= 0; fix it in the config or flags",
         name, value);
}

// DeepSpeed's warmup gamma in [0, 1) for last_batch_iteration i in [0, W).
double warmup_gamma(WarmupShape shape, int64_t i, int64_t W) {
  if (shape == WarmupShape::log) {
    const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(W));
    return inverse_log_warm_up * std::log(static_cast<double>(i + 1));
  }
  return static_cast<double>(i) / static_cast<double>(W);
}

LrSchedule one_cycle_from_config(const DsConfig::Scheduler& config, double optimizer_lr,
                                 std::optional<int64_t> run_steps) {
  LrSchedule s;
  s.kind = LrScheduleKind::one_cycle;
  s.lr = optimizer_lr;  // replaced by cycle_min_lr when DeepSpeed makes the scheduler
  if (!config.cycle_min_lr || !config.cycle_max_lr)
    fail(
        "lr schedule OneCycle: scheduler.params.{} is not set; DeepSpeed's OneCycle has no "
        "default for cycle_min_lr or cycle_max_lr (the rates the cycle starts from and rises "
        "to); give both",
        config.cycle_min_lr ? "cycle_max_lr" : "cycle_min_lr");
  s.cycle_min_lr = *config.cycle_min_lr;
  s.cycle_max_lr = *config.cycle_max_lr;
  s.decay_lr_rate = config.decay_lr_rate.value_or(0.0);
  s.cycle_first_step_size = config.cycle_first_step_size.value_or(2000);
  s.cycle_second_step_size = config.cycle_second_step_size.value_or(s.cycle_first_step_size);
  s.decay_step_size = config.decay_step_size.value_or(0);
  s.cycle_momentum = config.cycle_momentum.value_or(true);
  s.cycle_min_mom = config.cycle_min_mom.value_or(0.8);
  s.cycle_max_mom = config.cycle_max_mom.value_or(0.9);
  s.decay_mom_rate = config.decay_mom_rate.value_or(0.0);
  s.validate();
  // After the cycle, a decaying momentum only grows: its last update is the one to check.
  if (run_steps && *run_steps > 0)
    if (const auto last = s.betas_for_update(*run_steps - 1); last && last->first >= 1.0) {
      int64_t first = *run_steps - 1;
      while (first > 0 && s.betas_for_update(first - 1)->first >= 1.0) --first;
      fail(
          "lr schedule OneCycle: Adam's beta1, cycle_max_mom {} x (1 + decay_mom_rate {} x the "
          "updates past the cycle / decay_step_size {}), reaches {} at update {} of this run's "
          "{}, and beta1 must stay below 1; lower decay_mom_rate, or set it to 0 to hold "
          "cycle_max_mom after the cycle",
          s.cycle_max_mom, s.decay_mom_rate, s.decay_step_size, s.betas_for_update(first)->first,
          first + 1, *run_steps);
    }
  return s;
}

}  // namespace

std::string lr_schedule_name(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::constant:
      return "none";
    case LrScheduleKind::warmup:
      return "WarmupLR";
    case LrScheduleKind::warmup_decay:
      return "WarmupDecayLR";
    case LrScheduleKind::warmup_cosine:
      return "WarmupCosineLR";
    case LrScheduleKind::hf_linear:
      return "linear";
    case LrScheduleKind::hf_cosine:
      return "cosine";
    case LrScheduleKind::hf_constant_with_warmup:
      return "constant_with_warmup";
    case LrScheduleKind::one_cycle:
      return "OneCycle";
    case LrScheduleKind::lr_range_test:
      return "LRRangeTest";
    case LrScheduleKind::hf_cosine_with_restarts:
      return "cosine_with_restarts";
    case LrScheduleKind::hf_polynomial:
      return "polynomial";
    case LrScheduleKind::hf_inverse_sqrt:
      return "inverse_sqrt";
    case LrScheduleKind::hf_cosine_with_min_lr:
      return "cosine_with_min_lr";
    case LrScheduleKind::hf_warmup_stable_decay:
      return "warmup_stable_decay";
  }
  return "?";
}

bool is_hugging_face_schedule(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::hf_linear:
    case LrScheduleKind::hf_cosine:
    case LrScheduleKind::hf_constant_with_warmup:
    case LrScheduleKind::hf_cosine_with_restarts:
    case LrScheduleKind::hf_polynomial:
    case LrScheduleKind::hf_inverse_sqrt:
    case LrScheduleKind::hf_cosine_with_min_lr:
    case LrScheduleKind::hf_warmup_stable_decay:
      return true;
    default:
      return false;
  }
}

void LrSchedule::validate() const {
  check_rate(lr, "optimizer.params.lr");
  if (kind == LrScheduleKind::constant) return;
  const std::string name = lr_schedule_name(kind);
  if (is_hugging_face_schedule(kind)) {
    if (warmup_num_steps < 0)
      fail("lr schedule {}: the warmup is {} steps; it must be 0 or more", name, warmup_num_steps);
    if (kind != LrScheduleKind::hf_constant_with_warmup &&
        kind != LrScheduleKind::hf_inverse_sqrt && total_num_steps < 1)
      fail("lr schedule {}: the run's steps are {}; it decays to 0 over them, so give --steps",
           name, total_num_steps);
    for (const auto& [value, key] :
         {std::pair{num_cycles, "num_cycles"}, std::pair{min_lr_rate, "min_lr_rate"},
          std::pair{lr_end, "lr_end"}, std::pair{power, "power"},
          std::pair{min_lr_ratio, "min_lr_ratio"}})
      if (!std::isfinite(value) || value < 0.0)
        fail(
            "lr schedule {}: lr_scheduler_kwargs {} is {}; it must be a finite number >= 0; fix "
            "--lr-scheduler-kwargs",
            name, key, value);
    if (kind == LrScheduleKind::hf_polynomial) {
      if (!(lr > lr_end))
        fail(
            "lr schedule polynomial: lr_end ({}) must be smaller than the learning rate ({}), as "
            "transformers requires; lower lr_end in --lr-scheduler-kwargs",
            lr_end, lr);
      if (total_num_steps <= warmup_num_steps)
        fail(
            "lr schedule polynomial: the warmup ({} steps) takes the whole run ({} steps), which "
            "leaves nothing to decay over (transformers divides by zero there); shorten the "
            "warmup",
            warmup_num_steps, total_num_steps);
    }
    if (kind == LrScheduleKind::hf_inverse_sqrt && timescale < 1)
      fail("lr schedule inverse_sqrt: the timescale is {}; it must be 1 or more", timescale);
    if (kind == LrScheduleKind::hf_warmup_stable_decay &&
        (num_stable_steps < 0 || num_decay_steps < 0))
      fail(
          "lr schedule warmup_stable_decay: {} warmup, {} stable and {} decay steps; none may be "
          "negative (without num_stable_steps it is the run's {} steps less the warmup and the "
          "decay); fix num_decay_steps or num_stable_steps in --lr-scheduler-kwargs, or the "
          "warmup",
          warmup_num_steps, num_stable_steps, num_decay_steps, total_num_steps);
    return;
  }
  if (kind == LrScheduleKind::one_cycle) {
    check_rate(cycle_min_lr, "scheduler.params.cycle_min_lr");
    check_rate(cycle_max_lr, "scheduler.params.cycle_max_lr");
    check_rate(decay_lr_rate, "scheduler.params.decay_lr_rate");
    check_rate(decay_mom_rate, "scheduler.params.decay_mom_rate");
    if (cycle_first_step_size < 1 || cycle_second_step_size < 0)
      fail(
          "lr schedule OneCycle: cycle_first_step_size {} and cycle_second_step_size {}; the "
          "first must be 1 or more (DeepSpeed divides by it) and the second 0 or more; fix "
          "scheduler.params",
          cycle_first_step_size, cycle_second_step_size);
    if (decay_step_size < 0)
      fail(
          "lr schedule OneCycle: scheduler.params.decay_step_size is {}; it must be 0 (no decay) "
          "or more",
          decay_step_size);
    if (cycle_momentum)
      for (const auto& [value, key] :
           {std::pair{cycle_min_mom, "cycle_min_mom"}, std::pair{cycle_max_mom, "cycle_max_mom"}})
        if (!(value >= 0.0 && value < 1.0))
          fail(
              "lr schedule OneCycle: scheduler.params.{} is {}; it is Adam's beta1 while "
              "cycle_momentum is on, which must be in [0, 1); fix it, or set cycle_momentum false",
              key, value);
    return;
  }
  if (kind == LrScheduleKind::lr_range_test) {
    check_rate(range_test_min_lr, "scheduler.params.lr_range_test_min_lr");
    check_rate(range_test_step_rate, "scheduler.params.lr_range_test_step_rate");
    if (range_test_step_size < 1)
      fail(
          "lr schedule LRRangeTest: scheduler.params.lr_range_test_step_size is {}; it must be 1 "
          "or more (DeepSpeed divides by it)",
          range_test_step_size);
    return;
  }
  if (warmup_num_steps < 1)
    fail(
        "lr schedule {}: scheduler.params.warmup_num_steps is {}; DeepSpeed requires a positive "
        "whole number; set it to 1 or more",
        name, warmup_num_steps);
  if (kind == LrScheduleKind::warmup_cosine) {
    check_rate(warmup_min_ratio, "scheduler.params.warmup_min_ratio");
    check_rate(cos_min_ratio, "scheduler.params.cos_min_ratio");
  } else {
    check_rate(warmup_min_lr, "scheduler.params.warmup_min_lr");
    check_rate(warmup_max_lr, "scheduler.params.warmup_max_lr");
  }
  if (kind == LrScheduleKind::warmup) return;
  if (total_num_steps < 1)
    fail(
        "lr schedule {}: scheduler.params.total_num_steps is {}; it must be a whole number >= 1 "
        "(the step at which the decay ends); set it, or pass --steps",
        name, total_num_steps);
  if (total_num_steps < warmup_num_steps)
    log_warn(
        "lr schedule {}: total_num_steps {} is less than warmup_num_steps {}; the rate decays "
        "right after the warmup (DeepSpeed warns the same)",
        name, total_num_steps, warmup_num_steps);
}

double LrSchedule::at(int64_t i) const {
  if (kind == LrScheduleKind::constant) return lr;
  if (is_hugging_face_schedule(kind)) return lr * hugging_face_factor(i + 1);
  if (kind == LrScheduleKind::one_cycle) {
    if (i < 0) return cycle_min_lr;  // set when DeepSpeed makes the scheduler
    const OneCycleShape c = one_cycle_shape();
    if (static_cast<double>(i) < c.total_size)
      return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * c.scale_factor(i);
    if (decay_step_size == 0 || decay_lr_rate == 0.0) return cycle_min_lr;
    const double decay_interval = c.decay_iteration(i) / static_cast<double>(decay_step_size);
    return cycle_min_lr / (1 + decay_lr_rate * decay_interval);
  }
  if (kind == LrScheduleKind::lr_range_test) {
    if (i < 0) return range_test_min_lr;  // set when DeepSpeed makes the scheduler
    const double continuous = static_cast<double>(i) / static_cast<double>(range_test_step_size);
    const double interval = range_test_staircase ? std::floor(continuous) : continuous;
    return range_test_min_lr * (1 + range_test_step_rate * interval);
  }
  const int64_t W = std::max<int64_t>(2, warmup_num_steps);

  if (kind == LrScheduleKind::warmup_cosine) {
    if (i < 0) return lr * 0.0;  // DeepSpeed: "before it has started", ratio 0
    double ratio;
    if (i < W) {
      ratio = warmup_gamma(warmup_type, i, W);
      const double ratio_delta = 1. - warmup_min_ratio;
      ratio = warmup_min_ratio + ratio * ratio_delta;
    } else {
      const int64_t real_last_step = i - W + 1;
      const int64_t real_total_steps = std::max<int64_t>(1, total_num_steps - W);
      const double cosine_progress = std::min(
          1.0, static_cast<double>(real_last_step) / static_cast<double>(real_total_steps));
      const double ratio_delta = 1. - cos_min_ratio;
      ratio = (1 + std::cos(std::numbers::pi * cosine_progress)) / 2;
      ratio = std::max(0.0, cos_min_ratio + ratio_delta * ratio);
    }
    return lr * ratio;
  }

  // WarmupLR and WarmupDecayLR: min_lr + delta_lr * gamma.
  const double delta_lr = warmup_max_lr - warmup_min_lr;
  if (i < 0) return warmup_min_lr;  // DeepSpeed: "before it has started", min_lrs
  double gamma;
  if (i < W)
    gamma = warmup_gamma(warmup_type, i, W);
  else if (kind == LrScheduleKind::warmup)
    gamma = 1.0;
  else
    gamma = std::max(0.0, static_cast<double>(total_num_steps - i) /
                              std::max(1.0, static_cast<double>(total_num_steps - W)));
  return warmup_min_lr + (delta_lr * gamma);
}

double LrSchedule::hugging_face_factor(int64_t step) const {
  // transformers' lr_lambda at LambdaLR's step, in its order of operations (LambdaLR multiplies
  // the rate by it).
  const int64_t W = warmup_num_steps, T = total_num_steps;
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  if (kind == LrScheduleKind::hf_warmup_stable_decay) {
    const auto ramp = [&](RampShape shape, double progress, bool up) {
      if (shape == RampShape::linear) return up ? progress : 1.0 - progress;
      if (shape == RampShape::cosine)
        return up ? 0.5 * (1.0 - std::cos(std::numbers::pi * progress))
                  : 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress));
      return up ? 1.0 - std::sqrt(1.0 - progress) : 1.0 - std::sqrt(progress);
    };
    if (step < W) {
      const double factor = ramp(wsd_warmup, d(step) / d(std::max<int64_t>(1, W)), true);
      return std::max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio);
    }
    if (step < W + num_stable_steps) return 1.0;
    if (step < W + num_stable_steps + num_decay_steps) {
      const double progress =
          d(step - W - num_stable_steps) / d(std::max<int64_t>(1, num_decay_steps));
      const double factor = ramp(wsd_decay, progress, false);
      return std::max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio);
    }
    return min_lr_ratio;
  }
  if (step < W) return d(step) / d(std::max<int64_t>(1, W));
  switch (kind) {
    case LrScheduleKind::hf_constant_with_warmup:
      return 1.0;
    case LrScheduleKind::hf_linear:
      return std::max(0.0, d(T - step) / d(std::max<int64_t>(1, T - W)));
    case LrScheduleKind::hf_cosine_with_restarts: {
      const double progress = d(step - W) / d(std::max<int64_t>(1, T - W));
      if (progress >= 1.0) return 0.0;
      return std::max(
          0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * std::fmod(num_cycles * progress, 1.0))));
    }
    case LrScheduleKind::hf_polynomial: {
      if (step > T) return lr_end / lr;
      const double lr_range = lr - lr_end;
      const int64_t decay_steps = T - W;
      const double pct_remaining = 1 - d(step - W) / d(decay_steps);
      const double decay = lr_range * std::pow(pct_remaining, power) + lr_end;
      return decay / lr;
    }
    case LrScheduleKind::hf_inverse_sqrt: {
      const int64_t shift = timescale - W;
      return 1.0 / std::sqrt(d(step + shift) / d(timescale));
    }
    default: {  // cosine, cosine_with_min_lr
      const double progress = d(step - W) / d(std::max<int64_t>(1, T - W));
      double factor = 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress));
      factor = factor * (1 - min_lr_rate) + min_lr_rate;
      return std::max(0.0, factor);
    }
  }
}

std::optional<std::pair<double, double>> LrSchedule::betas_at(int64_t i) const {
  if (kind != LrScheduleKind::one_cycle || !cycle_momentum) return std::nullopt;
  constexpr double kBeta2 = 0.99;  // DeepSpeed's OneCycle pairs every momentum with it
  if (i < 0) return std::pair{cycle_min_mom, kBeta2};  // set when the scheduler is made
  const OneCycleShape c = one_cycle_shape();
  if (static_cast<double>(i) < c.total_size)
    return std::pair{cycle_max_mom - (cycle_max_mom - cycle_min_mom) * c.scale_factor(i), kBeta2};
  if (decay_step_size == 0 || decay_mom_rate == 0.0) return std::pair{cycle_max_mom, kBeta2};
  const double decay_interval = c.decay_iteration(i) / static_cast<double>(decay_step_size);
  return std::pair{cycle_max_mom * (1 + decay_mom_rate * decay_interval), kBeta2};
}

LrSchedule::OneCycleShape LrSchedule::one_cycle_shape() const {
  OneCycleShape c;
  const double first = static_cast<double>(cycle_first_step_size);
  c.total_size = first + static_cast<double>(cycle_second_step_size);
  c.step_ratio = first / c.total_size;
  return c;
}

double LrSchedule::OneCycleShape::scale_factor(int64_t i) const {
  const double batch_iteration = static_cast<double>(i + 1);
  const double cycle = std::floor(1 + batch_iteration / total_size);
  const double x = 1. + batch_iteration / total_size - cycle;
  return x <= step_ratio ? x / step_ratio : (x - 1) / (step_ratio - 1);
}

double LrSchedule::OneCycleShape::decay_iteration(int64_t i) const {
  return static_cast<double>(i) - total_size + 1;
}

LrSchedule lr_schedule_from_config(const DsConfig::Scheduler& config, double optimizer_lr,
                                   std::optional<int64_t> run_steps) {
  LrSchedule s;
  s.lr = optimizer_lr;
  if (!config.type.has_value()) {
    s.kind = LrScheduleKind::constant;
  } else if (*config.type == "WarmupLR") {
    s.kind = LrScheduleKind::warmup;
  } else if (*config.type == "WarmupDecayLR") {
    s.kind = LrScheduleKind::warmup_decay;
  } else if (*config.type == "WarmupCosineLR") {
    s.kind = LrScheduleKind::warmup_cosine;
  } else if (*config.type == "OneCycle") {
    return one_cycle_from_config(config, optimizer_lr, run_steps);
  } else if (*config.type == "LRRangeTest") {
    s.kind = LrScheduleKind::lr_range_test;
    s.range_test_min_lr = config.lr_range_test_min_lr.value_or(1e-3);
    s.range_test_step_size = config.lr_range_test_step_size.value_or(2000);
    s.range_test_step_rate = config.lr_range_test_step_rate.value_or(1.0);
    s.range_test_staircase = config.lr_range_test_staircase.value_or(false);
    s.validate();
    return s;
  } else {
    fail(
        "lr schedule: scheduler.type is \"{}\"; strata implements \"WarmupLR\", "
        "\"WarmupDecayLR\", \"WarmupCosineLR\", \"OneCycle\" and \"LRRangeTest\" (or no "
        "scheduler for a constant rate)",
        *config.type);
  }
  s.warmup_min_lr = config.warmup_min_lr.value_or(0.0);
  // Absent: DeepSpeed's default, which WarmupLR takes from the optimizer's lr and WarmupDecayLR
  // sets at 0.001; "auto": the lr, as Hugging Face fills it.
  s.warmup_max_lr = config.warmup_max_lr.value_or(
      s.kind == LrScheduleKind::warmup_decay && !config.warmup_max_lr_auto ? 1e-3 : optimizer_lr);
  if (s.kind != LrScheduleKind::constant && !config.warmup_num_steps &&
      config.warmup_num_steps_auto)
    fail(
        "lr schedule {}: scheduler.params.warmup_num_steps is \"auto\" and nothing sets it: "
        "Hugging Face fills it with its warmup steps, 0 unless --warmup_steps or "
        "--warmup_ratio is given, which DeepSpeed refuses (\"warmup_num_steps must be a "
        "positive integer\"); pass --warmup-steps N or --warmup-ratio R, or give the number in "
        "the config",
        lr_schedule_name(s.kind));
  s.warmup_num_steps = config.warmup_num_steps.value_or(1000);
  s.warmup_type =
      config.warmup_type.value_or("log") == "linear" ? WarmupShape::linear : WarmupShape::log;
  if (config.warmup_type.has_value() && *config.warmup_type != "log" &&
      *config.warmup_type != "linear")
    fail("lr schedule: scheduler.params.warmup_type is \"{}\"; expected \"log\" or \"linear\"",
         *config.warmup_type);
  s.warmup_min_ratio = config.warmup_min_ratio.value_or(0.0);
  s.cos_min_ratio = config.cos_min_ratio.value_or(1e-4);
  if (s.kind == LrScheduleKind::warmup_decay || s.kind == LrScheduleKind::warmup_cosine) {
    if (config.total_num_steps.has_value())
      s.total_num_steps = *config.total_num_steps;
    else if (run_steps.has_value())
      s.total_num_steps = *run_steps;
    else
      fail(
          "lr schedule {}: scheduler.params.total_num_steps is not set (or \"auto\") and the run "
          "has no step count to take it from; set total_num_steps in the config or pass --steps",
          lr_schedule_name(s.kind));
  }
  s.validate();
  return s;
}

namespace {

// Hugging Face's lr_scheduler_types strata runs, and the lr_scheduler_kwargs each one's function
// takes; get_scheduler passes none to constant, constant_with_warmup and inverse_sqrt (`passed`).
struct HuggingFaceType {
  const char* name;
  LrScheduleKind kind;
  std::vector<std::string> keys;
  bool passed = true;
};
const std::vector<HuggingFaceType>& hugging_face_types() {
  static const std::vector<HuggingFaceType> types = {
      {"constant", LrScheduleKind::constant, {}, false},
      {"linear", LrScheduleKind::hf_linear, {}},
      {"cosine", LrScheduleKind::hf_cosine, {"num_cycles"}},
      {"constant_with_warmup", LrScheduleKind::hf_constant_with_warmup, {}, false},
      {"cosine_with_restarts", LrScheduleKind::hf_cosine_with_restarts, {"num_cycles"}},
      {"polynomial", LrScheduleKind::hf_polynomial, {"lr_end", "power"}},
      {"inverse_sqrt", LrScheduleKind::hf_inverse_sqrt, {}, false},
      {"cosine_with_min_lr",
       LrScheduleKind::hf_cosine_with_min_lr,
       {"num_cycles", "min_lr", "min_lr_rate"}},
      {"warmup_stable_decay",
       LrScheduleKind::hf_warmup_stable_decay,
       {"num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
        "num_cycles"}}};
  return types;
}

}  // namespace

bool is_hugging_face_schedule_type(const std::string& type) {
  if (type == "reduce_lr_on_plateau" || type == "cosine_warmup_with_min_lr") return true;
  for (const HuggingFaceType& x : hugging_face_types())
    if (type == x.name) return true;
  return false;
}

LrSchedule hugging_face_lr_schedule(const std::string& type, double lr, int64_t warmup_steps,
                                    int64_t total_steps, const nlohmann::json& kwargs) {
  LrSchedule s;
  s.lr = lr;
  const HuggingFaceType* t = nullptr;
  std::string known;
  for (const HuggingFaceType& x : hugging_face_types()) {
    if (type == x.name) t = &x;
    known += fmt::format("{}{}", known.empty() ? "" : ", ", x.name);
  }
  if (type == "reduce_lr_on_plateau")
    fail(
        "lr schedule: Hugging Face's reduce_lr_on_plateau lowers the rate when the evaluation "
        "loss stops improving, which strata's schedules, fixed functions of the update count, "
        "do not do; strata runs {}",
        known);
  if (t == nullptr)
    fail(
        "lr schedule: Hugging Face's lr_scheduler_type \"{}\" is not implemented; strata runs {} "
        "(and DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)",
        type, known);
  s.kind = t->kind;
  s.warmup_num_steps = warmup_steps;
  s.total_num_steps = total_steps;
  if (s.kind == LrScheduleKind::hf_cosine_with_restarts) s.num_cycles = 1.0;
  if (s.kind == LrScheduleKind::hf_inverse_sqrt)
    s.timescale = warmup_steps > 0 ? warmup_steps : 10000;

  if (!kwargs.is_object())
    fail(
        "lr schedule {}: lr_scheduler_kwargs is {}; give a JSON object, e.g. {{\"num_cycles\": 1}}",
        type, kwargs.dump());
  if (!t->passed && !kwargs.empty())
    log_warn(
        "lr schedule {}: lr_scheduler_kwargs {} ignored: Hugging Face's get_scheduler passes "
        "none to {}",
        type, kwargs.dump(), type);
  const auto number = [&](const std::string& key, const nlohmann::json& v) {
    if (!v.is_number())
      fail("lr schedule {}: lr_scheduler_kwargs {} is {}; expected a number", type, key, v.dump());
    return v.get<double>();
  };
  const auto steps = [&](const std::string& key, const nlohmann::json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      fail("lr schedule {}: lr_scheduler_kwargs {} is {}; expected a whole number of steps >= 0",
           type, key, v.dump());
    return v.get<int64_t>();
  };
  const auto ramp = [&](const std::string& key, const nlohmann::json& v) {
    const std::string r = v.is_string() ? v.get<std::string>() : "";
    if (r == "linear") return RampShape::linear;
    if (r == "cosine") return RampShape::cosine;
    if (r == "1-sqrt") return RampShape::one_minus_sqrt;
    fail(
        "lr schedule {}: lr_scheduler_kwargs {} is {}; expected \"linear\", \"cosine\" or "
        "\"1-sqrt\"",
        type, key, v.dump());
  };
  std::optional<double> min_lr, min_lr_rate;
  std::optional<int64_t> stable, decay;
  for (const auto& [key, v] : kwargs.items()) {
    if (!t->passed) break;
    if (std::find(t->keys.begin(), t->keys.end(), key) == t->keys.end()) {
      std::string takes;
      for (const std::string& k : t->keys)
        takes += fmt::format("{}{}", takes.empty() ? "" : ", ", k);
      fail(
          "lr schedule {}: lr_scheduler_kwargs has \"{}\", which transformers' {} schedule does "
          "not take (a TypeError there); it takes {}",
          type, key, type, takes.empty() ? std::string("none") : takes);
    }
    if (key == "num_cycles")
      s.num_cycles = number(key, v);
    else if (key == "lr_end")
      s.lr_end = number(key, v);
    else if (key == "power")
      s.power = number(key, v);
    else if (key == "min_lr")
      min_lr = number(key, v);
    else if (key == "min_lr_rate")
      min_lr_rate = number(key, v);
    else if (key == "min_lr_ratio")
      s.min_lr_ratio = number(key, v);
    else if (key == "num_decay_steps")
      decay = steps(key, v);
    else if (key == "num_stable_steps")
      stable = steps(key, v);
    else if (key == "warmup_type")
      s.wsd_warmup = ramp(key, v);
    else if (key == "decay_type")
      s.wsd_decay = ramp(key, v);
  }
  if (s.kind == LrScheduleKind::hf_cosine_with_min_lr) {
    if (min_lr && min_lr_rate)
      fail(
          "lr schedule cosine_with_min_lr: lr_scheduler_kwargs sets both min_lr and "
          "min_lr_rate; give one, as transformers requires");
    if (!min_lr && !min_lr_rate)
      fail(
          "lr schedule cosine_with_min_lr: lr_scheduler_kwargs sets neither min_lr nor "
          "min_lr_rate; give one (e.g. --lr-scheduler-kwargs '{{\"min_lr_rate\": 0.1}}'), as "
          "transformers requires");
    s.min_lr_rate = min_lr ? *min_lr / lr : *min_lr_rate;
  }
  if (s.kind == LrScheduleKind::hf_warmup_stable_decay) {
    if (!decay)
      fail(
          "lr schedule warmup_stable_decay: lr_scheduler_kwargs has no num_decay_steps, which "
          "transformers' get_wsd_schedule requires; give it (e.g. --lr-scheduler-kwargs "
          "'{{\"num_decay_steps\": 100}}')");
    s.num_decay_steps = *decay;
    s.num_stable_steps = stable ? *stable : total_steps - warmup_steps - *decay;
    if (stable)
      log_warn(
          "lr schedule warmup_stable_decay: num_stable_steps {} is used, not the run's {} steps "
          "(transformers warns the same: both given)",
          *stable, total_steps);
  }
  s.validate();
  return s;
}

}  // namespace strata
