// test_ds_config.cpp: DeepSpeed configs as popular projects ship them for ZeRO-3 with CPU and
// NVMe offload (written out here from their published shape) are accepted and mean what they
// say; wrong types and values are errors naming their JSON path.
#include "testing.h"
#include "train/ds_config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace strata {
namespace {

using nlohmann::json;
using test::expect_error;

DsConfig parse(const std::string& text) {
  return parse_ds_config(json::parse(text), "test.json");
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// Hugging Face transformers' documentation, ds_config_zero3.json: "auto" everywhere the
// Trainer fills values in.
const char* kHfZero3 = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                           "warmup_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

// The same documentation's NVMe variant, with aio and WarmupDecayLR.
const char* kHfZero3Nvme = R"({
  "fp16": {"enabled": "auto"},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                          "buffer_count": 4, "fast_init": false},
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                      "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false,
          "overlap_events": true},
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

// DeepSpeedExamples' ZeRO-3 NVMe offload config (Megatron-style GPT training): concrete
// numbers, fp16, DeepSpeed's "Adam".
const char* kDeepSpeedExamples = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "steps_per_print": 10,
  "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95], "eps": 1e-8,
                                           "weight_decay": 1e-2}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015,
                                               "warmup_num_steps": 1000, "warmup_type": "linear"}},
  "gradient_clipping": 1.0,
  "fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
           "min_loss_scale": 1, "initial_scale_power": 12},
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                          "buffer_count": 4, "fast_init": false},
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                      "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
  },
  "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false,
          "overlap_events": true},
  "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
                               "contiguous_memory_optimization": false,
                               "number_checkpoints": null, "synchronize_checkpoint_boundary": false,
                               "profile": false},
  "wall_clock_breakdown": false
})";

// axolotl's zero3_bf16_cpuoffload_all.json: note sub_group_size and max_live_parameters 0.
const char* kAxolotl = R"({
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 0,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "bf16": {"enabled": true},
  "fp16": {"enabled": "auto", "auto_cast": false, "loss_scale": 0, "initial_scale_power": 32,
           "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

// LLaMA-Factory's ds_z3_offload_config.json.
const char* kLlamaFactory = R"({
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "zero_allow_untested_optimizer": true,
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
           "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  }
})";

TEST(DsConfig, HuggingFaceZero3CpuOffload) {
  const DsConfig c = parse(kHfZero3);
  EXPECT_FALSE(c.train_batch_size || c.train_micro_batch_size_per_gpu ||
               c.gradient_accumulation_steps || c.gradient_clipping);
  EXPECT_EQ(c.steps_per_print, 2000);
  EXPECT_FALSE(c.fp16.enabled.has_value());
  EXPECT_FALSE(c.bf16_enabled.has_value());
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_FALSE(c.optimizer.lr || c.optimizer.betas || c.optimizer.eps || c.optimizer.weight_decay);
  EXPECT_EQ(c.scheduler.type, "WarmupLR");
  EXPECT_FALSE(c.scheduler.warmup_num_steps.has_value());
  // Which values were "auto", by path, for the caller to say what it filled in.
  for (const char* p : {"optimizer.params.lr", "gradient_clipping", "bf16.enabled",
                        "scheduler.params.warmup_num_steps", "train_micro_batch_size_per_gpu"})
    EXPECT_TRUE(c.is_auto(p)) << p;
  EXPECT_FALSE(c.is_auto("steps_per_print"));
  EXPECT_TRUE(c.scheduler.warmup_num_steps_auto && c.scheduler.warmup_max_lr_auto);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, Tier::cpu);
  EXPECT_EQ(c.zero.offload_optimizer.device, Tier::cpu);
  EXPECT_EQ(c.zero.offload_param.pin_memory, true);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1'000'000'000u);
  EXPECT_FALSE(c.zero.stage3_prefetch_bucket_size || c.zero.stage3_param_persistence_threshold);
  // What strata does not act on is listed, by path, once each: read and checked, as
  // sub_group_size and overlap_comm are (a wrong type is refused below), or not.
  for (const char* p :
       {"zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "wall_clock_breakdown",
        "zero_optimization.sub_group_size", "zero_optimization.overlap_comm"})
    EXPECT_TRUE(has(c.ignored, p)) << p;
  EXPECT_FALSE(has(c.ignored, "zero_optimization.stage"));
  EXPECT_EQ(c.ignored.size(), 7u);

  const DsPlanSettings s = ds_plan_settings(c, 2, *find_preset("tiny"));
  EXPECT_FALSE(s.offload.automatic);
  EXPECT_EQ(s.offload.param, Tier::cpu);
  EXPECT_EQ(s.offload.optimizer, Tier::cpu);
  EXPECT_TRUE(s.offload.pin_memory);
  EXPECT_FALSE(s.batch.micro_batch || s.batch.grad_accum);
  EXPECT_FALSE(s.param_dtype.has_value());  // "auto": the caller decides
  EXPECT_FALSE(s.persistence_threshold || s.prefetch_depth);
}

