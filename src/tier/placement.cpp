// placement.cpp: see placement.h. Every byte figure here mirrors an allocation made elsewhere
// (ZeroModel, LlamaModel, ZeroRunner, the swap store, the pinned pool); when one of those
// changes what it allocates, change the matching line here and the test that compares them.
#include "tier/placement.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/system.h"
#include "model/file_io.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <set>
#include <sys/stat.h>
#include <unistd.h>
#include <fmt/format.h>

namespace strata {
namespace {

constexpr uint64_t kPinnedAlignment = 4096;

uint64_t round_up(uint64_t n, uint64_t a) {
  return a <= 1 ? n : (n + a - 1) / a * a;
}

// What a device arena hands out for one buffer of `bytes` (nothing for an empty one).
uint64_t device_buffer(uint64_t bytes, uint64_t alignment) {
  return bytes == 0 ? 0 : round_up(bytes, alignment);
}

// Host bytes of unit u's state at `bytes_per_element`: one block per rank's shard (one for a
// replicated unit), each rounded to a page as the pinned pool hands it out.
uint64_t host_bytes(const UnitPartition& up, int ranks, uint64_t bytes_per_element) {
  const uint64_t block = round_up(up.resident() * bytes_per_element, kPinnedAlignment);
  return up.replicated ? block : block * static_cast<uint64_t>(ranks);
}

// Swap-store shards (one per rank; one for a replicated unit) of a unit's state in stripes.
uint64_t nvme_stripes(const UnitPartition& up, int ranks, uint64_t bytes_per_element,
                      uint64_t stripe) {
  const uint64_t per_shard = (up.resident() * bytes_per_element + stripe - 1) / stripe;
  return up.replicated ? per_shard : per_shard * static_cast<uint64_t>(ranks);
}

// The swap files hold whole stripes on every path (SwapStore's file size).
uint64_t nvme_file_bytes(uint64_t stripes, size_t paths, uint64_t stripe) {
  const uint64_t k = std::max<size_t>(paths, 1);
  return (stripes + k - 1) / k * k * stripe;
}

struct Sizes {
  uint64_t ps, gs;  // bytes per element of parameters and gradients
  uint64_t os;      // of the optimizer state (the master and the moments its type keeps)
  uint64_t align;   // device arena alignment
};

Sizes sizes_of(const RunShape& s) {
  return {dtype_size(s.param_dtype), dtype_size(s.grad_dtype), optimizer_state_bytes(s.optimizer),
          std::max<uint64_t>(s.device_alignment, 1)};
}

// Per device: the GPU bytes of unit u's optimizer shard (the master and each moment its type
// keeps: an f32 buffer each).
uint64_t gpu_optimizer_bytes(const UnitPartition& up, const Sizes& z) {
  return z.os / 4 * device_buffer(up.resident() * 4, z.align);
}

// GPU bytes that do not depend on the homes: working buffers, activations, staging.
struct FixedGpu {
  uint64_t working = 0, landing = 0, activations = 0, other = 0;
  uint64_t host_activations = 0;  // the offloaded checkpoints, every rank's, in host RAM
};

FixedGpu fixed_gpu(const RunShape& s, const Partition& p) {
  const Sizes z = sizes_of(s);
  // The pool gathers sharded units (parameters and working gradients); a replicated unit is
  // used in place, with working gradients of its own (as ZeroModel allocates them). One rank
  // uses a sharded unit in place too (its shard is the whole unit): the pool holds gradients
  // alone.
  // Without training there are no gradients: ZeroModel allocates no working gradients and no
  // reduce-scatter staging, and the executor no activation gradients.
  const uint64_t gather_numel = p.max_gathered_numel();
  const uint64_t grads = s.training ? 1 : 0;
  FixedGpu f;
  const auto wb = static_cast<uint64_t>(s.working_buffers);
  const uint64_t gathered = s.ranks > 1 ? device_buffer(gather_numel * z.ps, z.align) : 0;
  f.working = wb * (gathered + grads * device_buffer(gather_numel * z.gs, z.align));
  for (const UnitPartition& up : p.units)
    if (up.replicated) f.working += grads * device_buffer(up.numel * z.gs, z.align);
  f.landing = wb * device_buffer(p.max_shard_numel() * z.ps, z.align);
  ModelOptions mo;
  mo.param_dtype = s.param_dtype;
  mo.grad_dtype = s.grad_dtype;
  mo.max_batch = s.micro_batch;
  mo.seq_len = s.seq_len;
  mo.recompute = s.recompute;
  mo.activation_sets = s.micro_batch_group;
  mo.forward_only = !s.training;  // evaluation: no room for a backward (LlamaModel)
  mo.kv_cache = s.kv_cache;
  mo.checkpoint_slots = checkpoint_slots(s);
  const uint64_t flow = static_cast<uint64_t>(s.micro_batch_group) * activation_bytes(s);
  // Each rank's offloaded checkpoints are one host block (the executor's), a page-rounded run of
  // sets x offloaded x [micro_batch * seq_len, hidden].
  f.host_activations =
      static_cast<uint64_t>(s.ranks) *
      round_up(static_cast<uint64_t>(offloaded_checkpoints(s.model, mo.checkpoint_slots)) * flow,
               kPinnedAlignment);
  f.activations = LlamaModel::workspace_bytes_for(s.model, mo, z.align) +
                  grads * 2 * device_buffer(flow, z.align);
  if (s.kv_cache)  // the executor's buffer of the last position's logits
    f.activations += device_buffer(static_cast<uint64_t>(s.model.vocab_size) * 4, z.align);
  // With several ranks, a shard of gradients each for the executor's staging of the summed
  // shard on its way to the host (units whose G is off the GPU) and ZeroModel's staging of the
  // sum it adds into a GPU-homed G. Which of them exist depends on the homes (gpu_staging);
  // this is the most they take. One rank adds its working gradients in place and copies them to
  // the host from the working buffer, but in micro-batch groups (unless reduced once per group,
  // which the shape does not say) through the staging (Schedule's file comment).
  const int staged = s.ranks > 1 ? 2 : s.micro_batch_group > 1 ? 1 : 0;
  f.other =
      grads * static_cast<uint64_t>(staged) * device_buffer(p.max_shard_numel() * z.gs, z.align);
  return f;
}

// The gradient staging the homes call for (FixedGpu::other is its bound): a shard for the
// executor's transfers of units whose G is off the GPU (one rank: in micro-batch groups only),
// and with several ranks one for ZeroModel's adds into sharded units' GPU-homed G.
uint64_t gpu_staging(const RunShape& s, const Partition& p, const std::vector<UnitHomes>& homes) {
  if (!s.training || (s.ranks == 1 && s.micro_batch_group == 1)) return 0;
  const Sizes z = sizes_of(s);
  bool off = false, added = false;
  for (size_t u = 0; u < homes.size(); ++u) {
    if (p.units[u].replicated) continue;
    off = off || homes[u].grad != Tier::gpu;
    added = added || (s.ranks > 1 && homes[u].grad == Tier::gpu);
  }
  return static_cast<uint64_t>((off ? 1 : 0) + (added ? 1 : 0)) *
         device_buffer(p.max_shard_numel() * z.gs, z.align);
}

// Pinned buffers for every shard that moves between tiers (placement.h), from the homes.
void size_pinned_buffers(Placement& p) {
  const Sizes z = sizes_of(p.shape);
  const int ranks = p.shape.ranks;
  uint64_t largest_moving = 0;
  for (size_t u = 0; u < p.homes.size(); ++u) {
    const UnitHomes& h = p.homes[u];
    const UnitPartition& up = p.partition.units[u];
    if (h.param != Tier::gpu || h.optimizer != Tier::gpu)
      largest_moving = std::max(largest_moving, host_bytes(up, ranks, z.ps));
    // G of every rank in one buffer: staged for grad_accumulate or NVMe, or brought down (or
    // read back) for CPU Adam.
    if (h.grad != Tier::gpu || h.optimizer != Tier::gpu)
      largest_moving = std::max(largest_moving, host_bytes(up, ranks, z.gs));
    if (h.optimizer == Tier::nvme)
      largest_moving = std::max(largest_moving, host_bytes(up, ranks, z.os));
  }
  p.pinned_buffers = largest_moving > 0 ? p.request.buffer_count : 0;
  p.pinned_buffer_bytes = largest_moving > 0 ? round_up(largest_moving, kPinnedAlignment) : 0;
}

// The homes of the gradient accumulators of units whose optimizer is off the GPU (GradHome):
// on the GPU in forward order while the GPU's need stays within its budget (automatic), or
// all of them (gpu), unless that would take more pinned buffers than there are.
void place_gradients(Placement& p, const TierBudgets& budgets) {
  const OffloadRequest& r = p.request;
  const Sizes z = sizes_of(p.shape);
  for (UnitHomes& h : p.homes) h.grad = h.optimizer == Tier::gpu ? Tier::gpu : Tier::cpu;
  if (r.grads == GradHome::cpu) return;
  if (r.grads == GradHome::nvme) {
    if (r.nvme_paths.empty())
      fail(
          "gradients on NVMe (--offload-gradients nvme): no nvme_path is given; add --nvme-path "
          "DIR[,DIR...] (or nvme_path in the config)");
    for (size_t u = 0; u < p.homes.size(); ++u)
      if (p.homes[u].optimizer != Tier::gpu && !p.partition.units[u].replicated)
        p.homes[u].grad = Tier::nvme;
    for (size_t u = 0; u < p.homes.size(); ++u)
      if (optimizer_pinned_buffers(p.homes[u]) > r.buffer_count)
        fail(
            "gradients on NVMe (--offload-gradients nvme): the optimizer of unit {} then holds "
            "{} pinned buffers at once (its gradients, updated parameters, optimizer state from "
            "NVMe), but buffer_count is {}; raise buffer_count",
            p.partition.units[u].name, optimizer_pinned_buffers(p.homes[u]), r.buffer_count);
    return;
  }
  uint64_t gpu = p.needs().total(Tier::gpu);
  // With several ranks the first sharded unit whose G comes to the GPU brings ZeroModel's
  // staging of the sums it adds (gpu_staging).
  bool staging = false;
  for (size_t u = 0; u < p.homes.size(); ++u)
    staging = staging || (!p.partition.units[u].replicated && p.homes[u].grad == Tier::gpu);
  staging = staging || p.shape.ranks == 1;
  for (size_t u = 0; u < p.homes.size(); ++u) {
    UnitHomes& h = p.homes[u];
    const UnitPartition& up = p.partition.units[u];
    if (h.optimizer == Tier::gpu) continue;
    UnitHomes g = h;
    g.grad = Tier::gpu;
    if (optimizer_pinned_buffers(g) > r.buffer_count) {
      if (r.grads == GradHome::gpu)
        fail(
            "gradients on the GPU (--offload-gradients none): the optimizer of unit {} then "
            "holds {} pinned buffers at once (its gradients, updated parameters, optimizer state "
            "from NVMe), but buffer_count is {}; raise buffer_count or keep the gradients in "
            "host RAM (--offload-gradients cpu)",
            up.name, optimizer_pinned_buffers(g), r.buffer_count);
      continue;
    }
    // A replicated unit's gradients are resident on every GPU whatever their home.
    uint64_t more = up.replicated ? 0 : device_buffer(up.resident() * z.gs, z.align);
    if (more > 0 && !staging) more += device_buffer(p.partition.max_shard_numel() * z.gs, z.align);
    if (r.grads == GradHome::automatic && more > 0 && gpu + more > budgets.gpu_memory) continue;
    gpu += more;
    h.grad = Tier::gpu;
    staging = staging || !up.replicated;
  }
  if (r.grads != GradHome::automatic || r.nvme_paths.empty()) return;
  // Host RAM short: the accumulators left there go to NVMe, last units first, until it holds.
  size_pinned_buffers(p);
  uint64_t cpu = p.needs().total(Tier::cpu);
  for (size_t u = p.homes.size(); u-- > 0 && cpu > budgets.cpu_memory;) {
    UnitHomes& h = p.homes[u];
    const UnitPartition& up = p.partition.units[u];
    if (h.grad != Tier::cpu || up.replicated) continue;
    UnitHomes g = h;
    g.grad = Tier::nvme;
    if (optimizer_pinned_buffers(g) > r.buffer_count) continue;
    h.grad = Tier::nvme;
    cpu -= host_bytes(up, p.shape.ranks, z.gs);
  }
}

void check_shape(const RunShape& s, const OffloadRequest& r) {
  if (s.ranks < 1) fail("placement: {} ranks (GPUs); at least 1 is needed", s.ranks);
  if (s.micro_batch < 1)
    fail("placement: micro-batch {} sequences; use --micro-batch 1 or more", s.micro_batch);
  if (s.seq_len < 1 || s.seq_len > s.model.max_position_embeddings)
    fail(
        "placement: sequence length {} is outside 1..{} (max_position_embeddings of {}); "
        "choose a --seq-len within it",
        s.seq_len, s.model.max_position_embeddings, s.model.name);
  if (s.working_buffers < 1)
    fail("placement: {} working buffers per GPU; at least 1 (prefetch depth + 1)",
         s.working_buffers);
  if (s.model.tie_word_embeddings && s.working_buffers < 2)
    fail(
        "placement: {} working buffer per GPU, but model {} ties its embeddings, so the head "
        "and the embedding are gathered together; use a prefetch depth of 1 or more",
        s.working_buffers, s.model.name);
  if (r.buffer_count < 1)
    fail("offload buffer_count {}: at least 1 pinned buffer is needed", r.buffer_count);
  if (r.nvme_stripe == 0 || r.nvme_stripe % 4096 != 0)
    fail("NVMe stripe (aio.block_size) {}: use a positive multiple of 4 KiB, e.g. 1048576",
         r.nvme_stripe);
  if (r.nvme_queue_depth < 1 || r.nvme_queue_depth > 4096)
    fail("NVMe queue depth (aio.queue_depth) {}: use 1 to 4096, e.g. 32", r.nvme_queue_depth);
  if (s.offload_activations && s.training && !s.recompute)
    fail(
        "activation checkpoints offloaded to host RAM (--offload-activations cpu, or "
        "activation_checkpointing.cpu_checkpointing) need activation checkpointing, which is "
        "off: without recompute each block keeps all its activations on the GPU; turn "
        "--activation-checkpointing on or keep the checkpoints on the GPU "
        "(--offload-activations none)");
}

}  // namespace

std::string_view tier_name(Tier t) {
  switch (t) {
    case Tier::gpu:
      return "gpu";
    case Tier::cpu:
      return "cpu";
    case Tier::nvme:
      return "nvme";
  }
  return "?";
}

Tier parse_tier(std::string_view text) {
  if (text == "none" || text == "gpu") return Tier::gpu;
  if (text == "cpu") return Tier::cpu;
  if (text == "nvme") return Tier::nvme;
  fail("offload device '{}' is not one of none (or gpu), cpu, nvme", text);
}

int optimizer_pinned_buffers(const UnitHomes& h) {
  if (h.optimizer == Tier::gpu) return h.param == Tier::nvme ? 1 : 0;
  return (h.optimizer == Tier::nvme ? 1 : 0) + (h.param != Tier::cpu ? 1 : 0) +
         (h.grad != Tier::cpu ? 1 : 0);
}

std::string_view grad_home_name(GradHome g) {
  switch (g) {
    case GradHome::automatic:
      return "auto";
    case GradHome::gpu:
      return "gpu";
    case GradHome::cpu:
      return "cpu";
    case GradHome::nvme:
      return "nvme";
  }
  return "?";
}

GradHome parse_grad_home(std::string_view text) {
  if (text == "auto") return GradHome::automatic;
  if (text == "gpu" || text == "none") return GradHome::gpu;
  if (text == "cpu") return GradHome::cpu;
  if (text == "nvme") return GradHome::nvme;
  fail(
      "gradient home '{}' is not one of auto (on the GPU where it fits), gpu (or none), cpu (in "
      "host RAM with the optimizer), nvme (in the swap store)",
      text);
}

std::string_view state_kind_name(StateKind k) {
  switch (k) {
    case StateKind::parameters:
      return "parameters";
    case StateKind::gradients:
      return "gradients";
    case StateKind::optimizer:
      return "optimizer";
    case StateKind::working:
      return "working";
    case StateKind::activations:
      return "activations";
    case StateKind::buffers:
      return "buffers";
    case StateKind::checkpoint:
      return "checkpoint";
    case StateKind::other:
      return "other";
  }
  return "?";
}

uint64_t TierBytes::total(Tier t) const {
  uint64_t sum = 0;
  for (uint64_t b : bytes[int(t)]) sum += b;
  return sum;
}

nlohmann::json TierBytes::to_json(Tier t) const {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 0; k < kStateKinds; ++k)
    j[std::string(state_kind_name(StateKind(k)))] = at(t, StateKind(k));
  j["total"] = total(t);
  return j;
}

