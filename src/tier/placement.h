// placement.h: where each unit's state lives (DESIGN §2), and whether that fits.
//
// For every unit u a placement names the home tier of the parameter shards P[u][r], the
// gradient accumulator shards G[u][r] and the optimizer shards O[u][r] (fp32 master, m, v).
// Homes come from DeepSpeed's semantics (offload_param.device / offload_optimizer.device:
// none | cpu | nvme) or, with `auto`, from filling the fastest tier first within each tier's
// budget, unit by unit in forward order. Gradient accumulators live on the GPU when the
// optimizer does. When it does not, they stay on the GPU too where there is room (GradHome):
// the micro-batches accumulate there, and the optimizer brings each unit's sum to the host
// once per step, instead of every micro-batch's gradients crossing PCIe into host RAM (as
// DeepSpeed's offload does, and GradHome::cpu asks for). Replicated units (below the
// persistence threshold) keep their parameters and gradients on the GPU.
//
// A placement also sizes what moving state needs: the pinned buffers that carry shards
// between NVMe, host and GPU (one pool, allocated once) and the GPU working buffers. needs()
// counts every byte per tier and per kind of state; check() compares that with the budgets
// and, when something does not fit, throws an Error holding a table of bytes needed versus
// available per tier, before anything is allocated. Plain data: `strata plan`, `strata
// estimate`, the schedule builder, the executor and the tests all read it.
#pragma once

#include "core/optimizer.h"
#include "model/config.h"
#include "partition/partition.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class Tier { gpu, cpu, nvme };
inline constexpr int kTiers = 3;
std::string_view tier_name(Tier t);  // "gpu", "cpu", "nvme"
// "none" and "gpu" name the GPU tier (DeepSpeed's "none": not offloaded), "cpu", "nvme".
// Throws Error naming the text and the accepted values.
Tier parse_tier(std::string_view text);

// What a byte of a tier holds (the rows of `strata plan`'s memory table).
enum class StateKind {
  parameters,   // P shards (bf16/fp16, or f32 in an fp32 run), replicated units whole
  gradients,    // G shards (the gradient accumulators)
  optimizer,    // O shards: fp32 master, m, v
  working,      // GPU: gathered units and their working gradients
  activations,  // GPU: activation checkpoints and the model's scratch; host RAM: the
                // checkpoints offloaded there (RunShape::offload_activations)
  buffers,      // pinned host buffers: staging between NVMe, host and GPU
  checkpoint,   // host RAM: one unit's state at a time on its way to or from a checkpoint
  other,        // communication staging, library reserves
};
inline constexpr int kStateKinds = 8;
std::string_view state_kind_name(StateKind k);

// Where the gradient accumulators of a unit whose optimizer is off the GPU live.
//   automatic: on the GPU while the GPU budget and the pinned buffers allow (units in forward
//              order), else in host RAM;
//   gpu:       on the GPU (check() refuses it when the GPU cannot hold them);
//   cpu:       in host RAM, each micro-batch's gradients brought down and added there;
//   nvme:      on NVMe, as ZeRO-Infinity swaps them beside the optimizer state: each
//              micro-batch's gradients come down into a pinned buffer and are written to the
//              swap store (the first of a step) or added to what is read back from it (the
//              later ones), and CPU Adam reads the step's sum back from it. Replicated units
//              (a few KB each) keep theirs in host RAM.
// On the GPU (or NVMe) the optimizer of a unit holds one more pinned buffer (its gradients,
// brought down or read back for CPU Adam); a unit whose optimizer would then need more
// pinned buffers than buffer_count keeps them in host RAM (`gpu`: an Error).
// With `automatic`, where host RAM then cannot hold the run (its budget, TierBudgets::
// cpu_memory) and there are nvme paths, the accumulators of the last units in forward order
// that have them in host RAM go to NVMe, as many as it takes.
enum class GradHome { automatic, gpu, cpu, nvme };
std::string_view grad_home_name(GradHome g);  // "auto", "gpu", "cpu", "nvme"
// "auto", "gpu" (or "none": not offloaded), "cpu", "nvme"; an Error names the text and the
// choices.
GradHome parse_grad_home(std::string_view text);