TEST(DsConfig, HuggingFaceZero3NvmeOffload) {
  const DsConfig c = parse(kHfZero3Nvme);
  EXPECT_EQ(c.zero.offload_param.device, Tier::nvme);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100'000'000u);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 8);
  for (const char* key : {"thread_count", "single_submit", "overlap_events"})
    EXPECT_TRUE(has(c.ignored, std::string("aio.") + key)) << key;
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  EXPECT_TRUE(has(c.ignored, "zero_optimization.offload_optimizer.fast_init"));
  // Checked (1.5 is refused below) but not acted on: the pinned buffers' size follows from the
  // model, so the key is listed with the others strata ignores.
  EXPECT_TRUE(has(c.ignored, "zero_optimization.offload_param.buffer_size"));
  const DsPlanSettings s = ds_plan_settings(c, 1, *find_preset("tiny"));
  EXPECT_EQ(s.offload.nvme_paths, std::vector<std::string>{"/local_nvme"});  // once
  EXPECT_EQ(s.offload.buffer_count, 5);
  EXPECT_EQ(s.offload.max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(s.offload.nvme_stripe, 1048576u);
  EXPECT_EQ(s.offload.nvme_queue_depth, 8u);
}

// max_in_cpu as DeepSpeed reads it: for parameters on NVMe only, 1e9 elements a rank where
// the config gives none; with the parameters in host RAM (or on the GPU), and under
// offload_optimizer, which has no such key, it is listed as not acted on. strata's "auto"
// takes it as a cap, none where none is given.
TEST(DsConfig, MaxInCpuIsDeepSpeedsForParametersOnNvmeOnly) {
  const LlamaConfig tiny = *find_preset("tiny");
  auto settings = [&](const std::string& text, DsConfig* out = nullptr) {
    DsConfig c = parse(text);
    if (out != nullptr) *out = c;
    return ds_plan_settings(c, 2, tiny).offload;
  };
  DsConfig c;
  EXPECT_EQ(
      settings(R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})", &c).max_in_cpu,
      kDeepSpeedMaxInCpu);
  EXPECT_EQ(kDeepSpeedMaxInCpu, 1'000'000'000u);
  EXPECT_TRUE(c.ignored.empty());
  EXPECT_EQ(
      settings(R"({"zero_optimization": {"offload_param": {"device": "nvme", "max_in_cpu": 0}}})")
          .max_in_cpu,
      0u);
  for (const char* device : {"cpu", "none"}) {
    const std::string text = fmt::format(
        R"({{"zero_optimization": {{"offload_param": {{"device": "{}", "max_in_cpu": 1e9}}}}}})",
        device);
    EXPECT_EQ(settings(text, &c).max_in_cpu, 0u) << device;
    EXPECT_TRUE(has(c.ignored, "zero_optimization.offload_param.max_in_cpu")) << device;
  }
  EXPECT_EQ(
      settings(
          R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "max_in_cpu": 5}}})",
          &c)
          .max_in_cpu,
      0u);
  EXPECT_TRUE(has(c.ignored, "zero_optimization.offload_optimizer.max_in_cpu"));
  EXPECT_EQ(settings(R"({"zero_optimization": {"offload_param": {"device": "auto"}}})").max_in_cpu,
            0u);
  EXPECT_EQ(
      settings(R"({"zero_optimization": {"offload_param": {"device": "auto", "max_in_cpu": 7}}})",
               &c)
          .max_in_cpu,
      7u);
  EXPECT_TRUE(c.ignored.empty());
}

