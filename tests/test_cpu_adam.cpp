// Tests of the CPU Adam (src/cpu_adam): the fused update against a scalar double-precision
// reference written here, the SIMD conversions against core/dtype.h bit for bit, determinism
// across thread counts and SIMD paths, the statistics pass and its non-finite detection, and the
// guard that keeps an overflowed step from being applied.
//
// What is guaranteed, and tested: every path this CPU can run (avx512f, avx2, sse4.2, scalar)
// gives the same output bits as the scalar path, for any thread count. Buffers are deliberately
// misaligned (one element past an aligned start) and sizes are odd (0, 1, 7, 15, 17, 1023,
// primes, across chunk boundaries).
//
// NUMA: the thread split is tested on made-up 2- and 4-node machines; the arenas, the pinning and
// the node lookup on this machine (whatever its nodes: CI has one). 64-bit indexing: the chunk
// and span arithmetic at 2^31 + 17 and 2^32 + 5 elements without memory behind it, and a real
// statistics pass over 2^31 + 1000 gradients in a sparse mapping whose untouched pages read as
// zero (no update: it writes every page, 24 GiB of master, m and v at that size).
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "core/dtype.h"
#include "core/topology.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

const std::vector<size_t> kOddSizes = {0, 1, 7, 15, 17, 31, 1023, 4099, 16387, 40009};
constexpr DType kGradTypes[] = {DType::f32, DType::bf16, DType::f16};

// A buffer whose data starts one element past a 64-byte boundary: nothing is aligned.
template <class T>
struct Misaligned {
  std::vector<T> storage;
  T* data;
  explicit Misaligned(size_t n) : storage(n + 64 / sizeof(T) + 1) {
    auto addr = reinterpret_cast<uintptr_t>(storage.data());
    const size_t skip = ((64 - addr % 64) % 64) / sizeof(T) + 1;
    data = storage.data() + skip;
  }
};

// Gradients as the raw bytes of their dtype, plus their exact float values.
struct Grad {
  Misaligned<uint16_t> bits16;
  Misaligned<float> bits32;
  std::vector<float> values;
  DType dtype;
  Grad(size_t n, DType t) : bits16(n), bits32(n), values(n), dtype(t) {}
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(bits32.data) : bits16.data;
  }
  void set(size_t i, float x) {
    if (dtype == DType::f32) bits32.data[i] = x;
    if (dtype == DType::bf16) x = bf16_to_f32(bits16.data[i] = f32_to_bf16(x));
    if (dtype == DType::f16) x = f16_to_f32(bits16.data[i] = f32_to_f16(x));
    values[i] = x;
  }
  GradShard shard() const { return {data(), dtype, values.size()}; }
};

struct State {
  Misaligned<float> master, m, v;
  size_t n;
  explicit State(size_t count) : master(count), m(count), v(count), n(count) {}
  // A fresh optimizer state: normal(0, 1) master weights, zero moments.
  State(size_t count, std::mt19937& rng) : State(count) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) master.data[i] = normal(rng);
    std::fill(m.data, m.data + n, 0.0f);
    std::fill(v.data, v.data + n, 0.0f);
  }
  AdamShard shard() { return {master.data, m.data, v.data, n}; }
};

// The reference: one Adam step in double from the float state, as written in the papers
// (Kingma & Ba; Loshchilov & Hutter for the decoupled decay).
struct Reference {
  double p, m, v;
  // Magnitudes of the terms each result is formed from: the tolerance is 1e-6 relative to them,
  // so that a cancellation (Adam's g + wd * p, or m's decay against a new gradient) is judged by
  // the size of what cancelled, as float arithmetic can only be.
  double p_scale, m_scale, v_scale;
};
Reference reference_step(double p, double g, double m, double v, int64_t step, const AdamParams& a,
                         double scale) {
  const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, wd = a.weight_decay, eps = a.eps;
  g *= scale;
  double g_scale = std::abs(g);
  if (!a.adamw) {
    g += wd * p;
    g_scale += std::abs(wd * p);
  }
  if (a.adamw) p *= 1.0 - lr * wd;
  Reference r;
  r.m_scale = std::abs(b1 * m) + std::abs((1 - b1) * g_scale);
  r.m = b1 * m + (1 - b1) * g;
  r.v = b2 * v + (1 - b2) * g * g;
  r.v_scale = b2 * v + (1 - b2) * std::abs(g) * g_scale;
  const double bc1 = a.bias_correction ? 1 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = a.bias_correction ? 1 - std::pow(b2, static_cast<double>(step)) : 1.0;
  const double update = lr / bc1 * r.m / (std::sqrt(r.v) / std::sqrt(bc2) + eps);
  const double update_scale = lr / bc1 * r.m_scale / (std::sqrt(r.v) / std::sqrt(bc2) + eps);
  r.p = p - update;
  r.p_scale = std::abs(p) + update_scale;
  return r;
}

bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// One shard, its gradient and the ways of updating it, checked against the reference.
void run_against_reference(const std::string& simd, size_t n, DType gt, const AdamParams& a,
                           int steps, uint32_t seed) {
  CpuAdam adam({.threads = 2, .simd = simd});
  std::mt19937 rng(seed);
  State s(n, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grad g(n, gt);
  std::vector<float> p0(n), m0(n), v0(n);
  int reported = 0;
  for (int step = 1; step <= steps; ++step) {
    const float magnitude = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    for (size_t i = 0; i < n; ++i) g.set(i, normal(rng) * magnitude);
    const float scale = (step % 3 == 0) ? 0.25f : 1.0f;
    std::copy(s.master.data, s.master.data + n, p0.begin());
    std::copy(s.m.data, s.m.data + n, m0.begin());
    std::copy(s.v.data, s.v.data + n, v0.begin());
    ASSERT_TRUE(adam.update(s.shard(), g.shard(), step, a, scale, GradStats{}));
    for (size_t i = 0; i < n; ++i) {
      const Reference r = reference_step(p0[i], g.values[i], m0[i], v0[i], step, a, scale);
      const bool ok = std::abs(s.master.data[i] - r.p) <= 1e-6 * r.p_scale + 1e-30 &&
                      std::abs(s.m.data[i] - r.m) <= 1e-6 * r.m_scale + 1e-30 &&
                      std::abs(s.v.data[i] - r.v) <= 1e-6 * r.v_scale + 1e-30;
      if (!ok && reported++ < 5)
        ADD_FAILURE() << simd << " n=" << n << " grad " << dtype_name(gt) << " step " << step
                      << " i=" << i << ": got p=" << s.master.data[i] << " m=" << s.m.data[i]
                      << " v=" << s.v.data[i] << ", reference p=" << r.p << " m=" << r.m
                      << " v=" << r.v;
    }
    if (reported > 0) return;
  }
}

TEST(CpuAdam, PathsListedBestFirstWithScalarLast) {
  const auto paths = CpuAdam::available_paths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.back(), "scalar");
  CpuAdam best;
  EXPECT_EQ(best.simd_path(), paths.front());
  EXPECT_GE(best.threads(), 1);
  CpuAdam three({.threads = 3});
  EXPECT_EQ(three.threads(), 3);
}

TEST(CpuAdam, MatchesDoubleReferenceOverThousandsOfSteps) {
  for (const std::string& simd : CpuAdam::available_paths()) {
    for (bool adamw : {true, false}) {
      for (bool bias : {true, false}) {
        AdamParams a{.lr = 1e-3f, .weight_decay = 0.01f, .adamw = adamw, .bias_correction = bias};
        run_against_reference(simd, 37, DType::f32, a, 2000, 1);
      }
    }
  }
}

TEST(CpuAdam, MatchesDoubleReferenceOnOddSizesAndEveryGradType) {
  for (const std::string& simd : CpuAdam::available_paths()) {
    for (size_t n : kOddSizes) {
      for (DType gt : kGradTypes) {
        AdamParams a{.lr = 3e-4f, .beta2 = 0.95f, .weight_decay = 0.1f};
        run_against_reference(simd, n, gt, a, 6, static_cast<uint32_t>(n));
        a.adamw = false;
        run_against_reference(simd, n, gt, a, 3, static_cast<uint32_t>(n) + 7);
      }
    }
  }
}

