// test_lr_schedule.cpp: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR at steps computed
// by hand, Python's exact bits where DeepSpeed's formulas take a log or a cosine (the literals
// below are DeepSpeed's expressions evaluated by CPython 3.11 and printed with repr), which
// update uses which scheduler index, defaults from a DeepSpeed config, and bad settings named.
#include "testing.h"
#include "train/lr_schedule.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <numbers>
#include <utility>

namespace strata {
namespace {

using test::expect_error;

LrSchedule warmup(double min_lr, double max_lr, int64_t steps, WarmupShape shape) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup;
  s.warmup_min_lr = min_lr;
  s.warmup_max_lr = max_lr;
  s.warmup_num_steps = steps;
  s.warmup_type = shape;
  s.validate();
  return s;
}

DsConfig::Scheduler scheduler_section(const std::string& json_text) {
  return parse_ds_config(nlohmann::json::parse(json_text), "test.json").scheduler;
}

TEST(LrSchedule, ConstantIsTheOptimizersRateAtEveryStep) {
  LrSchedule s;
  s.lr = 2.5e-4;
  for (int64_t i : {-1, 0, 1, 999, 1'000'000}) EXPECT_EQ(s.at(i), 2.5e-4);
  const LrSchedule c = lr_schedule_from_config({}, 7e-5, std::nullopt);
  EXPECT_EQ(c.kind, LrScheduleKind::constant);
  EXPECT_EQ(c.for_update(0), 7e-5);
  EXPECT_EQ(c.for_update(12345), 7e-5);
}

TEST(LrSchedule, WarmupLinearByHand) {
  // min 0.001, max 0.011, 5 steps: gamma = i / 5.
  const LrSchedule s = warmup(0.001, 0.011, 5, WarmupShape::linear);
  EXPECT_EQ(s.at(-1), 0.001);  // before the first scheduler step: min
  EXPECT_EQ(s.at(0), 0.001);
  EXPECT_DOUBLE_EQ(s.at(1), 0.003);
  EXPECT_DOUBLE_EQ(s.at(2), 0.005);
  EXPECT_DOUBLE_EQ(s.at(4), 0.009);
  EXPECT_DOUBLE_EQ(s.at(5), 0.011);
  EXPECT_DOUBLE_EQ(s.at(100000), 0.011);  // stays at max
}

TEST(LrSchedule, WarmupLogByHandAndWithPythonsBits) {
  // gamma = log(i + 1) / log(10).
  const LrSchedule s = warmup(0.0003, 0.003, 10, WarmupShape::log);
  EXPECT_EQ(s.at(0), 0.0003);  // log(1) = 0
  EXPECT_NEAR(s.at(1), 0.0003 + 0.0027 * std::log10(2.0), 1e-15);
  EXPECT_NEAR(s.at(4), 0.0003 + 0.0027 * std::log10(5.0), 1e-15);
  // DeepSpeed's own rounding: (1 / log(10)) * log(i + 1), then min + delta * gamma.
  EXPECT_EQ(s.at(1), 0.0011127809882927491);
  EXPECT_EQ(s.at(3), 0.0019255619765854981);
  EXPECT_EQ(s.at(7), 0.002738342964878247);
  EXPECT_EQ(s.at(9), 0.0029999999999999996);  // the last warmup step, just under max
  EXPECT_EQ(s.at(10), 0.003);                 // then exactly max
  EXPECT_EQ(s.at(5000), 0.003);
}

TEST(LrSchedule, WarmupOfOneStepIsTreatedAsTwo) {
  // DeepSpeed: warmup_num_steps = max(2, warmup_num_steps).
  const LrSchedule s = warmup(0.0, 1.0, 1, WarmupShape::linear);
  EXPECT_EQ(s.at(0), 0.0);
  EXPECT_EQ(s.at(1), 0.5);
  EXPECT_EQ(s.at(2), 1.0);
  const LrSchedule l = warmup(0.0, 1.0, 1, WarmupShape::log);
  EXPECT_EQ(l.at(1), 1.0);  // log(2) / log(2)
}

TEST(LrSchedule, TheFirstUpdateRunsAtIndexMinusOne) {
  const LrSchedule s = warmup(0.001, 0.011, 5, WarmupShape::linear);
  EXPECT_EQ(s.for_update(0), 0.001);  // scheduler not stepped yet
  EXPECT_EQ(s.for_update(1), 0.001);  // stepped once: last_batch_iteration 0
  EXPECT_DOUBLE_EQ(s.for_update(2), 0.003);
  for (int64_t k = 0; k < 20; ++k) EXPECT_EQ(s.for_update(k), s.at(k - 1));
}

TEST(LrSchedule, WarmupDecayLinearByHand) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup_decay;
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  s.warmup_num_steps = 4;
  s.warmup_type = WarmupShape::linear;
  s.total_num_steps = 12;
  s.validate();
  EXPECT_EQ(s.at(-1), 0.0);
  EXPECT_EQ(s.at(2), 0.5);
  EXPECT_EQ(s.at(3), 0.75);
  // From the end of warmup: (total - i) / (total - warmup).
  EXPECT_EQ(s.at(4), 1.0);
  EXPECT_EQ(s.at(6), 0.75);
  EXPECT_EQ(s.at(8), 0.5);
  EXPECT_EQ(s.at(11), 0.125);
  EXPECT_EQ(s.at(12), 0.0);
  EXPECT_EQ(s.at(13), 0.0);  // never below warmup_min_lr
  EXPECT_EQ(s.at(1000), 0.0);
}