TEST(DsConfig, DeepSpeedExamplesZero3Nvme) {
  const DsConfig c = parse(kDeepSpeedExamples);
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.optimizer.type, "Adam");
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay());  // DeepSpeed's Adam: adam_w_mode true
  EXPECT_DOUBLE_EQ(c.optimizer.lr.value(), 0.00015);
  EXPECT_DOUBLE_EQ(c.optimizer.betas.value()[1], 0.95);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_EQ(c.fp16.enabled, true);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100000u);
  // Its activation checkpoints go to host RAM (RunShape::offload_activations); the section's
  // other keys are Megatron's model parallelism.
  EXPECT_EQ(c.cpu_checkpointing, true);
  for (const char* key : {"partition_activations", "contiguous_memory_optimization",
                          "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})
    EXPECT_TRUE(has(c.ignored, std::string("activation_checkpointing.") + key)) << key;
  EXPECT_FALSE(has(c.ignored, "activation_checkpointing.cpu_checkpointing"));

  // 64 = 4 per GPU x accumulation x GPUs.
  const LlamaConfig model = *find_preset("llama2-7b");
  DsPlanSettings s = ds_plan_settings(c, 4, model);
  EXPECT_EQ(s.batch.micro_batch, 4);
  EXPECT_EQ(s.batch.grad_accum, 4);
  EXPECT_EQ(ds_plan_settings(c, 16, model).batch.grad_accum, 1);
  expect_error([&] { ds_plan_settings(c, 3, model); },
               {"train_batch_size 64", "train_micro_batch_size_per_gpu 4", "3 GPU(s)"});
  EXPECT_EQ(s.param_dtype, DType::f16);
  EXPECT_EQ(s.persistence_threshold, 100000u);
  EXPECT_EQ(s.offload_activations, true);
  // 1e7 elements ahead against llama2-7b's largest unit (the 131M-element embedding): 1.
  EXPECT_EQ(s.prefetch_depth, 1);
  EXPECT_EQ(ds_plan_settings(c, 4, *find_preset("tiny")).prefetch_depth, 4);

  DsConfig adam = c;
  adam.optimizer.adam_w_mode = false;
  EXPECT_FALSE(adam.optimizer.decoupled_weight_decay());
  // DeepSpeed's Adam takes bias_correction (default true); amsgrad false is accepted.
  EXPECT_FALSE(c.optimizer.bias_correction.has_value());
  const DsConfig no_bc = parse(R"({"optimizer": {"type": "AdamW", "params": {
      "bias_correction": false, "amsgrad": false}}})");
  EXPECT_EQ(no_bc.optimizer.bias_correction, false);
  EXPECT_FALSE(has(no_bc.ignored, "optimizer.params.bias_correction"));
  EXPECT_FALSE(has(no_bc.ignored, "optimizer.params.amsgrad"));
  EXPECT_EQ(no_bc.optimizer.optimizer_type(), OptimizerType::adam);

  // DeepSpeed's Lion (decoupled decay) and Adagrad (L2 decay), any case, with their params; the
  // plan sizes their state.
  const DsConfig lion = parse(R"({"optimizer": {"type": "lion", "params": {"lr": 1e-4,
      "betas": [0.95, 0.98], "weight_decay": 0.1}}})");
  EXPECT_EQ(lion.optimizer.type, "Lion");
  EXPECT_EQ(lion.optimizer.optimizer_type(), OptimizerType::lion);
  EXPECT_TRUE(lion.optimizer.decoupled_weight_decay());
  EXPECT_EQ(lion.optimizer.betas, (std::array<double, 2>{0.95, 0.98}));
  EXPECT_EQ(ds_plan_settings(lion, 1, *find_preset("tiny")).optimizer, OptimizerType::lion);
  const DsConfig adagrad = parse(R"({"optimizer": {"type": "Adagrad", "params": {"lr": 1e-2,
      "eps": 1e-10, "weight_decay": 0.01, "lr_decay": 0}}})");
  EXPECT_EQ(adagrad.optimizer.optimizer_type(), OptimizerType::adagrad);
  EXPECT_FALSE(adagrad.optimizer.decoupled_weight_decay());
  EXPECT_EQ(adagrad.optimizer.eps, 1e-10);
  EXPECT_EQ(ds_plan_settings(adagrad, 1, *find_preset("tiny")).optimizer, OptimizerType::adagrad);
}

