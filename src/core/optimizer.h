// optimizer.h: which optimizer updates the fp32 master weights, and the state it keeps for each
// element beside the master.
//
//   adam     m and v (exp_avg, exp_avg_sq): 12 bytes an element with the master
//   lion     m alone (exp_avg): 8 bytes
//   adagrad  the sum of squared gradients alone (kept where Adam keeps v, DeepSpeed's exp_avg_sq):
//            8 bytes
//
// A shard's state is one block of f32 arrays in this order: master, then m if kept, then v if
// kept. Placement, the schedule and the executor size every home of the optimizer state with
// optimizer_state_bytes; the update kernels (cpu_adam/formula.h, gpu/optimizer.cu) read and
// write only the arrays the type keeps.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata {

enum class OptimizerType : uint8_t { adam, lion, adagrad };

constexpr std::string_view optimizer_type_name(OptimizerType t) {
  return t == OptimizerType::adam ? "adam" : t == OptimizerType::lion ? "lion" : "adagrad";
}
constexpr bool optimizer_keeps_m(OptimizerType t) {
  return t != OptimizerType::adagrad;
}
constexpr bool optimizer_keeps_v(OptimizerType t) {
  return t != OptimizerType::lion;
}
// f32 arrays a shard's state holds: the master and the moments the type keeps.
constexpr int optimizer_state_arrays(OptimizerType t) {
  return 1 + (optimizer_keeps_m(t) ? 1 : 0) + (optimizer_keeps_v(t) ? 1 : 0);
}
constexpr uint64_t optimizer_state_bytes(OptimizerType t) {
  return 4 * static_cast<uint64_t>(optimizer_state_arrays(t));
}

}  // namespace strata
