// lr_schedule.h: DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR,
// OneCycle, which also cycles Adam's beta1, and LRRangeTest), Hugging Face's (lr_scheduler_type
// linear, cosine, constant_with_warmup: what its Trainer runs beside a DeepSpeed config that has no
// scheduler) and a constant rate, as a pure function of how many optimizer updates have been
// applied.
//
// The formulas are those of DeepSpeed's deepspeed/runtime/lr_schedules.py as of its mid-2026
// master (after PR 8142: WarmupCosineLR floors its cosine window at one step and clamps the
// progress at 1, so past total_num_steps the rate stays at cos_min_ratio; earlier releases let
// the cosine rise again there and are otherwise the same). They are evaluated in the same
// order, in doubles, with the same libm calls, so each rate has Python's bits.
//
// The one thing to know before editing: DeepSpeed indexes its scheduler by
// `last_batch_iteration`, which starts at -1 and is stepped after each applied optimizer update
// (an fp16 update skipped for overflow does not step it). So update number k (k = 0 for the
// first) uses last_batch_iteration k - 1: the first update runs at -1, where WarmupLR and
// WarmupDecayLR give warmup_min_lr and WarmupCosineLR gives 0; the second at 0, where the log
// and linear warmups are also at their minimum. `for_update(k)` does this mapping; `at` takes
// DeepSpeed's index itself. Hugging Face's schedules are LambdaLR's, whose step count is 0 at
// the first update: update k runs at its step k, which `at(k - 1)` maps to, so the first update
// of a warmup runs at rate 0, as in Hugging Face.
//
// OneCycle and LRRangeTest set the optimizer's rate when they are made (index -1): cycle_min_lr
// and lr_range_test_min_lr, and OneCycle with cycle_momentum Adam's betas (cycle_min_mom, 0.99).
// Each later index is DeepSpeed's formula. OneCycle's is that of DeepSpeed's lr_schedules.py
// as it has been since its decay switches (skip_lr_decay) came in: the cycle evaluated at index
// + 1, and cycle_min_lr held after the cycle unless decay_step_size and decay_lr_rate are both
// set. Older releases evaluated the cycle at the index itself.
#pragma once

#include "train/ds_config.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace strata {

enum class LrScheduleKind : uint8_t {
  constant,
  warmup,
  warmup_decay,
  warmup_cosine,
  hf_linear,                // Hugging Face's get_linear_schedule_with_warmup
  hf_cosine,                // get_cosine_schedule_with_warmup (half a cycle)
  hf_constant_with_warmup,  // get_constant_schedule_with_warmup
  one_cycle,                // DeepSpeed's OneCycle
  lr_range_test,            // DeepSpeed's LRRangeTest
  hf_cosine_with_restarts,  // get_cosine_with_hard_restarts_schedule_with_warmup
  hf_polynomial,            // get_polynomial_decay_schedule_with_warmup
  hf_inverse_sqrt,          // get_inverse_sqrt_schedule
  hf_cosine_with_min_lr,    // get_cosine_with_min_lr_schedule_with_warmup
  hf_warmup_stable_decay,   // get_wsd_schedule
};
enum class WarmupShape : uint8_t { log, linear };
// The shapes of a warmup-stable-decay schedule's ramps (its warmup_type and decay_type).
enum class RampShape : uint8_t { linear, cosine, one_minus_sqrt };