TEST(DsConfig, AxolotlAndLlamaFactoryCpuOffload) {
  const DsConfig a = parse(kAxolotl);
  EXPECT_EQ(a.bf16_enabled, true);
  EXPECT_EQ(a.fp16.initial_scale_power, 32);
  EXPECT_EQ(a.zero.stage3_max_live_parameters, 0u);
  EXPECT_TRUE(has(a.ignored, "fp16.auto_cast"));
  const DsPlanSettings s = ds_plan_settings(a, 8, *find_preset("llama3-8b"));
  EXPECT_EQ(s.param_dtype, DType::bf16);
  EXPECT_EQ(s.offload.param, Tier::cpu);

  const DsConfig f = parse(kLlamaFactory);
  EXPECT_TRUE(has(f.ignored, "zero_optimization.overlap_comm"));
  EXPECT_TRUE(has(f.ignored, "zero_allow_untested_optimizer"));
  EXPECT_EQ(ds_plan_settings(f, 1, *find_preset("tiny")).offload.optimizer, Tier::cpu);
}

TEST(DsConfig, BatchArithmetic) {
  DsConfig c;
  c.train_batch_size = 32;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = 4;
  DsBatch b = resolve_ds_batch(c, 4);
  EXPECT_EQ(b.micro_batch, 2);
  EXPECT_EQ(b.grad_accum, 4);
  expect_error([&] { resolve_ds_batch(c, 2); },
               {"train_batch_size 32", "train_micro_batch_size_per_gpu 2",
                "gradient_accumulation_steps 4", "= 16"});
  c.train_micro_batch_size_per_gpu.reset();
  EXPECT_EQ(resolve_ds_batch(c, 2).micro_batch, 4);  // 32 / (4 x 2)
  c.gradient_accumulation_steps.reset();
  b = resolve_ds_batch(c, 4);
  EXPECT_EQ(b.micro_batch, 8);
  EXPECT_EQ(b.grad_accum, 1);
  expect_error([&] { resolve_ds_batch(c, 3); }, {"train_batch_size 32", "3 GPU(s)"});
  c = DsConfig{};
  c.train_micro_batch_size_per_gpu = 3;
  b = resolve_ds_batch(c, 2);
  EXPECT_EQ(b.micro_batch, 3);
  EXPECT_FALSE(b.grad_accum.has_value());
  // Products past 2^63 are refused, not overflowed (signed overflow: UBSan in fuzz_ds_config).
  c = DsConfig{};
  c.train_batch_size = int64_t{1} << 62;
  c.train_micro_batch_size_per_gpu = int64_t{1} << 62;
  c.gradient_accumulation_steps = 4;
  expect_error([&] { resolve_ds_batch(c, 1); },
               {"4611686018427387904 x 4", "does not fit a 64-bit count"});
  c.gradient_accumulation_steps.reset();
  expect_error([&] { resolve_ds_batch(c, 8); }, {"4611686018427387904 x 8", "64-bit"});
  c.train_micro_batch_size_per_gpu.reset();
  c.gradient_accumulation_steps = int64_t{1} << 62;
  expect_error([&] { resolve_ds_batch(c, 2); }, {"gradient_accumulation_steps x GPUs", "64-bit"});
}