// Lion and Adagrad against double references written here from their papers (Chen et al. 2023;
// Duchi et al. 2011, as torch.optim.Adagrad runs it), every path, odd sizes, every gradient type,
// the moment the optimizer does not keep passed as null (so a read of it would fault).
void run_one_moment_against_reference(const std::string& simd, size_t n, DType gt,
                                      const AdamParams& a, int steps, uint32_t seed) {
  CpuAdam adam({.threads = 2, .simd = simd});
  std::mt19937 rng(seed);
  State s(n, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grad g(n, gt);
  const bool lion = a.type == OptimizerType::lion;
  float* moment = lion ? s.m.data : s.v.data;
  const AdamShard shard{s.master.data, lion ? s.m.data : nullptr, lion ? nullptr : s.v.data, n};
  std::vector<float> p0(n), k0(n);
  int reported = 0;
  for (int step = 1; step <= steps; ++step) {
    const float magnitude = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    for (size_t i = 0; i < n; ++i) g.set(i, i % 11 == 3 ? 0.0f : normal(rng) * magnitude);
    const float scale = (step % 3 == 0) ? 0.25f : 1.0f;
    std::copy(s.master.data, s.master.data + n, p0.begin());
    std::copy(moment, moment + n, k0.begin());
    ASSERT_TRUE(adam.update(shard, g.shard(), step, a, scale, GradStats{}));
    for (size_t i = 0; i < n; ++i) {
      const double lr = a.lr, wd = a.weight_decay, p = p0[i], k = k0[i];
      double gi = static_cast<double>(g.values[i]) * scale;
      double want_p, want_k, p_tol, k_tol;
      if (lion) {
        const double b1 = a.beta1, b2 = a.beta2;
        const double c = b1 * k + (1 - b1) * gi,
                     c_scale = std::abs(b1 * k) + std::abs((1 - b1) * gi);
        const double decayed = p * (1 - lr * wd);
        // A c within rounding of zero may take either sign in float: a step either way.
        const bool either = std::abs(c) <= 1e-6 * c_scale && c_scale > 0;
        want_p = decayed - lr * (c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0);
        p_tol = 1e-6 * (std::abs(p) + lr) + (either ? 2 * lr : 0.0);
        want_k = b2 * k + (1 - b2) * gi;
        k_tol = 1e-6 * (std::abs(b2 * k) + std::abs((1 - b2) * gi));
      } else {
        const double g_scale = std::abs(gi) + std::abs(wd * p);
        gi += wd * p;
        want_k = k + gi * gi;
        k_tol = 1e-6 * (k + std::abs(gi) * g_scale);
        const double step_size = lr * gi / (std::sqrt(want_k) + a.eps);
        want_p = p - step_size;
        p_tol = 1e-6 * (std::abs(p) + lr * g_scale / (std::sqrt(want_k) + a.eps));
      }
      const bool ok = std::abs(s.master.data[i] - want_p) <= p_tol + 1e-30 &&
                      std::abs(moment[i] - want_k) <= k_tol + 1e-30;
      if (!ok && reported++ < 5)
        ADD_FAILURE() << simd << " " << optimizer_type_name(a.type) << " n=" << n << " grad "
                      << dtype_name(gt) << " step " << step << " i=" << i
                      << ": got p=" << s.master.data[i] << " moment=" << moment[i]
                      << ", reference p=" << want_p << " moment=" << want_k;
    }
    if (reported > 0) return;
  }
}

TEST(CpuLionAndAdagrad, MatchDoubleReferencesOnOddSizesAndEveryGradType) {
  for (const std::string& simd : CpuAdam::available_paths())
    for (size_t n : kOddSizes)
      for (DType gt : kGradTypes) {
        const AdamParams lion{.type = OptimizerType::lion,
                              .lr = 1e-4f,
                              .beta1 = 0.9f,
                              .beta2 = 0.99f,
                              .weight_decay = 0.1f};
        run_one_moment_against_reference(simd, n, gt, lion, 6, static_cast<uint32_t>(n) + 1);
        const AdamParams adagrad{.type = OptimizerType::adagrad,
                                 .lr = 1e-2f,
                                 .eps = 1e-10f,
                                 .weight_decay = 0.01f,
                                 .adamw = false};
        run_one_moment_against_reference(simd, n, gt, adagrad, 6, static_cast<uint32_t>(n) + 2);
      }
}

TEST(CpuLionAndAdagrad, MatchDoubleReferencesOverThousandsOfSteps) {
  for (const std::string& simd : CpuAdam::available_paths()) {
    run_one_moment_against_reference(
        simd, 37, DType::f32,
        {.type = OptimizerType::lion, .lr = 3e-4f, .beta1 = 0.95f, .beta2 = 0.98f}, 2000, 3);
    run_one_moment_against_reference(
        simd, 37, DType::f32,
        {.type = OptimizerType::adagrad, .lr = 1e-2f, .eps = 1e-10f, .adamw = false}, 2000, 4);
  }
}

// Lion steps by the sign of its momentum: where the momentum and the gradient are both zero (a
// token's embedding row no batch has used), the weight does not move, unless decayed. DeepSpeed's
// CPU Lion (copysign(lr, 0) = lr) moves it a full step down every update.
TEST(CpuLionAndAdagrad, LionLeavesAWeightWithoutMomentumOrGradientInPlace) {
  for (const std::string& simd : CpuAdam::available_paths()) {
    CpuAdam adam({.threads = 1, .simd = simd});
    const size_t n = 19;
    std::vector<float> master(n, 0.5f), m(n, 0.0f), grad(n, 0.0f);
    grad[4] = -2.0f;  // one element does move: up, by lr
    for (int64_t step = 1; step <= 3; ++step)
      ASSERT_TRUE(adam.update({master.data(), m.data(), nullptr, n}, {grad.data(), DType::f32, n},
                              step, {.type = OptimizerType::lion, .lr = 0.01f}, 1.0f, GradStats{}));
    for (size_t i = 0; i < n; ++i)
      EXPECT_EQ(master[i], i == 4 ? 0.5f + 3 * 0.01f : 0.5f) << simd << " element " << i;
  }
}

// Runs `steps` updates with a fixed seed and returns master, m, v and the copy as bits.
struct Outcome {
  std::vector<float> master, m, v;
  std::vector<uint16_t> copy;
  bool operator==(const Outcome& o) const {
    const auto bits = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    return bits(master, o.master) && bits(m, o.m) && bits(v, o.v) && copy == o.copy;
  }
};
Outcome run_steps(const CpuAdamOptions& options, size_t n, DType gt, DType out, int steps,
                  OptimizerType type = OptimizerType::adam) {
  CpuAdam adam(options);
  std::mt19937 rng(42);
  State s(n, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grad g(n, gt);
  Misaligned<uint16_t> copy(n);
  AdamParams a{.type = type, .lr = 1e-2f, .weight_decay = 0.05f};
  for (int step = 1; step <= steps; ++step) {
    for (size_t i = 0; i < n; ++i) g.set(i, normal(rng) * 0.01f);
    adam.update(s.shard(), g.shard(), step, a, 0.5f, GradStats{}, ParamCopy{copy.data, out});
  }
  return {{s.master.data, s.master.data + n},
          {s.m.data, s.m.data + n},
          {s.v.data, s.v.data + n},
          {copy.data, copy.data + n}};
}

TEST(CpuAdam, SameBitsForAnyThreadCountAndEveryPath) {
  const size_t n = 3 * CpuAdam::kUpdateChunk + 1237;
  for (DType gt : kGradTypes) {
    for (DType out : {DType::bf16, DType::f16}) {
      const Outcome want = run_steps({.threads = 1, .simd = "scalar"}, n, gt, out, 4);
      for (const std::string& simd : CpuAdam::available_paths()) {
        for (int threads : {1, 2, 3, 7}) {
          EXPECT_TRUE(run_steps({.threads = threads, .simd = simd}, n, gt, out, 4) == want)
              << simd << " with " << threads << " threads, grad " << dtype_name(gt) << ", copy "
              << dtype_name(out) << " differs from the scalar path";
        }
        EXPECT_TRUE(run_steps({.threads = 2, .simd = simd, .numa = false}, n, gt, out, 4) == want)
            << simd << " with one unpinned arena, grad " << dtype_name(gt) << ", copy "
            << dtype_name(out) << " differs from the scalar path";
      }
    }
  }
}

TEST(CpuLionAndAdagrad, SameBitsForAnyThreadCountAndEveryPath) {
  const size_t n = 2 * CpuAdam::kUpdateChunk + 1237;
  for (const OptimizerType type : {OptimizerType::lion, OptimizerType::adagrad})
    for (DType gt : kGradTypes) {
      const Outcome want = run_steps({.threads = 1, .simd = "scalar"}, n, gt, DType::bf16, 4, type);
      for (const std::string& simd : CpuAdam::available_paths())
        for (int threads : {1, 3})
          EXPECT_TRUE(run_steps({.threads = threads, .simd = simd}, n, gt, DType::bf16, 4, type) ==
                      want)
              << optimizer_type_name(type) << " " << simd << " with " << threads
              << " threads, grad " << dtype_name(gt) << " differs from the scalar path";
    }
}

TEST(CpuAdam, ParamCopyIsTheRoundedMasterBitForBit) {
  for (const std::string& simd : CpuAdam::available_paths()) {
    for (size_t n : kOddSizes) {
      for (DType out : {DType::bf16, DType::f16}) {
        const Outcome o = run_steps({.threads = 2, .simd = simd}, n, DType::bf16, out, 2);
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) {
          const uint16_t want =
              out == DType::bf16 ? f32_to_bf16(o.master[i]) : f32_to_f16(o.master[i]);
          if (o.copy[i] != want && bad++ < 5)
            ADD_FAILURE() << simd << " n=" << n << " " << dtype_name(out) << " copy[" << i
                          << "] = " << o.copy[i] << ", want " << want;
        }
      }
    }
  }
}

// The floats whose rounding to `bits` (16) leaves `low` below it: every high pattern with the
// low bits at and around the rounding boundaries, and a few random ones.
std::vector<float> rounding_cases(int low_bits) {
  const uint32_t half = 1u << (low_bits - 1), mask = (1u << low_bits) - 1;
  const uint32_t lows[] = {0, 1, half - 1, half, half + 1, mask, 0x5a5a5a5au & mask};
  std::vector<float> out;
  for (uint64_t high = 0; high < (uint64_t{1} << (32 - low_bits)); ++high)
    for (uint32_t low : lows)
      out.push_back(std::bit_cast<float>(static_cast<uint32_t>(high << low_bits) | low));
  return out;
}

TEST(CpuAdamConversions, StoresMatchCoreDtypeBitForBit) {
  for (const cpu_adam::SimdKernels* k : cpu_adam::available_kernels()) {
    for (DType t : {DType::bf16, DType::f16}) {
      // bf16 rounds away 16 bits; f16 13 of a normal's mantissa (more for its subnormals, whose
      // exponents are all in the list anyway).
      const std::vector<float> in = rounding_cases(t == DType::bf16 ? 16 : 13);
      std::vector<uint16_t> got(in.size());
      k->store(in.data(), in.size(), got.data(), t);
      size_t bad = 0;
      for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t want = t == DType::bf16 ? f32_to_bf16(in[i]) : f32_to_f16(in[i]);
        if (got[i] != want && bad++ < 5)
          ADD_FAILURE() << k->name << " " << dtype_name(t) << " of bits 0x" << std::hex
                        << std::bit_cast<uint32_t>(in[i]) << ": 0x" << got[i] << ", want 0x"
                        << want;
      }
    }
  }
}