// What the user asked for: DeepSpeed's zero_optimization keys, or flags.
struct OffloadRequest {
  bool automatic = false;      // `auto`: fastest tier first within budgets
  Tier param = Tier::gpu;      // offload_param.device
  Tier optimizer = Tier::gpu;  // offload_optimizer.device
  uint64_t max_in_cpu = 0;     // offload_param.max_in_cpu (elements); 0: no limit
  int buffer_count = 5;        // offload_param.buffer_count / offload_optimizer.buffer_count
  bool pin_memory = true;      // offload_*.pin_memory
  std::vector<std::string> nvme_paths;   // offload_*.nvme_path, one per drive
  uint64_t nvme_stripe = 1ull << 20;     // the swap store's stripe (aio.block_size)
  unsigned nvme_queue_depth = 32;        // the swap store's requests in flight (aio.queue_depth)
  GradHome grads = GradHome::automatic;  // gradients under an offloaded optimizer (above)
};
// max_in_cpu, as DeepSpeed means it: with offload_param.device nvme, units in forward order
// keep their parameter shards in host RAM while each rank's shards of them stay within
// max_in_cpu elements (0: none; padding included), the rest go to NVMe, as DeepSpeed keeps
// each rank's first max_in_cpu partition elements in CPU memory; device cpu ignores it, as
// DeepSpeed does. With `auto` it caps the parameters placed in host RAM (0: no cap).
//
// Pinned buffers: with anything off the GPU there are buffer_count of them, one per unit in
// flight between tiers. A buffer carries a whole unit's transfer, every rank's shard of it
// (the schedule reads P[u] from NVMe and streams O[u] through CPU Adam for all ranks at
// once), so each is the largest such transfer: P (param dtype) or O (master+m+v) over all
// ranks (each rank's shard starting on a 4 KiB page, so the swap store moves it in place with
// O_DIRECT), G over all ranks (grad dtype; gradients kept on the GPU on their way to CPU
// Adam, or staged for accumulation in host RAM), rounded up to 4 KiB.
// DeepSpeed's buffer_size is not acted on: the executor moves a unit's transfer whole, never in
// pieces.

// One nvme path of this machine: the swap store stripes evenly over the paths, so each must
// have room for its share (paths on one filesystem share its free space).
struct NvmePathSpace {
  std::string path;
  uint64_t filesystem = 0;  // st_dev
  uint64_t free = 0;        // the filesystem's free bytes
};

// What each tier can hold. GPU figures are per device; NVMe is the free space over all paths.
struct TierBudgets {
  uint64_t gpu_memory = 0;    // per device
  uint64_t cpu_memory = 0;    // host RAM the run may use (`--cpu-memory`)
  uint64_t pinned_limit = 0;  // page-locked bytes allowed (`ulimit -l`, or a cap); 0: none
  uint64_t nvme_free = 0;     // over all nvme_paths
  // Per path, in the request's order, when the paths are this machine's (empty when sized by
  // `--nvme`): check() then also refuses a path too small for its share.
  std::vector<NvmePathSpace> nvme_paths;
};

// Host RAM a run may use by default: the rest of what /proc/meminfo calls available is left to
// the OS, the page cache and the data loader.
inline constexpr double kSafeRamFraction = 0.8;

// Free bytes over the nvme paths, each filesystem counted once (two paths on one drive do not
// double its space). An Error names a path that does not exist, is not a directory, is not
// writable, or whose space is unknown.
uint64_t nvme_free_space(const std::vector<std::string>& paths);
// The same checks, and each path's filesystem and its free bytes.
std::vector<NvmePathSpace> nvme_path_space(const std::vector<std::string>& paths);

// This machine's budgets for a run on devices of `device_memory` each: host RAM `cpu_memory`
// (0: kSafeRamFraction of what is available), the pinned limit (`ulimit -l`, unlimited with
// CAP_IPC_LOCK), and nvme_free_space of the paths (0 without paths) with each path's space.
TierBudgets local_budgets(uint64_t device_memory, const std::vector<std::string>& nvme_paths,
                          uint64_t cpu_memory = 0);