TEST(DsConfig, PrecisionAndAutomaticPlacement) {
  const LlamaConfig tiny = *find_preset("tiny");
  EXPECT_EQ(ds_plan_settings(parse(R"({"bf16": {"enabled": false}, "fp16": {"enabled": false}})"),
                             1, tiny)
                .param_dtype,
            DType::f32);
  // One section turned off and the other absent is DeepSpeed's fp32 too; "auto" (Hugging
  // Face's, filled from its flags) or no section at all leaves the choice to strata's flags.
  for (const char* text : {R"({"bf16": {"enabled": false}})", R"({"fp16": {"enabled": false}})",
                           R"({"fp16": {"enabled": false}, "bf16": {"enabled": "auto"}})"})
    EXPECT_EQ(ds_plan_settings(parse(text), 1, tiny).param_dtype, DType::f32) << text;
  for (const char* text : {R"({})", R"({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})",
                           R"({"fp16": {"loss_scale": 0}})"})
    EXPECT_FALSE(ds_plan_settings(parse(text), 1, tiny).param_dtype) << text;
  EXPECT_EQ(ds_plan_settings(parse(R"({"bfloat16": {"enabled": true}})"), 1, tiny).param_dtype,
            DType::bf16);
  const DsPlanSettings a =
      ds_plan_settings(parse(R"({"zero_optimization": {"offload_optimizer": {"device": "auto",
                "nvme_path": ["/a", "/b"]}}})"),
                       1, tiny);
  EXPECT_TRUE(a.offload.automatic);
  EXPECT_EQ(a.offload.nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_FALSE(a.offload.pin_memory);  // DeepSpeed's default once a section is given
  // data_types.grad_accum_dtype: the gradients' dtype; its other keys are not acted on.
  EXPECT_FALSE(ds_plan_settings(parse("{}"), 1, tiny).grad_dtype);
  for (const auto& [text, dtype] : {std::pair{"fp32", DType::f32}, std::pair{"bf16", DType::bf16},
                                    std::pair{"fp16", DType::f16}}) {
    const DsConfig c = parse(fmt::format(
        R"({{"data_types": {{"grad_accum_dtype": "{}", "params_dtype": "bf16"}}}})", text));
    EXPECT_EQ(ds_plan_settings(c, 1, tiny).grad_dtype, dtype) << text;
    EXPECT_TRUE(has(c.ignored, "data_types.params_dtype")) << text;
  }
  test::expect_error([&] { parse(R"({"data_types": {"grad_accum_dtype": "int8"}})"); },
                     {"data_types.grad_accum_dtype", "'int8'", "\"fp32\", \"bf16\" or \"fp16\""});
}

