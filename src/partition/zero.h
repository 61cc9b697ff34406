// zero.h: ZeRO-3 model state over the local devices, and data-parallel forward/backward on it
// (DESIGN §2-§3).
//
// ZeroModel holds, for every unit u and rank r, the parameter shard P[u][r] (param dtype) and
// the gradient accumulator shard G[u][r] (grad dtype), in device r's memory, laid out by a
// Partition. Replicated units (below the persistence threshold) are held whole on every rank.
// A unit is used through a working buffer: gather() all-gathers the unit's full parameters
// into one of a small, fixed pool of working buffers on every rank; release() hands it back;
// reduce_scatter_grads() adds the working gradients, summed over ranks, into the shards. With
// one rank a shard is the whole unit, so gather() copies nothing: the unit is used where it
// lies (its resident shard, or the caller's buffer), and the pool's working buffers hold
// gradients alone. For a 7B model's 0.5B-parameter embedding that is 1 GiB less of the GPU
// per working buffer in bf16.
//
// Ordering. Every call queues its part for rank r on streams[r] (nothing blocks). Work that
// uses a gathered buffer must be queued on those streams, or wait for them. release(u,
// streams) takes the streams that last used the buffer: it records an event there, and the
// next gather() into the same buffer waits for it (and for every rank's part of the last
// reduce-scatter out of it, as peers read the buffer).
//
// ZeroRunner drives a LlamaModel per rank (each with its own activations) over the units in
// the order of DESIGN §3: forward unit by unit (gather, forward, release), then backward in
// reverse (gather, backward, reduce-scatter, release). With tied embeddings the head reads
// the embedding's table, so unit 0 is gathered beside the head, and in backward it stays
// gathered from the head to the embedding, whose gradients are then reduce-scattered once.
// Cut into vocabulary pieces, head piece k reads embedding piece k (ModelLayout::table_unit),
// gathered beside it; in backward the table's gradients are reduce-scattered after the head
// piece's backward and again after the embedding piece's own, so no piece stays gathered
// across the blocks (the accumulated gradients are the sum of both reductions).
#pragma once

#include "core/device.h"
#include "model/llama.h"
#include "partition/communicator.h"
#include "partition/partition.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace strata {

class SafetensorsReader;

struct ZeroOptions {
  DType param_dtype = DType::f32;
  DType grad_dtype = DType::f32;
  bool with_grads = true;                         // false: parameters only (eval)
  uint64_t align_elements = ModelLayout::kAlign;  // every shard a multiple of this
  // DeepSpeed's stage3_param_persistence_threshold and its default, in elements.
  uint64_t persistence_threshold = 100000;
  // Working buffers per rank: the unit in use and one prefetched (two are needed with tied
  // embeddings: the head and the embedding at once).
  int working_buffers = 2;
  // Per unit, whether its parameter shards P[u][r] and gradient shards G[u][r] live in device
  // memory (empty: every unit's do). A unit whose parameters live elsewhere (host RAM, NVMe)
  // has no resident shard: gather() takes each rank's shard from the caller (a device staging
  // buffer the step executor filled). A unit whose gradients live elsewhere has no resident
  // G: reduce_scatter_grads() writes the summed shard into the caller's buffer (overwriting),
  // and the executor copies it to the host. Replicated units must keep both resident.
  std::vector<bool> param_resident, grad_resident;
};

class ZeroModel {
 public:
  // Allocates every shard, the working buffers and the reduce-scatter staging on the
  // communicator's devices; contents are undefined until init_random() or load(). Throws
  // Error naming the device and the kind of state that does not fit.
  ZeroModel(const ModelLayout& layout, Communicator& comm, const ZeroOptions& options);
  ~ZeroModel();
  ZeroModel(const ZeroModel&) = delete;
  ZeroModel& operator=(const ZeroModel&) = delete;

  int ranks() const { return partition_.ranks; }
  Device& device(int rank) const { return comm_.device(rank); }
  Communicator& communicator() const { return comm_; }
  const ModelLayout& layout() const { return layout_; }
  const Partition& partition() const { return partition_; }
  const ZeroOptions& options() const { return options_; }

  // ---- model state, synchronously (each rank copies only its slice; one unit is staged on
  // the host at a time) ----
  void init_random(uint64_t seed);  // init_unit_random's bits, as ResidentWeights
  // Every tensor from a checkpoint, checked as ResidentWeights::load checks it.
  void load(const SafetensorsReader& reader);
  // Throws Error naming a tensor of `reader` that is no part of this model (load's first check).
  void check_tensor_names(const SafetensorsReader& reader) const;
  // Unit u's padded parameters in param dtype (host memory, the whole unit) to every rank's
  // resident shard; nothing for a unit whose parameters are not resident (their home's owner
  // sets them). For a caller that stages each unit once for every home, as the executor does.
  void scatter_staged(int u, const std::vector<char>& staged);
  // Replaces unit u's parameters with `values` (f32, the layout's numel), converted.
  void upload_unit(int u, const std::vector<float>& values);
  void zero_grads();
  // Zeroes rank r's resident gradients of unit u, queued on `stream` (no-op when unit u's
  // gradients are not resident or the state has none).
  void zero_grad(int u, int r, Stream& stream);
  // Unit u's parameters (or accumulated gradients) assembled from the shards, as f32, the
  // layout's numel. Replicated units must hold the same bits on every rank (else Error).
  std::vector<float> download_unit(int u, bool grad) const;