TEST(CpuAdamConversions, LoadsMatchCoreDtypeOnAll65536Patterns) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (const cpu_adam::SimdKernels* k : cpu_adam::available_kernels()) {
    for (DType t : {DType::bf16, DType::f16}) {
      std::vector<float> got(all.size());
      k->load(all.data(), t, all.size(), got.data());
      size_t bad = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        const float want = t == DType::bf16 ? bf16_to_f32(all[i]) : f16_to_f32(all[i]);
        if (!same_bits(got[i], want) && bad++ < 5)
          ADD_FAILURE() << k->name << " " << dtype_name(t) << " load of 0x" << std::hex << i
                        << ": 0x" << std::bit_cast<uint32_t>(got[i]) << ", want 0x"
                        << std::bit_cast<uint32_t>(want);
      }
    }
  }
}

TEST(CpuAdamStats, SumOfSquaresMatchesReferenceAndIsDeterministic) {
  const size_t n = 5 * CpuAdam::kStatsChunk + 12345;
  for (DType gt : kGradTypes) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    Grad g(n, gt);
    for (size_t i = 0; i < n; ++i) g.set(i, normal(rng));
    long double want = 0;
    for (float x : g.values) want += static_cast<long double>(x) * x;
    CpuAdam scalar({.threads = 1, .simd = "scalar"});
    const GradStats ref = scalar.grad_stats(g.shard());
    EXPECT_FALSE(ref.non_finite);
    EXPECT_NEAR(ref.sum_squares, static_cast<double>(want), 1e-12 * static_cast<double>(want));
    for (const std::string& simd : CpuAdam::available_paths()) {
      for (int threads : {1, 2, 3, 7}) {
        CpuAdam adam({.threads = threads, .simd = simd});
        const GradStats s = adam.grad_stats(g.shard());
        EXPECT_EQ(std::bit_cast<uint64_t>(s.sum_squares), std::bit_cast<uint64_t>(ref.sum_squares))
            << simd << " with " << threads << " threads, grad " << dtype_name(gt);
      }
    }
    for (size_t small : kOddSizes) {  // odd sizes: every path against the exact sum
      double exact = 0;
      for (size_t i = 0; i < small; ++i) exact += static_cast<double>(g.values[i]) * g.values[i];
      for (const std::string& simd : CpuAdam::available_paths()) {
        CpuAdam adam({.threads = 2, .simd = simd});
        EXPECT_NEAR(adam.grad_stats({g.data(), gt, small}).sum_squares, exact, 1e-12 * exact)
            << simd << " n=" << small;
      }
    }
  }
}

TEST(CpuAdamStats, FlagsNanAndInfAtStartMiddleAndTail) {
  const size_t n = 2 * CpuAdam::kStatsChunk + 17;
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (const std::string& simd : CpuAdam::available_paths()) {
    CpuAdam adam({.threads = 3, .simd = simd});
    for (DType gt : kGradTypes) {
      Grad g(n, gt);
      for (size_t i = 0; i < n; ++i) g.set(i, 1.0f);
      EXPECT_FALSE(adam.grad_stats(g.shard()).non_finite);
      for (float bad : bad_values) {
        for (size_t at : {size_t{0}, n / 2, n - 1}) {
          g.set(at, bad);
          EXPECT_TRUE(adam.grad_stats(g.shard()).non_finite)
              << simd << " " << dtype_name(gt) << " value " << bad << " at " << at;
          g.set(at, 1.0f);
        }
      }
      // Finite but large: f16's max squared, f32's max squared, do not count as overflow.
      g.set(n / 3, gt == DType::f32 ? std::numeric_limits<float>::max() : 65504.0f);
      EXPECT_FALSE(adam.grad_stats(g.shard()).non_finite) << simd << " " << dtype_name(gt);
    }
  }
}

