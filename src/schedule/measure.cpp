// measure.cpp: times each lane's work with the code the executor runs, and verifies what it
// timed (see measure.h).
#include "schedule/measure.h"

#include "core/bytes.h"
#include "core/device.h"
#include "core/error.h"
#include "core/pinned_pool.h"
#include "core/system.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "model/llama.h"
#include "model/weights.h"
#include "nvme/swap_store.h"
#include "partition/communicator.h"
#include "schedule/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include <unistd.h>

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

// Bytes per second of back-to-back calls of f, each moving `bytes`, after one warm-up call:
// at least `repeats` calls and at least `min_seconds`, the total over the elapsed time.
double sustained_rate(int repeats, double min_seconds, uint64_t bytes,
                      const std::function<void()>& f) {
  f();
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  uint64_t calls = 0;
  while (calls < uint64_t(std::max(repeats, 1)) || elapsed < min_seconds) {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return elapsed > 0 ? double(calls) * double(bytes) / elapsed : 0.0;
}

// Rate of `work` per second, or 0 when nothing could be timed.
double rate(double work, double seconds) {
  return seconds > 0 ? work / seconds : 0.0;
}

// A value in [-0.5, 0.5) from an index hash: the same on every run, never subnormal.
float hashed(size_t i, uint64_t salt) {
  uint64_t x = (i + salt) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return static_cast<float>(x & 0xffffff) / 16777216.0f - 0.5f;
}

// The byte pattern copies and NVMe transfers carry: position-dependent, so a block landing in
// the wrong place shows.
char pattern_byte(uint64_t i) {
  return static_cast<char>((i * 131 + 7) ^ (i >> 12));
}
void fill_pattern(char* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) p[i] = pattern_byte(i);
}
// The first byte that differs from the pattern, or n.
uint64_t pattern_mismatch(const char* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i)
    if (p[i] != pattern_byte(i)) return i;
  return n;
}

std::string repeats_note(const MeasureSetup& s) {
  return fmt::format("median of {} after a warm-up", std::max(s.repeats, 1));
}

// The model's forward and backward (recompute included unless the run turns it off) on the
// first device, as the executor runs them: what gpu_flops is timed on.
struct ComputeRun {
  // On the setup's device `device` (the first by default).
  explicit ComputeRun(const MeasureSetup& s, size_t device = 0)
      : d(*s.devices.at(device)),
        c(cut(s)),
        model(c, options(s), d),
        w(model.layout(), d, s.param_dtype, s.grad_dtype, true),
        st(d.create_stream("measure compute")),
        batch(s.micro_batch),
        n(s.micro_batch * s.seq_len),
        ids(d, static_cast<uint64_t>(n) * 4, "measure ids"),
        targets(d, static_cast<uint64_t>(n) * 4, "measure targets") {
    w.init_random(1, *st);
    w.zero_grads(*st);
    std::vector<int32_t> hi(static_cast<size_t>(n)), ht(hi.size());
    for (int64_t i = 0; i < n; ++i) {
      hi[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % c.vocab_size);
      ht[static_cast<size_t>(i)] = static_cast<int32_t>((i * 104729 + 5) % c.vocab_size);
    }
    d.copy_to_device(ids.data(), hi.data(), ids.bytes(), *st);
    d.copy_to_device(targets.data(), ht.data(), targets.bytes(), *st);
    st->synchronize();
  }

  // One forward and backward, waited for.
  void operator()() {
    const auto* pi = static_cast<const int32_t*>(ids.data());
    const auto* pt = static_cast<const int32_t*>(targets.data());
    model.forward(w.units(), pi, pt, batch, true, *st);
    model.backward(w.units(), pi, pt, batch, 1.0f / static_cast<float>(n), *st);
    st->synchronize();
  }

  // The last forward's mean loss, checked: a randomly initialised model's is near ln(vocab)
  // (its logits are small). `what` names the timing in the error.
  double checked_loss(const char* what) {
    std::vector<float> losses(static_cast<size_t>(n));
    d.copy_to_host(losses.data(), model.losses(batch).data, losses.size() * 4, *st);
    st->synchronize();
    double mean = 0;
    for (float x : losses) mean += x;
    mean /= static_cast<double>(n);
    const double expect = std::log(static_cast<double>(c.vocab_size));
    if (!std::isfinite(mean) || mean < 0.5 * expect || mean > 1.5 * expect)
      fail(
          "{}: the timed forward's mean loss is {} on {}, but a randomly initialised model gives "
          "about ln({}) = {:.3f}; the kernels are wrong on this device (run strata bench model), "
          "so no rate is reported",
          what, mean, d.name(), c.vocab_size, expect);
    return mean;
  }

  Device& d;
  const LlamaConfig c;
  LlamaModel model;
  ResidentWeights w;
  std::unique_ptr<Stream> st;
  const int64_t batch, n;
  DeviceBuffer ids, targets;

  static LlamaConfig cut(const MeasureSetup& s) {
    LlamaConfig m = s.model;
    if (s.compute_layers > 0) m.num_hidden_layers = std::min(m.num_hidden_layers, s.compute_layers);
    return m;
  }
  static ModelOptions options(const MeasureSetup& s) {
    ModelOptions o;
    o.param_dtype = s.param_dtype;
    o.grad_dtype = s.grad_dtype;
    o.max_batch = s.micro_batch;
    o.seq_len = s.seq_len;
    o.recompute = s.recompute;
    return o;
  }
};

