// cpu_adam.cpp: CpuAdam's checks, its oneTBB arenas (one per NUMA node, pinned) and the choice
// of SIMD path.
//
// Work is cut into fixed chunks (kUpdateChunk, kStatsChunk elements from the start of the shard)
// whatever the thread count; the statistics keep one partial sum per chunk and add them in chunk
// order afterwards, which is what makes them independent of the thread count and scheduling.
#include "cpu_adam/cpu_adam.h"

#include "core/error.h"
#include "core/log.h"
#include "core/topology.h"
#include "cpu_adam/kernels.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>
#include <xsimd/xsimd.hpp>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>

namespace strata {
namespace cpu_adam {

std::span<const SimdKernels* const> available_kernels() {
  static const std::vector<const SimdKernels*> list = [] {
    std::vector<const SimdKernels*> l;
#if defined(__x86_64__)
    const auto a = xsimd::available_architectures();
    // F16C is CPUID.1:ECX bit 29 (read directly: clang 14, which the fuzz build uses, does not
    // know "f16c" in __builtin_cpu_supports).
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    if (a.avx512f && f16c) l.push_back(&kAvx512Kernels);
    if (a.avx2 && f16c) l.push_back(&kAvx2Kernels);
    if (a.sse4_2) l.push_back(&kSse42Kernels);
#elif defined(__aarch64__)
    l.push_back(&kNeon64Kernels);  // Advanced SIMD and its f16 conversions are base AArch64
#endif
    l.push_back(&kScalarKernels);
    return l;
  }();
  return list;
}

std::vector<int> split_threads(int total, const std::vector<int>& cpus_per_node) {
  if (total < 1)
    fail("cpu adam: a thread budget of {} cannot be split; pass 1 or more threads", total);
  const size_t nodes = cpus_per_node.size();
  std::vector<int> out(nodes, 0);
  std::vector<size_t> with_cpus;  // nodes that can take threads, most CPUs first
  int64_t cpus = 0;
  for (size_t i = 0; i < nodes; ++i) {
    if (cpus_per_node[i] > 0) {
      with_cpus.push_back(i);
      cpus += cpus_per_node[i];
    }
  }
  if (with_cpus.empty()) return out;
  if (static_cast<size_t>(total) < with_cpus.size()) {
    std::stable_sort(with_cpus.begin(), with_cpus.end(),
                     [&](size_t a, size_t b) { return cpus_per_node[a] > cpus_per_node[b]; });
    for (int k = 0; k < total; ++k) out[with_cpus[static_cast<size_t>(k)]] = 1;
    return out;
  }
  // Node i's share is total * c_i / cpus. Start from its floor (at least 1), then move single
  // threads: add to the node furthest below its share, or take from the one furthest above it
  // (keeping 1), until the budget is met. Shares are compared as total * c_i - out_i * cpus,
  // exactly, in 64 bits. Ties go to the lower index when adding, the higher when taking.
  const auto below = [&](size_t i) {
    return int64_t{total} * cpus_per_node[i] - int64_t{out[i]} * cpus;
  };
  int64_t sum = 0;
  for (size_t i : with_cpus) {
    out[i] = std::max<int>(1, static_cast<int>(int64_t{total} * cpus_per_node[i] / cpus));
    sum += out[i];
  }
  while (sum < total) {
    size_t best = with_cpus.front();
    for (size_t i : with_cpus)
      if (below(i) > below(best)) best = i;
    ++out[best];
    ++sum;
  }
  while (sum > total) {
    size_t best = nodes;
    for (size_t i : with_cpus)
      if (out[i] > 1 && (best == nodes || below(i) <= below(best))) best = i;
    --out[best];
    --sum;
  }
  return out;
}

size_t chunk_count(size_t total, size_t chunk) {
  return total / chunk + (total % chunk != 0 ? 1 : 0);  // no total + chunk - 1: cannot overflow
}

ChunkRange chunk_range(size_t total, size_t chunk, size_t c) {
  const size_t begin = c * chunk;
  return {begin, std::min(chunk, total - begin)};
}

UpdateSpan update_span(const AdamShard& shard, const GradShard& grad,
                       const std::optional<ParamCopy>& copy, size_t c) {
  const ChunkRange r = chunk_range(shard.n, CpuAdam::kUpdateChunk, c);
  const size_t gsize = dtype_size(grad.dtype);
  const size_t osize = copy ? dtype_size(copy->dtype) : 0;
  return UpdateSpan{
      shard.master + r.begin,
      shard.m != nullptr ? shard.m + r.begin : nullptr,
      shard.v != nullptr ? shard.v + r.begin : nullptr,
      static_cast<const unsigned char*>(grad.data) + r.begin * gsize,
      grad.dtype,
      copy ? static_cast<unsigned char*>(copy->data) + r.begin * osize : nullptr,
      copy ? copy->dtype : DType::bf16,
      r.n,
  };
}

}  // namespace cpu_adam

namespace {

// Pins every thread that enters an arena to `cpus`. Workers go back to the process's CPUs when
// they leave (oneTBB shares its workers between arenas, and other arenas are not ours to pin);
// a calling thread gets its own binding back when its call leaves the arena.
class Pinner : public tbb::task_scheduler_observer {
 public:
  using Report = std::function<void(const std::string&)>;
  Pinner(tbb::task_arena& arena, std::vector<int> cpus, std::vector<int> process_cpus,
         Report report)
      : tbb::task_scheduler_observer(arena),
        cpus_(std::move(cpus)),
        process_cpus_(std::move(process_cpus)),
        report_(std::move(report)) {
    observe(true);
  }
  // Stop the callbacks before the members they use go away. A thread still inside the arena
  // holds a reference to oneTBB's record of this observer, which it drops only when it leaves;
  // a worker that lingers there until the process ends leaks that record (LeakSanitizer sees
  // it), so wait (briefly: idle workers leave an arena in microseconds) for them to leave.
  ~Pinner() override {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (inside_.load() > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    observe(false);
  }
  Pinner(const Pinner&) = delete;
  Pinner& operator=(const Pinner&) = delete;

  void on_scheduler_entry(bool worker) override {
    ++inside_;
    if (!worker) saved().push_back(cpus_of_this_thread());
    const std::string error = bind_this_thread_to_cpus(cpus_);
    if (!error.empty()) report_(error);
  }
  void on_scheduler_exit(bool worker) override {
    std::vector<int> back;
    if (worker) {
      back = process_cpus_;
    } else if (!saved().empty()) {
      back = std::move(saved().back());
      saved().pop_back();
    }
    if (!back.empty()) (void)bind_this_thread_to_cpus(back);  // best effort, as the pinning
    --inside_;
  }

 private:
  // The bindings of a calling thread's enclosing calls, innermost last.
  static std::vector<std::vector<int>>& saved() {
    thread_local std::vector<std::vector<int>> stack;
    return stack;
  }

  std::vector<int> cpus_;
  std::vector<int> process_cpus_;
  Report report_;
  std::atomic<int> inside_{0};  // threads between their entry and exit notifications
};

const cpu_adam::SimdKernels& pick_kernels(const std::string& name) {
  const auto list = cpu_adam::available_kernels();
  if (name == "best") return *list.front();
  std::string names;
  for (const cpu_adam::SimdKernels* k : list) {
    if (name == k->name) return *k;
    names += names.empty() ? k->name : std::string(", ") + k->name;
  }
  fail(
      "cpu adam: SIMD path '{}' is not available on this CPU (it has: {}); use one of those or "
      "'best'",
      name, names);
}

void check_params(int64_t step, const AdamParams& p, float grad_scale) {
  if (step < 1) fail("cpu adam: step {} is not valid; steps count from 1", step);
  if (p.type != OptimizerType::adam && p.type != OptimizerType::lion &&
      p.type != OptimizerType::adagrad)
    fail("cpu adam: optimizer type {} is not one of adam, lion, adagrad", static_cast<int>(p.type));
  if (!std::isfinite(p.lr) || p.lr < 0)
    fail("cpu adam: lr {} is not valid; use a finite lr >= 0", p.lr);
  if (p.type != OptimizerType::adagrad &&
      (!(p.beta1 >= 0 && p.beta1 < 1) || !(p.beta2 >= 0 && p.beta2 < 1)))
    fail("cpu adam: {}'s betas ({}, {}) are not valid; each must be in [0, 1)",
         optimizer_type_name(p.type), p.beta1, p.beta2);
  if (p.type != OptimizerType::lion && (!std::isfinite(p.eps) || p.eps <= 0))
    fail("cpu adam: {}'s eps {} is not valid; use a finite eps > 0 (e.g. 1e-8)",
         optimizer_type_name(p.type), p.eps);
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    fail("cpu adam: weight_decay {} is not valid; use a finite value >= 0", p.weight_decay);
  if (!std::isfinite(grad_scale) || grad_scale <= 0)
    fail(
        "cpu adam: gradient scale {} is not valid; pass 1/loss-scale x clip coefficient (finite, "
        "> 0), see combined_grad_scale",
        grad_scale);
}

void check_shard(const AdamShard& shard, const GradShard& grad,
                 const std::optional<ParamCopy>& copy, OptimizerType type) {
  if (grad.n != shard.n)
    fail(
        "cpu adam: gradient shard has {} elements but the optimizer shard {}; pass the gradient "
        "of this shard",
        grad.n, shard.n);
  if (shard.n > 0 && (!shard.master || !grad.data))
    fail("cpu adam: shard of {} elements is missing its master or gradient buffer", shard.n);
  if (shard.n > 0 &&
      ((optimizer_keeps_m(type) && !shard.m) || (optimizer_keeps_v(type) && !shard.v)))
    fail("cpu adam: shard of {} elements is missing the {} that {} keeps", shard.n,
         optimizer_keeps_m(type) && !shard.m ? "m" : "v", optimizer_type_name(type));
  if (copy && copy->dtype == DType::f32)
    fail(
        "cpu adam: parameter copy dtype f32 is not supported (the master already is f32); use "
        "bf16 or f16, or no copy");
  if (copy && shard.n > 0 && copy->data == nullptr)
    fail("cpu adam: parameter copy of {} elements has no buffer; pass one or no copy", shard.n);
}

}  // namespace

namespace cpu_adam {

StepConstants step_constants(int64_t step, const AdamParams& p, float grad_scale) {
  check_params(step, p, grad_scale);
  // Computed in double and rounded to float once, as torch does with its Python-float scalars.
  const double lr = p.lr, b1 = p.beta1, b2 = p.beta2, wd = p.weight_decay;
  const double s = static_cast<double>(step);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, s) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, s) : 1.0;
  StepConstants k{};
  k.type = p.type;
  k.grad_scale = grad_scale;
  switch (p.type) {
    case OptimizerType::adam:
      k.l2_decay = p.adamw ? 0.0f : p.weight_decay;
      k.param_decay = p.adamw ? static_cast<float>(1.0 - lr * wd) : 1.0f;
      k.beta1 = p.beta1;
      k.one_minus_beta1 = static_cast<float>(1.0 - b1);
      k.beta2 = p.beta2;
      k.one_minus_beta2 = static_cast<float>(1.0 - b2);
      k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
      k.eps = p.eps;
      k.neg_step_size = static_cast<float>(-(lr / bc1));
      break;
    case OptimizerType::lion:  // decay always decoupled; no bias correction, no eps
      k.param_decay = static_cast<float>(1.0 - lr * wd);
      k.beta1 = p.beta1;
      k.one_minus_beta1 = static_cast<float>(1.0 - b1);
      k.beta2 = p.beta2;
      k.one_minus_beta2 = static_cast<float>(1.0 - b2);
      k.neg_step_size = static_cast<float>(-lr);
      break;
    case OptimizerType::adagrad:  // decay always L2, as torch's and DeepSpeed's Adagrad
      k.l2_decay = p.weight_decay;
      k.param_decay = 1.0f;
      k.eps = p.eps;
      k.neg_step_size = static_cast<float>(-lr);
      break;
  }
  return k;
}

}  // namespace cpu_adam