TEST(CpuAdamGuard, NonFiniteGradientsAreNeverApplied) {
  const size_t n = 1000;
  CpuAdam adam({.threads = 2});
  State s(n);
  for (size_t i = 0; i < n; ++i) s.master.data[i] = s.m.data[i] = s.v.data[i] = 0.5f;
  Grad g(n, DType::f16);
  for (size_t i = 0; i < n; ++i) g.set(i, 0.1f);
  g.set(500, 1e6f);  // overflows f16 to +Inf, as an overflowed fp16 backward would
  Misaligned<uint16_t> copy(n);
  std::fill(copy.data, copy.data + n, uint16_t{0xabcd});
  const GradStats stats = adam.grad_stats(g.shard());
  ASSERT_TRUE(stats.non_finite);
  EXPECT_FALSE(adam.update(s.shard(), g.shard(), 1, AdamParams{}, 1.0f, stats,
                           ParamCopy{copy.data, DType::bf16}));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(s.master.data[i], 0.5f);
    ASSERT_EQ(s.m.data[i], 0.5f);
    ASSERT_EQ(s.v.data[i], 0.5f);
    ASSERT_EQ(copy.data[i], 0xabcd);
  }
  test::expect_error([&] { combined_grad_scale(stats, 1024.0f, 1.0f); }, {"NaN or Inf", "skip"});
}

TEST(CpuAdamGuard, CombinedScaleUnscalesAndClips) {
  GradStats s{.sum_squares = 4.0 * 1024.0 * 1024.0};  // norm 2 after unscaling by 1024
  EXPECT_FLOAT_EQ(combined_grad_scale(s, 1024.0f, 0.0f), 1.0f / 1024.0f);
  EXPECT_FLOAT_EQ(combined_grad_scale(s, 1024.0f, 4.0f), 1.0f / 1024.0f);
  // torch's coefficient max_norm / (norm + 1e-6)
  EXPECT_FLOAT_EQ(combined_grad_scale(s, 1024.0f, 1.0f),
                  static_cast<float>(1.0 / (2.0 + 1e-6) / 1024.0));
}

TEST(CpuAdamErrors, SayWhatWhichValueAndWhatToDo) {
  test::expect_error([] { CpuAdam({.simd = "avx9000"}); }, {"avx9000", "scalar", "best"});
  test::expect_error([] { CpuAdam({.threads = -2}); }, {"-2", "positive"});
  CpuAdam adam({.threads = 1});
  State s(4);
  Grad g(5, DType::f32);
  test::expect_error([&] { adam.update(s.shard(), g.shard(), 1, {}, 1.0f, {}); },
                     {"5 elements", "4"});
  Grad g4(4, DType::f32);
  test::expect_error([&] { adam.update(s.shard(), g4.shard(), 0, {}, 1.0f, {}); },
                     {"step 0", "from 1"});
  test::expect_error([&] { adam.update(s.shard(), g4.shard(), 1, {.beta1 = 1.0f}, 1.0f, {}); },
                     {"betas (1", "[0, 1)"});
  test::expect_error([&] { adam.update(s.shard(), g4.shard(), 1, {}, 0.0f, {}); },
                     {"gradient scale 0", "combined_grad_scale"});
  Misaligned<float> out(4);
  test::expect_error(
      [&] {
        adam.update(s.shard(), g4.shard(), 1, {}, 1.0f, {}, ParamCopy{out.data, DType::f32});
      },
      {"f32", "bf16 or f16"});
  // A moment the optimizer keeps must be there; Lion's betas are checked, Adagrad's are not.
  const AdamShard no_m{s.master.data, nullptr, s.v.data, 4},
      no_v{s.master.data, s.m.data, nullptr, 4};
  test::expect_error(
      [&] { adam.update(no_m, g4.shard(), 1, {.type = OptimizerType::lion}, 1.0f, {}); },
      {"4 elements", "the m that lion keeps"});
  test::expect_error(
      [&] { adam.update(no_v, g4.shard(), 1, {.type = OptimizerType::adagrad}, 1.0f, {}); },
      {"the v that adagrad keeps"});
  test::expect_error(
      [&] {
        adam.update(no_v, g4.shard(), 1, {.type = OptimizerType::lion, .beta2 = 1.5f}, 1.0f, {});
      },
      {"lion's betas (0.9, 1.5)", "[0, 1)"});
  EXPECT_TRUE(adam.update(no_m, g4.shard(), 1,
                          {.type = OptimizerType::adagrad, .beta1 = 7.0f, .adamw = false}, 1.0f,
                          {}));
  test::expect_error(
      [&] {
        adam.update(no_m, g4.shard(), 1, {.type = OptimizerType::adagrad, .eps = 0.0f}, 1.0f, {});
      },
      {"adagrad's eps 0", "> 0"});
}

// --- Threads and NUMA -------------------------------------------------------------------------