void measure_compute(const MeasureSetup& s, HardwareProfile& h) {
  ComputeRun run(s);
  Device& d = run.d;
  const LlamaConfig& c = run.c;
  LlamaModel& model = run.model;
  ResidentWeights& w = run.w;
  Stream* st = run.st.get();
  const double seconds = median_seconds(s.repeats, [&] { run(); });

  // Verify the work timed: the loss, and the gradients of its smallest unit with parameters
  // (not a tied head's later vocabulary pieces, padding alone) finite and not all zero.
  const double mean = run.checked_loss("compute alone");
  const double expect = std::log(static_cast<double>(c.vocab_size));
  const std::vector<UnitLayout>& units = model.layout().units;
  int smallest = -1;
  for (int u = 0; u < model.layout().num_units(); ++u)
    if (!units[size_t(u)].params.empty() &&
        (smallest < 0 || units[size_t(u)].numel < units[size_t(smallest)].numel))
      smallest = u;
  const std::vector<float> g = w.download(smallest, true, *st);
  const bool finite = std::all_of(g.begin(), g.end(), [](float x) { return std::isfinite(x); });
  const bool nonzero = std::any_of(g.begin(), g.end(), [](float x) { return x != 0.0f; });
  if (!finite || !nonzero)
    fail("the timed backward left {} gradients in unit {} on {}; no rate is reported",
         finite ? "all-zero" : "non-finite", model.layout().units[size_t(smallest)].name, d.name());

  // What the schedule counts for this work: every unit's forward and backward tasks.
  double flops = 0;
  for (int u = 0; u < model.layout().num_units(); ++u)
    flops += unit_forward_flops(c, model.layout().units[size_t(u)], s.micro_batch, s.seq_len) +
             unit_backward_flops(c, model.layout().units[size_t(u)], s.micro_batch, s.seq_len,
                                 s.recompute);
  h.gpu_flops = rate(flops, seconds);
  h.notes["gpu_flops"] = fmt::format(
      "measured on {}: forward + backward ({}) of {} ({} layer(s), hidden {}, "
      "vocab {}), {} x {} tokens, {}, {}; verified: loss {:.3f} ~ ln(vocab) {:.3f}, finite "
      "gradients",
      d.name(), s.recompute ? "recompute included" : "activations kept, no recompute",
      s.compute_note.empty() ? c.name : s.compute_note, c.num_hidden_layers, c.hidden_size,
      c.vocab_size, s.micro_batch, s.seq_len, dtype_name(s.param_dtype), repeats_note(s), mean,
      expect);
}

// Calls made and seconds taken by one side of side_by_side().
struct SideRun {
  uint64_t calls = 0;
  double seconds = 0;
};

// Runs `a` and `b` on two threads at once, each again and again until `seconds` have passed
// and it has made at least `min_calls` calls; an exception from either is rethrown once both
// have stopped.
std::pair<SideRun, SideRun> side_by_side(double seconds, uint64_t min_calls,
                                         const std::function<void()>& a,
                                         const std::function<void()>& b) {
  std::atomic<bool> stop{false};
  SideRun ra, rb;
  std::exception_ptr ea, eb;
  auto run = [&](SideRun& side, std::exception_ptr& error, const std::function<void()>& f) {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      while (!stop.load() || side.calls < min_calls) {
        f();
        ++side.calls;
      }
      side.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } catch (...) {
      error = std::current_exception();
    }
  };
  std::thread ta(run, std::ref(ra), std::ref(ea), std::cref(a));
  std::thread tb(run, std::ref(rb), std::ref(eb), std::cref(b));
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  ta.join();
  tb.join();
  for (const std::exception_ptr& e : {ea, eb})
    if (e) std::rethrow_exception(e);
  return {ra, rb};
}

// The memory a timing cycles through so that its data comes from memory rather than a cache,
// as a step's does (it streams every unit's state): twice the last-level cache, within
// [64 MiB, 256 MiB]. A copy or an Adam over one 3 MiB buffer, timed again and again, runs in
// the L3 cache several times faster than the step's traffic ever does.
uint64_t cold_bytes() {
  long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const uint64_t cache = llc > 0 ? static_cast<uint64_t>(llc) : (32ull << 20);
  return std::clamp<uint64_t>(2 * cache, 64ull << 20, 256ull << 20);
}

// How many buffers of `bytes` a timing rotates through: enough for cold_bytes(), at most 64.
size_t cold_sets(uint64_t bytes) {
  const uint64_t n =
      (cold_bytes() + std::max<uint64_t>(bytes, 1) - 1) / std::max<uint64_t>(bytes, 1);
  return static_cast<size_t>(std::clamp<uint64_t>(n, 1, 64));
}

// Median seconds of `repeats` calls of f(i) after one warm-up call, i cycling through
// 0..sets-1 so that each call touches memory the previous ones did not.
double median_rotating(int repeats, size_t sets, const std::function<void(size_t)>& f) {
  size_t i = 0;
  return median_seconds(repeats, [&] { f(i++ % sets); });
}

// The fixed cost of one task as the executor pays it, seconds per hop: one lane's thread
// queues a 256-byte copy from `dev` to `host` and waits for it, then hands the turn to another
// lane's thread (a condition variable, as the executor's lanes release each other's tasks),
// which does the same on its own stream, `hops` times in all. `host` holds 512 bytes.
double hop_seconds(Device& d, char* host, const void* dev, int hops) {
  auto s0 = d.create_stream("measure task latency 0");
  auto s1 = d.create_stream("measure task latency 1");
  std::mutex m;
  std::condition_variable cv;
  int turn = 0;  // hops done; even: the first thread's turn
  auto lane = [&](int parity, Stream& on) {
    for (int i = parity; i < hops; i += 2) {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return turn == i; });
      lock.unlock();
      d.copy_to_host(host + 256 * parity, dev, 256, on);
      on.synchronize();
      lock.lock();
      ++turn;
      cv.notify_all();
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::thread other(lane, 1, std::ref(*s1));
  lane(0, *s0);
  other.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / hops;
}

