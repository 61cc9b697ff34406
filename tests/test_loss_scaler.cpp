// test_loss_scaler.cpp: DeepSpeed's dynamic fp16 loss scaling over sequences of overflow and
// clean steps worked out by hand (hysteresis, consecutive or not, the W-th clean step doubling,
// the floor and the error at it) and over random ones against DynamicLossScaler.update_scale
// transcribed as DeepSpeed writes it, static and unit scales, defaults from a config, and the
// state's JSON round trip bit for bit.
#include "testing.h"
#include "train/loss_scaler.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>

namespace strata {
namespace {

using test::expect_error;

LossScaleSettings dynamic_settings(double initial, int64_t window, int hysteresis,
                                   double min_scale) {
  LossScaleSettings s;
  s.fp16 = true;
  s.dynamic = true;
  s.initial_scale = initial;
  s.window = window;
  s.hysteresis = hysteresis;
  s.min_scale = min_scale;
  return s;
}

// Runs `steps` ('o' overflow, '.' clean) and returns the scale after each.
std::vector<double> run(LossScaler& scaler, const std::string& steps) {
  std::vector<double> scales;
  for (char c : steps) {
    const bool skipped = scaler.update(c == 'o');
    EXPECT_EQ(skipped, c == 'o');
    scales.push_back(scaler.scale());
  }
  return scales;
}

TEST(LossScaler, DefaultsFromAConfigAreDeepSpeeds) {
  const LossScaleSettings s = loss_scale_settings(DsConfig::Fp16{}, true);
  EXPECT_TRUE(s.dynamic);
  EXPECT_EQ(s.initial_scale, 65536.0);  // 2^16
  EXPECT_EQ(s.window, 1000);
  EXPECT_EQ(s.hysteresis, 2);
  EXPECT_EQ(s.min_scale, 1.0);
  DsConfig::Fp16 f;
  f.initial_scale_power = 12;
  f.loss_scale_window = 50;
  f.hysteresis = 4;
  f.min_loss_scale = 0.5;
  const LossScaleSettings t = loss_scale_settings(f, true);
  EXPECT_EQ(t.initial_scale, 4096.0);
  EXPECT_EQ(t.window, 50);
  EXPECT_EQ(t.hysteresis, 4);
  EXPECT_EQ(t.min_scale, 0.5);
  EXPECT_EQ(LossScaler(t).state().hysteresis_left, 4);
}

TEST(LossScaler, TheFirstDoublingComesOnTheWindowsLastStepThenEveryWindow) {
  LossScaler s(dynamic_settings(16, 3, 2, 1));
  EXPECT_EQ(s.scale(), 16);
  // Clean step c (0-based since the start) doubles when (c + 1) % 3 == 0.
  EXPECT_EQ(run(s, "........."), (std::vector<double>{16, 16, 32, 32, 32, 64, 64, 64, 128}));
  EXPECT_EQ(s.state().clean_steps, 9);
  EXPECT_EQ(run(s, "."), std::vector<double>{128});
  // After an overflow the count starts again: the third clean step after it doubles.
  EXPECT_EQ(run(s, "o...."), (std::vector<double>{128, 128, 128, 256, 256}));
}

TEST(LossScaler, HysteresisAbsorbsOverflowsBeforeTheScaleHalves) {
  LossScaler s(dynamic_settings(64, 3, 2, 1));
  // 1st overflow uses the hysteresis (scale stays), the next ones halve.
  EXPECT_EQ(run(s, "ooo"), (std::vector<double>{64, 32, 16}));
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_EQ(s.state().clean_steps, 0);
  // Clean steps alone do not refill the hysteresis (consecutive_hysteresis false) ...
  EXPECT_EQ(run(s, "..o"), (std::vector<double>{16, 16, 8}));
  // ... a doubling does: the 3rd clean step after the overflow doubles and refills.
  EXPECT_EQ(run(s, "...."), (std::vector<double>{8, 8, 16, 16}));
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_EQ(run(s, "o.o"), (std::vector<double>{16, 16, 8}));
}

TEST(LossScaler, ConsecutiveHysteresisRefillsAtEveryCleanStep) {
  // Alternating overflows: without consecutive_hysteresis each one after the first halves;
  // with it a clean step between them refills the hysteresis, and the scale holds.
  LossScaler plain(dynamic_settings(64, 1000, 2, 1));
  EXPECT_EQ(run(plain, "o.o.o.o"), (std::vector<double>{64, 64, 32, 32, 16, 16, 8}));
  LossScaleSettings c = dynamic_settings(64, 1000, 2, 1);
  c.consecutive_hysteresis = true;
  LossScaler consecutive(c);
  EXPECT_EQ(run(consecutive, "o.o.o.o"), std::vector<double>(7, 64));
  // Two in a row still halve: the first uses the hysteresis a clean step refilled.
  EXPECT_EQ(run(consecutive, ".oo"), (std::vector<double>{64, 64, 32}));
  DsConfig::Fp16 f;
  f.consecutive_hysteresis = true;
  EXPECT_TRUE(loss_scale_settings(f, true).consecutive_hysteresis);
  EXPECT_FALSE(loss_scale_settings(DsConfig::Fp16{}, true).consecutive_hysteresis);
}

// DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py) as it is
// written there, with its counters: cur_iter from 0, last_overflow_iter from -1, cur_hysteresis
// from delayed_shift, and raise_error_at_min_scale on.
struct DeepSpeedScaler {
  double cur_scale, min_scale;
  int64_t scale_window, cur_iter = 0, last_overflow_iter = -1;
  int delayed_shift, cur_hysteresis;
  bool consecutive_hysteresis;