TEST(LrSchedule, WarmupDecayDecaysToTheMinimumWithPythonsBits) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup_decay;
  s.warmup_min_lr = 1e-5;
  s.warmup_max_lr = 3e-4;
  s.warmup_num_steps = 3;
  s.total_num_steps = 20;
  s.validate();
  EXPECT_EQ(s.warmup_type, WarmupShape::log);  // the default
  EXPECT_EQ(s.at(1), 0.00019296962853572258);
  EXPECT_EQ(s.at(2), 0.0003);
  EXPECT_EQ(s.at(5), 0.00026588235294117645);
  EXPECT_EQ(s.at(13), 0.00012941176470588234);
  EXPECT_EQ(s.at(20), 1e-5);
  EXPECT_EQ(s.at(40), 1e-5);
}

TEST(LrSchedule, WarmupCosineByHand) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup_cosine;
  s.lr = 0.2;
  s.warmup_num_steps = 4;
  s.warmup_type = WarmupShape::linear;
  s.warmup_min_ratio = 0.1;
  s.cos_min_ratio = 0.05;
  s.total_num_steps = 12;
  s.validate();
  EXPECT_EQ(s.at(-1), 0.0);  // DeepSpeed's first update runs at rate 0
  EXPECT_DOUBLE_EQ(s.at(0), 0.02);
  EXPECT_DOUBLE_EQ(s.at(2), 0.2 * (0.1 + 0.5 * 0.9));
  EXPECT_DOUBLE_EQ(s.at(3), 0.2 * (0.1 + 0.75 * 0.9));
  // progress = (i - 4 + 1) / (12 - 4).
  EXPECT_DOUBLE_EQ(s.at(4), 0.2 * (0.05 + 0.95 * (1 + std::cos(std::numbers::pi / 8)) / 2));
  EXPECT_DOUBLE_EQ(s.at(7), 0.2 * (0.05 + 0.95 * 0.5));
  EXPECT_DOUBLE_EQ(s.at(11), 0.2 * 0.05);
  // Past the end the rate stays at the floor (the cosine does not rise again).
  for (int64_t i : {12, 13, 19, 20, 27, 1000}) EXPECT_DOUBLE_EQ(s.at(i), 0.2 * 0.05) << i;
}

TEST(LrSchedule, WarmupCosineWithPythonsBits) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup_cosine;
  s.lr = 6e-4;
  s.warmup_num_steps = 5;
  s.warmup_min_ratio = 0.01;
  s.cos_min_ratio = 0.1;
  s.total_num_steps = 25;
  s.validate();
  EXPECT_EQ(s.at(1), 0.0002618218754955954);
  EXPECT_EQ(s.at(5), 0.0005966758519606872);
  EXPECT_EQ(s.at(6), 0.0005867852593996914);
  EXPECT_EQ(s.at(9), 0.0005209188309203678);
  EXPECT_EQ(s.at(17), 0.00020742256507032237);
  EXPECT_EQ(s.at(40), 5.9999999999999995e-05);
}

TEST(LrSchedule, TotalEqualToWarmupHoldsTheFloorAfterWarmup) {
  LrSchedule s;
  s.kind = LrScheduleKind::warmup_cosine;
  s.lr = 1.0;
  s.warmup_num_steps = 10;
  s.total_num_steps = 10;
  s.cos_min_ratio = 0.25;
  s.validate();  // accepted with a warning, as DeepSpeed
  EXPECT_EQ(s.at(10), 0.25);
  EXPECT_EQ(s.at(11), 0.25);
  LrSchedule d = s;
  d.kind = LrScheduleKind::warmup_decay;
  d.warmup_min_lr = 0.0;
  d.warmup_max_lr = 1.0;
  d.total_num_steps = 5;  // below warmup: decays from the first step past warmup
  d.validate();
  EXPECT_EQ(d.at(10), 0.0);
}