void measure_copies(const MeasureSetup& s, HardwareProfile& h) {
  Device& d = *s.devices.front();
  const uint64_t bytes = s.transfer_bytes;
  const size_t k = cold_sets(bytes);
  PinnedPoolOptions po;
  po.capacity = k * ((bytes + 4095) / 4096 * 4096);
  po.cuda = d.backend() == Backend::cuda;
  PinnedPool pool(po);
  std::vector<char*> host;
  std::vector<DeviceBuffer> dev;
  for (size_t i = 0; i < k; ++i) {
    host.push_back(static_cast<char*>(pool.allocate(bytes, "measure copy")));
    fill_pattern(host.back(), bytes);
    dev.emplace_back(d, bytes, "measure copy");
  }
  auto st = d.create_stream("measure copies");
  const auto b = static_cast<double>(bytes);
  h.h2d_bytes_per_s = rate(b, median_rotating(s.repeats, k, [&](size_t i) {
                             d.copy_to_device(dev[i].data(), host[i], bytes, *st);
                             st->synchronize();
                           }));
  // Every device buffer holds the pattern (the timing may not have reached them all); the
  // host buffers are cleared for the way back.
  for (size_t i = 0; i < k; ++i) d.copy_to_device(dev[i].data(), host[i], bytes, *st);
  st->synchronize();
  for (char* p : host) std::memset(p, 0, bytes);
  h.d2h_bytes_per_s = rate(b, median_rotating(s.repeats, k, [&](size_t i) {
                             d.copy_to_host(host[i], dev[i].data(), bytes, *st);
                             st->synchronize();
                           }));
  // Verify: what came back is what went up.
  for (size_t i = 0; i < std::min<size_t>(k, size_t(std::max(s.repeats, 1)) + 1); ++i)
    if (const uint64_t bad = pattern_mismatch(host[i], bytes); bad != bytes)
      fail(
          "bytes copied to {} and back differ at offset {} of {}; the copies are broken on this "
          "device, so no rate is reported",
          d.name(), bad, bytes);
  // A copy within the device (what a collective of one rank does): buffer i into the next
  // one, all of them holding the pattern, checked the same way.
  DeviceBuffer spare(d, bytes, "measure device copy");
  auto next = [&](size_t i) { return k > 1 ? dev[(i + 1) % k].data() : spare.data(); };
  h.device_copy_bytes_per_s = rate(b, median_rotating(s.repeats, k, [&](size_t i) {
                                     d.copy_on_device(next(i), dev[i].data(), bytes, *st);
                                     st->synchronize();
                                   }));
  d.fill_zero(spare.data(), bytes, *st);
  d.copy_on_device(spare.data(), dev[0].data(), bytes, *st);
  std::memset(host[0], 0, bytes);
  d.copy_to_host(host[0], spare.data(), bytes, *st);
  st->synchronize();
  if (const uint64_t at = pattern_mismatch(host[0], bytes); at != bytes)
    fail(
        "a copy within {} differs from its source at offset {} of {}; the device's copies are "
        "broken, so no rate is reported",
        d.name(), at, bytes);
  // The fixed cost of one task (measure_host_cores measures it again beside the model's
  // compute on host devices, whose lanes share the cores).
  h.task_latency_s = hop_seconds(d, host[0], dev[0].data(), std::max(s.repeats, 50) * 2);
  for (char* p : host) pool.release(p);
  const std::string cycling =
      fmt::format("cycling through {} buffer(s), {} in all", k, format_bytes(k * bytes));
  h.notes["h2d_bytes_per_s"] = fmt::format(
      "measured: copies of {} from pinned host memory to {}, {}, {}; verified: every byte came "
      "back",
      format_bytes(bytes), d.name(), cycling, repeats_note(s));
  h.notes["d2h_bytes_per_s"] = fmt::format(
      "measured: copies of {} from {} to pinned host memory, {}, {}; verified: every "
      "byte as sent",
      format_bytes(bytes), d.name(), cycling, repeats_note(s));
  h.notes["device_copy_bytes_per_s"] = fmt::format(
      "measured: copies of {} within {} (a one-rank collective), {}, {}; verified: every byte",
      format_bytes(bytes), d.name(), cycling, repeats_note(s));
  h.notes["task_latency_s"] = fmt::format(
      "measured: a 256-byte copy from {} queued and waited for by one thread, which then "
      "wakes another to do the same, as lanes release each other's tasks; mean of {} hops",
      d.name(), std::max(s.repeats, 50) * 2);
}