float combined_grad_scale(const GradStats& global, float loss_scale, float max_norm) {
  if (global.non_finite)
    fail(
        "cpu adam: the gradients hold NaN or Inf; skip this step (and lower the loss scale) "
        "instead of scaling it");
  if (!std::isfinite(loss_scale) || loss_scale <= 0)
    fail("cpu adam: loss scale {} is not valid; use a finite value > 0 (1 without fp16)",
         loss_scale);
  const double norm = std::sqrt(global.sum_squares) / loss_scale;
  double clip = 1.0;  // torch.nn.utils.clip_grad_norm_'s coefficient
  if (max_norm > 0 && norm > max_norm) clip = max_norm / (norm + 1e-6);
  return static_cast<float>(clip / loss_scale);
}

struct CpuAdam::Impl {
  struct NodeArena {
    int node = -1;          // os index of its NUMA node; -1: not pinned
    std::vector<int> cpus;  // empty: not pinned
    int threads = 0;
    std::unique_ptr<tbb::task_arena> arena;
    std::unique_ptr<Pinner> pinner;  // declared after the arena: destroyed before it
  };

  const cpu_adam::SimdKernels* kernels = nullptr;
  // Before the arenas: a late worker entering an arena may still report while they go.
  mutable std::mutex error_mutex;
  std::string pinning_error;
  std::vector<NodeArena> arenas;
  size_t fallback = 0;  // the arena with the most threads: for memory of no known node