  bool param_resident(int u) const;
  bool grad_resident(int u) const;

  // Rank r's resident shard of unit u (the whole unit when replicated), for the optimizer.
  // Throws Error for a unit whose parameters (gradients) are not resident.
  TensorView param_shard(int u, int rank) const;
  TensorView grad_shard(int u, int rank) const;

  // ---- gather / release / reduce-scatter, queued on streams[r] for each rank r ----
  // Unit u's full parameters on every rank (replicated units: the resident copy). With
  // for_backward, the unit also gets a zeroed working gradient buffer (a replicated unit: one
  // of its own, outside the pool). Returns one UnitBuffers per rank. Throws Error when u is
  // already gathered or, for a sharded unit, no working buffer of the pool is free (naming
  // the units that hold them). `shards` (one per rank, param dtype, the unit's
  // shard length, on that rank's device) is where the shards come from when the unit's
  // parameters are not resident, and must be empty otherwise. With one rank the returned
  // parameters are the resident shard or shards[0] itself: neither may change until release().
  std::vector<UnitBuffers> gather(int u, const std::vector<Stream*>& streams,
                                  bool for_backward = false,
                                  const std::vector<TensorView>& shards = {});
  // Returns unit u's working buffer once the work queued so far on `streams` is done.
  void release(int u, const std::vector<Stream*>& streams);
  // G[u][r] += chunk r of the sum over ranks of the working gradients (replicated units: the
  // whole all-reduced sum). Needs gather(u, ..., for_backward = true). For a unit whose
  // gradients are not resident, `out` (one per rank, grad dtype, the shard length, on that
  // rank's device) receives chunk r of the sum instead (overwritten); else it must be empty.
  void reduce_scatter_grads(int u, const std::vector<Stream*>& streams,
                            const std::vector<TensorView>& out = {});
  // Zeroes unit u's working gradients on every rank (queued on streams[r]), for the next
  // backward of a unit that stays gathered; queue it after the reduce-scatter that read them.
  void clear_working_grads(int u, const std::vector<Stream*>& streams);
  bool gathered(int u) const;
  int free_working_buffers() const;  // of the pool

 private:
  struct Slot;
  struct Rank;
  int take_slot(int u);
  void check_unit(int u, const char* what) const;
  void check_streams(const std::vector<Stream*>& streams, const char* what) const;
  void synchronize_setup() const;

  ModelLayout layout_;
  Communicator& comm_;
  ZeroOptions options_;
  Partition partition_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<std::unique_ptr<Slot>> slots_;  // the pool, then one per replicated unit
  std::vector<int> rep_slot_;                 // per unit: its own slot, or -1
  struct UnitState {
    bool gathered = false;
    bool for_backward = false;
    int slot = -1;  // working buffer, or -1 (a replicated unit gathered for forward)
  };
  std::vector<UnitState> state_;
};

// One rank's micro-batch: `batch` sequences of ids and targets (int32, batch × seq_len each)
// in that rank's device memory. batch == 0: the rank computes nothing but still takes part
// in every collective.
struct RankBatch {
  const int32_t* ids = nullptr;
  const int32_t* targets = nullptr;
  int64_t batch = 0;
};

class ZeroRunner {
 public:
  // models[r] runs on zero.device(r), with zero's parameter and gradient dtypes; allocates
  // the activation gradients flowing between units (two [max_batch × seq_len, hidden] per
  // rank).
  ZeroRunner(ZeroModel& zero, const std::vector<LlamaModel*>& models);

  // Forward of every unit on every rank; rank r's per-token losses land in
  // models[r]->losses(batches[r].batch), and every unit's input is kept for backward().
  void forward(const std::vector<RankBatch>& batches, const std::vector<Stream*>& streams);
  // Backward after forward() of the same batches: gradients of loss_scale × (sum of every
  // rank's per-token losses) are added to the gradient shards. For the mean over all ranks'
  // tokens pass 1 / (non-ignored targets summed over the ranks).
  void backward(const std::vector<RankBatch>& batches, float loss_scale,
                const std::vector<Stream*>& streams);

 private:
  void check(const std::vector<RankBatch>& batches, const std::vector<Stream*>& streams) const;
  void gather(int u, const std::vector<Stream*>& streams, bool for_backward);
  void release(int u, const std::vector<Stream*>& streams);

  ZeroModel& zero_;
  std::vector<LlamaModel*> models_;
  bool tied_ = false;
  std::vector<std::vector<UnitBuffers>> views_;  // [rank][unit]: gathered buffers, else empty
  std::vector<DeviceBuffer> grad_a_, grad_b_;    // per rank
};

}  // namespace strata