TEST(CpuAdamThreads, SplitFollowsCpusOnTwoAndFourNodeMachines) {
  using cpu_adam::split_threads;
  using V = std::vector<int>;
  // Two nodes.
  EXPECT_EQ(split_threads(8, {4, 4}), (V{4, 4}));
  EXPECT_EQ(split_threads(3, {4, 4}), (V{2, 1}));  // the remainder to the lower index
  EXPECT_EQ(split_threads(4, {2, 6}), (V{1, 3}));
  EXPECT_EQ(split_threads(4, {1, 15}), (V{1, 3}));  // 0.25 rounds up to the minimum of one
  EXPECT_EQ(split_threads(16, {4, 4}), (V{8, 8}));  // more threads than CPUs: still proportional
  EXPECT_EQ(split_threads(2, {1, 15}), (V{1, 1}));  // every node with CPUs gets one
  EXPECT_EQ(split_threads(1, {4, 4}), (V{1, 0}));   // total < nodes: the budget holds
  EXPECT_EQ(split_threads(1, {2, 6}), (V{0, 1}));   // ... and goes to the node with most CPUs
  EXPECT_EQ(split_threads(4, {0, 4}), (V{0, 4}));   // a memory-only node gets none
  EXPECT_EQ(split_threads(3, {0, 0}), (V{0, 0}));
  // Four nodes.
  EXPECT_EQ(split_threads(32, {8, 8, 8, 8}), (V{8, 8, 8, 8}));
  EXPECT_EQ(split_threads(6, {8, 8, 8, 8}), (V{2, 2, 1, 1}));
  EXPECT_EQ(split_threads(4, {1, 1, 1, 29}), (V{1, 1, 1, 1}));
  EXPECT_EQ(split_threads(5, {1, 1, 1, 29}), (V{1, 1, 1, 2}));
  EXPECT_EQ(split_threads(12, {2, 8, 4, 8}), (V{1, 5, 2, 4}));  // a tie: the lower index
  EXPECT_EQ(split_threads(2, {8, 8, 8, 8}), (V{1, 1, 0, 0}));   // total < nodes
  EXPECT_EQ(split_threads(2, {2, 8, 4, 8}), (V{0, 1, 0, 1}));
  EXPECT_EQ(split_threads(3, {2, 8, 4, 8}), (V{0, 1, 1, 1}));
  // For any budget: the sum is the budget, every node with CPUs gets one when the budget covers
  // them all, and a node never gets fewer threads than one with fewer CPUs.
  const std::vector<V> machines = {{4, 4},       {2, 6},       {1, 15},
                                   {8, 8, 8, 8}, {2, 8, 4, 8}, {3, 0, 5, 7}};
  for (const V& cpus : machines) {
    const int with_cpus =
        static_cast<int>(std::count_if(cpus.begin(), cpus.end(), [](int c) { return c > 0; }));
    for (int total = 1; total <= 64; ++total) {
      const V split = split_threads(total, cpus);
      int sum = 0;
      for (size_t i = 0; i < cpus.size(); ++i) {
        sum += split[i];
        if (cpus[i] == 0) {
          EXPECT_EQ(split[i], 0);
        }
        if (cpus[i] > 0 && total >= with_cpus) {
          EXPECT_GE(split[i], 1);
        }
        for (size_t j = 0; j < cpus.size(); ++j)
          if (cpus[i] > cpus[j]) {
            EXPECT_GE(split[i], split[j]) << "total " << total;
          }
      }
      EXPECT_EQ(sum, total) << "total " << total << " over " << cpus.size() << " nodes";
    }
  }
  test::expect_error([] { split_threads(0, {4, 4}); }, {"budget of 0", "1 or more"});
}