TEST(LrSchedule, FromAConfigWithDeepSpeedsDefaults) {
  // Hugging Face's "auto": warmup_max_lr is the optimizer's lr; warmup_num_steps is the
  // caller's flag, set here as tools/train.cpp sets it.
  DsConfig::Scheduler auto_section = scheduler_section(R"({"scheduler": {"type": "WarmupLR",
      "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}})");
  EXPECT_TRUE(auto_section.warmup_max_lr_auto && auto_section.warmup_num_steps_auto);
  auto_section.warmup_num_steps = 40;
  const LrSchedule w = lr_schedule_from_config(auto_section, 3e-4, 100);
  EXPECT_EQ(w.kind, LrScheduleKind::warmup);
  EXPECT_EQ(w.warmup_min_lr, 0.0);
  EXPECT_EQ(w.warmup_max_lr, 3e-4);  // the optimizer's lr
  EXPECT_EQ(w.warmup_num_steps, 40);
  EXPECT_EQ(w.warmup_type, WarmupShape::log);
  // Left "auto" with no flag: Hugging Face would fill 0, which DeepSpeed refuses.
  for (const char* type : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"})
    expect_error(
        [&] {
          lr_schedule_from_config(
              scheduler_section(fmt::format(R"({{"scheduler": {{"type": "{}", "params": {{
                  "warmup_num_steps": "auto"}}}}}})",
                                            type)),
              3e-4, 100);
        },
        {type, "warmup_num_steps is \"auto\"", "--warmup-steps", "--warmup-ratio"});
  // Absent: DeepSpeed's defaults, 1000 steps, and a warmup_max_lr that WarmupLR takes from
  // the optimizer but WarmupDecayLR sets at 0.001 (its constructor's default).
  const LrSchedule absent = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "WarmupLR"}})"), 3e-4, 100);
  EXPECT_EQ(absent.warmup_max_lr, 3e-4);
  EXPECT_EQ(absent.warmup_num_steps, 1000);
  const LrSchedule decay_absent = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "WarmupDecayLR"}})"), 3e-4, 100);
  EXPECT_EQ(decay_absent.warmup_max_lr, 1e-3);
  const LrSchedule decay_auto = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "WarmupDecayLR", "params": {
          "warmup_max_lr": "auto"}}})"),
      3e-4, 100);
  EXPECT_EQ(decay_auto.warmup_max_lr, 3e-4);

  const LrSchedule d = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "WarmupDecayLR", "params": {
          "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear",
          "total_num_steps": "auto"}}})"),
      3e-4, 500);
  EXPECT_EQ(d.kind, LrScheduleKind::warmup_decay);
  EXPECT_EQ(d.warmup_max_lr, 0.01);
  EXPECT_EQ(d.total_num_steps, 500);  // the run's --steps
  EXPECT_EQ(d.warmup_type, WarmupShape::linear);
  EXPECT_EQ(d.at(5), 0.005);

  const LrSchedule c =
      lr_schedule_from_config(scheduler_section(R"({"scheduler": {"type": "WarmupCosineLR",
                                          "params": {"total_num_steps": 2000}}})"),
                              1e-3, 10);
  EXPECT_EQ(c.kind, LrScheduleKind::warmup_cosine);
  EXPECT_EQ(c.total_num_steps, 2000);  // the config wins over --steps
  EXPECT_EQ(c.warmup_min_ratio, 0.0);
  EXPECT_EQ(c.cos_min_ratio, 1e-4);
  EXPECT_EQ(c.warmup_num_steps, 1000);
  EXPECT_EQ(lr_schedule_name(c.kind), "WarmupCosineLR");
}