  void report(const std::string& error) {
    std::lock_guard lock(error_mutex);
    if (!pinning_error.empty()) return;
    pinning_error = error;
    warn_once("cpu-adam-pinning", "cpu adam: threads are not pinned to their NUMA node ({})",
              error);
  }

  size_t arena_for(const void* memory, uint64_t bytes) const {
    if (arenas.size() == 1) return 0;  // nothing to choose: skip the page query
    const int node = numa_node_of_memory(memory, bytes);
    for (size_t i = 0; i < arenas.size(); ++i)
      if (node >= 0 && arenas[i].node == node) return i;
    return fallback;
  }

  // Runs f(chunk) for chunk in [0, chunks) on arena a, statically partitioned.
  template <class F>
  void for_chunks(size_t a, size_t chunks, const F& f) {
    if (chunks <= 1) {
      if (chunks == 1) f(size_t{0});
      return;
    }
    arenas[a].arena->execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, chunks),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t c = r.begin(); c != r.end(); ++c) f(c);
          },
          tbb::static_partitioner());
    });
  }

  // One pinned arena per NUMA node with usable CPUs; nothing when the nodes cannot be read.
  void make_node_arenas(int threads) {
    std::vector<int> process = cpus_of_this_process();
    std::vector<NumaNode> nodes;
    try {
      nodes = topology().numa_nodes;
    } catch (const Error& e) {
      warn_once("cpu-adam-topology", "cpu adam: NUMA nodes unknown ({}); one unpinned arena",
                e.what());
      return;
    }
    std::vector<std::vector<int>> usable(nodes.size());
    std::vector<int> counts(nodes.size());
    int all = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      for (int cpu : nodes[i].cpus)
        if (process.empty() || std::find(process.begin(), process.end(), cpu) != process.end())
          usable[i].push_back(cpu);
      counts[i] = static_cast<int>(usable[i].size());
      all += counts[i];
    }
    if (all == 0) return;
    const std::vector<int> split = cpu_adam::split_threads(threads == 0 ? all : threads, counts);
    if (process.empty()) {
      for (const std::vector<int>& u : usable) process.insert(process.end(), u.begin(), u.end());
      std::sort(process.begin(), process.end());
    }
    arenas.reserve(nodes.size());
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (split[i] == 0) continue;
      NodeArena& na = arenas.emplace_back();
      na.node = nodes[i].os_index;
      na.cpus = usable[i];
      na.threads = split[i];
      na.arena = std::make_unique<tbb::task_arena>(split[i]);
      na.arena->initialize();
      na.pinner = std::make_unique<Pinner>(*na.arena, na.cpus, process,
                                           [this](const std::string& e) { report(e); });
    }
  }
};

