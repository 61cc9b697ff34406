// commands.h: each `strata` subcommand registers itself on a CLI11 app here.
// A command's run function returns the process exit status; strata::Error escaping it is
// printed by main() as "strata: error: ..." with exit status 1.
#pragma once

#include "core/optimizer.h"

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>

namespace strata::cli {

// A registered subcommand and what to do once the arguments naming it are parsed.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

Command add_info(CLI::App& app);      // strata info
Command add_eval(CLI::App& app);      // strata eval
Command add_bench(CLI::App& app);     // strata bench <what>: the subcommands below
Command add_estimate(CLI::App& app);  // strata estimate
Command add_plan(CLI::App& app);      // strata plan
Command add_tokenize(CLI::App& app);  // strata tokenize
Command add_generate(CLI::App& app);  // strata generate
Command add_train(CLI::App& app);     // strata train
Command add_export(CLI::App& app);    // strata export
Command add_tune(CLI::App& app);      // strata tune
// `strata bench` subcommands (tools/bench_*.cpp), registered on the `bench` app.
Command add_bench_adam(CLI::App& bench);       // strata bench adam
Command add_bench_attention(CLI::App& bench);  // strata bench attention
Command add_bench_io(CLI::App& bench);         // strata bench io
Command add_bench_model(CLI::App& bench);      // strata bench model
Command add_bench_ops(CLI::App& bench);        // strata bench ops
Command add_bench_step(CLI::App& bench);       // strata bench step

// A flag taking on|off (or true|false) into `on`; anything else is refused naming the flag,
// the value and the choices.
inline CLI::Option* add_switch_option(CLI::App* cmd, const char* name, bool& on, const char* help) {
  return cmd->add_option(name, on, help)->check(CLI::IsMember({"on", "off", "true", "false"}));
}

// --activation-checkpointing on|off into `recompute` (RunShape::recompute), the same words and
// help in every command.
inline CLI::Option* add_checkpointing_option(CLI::App* cmd, bool& recompute) {
  return add_switch_option(
      cmd, "--activation-checkpointing", recompute,
      "on (default): backward recomputes each block from its input, the least GPU memory; off: "
      "blocks keep their activations on the GPU, a third fewer FLOPs");
}

// --offload-activations none|cpu into `value` (offload_activations_flag reads it).
inline CLI::Option* add_offload_activations_option(CLI::App* cmd, std::string& value) {
  return cmd->add_option(
      "--offload-activations", value,
      "none (default, or the DeepSpeed config's activation_checkpointing.cpu_checkpointing): the "
      "activation checkpoints stay on the GPU; cpu: each block's input goes to host RAM after "
      "its forward and comes back before its backward, the GPU keeping prefetch depth + 1 of "
      "them (needs --activation-checkpointing on)");
}

// --micro-batch-group G into `group` (micro_batch_group_flag checks it against the step).
inline CLI::Option* add_micro_batch_group_option(CLI::App* cmd, int64_t& group) {
  return cmd->add_option(
      "--micro-batch-group", group,
      "run G of the step's micro-batches unit by unit (default 1): each unit is fetched and "
      "gathered once for the G forwards and once for the G backwards, for G micro-batches' "
      "activations on the GPU");
}

// --vocab-pieces N into `pieces` (apply_vocab_pieces sets it on the model).
inline CLI::Option* add_vocab_pieces_option(CLI::App* cmd, int64_t& pieces) {
  return cmd->add_option(
      "--vocab-pieces", pieces,
      "units the embedding's and the head's tables are each cut into, by vocabulary rows (a tied "
      "table once, the head's pieces reading its pieces), so no working or pinned buffer need "
      "hold a whole table (0, the default: strata chooses; 1: whole)");
}

// --update-during-backward on|off into `on` (ScheduleOptions::update_during_backward).
inline CLI::Option* add_update_during_backward_option(CLI::App* cmd, bool& on) {
  return add_switch_option(
      cmd, "--update-during-backward", on,
      "on: CPU Adam updates each unit as soon as its gradients are final, under the rest of the "
      "backward (needs gradient clipping off and no fp16; a NaN or Inf gradient then stops the "
      "run instead of skipping the step); off (default): after the whole backward");
}

// --reduce-per-group on|off into `on` (ScheduleOptions::reduce_per_group).
inline CLI::Option* add_reduce_per_group_option(CLI::App* cmd, bool& on) {
  return add_switch_option(
      cmd, "--reduce-per-group", on,
      "with --micro-batch-group G > 1, on: each GPU sums the group's gradients and each unit is "
      "reduce-scattered once per group, 1/G of the gradient traffic between the GPUs and to host "
      "RAM (the same sums in another order: rounding differs from G = 1); off (default): once "
      "per micro-batch, the bits of G = 1");
}

// --offload-gradients into `value` (apply_offload_flags reads it): where the gradients of an
// offloaded optimizer accumulate.
inline CLI::Option* add_gradients_option(CLI::App* cmd, std::string& value) {
  return cmd->add_option(
      "--offload-gradients", value,
      "with the optimizer offloaded: auto (default; summed on the GPU where it has room, brought "
      "to the host once a step; where host RAM is then short, the last units' on NVMe), none "
      "(on the GPU), cpu (every micro-batch's to host RAM, as DeepSpeed does) or nvme (every "
      "micro-batch's summed in the swap store, as ZeRO-Infinity swaps them)");
}

}  // namespace strata::cli

namespace strata {
struct RunShape;  // tier/placement.h
namespace cli {
// The shape of a run from --model, --gpus, --micro-batch, --seq-len (0: the model's context,
// at most 4096) and --dtype, shared by `strata estimate` and `strata plan` (estimate.cpp).
RunShape run_shape_for(const std::string& model, int gpus, int64_t micro_batch, int64_t seq_len,
                       const std::string& dtype);
// --optimizer of `strata plan` and `strata estimate`: adam or adamw (Adam's state), lion or
// adagrad; empty: `config`'s (a DeepSpeed config's optimizer.type), else adam.
OptimizerType optimizer_flag(const std::string& flag, OptimizerType config = OptimizerType::adam);
}  // namespace cli
}  // namespace strata