// Hugging Face's schedules (lr_scheduler_type), what its Trainer runs beside a DeepSpeed config
// without a scheduler: LambdaLR's step k is update k, so the first update of a warmup runs at 0.
// The literals are transformers' lr_lambda expressions (get_linear_schedule_with_warmup,
// get_cosine_schedule_with_warmup with half a cycle) times the rate, evaluated by CPython 3.11
// and printed with repr: the same bits. The cosine is not clamped past the last step, as in
// transformers, so it rises again there.
TEST(LrSchedule, HuggingFacesSchedulesWithPythonsBits) {
  const LrSchedule lin = hugging_face_lr_schedule("linear", 3e-4, 3, 10);
  EXPECT_EQ(lin.kind, LrScheduleKind::hf_linear);
  EXPECT_TRUE(is_hugging_face_schedule(lin.kind));
  EXPECT_EQ(lr_schedule_name(lin.kind), "linear");
  const std::pair<int64_t, double> linear_bits[] = {{0, 0.0},
                                                    {1, 9.999999999999999e-05},
                                                    {3, 0.0003},
                                                    {4, 0.0002571428571428571},
                                                    {9, 4.285714285714285e-05},
                                                    {10, 0.0},
                                                    {11, 0.0}};
  for (const auto& [update, want] : linear_bits)
    EXPECT_EQ(lin.for_update(update), want) << "linear, update " << update;
  const LrSchedule cos = hugging_face_lr_schedule("cosine", 3e-4, 3, 12);
  const std::pair<int64_t, double> cosine_bits[] = {{0, 0.0},
                                                    {1, 9.999999999999999e-05},
                                                    {2, 0.00019999999999999998},
                                                    {3, 0.0003},
                                                    {5, 0.00026490666646784665},
                                                    {7, 0.00017604722665003956},
                                                    {11, 9.046106882113751e-06},
                                                    {12, 0.0},
                                                    {13, 9.046106882113734e-06}};
  for (const auto& [update, want] : cosine_bits)
    EXPECT_EQ(cos.for_update(update), want) << "cosine, update " << update;
  const LrSchedule held = hugging_face_lr_schedule("constant_with_warmup", 2e-4, 4, 0);
  EXPECT_EQ(held.for_update(0), 0.0);
  EXPECT_EQ(held.for_update(2), 2e-4 * 0.5);
  for (int64_t k : {4, 5, 1000}) EXPECT_EQ(held.for_update(k), 2e-4);
  // Without a warmup (Hugging Face's default) the first update runs at the full rate.
  EXPECT_EQ(hugging_face_lr_schedule("linear", 1e-3, 0, 4).for_update(0), 1e-3);
  EXPECT_EQ(hugging_face_lr_schedule("constant", 1e-3, 0, 4).kind, LrScheduleKind::constant);
  expect_error([] { hugging_face_lr_schedule("exponential", 1e-3, 0, 4); },
               {"exponential", "linear, cosine, constant_with_warmup, cosine_with_restarts"});
  expect_error([] { hugging_face_lr_schedule("cosine", 1e-3, 0, 0); },
               {"cosine", "steps are 0", "--steps"});
  expect_error([] { hugging_face_lr_schedule("linear", 1e-3, -1, 10); },
               {"linear", "warmup is -1"});
}

// DeepSpeed's OneCycle: the rate from cycle_min_lr up to cycle_max_lr and back, Adam's beta1 the
// other way, then a decay. The literals are DeepSpeed's OneCycle expressions (its
// _get_scale_factor at last_batch_iteration + 1, _get_cycle_lr, _get_cycle_mom, _get_decay_lr,
// _get_decay_mom) written out in Python, evaluated by CPython 3.11 and printed with repr. Index -1
// is what the scheduler sets when it is made: cycle_min_lr, and beta1 cycle_min_mom.
TEST(LrSchedule, OneCycleWithPythonsBits) {
  const DsConfig::Scheduler section = scheduler_section(R"({"scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 7,
      "cycle_second_step_size": 5, "decay_step_size": 3, "decay_lr_rate": 0.1,
      "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01,
      "cycle_first_stair_count": 2}}})");
  const LrSchedule s = lr_schedule_from_config(section, 5e-4, 20);
  EXPECT_EQ(s.kind, LrScheduleKind::one_cycle);
  EXPECT_EQ(lr_schedule_name(s.kind), "OneCycle");
  struct Bits {
    int64_t i;
    double lr, beta1;
  };
  const Bits bits[] = {{-1, 0.0001, 0.85},
                       {0, 0.00022857142857142846, 0.9357142857142857},
                       {1, 0.0003571428571428572, 0.9214285714285714},
                       {4, 0.000742857142857143, 0.8785714285714286},
                       {5, 0.0008714285714285714, 0.8642857142857143},
                       {6, 0.0009999999999999998, 0.85},  // the top: 7 updates after -1
                       {7, 0.0008200000000000004, 0.8699999999999999},
                       {10, 0.00028000000000000035, 0.9299999999999999},
                       {11, 0.0001, 0.95},  // the cycle's 12 updates are over
                       {12, 9.67741935483871e-05, 0.9531666666666667},
                       {13, 9.375e-05, 0.9563333333333333},
                       {17, 8.333333333333334e-05, 0.969},
                       {20, 7.692307692307693e-05, 0.9784999999999999}};
  for (const Bits& b : bits) {
    EXPECT_EQ(s.at(b.i), b.lr) << "index " << b.i;
    const auto betas = s.betas_at(b.i);
    ASSERT_TRUE(betas.has_value()) << "index " << b.i;
    EXPECT_EQ(betas->first, b.beta1) << "index " << b.i;
    EXPECT_EQ(betas->second, 0.99) << "index " << b.i;  // DeepSpeed's, whatever the optimizer's
  }
  // Update k runs at index k - 1.
  EXPECT_EQ(s.for_update(0), 0.0001);
  EXPECT_EQ(s.betas_for_update(7)->first, 0.85);
  EXPECT_EQ(s.for_update(7), 0.0009999999999999998);

  // DeepSpeed's defaults: the second half as long as the first, and no decay without a
  // decay_step_size, so cycle_min_lr and cycle_max_mom hold after the cycle. A maximum below
  // the minimum is allowed (the rate dips, then comes back).
  const LrSchedule d = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 3e-4,
          "cycle_max_lr": 2e-5, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
          "decay_mom_rate": 0.5}}})"),
      1e-3, 100);
  EXPECT_EQ(d.cycle_second_step_size, 4);
  const Bits defaults[] = {{-1, 0.0003, 0.8},
                           {0, 0.00022999999999999998, 0.875},
                           {2, 8.999999999999999e-05, 0.8250000000000001},
                           {3, 1.9999999999999998e-05, 0.8},
                           {6, 0.00022999999999999998, 0.875},
                           {7, 0.0003, 0.9},
                           {8, 0.0003, 0.9},
                           {500, 0.0003, 0.9}};
  for (const Bits& b : defaults) {
    EXPECT_EQ(d.at(b.i), b.lr) << "defaults, index " << b.i;
    EXPECT_EQ(d.betas_at(b.i)->first, b.beta1) << "defaults, index " << b.i;
  }
  // cycle_momentum false: the optimizer's betas stand.
  const LrSchedule no_mom = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0,
          "cycle_max_lr": 1e-3, "cycle_momentum": false}}})"),
      1e-3, 100);
  EXPECT_FALSE(no_mom.betas_at(-1).has_value());
  EXPECT_FALSE(no_mom.betas_at(10).has_value());
  // No other schedule sets betas.
  EXPECT_FALSE(warmup(0.0, 1e-3, 10, WarmupShape::log).betas_at(3).has_value());
}