void measure_comm(const MeasureSetup& s, HardwareProfile& h) {
  const int R = static_cast<int>(s.devices.size());
  if (R < 2 || s.comm == nullptr) {
    h.notes["comm_bytes_per_s"] =
        "absent: one device; the all-gather needs two or more (only multi-device runs use it)";
    h.notes["reduce_bytes_per_s"] =
        "absent: one device; the reduce-scatter needs two or more (only multi-device runs use "
        "it)";
    return;
  }
  if (R > 256) fail("{} ranks: the all-gather check numbers at most 256", R);
  const uint64_t count = std::max<uint64_t>(s.transfer_bytes / 4 / uint64_t(R), 1);
  std::vector<DeviceBuffer> send, recv;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Stream*> sp;
  std::vector<TensorView> sv, rv;
  // Rank r sends (r << 16) | (i & 0xffff): exact in f32, different on every rank.
  auto value = [](int r, uint64_t i) {
    return static_cast<float>((uint64_t(r) << 16) | (i & 0xffff));
  };
  std::vector<float> host(count);
  for (int r = 0; r < R; ++r) {
    Device* d = s.devices[size_t(r)];
    send.emplace_back(*d, count * 4, "measure all-gather");
    recv.emplace_back(*d, count * 4 * uint64_t(R), "measure all-gather");
    streams.push_back(d->create_stream("measure comm"));
    sp.push_back(streams.back().get());
    for (uint64_t i = 0; i < count; ++i) host[i] = value(r, i);
    d->copy_to_device(send.back().data(), host.data(), count * 4, *sp.back());
    sp.back()->synchronize();
    sv.push_back(send.back().view(DType::f32, {static_cast<int64_t>(count)}));
    rv.push_back(recv.back().view(DType::f32, {static_cast<int64_t>(count) * R}));
  }
  // The schedule's unit: what one rank moves in a ring, (R - 1) / R of the gathered bytes.
  const double bytes = static_cast<double>(count * 4) * (R - 1);
  h.comm_bytes_per_s = rate(bytes, median_seconds(s.repeats, [&] {
                              s.comm->all_gather(sv, rv, sp);
                              for (Stream* x : sp) x->synchronize();
                            }));
  // Verify: every rank holds every rank's input, in rank order.
  std::vector<float> got(count * uint64_t(R));
  for (int r = 0; r < R; ++r) {
    s.devices[size_t(r)]->copy_to_host(got.data(), recv[size_t(r)].data(), got.size() * 4,
                                       *sp[size_t(r)]);
    sp[size_t(r)]->synchronize();
    for (int q = 0; q < R; ++q)
      for (uint64_t i = 0; i < count; ++i)
        if (got[uint64_t(q) * count + i] != value(q, i))
          fail(
              "the all-gather left {} at element {} of rank {}'s output where rank {}'s input "
              "{} belongs; the collective is broken, so no rate is reported",
              got[uint64_t(q) * count + i], i, r, q, value(q, i));
  }
  h.notes["comm_bytes_per_s"] = fmt::format(
      "measured: all-gather of {} per rank over {} ranks ((R-1)/R of the gathered bytes per "
      "second), {}; verified: every rank's output",
      format_bytes(count * 4), R, repeats_note(s));

  // The reduce-scatter moves what the all-gather moves and adds it too (simulator.h): the
  // gathered buffers are each rank's input now, the shards its output. Rank r sends
  // (r + 1) * (i & 0xff) at element i, so every sum is an integer under 2^24, exact in f32 in
  // any order, and checked bit for bit.
  auto term = [](int r, uint64_t i) { return static_cast<float>(uint64_t(r + 1) * (i & 0xff)); };
  std::vector<float> input(count * uint64_t(R));
  for (int r = 0; r < R; ++r) {
    for (uint64_t i = 0; i < input.size(); ++i) input[i] = term(r, i);
    s.devices[size_t(r)]->copy_to_device(recv[size_t(r)].data(), input.data(), input.size() * 4,
                                         *sp[size_t(r)]);
    sp[size_t(r)]->synchronize();
  }
  h.reduce_bytes_per_s = rate(bytes, median_seconds(s.repeats, [&] {
                                s.comm->reduce_scatter(rv, sv, sp);
                                for (Stream* x : sp) x->synchronize();
                              }));
  for (int r = 0; r < R; ++r) {
    s.devices[size_t(r)]->copy_to_host(host.data(), send[size_t(r)].data(), count * 4,
                                       *sp[size_t(r)]);
    sp[size_t(r)]->synchronize();
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t e = uint64_t(r) * count + i;  // rank r's shard: its chunk of the inputs
      float want = 0;
      for (int q = 0; q < R; ++q) want += term(q, e);
      if (host[i] != want)
        fail(
            "the reduce-scatter left {} at element {} of rank {}'s shard where the ranks' sum "
            "{} belongs; the collective is broken, so no rate is reported",
            host[i], i, r, want);
    }
  }
  h.notes["reduce_bytes_per_s"] = fmt::format(
      "measured: reduce-scatter of {} per rank over {} ranks, f32 ((R-1)/R of the input bytes "
      "per second), {}; verified: every rank's shard",
      format_bytes(count * 4 * uint64_t(R)), R, repeats_note(s));
}

// Inputs of an Adam step: hashed master and gradients, m and v from a previous step's size.
struct AdamInputs {
  std::vector<float> master, m, v;
  std::vector<char> grad;
  AdamInputs(size_t n, DType grad_dtype) : master(n), m(n), v(n), grad(n * dtype_size(grad_dtype)) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) {
      master[i] = hashed(i, 1);
      m[i] = hashed(i, 3) * 1e-3f;
      v[i] = std::abs(hashed(i, 4)) * 1e-6f;
      g[i] = hashed(i, 2) * 1e-2f;
    }
    convert(grad.data(), grad_dtype, g.data(), DType::f32, n);
  }
};