Placement::OffloadedGradients Placement::offloaded_gradients() const {
  OffloadedGradients g;
  for (const UnitHomes& h : homes)
    if (h.optimizer != Tier::gpu) {
      ++g.units;
      g.on_gpu += h.grad == Tier::gpu ? 1 : 0;
      g.on_nvme += h.grad == Tier::nvme ? 1 : 0;
    }
  return g;
}

bool Placement::offloaded() const {
  return std::any_of(homes.begin(), homes.end(), [](const UnitHomes& h) {
    return h.param != Tier::gpu || h.grad != Tier::gpu || h.optimizer != Tier::gpu;
  });
}

uint64_t Placement::pinned_need() const {
  uint64_t n = pinned_bytes();
  if (request.pin_memory) {
    const TierBytes t = needs();
    // Not the optimizer state: CPU Adam reads it in place and no device copies it (executor).
    n += t.at(Tier::cpu, StateKind::parameters) + t.at(Tier::cpu, StateKind::gradients) +
         t.at(Tier::cpu, StateKind::activations);
  }
  return n;
}

Placement Placement::make(const RunShape& shape, const OffloadRequest& asked,
                          const TierBudgets& budgets) {
  // Without training there is no optimizer state to offload: whatever the config says of it,
  // it stays "gpu" (no bytes), so only the parameters' request matters.
  OffloadRequest request = asked;
  if (!shape.training) request.optimizer = Tier::gpu;
  check_shape(shape, request);
  Placement p;
  p.shape = shape;
  p.request = request;
  const ModelLayout layout = ModelLayout::build(shape.model);
  p.partition =
      Partition::build(layout, shape.ranks, ModelLayout::kAlign, shape.persistence_threshold);
  const Sizes z = sizes_of(shape);
  const int U = p.partition.num_units();
  const bool have_nvme = !request.nvme_paths.empty();
  p.homes.assign(static_cast<size_t>(U), UnitHomes{});
  const auto unit = [&](int u) -> const UnitPartition& { return p.partition.units[size_t(u)]; };

  if (!request.automatic) {
    if ((request.param == Tier::nvme || request.optimizer == Tier::nvme) && !have_nvme)
      fail(
          "offload_{}.device is nvme but no nvme_path is given; add --nvme-path DIR[,DIR...] "
          "(or nvme_path in the config)",
          request.param == Tier::nvme ? "param" : "optimizer");
    // max_in_cpu: how many of each rank's parameter elements stay in host RAM when the
    // parameters' home is NVMe (see placement.h).
    uint64_t in_cpu = 0;
    for (int u = 0; u < U; ++u) {
      UnitHomes& h = p.homes[size_t(u)];
      h.optimizer = request.optimizer;  // h.grad: place_gradients
      h.param = unit(u).replicated ? Tier::gpu : request.param;
      if (h.param != Tier::nvme) continue;
      if (in_cpu + unit(u).shard <= request.max_in_cpu) {
        h.param = Tier::cpu;
        in_cpu += unit(u).shard;
      }
    }
  } else {
    // Fill the fastest tier first, unit by unit in forward order, after what every placement
    // needs: the GPU's working buffers, activations and staging, and (pessimistically, since
    // the homes decide whether they exist) the pinned buffers in host RAM.
    const FixedGpu f = fixed_gpu(shape, p.partition);
    uint64_t gpu = f.working + f.landing + f.activations + f.other;
    // Without training only the parameters have homes: the optimizer counts nothing below
    // (it stays "gpu", holding no bytes) and only parameters move through the buffers.
    const uint64_t moving_bytes = shape.training ? z.os : z.ps;
    uint64_t largest_moving = 0;
    for (const UnitPartition& up : p.partition.units)
      largest_moving = std::max(largest_moving, host_bytes(up, shape.ranks, moving_bytes));
    const uint64_t buffer_bytes = round_up(largest_moving, kPinnedAlignment);
    uint64_t cpu = uint64_t(request.buffer_count) * buffer_bytes +
                   (shape.training ? p.checkpoint_bytes() : 0) + f.host_activations;
    uint64_t stripes = 0, param_in_cpu = 0;
    const uint64_t stripe = request.nvme_stripe;
    const auto nvme_fits = [&](uint64_t more) {
      return have_nvme && nvme_file_bytes(stripes + more, request.nvme_paths.size(), stripe) <=
                              budgets.nvme_free;
    };
    for (const UnitPartition& up : p.partition.units)
      if (up.replicated)  // resident on every GPU: parameters and gradients
        gpu += device_buffer(up.numel * z.ps, z.align) +
               (shape.training ? device_buffer(up.numel * z.gs, z.align) : 0);

    // With tied embeddings the head reads the embedding's table: the two are placed together
    // (the head takes unit 0's homes; cut into vocabulary pieces, each head piece its table
    // piece's) so the pair is fetched from one tier.
    std::vector<std::vector<int>> groups;
    for (int u = 0; u < U; ++u) {
      if (layout.tied_table(u) >= 0) continue;
      groups.push_back({u});
      for (int h = 0; h < U; ++h)
        if (layout.tied_table(h) == u) groups.back().push_back(h);
    }
    // Each tier takes a prefix of the units: once a unit's state misses a tier, later units
    // do not try it, so the units the GPU waits for longest come first in every tier.
    Tier o_floor = Tier::gpu, p_floor = Tier::gpu;
    const auto grads_from = [&](size_t first) {  // host gradient bytes of groups[first..]
      uint64_t b = 0;
      for (size_t i = first; i < groups.size(); ++i)
        for (int u : groups[i]) b += host_bytes(unit(u), shape.ranks, z.gs);
      return b;
    };
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const std::vector<int>& g = groups[gi];
      uint64_t o_gpu = 0, o_cpu = 0, o_stripes = 0, p_gpu = 0, p_cpu = 0, p_elems = 0,
               p_stripes = 0;
      bool any_sharded = false;
      for (int u : g) {
        const UnitPartition& up = unit(u);
        if (shape.training) {
          o_gpu += gpu_optimizer_bytes(up, z);
          if (!up.replicated) o_gpu += device_buffer(up.resident() * z.gs, z.align);
          o_cpu += host_bytes(up, shape.ranks, z.os);
          o_stripes += nvme_stripes(up, shape.ranks, z.os, stripe);
        }
        if (up.replicated) continue;
        any_sharded = true;
        p_gpu += device_buffer(up.resident() * z.ps, z.align);
        p_cpu += host_bytes(up, shape.ranks, z.ps);
        p_elems += up.shard;
        p_stripes += nvme_stripes(up, shape.ranks, z.ps, stripe);
      }
      // Once one unit's optimizer leaves the GPU every later one does (the prefix rule), and
      // their gradient accumulators all come to host RAM: reserve them then, before choosing
      // between host RAM and NVMe for the optimizer.
      const bool gpu_ok =
          !shape.training || (o_floor == Tier::gpu && gpu + o_gpu <= budgets.gpu_memory);
      const uint64_t g_new = !gpu_ok && o_floor == Tier::gpu ? grads_from(gi) : 0;
      Tier o;
      if (gpu_ok) {
        o = Tier::gpu;
        gpu += o_gpu;
      } else if (o_floor != Tier::nvme && cpu + g_new + o_cpu <= budgets.cpu_memory) {
        o = Tier::cpu;
        cpu += g_new + o_cpu;
      } else if (nvme_fits(o_stripes)) {
        o = Tier::nvme;
        stripes += o_stripes;
        cpu += g_new;
      } else {  // fits nowhere: the slowest tier there is; check() will say by how much
        o = have_nvme ? Tier::nvme : Tier::cpu;
        if (o == Tier::nvme) stripes += o_stripes;
        cpu += g_new + (o == Tier::cpu ? o_cpu : 0);
      }
      Tier pt = Tier::gpu;
      if (any_sharded) {
        const bool cpu_allowed =
            request.max_in_cpu == 0 || param_in_cpu + p_elems <= request.max_in_cpu;
        if (p_floor == Tier::gpu && gpu + p_gpu <= budgets.gpu_memory) {
          gpu += p_gpu;
        } else if (p_floor != Tier::nvme && cpu_allowed && cpu + p_cpu <= budgets.cpu_memory) {
          pt = Tier::cpu;
          cpu += p_cpu;
          param_in_cpu += p_elems;
        } else if (nvme_fits(p_stripes)) {
          pt = Tier::nvme;
          stripes += p_stripes;
        } else {
          pt = have_nvme ? Tier::nvme : Tier::cpu;
          if (pt == Tier::nvme) stripes += p_stripes;
        }
      }
      o_floor = std::max(o_floor, o);
      if (any_sharded) p_floor = std::max(p_floor, pt);
      for (int u : g) {
        UnitHomes& h = p.homes[size_t(u)];
        h.optimizer = o;  // h.grad: place_gradients
        h.param = unit(u).replicated ? Tier::gpu : pt;
      }
    }
  }

  place_gradients(p, budgets);
  size_pinned_buffers(p);
  return p;
}