// DeepSpeed's LRRangeTest: lr_range_test_min_lr x (1 + step_rate x interval), the interval
// continuous or, with the staircase, whole steps; literals as above.
TEST(LrSchedule, LrRangeTestWithPythonsBits) {
  const LrSchedule s =
      lr_schedule_from_config(scheduler_section(R"({"scheduler": {"type": "LRRangeTest", "params": {
          "lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3,
          "lr_range_test_step_rate": 0.5}}})"),
                              1e-3, 10);
  EXPECT_EQ(s.kind, LrScheduleKind::lr_range_test);
  EXPECT_EQ(lr_schedule_name(s.kind), "LRRangeTest");
  const std::pair<int64_t, double> continuous[] = {{-1, 0.0001},
                                                   {0, 0.0001},
                                                   {1, 0.00011666666666666668},
                                                   {2, 0.00013333333333333334},
                                                   {3, 0.00015000000000000001},
                                                   {5, 0.00018333333333333336},
                                                   {7, 0.0002166666666666667}};
  for (const auto& [i, want] : continuous) EXPECT_EQ(s.at(i), want) << "index " << i;
  EXPECT_FALSE(s.betas_at(3).has_value());
  LrSchedule stairs = s;
  stairs.range_test_staircase = true;
  const std::pair<int64_t, double> staircase[] = {
      {1, 0.0001}, {2, 0.0001}, {3, 0.00015000000000000001}, {5, 0.00015000000000000001},
      {6, 0.0002}, {7, 0.0002}};
  for (const auto& [i, want] : staircase) EXPECT_EQ(stairs.at(i), want) << "staircase " << i;
  // DeepSpeed's defaults.
  const LrSchedule d = lr_schedule_from_config(
      scheduler_section(R"({"scheduler": {"type": "LRRangeTest"}})"), 1e-3, 10);
  EXPECT_EQ(d.range_test_min_lr, 1e-3);
  EXPECT_EQ(d.range_test_step_size, 2000);
  EXPECT_EQ(d.range_test_step_rate, 1.0);
  EXPECT_FALSE(d.range_test_staircase);
  EXPECT_EQ(d.at(2000), 2e-3);
}