// "none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest" (the names
// of the config's scheduler.type, "none" for no scheduler), and Hugging Face's "linear", "cosine",
// "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt",
// "cosine_with_min_lr", "warmup_stable_decay" (its lr_scheduler_type).
std::string lr_schedule_name(LrScheduleKind kind);
bool is_hugging_face_schedule(LrScheduleKind kind);

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  double lr = 1e-3;  // the optimizer's lr: the constant rate, and WarmupCosineLR's base

  // WarmupLR, WarmupDecayLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps.
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  // All warmup kinds. As configured; the formulas use max(2, warmup_num_steps), as DeepSpeed.
  int64_t warmup_num_steps = 1000;
  WarmupShape warmup_type = WarmupShape::log;
  // WarmupDecayLR (linear decay back to warmup_min_lr at total_num_steps) and WarmupCosineLR.
  int64_t total_num_steps = 0;
  // WarmupCosineLR: ratios of `lr`; warmup from warmup_min_ratio to 1, then a cosine down to
  // cos_min_ratio at total_num_steps.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;

  // Hugging Face's, from its lr_scheduler_kwargs. The cosines' waves (0.5: half a cosine;
  // cosine_with_restarts' count of restarts, 1 by default); cosine_with_min_lr's floor as a ratio
  // of `lr` (0 for plain cosine); polynomial's end rate and power; inverse_sqrt's timescale (its
  // warmup, or 10000 without one); warmup_stable_decay's stable and decay lengths, ramp shapes
  // and floor (min_lr_ratio, which its warmup starts from too).
  double num_cycles = 0.5;
  double min_lr_rate = 0.0;
  double lr_end = 1e-7, power = 1.0;
  int64_t timescale = 10000;
  int64_t num_stable_steps = 0, num_decay_steps = 0;
  RampShape wsd_warmup = RampShape::linear, wsd_decay = RampShape::cosine;
  double min_lr_ratio = 0.0;

  // OneCycle: from cycle_min_lr up to cycle_max_lr over cycle_first_step_size updates and back
  // over cycle_second_step_size (DeepSpeed's default: the first's), beta1 cycling the other way
  // between cycle_max_mom and cycle_min_mom when cycle_momentum is on (beta2 then 0.99, DeepSpeed's
  // constant); after the cycle cycle_min_lr / (1 + decay_lr_rate x n / decay_step_size) and
  // beta1 cycle_max_mom x (1 + decay_mom_rate x n / decay_step_size), n updates past it (no
  // decay where decay_step_size or the rate is 0).
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0, decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000, cycle_second_step_size = 2000, decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;
  // LRRangeTest: lr_range_test_min_lr x (1 + step_rate x i / step_size), i / step_size rounded
  // down with staircase.
  double range_test_min_lr = 1e-3, range_test_step_rate = 1.0;
  int64_t range_test_step_size = 2000;
  bool range_test_staircase = false;

  // Throws an Error naming the setting (by its JSON path under scheduler.params, or the
  // optimizer's lr), its value and the accepted range: a negative or non-finite rate or ratio,
  // warmup_num_steps < 1, or, for the decaying kinds, total_num_steps < 1. total_num_steps below
  // warmup_num_steps is accepted with a warning, as DeepSpeed does.
  void validate() const;

  // The rate DeepSpeed's scheduler sets at `last_batch_iteration` (-1 before its first step).
  double at(int64_t last_batch_iteration) const;
  // The rate of optimizer update number `applied` (0 for the first), counting only updates that
  // were applied: at(applied - 1).
  double for_update(int64_t applied) const { return at(applied - 1); }
  // Adam's (beta1, beta2) as the scheduler sets them at `last_batch_iteration`, where it sets
  // them (OneCycle with cycle_momentum); else none: the optimizer's own.
  std::optional<std::pair<double, double>> betas_at(int64_t last_batch_iteration) const;
  std::optional<std::pair<double, double>> betas_for_update(int64_t applied) const {
    return betas_at(applied - 1);
  }

 private:
  // A Hugging Face schedule's multiplier of `lr` at LambdaLR's step.
  double hugging_face_factor(int64_t step) const;
  // OneCycle's cycle: its length in updates and the rising part's share, as DeepSpeed holds them
  // (floats), the scale (0 at cycle_min_lr, 1 at cycle_max_lr) at index i within the cycle, and
  // how many updates past the cycle index i is.
  struct OneCycleShape {
    double total_size = 0, step_ratio = 0;
    double scale_factor(int64_t i) const;
    double decay_iteration(int64_t i) const;
  };
  OneCycleShape one_cycle_shape() const;
};

// The schedule a DeepSpeed config's `scheduler` section asks for, resolved as DeepSpeed does
// where a value is unset (absent, or "auto"): warmup_min_lr 0, warmup_num_steps 1000,
// warmup_type log, warmup_min_ratio 0, cos_min_ratio 0.0001, and an absent warmup_max_lr the
// optimizer's lr for WarmupLR and 0.001 for WarmupDecayLR. "auto" is what Hugging Face's
// integration fills in from its flags: warmup_max_lr the optimizer's lr; warmup_num_steps the
// caller's warmup flag, so an "auto" left unset here is an Error (Hugging Face would fill 0,
// which DeepSpeed refuses). An unset total_num_steps (absent or "auto") is `run_steps` (the
// run's --steps; an Error when there is none either, since DeepSpeed requires it). OneCycle
// needs cycle_min_lr and cycle_max_lr (DeepSpeed's constructor has no defaults for them); its
// other settings and LRRangeTest's default as in DeepSpeed; none of them may be "auto", which
// Hugging Face fills for the warmup schedulers only. A OneCycle whose momentum decay would take
// beta1 to 1 or more within `run_steps` updates is an Error. No scheduler type: the constant
// `optimizer_lr`. Validated.
LrSchedule lr_schedule_from_config(const DsConfig::Scheduler& config, double optimizer_lr,
                                   std::optional<int64_t> run_steps);

// Hugging Face's schedule of lr_scheduler_type `type` ("linear", "cosine",
// "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt",
// "cosine_with_min_lr", "warmup_stable_decay", or "constant", which is the constant rate): from 0
// to `lr` over `warmup_steps` updates (0: none, Hugging Face's default), then as the type goes
// over `total_steps` (transformers' get_scheduler, its `lr_scheduler_kwargs` from `kwargs`, a
// JSON object: a key the type's function does not take is an Error, as its TypeError is, except
// for the types get_scheduler passes none to (constant, constant_with_warmup, inverse_sqrt),
// which ignore them with a warning, as it does). Validated; an unknown type is an Error listing
// the known ones.
// Whether `type` is one of Hugging Face's lr_scheduler_types (those strata runs, and
// reduce_lr_on_plateau and cosine_warmup_with_min_lr, which it refuses by name), not DeepSpeed's.
bool is_hugging_face_schedule_type(const std::string& type);
LrSchedule hugging_face_lr_schedule(const std::string& type, double lr, int64_t warmup_steps,
                                    int64_t total_steps,
                                    const nlohmann::json& kwargs = nlohmann::json::object());

}  // namespace strata