CpuAdam::CpuAdam(const CpuAdamOptions& options) : impl_(std::make_unique<Impl>()) {
  if (options.threads < 0)
    fail("cpu adam: threads {} is not valid; use 0 (every core) or a positive count",
         options.threads);
  impl_->kernels = &pick_kernels(options.simd);
  if (options.numa) impl_->make_node_arenas(options.threads);
  if (impl_->arenas.empty()) {
    Impl::NodeArena& na = impl_->arenas.emplace_back();
    // A plain int: task_arena::automatic has no definition to bind a reference to.
    const int concurrency = options.threads == 0 ? tbb::task_arena::automatic : options.threads;
    na.arena = std::make_unique<tbb::task_arena>(concurrency);
    na.arena->initialize();
    na.threads = na.arena->max_concurrency();
  }
  for (size_t i = 1; i < impl_->arenas.size(); ++i)
    if (impl_->arenas[i].threads > impl_->arenas[impl_->fallback].threads) impl_->fallback = i;
}

CpuAdam::~CpuAdam() = default;

const char* CpuAdam::simd_path() const {
  return impl_->kernels->name;
}
int CpuAdam::threads() const {
  int sum = 0;
  for (const Impl::NodeArena& a : impl_->arenas) sum += a.threads;
  return sum;
}