TEST(LrSchedule, BadOneCycleAndRangeTestSettingsAreNamed) {
  const auto from = [](const std::string& params, std::optional<int64_t> steps = 100) {
    return lr_schedule_from_config(
        scheduler_section(R"({"scheduler": {"type": "OneCycle", "params": )" + params + "}}"), 1e-3,
        steps);
  };
  expect_error([&] { from(R"({"cycle_max_lr": 1e-3})"); },
               {"OneCycle", "scheduler.params.cycle_min_lr is not set", "give both"});
  expect_error([&] { from(R"({"cycle_min_lr": 1e-4})"); },
               {"scheduler.params.cycle_max_lr is not set"});
  expect_error([&] { from(R"({"cycle_min_lr": 0, "cycle_max_lr": 1e-3, "cycle_max_mom": 1.0})"); },
               {"scheduler.params.cycle_max_mom is 1", "[0, 1)", "cycle_momentum false"});
  // Without the momentum cycling the momenta are not Adam's: not checked.
  from(R"({"cycle_min_lr": 0, "cycle_max_lr": 1e-3, "cycle_max_mom": 1.0,
           "cycle_momentum": false})");
  // 0.95 x (1 + 0.01 x n / 3) reaches 1 at n = 16 (index 27 = 12 + 16 - 1): the 29th update,
  // which runs at index 27. A run of 28 updates stops short of it.
  const std::string decaying = R"({"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
      "cycle_first_step_size": 7, "cycle_second_step_size": 5, "decay_step_size": 3,
      "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01})";
  EXPECT_LT(from(decaying, 28).betas_for_update(27)->first, 1.0);
  expect_error([&] { from(decaying, 29); }, {"at update 29 of this run's 29"});
  expect_error([&] { from(decaying, 40); },
               {"OneCycle", "beta1", "reaches 1.00", "at update 29 of this run's 40",
                "lower decay_mom_rate"});
  // The parser's bounds, and "auto", which Hugging Face does not fill here.
  const auto parse = [](const std::string& params) {
    return [params] { scheduler_section(R"({"scheduler": {"params": )" + params + "}}"); };
  };
  expect_error(parse(R"({"cycle_min_lr": -1e-4})"), {"scheduler.params.cycle_min_lr", "-0.0001"});
  expect_error(parse(R"({"cycle_max_lr": "auto"})"), {"scheduler.params.cycle_max_lr", "\"auto\""});
  expect_error(parse(R"({"cycle_first_step_size": 0})"),
               {"scheduler.params.cycle_first_step_size", ">= 1"});
  expect_error(parse(R"({"cycle_second_step_size": -2})"),
               {"scheduler.params.cycle_second_step_size", "-2"});
  expect_error(parse(R"({"cycle_momentum": "yes"})"),
               {"scheduler.params.cycle_momentum", "true or false"});
  expect_error(parse(R"({"cycle_second_stair_count": 1.5})"),
               {"scheduler.params.cycle_second_stair_count", "1.5"});
  expect_error(parse(R"({"lr_range_test_step_size": 0})"),
               {"scheduler.params.lr_range_test_step_size", ">= 1"});
  expect_error(parse(R"({"lr_range_test_staircase": 1})"),
               {"scheduler.params.lr_range_test_staircase"});
  // The stair counts are kept by DeepSpeed's OneCycle and used nowhere: read, listed as not
  // acted on.
  const DsConfig c = parse_ds_config(nlohmann::json::parse(R"({"scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3, "cycle_first_stair_count": 3}}})"),
                                     "test.json");
  EXPECT_NE(
      std::find(c.ignored.begin(), c.ignored.end(), "scheduler.params.cycle_first_stair_count"),
      c.ignored.end());
  expect_error(
      [] {
        lr_schedule_from_config(scheduler_section(R"({"scheduler": {"type": "Cyclic"}})"), 1e-3,
                                10);
      },
      {"scheduler.type", "Cyclic", "OneCycle", "LRRangeTest"});
}