// The shape of the work a placement is sized for.
struct RunShape {
  LlamaConfig model;
  int ranks = 1;                    // local GPUs (or host devices)
  DType param_dtype = DType::bf16;  // f32 for an fp32 run
  DType grad_dtype = DType::f32;    // accumulators
  // The optimizer, which decides the bytes of its state (core/optimizer.h: 12 an element for
  // Adam, 8 for Lion and Adagrad).
  OptimizerType optimizer = OptimizerType::adam;
  int64_t micro_batch = 1;  // sequences per rank per micro-batch
  int64_t seq_len = 0;
  uint64_t persistence_threshold = 100000;  // elements
  int working_buffers = 2;                  // gathered units per GPU (prefetch depth + 1)
  uint64_t device_alignment = 256;          // device arenas round every buffer up to this
  // Activation checkpointing: backward recomputes each block (ModelOptions::recompute). Off,
  // every block keeps its activations on the GPU, a third fewer FLOPs for more memory.
  bool recompute = true;
  // Micro-batches run unit by unit (Schedule's micro-batch groups): each unit is fetched and
  // gathered once for the group's forwards and once for its backwards, and the GPU keeps the
  // activations (and the gradients flowing between units) of every micro-batch of the group.
  int micro_batch_group = 1;
  // Activation checkpoints in host RAM (DeepSpeed's activation_checkpointing.cpu_checkpointing,
  // ZeRO-Infinity's activation offload): each block's input is copied to the host after the
  // forward that writes it and back before the block's backward, so the GPU keeps a ring of
  // checkpoint_slots() of them per micro-batch of a group instead of one per layer. Training
  // with recompute only.
  bool offload_activations = false;
  // False: parameters only, for evaluation (`strata eval`, forward-only schedules): no gradient
  // accumulators, no optimizer state, no working gradients or reduce-scatter staging, and no
  // activation gradients, and the model's activations are a forward-only model's
  // (ModelOptions::forward_only: two activation slots, no backward scratch). The homes' grad
  // and optimizer are then meaningless (left gpu) and count no bytes; only the parameters are
  // placed, and the pinned buffers carry them alone.
  bool training = true;
  // Generation (training off, one sequence of micro_batch 1): each rank's model keeps a KV
  // cache of seq_len positions (ModelOptions::kv_cache), counted with the activations.
  bool kv_cache = false;
};

// Gathered working buffers per GPU for a prefetch depth: the unit in use and `depth` ahead, and
// at least two with tied embeddings (the head reuses unit 0 while the last block is gathered).
inline int working_buffers_for(int prefetch_depth, bool tied_embeddings) {
  return std::max(prefetch_depth + 1, tied_embeddings ? 2 : 1);
}

// The ring of activation checkpoints each GPU keeps (ModelOptions::checkpoint_slots) when they
// are offloaded: as many as the working buffers (prefetch depth + 1), at least 2, so each
// block's input comes back from the host as far ahead of its backward as the parameters do;
// 0 (one slot per unit) otherwise.
inline int checkpoint_slots(const RunShape& s) {
  return s.offload_activations && s.training ? std::max(s.working_buffers, 2) : 0;
}

// Bytes of one micro-batch's activations [micro_batch x seq_len, hidden] in the parameters'
// dtype: a unit's input (one activation checkpoint), or the gradient flowing between units.
inline uint64_t activation_bytes(const RunShape& s) {
  return static_cast<uint64_t>(s.micro_batch * s.seq_len * s.model.hidden_size) *
         dtype_size(s.param_dtype);
}

struct UnitHomes {
  Tier param = Tier::gpu;
  Tier grad = Tier::gpu;
  Tier optimizer = Tier::gpu;
};

// Pinned buffers the optimizer of a unit with homes `h` holds at once (Schedule::build's
// rule): O read from NVMe, the updated P on its way to the GPU or NVMe (to NVMe only, with O on
// the GPU), and the gradients brought down from the GPU for CPU Adam.
int optimizer_pinned_buffers(const UnitHomes& h);

// Bytes per tier per kind; gpu figures are per device, cpu and nvme for the whole node.
struct TierBytes {
  std::array<std::array<uint64_t, kStateKinds>, kTiers> bytes{};
  uint64_t& at(Tier t, StateKind k) { return bytes[int(t)][int(k)]; }
  uint64_t at(Tier t, StateKind k) const { return bytes[int(t)][int(k)]; }
  uint64_t total(Tier t) const;
  // One tier's bytes per kind ("parameters", ..., "other") and "total", for --json output.
  nlohmann::json to_json(Tier t) const;
};

struct Placement {
  RunShape shape;
  Partition partition;
  OffloadRequest request;
  std::vector<UnitHomes> homes;  // one per unit, in the layout's order