void measure_adam(const MeasureSetup& s, HardwareProfile& h) {
  const size_t n = s.adam_elements;
  const size_t gsize = dtype_size(s.grad_dtype);
  const bool has_copy = s.param_dtype != DType::f32;
  const size_t csize = has_copy ? dtype_size(s.param_dtype) : 0;
  AdamInputs in(n, s.grad_dtype);
  std::vector<char> copy(n * std::max<size_t>(csize, 1), 0);
  CpuAdamOptions ao;
  ao.threads = s.cpu_adam_threads;
  CpuAdam adam(ao);
  const GradShard g{in.grad.data(), s.grad_dtype, n};
  const AdamShard shard{in.master.data(), in.m.data(), in.v.data(), n};
  std::optional<ParamCopy> pc;
  if (has_copy) pc = ParamCopy{copy.data(), s.param_dtype};
  AdamParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.01f;

  // Verify step 1 at a spread sample against the scalar path on copies of its inputs.
  const size_t samples = std::min<size_t>(n, 4096);
  std::vector<size_t> at(samples);
  for (size_t j = 0; j < samples; ++j) at[j] = samples == 1 ? 0 : j * (n - 1) / (samples - 1);
  std::vector<float> sp(samples), sm(samples), sv(samples);
  std::vector<char> sg(samples * gsize), sc(samples * std::max<size_t>(csize, 1));
  for (size_t j = 0; j < samples; ++j) {
    sp[j] = in.master[at[j]];
    sm[j] = in.m[at[j]];
    sv[j] = in.v[at[j]];
    std::memcpy(&sg[j * gsize], &in.grad[at[j] * gsize], gsize);
  }
  const GradStats stats = adam.grad_stats(g);
  const float scale = combined_grad_scale(stats, 1.0f, 1.0f);
  adam.update(shard, g, 1, p, scale, stats, pc);
  CpuAdam scalar({.threads = 1, .simd = "scalar"});
  std::optional<ParamCopy> spc;
  if (has_copy) spc = ParamCopy{sc.data(), s.param_dtype};
  scalar.update({sp.data(), sm.data(), sv.data(), samples}, {sg.data(), s.grad_dtype, samples}, 1,
                p, scale, stats, spc);
  for (size_t j = 0; j < samples; ++j) {
    const size_t i = at[j];
    const bool same = std::memcmp(&sp[j], &in.master[i], 4) == 0 &&
                      std::memcmp(&sm[j], &in.m[i], 4) == 0 &&
                      std::memcmp(&sv[j], &in.v[i], 4) == 0 &&
                      (!has_copy || std::memcmp(&sc[j * csize], &copy[i * csize], csize) == 0);
    if (!same)
      fail(
          "CPU Adam's {} path gave master {} at element {} where the scalar path gives {}; the "
          "kernel is wrong on this CPU (run test_cpu_adam), so no rate is reported",
          adam.simd_path(), in.master[i], i, sp[j]);
  }

  // Timed over sets of inputs cycled through, so that the state comes from memory as a
  // step's does (cold_bytes()): the first set is the verified one.
  const size_t k = cold_sets(n * (12 + gsize));
  std::vector<std::unique_ptr<AdamInputs>> more;
  for (size_t i = 1; i < k; ++i) more.push_back(std::make_unique<AdamInputs>(n, s.grad_dtype));
  auto shard_of = [&](size_t i) {
    AdamInputs& x = i == 0 ? in : *more[i - 1];
    return AdamShard{x.master.data(), x.m.data(), x.v.data(), n};
  };
  auto grad_of = [&](size_t i) {
    return GradShard{(i == 0 ? in : *more[i - 1]).grad.data(), s.grad_dtype, n};
  };
  int64_t step = 1;
  h.adam_elements_per_s = rate(double(n), median_rotating(s.repeats, k, [&](size_t i) {
                                 adam.update(shard_of(i), grad_of(i), ++step, p, scale, stats, pc);
                               }));
  h.stats_elements_per_s =
      rate(double(n),
           median_rotating(s.repeats, k, [&](size_t i) { (void)adam.grad_stats(grad_of(i)); }));
  h.notes["adam_elements_per_s"] = fmt::format(
      "measured: CpuAdam's fused update ({} path, {} thread(s)) of {} elements, {} gradients{}, "
      "cycling through {} set(s) of state, {}; verified: step 1 equals the scalar path bit for "
      "bit at {} elements",
      adam.simd_path(), adam.threads(), n, dtype_name(s.grad_dtype),
      has_copy ? fmt::format(", {} copy", dtype_name(s.param_dtype)) : std::string(), k,
      repeats_note(s), samples);
  h.notes["stats_elements_per_s"] = fmt::format(
      "measured: CpuAdam's gradient statistics pass over {} {} elements, cycling through {} "
      "set(s), {}",
      n, dtype_name(s.grad_dtype), k, repeats_note(s));
}

// On host devices the executor's device lanes run on the host's cores beside CPU Adam (the
// next step's forward runs under this step's optimizer): the model's forward and backward on
// one thread and CPU Adam on another, at once for at least 0.3 s, each as a fraction of its rate
// alone, summed (HardwareProfile::host_cpu_mixed), kept within [1, 2]. A GPU's lanes do not
// share the cores: 0.
void measure_host_cores(const MeasureSetup& s, HardwareProfile& h) {
  if (s.devices.front()->backend() != Backend::host) {
    h.host_cpu_mixed = 0;
    h.notes["host_cpu_mixed"] = fmt::format(
        "0: the device lanes run on {}, not on the host's cores", s.devices.front()->name());
    return;
  }
  ComputeRun compute(s);
  const size_t n = s.adam_elements;
  AdamInputs in(n, s.grad_dtype);
  CpuAdamOptions ao;
  ao.threads = s.cpu_adam_threads;
  CpuAdam adam(ao);
  const GradShard g{in.grad.data(), s.grad_dtype, n};
  const AdamShard shard{in.master.data(), in.m.data(), in.v.data(), n};
  AdamParams p;
  p.lr = 1e-3f;
  const GradStats stats = adam.grad_stats(g);
  int64_t step = 0;
  auto update = [&] { adam.update(shard, g, ++step, p, 1.0f, stats, std::nullopt); };
  const double compute_alone = median_seconds(s.repeats, [&] { compute(); });
  const double adam_alone = median_seconds(s.repeats, update);

  constexpr double kSeconds = 0.3;
  const auto [c, a] = side_by_side(
      kSeconds, 2, [&] { compute(); }, update);
  // Verify: the model's loss still near ln(vocab), and Adam's master weights finite.
  compute.checked_loss("compute beside CPU Adam");
  if (!std::all_of(in.master.begin(), in.master.end(), [](float x) { return std::isfinite(x); }))
    fail(
        "beside the model's compute, CPU Adam left non-finite master weights; no rate is "
        "reported");
  // The fixed cost of a task while the cores are busy, as a step's small transfers and
  // collectives find them: hops beside the model's compute.
  {
    DeviceBuffer src(compute.d, 4096, "measure task latency");
    std::vector<char> dst(512);
    std::vector<double> hops;
    (void)side_by_side(
        0.2, 2, [&] { compute(); },
        [&] { hops.push_back(hop_seconds(compute.d, dst.data(), src.data(), 10)); });
    std::sort(hops.begin(), hops.end());
    h.task_latency_s = hops[hops.size() / 2];
    h.notes["task_latency_s"] = fmt::format(
        "measured on {}: a 256-byte copy queued and waited for by one thread, which then wakes "
        "another to do the same, as lanes release each other's tasks, beside the model's forward "
        "and backward; median of {} runs of 10 hops",
        compute.d.name(), hops.size());
  }
  const double fc = c.seconds > 0 ? double(c.calls) / c.seconds * compute_alone : 0;
  const double fa = a.seconds > 0 ? double(a.calls) / a.seconds * adam_alone : 0;
  h.host_cpu_mixed = std::clamp(fc + fa, 1.0, 2.0);
  h.notes["host_cpu_mixed"] = fmt::format(
      "measured on {}: the model's forward and backward ({:.2f} of its rate alone) and CPU Adam "
      "over {} elements ({:.2f} of its rate alone) at once for {:.2g} s; sum {:.2f}, kept within "
      "[1, 2]",
      compute.d.name(), fc, n, fa, kSeconds, fc + fa);
  if (s.devices.size() < 2) return;
  // With several host devices their compute lanes run at once too, each over every core (BLAS
  // on oneTBB), and they share the cores worse than compute and Adam do: two computes, each
  // timed against its rate alone. The simulator has one factor for every pair of lanes, so it
  // takes the lesser: most of such a step's overlap is between the ranks' computes.
  ComputeRun other(s, 1);
  const double other_alone = median_seconds(s.repeats, [&] { other(); });
  const auto [c0, c1] = side_by_side(
      kSeconds, 2, [&] { compute(); }, [&] { other(); });
  compute.checked_loss("compute beside another device's");
  other.checked_loss("compute beside another device's");
  const double f0 = c0.seconds > 0 ? double(c0.calls) / c0.seconds * compute_alone : 0;
  const double f1 = c1.seconds > 0 ? double(c1.calls) / c1.seconds * other_alone : 0;
  h.host_cpu_mixed = std::clamp(std::min(f0 + f1, fc + fa), 1.0, 2.0);
  h.notes["host_cpu_mixed"] = fmt::format(
      "measured on {} and {}: the lesser of two sums, kept within [1, 2]: the model's forward "
      "and backward with CPU Adam over {} elements at once ({:.2f} and {:.2f} of their rates "
      "alone, sum {:.2f}), and the model's forward and backward on both devices at once ({:.2f} "
      "and {:.2f}, sum {:.2f}), each for {:.2g} s",
      compute.d.name(), other.d.name(), n, fc, fa, fc + fa, f0, f1, f0 + f1, kSeconds);
}