// The rest of Hugging Face's lr_scheduler_types, with their lr_scheduler_kwargs: transformers'
// lr_lambda expressions (optimization.py) transcribed to Python, evaluated by CPython 3.11 and
// printed with repr, times the rate, at update k (LambdaLR's step k).
TEST(LrSchedule, MoreHuggingFaceSchedulesWithPythonsBits) {
  using Bits = std::vector<std::pair<int64_t, double>>;
  const auto check = [](const LrSchedule& s, const Bits& bits) {
    for (const auto& [update, want] : bits)
      EXPECT_EQ(s.for_update(update), want) << lr_schedule_name(s.kind) << ", update " << update;
  };
  const auto kw = [](const char* text) { return nlohmann::json::parse(text); };
  // cosine_with_min_lr: the cosine down to min_lr_rate x lr at the last step, rising again past
  // it, as transformers' does.
  const LrSchedule min_rate =
      hugging_face_lr_schedule("cosine_with_min_lr", 3e-4, 3, 12, kw(R"({"min_lr_rate": 0.1})"));
  EXPECT_EQ(lr_schedule_name(min_rate.kind), "cosine_with_min_lr");
  check(min_rate, {{0, 0.0},
                   {2, 0.00019999999999999998},
                   {3, 0.0003},
                   {5, 0.000268415999821062},
                   {7, 0.0001884425039850356},
                   {11, 3.814149619390237e-05},
                   {12, 2.9999999999999997e-05},
                   {13, 3.814149619390236e-05}});
  // min_lr instead: the ratio min_lr / lr.
  EXPECT_EQ(hugging_face_lr_schedule("cosine_with_min_lr", 3e-4, 3, 12, kw(R"({"min_lr": 3e-5})"))
                .for_update(7),
            0.0001884425039850356);
  // cosine with num_cycles 1.5: down, up and down again.
  check(hugging_face_lr_schedule("cosine", 3e-4, 2, 10, kw(R"({"num_cycles": 1.5})")),
        {{2, 0.0003},
         {4, 4.3933982822017876e-05},
         {6, 0.00014999999999999996},
         {9, 9.259748514523652e-05},
         {10, 0.0}});
  // cosine_with_restarts, 3 restarts, then 0 from the last step on.
  check(hugging_face_lr_schedule("cosine_with_restarts", 3e-4, 2, 12, kw(R"({"num_cycles": 3})")),
        {{1, 0.00015},
         {2, 0.0003},
         {4, 0.00010364745084375785},
         {5, 7.341522555726986e-06},
         {6, 0.000271352549156242},
         {8, 2.864745084375793e-05},
         {11, 6.183221215612897e-05},
         {12, 0.0},
         {13, 0.0}});
  EXPECT_EQ(hugging_face_lr_schedule("cosine_with_restarts", 3e-4, 0, 10).num_cycles, 1.0);
  // polynomial: power 2 down to lr_end, then held; and its defaults (1e-7, power 1).
  check(
      hugging_face_lr_schedule("polynomial", 3e-4, 2, 10, kw(R"({"lr_end": 1e-5, "power": 2.0})")),
      {{1, 0.00015},
       {2, 0.0003},
       {3, 0.00023203124999999995},
       {6, 8.249999999999999e-05},
       {10, 1e-05},
       {11, 1e-05}});
  check(hugging_face_lr_schedule("polynomial", 3e-4, 0, 10), {{0, 0.0003},
                                                              {4, 0.00018004000000000002},
                                                              {10, 9.999999999999998e-08},
                                                              {11, 9.999999999999998e-08}});
  // inverse_sqrt: timescale = the warmup, or 10000 without one.
  check(hugging_face_lr_schedule("inverse_sqrt", 3e-4, 4, 0), {{1, 7.5e-05},
                                                               {4, 0.0003},
                                                               {5, 0.0002683281572999747},
                                                               {9, 0.00019999999999999998},
                                                               {100, 5.9999999999999995e-05}});
  check(
      hugging_face_lr_schedule("inverse_sqrt", 3e-4, 0, 0),
      {{0, 0.0003}, {1, 0.0002999850011249063}, {10000, 0.00021213203435596422}, {30000, 0.00015}});
  // warmup_stable_decay: stable = the run's steps less the warmup and the decay, a floor of
  // min_lr_ratio that the warmup starts from; and each ramp shape.
  const LrSchedule wsd = hugging_face_lr_schedule(
      "warmup_stable_decay", 3e-4, 2, 12, kw(R"({"num_decay_steps": 4, "min_lr_ratio": 0.1})"));
  EXPECT_EQ(wsd.num_stable_steps, 6);
  check(wsd, {{0, 2.9999999999999997e-05},
              {1, 0.000165},
              {2, 0.0003},
              {7, 0.0003},
              {8, 0.0003},
              {9, 0.0002604594154601839},
              {10, 0.000165},
              {11, 6.954058453981609e-05},
              {12, 2.9999999999999997e-05},
              {13, 2.9999999999999997e-05}});
  check(hugging_face_lr_schedule("warmup_stable_decay", 3e-4, 4, 100,
                                 kw(R"({"num_decay_steps": 4, "num_stable_steps": 3,
                                        "warmup_type": "cosine", "decay_type": "1-sqrt"})")),
        {{1, 4.393398282201786e-05},
         {3, 0.00025606601717798207},
         {4, 0.0003},
         {7, 0.0003},
         {8, 0.00015},
         {9, 8.786796564403573e-05},
         {11, 0.0},
         {12, 0.0}});
  check(hugging_face_lr_schedule("warmup_stable_decay", 3e-4, 4, 11,
                                 kw(R"({"num_decay_steps": 4, "warmup_type": "1-sqrt",
                                        "decay_type": "linear", "min_lr_ratio": 0.2})")),
        {{1, 9.215390309173473e-05},
         {3, 0.00018},
         {8, 0.00023999999999999998},
         {10, 0.00011999999999999999}});
  // The types get_scheduler passes no kwargs to ignore them (with a warning), as it does.
  EXPECT_EQ(
      hugging_face_lr_schedule("constant_with_warmup", 2e-4, 4, 0, kw(R"({"x": 1})")).for_update(2),
      1e-4);
}

