// measure.h: a HardwareProfile measured on this machine (what `strata tune` writes and `strata
// bench step` predicts from).
//
// Each rate is timed with the code the executor runs for that lane, at sizes like the run's:
// the model's own forward and backward (recompute included) on the first device for
// gpu_flops, so the rate is what the kernel table achieves at this shape, not a matmul peak;
// Device copies from the pinned pool for h2d/d2h, and within the device for one-rank
// collectives; the communicator's all-gather for comm;
// CpuAdam's fused update and statistics pass for the CPU lanes; the kernel table's
// adam_update and grad_chunk_sums for Adam and its statistics pass on a device; the SwapStore
// (striped, checksummed, io_uring) for NVMe; and for the fixed cost of a task, a small copy
// queued and waited for by one thread that then wakes another to do the same, as the executor's
// lanes hand each other work. On host devices the model's compute and CPU Adam are also run at
// once, for how the cores serve two lanes (host_cpu_mixed), and the task cost is measured again
// beside the model's compute, since there the lanes' threads wait for busy cores. Each figure is
// the median of `repeats` timings after one warm-up, except NVMe's, which are sustained rates (see
// nvme_min_seconds). The copies and CPU Adam cycle through buffers that together exceed the
// last-level cache twice, so that, as in a step, their data comes from memory rather than a cache.
// Nothing measured here is checked for speed: a rate that cannot be measured (no nvme paths, one
// rank) is left 0, which simulate() refuses only for a schedule that needs it.
//
// Every figure is verified before it is returned, as the benches do: the timed forward's loss
// is finite and near ln(vocab) (a randomly initialised model's) and its gradients finite; the
// copies' bytes come back as they were sent; the all-gather's output is every rank's input in
// rank order; CPU Adam's step equals the scalar path bit for bit at 4,096 spread elements; the
// device's adam_update equals CpuAdam bit for bit, and its chunk sums add up to CpuAdam's
// grad_stats bit for bit; every NVMe byte read equals the byte
// written. A wrong result is an Error naming it, never a speed. The profile's notes say how
// each rate was obtained, or why it is 0.
#pragma once

#include "model/config.h"
#include "nvme/io_ring.h"
#include "schedule/simulator.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace strata {

class Communicator;
class Device;

struct MeasureSetup {
  std::vector<Device*> devices;  // the ranks; the first one is timed for compute and copies
  Communicator* comm = nullptr;  // over `devices`; the all-gather rate needs two ranks or more
  LlamaConfig model;             // the model whose forward/backward calibrates gpu_flops
  int64_t micro_batch = 1;
  int64_t seq_len = 128;
  DType param_dtype = DType::f32;
  DType grad_dtype = DType::f32;
  // Layers of the model run for gpu_flops: 0 for all of them. A model too big for the first
  // device is cut to fewer layers (the per-layer rate does not depend on the count).
  int64_t compute_layers = 0;
  bool recompute = true;                // the run's activation checkpointing (RunShape::recompute)
  std::vector<std::string> nvme_paths;  // none: nvme rates stay 0
  uint64_t nvme_stripe = 64 * 1024;
  nvme::IoOptions io;
  uint64_t transfer_bytes = 64ull << 20;  // per copy, all-gather and NVMe transfer
  uint64_t adam_elements = 1ull << 22;    // per CPU Adam / device Adam timing
  int cpu_adam_threads = 0;               // as the executor's
  int repeats = 5;
  // NVMe: the (stripe, queue depth) pairs to time over all paths together; the pair whose read
  // plus write of transfer_bytes takes least is kept, and recorded in the profile
  // (nvme_block_size, nvme_queue_depth). Empty: nvme_stripe and io.queue_depth alone.
  std::vector<std::pair<uint64_t, unsigned>> nvme_settings;
  // Also time each path alone at the kept setting (HardwareProfile::nvme_paths).
  bool nvme_per_path = false;
  // Each NVMe direction is timed as a run of back-to-back transfers (at least `repeats`) lasting
  // at least this long, its rate the bytes over the run's time: what a drive sustains, which
  // is what a step's traffic sees. A few short transfers alone can catch a drive's write cache
  // or a throttle's burst allowance and read several times too fast (on a loop device
  // throttled to 300 MB/s, 5 transfers of 3 MiB read 2.6 GB/s).
  double nvme_min_seconds = 0.5;
  // What the compute figure's model is, for the profile's note ("" : the model's name).
  std::string compute_note;
};

// Throws Error naming the measurement that failed (a device too small for the transfer, an
// NVMe path that cannot hold it, ...).
HardwareProfile measure_hardware(const MeasureSetup& setup);

}  // namespace strata