TierBytes Placement::needs() const {
  const Sizes z = sizes_of(shape);
  TierBytes t;
  const FixedGpu f = fixed_gpu(shape, partition);
  const bool param_off_gpu = std::any_of(homes.begin(), homes.end(),
                                         [](const UnitHomes& h) { return h.param != Tier::gpu; });
  t.at(Tier::gpu, StateKind::working) = f.working + (param_off_gpu ? f.landing : 0);
  t.at(Tier::gpu, StateKind::activations) = f.activations;
  t.at(Tier::cpu, StateKind::activations) = f.host_activations;
  t.at(Tier::gpu, StateKind::other) = gpu_staging(shape, partition, homes);
  uint64_t stripes = 0;
  const uint64_t stripe = request.nvme_stripe;
  for (size_t u = 0; u < homes.size(); ++u) {
    const UnitHomes& h = homes[u];
    const UnitPartition& up = partition.units[u];
    switch (h.param) {
      case Tier::gpu:
        t.at(Tier::gpu, StateKind::parameters) += device_buffer(up.resident() * z.ps, z.align);
        break;
      case Tier::cpu:
        t.at(Tier::cpu, StateKind::parameters) += host_bytes(up, shape.ranks, z.ps);
        break;
      case Tier::nvme:
        stripes += nvme_stripes(up, shape.ranks, z.ps, stripe);
        break;
    }
    if (!shape.training) continue;  // parameters only
    // A replicated unit's gradients are all-reduced in place on every GPU, so they stay
    // there even when the optimizer (and a host copy of them) lives on the host.
    if (h.grad == Tier::gpu || up.replicated)
      t.at(Tier::gpu, StateKind::gradients) += device_buffer(up.resident() * z.gs, z.align);
    if (h.grad == Tier::cpu)
      t.at(Tier::cpu, StateKind::gradients) += host_bytes(up, shape.ranks, z.gs);
    if (h.grad == Tier::nvme) stripes += nvme_stripes(up, shape.ranks, z.gs, stripe);
    switch (h.optimizer) {
      case Tier::gpu:
        t.at(Tier::gpu, StateKind::optimizer) += gpu_optimizer_bytes(up, z);
        break;
      case Tier::cpu:
        t.at(Tier::cpu, StateKind::optimizer) += host_bytes(up, shape.ranks, z.os);
        break;
      case Tier::nvme:
        stripes += nvme_stripes(up, shape.ranks, z.os, stripe);
        break;
    }
  }
  if (stripes > 0) {
    // P and G their stripes, O the rest of the rounded total, so the kinds sum to the files.
    const uint64_t total = nvme_file_bytes(stripes, request.nvme_paths.size(), stripe);
    uint64_t p_stripes = 0, g_stripes = 0;
    for (size_t u = 0; u < homes.size(); ++u) {
      if (homes[u].param == Tier::nvme)
        p_stripes += nvme_stripes(partition.units[u], shape.ranks, z.ps, stripe);
      if (shape.training && homes[u].grad == Tier::nvme)
        g_stripes += nvme_stripes(partition.units[u], shape.ranks, z.gs, stripe);
    }
    t.at(Tier::nvme, StateKind::parameters) = p_stripes * stripe;
    t.at(Tier::nvme, StateKind::gradients) = g_stripes * stripe;
    t.at(Tier::nvme, StateKind::optimizer) = total - (p_stripes + g_stripes) * stripe;
  }
  t.at(Tier::cpu, StateKind::buffers) = pinned_bytes();
  if (shape.training) t.at(Tier::cpu, StateKind::checkpoint) = checkpoint_bytes();
  return t;
}