TEST(LrSchedule, BadHuggingFaceKwargsAreNamed) {
  const auto kw = [](const char* text) { return nlohmann::json::parse(text); };
  expect_error([&] { hugging_face_lr_schedule("linear", 1e-3, 0, 10, kw(R"({"num_cycles": 2})")); },
               {"linear", "\"num_cycles\"", "does not take", "takes none"});
  expect_error(
      [&] { hugging_face_lr_schedule("cosine", 1e-3, 0, 10, kw(R"({"min_lr_rate": 0.1})")); },
      {"cosine", "\"min_lr_rate\"", "takes num_cycles"});
  expect_error([&] { hugging_face_lr_schedule("cosine_with_min_lr", 1e-3, 0, 10); },
               {"cosine_with_min_lr", "neither min_lr nor min_lr_rate", "min_lr_rate\": 0.1"});
  expect_error(
      [&] {
        hugging_face_lr_schedule("cosine_with_min_lr", 1e-3, 0, 10,
                                 kw(R"({"min_lr": 1e-4, "min_lr_rate": 0.1})"));
      },
      {"both min_lr and min_lr_rate"});
  expect_error(
      [&] { hugging_face_lr_schedule("polynomial", 1e-3, 0, 10, kw(R"({"lr_end": 1e-3})")); },
      {"polynomial", "lr_end (0.001) must be smaller than the learning rate (0.001)"});
  expect_error([&] { hugging_face_lr_schedule("polynomial", 1e-3, 10, 10); },
               {"polynomial", "takes the whole run", "shorten the warmup"});
  expect_error(
      [&] { hugging_face_lr_schedule("polynomial", 1e-3, 0, 10, kw(R"({"power": "two"})")); },
      {"power is \"two\"", "a number"});
  expect_error([&] { hugging_face_lr_schedule("warmup_stable_decay", 1e-3, 2, 10); },
               {"warmup_stable_decay", "no num_decay_steps", "num_decay_steps\": 100"});
  expect_error(
      [&] {
        hugging_face_lr_schedule("warmup_stable_decay", 1e-3, 4, 10,
                                 kw(R"({"num_decay_steps": 8})"));
      },
      {"4 warmup, -2 stable and 8 decay steps", "negative"});
  expect_error(
      [&] {
        hugging_face_lr_schedule("warmup_stable_decay", 1e-3, 0, 10,
                                 kw(R"({"num_decay_steps": 2, "decay_type": "exp"})"));
      },
      {"decay_type is \"exp\"", "\"1-sqrt\""});
  expect_error(
      [&] { hugging_face_lr_schedule("cosine", 1e-3, 0, 10, kw(R"({"num_cycles": -1})")); },
      {"num_cycles is -1", ">= 0"});
  expect_error([&] { hugging_face_lr_schedule("reduce_lr_on_plateau", 1e-3, 0, 10); },
               {"reduce_lr_on_plateau", "evaluation loss", "cosine_with_min_lr"});
  expect_error([&] { hugging_face_lr_schedule("cosine", 1e-3, 0, 10, kw("[1]")); },
               {"cosine", "lr_scheduler_kwargs is [1]", "JSON object"});
  EXPECT_TRUE(is_hugging_face_schedule_type("warmup_stable_decay"));
  EXPECT_FALSE(is_hugging_face_schedule_type("OneCycle"));
}

TEST(LrSchedule, BadSettingsAreNamed) {
  expect_error(
      [] {
        lr_schedule_from_config(
            scheduler_section(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})"), 1e-3,
            std::nullopt);
      },
      {"WarmupDecayLR", "scheduler.params.total_num_steps", "--steps"});
  expect_error(
      [] {
        lr_schedule_from_config(
            scheduler_section(
                R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})"),
            1e-3, std::nullopt);
      },
      {"scheduler.params.warmup_num_steps", "is 0", "positive"});
  expect_error([] { lr_schedule_from_config({}, -1e-3, std::nullopt); },
               {"optimizer.params.lr", "-0.001", ">= 0"});
  expect_error([] { lr_schedule_from_config({}, std::nan(""), std::nullopt); },
               {"optimizer.params.lr", "nan"});
  LrSchedule s = warmup(0.0, 1e-3, 10, WarmupShape::log);
  s.warmup_min_lr = -0.5;
  expect_error([&] { s.validate(); }, {"scheduler.params.warmup_min_lr", "-0.5"});
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = INFINITY;
  expect_error([&] { s.validate(); }, {"scheduler.params.warmup_max_lr", "inf"});
  LrSchedule c;
  c.kind = LrScheduleKind::warmup_cosine;
  c.total_num_steps = 10;
  c.cos_min_ratio = -0.1;
  expect_error([&] { c.validate(); }, {"scheduler.params.cos_min_ratio", "-0.1"});
  c.cos_min_ratio = 0.0;
  c.warmup_min_ratio = -2;
  expect_error([&] { c.validate(); }, {"scheduler.params.warmup_min_ratio", "-2"});
  c.warmup_min_ratio = 0.0;
  c.total_num_steps = 0;
  expect_error([&] { c.validate(); }, {"WarmupCosineLR", "scheduler.params.total_num_steps"});
  c.total_num_steps = 10;
  c.warmup_num_steps = -3;
  expect_error([&] { c.validate(); }, {"scheduler.params.warmup_num_steps", "-3"});
}

}  // namespace
}  // namespace strata