void measure_device_adam(const MeasureSetup& s, HardwareProfile& h) {
  Device& d = *s.devices.front();
  const auto n = static_cast<int64_t>(s.adam_elements);
  const auto un = static_cast<size_t>(n);
  const bool has_copy = s.param_dtype != DType::f32;
  AdamInputs in(un, s.grad_dtype);
  std::vector<DeviceBuffer> b;
  auto st = d.create_stream("measure device adam");
  for (const std::vector<float>* x : {&in.master, &in.m, &in.v}) {
    b.emplace_back(d, uint64_t(n) * 4, "measure adam state");
    d.copy_to_device(b.back().data(), x->data(), uint64_t(n) * 4, *st);
  }
  DeviceBuffer grad(d, in.grad.size(), "measure gradient");
  d.copy_to_device(grad.data(), in.grad.data(), in.grad.size(), *st);
  DeviceBuffer copy;
  TensorView cv;
  if (has_copy) {
    copy = DeviceBuffer(d, uint64_t(n) * dtype_size(s.param_dtype), "measure copy");
    cv = copy.view(s.param_dtype, {n});
  }
  st->synchronize();
  auto f32 = [&](size_t i) { return b[i].view(DType::f32, {n}); };
  AdamParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.01f;
  auto step_on_device = [&](int64_t step) {
    const cpu_adam::StepConstants k = cpu_adam::step_constants(step, p, 1.0f);
    d.kernels().adam_update(f32(0), f32(1), f32(2), grad.view(s.grad_dtype, {n}), cv, k, *st);
    st->synchronize();
  };

  // Verify step 1 against CpuAdam (whose every path gives the scalar bits) on the same inputs.
  step_on_device(1);
  std::vector<char> want_copy(has_copy ? un * dtype_size(s.param_dtype) : 0);
  {
    CpuAdamOptions ao;
    ao.threads = s.cpu_adam_threads;
    CpuAdam ref(ao);
    std::optional<ParamCopy> pc;
    if (has_copy) pc = ParamCopy{want_copy.data(), s.param_dtype};
    ref.update({in.master.data(), in.m.data(), in.v.data(), un}, {in.grad.data(), s.grad_dtype, un},
               1, p, 1.0f, GradStats{}, pc);
  }
  std::vector<float> got(un);
  for (size_t i = 0; i < 3; ++i) {
    d.copy_to_host(got.data(), b[i].data(), un * 4, *st);
    st->synchronize();
    const std::vector<float>& want = i == 0 ? in.master : i == 1 ? in.m : in.v;
    if (std::memcmp(got.data(), want.data(), un * 4) != 0) {
      size_t at = 0;
      while (std::memcmp(&got[at], &want[at], 4) == 0) ++at;
      fail(
          "Adam on {} gave {} {} at element {} where CPU Adam gives {}; the device's adam_update "
          "is wrong, so no rate is reported",
          d.name(),
          i == 0   ? "master"
          : i == 1 ? "m"
                   : "v",
          got[at], at, want[at]);
    }
  }
  if (has_copy) {
    std::vector<char> got_copy(want_copy.size());
    d.copy_to_host(got_copy.data(), copy.data(), got_copy.size(), *st);
    st->synchronize();
    if (got_copy != want_copy)
      fail("Adam on {} wrote a {} parameter copy that differs from CPU Adam's; no rate is reported",
           d.name(), dtype_name(s.param_dtype));
  }

  int64_t step = 1;
  h.gpu_adam_elements_per_s =
      rate(double(n), median_seconds(s.repeats, [&] { step_on_device(++step); }));
  h.notes["gpu_adam_elements_per_s"] = fmt::format(
      "measured: the kernel table's adam_update on {} over {} elements, {}; verified: step 1 "
      "equals CPU Adam bit for bit",
      d.name(), n, repeats_note(s));

  // The statistics pass as the executor's grad_stats task runs it on a device: the chunk sums,
  // copied to the host and added in chunk order, which gives CpuAdam's grad_stats bits.
  const size_t chunks = cpu_adam::chunk_count(un, CpuAdam::kStatsChunk);
  DeviceBuffer sums_on_device(d, chunks * 8, "measure chunk sums");
  std::vector<double> sums(chunks);
  auto stats_on_device = [&] {
    d.kernels().grad_chunk_sums(grad.view(s.grad_dtype, {n}),
                                static_cast<double*>(sums_on_device.data()), *st);
    d.copy_to_host(sums.data(), sums_on_device.data(), chunks * 8, *st);
    st->synchronize();
    double total = 0;
    for (double c : sums) total += c;
    return total;
  };
  CpuAdamOptions ao;
  ao.threads = s.cpu_adam_threads;
  const double want_sum = CpuAdam(ao).grad_stats({in.grad.data(), s.grad_dtype, un}).sum_squares;
  if (const double got_sum = stats_on_device(); std::memcmp(&got_sum, &want_sum, 8) != 0)
    fail(
        "the gradient statistics on {} summed to {} where CPU Adam's grad_stats gives {}; the "
        "device's grad_chunk_sums is wrong, so no rate is reported",
        d.name(), got_sum, want_sum);
  h.gpu_stats_elements_per_s =
      rate(double(n), median_seconds(s.repeats, [&] { (void)stats_on_device(); }));
  h.notes["gpu_stats_elements_per_s"] = fmt::format(
      "measured: the kernel table's grad_chunk_sums on {} over {} elements and its {} chunk "
      "sum(s) copied to the host, {}; verified: their sum equals CPU Adam's grad_stats bit for "
      "bit",
      d.name(), n, chunks, repeats_note(s));
}

