// loss_scaler.cpp: see loss_scaler.h. `update` follows DeepSpeed's DynamicLossScaler.update_scale
// step for step; its cur_iter - last_overflow_iter - 1 is our clean_steps (before this step).
#include "train/loss_scaler.h"

#include "core/error.h"
#include "core/log.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace strata {

void LossScaleSettings::validate() const {
  if (!fp16) return;
  if (!std::isfinite(initial_scale) || initial_scale <= 0.0)
    fail(
        "fp16 loss scale: the initial scale is {} ({}); it must be a finite number > 0; set "
        "fp16.initial_scale_power, or fp16.loss_scale 0 for dynamic scaling",
        initial_scale, dynamic ? "2^fp16.initial_scale_power" : "fp16.loss_scale");
  if (!dynamic) return;
  if (window < 1)
    fail("fp16 loss scale: fp16.loss_scale_window is {}; it must be a whole number >= 1", window);
  if (hysteresis < 1)
    fail("fp16 loss scale: fp16.hysteresis is {}; it must be a whole number >= 1", hysteresis);
  if (!std::isfinite(min_scale) || min_scale <= 0.0)
    fail("fp16 loss scale: fp16.min_loss_scale is {}; it must be a finite number > 0", min_scale);
  if (initial_scale < min_scale)
    fail(
        "fp16 loss scale: the initial scale {} (2^fp16.initial_scale_power) is below "
        "fp16.min_loss_scale {}; raise initial_scale_power or lower min_loss_scale",
        initial_scale, min_scale);
}

LossScaleSettings loss_scale_settings(const DsConfig::Fp16& fp16, bool fp16_enabled) {
  LossScaleSettings s;
  s.fp16 = fp16_enabled;
  if (!fp16_enabled) return s;
  const double static_scale = fp16.loss_scale.value_or(0.0);
  s.dynamic = static_scale == 0.0;
  if (s.dynamic) {
    s.initial_scale = std::ldexp(1.0, fp16.initial_scale_power.value_or(16));
  } else {
    s.initial_scale = static_scale;
  }
  s.window = fp16.loss_scale_window.value_or(1000);
  s.hysteresis = fp16.hysteresis.value_or(2);
  s.min_scale = fp16.min_loss_scale.value_or(1.0);
  s.consecutive_hysteresis = fp16.consecutive_hysteresis.value_or(false);
  s.validate();
  return s;
}

nlohmann::json LossScaleState::to_json() const {
  return {{"scale", scale}, {"clean_steps", clean_steps}, {"hysteresis_left", hysteresis_left}};
}

LossScaleState LossScaleState::from_json(const nlohmann::json& json, std::string_view source) {
  if (!json.is_object())
    fail(
        "{}: the loss scale state is {}; expected an object with scale, clean_steps and "
        "hysteresis_left; the checkpoint is damaged",
        source, json.dump());
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!json.contains(key))
      fail(
          "{}: the loss scale state has no \"{}\"; the checkpoint is damaged or from another "
          "version",
          source, key);
    return json.at(key);
  };
  LossScaleState s;
  const nlohmann::json& scale = field("scale");
  if (!scale.is_number() || !std::isfinite(scale.get<double>()) || scale.get<double>() <= 0.0)
    fail("{}: loss scale state \"scale\" is {}; expected a finite number > 0", source,
         scale.dump());
  s.scale = scale.get<double>();
  const nlohmann::json& clean = field("clean_steps");
  if (!clean.is_number_integer() || clean.get<int64_t>() < 0)
    fail("{}: loss scale state \"clean_steps\" is {}; expected a whole number >= 0", source,
         clean.dump());
  s.clean_steps = clean.get<int64_t>();
  const nlohmann::json& left = field("hysteresis_left");
  if (!left.is_number_integer() || left.get<int64_t>() < 1 ||
      left.get<int64_t>() > std::numeric_limits<int>::max())
    fail("{}: loss scale state \"hysteresis_left\" is {}; expected a whole number >= 1", source,
         left.dump());
  s.hysteresis_left = static_cast<int>(left.get<int64_t>());
  return s;
}

LossScaler::LossScaler(const LossScaleSettings& settings) : settings_(settings) {
  settings_.validate();
  state_.scale = settings_.fp16 ? settings_.initial_scale : 1.0;
  state_.hysteresis_left = settings_.dynamic ? settings_.hysteresis : 1;
}

bool LossScaler::update(bool overflow) {
  if (!settings_.dynamic) return overflow;
  if (overflow) {
    if (settings_.hysteresis == 1 || state_.hysteresis_left == 1) {
      if (state_.scale == settings_.min_scale)
        fail(
            "fp16 loss scale: the gradients overflowed at the minimum loss scale {} "
            "(fp16.min_loss_scale) with no hysteresis left, so no scale can make them finite; "
            "lower the learning rate, check the data, lower fp16.min_loss_scale, or train in bf16",
            state_.scale);
      state_.scale = std::max(state_.scale / 2.0, settings_.min_scale);
    } else {
      state_.hysteresis_left -= 1;
    }
    state_.clean_steps = 0;
    return true;
  }
  if (settings_.consecutive_hysteresis) state_.hysteresis_left = settings_.hysteresis;
  if ((state_.clean_steps + 1) % settings_.window == 0) {
    state_.hysteresis_left = settings_.hysteresis;
    state_.scale *= 2.0;
  }
  state_.clean_steps += 1;
  return false;
}

void LossScaler::restore(const LossScaleState& state) {
  if (!std::isfinite(state.scale) || state.scale <= 0.0 || state.clean_steps < 0)
    fail("loss scale state (scale {}, clean_steps {}) is not valid; the checkpoint is damaged",
         state.scale, state.clean_steps);
  if (!settings_.dynamic) {
    const double configured = settings_.fp16 ? settings_.initial_scale : 1.0;
    if (state.scale != configured)
      log_warn(
          "the checkpoint's loss scale {} differs from the configured static scale {}; "
          "using the configured one",
          state.scale, configured);
    return;
  }
  if (state.scale < settings_.min_scale)
    fail(
        "loss scale state: scale {} is below fp16.min_loss_scale {}; resume with the config the "
        "checkpoint was written with, or lower min_loss_scale",
        state.scale, settings_.min_scale);
  if (state.hysteresis_left < 1 || state.hysteresis_left > settings_.hysteresis)
    fail(
        "loss scale state: hysteresis_left {} is outside 1..{} (fp16.hysteresis); resume with the "
        "config the checkpoint was written with",
        state.hysteresis_left, settings_.hysteresis);
  state_ = state;
}

}  // namespace strata
