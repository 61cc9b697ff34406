// measure.cpp: times each lane's work with the code the executor runs (see measure.h).
#include "schedule/measure.h"

#include "core/device.h"
#include "core/error.h"
#include "core/pinned_pool.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "model/llama.h"
#include "model/weights.h"
#include "nvme/swap_store.h"
#include "partition/communicator.h"
#include "schedule/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

namespace strata {
namespace {

// Median seconds of `repeats` calls of f after one warm-up call.
double median_seconds(int repeats, const std::function<void()>& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < std::max(repeats, 1); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Rate of `work` per second, or 0 when nothing could be timed.
double rate(double work, double seconds) {
  return seconds > 0 ? work / seconds : 0.0;
}

void measure_compute(const MeasureSetup& s, HardwareProfile& h) {
  Device& d = *s.devices.front();
  LlamaConfig c = s.model;
  if (s.compute_layers > 0) c.num_hidden_layers = std::min(c.num_hidden_layers, s.compute_layers);
  ModelOptions o;
  o.param_dtype = s.param_dtype;
  o.grad_dtype = s.grad_dtype;
  o.max_batch = s.micro_batch;
  o.seq_len = s.seq_len;
  LlamaModel model(c, o, d);
  ResidentWeights w(model.layout(), d, s.param_dtype, s.grad_dtype, true);
  auto st = d.create_stream("measure compute");
  w.init_random(1, *st);
  w.zero_grads(*st);
  const int64_t n = s.micro_batch * s.seq_len;
  std::vector<int32_t> ids(static_cast<size_t>(n)), targets(ids.size());
  for (int64_t i = 0; i < n; ++i) {
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % c.vocab_size);
    targets[static_cast<size_t>(i)] = static_cast<int32_t>((i * 104729 + 5) % c.vocab_size);
  }
  DeviceBuffer di(d, static_cast<uint64_t>(n) * 4, "measure ids"),
      dt(d, static_cast<uint64_t>(n) * 4, "measure targets");
  d.copy_to_device(di.data(), ids.data(), di.bytes(), *st);
  d.copy_to_device(dt.data(), targets.data(), dt.bytes(), *st);
  const auto* pi = static_cast<const int32_t*>(di.data());
  const auto* pt = static_cast<const int32_t*>(dt.data());
  const double seconds = median_seconds(s.repeats, [&] {
    model.forward(w.units(), pi, pt, s.micro_batch, true, *st);
    model.backward(w.units(), pi, pt, s.micro_batch, 1.0f / static_cast<float>(n), *st);
    st->synchronize();
  });
  // What the schedule counts for this work: every unit's forward once, and its backward
  // (recompute + backward) at three times that.
  double flops = 0;
  for (int u = 0; u < model.layout().num_units(); ++u)
    flops += 4.0 * unit_forward_flops(c, u, s.micro_batch, s.seq_len);
  h.gpu_flops = rate(flops, seconds);
}

void measure_copies(const MeasureSetup& s, HardwareProfile& h) {
  Device& d = *s.devices.front();
  PinnedPoolOptions po;
  po.capacity = s.transfer_bytes;
  po.cuda = d.backend() == Backend::cuda;
  PinnedPool pool(po);
  void* host = pool.allocate(s.transfer_bytes, "measure copy");
  std::fill_n(static_cast<char*>(host), s.transfer_bytes, char(1));
  DeviceBuffer dev(d, s.transfer_bytes, "measure copy");
  auto st = d.create_stream("measure copies");
  const auto b = static_cast<double>(s.transfer_bytes);
  h.h2d_bytes_per_s = rate(b, median_seconds(s.repeats, [&] {
                             d.copy_to_device(dev.data(), host, s.transfer_bytes, *st);
                             st->synchronize();
                           }));
  h.d2h_bytes_per_s = rate(b, median_seconds(s.repeats, [&] {
                             d.copy_to_host(host, dev.data(), s.transfer_bytes, *st);
                             st->synchronize();
                           }));
  // The fixed cost of one task: a small copy queued and waited for.
  h.task_latency_s = median_seconds(std::max(s.repeats, 50), [&] {
    d.copy_to_host(host, dev.data(), 256, *st);
    st->synchronize();
  });
  pool.release(host);
}

void measure_comm(const MeasureSetup& s, HardwareProfile& h) {
  const int R = static_cast<int>(s.devices.size());
  if (R < 2 || s.comm == nullptr) return;
  const uint64_t count = std::max<uint64_t>(s.transfer_bytes / 4 / uint64_t(R), 1);
  std::vector<DeviceBuffer> send, recv;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Stream*> sp;
  std::vector<TensorView> sv, rv;
  for (Device* d : s.devices) {
    send.emplace_back(*d, count * 4, "measure all-gather");
    recv.emplace_back(*d, count * 4 * uint64_t(R), "measure all-gather");
    streams.push_back(d->create_stream("measure comm"));
    sp.push_back(streams.back().get());
    d->fill_zero(send.back().data(), count * 4, *sp.back());
    sv.push_back(send.back().view(DType::f32, {static_cast<int64_t>(count)}));
    rv.push_back(recv.back().view(DType::f32, {static_cast<int64_t>(count) * R}));
  }
  // The schedule's unit: what one rank moves in a ring, (R - 1) / R of the gathered bytes.
  const double bytes = static_cast<double>(count * 4) * (R - 1);
  h.comm_bytes_per_s = rate(bytes, median_seconds(s.repeats, [&] {
                              s.comm->all_gather(sv, rv, sp);
                              for (Stream* x : sp) x->synchronize();
                            }));
}

void measure_adam(const MeasureSetup& s, HardwareProfile& h) {
  const size_t n = s.adam_elements;
  const size_t gsize = dtype_size(s.grad_dtype);
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<char> grad(n * gsize, 0);
  std::vector<char> copy(n * dtype_size(s.param_dtype), 0);
  CpuAdamOptions ao;
  ao.threads = s.cpu_adam_threads;
  CpuAdam adam(ao);
  const GradShard g{grad.data(), s.grad_dtype, n};
  const AdamShard shard{master.data(), m.data(), v.data(), n};
  std::optional<ParamCopy> pc;
  if (s.param_dtype != DType::f32) pc = ParamCopy{copy.data(), s.param_dtype};
  AdamParams p;
  int64_t step = 0;
  h.adam_elements_per_s = rate(double(n), median_seconds(s.repeats, [&] {
                                 adam.update(shard, g, ++step, p, 1.0f, GradStats{}, pc);
                               }));
  h.stats_elements_per_s =
      rate(double(n), median_seconds(s.repeats, [&] { (void)adam.grad_stats(g); }));
}

void measure_device_adam(const MeasureSetup& s, HardwareProfile& h) {
  Device& d = *s.devices.front();
  const auto n = static_cast<int64_t>(s.adam_elements);
  std::vector<DeviceBuffer> b;
  auto st = d.create_stream("measure device adam");
  for (const char* what : {"master", "m", "v"}) {
    b.emplace_back(d, uint64_t(n) * 4, fmt::format("measure {}", what));
    d.fill_zero(b.back().data(), uint64_t(n) * 4, *st);
  }
  DeviceBuffer grad(d, uint64_t(n) * dtype_size(s.grad_dtype), "measure gradient");
  d.fill_zero(grad.data(), grad.bytes(), *st);
  DeviceBuffer copy;
  TensorView cv;
  if (s.param_dtype != DType::f32) {
    copy = DeviceBuffer(d, uint64_t(n) * dtype_size(s.param_dtype), "measure copy");
    cv = copy.view(s.param_dtype, {n});
  }
  auto f32 = [&](size_t i) { return b[i].view(DType::f32, {n}); };
  int64_t step = 0;
  h.gpu_adam_elements_per_s = rate(
      double(n), median_seconds(s.repeats, [&] {
        const cpu_adam::StepConstants k = cpu_adam::step_constants(++step, AdamParams{}, 1.0f);
        d.kernels().adam_update(f32(0), f32(1), f32(2), grad.view(s.grad_dtype, {n}), cv, k, *st);
        st->synchronize();
      }));
}

void measure_nvme(const MeasureSetup& s, HardwareProfile& h) {
  if (s.nvme_paths.empty()) return;
  const uint64_t bytes = (s.transfer_bytes + 4095) / 4096 * 4096;
  PinnedPoolOptions po;
  po.capacity = bytes;
  po.cuda = s.devices.front()->backend() == Backend::cuda;
  PinnedPool pool(po);
  char* buf = static_cast<char*>(pool.allocate(bytes, "measure nvme"));
  for (uint64_t i = 0; i < bytes; ++i) buf[i] = static_cast<char>(i * 131 + 7);
  nvme::SwapStoreOptions so;
  so.paths = s.nvme_paths;
  so.stripe = s.nvme_stripe;
  so.capacity = (bytes + s.nvme_stripe - 1) / s.nvme_stripe * s.nvme_stripe;
  so.io = s.io;
  nvme::SwapStore store(so);
  store.add_shard("measure", bytes);
  const auto b = static_cast<double>(bytes);
  h.nvme_write_bytes_per_s =
      rate(b, median_seconds(s.repeats, [&] { store.write("measure", buf); }));
  h.nvme_read_bytes_per_s = rate(b, median_seconds(s.repeats, [&] { store.read("measure", buf); }));
  pool.release(buf);
}

}  // namespace

HardwareProfile measure_hardware(const MeasureSetup& setup) {
  if (setup.devices.empty()) fail("measure: no devices given; name some with --devices");
  HardwareProfile h;
  h.name = fmt::format("measured on {} ({} rank(s))", setup.devices.front()->name(),
                       setup.devices.size());
  const std::pair<const char*, void (*)(const MeasureSetup&, HardwareProfile&)> steps[] = {
      {"compute (the model's forward and backward)", measure_compute},
      {"host<->device copies", measure_copies},
      {"all-gather", measure_comm},
      {"CPU Adam", measure_adam},
      {"Adam on the device", measure_device_adam},
      {"NVMe swap store", measure_nvme},
  };
  for (const auto& [what, f] : steps) {
    try {
      f(setup, h);
    } catch (const Error& e) {
      fail("measuring {} failed: {}", what, e.what());
    }
  }
  return h;
}

}  // namespace strata