uint64_t Placement::checkpoint_bytes() const {
  uint64_t largest = 0;
  for (const UnitPartition& u : partition.units) largest = std::max(largest, u.padded);
  const uint64_t ps = dtype_size(shape.param_dtype), os = optimizer_state_bytes(shape.optimizer);
  return std::max(2 * os + 2 * ps, 4 + 3 * ps) * largest + AtomicFile::kStagingBytes;
}

void Placement::check(const TierBudgets& budgets) const {
  const TierBytes t = needs();
  struct Row {
    std::string name;
    uint64_t need, have;
    bool limited;
  };
  const uint64_t pinned_have = budgets.pinned_limit;
  const bool pinned_limited = pinned_have != 0 && pinned_have != kUnlimited;
  // The swap store stripes evenly over the paths: each holds its share of the files, and a
  // filesystem holding several paths needs all their shares (one path: the nvme row says it).
  std::string short_paths;
  const uint64_t nvme_need = t.total(Tier::nvme);
  if (nvme_need > 0 && budgets.nvme_paths.size() > 1 &&
      budgets.nvme_paths.size() == std::max<size_t>(request.nvme_paths.size(), 1)) {
    const uint64_t share = nvme_need / budgets.nvme_paths.size();
    std::map<uint64_t, uint64_t> on_filesystem;
    for (const NvmePathSpace& p : budgets.nvme_paths) on_filesystem[p.filesystem] += share;
    std::set<uint64_t> told;
    for (const NvmePathSpace& p : budgets.nvme_paths) {
      const uint64_t need = on_filesystem[p.filesystem];
      if (need <= p.free || !told.insert(p.filesystem).second) continue;
      short_paths += fmt::format(
          "  - nvme path {} is too small: its filesystem has {} free, the swap files need {} "
          "there ({} on each of the {} path(s)); free space on it or name a larger one\n",
          p.path, format_bytes(p.free), format_bytes(need), format_bytes(share),
          budgets.nvme_paths.size());
    }
  }
  const std::vector<Row> rows = {
      {"gpu (per device)", t.total(Tier::gpu), budgets.gpu_memory, true},
      {"cpu", t.total(Tier::cpu), budgets.cpu_memory, true},
      {"nvme", t.total(Tier::nvme), budgets.nvme_free, true},
      {"pinned (ulimit -l)", pinned_need(), pinned_have, pinned_limited},
  };
  bool over = !short_paths.empty();
  for (const Row& r : rows) over |= r.limited && r.need > r.have;
  if (!over) return;

  std::string m = fmt::format(
      "placement does not fit: model {}, {} GPU(s), micro-batch {} x {} tokens; nothing was "
      "allocated\n",
      shape.model.name, shape.ranks, shape.micro_batch, shape.seq_len);
  m += fmt::format("  {:<20} {:>12} {:>12} {:>12}\n", "tier", "needed", "available", "over by");
  for (const Row& r : rows) {
    if (!r.limited) {
      m += fmt::format("  {:<20} {:>12} {:>12} {:>12}\n", r.name, format_bytes(r.need), "unlimited",
                       "-");
      continue;
    }
    m += fmt::format("  {:<20} {:>12} {:>12} {:>12}\n", r.name, format_bytes(r.need),
                     format_bytes(r.have), r.need > r.have ? format_bytes(r.need - r.have) : "-");
  }
  const auto split = [&](Tier tier) {
    std::string s;
    for (int k = 0; k < kStateKinds; ++k) {
      const uint64_t b = t.at(tier, StateKind(k));
      if (b == 0) continue;
      s += fmt::format("{}{} {}", s.empty() ? "" : ", ", state_kind_name(StateKind(k)),
                       format_bytes(b));
    }
    return s;
  };
  const auto any_home = [&](auto pred) { return std::any_of(homes.begin(), homes.end(), pred); };
  const auto opt_on = [&](Tier x) {
    return any_home([x](const UnitHomes& h) { return h.optimizer == x; });
  };
  const auto param_on = [&](Tier x) {
    return any_home([x](const UnitHomes& h) { return h.param == x; });
  };
  if (rows[0].need > rows[0].have) {
    m += fmt::format("gpu, per device: {}\n", split(Tier::gpu));
    if (shape.micro_batch > 1 || t.at(Tier::gpu, StateKind::activations) > rows[0].have / 4)
      m += fmt::format("  - a smaller micro-batch or sequence length (activations take {})\n",
                       format_bytes(t.at(Tier::gpu, StateKind::activations)));
    if (shape.training && shape.recompute && !shape.offload_activations) {
      RunShape off = shape;
      off.offload_activations = true;
      const FixedGpu now = fixed_gpu(shape, partition), then = fixed_gpu(off, partition);
      if (then.activations < now.activations)
        m += fmt::format(
            "  - offload the activation checkpoints to host RAM (--offload-activations cpu, or "
            "activation_checkpointing.cpu_checkpointing true): frees {} per device for {} more "
            "in host RAM, copied out and back once a micro-batch\n",
            format_bytes(now.activations - then.activations), format_bytes(then.host_activations));
    }
    if (shape.training && opt_on(Tier::gpu))
      m += fmt::format(
          "  - offload the optimizer to the CPU (--offload-optimizer cpu, or "
          "offload_optimizer.device \"cpu\"): frees {} per device with its gradients\n",
          format_bytes(t.at(Tier::gpu, StateKind::optimizer) +
                       t.at(Tier::gpu, StateKind::gradients)));
    // Replicated units (norms, below the persistence threshold) stay on the GPU wherever the
    // parameters are offloaded: they are no reason to suggest it.
    bool sharded_on_gpu = false;
    for (size_t u = 0; u < homes.size(); ++u)
      sharded_on_gpu =
          sharded_on_gpu || (homes[u].param == Tier::gpu && !partition.units[u].replicated);
    if (sharded_on_gpu) m += "  - offload the parameters (--offload-param cpu or nvme)\n";
    // Replicated units whose weight counts (over 1% of the GPU): offloading moves them only
    // once they are sharded.
    uint64_t replicated = 0;
    for (const UnitPartition& up : partition.units)
      if (up.replicated) replicated += device_buffer(up.numel * sizes_of(shape).ps, 1);
    if (replicated > rows[0].have / 100)
      m += fmt::format(
          "  - a lower --persistence-threshold (now {} elements): units at or below it stay "
          "whole on every GPU, {} of parameters here, whatever --offload-param says\n",
          partition.persistence_threshold, format_bytes(replicated));
    // Every working buffer is sized to the largest unit (often the embedding): say so, with
    // what one takes, where fewer of them are possible (tied embeddings need two).
    const int fewest = shape.model.tie_word_embeddings ? 2 : 1;
    if (shape.working_buffers > fewest) {
      const UnitPartition* largest = nullptr;
      for (const UnitPartition& up : partition.units)
        if (!up.replicated && (largest == nullptr || up.padded > largest->padded)) largest = &up;
      const uint64_t each =
          t.at(Tier::gpu, StateKind::working) / static_cast<uint64_t>(shape.working_buffers);
      const auto n = static_cast<double>(largest != nullptr ? largest->numel : 0);
      const std::string count = n >= 1e9   ? fmt::format("{:.2f}B", n / 1e9)
                                : n >= 1e6 ? fmt::format("{:.1f}M", n / 1e6)
                                           : fmt::format("{}", n);
      m += fmt::format(
          "  - a smaller --prefetch-depth (now {}: {} working buffers, each sized to the largest "
          "unit{}, about {}; fewer overlap less of the fetches with compute)\n",
          shape.working_buffers - 1, shape.working_buffers,
          largest != nullptr ? fmt::format(" ({}, {} parameters)", largest->name, count) : "",
          format_bytes(each));
    }
    // f32 gradients beside 16-bit parameters: the working buffers' gradients and the GPU-homed
    // accumulators halve in the parameters' dtype.
    if (shape.training && shape.grad_dtype == DType::f32 && shape.param_dtype != DType::f32) {
      const Sizes z = sizes_of(shape);
      const uint64_t grads = static_cast<uint64_t>(shape.working_buffers) *
                                 device_buffer(partition.max_gathered_numel() * z.gs, z.align) +
                             t.at(Tier::gpu, StateKind::gradients);
      if (grads > rows[0].have / 8)
        m += fmt::format(
            "  - {} gradients (--grad-dtype {}, or data_types.grad_accum_dtype in the DeepSpeed "
            "config): the f32 ones take {} here, working buffers and accumulators; for runs "
            "that accumulate little\n",
            dtype_name(shape.param_dtype), dtype_name(shape.param_dtype), format_bytes(grads));
    }
    m += "  - more GPUs (--gpus in plan, --devices in train and eval), or a larger "
         "--gpu-memory / --device-memory if the GPUs have it\n";
  }
  if (rows[1].need > rows[1].have) {
    m += fmt::format("cpu: {}\n", split(Tier::cpu));
    if (opt_on(Tier::cpu))
      m += "  - offload the optimizer to NVMe (--offload-optimizer nvme --nvme-path DIR)\n";
    if (param_on(Tier::cpu))
      m += "  - offload the parameters to NVMe (--offload-param nvme --nvme-path DIR)\n";
    // Gradient accumulators in host RAM: often most of it with the optimizer on NVMe, which
    // neither hint above moves.
    const uint64_t cpu_grads = t.at(Tier::cpu, StateKind::gradients);
    if (shape.training && cpu_grads > 0 && shape.grad_dtype == DType::f32 &&
        shape.param_dtype != DType::f32)
      m += fmt::format(
          "  - {} gradients (--grad-dtype {}, or data_types.grad_accum_dtype in the DeepSpeed "
          "config): the f32 accumulators take {} of it, and would take half; for runs that "
          "accumulate little\n",
          dtype_name(shape.param_dtype), dtype_name(shape.param_dtype), format_bytes(cpu_grads));
    if (shape.training && cpu_grads > 0)
      m += fmt::format(
          "  - sum the gradients on NVMe (--offload-gradients nvme{}), as ZeRO-Infinity swaps "
          "them: up to {} less here, for their traffic to the drives every micro-batch\n",
          request.nvme_paths.empty() ? " --nvme-path DIR" : "", format_bytes(cpu_grads));
    if (shape.training && cpu_grads > 0 && request.grads == GradHome::cpu)
      m += fmt::format(
          "  - keep the gradients on the GPUs where they fit (--offload-gradients auto): {} of "
          "accumulators are in host RAM because --offload-gradients cpu puts them there\n",
          format_bytes(cpu_grads));
    if (const uint64_t a = t.at(Tier::cpu, StateKind::activations); a > 0)
      m += fmt::format(
          "  - keep the activation checkpoints on the GPUs (--offload-activations none): they "
          "take {} here\n",
          format_bytes(a));
    if (pinned_buffers > 0)
      m += fmt::format("  - fewer or smaller pinned buffers (buffer_count {}, {} each)\n",
                       request.buffer_count, format_bytes(pinned_buffer_bytes));
    m += "  - raise --cpu-memory if the machine has more RAM free\n";
  }
  if (rows[2].need > rows[2].have || !short_paths.empty()) {
    std::string paths;
    for (const std::string& p : request.nvme_paths) paths += (paths.empty() ? "" : ", ") + p;
    m += fmt::format("nvme ({}): {}\n", paths, split(Tier::nvme));
    m += short_paths;
    m += "  - add nvme paths on other drives (--nvme-path a,b) or free space on them\n";
    m += "  - keep more in host RAM (offload_param.device cpu, or a larger max_in_cpu)\n";
  }
  if (pinned_limited && rows[3].need > rows[3].have) {
    m +=
        fmt::format("pinned: {} of buffers{}\n", format_bytes(pinned_bytes()),
                    request.pin_memory ? " plus the cpu-homed parameters, gradients and activation "
                                         "checkpoints (pin_memory true)"
                                       : "");
    m += "  - raise the pinned-memory limit (--pinned-memory, at most ulimit -l; memlock in "
         "/etc/security/limits.conf)\n";
    if (request.pin_memory) m += "  - set pin_memory false to pin only the buffers\n";
    m += "  - a smaller buffer_count\n";
  }
  if (!m.empty() && m.back() == '\n') m.pop_back();
  throw Error(m);
}