  void update_scale(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale)
          throw std::runtime_error("Current loss scale already at minimum");
        cur_scale = std::max(cur_scale / 2.0, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= 2.0;
      }
    }
    cur_iter += 1;
  }
};

TEST(LossScaler, RandomSequencesGiveDeepSpeedsScales) {
  std::mt19937 rng(7);
  int cases = 0;
  for (int64_t window : {1, 2, 3, 7})
    for (int hysteresis : {1, 2, 3})
      for (bool consecutive : {false, true})
        for (double p_overflow : {0.1, 0.3, 0.6}) {
          SCOPED_TRACE(::testing::Message()
                       << "window " << window << " hysteresis " << hysteresis << " consecutive "
                       << consecutive << " p " << p_overflow);
          LossScaleSettings st = dynamic_settings(1024, window, hysteresis, 0.25);
          st.consecutive_hysteresis = consecutive;
          LossScaler ours(st);
          DeepSpeedScaler ref{1024, 0.25, window, 0, -1, hysteresis, hysteresis, consecutive};
          std::bernoulli_distribution overflow(p_overflow);
          for (int i = 0; i < 300; ++i) {
            const bool o = overflow(rng);
            bool ref_threw = false, ours_threw = false;
            try {
              ref.update_scale(o);
            } catch (const std::runtime_error&) {
              ref_threw = true;
            }
            try {
              ours.update(o);
            } catch (const Error&) {
              ours_threw = true;
            }
            ASSERT_EQ(ours_threw, ref_threw) << "step " << i;
            if (ref_threw) break;  // both refuse the step; DeepSpeed's run ends there too
            ASSERT_EQ(ours.scale(), ref.cur_scale) << "step " << i;
            ASSERT_EQ(ours.state().hysteresis_left, ref.cur_hysteresis) << "step " << i;
          }
          ++cases;
        }
  EXPECT_EQ(cases, 72);
}

TEST(LossScaler, HysteresisOfOneHalvesAtEveryOverflow) {
  LossScaler s(dynamic_settings(1024, 1000, 1, 1));
  EXPECT_EQ(run(s, "o.o.o"), (std::vector<double>{512, 512, 256, 256, 128}));
}

TEST(LossScaler, WindowOfOneDoublesAtEveryCleanStep) {
  LossScaler s(dynamic_settings(2, 1, 2, 1));
  EXPECT_EQ(run(s, "....o.."), (std::vector<double>{4, 8, 16, 32, 32, 64, 128}));
}

