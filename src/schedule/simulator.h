// simulator.h: predicts a step from its schedule and a hardware profile (DESIGN §1).
//
// Every task takes a time derived from its work and the profile: transfers and collectives
// bytes / bandwidth (+ a fixed latency), compute FLOPs / the GPU's rate, Adam and grad stats
// elements / the CPU's rate. Lanes run their tasks in schedule order; a task starts when its
// lane is free and its dependencies (this step's, and `prev` ones of the previous step) are
// done; a group starts on all its lanes at once. The simulator runs several steps back to back
// so the cross-step overlap reaches its steady state, and reports the last one. The NVMe lanes
// share the drives (the executor runs them at once, each on its own ring of one swap store
// over every nvme path), modelled as one drive timeline: a task of length L on nvme.read or
// nvme.write runs from the earliest time t at or after it is ready such that the drives have
// a free gap of L / nvme_mixed within [t, t + L), which it then takes. With nvme_mixed 1 the
// task holds the drives for all of its length, so they are busy for the sum of both lanes'
// bytes over their rates; with 2, a read and a write of equal length run side by side. On the
// host backend (host_cpu_mixed > 0) the device lanes and cpu.adam share the host's cores the
// same way, on a timeline of their own: a group (a collective, one call) takes it once.
#pragma once

#include "schedule/schedule.h"
#include "schedule/trace.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace strata {

// One nvme path measured alone (the swap store over that path only).
struct NvmePathRate {
  std::string path;
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
  bool direct = false;  // O_DIRECT was taken; false: through the page cache (not the drive's speed)
};

// Measured or assumed rates of one machine (`strata tune` writes it; JSON on disk).
struct HardwareProfile {
  std::string name = "assumed";
  double gpu_flops = 0;                // achieved matmul FLOP/s of one GPU (or host device)
  double h2d_bytes_per_s = 0;          // pinned host -> one GPU
  double d2h_bytes_per_s = 0;          // one GPU -> pinned host
  double comm_bytes_per_s = 0;         // per-rank collective bandwidth (bus bandwidth)
  double adam_elements_per_s = 0;      // CPU Adam update, all optimizer threads
  double stats_elements_per_s = 0;     // CPU grad stats (norm), all threads
  double gpu_adam_elements_per_s = 0;  // Adam on the GPU (optimizer not offloaded)
  double nvme_read_bytes_per_s = 0;    // over all nvme_paths together
  double nvme_write_bytes_per_s = 0;
  double task_latency_s = 0;  // fixed cost added to every task
  // How the drives serve reads and writes at once (the executor's two NVMe lanes do): their
  // read and write rates then, as fractions of the rates alone, add up to this. 1 (the default,
  // and what a profile without the key means): one direction at a time, the sum of both
  // lanes' bytes over their rates. 2: each direction at its full rate beside the other (a
  // full-duplex link, or a throttle with a budget per direction). Measured by strata tune and
  // strata bench step; optional in the JSON ("nvme_mixed"), from 1 to 2.
  double nvme_mixed = 1;
  // A copy within one device's memory (copy_on_device), bytes per second: what a collective
  // of one rank does (the unit into its working buffer, its gradients into their shard).
  // Optional in the JSON ("device_copy_bytes_per_s"); 0, or a profile without the key, counts
  // such a copy free (task_latency_s only): on a GPU it is a few hundred times faster than the
  // links that set the step's pace.
  double device_copy_bytes_per_s = 0;
  // Whether the device lanes run on the host's cores, and how the cores serve two lanes at
  // once. 0 (the default, and what a profile without the key means): they do not (a GPU
  // computes and its copy engines copy while the CPU runs Adam). From 1 to 2: they do
  // (strata's host backend): every task on a device lane or on cpu.adam holds the cores for
  // its length / host_cpu_mixed within its span, as the NVMe tasks hold the drives: 1, one at
  // a time (each lane's work already uses every core, as BLAS and CPU Adam do); 2, two side by
  // side at full speed. Measured on host devices by timing the model's compute and CPU Adam at
  // once. Optional in the JSON ("host_cpu_mixed").
  double host_cpu_mixed = 0;
  // The gradient statistics pass on a device (the kernel table's grad_chunk_sums, plus copying
  // its chunk sums to the host), elements per second: it reads the gradient once where Adam
  // reads and writes four arrays, so it runs several times faster. Optional in the JSON
  // ("gpu_stats_elements_per_s"); 0, or a profile without the key, times it at
  // gpu_adam_elements_per_s, an upper bound.
  double gpu_stats_elements_per_s = 0;
  // A reduce-scatter's per-rank bandwidth, in the same unit as comm_bytes_per_s (the
  // all-gather's): (R-1)/R of each rank's input bytes per second. It moves what an all-gather
  // moves and adds it too: on the host backend, where a peer's chunk is staged and then added,
  // two host devices on the 2-core dev VM reduce-scatter at 1.5 GB/s and all-gather at 5.7.
  // The schedule's all-reduces of replicated units go at it as well. Optional in the JSON
  // ("reduce_bytes_per_s"); 0, or a profile without the key, times them at comm_bytes_per_s.
  double reduce_bytes_per_s = 0;
  // The fixed cost of one swap-store call (a shard's read or write), seconds, beside bytes over
  // nvme_*_bytes_per_s: an NVMe task of b bytes takes latency + b / rate. Measured by fitting
  // that line to sustained transfers of two sizes (strata tune, strata bench step), where the
  // rates are then the line's slope. It matters where units are small (a few MB: on the dev
  // VM's virtio disk a 470 KB read took 1.0 ms where its sustained rate gave 0.6); a 70B
  // model's units of ~1.7 GB hide it. Optional in the JSON ("nvme_read_latency_s",
  // "nvme_write_latency_s"); 0, or a profile without the keys, counts bytes / rate alone.
  double nvme_read_latency_s = 0;
  double nvme_write_latency_s = 0;