// DeepSpeed's monitor sections: TensorBoard and CSV files where output_path/job_name say, each
// off unless enabled (its defaults: output_path "", job_name "DeepSpeedJobName"); the monitors
// strata has no writer for (W&B, Comet) are listed as not acted on.
TEST(DsConfig, MonitorSections) {
  const DsConfig c = parse(R"({
    "tensorboard": {"enabled": true, "output_path": "logs/tb", "job_name": "llama-sft"},
    "csv_monitor": {"enabled": true},
    "wandb": {"enabled": true, "project": "p"},
    "comet": {"enabled": false}
  })");
  EXPECT_TRUE(c.monitor.tensorboard.enabled);
  EXPECT_EQ(c.monitor.tensorboard.dir(), std::filesystem::path("logs/tb/llama-sft"));
  EXPECT_TRUE(c.monitor.csv.enabled);
  EXPECT_EQ(c.monitor.csv.dir(), std::filesystem::path("DeepSpeedJobName"));
  EXPECT_TRUE(has(c.ignored, "wandb"));
  EXPECT_TRUE(has(c.ignored, "comet"));
  const DsConfig off = parse(R"({"tensorboard": {"output_path": "x", "flush_secs": 5}})");
  EXPECT_FALSE(off.monitor.enabled());
  EXPECT_TRUE(has(off.ignored, "tensorboard.flush_secs"));
  EXPECT_FALSE(parse(kHfZero3).monitor.enabled());
}

TEST(DsConfig, WrongTypesAndValuesNameTheirPath) {
  struct Case {
    const char* text;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
       {"zero_optimization.offload_optimizer.device", "\"disk\"", "\"none\", \"cpu\", \"nvme\""}},
      {R"({"zero_optimization": {"offload_param": {"device": 1}}})",
       {"zero_optimization.offload_param.device", "is 1"}},
      {R"({"zero_optimization": {"stage": 4}})", {"zero_optimization.stage", "0..3"}},
      {R"({"activation_checkpointing": {"cpu_checkpointing": "yes"}})",
       {"activation_checkpointing.cpu_checkpointing", "true or false"}},
      {R"({"activation_checkpointing": true})", {"activation_checkpointing", "object"}},
      {R"({"zero_optimization": {"stage": "auto"}})", {"zero_optimization.stage", "\"auto\""}},
      {R"({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}})",
       {"zero_optimization.offload_param.pin_memory", "true or false"}},
      {R"({"zero_optimization": {"offload_param": {"buffer_count": 0}}})",
       {"zero_optimization.offload_param.buffer_count", "is 0"}},
      {R"({"zero_optimization": {"offload_param": {"buffer_size": 1.5}}})",
       {"zero_optimization.offload_param.buffer_size", "whole number"}},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": 3}}})",
       {"zero_optimization.offload_optimizer.nvme_path", "directory"}},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -1}})",
       {"zero_optimization.stage3_param_persistence_threshold", "-1"}},
      {R"({"zero_optimization": {"overlap_comm": "auto"}})", {"zero_optimization.overlap_comm"}},
      {R"({"zero_optimization": []})", {"zero_optimization", "an object"}},
      {R"({"train_batch_size": 0})", {"train_batch_size", ">= 1"}},
      {R"({"train_micro_batch_size_per_gpu": "4"})", {"train_micro_batch_size_per_gpu", "\"4\""}},
      {R"({"gradient_clipping": -1.0})", {"gradient_clipping", ">= 0"}},
      {R"({"steps_per_print": "auto"})", {"steps_per_print", "\"auto\""}},
      {R"({"bf16": {"enabled": 1}})", {"bf16.enabled", "true, false or \"auto\""}},
      {R"({"fp16": {"initial_scale_power": 200}})", {"fp16.initial_scale_power", "0..127"}},
      {R"({"fp16": {"hysteresis": "auto"}})", {"fp16.hysteresis"}},
      {R"({"optimizer": {"type": "Lamb"}})", {"optimizer.type", "\"Lamb\"", "\"Lion\""}},
      {R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})",
       {"optimizer.params.eps", "1e-08", "Lion takes lr, betas and weight_decay", "remove it"}},
      {R"({"optimizer": {"params": {"adam_w_mode": false}, "type": "Lion"}})",
       {"optimizer.params.adam_w_mode", "decay always decoupled"}},
      {R"({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})",
       {"optimizer.params.betas", "Adagrad takes lr, eps and weight_decay"}},
      {R"({"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0.1}}})",
       {"optimizer.params.lr_decay", "0.1", "scheduler"}},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", {"optimizer.params.betas", "[0.9]"}},
      {R"({"optimizer": {"params": {"amsgrad": true}}})",
       {"optimizer.params.amsgrad", "does not run AMSGrad", "set it false"}},
      {R"({"optimizer": {"params": {"bias_correction": 0}}})",
       {"optimizer.params.bias_correction", "true or false"}},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.5]}}})", {"optimizer.params.betas"}},
      {R"({"optimizer": {"params": {"eps": 0}}})", {"optimizer.params.eps", "> 0"}},
      {R"({"optimizer": {"params": {"lr": "fast"}}})", {"optimizer.params.lr", "\"fast\""}},
      {R"({"scheduler": {"type": "CyclicLR"}})", {"scheduler.type", "OneCycle", "LRRangeTest"}},
      {R"({"scheduler": {"params": {"warmup_type": "cubic"}}})",
       {"scheduler.params.warmup_type", "\"log\", \"linear\""}},
      {R"({"scheduler": {"params": {"total_num_steps": 0}}})",
       {"scheduler.params.total_num_steps"}},
      {R"({"aio": {"block_size": 1000}})", {"aio.block_size", "multiple of 4096"}},
      {R"({"aio": {"block_size": 536870912}})", {"aio.block_size", "536870912", "256 MiB"}},
      {R"({"aio": {"queue_depth": true}})", {"aio.queue_depth"}},
      {R"({"tensorboard": {"enabled": "yes"}})", {"tensorboard.enabled", "true or false"}},
      {R"({"tensorboard": {"output_path": 3}})", {"tensorboard.output_path", "a directory"}},
      {R"({"csv_monitor": {"job_name": "a/b"}})", {"csv_monitor.job_name", "\"a/b\"", "no '/'"}},
      {R"({"csv_monitor": {"job_name": ""}})", {"csv_monitor.job_name", "one directory's name"}},
      {R"({"csv_monitor": true})", {"csv_monitor", "an object"}},
      {R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})",
       {"bf16.enabled", "fp16.enabled", "both true"}},
      {R"([1, 2])", {"top level", "array"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    std::vector<std::string> parts = c.parts;
    parts.push_back("test.json");
    const std::string msg = test::error_message([&] { parse(c.text); });
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing from: " << msg;
  }
}