struct NvmeTiming {
  double read = 0, write = 0;  // bytes per second
};

// Swap store options over `paths` for `capacity` bytes (rounded up to whole stripes), as
// the run would open it, with `channels` rings.
nvme::SwapStoreOptions store_options(const MeasureSetup& s, const std::vector<std::string>& paths,
                                     uint64_t stripe, unsigned queue_depth, uint64_t capacity,
                                     unsigned channels) {
  nvme::SwapStoreOptions so;
  so.paths = paths;
  so.stripe = stripe;
  so.capacity = (capacity + stripe - 1) / stripe * stripe;
  so.io = s.io;
  so.io.queue_depth = queue_depth;
  so.channels = channels;
  return so;
}

// Fails unless `buf` holds the pattern the measurement wrote: a rate is never reported for a
// store that returned bad data.
void check_read_back(const char* buf, uint64_t bytes, const std::vector<std::string>& paths,
                     const char* when) {
  const uint64_t bad = pattern_mismatch(buf, bytes);
  if (bad != bytes)
    fail(
        "the swap store over {} read back a byte at offset {}{} that differs from the one "
        "written; the drive or the I/O engine returned bad data, so no rate is reported",
        fmt::join(paths, ", "), bad, when);
}

// The swap store over `paths` with one shard of `bytes`: median write and read rates, then a
// read into a cleared buffer compared byte for byte with what was written.
NvmeTiming time_store(const MeasureSetup& s, const std::vector<std::string>& paths, uint64_t stripe,
                      unsigned queue_depth, uint64_t bytes, char* buf) {
  nvme::SwapStore store(store_options(s, paths, stripe, queue_depth, bytes, 1));
  store.add_shard("measure", bytes);
  fill_pattern(buf, bytes);
  NvmeTiming t;
  t.write =
      sustained_rate(s.repeats, s.nvme_min_seconds, bytes, [&] { store.write("measure", buf); });
  std::memset(buf, 0, bytes);
  t.read =
      sustained_rate(s.repeats, s.nvme_min_seconds, bytes, [&] { store.read("measure", buf); });
  check_read_back(buf, bytes, paths, "");
  return t;
}

// The drives reading one shard on channel 0 while writing another on channel 1, as the
// executor's two NVMe lanes do, for at least nvme_min_seconds: each direction's rate then as a
// fraction of its rate alone (`alone`), summed (HardwareProfile::nvme_mixed), kept within
// [1, 2]. What was read is verified.
double time_mixed(const MeasureSetup& s, const std::vector<std::string>& paths, uint64_t stripe,
                  unsigned queue_depth, uint64_t bytes, char* buf, const NvmeTiming& alone,
                  std::string& note) {
  const uint64_t shard = (bytes + stripe - 1) / stripe * stripe;
  nvme::SwapStore store(store_options(s, paths, stripe, queue_depth, 2 * shard, 2));
  store.add_shard("read", bytes);
  store.add_shard("write", bytes);
  fill_pattern(buf, bytes);
  store.write("read", buf);
  store.write("write", buf);
  std::vector<char> other(bytes);  // the writer's source; buf is the reader's destination
  std::memcpy(other.data(), buf, bytes);
  const auto [rd, wr] = side_by_side(
      std::max(s.nvme_min_seconds, 0.01), uint64_t(std::max(s.repeats, 1)),
      [&] { store.read("read", buf, 0); }, [&] { store.write("write", other.data(), 1); });
  check_read_back(buf, bytes, paths, " (while writing another shard)");
  const double r = rate(double(rd.calls) * double(bytes), rd.seconds);
  const double w = rate(double(wr.calls) * double(bytes), wr.seconds);
  const double sum = r / alone.read + w / alone.write;
  note = fmt::format(
      "measured: reading and writing at once (channels 0 and 1, as the executor's lanes), read "
      "{:.2f} GB/s ({:.2f} of alone) and write {:.2f} GB/s ({:.2f} of alone) over at least "
      "{:.2g} s; sum {:.2f}, kept within [1, 2]",
      r / 1e9, r / alone.read, w / 1e9, w / alone.write, s.nvme_min_seconds, sum);
  return std::clamp(sum, 1.0, 2.0);
}