  // Optional, what `strata tune` records beside the rates (the simulator reads none of it):
  // per rate, how it was obtained ("measured: ...", "assumed: ...") or why it is 0
  // ("absent: ..."); the swap store settings the nvme rates were measured with (aio.block_size
  // and aio.queue_depth; 0: not recorded); and each nvme path measured alone.
  std::map<std::string, std::string> notes;
  uint64_t nvme_block_size = 0;
  unsigned nvme_queue_depth = 0;
  std::vector<NvmePathRate> nvme_paths;

  // Reads / writes the JSON form: an object whose keys are the rates above (`name` may be
  // left out), and optionally "notes" (an object of strings keyed by rate) and "nvme"
  // ({"block_size", "queue_depth", "paths": [{"path", "read_bytes_per_s",
  // "write_bytes_per_s", "direct"}]}). Throws Error naming the file and the JSON path of a
  // missing, non-numeric, negative or non-finite value, or of a key it does not know. A rate
  // of 0 means "not measured": simulate() refuses a schedule that needs it.
  static HardwareProfile load(const std::string& path);
  static HardwareProfile from_json_text(const std::string& text, const std::string& where);
  std::string to_json() const;
};

struct LaneTime {
  std::string lane;
  double busy_s = 0;  // time its tasks took within the step
};

struct Prediction {
  double step_s = 0;            // steady-state step time
  std::vector<LaneTime> lanes;  // per lane, in the schedule's order
  int critical_lane = -1;       // the busiest lane
  double nvme_busy_s = 0;       // the drives' busy time (the NVMe lanes' union)
  double overlap = 0;           // max(busiest lane's busy time, nvme_busy_s) / step time
  // Start and end of each task of the reported step, relative to its start (the earliest
  // start among its tasks), indexed by task id (for traces).
  std::vector<double> start_s, end_s;
  // Every simulated step, in absolute seconds from the first task's start: what
  // check_timeline() and trace_json() read.
  Timeline timeline;
};

// Duration of one task of a schedule over `ranks` ranks under `profile`.
// `optimizer_cost`: Schedule::optimizer_cost, which scales an adam task's elements.
double task_seconds(const Task& task, const Lane& lane, int ranks, const HardwareProfile& profile,
                    double optimizer_cost = 1.0);

// Throws Error when the profile lacks a rate some task needs (naming the field), or steps < 1.
// With one step, step_s is that step's length; with more, the last step's end minus the one
// before's (the steady state, with the next step's early work overlapping the optimizer).
Prediction simulate(const Schedule& schedule, const HardwareProfile& profile, int steps = 3);

}  // namespace strata