TEST(DsConfig, LoadsFilesAndNamesBadOnes) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("strata_ds_config_" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "ok.json") << kAxolotl;
  std::ofstream(dir / "bad.json") << "{\"zero_optimization\": {";
  EXPECT_EQ(load_ds_config(dir / "ok.json").zero.stage, 3);
  expect_error([&] { load_ds_config(dir / "bad.json"); }, {"bad.json", "not valid JSON"});
  expect_error([&] { load_ds_config(dir / "missing.json"); }, {"missing.json", "--config"});
  expect_error([&] { load_ds_config(dir); }, {dir.string(), "is a directory"});
  // Strict JSON: a repeated key would silently drop one of its values; absurd nesting is damage.
  std::ofstream(dir / "twice.json") << R"({"train_batch_size": 8, "train_batch_size": 16})";
  expect_error([&] { load_ds_config(dir / "twice.json"); },
               {"twice.json", "'train_batch_size' appears twice"});
  std::ofstream(dir / "deep.json")
      << "{\"aio\": " << std::string(100, '[') << std::string(100, ']') << "}";
  expect_error([&] { load_ds_config(dir / "deep.json"); }, {"deep.json", "nested more than 64"});
  // Past a double's range: nlohmann's out_of_range used to escape (found by fuzz_ds_config).
  std::ofstream(dir / "huge.json") << R"({"optimizer": {"params": {"lr": 1e400}}})";
  expect_error([&] { load_ds_config(dir / "huge.json"); },
               {"huge.json", "not valid JSON", "number overflow"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