void measure_nvme(const MeasureSetup& s, HardwareProfile& h) {
  if (s.nvme_paths.empty()) {
    h.notes["nvme_read_bytes_per_s"] = h.notes["nvme_write_bytes_per_s"] =
        "absent: no nvme path given (strata tune --nvme-path DIR)";
    return;
  }
  std::vector<std::pair<uint64_t, unsigned>> settings = s.nvme_settings;
  if (settings.empty()) settings.push_back({s.nvme_stripe, s.io.queue_depth});
  uint64_t largest = 0;
  for (const auto& [stripe, qd] : settings) {
    if (stripe == 0 || stripe % 4096 != 0)
      fail("nvme stripe {}: not a positive multiple of 4096 bytes", stripe);
    if (qd < 1 || qd > 4096) fail("nvme queue depth {}: expected 1..4096", qd);
    largest = std::max(largest, stripe);
  }
  // Whole stripes of every setting, at least one per path and queue slot of the first.
  const uint64_t bytes = std::max((s.transfer_bytes + largest - 1) / largest * largest, largest);
  PinnedPoolOptions po;
  po.capacity = bytes;
  po.cuda = s.devices.front()->backend() == Backend::cuda;
  PinnedPool pool(po);
  char* buf = static_cast<char*>(pool.allocate(bytes, "measure nvme"));
  NvmeTiming best;
  size_t kept = 0;
  std::string tried;
  for (size_t i = 0; i < settings.size(); ++i) {
    const NvmeTiming t =
        time_store(s, s.nvme_paths, settings[i].first, settings[i].second, bytes, buf);
    tried += fmt::format("{}{} KiB x qd {}: read {:.2f} / write {:.2f} GB/s", i ? "; " : "",
                         settings[i].first / 1024, settings[i].second, t.read / 1e9, t.write / 1e9);
    // Least time for a read plus a write of the same bytes.
    if (i == 0 || 1 / t.read + 1 / t.write < 1 / best.read + 1 / best.write) {
      best = t;
      kept = i;
    }
  }
  h.nvme_read_bytes_per_s = best.read;
  h.nvme_write_bytes_per_s = best.write;
  h.nvme_block_size = settings[kept].first;
  h.nvme_queue_depth = settings[kept].second;
  // The per-call latency: the same store timed with transfers an eighth the size (whole 4 KiB
  // pages, as O_DIRECT needs), and the line latency + bytes / rate through both points, per
  // direction.
  std::string line = "not fitted: the transfer is a single page";
  const uint64_t stripe = h.nvme_block_size;
  const uint64_t small = std::max(bytes / 8 / 4096, uint64_t{1}) * 4096;
  if (small < bytes) {
    const NvmeTiming t = time_store(s, s.nvme_paths, stripe, h.nvme_queue_depth, small, buf);
    const auto fit = [&](double big_rate, double small_rate, double& rate_out, double& latency) {
      const double t1 = double(bytes) / big_rate, t2 = double(small) / small_rate;
      latency = 0;
      if (!(t1 > t2)) return;  // noise: the larger transfer was not slower
      const double slope = double(bytes - small) / (t1 - t2);
      const double l = t1 - double(bytes) / slope;
      if (l > 0 && l < 1) {
        rate_out = slope;
        latency = l;
      }
    };
    fit(best.read, t.read, h.nvme_read_bytes_per_s, h.nvme_read_latency_s);
    fit(best.write, t.write, h.nvme_write_bytes_per_s, h.nvme_write_latency_s);
    line = fmt::format(
        "fitted through {} transfers (read {:.2f} / write {:.2f} GB/s) and {} ones (read {:.2f} "
        "/ write {:.2f} GB/s): per call read {:.0f} us + bytes at {:.2f} GB/s, write {:.0f} us + "
        "bytes at {:.2f} GB/s",
        format_bytes(bytes), best.read / 1e9, best.write / 1e9, format_bytes(small), t.read / 1e9,
        t.write / 1e9, h.nvme_read_latency_s * 1e6, h.nvme_read_bytes_per_s / 1e9,
        h.nvme_write_latency_s * 1e6, h.nvme_write_bytes_per_s / 1e9);
  }
  h.notes["nvme_read_latency_s"] = h.notes["nvme_write_latency_s"] = line;
  h.nvme_mixed = time_mixed(s, s.nvme_paths, h.nvme_block_size, h.nvme_queue_depth, bytes, buf,
                            best, h.notes["nvme_mixed"]);
  bool all_direct = true;
  h.nvme_paths.clear();
  for (const std::string& p : s.nvme_paths) {
    NvmePathRate r;
    r.path = p;
    r.direct = probe_o_direct(p).result == ODirect::yes;
    all_direct = all_direct && r.direct;
    if (s.nvme_per_path && s.nvme_paths.size() > 1) {
      const NvmeTiming t = time_store(s, {p}, h.nvme_block_size, h.nvme_queue_depth, bytes, buf);
      r.read_bytes_per_s = t.read;
      r.write_bytes_per_s = t.write;
    } else if (s.nvme_paths.size() == 1) {
      r.read_bytes_per_s = best.read;
      r.write_bytes_per_s = best.write;
    }
    h.nvme_paths.push_back(r);
  }
  pool.release(buf);
  const std::string what = fmt::format(
      "measured: the swap store (io_uring, checksummed) striped over {} path(s), {} per "
      "transfer, stripe {} KiB, queue depth {}, sustained over at least {} transfers and {:.2g} "
      "s after a warm-up{}; verified: every byte read back; settings tried: {}; kept: the "
      "slope of the line latency + bytes / rate through this size and an eighth of it (see "
      "nvme_read_latency_s)",
      s.nvme_paths.size(), format_bytes(bytes), h.nvme_block_size / 1024, h.nvme_queue_depth,
      std::max(s.repeats, 1), s.nvme_min_seconds,
      all_direct ? ", O_DIRECT"
                 : ", without O_DIRECT on some path (the page cache's speed, not the drive's)",
      tried);
  h.notes["nvme_read_bytes_per_s"] = h.notes["nvme_write_bytes_per_s"] = what;
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
      {"the all-gather and the reduce-scatter", measure_comm},
      {"CPU Adam", measure_adam},
      {"the model's compute beside CPU Adam", measure_host_cores},
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