// Spins for `us` microseconds: long enough for the arena's other threads to take chunks.
void busy(int us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Where the chunks of a pass ran: each thread's CPU masks, and the CPUs it ran on.
struct Seen {
  std::mutex mu;
  std::map<std::thread::id, std::set<std::vector<int>>> masks;
  std::set<int> cpus;
  void record() {
    std::vector<int> mask = cpus_of_this_thread();
    const int cpu = sched_getcpu();
    std::lock_guard lock(mu);
    masks[std::this_thread::get_id()].insert(std::move(mask));
    cpus.insert(cpu);
  }
};

int only_node() {
  return topology().numa_nodes.size() == 1 ? topology().numa_nodes[0].os_index : -1;
}

TEST(CpuAdamTopology, NumaNodeOfTouchedUntouchedAndEmptyMemory) {
  ASSERT_FALSE(topology().numa_nodes.empty());
  std::vector<float> small(1000, 1.0f);              // touched, a page or two
  std::vector<float> large(size_t{16} << 20, 1.0f);  // touched, 64 MiB: sampled pages
  const int node_small = numa_node_of_memory(small.data(), small.size() * 4);
  const int node_large = numa_node_of_memory(large.data(), large.size() * 4);
  if (only_node() >= 0) {
    EXPECT_EQ(node_small, only_node());
    EXPECT_EQ(node_large, only_node());
  } else {  // several nodes: whichever holds them, it is one of the machine's
    EXPECT_GE(node_small, 0);
  }
  EXPECT_EQ(numa_node_of_memory(nullptr, 4096), -1);
  EXPECT_EQ(numa_node_of_memory(small.data(), 0), -1);
  // A fresh mapping has no pages yet: no node holds it (hwloc reports an empty set). After one
  // write, the small area around that page is on the writer's node.
  const size_t bytes = size_t{256} << 20;
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  auto* p = static_cast<unsigned char*>(map);
  EXPECT_EQ(numa_node_of_memory(p, bytes), -1);
  EXPECT_EQ(numa_node_of_memory(p + (bytes / 2), 64 * 4096), -1);
  p[bytes / 2 + 4096] = 1;
  const int written = numa_node_of_memory(p + (bytes / 2), 64 * 4096);
  if (only_node() >= 0) {
    EXPECT_EQ(written, only_node());
  }
  EXPECT_GE(written, 0);
  munmap(map, bytes);
}

TEST(CpuAdamTopology, BindThisThreadToCpus) {
  const std::vector<int> process = cpus_of_this_process();
  ASSERT_FALSE(process.empty());
  std::thread([&] {  // a thread of its own: the test's main thread keeps its binding
    const std::vector<int> one = {process.back()};
    ASSERT_EQ(bind_this_thread_to_cpus(one), "");
    EXPECT_EQ(cpus_of_this_thread(), one);
    busy(1000);
    EXPECT_EQ(sched_getcpu(), process.back());
    const std::string none = bind_this_thread_to_cpus({});
    EXPECT_NE(none.find("no CPUs"), std::string::npos) << none;
    const std::string bad = bind_this_thread_to_cpus({99999});
    EXPECT_NE(bad.find("99999"), std::string::npos) << bad;
    EXPECT_NE(bind_this_thread_to_cpus({-1}).find("-1"), std::string::npos);
    EXPECT_EQ(cpus_of_this_thread(), one);  // a failed binding leaves the old one
    EXPECT_EQ(bind_this_thread_to_cpus(process), "");
    EXPECT_EQ(cpus_of_this_thread(), process);
  })
      .join();
}

TEST(CpuAdamNuma, OneArenaPerNodeWithCpusAndTheBudgetSplit) {
  const std::vector<int> process = cpus_of_this_process();
  std::vector<int> nodes, usable;
  for (const NumaNode& n : topology().numa_nodes) {
    int count = 0;
    for (int cpu : n.cpus) count += std::count(process.begin(), process.end(), cpu);
    if (count > 0) {
      nodes.push_back(n.os_index);
      usable.push_back(count);
    }
  }
  ASSERT_FALSE(nodes.empty());
  const int all = std::accumulate(usable.begin(), usable.end(), 0);
  CpuAdam adam;
  EXPECT_EQ(adam.arena_nodes(), nodes);
  EXPECT_EQ(adam.arena_threads(), usable);  // 0 threads: every usable CPU, each on its node
  EXPECT_EQ(adam.threads(), all);
  for (int threads : {1, 2, 3, 7}) {
    CpuAdam budget({.threads = threads});
    std::vector<int> want = cpu_adam::split_threads(threads, usable);
    std::vector<int> want_nodes;
    for (size_t i = 0; i < want.size(); ++i)
      if (want[i] > 0) want_nodes.push_back(nodes[i]);
    std::erase(want, 0);
    EXPECT_EQ(budget.arena_threads(), want) << threads << " threads";
    EXPECT_EQ(budget.arena_nodes(), want_nodes) << threads << " threads";
    EXPECT_EQ(budget.threads(), threads);
  }
  CpuAdam flat({.threads = 3, .numa = false});
  EXPECT_EQ(flat.arena_nodes(), std::vector<int>{-1});
  EXPECT_EQ(flat.arena_threads(), std::vector<int>{3});
  // Memory of no known node (never touched) goes to the arena with the most threads.
  const std::vector<int> threads = adam.arena_threads();
  const auto most = std::max_element(threads.begin(), threads.end()) - threads.begin();
  void* map = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  EXPECT_EQ(adam.arena_for(map, 1 << 20), most);
  munmap(map, 1 << 20);
  std::vector<float> touched(1 << 16, 1.0f);
  const int at = adam.arena_for(touched.data(), touched.size() * 4);
  ASSERT_GE(at, 0);
  ASSERT_LT(at, static_cast<int>(nodes.size()));
  if (nodes.size() > 1) {
    EXPECT_EQ(adam.arena_nodes()[at], numa_node_of_memory(touched.data(), touched.size() * 4));
  }
}

// Every thread that may enter the arena is first bound to one CPU (the caller directly; the
// oneTBB workers inside an unpinned arena's chunks): inside the pinned arena each must then run
// on exactly its node's CPUs, and the caller gets its one CPU back afterwards.
TEST(CpuAdamNuma, ThreadsRunOnTheCpusOfTheNodeHoldingTheMemory) {
  const std::vector<int> process = cpus_of_this_process();
  if (process.size() < 2) GTEST_SKIP() << "one CPU: a thread's binding cannot change";
  std::thread([&] {
    const std::vector<int> one = {process.back()};
    std::vector<float> shard(size_t{1} << 20, 1.0f);
    const uint64_t bytes = shard.size() * 4;
    CpuAdam unpinned({.numa = false});
    ASSERT_EQ(bind_this_thread_to_cpus(one), "");
    unpinned.for_each_chunk(shard.data(), bytes, 64, [&](size_t) {
      ASSERT_EQ(bind_this_thread_to_cpus(one), "");
      busy(200);
    });

    CpuAdam adam;
    const int a = adam.arena_for(shard.data(), bytes);
    const int node = adam.arena_nodes()[a];
    std::vector<int> node_cpus;
    for (const NumaNode& n : topology().numa_nodes)
      if (n.os_index == node)
        for (int cpu : n.cpus)
          if (std::count(process.begin(), process.end(), cpu)) node_cpus.push_back(cpu);
    ASSERT_FALSE(node_cpus.empty());
    Seen seen;
    adam.for_each_chunk(shard.data(), bytes, 64, [&](size_t) {
      seen.record();
      busy(200);
    });
    EXPECT_EQ(adam.pinning_error(), "");
    EXPECT_TRUE(seen.masks.contains(std::this_thread::get_id())) << "the caller ran no chunk";
    EXPECT_LE(seen.masks.size(), static_cast<size_t>(adam.arena_threads()[a]));
    for (const auto& [thread, masks] : seen.masks)
      EXPECT_EQ(masks, std::set<std::vector<int>>{node_cpus})
          << "a thread in the arena of node " << node << " was not bound to its CPUs "
          << format_cpu_list(node_cpus);
    for (int cpu : seen.cpus)
      EXPECT_TRUE(std::count(node_cpus.begin(), node_cpus.end(), cpu)) << "ran on CPU " << cpu;
    EXPECT_EQ(cpus_of_this_thread(), one) << "the caller's own binding was not put back";

    // Without NUMA nothing is pinned: the caller keeps its one CPU inside the arena.
    Seen flat;
    unpinned.for_each_chunk(shard.data(), bytes, 64, [&](size_t) {
      flat.record();
      busy(200);
    });
    EXPECT_EQ(flat.masks[std::this_thread::get_id()], std::set<std::vector<int>>{one});

    // Leave the workers as they were found.
    unpinned.for_each_chunk(shard.data(), bytes, 64, [&](size_t) {
      (void)bind_this_thread_to_cpus(process);
      busy(200);
    });
  }).join();
}

TEST(CpuAdamNuma, ThreadBudgetIsHonored) {
  std::vector<float> shard(size_t{1} << 20, 1.0f);
  for (int threads : {1, 2}) {
    CpuAdam adam({.threads = threads});
    EXPECT_EQ(adam.threads(), threads);
    Seen seen;
    adam.for_each_chunk(shard.data(), shard.size() * 4, 32, [&](size_t) {
      seen.record();
      busy(300);
    });
    EXPECT_LE(seen.masks.size(), static_cast<size_t>(threads));
    if (threads == 1) {
      EXPECT_TRUE(seen.masks.contains(std::this_thread::get_id()));
    }
  }
}

// --- 64-bit indexing ---------------------------------------------------------------------------

TEST(CpuAdam64Bit, ChunkAndSpanArithmeticPast2To31And2To32Elements) {
  for (const uint64_t n : {(uint64_t{1} << 31) + 17, (uint64_t{1} << 32) + 5}) {
    for (const uint64_t chunk : {uint64_t{CpuAdam::kUpdateChunk}, uint64_t{CpuAdam::kStatsChunk}}) {
      const size_t count = cpu_adam::chunk_count(n, chunk);
      ASSERT_EQ(count, (n + chunk - 1) / chunk) << n;
      uint64_t covered = 0;
      for (size_t c = 0; c < count; ++c) {
        const cpu_adam::ChunkRange r = cpu_adam::chunk_range(n, chunk, c);
        ASSERT_EQ(r.begin, covered) << "chunk " << c << " of " << n;
        ASSERT_EQ(r.n, std::min<uint64_t>(chunk, n - covered)) << "chunk " << c << " of " << n;
        covered += r.n;
      }
      EXPECT_EQ(covered, n);
      EXPECT_EQ(cpu_adam::chunk_range(n, chunk, count - 1).n, n - (count - 1) * chunk);
    }
    // Spans of a shard at made-up addresses (never dereferenced): every pointer is its base plus
    // the element offset times the element size, computed here in 64-bit integers.
    const uint64_t base = uint64_t{1} << 44;
    const uint64_t master = base, m = base + 0x1000000000, v = base + 0x2000000000;
    const uint64_t grad = base + 0x3000000000, copy = base + 0x4000000000;
    const AdamShard shard{reinterpret_cast<float*>(master), reinterpret_cast<float*>(m),
                          reinterpret_cast<float*>(v), n};
    const size_t count = cpu_adam::chunk_count(n, CpuAdam::kUpdateChunk);
    const size_t at_2_31 = (size_t{1} << 31) / CpuAdam::kUpdateChunk;  // begins at element 2^31
    for (DType gt : kGradTypes) {
      const GradShard g{reinterpret_cast<const void*>(grad), gt, n};
      const std::optional<ParamCopy> out = ParamCopy{reinterpret_cast<void*>(copy), DType::bf16};
      for (size_t c : {size_t{0}, at_2_31 - 1, at_2_31, count - 2, count - 1}) {
        const cpu_adam::UpdateSpan s = cpu_adam::update_span(shard, g, out, c);
        const uint64_t begin = uint64_t{c} * CpuAdam::kUpdateChunk;
        EXPECT_EQ(reinterpret_cast<uint64_t>(s.master), master + begin * 4) << c;
        EXPECT_EQ(reinterpret_cast<uint64_t>(s.m), m + begin * 4) << c;
        EXPECT_EQ(reinterpret_cast<uint64_t>(s.v), v + begin * 4) << c;
        EXPECT_EQ(reinterpret_cast<uint64_t>(s.grad), grad + begin * dtype_size(gt)) << c;
        EXPECT_EQ(reinterpret_cast<uint64_t>(s.out), copy + begin * 2) << c;
        EXPECT_EQ(s.n, std::min<uint64_t>(CpuAdam::kUpdateChunk, n - begin)) << c;
      }
      EXPECT_EQ(cpu_adam::update_span(shard, g, {}, count - 1).out, nullptr);
    }
  }
}

// A gradient shard of n elements in an anonymous mapping no one has written: its pages read as
// zero without being allocated, so 2^31 + 1000 elements cost page tables, not gigabytes.
class SparseGrad {
 public:
  SparseGrad(size_t n, DType t) : bytes_(n * dtype_size(t)) {
    map_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map_ == MAP_FAILED) map_ = nullptr;
#if defined(MADV_POPULATE_READ)
    // Map the shared zero page everywhere in one call (Linux 5.14+): a first read that faults
    // page by page takes 20 s on a small virtual machine, this about 3. Older kernels refuse it
    // and fault instead.
    if (map_ != nullptr) (void)madvise(map_, bytes_, MADV_POPULATE_READ);
#endif
  }
  ~SparseGrad() {
    if (map_ != nullptr) munmap(map_, bytes_);
  }
  SparseGrad(const SparseGrad&) = delete;
  SparseGrad& operator=(const SparseGrad&) = delete;
  void* data() const {
    return map_;
  }

 private:
  size_t bytes_;
  void* map_ = nullptr;
};