std::vector<int> CpuAdam::arena_threads() const {
  std::vector<int> out;
  for (const Impl::NodeArena& a : impl_->arenas) out.push_back(a.threads);
  return out;
}

std::vector<int> CpuAdam::arena_nodes() const {
  std::vector<int> out;
  for (const Impl::NodeArena& a : impl_->arenas) out.push_back(a.node);
  return out;
}

int CpuAdam::arena_for(const void* memory, uint64_t bytes) const {
  return static_cast<int>(impl_->arena_for(memory, bytes));
}

std::string CpuAdam::pinning_error() const {
  std::lock_guard lock(impl_->error_mutex);
  return impl_->pinning_error;
}

void CpuAdam::for_each_chunk(const void* memory, uint64_t bytes, size_t chunks,
                             const std::function<void(size_t)>& f) {
  impl_->for_chunks(impl_->arena_for(memory, bytes), chunks, f);
}

std::vector<std::string> CpuAdam::available_paths() {
  std::vector<std::string> names;
  for (const cpu_adam::SimdKernels* k : cpu_adam::available_kernels()) names.emplace_back(k->name);
  return names;
}

GradStats CpuAdam::grad_stats(const GradShard& grad) {
  if (grad.n > 0 && grad.data == nullptr)
    fail("cpu adam: gradient shard of {} elements has no data; pass its buffer", grad.n);
  const size_t chunks = cpu_adam::chunk_count(grad.n, kStatsChunk);
  std::vector<double> partial(chunks);
  const size_t size = dtype_size(grad.dtype);
  const auto* base = static_cast<const unsigned char*>(grad.data);
  impl_->for_chunks(impl_->arena_for(grad.data, grad.n * size), chunks, [&](size_t c) {
    const cpu_adam::ChunkRange r = cpu_adam::chunk_range(grad.n, kStatsChunk, c);
    partial[c] = impl_->kernels->sum_squares(base + r.begin * size, grad.dtype, r.n);
  });
  GradStats stats;
  for (double p : partial) stats.sum_squares += p;  // chunk order: the same bits for any threads
  // Squares of finite f32/bf16/f16 values cannot overflow a double sum: a non-finite sum means a
  // non-finite element.
  stats.non_finite = !std::isfinite(stats.sum_squares);
  return stats;
}

bool CpuAdam::update(const AdamShard& shard, const GradShard& grad, int64_t step,
                     const AdamParams& params, float grad_scale, const GradStats& global,
                     std::optional<ParamCopy> copy) {
  if (global.non_finite) return false;  // an overflowed step: the trainer skips it
  check_shard(shard, grad, copy, params.type);
  const cpu_adam::StepConstants k = cpu_adam::step_constants(step, params, grad_scale);
  for_spans(shard, grad, copy,
            [&](const cpu_adam::UpdateSpan& span) { impl_->kernels->update(span, k); });
  return true;
}

void CpuAdam::memory_bound_pass(const AdamShard& shard, const GradShard& grad,
                                std::optional<ParamCopy> copy, OptimizerType type) {
  check_shard(shard, grad, copy, type);
  AdamShard kept = shard;  // the moments the type keeps, and only those
  if (!optimizer_keeps_m(type)) kept.m = nullptr;
  if (!optimizer_keeps_v(type)) kept.v = nullptr;
  for_spans(kept, grad, copy,
            [&](const cpu_adam::UpdateSpan& span) { impl_->kernels->traffic(span); });
}

void CpuAdam::for_spans(const AdamShard& shard, const GradShard& grad,
                        const std::optional<ParamCopy>& copy,
                        const std::function<void(const cpu_adam::UpdateSpan&)>& f) {
  impl_->for_chunks(impl_->arena_for(shard.master, uint64_t{shard.n} * sizeof(float)),
                    cpu_adam::chunk_count(shard.n, kUpdateChunk),
                    [&](size_t c) { f(cpu_adam::update_span(shard, grad, copy, c)); });
}

}  // namespace strata