TEST(LossScaler, TheScaleStopsAtTheMinimumThenAnOverflowThereIsAnError) {
  LossScaler s(dynamic_settings(16, 1000, 1, 3));
  EXPECT_EQ(run(s, "oo"), (std::vector<double>{8, 4}));
  EXPECT_EQ(run(s, "o"), std::vector<double>{3});  // max(4 / 2, 3)
  expect_error([&] { s.update(true); }, {"minimum loss scale 3", "fp16.min_loss_scale", "bf16"});
  EXPECT_EQ(s.scale(), 3);  // unchanged by the refused step
  // With hysteresis left, an overflow at the floor only uses it up.
  LossScaler h(dynamic_settings(1, 1000, 2, 1));
  EXPECT_TRUE(h.update(true));
  EXPECT_EQ(h.scale(), 1);
  EXPECT_THROW(h.update(true), Error);
}

TEST(LossScaler, StaticAndUnitScalesNeverChangeButOverflowsStillSkip) {
  DsConfig::Fp16 f;
  f.loss_scale = 128;
  LossScaler st(loss_scale_settings(f, true));
  EXPECT_FALSE(st.dynamic());
  EXPECT_EQ(run(st, "oo....o"), std::vector<double>(7, 128));
  LossScaler bf16(loss_scale_settings(f, false));  // bf16 / fp32: scale 1
  EXPECT_FALSE(bf16.dynamic());
  EXPECT_EQ(run(bf16, "o..o"), std::vector<double>(4, 1));
}

TEST(LossScaler, StateRoundTripsThroughJsonBitForBit) {
  LossScaler s(dynamic_settings(0.1 * 3, 2, 3, 0.1 * 3 / 64));  // not a power of two
  run(s, "o.....oo.");
  const LossScaleState before = s.state();
  const std::string text = before.to_json().dump();
  const LossScaleState after = LossScaleState::from_json(nlohmann::json::parse(text), "state.json");
  EXPECT_EQ(std::memcmp(&before.scale, &after.scale, sizeof(double)), 0) << text;
  EXPECT_EQ(before, after);

  // A resumed scaler continues exactly as the uninterrupted one.
  LossScaler resumed(s.settings());
  resumed.restore(after);
  const std::string rest = "o...ooo......o..";
  EXPECT_EQ(run(resumed, rest), run(s, rest));
  EXPECT_EQ(resumed.state(), s.state());
}

TEST(LossScaler, BadStateAndSettingsAreNamed) {
  using nlohmann::json;
  expect_error(
      [] {
        LossScaleState::from_json(json::parse(R"({"scale": 8, "clean_steps": 1})"),
                                  "ckpt/trainer.json");
      },
      {"ckpt/trainer.json", "hysteresis_left"});
  expect_error(
      [] {
        LossScaleState::from_json(
            json::parse(R"({"scale": -8, "clean_steps": 1, "hysteresis_left": 2})"), "t.json");
      },
      {"t.json", "\"scale\" is -8"});
  expect_error(
      [] {
        LossScaleState::from_json(
            json::parse(R"({"scale": 8, "clean_steps": 1.5, "hysteresis_left": 2})"), "t.json");
      },
      {"clean_steps", "1.5"});
  expect_error([] { LossScaleState::from_json(json::array(), "t.json"); }, {"t.json", "object"});

  LossScaler s(dynamic_settings(16, 10, 2, 1));
  expect_error([&] { s.restore({0.5, 0, 1}); }, {"scale 0.5", "fp16.min_loss_scale"});
  expect_error([&] { s.restore({16, 0, 3}); }, {"hysteresis_left 3", "fp16.hysteresis"});

  expect_error([] { LossScaler(dynamic_settings(16, 0, 2, 1)); }, {"fp16.loss_scale_window", "0"});
  expect_error([] { LossScaler(dynamic_settings(16, 10, 0, 1)); }, {"fp16.hysteresis", "0"});
  expect_error([] { LossScaler(dynamic_settings(16, 10, 2, 0)); }, {"fp16.min_loss_scale", "0"});
  expect_error([] { LossScaler(dynamic_settings(0.5, 10, 2, 1)); },
               {"initial scale 0.5", "fp16.min_loss_scale 1"});
  DsConfig::Fp16 f;
  f.initial_scale_power = 2000;  // beyond a double: infinite
  expect_error([&] { loss_scale_settings(f, true); }, {"initial scale is inf"});
}

}  // namespace
}  // namespace strata