TEST(CpuAdam64Bit, GradStatsOver2To31PlusElementsSeeEveryOne) {
#if defined(STRATA_TEST_ASAN)
  // Little memory, but every load checked: a minute under ASan against 5 s. The Release build's
  // full ctest runs it; the arithmetic test above runs everywhere.
  GTEST_SKIP() << "4 GiB of reads under ASan take a minute; this test runs in the Release build";
#endif
  const size_t n = (size_t{1} << 31) + 1000;
  SparseGrad sparse(n, DType::bf16);
  if (sparse.data() == nullptr)
    GTEST_SKIP() << "cannot map " << n * 2 << " bytes of address space (overcommit off?)";
  auto* g = static_cast<uint16_t*>(sparse.data());
  // Values whose squares add exactly: 3^2 + 4^2 + 12^2 = 169. Two of them lie past 2^31, where a
  // 32-bit index would wrap (and read a zero at a small index instead).
  g[5] = f32_to_bf16(3.0f);
  g[(size_t{1} << 31) + 500] = f32_to_bf16(4.0f);
  g[n - 1] = f32_to_bf16(12.0f);
  CpuAdam adam({.threads = 2});
  const auto t0 = std::chrono::steady_clock::now();
  GradStats stats = adam.grad_stats({g, DType::bf16, n});
  EXPECT_FALSE(stats.non_finite);
  EXPECT_EQ(stats.sum_squares, 169.0);
  g[n - 1] = f32_to_bf16(std::numeric_limits<float>::infinity());
  stats = adam.grad_stats({g, DType::bf16, n});
  EXPECT_TRUE(stats.non_finite) << "an Inf at element " << n - 1 << " was missed";
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("seconds", std::to_string(seconds));
}

}  // namespace
}  // namespace strata
