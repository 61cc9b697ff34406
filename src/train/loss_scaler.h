// loss_scaler.h: fp16 loss scaling with DeepSpeed's semantics (deepspeed/runtime/fp16/
// loss_scaler.py, DynamicLossScaler, which ZeRO's optimizers run), a static scale when
// fp16.loss_scale > 0, and scale 1 with no dynamics for bf16 and fp32.
//
// The dynamic rule, per optimizer step, once the step's gradients are known to be finite or not:
// - overflow: if hysteresis is spent (1 left, or fp16.hysteresis is 1) the scale halves, never
//   below min_loss_scale; otherwise one unit of hysteresis is used up and the scale stays. An
//   overflow with the scale already at min_loss_scale and no hysteresis left is an Error, as
//   DeepSpeed raises ("cannot decrease scale anymore").
// - no overflow: with c the count of clean steps since the last overflow (or the start) before
//   this one, the scale doubles when (c + 1) % loss_scale_window == 0: with window W on the W-th
//   clean step, then every W (DeepSpeed's (cur_iter - last_overflow_iter) % scale_window, its
//   last_overflow_iter -1 at the start). Hysteresis refills at a doubling or, with
//   fp16.consecutive_hysteresis, at every clean step, so only overflows in a row use it up.
// The state is three plain numbers, saved in checkpoints and restored bit for bit so a resumed
// run scales exactly as an uninterrupted one.
#pragma once

#include "train/ds_config.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string_view>

namespace strata {

struct LossScaleSettings {
  bool fp16 = false;           // scaling applies only to fp16; otherwise the scale is 1, always
  bool dynamic = false;        // fp16 with fp16.loss_scale 0 (DeepSpeed's default)
  double initial_scale = 1.0;  // 2^initial_scale_power when dynamic, else fp16.loss_scale
  int64_t window = 1000;       // fp16.loss_scale_window
  int hysteresis = 2;          // fp16.hysteresis
  double min_scale = 1.0;      // fp16.min_loss_scale
  bool consecutive_hysteresis = false;  // fp16.consecutive_hysteresis

  // Throws an Error naming the fp16.* key, its value and the accepted range.
  void validate() const;
};

// The settings a config asks for. `fp16_enabled` is the run's precision (config or flags);
// unset fp16 keys take DeepSpeed's defaults: loss_scale 0 (dynamic), initial_scale_power 16,
// loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false, min_loss_scale 1.
// Validated.
LossScaleSettings loss_scale_settings(const DsConfig::Fp16& fp16, bool fp16_enabled);

struct LossScaleState {
  double scale = 1.0;
  int64_t clean_steps = 0;  // consecutive steps without overflow since the last overflow
  int hysteresis_left = 1;  // overflows still absorbed before the scale halves

  bool operator==(const LossScaleState&) const = default;
  // {"scale", "clean_steps", "hysteresis_left"}; doubles are written so they read back
  // bit for bit.
  nlohmann::json to_json() const;
  // `source` names the checkpoint file in errors; a missing key or a wrong type or value is an
  // Error naming it.
  static LossScaleState from_json(const nlohmann::json& json, std::string_view source);
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleSettings& settings);  // validates; starts at initial_scale

  double scale() const { return state_.scale; }
  bool dynamic() const { return settings_.dynamic; }
  const LossScaleSettings& settings() const { return settings_; }
  const LossScaleState& state() const { return state_; }

  // Records one optimizer step's outcome and returns whether the step must be skipped: any
  // overflow skips it (non-finite gradients never reach the weights), in every mode; only a
  // dynamic scaler changes its scale.
  bool update(bool overflow);

  // Continues from a checkpoint's state; an Error when it cannot come from these settings
  // (a scale below min_loss_scale, hysteresis outside 1..fp16.hysteresis). A static or unit
  // scaler keeps its configured scale and only checks the state.
  void restore(const LossScaleState& state);

 private:
  LossScaleSettings settings_;
  LossScaleState state_;
};

}  // namespace strata
