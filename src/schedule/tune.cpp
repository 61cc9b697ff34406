// tune.cpp: candidates placed, checked, simulated and ranked; the best as a DeepSpeed config
// (see tune.h).
#include "schedule/tune.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/system.h"
#include "model/llama.h"
#include "schedule/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <tuple>

namespace strata {

std::string TuneCandidate::offload_name(Tier t) {
  return t == Tier::gpu ? "none" : std::string(tier_name(t));
}

std::string TuneCandidate::label() const {
  std::string s = fmt::format("P {}, O {}, micro {} x {}, depth {}", offload_name(param),
                              offload_name(optimizer), micro_batch, grad_accum, prefetch_depth);
  if (param != Tier::gpu || optimizer != Tier::gpu) s += fmt::format(", {} buffers", buffer_count);
  if (!recompute) s += ", no recompute";
  if (offload_activations) s += ", activations in host RAM";
  if (micro_batch_group > 1) s += fmt::format(", groups of {} reduced once", micro_batch_group);
  if (update_during_backward) s += ", Adam during the backward";
  return s;
}

namespace {

int offload_rank(Tier t) {
  return t == Tier::gpu ? 0 : t == Tier::cpu ? 1 : 2;
}

RunShape shape_for(const TuneSpace& s, int64_t micro, int depth, bool recompute, int group) {
  RunShape r;
  r.model = s.model;
  r.ranks = s.ranks;
  r.param_dtype = s.param_dtype;
  r.grad_dtype = s.grad_dtype;
  r.optimizer = s.optimizer;
  r.micro_batch = micro;
  r.seq_len = s.seq_len;
  r.persistence_threshold = s.persistence_threshold;
  r.working_buffers = working_buffers_for(depth, s.model.tie_word_embeddings);
  r.recompute = recompute;
  r.micro_batch_group = group;
  return r;
}

OffloadRequest request_for(const TuneSpace& s, const TuneCandidate& c) {
  OffloadRequest r;
  r.param = c.param;
  r.optimizer = c.optimizer;
  r.buffer_count = c.buffer_count;
  r.pin_memory = c.pin_memory;
  if (c.param == Tier::nvme || c.optimizer == Tier::nvme) r.nvme_paths = s.nvme_paths;
  r.nvme_stripe = s.nvme_stripe;
  return r;
}

// Every tier over its budget, as "gpu: needs X per device (its largest kind), Y available; ...";
// "" when it fits.
std::string over_budget(const TuneSpace& s, const Placement& p, const TierBudgets& b,
                        TuneCandidate& c) {
  c.needs = p.needs();
  c.pinned_bytes = p.pinned_need();
  const uint64_t gpu = c.needs.total(Tier::gpu), cpu = c.needs.total(Tier::cpu);
  const uint64_t nvme = c.needs.total(Tier::nvme);
  c.host_ram = s.host_devices ? cpu + gpu * uint64_t(s.ranks) : cpu;
  const char* device = s.host_devices ? "host device" : "GPU";
  // The largest kind of state in a tier: what to move elsewhere first.
  auto largest = [&](Tier t) {
    int k = 0;
    for (int i = 1; i < kStateKinds; ++i)
      if (c.needs.at(t, StateKind(i)) > c.needs.at(t, StateKind(k))) k = i;
    return fmt::format("{} {}", state_kind_name(StateKind(k)),
                       format_bytes(c.needs.at(t, StateKind(k))));
  };
  std::vector<std::string> over;
  if (gpu > b.gpu_memory)
    over.push_back(fmt::format("gpu: needs {} per {} ({} the most), {} available",
                               format_bytes(gpu), device, largest(Tier::gpu),
                               format_bytes(b.gpu_memory)));
  if (cpu > b.cpu_memory)
    over.push_back(fmt::format("cpu: needs {} ({} the most), {} available", format_bytes(cpu),
                               largest(Tier::cpu), format_bytes(b.cpu_memory)));
  if (s.host_devices && c.host_ram > b.cpu_memory && cpu <= b.cpu_memory)
    over.push_back(
        fmt::format("host RAM: needs {} (cpu tier {} + {} host device(s) x {}), {} available",
                    format_bytes(c.host_ram), format_bytes(cpu), s.ranks, format_bytes(gpu),
                    format_bytes(b.cpu_memory)));
  if (nvme > b.nvme_free)
    over.push_back(fmt::format("nvme: needs {} ({} the most), {} free on the nvme path(s)",
                               format_bytes(nvme), largest(Tier::nvme), format_bytes(b.nvme_free)));
  if (b.pinned_limit != 0 && b.pinned_limit != kUnlimited && c.pinned_bytes > b.pinned_limit)
    over.push_back(fmt::format("pinned: needs {} page-locked, ulimit -l allows {}",
                               format_bytes(c.pinned_bytes), format_bytes(b.pinned_limit)));
  if (!over.empty()) return fmt::format("{}", fmt::join(over, "; "));
  // The placement's own check is the last word (per-path NVMe shares, ...).
  try {
    p.check(b);
  } catch (const Error& e) {
    const std::string m = e.what();
    const size_t at = m.find("- nvme path");
    const size_t from = at == std::string::npos ? 0 : at + 2;
    return m.substr(from, m.find('\n', from) - from);
  }
  return "";
}

// Places candidate c and checks it: pinning the cpu-homed P and G when the pinned limit allows,
// else pinning only the buffers. Returns the placement when it fits.
std::optional<Placement> place(const TuneSpace& s, const TierBudgets& b, TuneCandidate& c) {
  std::optional<Placement> p;
  for (bool pin : {true, false}) {
    c.pin_memory = pin;
    RunShape shape =
        shape_for(s, c.micro_batch, c.prefetch_depth, c.recompute, c.micro_batch_group);
    shape.offload_activations = c.offload_activations;
    p = Placement::make(shape, request_for(s, c), b);
    c.why_not = over_budget(s, *p, b, c);
    c.fits = c.why_not.empty();
    // Pinning only the buffers helps when the pinned limit is all that is over.
    if (c.fits || !c.why_not.starts_with("pinned") || !p->offloaded()) break;
  }
  if (!c.fits) p.reset();
  return p;
}

struct Simulated {
  double step_s = 0;
  int critical = -1;
  double overlap = 0;
  std::vector<std::string> lanes;
};

// A grouped candidate reduces its gradients once per group (ScheduleOptions::reduce_per_group):
// fewer tasks and bytes and no waits between a group's backwards, in the same memory.
Simulated simulate_once(const Placement& p, int64_t accum, int depth, bool early,
                        const HardwareProfile& profile) {
  ScheduleOptions so;
  so.micro_batches = static_cast<int>(accum);
  so.prefetch_depth = depth;
  so.reduce_per_group = p.shape.micro_batch_group > 1;
  so.update_during_backward = early;
  const Schedule schedule = Schedule::build(p, so);
  const Prediction pred = simulate(schedule, profile);  // the steady state, as plan reports
  Simulated r;
  r.step_s = pred.step_s;
  r.critical = pred.critical_lane;
  r.overlap = pred.overlap;
  for (const LaneTime& l : pred.lanes) r.lanes.push_back(l.lane);
  return r;
}

void simulate_candidate(const Placement& p, const HardwareProfile& profile, const TuneSpace& s,
                        TuneCandidate& c, int& simulations) {
  Simulated at;
  if (c.grad_accum <= kMaxSimulatedAccum) {
    at = simulate_once(p, c.grad_accum, c.prefetch_depth, c.update_during_backward, profile);
    ++simulations;
    c.step_s = at.step_s;
  } else {
    // The cost of one more micro-batch, from half of kMaxSimulatedAccum to all of it.
    const int64_t lo = kMaxSimulatedAccum / 2, hi = kMaxSimulatedAccum;
    const Simulated a = simulate_once(p, lo, c.prefetch_depth, c.update_during_backward, profile);
    at = simulate_once(p, hi, c.prefetch_depth, c.update_during_backward, profile);
    simulations += 2;
    const double per = (at.step_s - a.step_s) / double(hi - lo);
    c.step_s = at.step_s + per * double(c.grad_accum - hi);
    c.extrapolated = true;
  }
  c.simulated = true;
  c.overlap = at.overlap;
  c.critical_lane = at.critical >= 0 ? at.lanes[size_t(at.critical)] : "-";
  const double tokens =
      double(s.ranks) * double(c.micro_batch) * double(c.grad_accum) * double(s.seq_len);
  c.tokens_per_s = c.step_s > 0 ? tokens / c.step_s : 0;
}

// Micro-batch and accumulation pairs, smallest micro-batch first.
std::vector<std::pair<int64_t, int64_t>> batch_choices(const TuneSpace& s) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (s.max_micro_batch < 1)
    fail("tune: the largest micro-batch to try is {}; it must be at least 1", s.max_micro_batch);
  if (s.global_batch > 0) {
    if (s.global_batch % s.ranks != 0)
      fail(
          "--global-batch {}: not a multiple of the {} device(s); each device takes the same "
          "number of sequences per step, so use a multiple of {}",
          s.global_batch, s.ranks, s.ranks);
    const int64_t per_rank = s.global_batch / s.ranks;
    for (int64_t m = 1; m <= std::min(per_rank, s.max_micro_batch); ++m)
      if (per_rank % m == 0) out.push_back({m, per_rank / m});
    // Many divisors: keep powers of two and the largest (a few sizes suffice to find the knee).
    if (out.size() > 8) {
      std::vector<std::pair<int64_t, int64_t>> kept;
      for (const auto& x : out)
        if ((x.first & (x.first - 1)) == 0 || x == out.back()) kept.push_back(x);
      out = kept;
    }
  } else {
    for (int64_t m = 1; m <= s.max_micro_batch; m *= 2) out.push_back({m, 1});
  }
  return out;
}

}  // namespace