std::string Placement::str() const {
  std::string s = fmt::format(
      "placement: model {}, {} GPU(s), micro-batch {} x {} tokens, parameters {}, gradients "
      "{}, {} units ({} replicated){}\n",
      shape.model.name, shape.ranks, shape.micro_batch, shape.seq_len,
      dtype_name(shape.param_dtype), dtype_name(shape.grad_dtype), homes.size(),
      std::count_if(partition.units.begin(), partition.units.end(),
                    [](const UnitPartition& u) { return u.replicated; }),
      request.automatic ? ", chosen automatically" : "");
  const ModelLayout layout = ModelLayout::build(shape.model);
  if (layout.vocab_pieces > 1 && layout.tied)
    s += fmt::format(
        "  the tied embedding table in {} vocabulary pieces of {} rows (--vocab-pieces), each "
        "read by a piece of the head too\n",
        layout.vocab_pieces, layout.units.front().vocab_rows);
  else if (layout.vocab_pieces > 1)
    s += fmt::format(
        "  the embedding and the head each in {} vocabulary pieces of {} rows (--vocab-pieces)\n",
        layout.vocab_pieces, layout.units.front().vocab_rows);
  s += fmt::format("  {:<22} {:<6} {:<6} {:<9}\n", "units", "param", "grad", "optimizer");
  for (size_t b = 0; b < homes.size();) {
    size_t e = b + 1;
    while (e < homes.size() && homes[e].param == homes[b].param && homes[e].grad == homes[b].grad &&
           homes[e].optimizer == homes[b].optimizer)
      ++e;
    const std::string units = e - b == 1 ? partition.units[b].name
                                         : fmt::format("{} .. {} ({})", partition.units[b].name,
                                                       partition.units[e - 1].name, e - b);
    s += fmt::format("  {:<22} {:<6} {:<6} {:<9}\n", units, tier_name(homes[b].param),
                     tier_name(homes[b].grad), tier_name(homes[b].optimizer));
    b = e;
  }
  if (const int n = offloaded_checkpoints(shape.model, checkpoint_slots(shape)); n > 0)
    s += fmt::format(
        "  activation checkpoints: the inputs of blocks 0..{} in host RAM, copied out after the "
        "forward and back before the backward; the GPU keeps a ring of {}\n",
        n - 1, checkpoint_slots(shape));
  const TierBytes t = needs();
  s += fmt::format("  {:<12} {:>16} {:>12} {:>12}\n", "memory", "gpu (per device)", "cpu", "nvme");
  for (int k = 0; k < kStateKinds; ++k) {
    const StateKind kind = StateKind(k);
    s += fmt::format("  {:<12} {:>16} {:>12} {:>12}\n", state_kind_name(kind),
                     format_bytes(t.at(Tier::gpu, kind)), format_bytes(t.at(Tier::cpu, kind)),
                     format_bytes(t.at(Tier::nvme, kind)));
  }
  s += fmt::format("  {:<12} {:>16} {:>12} {:>12}\n", "total", format_bytes(t.total(Tier::gpu)),
                   format_bytes(t.total(Tier::cpu)), format_bytes(t.total(Tier::nvme)));
  if (pinned_buffers > 0)
    s += fmt::format(
        "  pinned buffers: {} x {} = {} (one unit in flight each){}\n", pinned_buffers,
        format_bytes(pinned_buffer_bytes), format_bytes(pinned_bytes()),
        request.pin_memory
            ? fmt::format("; {} page-locked with the cpu-homed P and G{}",
                          format_bytes(pinned_need()),
                          shape.offload_activations ? " and the activation checkpoints" : "")
            : std::string());
  else
    s += "  pinned buffers: none (nothing is offloaded)\n";
  return s;
}