  // Pinned host buffers: `pinned_buffers` buffers of `pinned_buffer_bytes` each, carved from
  // one PinnedPool, carrying shards NVMe <-> host <-> GPU.
  int pinned_buffers = 0;
  uint64_t pinned_buffer_bytes = 0;

  // Builds the homes and sizes the buffers. Throws Error for an impossible request (NVMe
  // without nvme_paths, buffer_count < 1, ...), naming the setting and its value. Does not
  // check budgets (check() does) except that `automatic` (and GradHome::automatic) read them
  // to choose.
  static Placement make(const RunShape& shape, const OffloadRequest& request,
                        const TierBudgets& budgets);

  // Exact bytes per tier and kind, as the allocations round them. GPU, per device:
  // parameters (gpu-homed shards; replicated units whole), gradients (gpu-homed G),
  // optimizer (gpu-homed O: master, m, v as three f32 buffers), working (working_buffers ×
  // (the largest gathered unit in param dtype, but for one rank, which uses units where they
  // lie + the largest unit's working gradient in grad dtype), plus working_buffers landing
  // buffers of the largest shard when some P lives off the GPU), activations
  // (LlamaModel::workspace_bytes_for + the two activation gradients ZeroRunner passes between
  // units), other (with several ranks, a shard of gradients for the executor's transfers of G
  // homed off the GPU and one for ZeroModel's adds into GPU-homed G; one rank stages none).
  // CPU (node):
  // cpu-homed P, G, O of every rank (a replicated unit's once), each shard rounded up to a
  // 4 KiB page as the pinned pool hands it out, the pinned buffers, and for training the
  // checkpoint's staging (checkpoint_bytes()).
  // NVMe: nvme-homed P, G and O of every rank, one swap-store shard per (unit, rank, kind),
  // each rounded up to the stripe, the total to whole stripes on every path.
  TierBytes needs() const;
  // Host RAM a training run holds while it writes a checkpoint or resumes from one, one unit
  // at a time, the largest at most: resuming, its optimizer state as read (f32 master and
  // moments: os, 12 bytes an element for Adam), its parameters staged in their dtype (ps), and
  // the executor's block of shards written behind to the GPU or NVMe (os + ps); writing, less:
  // the state of one unit written from where it lies and of the next read from NVMe (os + os),
  // or the parameters (as f32, in their dtype, and two blocks of shards: 4 + 3 ps). And the
  // writer's staging chunks (AtomicFile::kStagingBytes). Counted in needs() so that a run that
  // fills host RAM leaves room for its first checkpoint rather than failing at it.
  uint64_t checkpoint_bytes() const;
  // Bytes of the pinned buffers, and whether any state lives off the GPU.
  uint64_t pinned_bytes() const { return uint64_t(pinned_buffers) * pinned_buffer_bytes; }
  bool offloaded() const;
  // The units whose optimizer is off the GPU, and how many of them keep their gradients there.
  struct OffloadedGradients {
    int units = 0, on_gpu = 0, on_nvme = 0;  // the rest in host RAM
  };
  OffloadedGradients offloaded_gradients() const;
  // Page-locked bytes the run needs: the buffers, plus, when pin_memory, the cpu-homed
  // parameters and gradient accumulators (devices copy them in place). Optimizer state is never
  // page-locked: only CPU Adam reads it.
  uint64_t pinned_need() const;
  // Throws Error when a tier's need exceeds its budget: the message holds the table of
  // needed versus available bytes per tier (and per kind for the tiers that overflow) and
  // what to change (a smaller micro-batch, offloading to the next tier, more memory).
  void check(const TierBudgets& budgets) const;

  // The homes per unit and the memory table, for logs and `strata plan`.
  std::string str() const;
};

// A run of `shape` on this machine's devices of `device_memory` each, placed and checked
// before anything is allocated: the nvme paths are created when the request can place
// something on NVMe (an Error names one that is not a directory or cannot be made), the budgets are
// local_budgets' (`cpu_memory` 0: the default share of RAM; `pinned_memory` > 0 lowers the pinned
// limit to it), and Placement::make's result is check()ed, so a run that does not fit is refused
// with the table of bytes. `budgets`, when given, receives the budgets used. `strata train` and
// `strata eval` place their runs this way.
Placement place_locally(const RunShape& shape, const OffloadRequest& request,
                        uint64_t device_memory, uint64_t cpu_memory, uint64_t pinned_memory,
                        TierBudgets* budgets = nullptr);

}  // namespace strata