TuneResult tune_search(const TuneSpace& s, const TierBudgets& b, const HardwareProfile* profile) {
  if (s.ranks < 1) fail("tune: {} devices; at least 1", s.ranks);
  if (s.seq_len < 1) fail("tune: --seq-len {}; at least 1", s.seq_len);
  if (s.prefetch_depths.empty() || s.buffer_counts.empty() || s.recompute.empty() ||
      s.offload_activations.empty())
    fail(
        "tune: no prefetch depth, buffer count, activation checkpointing or activation offload "
        "choice to try");
  for (int d : s.prefetch_depths)
    if (d < 0 || d > 64) fail("tune: prefetch depth {}: expected 0..64", d);
  const auto batches = batch_choices(s);
  TuneResult r;
  std::vector<Tier> params, optimizers;
  for (const auto& [from, to] :
       {std::pair{&s.param_tiers, &params}, {&s.optimizer_tiers, &optimizers}})
    for (Tier t : *from) {
      if (t == Tier::nvme && s.nvme_paths.empty()) {
        const std::string why = "nvme: no nvme path given (--nvme-path DIR on a fast drive)";
        if (std::find(r.skipped.begin(), r.skipped.end(), why) == r.skipped.end())
          r.skipped.push_back(why);
        continue;
      }
      if (std::find(to->begin(), to->end(), t) == to->end()) to->push_back(t);
    }
  if (params.empty() || optimizers.empty())
    fail("tune: nothing to try: {}", r.skipped.empty() ? "no tiers" : r.skipped.front());
  std::vector<int> depths = s.prefetch_depths;
  std::sort(depths.begin(), depths.end());
  std::vector<int> buffers = s.buffer_counts;
  std::sort(buffers.begin(), buffers.end());

  // Checkpointing first: without a profile only it is tried (the smaller memory).
  std::vector<bool> recomputes = s.recompute;
  std::sort(recomputes.begin(), recomputes.end(), std::greater<>());
  recomputes.erase(std::unique(recomputes.begin(), recomputes.end()), recomputes.end());
  // Activation checkpoints on the GPU first.
  std::vector<bool> acts = s.offload_activations;
  std::sort(acts.begin(), acts.end());
  acts.erase(std::unique(acts.begin(), acts.end()), acts.end());
  if (std::find(acts.begin(), acts.end(), false) == acts.end() &&
      std::find(recomputes.begin(), recomputes.end(), true) == recomputes.end())
    fail(
        "tune: the activation checkpoints can only go to host RAM (--offload-activations cpu) "
        "with activation checkpointing on, and only off is to be tried; try "
        "--activation-checkpointing on, or --offload-activations none");
  // Per checkpointing choice, the offload choices to try: with recompute every one asked (on
  // the GPU first), without it none (there are no checkpoints to move); without a profile
  // (whether anything fits) only the last, the least GPU memory.
  auto acts_for = [&](bool recompute) {
    std::vector<bool> out;
    for (bool a : acts)
      if (!a || recompute) out.push_back(a);
    if (profile == nullptr && out.size() > 1) out = {out.back()};
    return out;
  };
  // Updating after the backward first (the default's behaviour on a non-finite gradient).
  std::vector<bool> updates = s.update_during_backward;
  std::sort(updates.begin(), updates.end());
  updates.erase(std::unique(updates.begin(), updates.end()), updates.end());
  if (updates.empty()) fail("tune: no --update-during-backward choice to try");

  // What makes two candidates the same run: every unit's homes, the pinned buffers, pinning,
  // micro-batch, accumulation, depth and checkpointing.
  std::map<std::string, std::string> first_with;  // signature -> the choice that had it first
  auto signature = [](const Placement& p, const TuneCandidate& c) {
    std::string sig =
        fmt::format("{} {} {} {} {} {} {} {} {} {}|", c.micro_batch, c.grad_accum, c.prefetch_depth,
                    p.pinned_buffers, p.pinned_buffer_bytes, p.offloaded() && c.pin_memory,
                    c.recompute, c.micro_batch_group, c.update_during_backward,
                    offloaded_checkpoints(p.shape.model, checkpoint_slots(p.shape)));
    for (const UnitHomes& h : p.homes)
      sig += fmt::format("{}{}{}", int(h.param), int(h.grad), int(h.optimizer));
    return sig;
  };
  auto choice = [](Tier pt, Tier ot) {
    return fmt::format("P {}, O {}", TuneCandidate::offload_name(pt),
                       TuneCandidate::offload_name(ot));
  };

  for (Tier pt : params)
    for (Tier ot : optimizers) {
      const bool offloaded = pt != Tier::gpu || ot != Tier::gpu;
      int distinct = 0;
      std::string duplicate_of;
      // Buffers only matter when something moves between tiers; one placement otherwise.
      const std::vector<int> counts = offloaded ? buffers : std::vector<int>{buffers.front()};
      std::optional<TuneCandidate> smallest;
      bool any = false;
      // Without a profile only whether the choice fits: its smallest setting.
      const size_t nd = profile ? depths.size() : 1, nc = profile ? counts.size() : 1;
      const size_t nb = profile ? batches.size() : 1, nr = profile ? recomputes.size() : 1;
      // Groups: with a profile, each accumulating step also as one group, its gradients
      // reduced once per group (which tied embeddings need in a group).
      const size_t ng = profile && s.whole_step_groups ? 2 : 1;
      // CPU Adam during the backward: with a profile, where the optimizer is on the host.
      std::vector<bool> early{false};
      if (profile && ot != Tier::gpu) early = updates;
      for (size_t di = 0; di < nd; ++di)
        for (size_t ci = 0; ci < nc; ++ci)
          for (size_t ri = 0; ri < nr; ++ri)
            for (const bool act : acts_for(recomputes[ri]))
              for (size_t gi = 0; gi < ng; ++gi)
                for (size_t ui = 0; ui < early.size(); ++ui)
                  for (size_t bi = 0; bi < nb; ++bi) {
                    const int depth = depths[di], count = counts[ci];
                    const auto [micro, accum] = batches[bi];
                    if (gi == 1 && accum == 1) continue;  // one micro-batch: nothing to group
                    TuneCandidate c;
                    c.micro_batch_group = gi == 1 ? static_cast<int>(accum) : 1;
                    c.update_during_backward = early[ui];
                    c.param = pt;
                    c.optimizer = ot;
                    c.micro_batch = micro;
                    c.grad_accum = accum;
                    c.prefetch_depth = depth;
                    c.buffer_count = count;
                    c.recompute = recomputes[ri];
                    c.offload_activations = act;
                    const std::optional<Placement> p = place(s, b, c);
                    ++r.placements;
                    if (!smallest) smallest = c;
                    // Larger micro-batches need more of every tier: none of them fits either.
                    if (!p) break;
                    any = true;
                    const auto [it, fresh] = first_with.emplace(signature(*p, c), choice(pt, ot));
                    if (!fresh) {
                      if (it->second != choice(pt, ot)) duplicate_of = it->second;
                      continue;
                    }
                    ++distinct;
                    if (profile != nullptr) {
                      try {
                        simulate_candidate(*p, *profile, s, c, r.simulations);
                      } catch (const Error& e) {
                        // A rate this candidate needs is not in the profile: say so once per rate
                        // (the messages differ only in the task named), rank the rest.
                        const std::string m = e.what();
                        const std::string key = m.substr(0, m.find(", but task"));
                        if (std::none_of(r.unsimulated.begin(), r.unsimulated.end(),
                                         [&](const std::string& x) { return x.starts_with(key); }))
                          r.unsimulated.push_back(m);
                        continue;
                      }
                    }
                    r.ranked.push_back(c);
                  }
      if (!any && smallest) r.refused.push_back(*smallest);
      if (any && distinct == 0 && !duplicate_of.empty())
        r.same_as.push_back(
            fmt::format("{} places everything as {} does", choice(pt, ot), duplicate_of));
    }
  if (profile == nullptr) return r;
  // Best first: of those left, the preferred among the ones within 1% of the fastest (fewer
  // tiers off the devices, the optimizer nearer, a shallower prefetch, fewer buffers, a larger
  // micro-batch, checkpointing kept, the checkpoints on the GPU, no groups, CPU Adam after the
  // backward), then again. A
  // selection, not a sort: "within 1%" is not transitive.
  auto preference = [](const TuneCandidate& c) {
    return std::make_tuple(offload_rank(c.param) + offload_rank(c.optimizer),
                           offload_rank(c.optimizer), c.prefetch_depth, c.buffer_count,
                           -c.micro_batch, !c.recompute, c.offload_activations, c.micro_batch_group,
                           c.update_during_backward);
  };
  std::vector<TuneCandidate> left = std::move(r.ranked), out;
  while (!left.empty()) {
    double fastest = 0;
    for (const TuneCandidate& c : left) fastest = std::max(fastest, c.tokens_per_s);
    size_t pick = left.size();
    for (size_t i = 0; i < left.size(); ++i)
      if (left[i].tokens_per_s >= fastest / 1.01 &&
          (pick == left.size() || preference(left[i]) < preference(left[pick])))
        pick = i;
    out.push_back(left[pick]);
    left.erase(left.begin() + static_cast<std::ptrdiff_t>(pick));
  }
  r.ranked = std::move(out);
  return r;
}