std::vector<NvmePathSpace> nvme_path_space(const std::vector<std::string>& paths) {
  std::vector<NvmePathSpace> out;
  for (const std::string& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0)
      fail(
          "nvme path {}: does not exist; create it or name another directory (strata plan sizes "
          "drives this machine does not have with --nvme DRIVESxSIZE)",
          p);
    if (!S_ISDIR(st.st_mode))
      fail("nvme path {}: is not a directory; name the directory the swap files go in", p);
    if (::access(p.c_str(), W_OK | X_OK) != 0)
      fail(
          "nvme path {}: not writable ({}); the swap files cannot be created there, make it "
          "writable or name another directory",
          p, errno_text(errno));
    std::error_code ec;
    const auto space = std::filesystem::space(p, ec);
    if (ec)
      fail(
          "nvme path {}: free space unknown ({}); name another directory, or plan with --nvme SIZE",
          p, ec.message());
    out.push_back({p, static_cast<uint64_t>(st.st_dev), space.available});
  }
  return out;
}

uint64_t nvme_free_space(const std::vector<std::string>& paths) {
  std::set<uint64_t> seen;
  uint64_t free = 0;
  for (const NvmePathSpace& p : nvme_path_space(paths))
    if (seen.insert(p.filesystem).second) free += p.free;
  return free;
}