nlohmann::ordered_json tune_ds_config(const TuneSpace& s, const TuneCandidate& c,
                                      unsigned queue_depth) {
  using json = nlohmann::ordered_json;
  json j;
  j["train_batch_size"] = c.micro_batch * c.grad_accum * s.ranks;
  j["train_micro_batch_size_per_gpu"] = c.micro_batch;
  j["gradient_accumulation_steps"] = c.grad_accum;
  j["bf16"] = {{"enabled", s.param_dtype == DType::bf16}};
  j["fp16"] = {{"enabled", s.param_dtype == DType::f16}};
  if (s.param_dtype == DType::f16) j["fp16"]["loss_scale"] = 0;  // dynamic
  const bool nvme = c.param == Tier::nvme || c.optimizer == Tier::nvme;
  auto section = [&](Tier t, bool param) {
    json o;
    o["device"] = TuneCandidate::offload_name(t);
    if (t == Tier::gpu) return o;
    if (t == Tier::nvme) {
      // Every parameter on NVMe, as simulated (DeepSpeed's default keeps 1e9 a rank in RAM).
      if (param) o["max_in_cpu"] = 0;
      if (s.nvme_paths.size() == 1)
        o["nvme_path"] = s.nvme_paths.front();
      else
        o["nvme_path"] = s.nvme_paths;  // strata's extension: one path per drive
    }
    o["pin_memory"] = c.pin_memory;
    o["buffer_count"] = c.buffer_count;
    return o;
  };
  uint64_t largest = 1;
  for (const UnitLayout& u : ModelLayout::build(s.model).units)
    largest = std::max(largest, u.numel);
  json z;
  z["stage"] = 3;
  z["offload_param"] = section(c.param, true);
  z["offload_optimizer"] = section(c.optimizer, false);
  // strata fetches whole units: the depth is this bucket / the largest unit's elements.
  z["stage3_prefetch_bucket_size"] = uint64_t(std::max(c.prefetch_depth, 1)) * largest;
  z["stage3_param_persistence_threshold"] = s.persistence_threshold;
  j["zero_optimization"] = z;
  if (c.offload_activations) j["activation_checkpointing"] = {{"cpu_checkpointing", true}};
  if (nvme) {
    j["aio"] = {{"block_size", s.nvme_stripe}};
    if (queue_depth > 0) j["aio"]["queue_depth"] = queue_depth;
  }
  return j;
}

}  // namespace strata