TierBudgets local_budgets(uint64_t device_memory, const std::vector<std::string>& nvme_paths,
                          uint64_t cpu_memory) {
  TierBudgets b;
  b.gpu_memory = device_memory;
  b.cpu_memory =
      cpu_memory > 0 ? cpu_memory : uint64_t(double(memory_info().available) * kSafeRamFraction);
  b.pinned_limit = can_lock_past_limit() ? kUnlimited : memlock_limit();
  b.nvme_paths = nvme_path_space(nvme_paths);
  std::set<uint64_t> seen;
  for (const NvmePathSpace& p : b.nvme_paths)
    if (seen.insert(p.filesystem).second) b.nvme_free += p.free;
  return b;
}

Placement place_locally(const RunShape& shape, const OffloadRequest& request,
                        uint64_t device_memory, uint64_t cpu_memory, uint64_t pinned_memory,
                        TierBudgets* budgets_out) {
  // Only a request that can put something on NVMe needs its paths: a DeepSpeed config may name
  // one for a tier this run keeps elsewhere (the optimizer's, say, for an evaluation), and that
  // directory is then neither created nor budgeted.
  const bool nvme =
      request.automatic || request.param == Tier::nvme ||
      (shape.training && (request.optimizer == Tier::nvme || request.grads == GradHome::nvme));
  const std::vector<std::string> paths = nvme ? request.nvme_paths : std::vector<std::string>{};
  for (const std::string& p : paths) {
    std::error_code ec;
    if (std::filesystem::exists(p, ec) && !std::filesystem::is_directory(p, ec))
      fail(
          "nvme path {}: is a {}, not a directory; name a directory for the swap files with "
          "--nvme-path (a missing one is created)",
          p, std::filesystem::is_regular_file(p, ec) ? "file" : "special file");
    std::filesystem::create_directories(p, ec);
    if (ec)
      fail("nvme path {}: cannot create it: {}; name a writable directory with --nvme-path", p,
           ec.message());
  }
  TierBudgets budgets = local_budgets(device_memory, paths, cpu_memory);
  if (pinned_memory > 0 && (budgets.pinned_limit == 0 || pinned_memory < budgets.pinned_limit))
    budgets.pinned_limit = pinned_memory;
  const Placement placement = Placement::make(shape, request, budgets);
  placement.check(budgets);
  if (budgets_out != nullptr) *budgets_out = std::move(budgets);
  return placement;
}

}  // namespace strata
