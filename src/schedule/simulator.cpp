// simulator.cpp: task durations from a hardware profile, and one exact pass per step.
//
// Because every dependency of a task comes earlier in the schedule and each lane runs its
// tasks in schedule order, one pass in schedule order computes every start and end exactly:
// a task starts at the latest of its lane becoming free, its dependencies' ends and its
// `prev` dependencies' ends in the previous step; a group starts on all its lanes at the
// latest of its members' ready times and ends together. No event queue is needed, so
// llama2-70b's tens of thousands of tasks take milliseconds.
//
// Rates used: transfers bytes / their link (h2d, d2h, comm, NVMe read, NVMe write); forward
// and backward FLOPs / gpu_flops; adam elements / adam_elements_per_s on the CPU or
// gpu_adam_elements_per_s on a GPU; grad_stats and grad_accumulate (streaming passes over a
// shard) elements / stats_elements_per_s on the CPU; on a GPU, grad_stats at
// gpu_stats_elements_per_s where the profile has it, and otherwise, like grad_accumulate, at
// gpu_adam_elements_per_s (an upper bound). Every task adds task_latency_s.
// Reduce-scatters (and all-reduces) go at reduce_bytes_per_s where the profile has it, else at
// comm_bytes_per_s, the all-gather's rate. One-rank collectives are device copies: bytes /
// device_copy_bytes_per_s (free when it is 0). NVMe tasks add nvme_read_latency_s or
// nvme_write_latency_s (one swap-store call's fixed cost). The NVMe lanes share the drives: each
// task takes a gap of its length / nvme_mixed in the drives' busy intervals, within its own span
// (simulator.h); on the host backend the device lanes and cpu.adam share the cores in the same way,
// with host_cpu_mixed.
#include "schedule/simulator.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <sstream>

namespace strata {

namespace {

struct RateField {
  const char* key;
  double HardwareProfile::*member;
};

constexpr std::array<RateField, 10> kFields = {{
    {"gpu_flops", &HardwareProfile::gpu_flops},
    {"h2d_bytes_per_s", &HardwareProfile::h2d_bytes_per_s},
    {"d2h_bytes_per_s", &HardwareProfile::d2h_bytes_per_s},
    {"comm_bytes_per_s", &HardwareProfile::comm_bytes_per_s},
    {"adam_elements_per_s", &HardwareProfile::adam_elements_per_s},
    {"stats_elements_per_s", &HardwareProfile::stats_elements_per_s},
    {"gpu_adam_elements_per_s", &HardwareProfile::gpu_adam_elements_per_s},
    {"nvme_read_bytes_per_s", &HardwareProfile::nvme_read_bytes_per_s},
    {"nvme_write_bytes_per_s", &HardwareProfile::nvme_write_bytes_per_s},
    {"task_latency_s", &HardwareProfile::task_latency_s},
}};

std::string rate_keys() {
  std::string all;
  for (size_t i = 0; i < kFields.size(); ++i)
    all += fmt::format("{}{}", i ? ", " : "", kFields[i].key);
  return all;
}

bool is_rate_key(const std::string& key) {
  return std::any_of(kFields.begin(), kFields.end(),
                     [&](const RateField& f) { return key == f.key; });
}

// The keys a profile may leave out.
constexpr std::array<const char*, 7> kOptional = {"nvme_mixed",          "device_copy_bytes_per_s",
                                                  "host_cpu_mixed",      "gpu_stats_elements_per_s",
                                                  "reduce_bytes_per_s",  "nvme_read_latency_s",
                                                  "nvme_write_latency_s"};
bool is_optional_key(const std::string& key) {
  return std::find(kOptional.begin(), kOptional.end(), key) != kOptional.end();
}
std::string optional_keys() {
  return fmt::format("{}", fmt::join(kOptional, ", "));
}

// "notes": {rate: text}.
void read_notes(const nlohmann::json& v, const std::string& where, HardwareProfile& p) {
  if (!v.is_object())
    fail("hardware profile {}: /notes: expected an object of strings keyed by rate, found {}",
         where, v.type_name());
  for (const auto& item : v.items()) {
    const std::string& key = item.key();
    if (!is_rate_key(key) && !is_optional_key(key))
      fail("hardware profile {}: /notes/{}: not a rate; the rates are {}, {}", where, key,
           rate_keys(), optional_keys());
    if (!item.value().is_string())
      fail("hardware profile {}: /notes/{}: expected a string, found {}", where, key,
           item.value().type_name());
    p.notes[key] = item.value().get<std::string>();
  }
}

double read_rate(const nlohmann::json& v, const std::string& where, const std::string& path) {
  if (!v.is_number())
    fail("hardware profile {}: {}: expected a number, found {} ({})", where, path, v.type_name(),
         v.dump());
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < 0)
    fail("hardware profile {}: {}: {} is not a rate; it must be a finite number >= 0", where, path,
         v.dump());
  return x;
}

uint64_t read_count(const nlohmann::json& v, const std::string& where, const std::string& path,
                    uint64_t most) {
  if (!v.is_number_unsigned() || v.get<uint64_t>() > most)
    fail("hardware profile {}: {}: {} is not a count from 0 to {}", where, path, v.dump(), most);
  return v.get<uint64_t>();
}

// "nvme": {"block_size", "queue_depth", "paths": [{"path", "read_bytes_per_s",
// "write_bytes_per_s", "direct"}]}.
void read_nvme(const nlohmann::json& v, const std::string& where, HardwareProfile& p) {
  if (!v.is_object())
    fail("hardware profile {}: /nvme: expected an object, found {}", where, v.type_name());
  for (const auto& item : v.items()) {
    const std::string& key = item.key();
    const nlohmann::json& value = item.value();
    if (key == "block_size") {
      p.nvme_block_size = read_count(value, where, "/nvme/block_size", uint64_t{1} << 40);
    } else if (key == "queue_depth") {
      p.nvme_queue_depth =
          static_cast<unsigned>(read_count(value, where, "/nvme/queue_depth", 4096));
    } else if (key == "paths") {
      if (!value.is_array())
        fail("hardware profile {}: /nvme/paths: expected an array, found {}", where,
             value.type_name());
      for (size_t i = 0; i < value.size(); ++i) {
        const nlohmann::json& e = value[i];
        const std::string at = fmt::format("/nvme/paths/{}", i);
        if (!e.is_object())
          fail("hardware profile {}: {}: expected an object, found {}", where, at, e.type_name());
        NvmePathRate r;
        for (const char* need : {"path", "read_bytes_per_s", "write_bytes_per_s", "direct"})
          if (!e.contains(need)) fail("hardware profile {}: {}/{}: missing", where, at, need);
        for (const auto& f : e.items()) {
          const std::string& k = f.key();
          if (k == "path" && f.value().is_string()) {
            r.path = f.value().get<std::string>();
          } else if (k == "direct" && f.value().is_boolean()) {
            r.direct = f.value().get<bool>();
          } else if (k == "read_bytes_per_s") {
            r.read_bytes_per_s = read_rate(f.value(), where, at + "/" + k);
          } else if (k == "write_bytes_per_s") {
            r.write_bytes_per_s = read_rate(f.value(), where, at + "/" + k);
          } else if (k == "path" || k == "direct") {
            fail("hardware profile {}: {}/{}: expected a {}, found {}", where, at, k,
                 k == "path" ? "string" : "boolean", f.value().type_name());
          } else {
            fail(
                "hardware profile {}: {}/{}: unknown key; the keys are path, read_bytes_per_s, "
                "write_bytes_per_s, direct",
                where, at, k);
          }
        }
        p.nvme_paths.push_back(r);
      }
    } else {
      fail(
          "hardware profile {}: /nvme/{}: unknown key; the keys are block_size, queue_depth, paths",
          where, key);
    }
  }
}

// A resource that lanes share (the drives, or the host's cores): its busy intervals, sorted,
// disjoint and merged where they touch. A task of `length` ready at `at` holds it for
// length / mixed of its span: it starts at the earliest t >= at whose span [t, t + length) has
// that much free time, and takes the earliest free pieces of it. With mixed 1 that is the
// first gap that holds the whole task; the general case finds t on the free time of the span,
// a piecewise linear function of t whose corners are where either end of the span crosses an
// interval's edge.
class SharedTimeline {
 public:
  explicit SharedTimeline(double mixed) : mixed_(std::clamp(mixed, 1.0, 2.0)) {}

  // Places a task of `length` ready at `at`; returns its start.
  double fit(double at, double length) {
    if (mixed_ == 1.0) {  // the first gap that holds the whole task
      size_t i = first_ending_after(at);
      for (; i < busy_.size(); ++i) {
        if (at + length <= busy_[i].first) break;
        at = std::max(at, busy_[i].second);
      }
      take(at, at + length);
      return at;
    }
    const double held = length / mixed_;
    double t = at;
    double f = free_in(at, at + length);
    if (f < held) {
      std::vector<double> corners;
      for (size_t i = first_ending_after(at); i < busy_.size(); ++i)
        for (double e : {busy_[i].first, busy_[i].second})
          for (double c : {e, e - length})
            if (c > at) corners.push_back(c);
      std::sort(corners.begin(), corners.end());
      for (double c : corners) {
        const double fc = free_in(c, c + length);
        if (fc >= held) {  // crosses between t and c, linearly
          t = fc > f ? t + (held - f) * (c - t) / (fc - f) : c;
          break;
        }
        t = c;
        f = fc;
      }
    }
    // The earliest free pieces from t, `held` of them; rounding may leave a sliver past the
    // span, which the task then ends with.
    double need = held, x = t;
    size_t i = first_ending_after(x);
    while (x + need > x) {  // what is left is more than rounding at x
      if (i == busy_.size()) {
        take(x, x + need);
        break;
      }
      const double gap_end = busy_[i].first;
      if (gap_end > x) {
        const double piece = std::min(need, gap_end - x);
        take(x, x + piece);
        need -= piece;
        x += piece;
        i = first_ending_after(x);
        continue;
      }
      x = std::max(x, busy_[i].second);
      ++i;
    }
    return t;
  }

 private:
  size_t first_ending_after(double a) const {
    return static_cast<size_t>(
        std::lower_bound(busy_.begin(), busy_.end(), std::pair{a, a},
                         [](const auto& x, const auto& y) { return x.second <= y.first; }) -
        busy_.begin());
  }
  double free_in(double a, double b) const {
    double busy = 0;
    for (size_t i = first_ending_after(a); i < busy_.size() && busy_[i].first < b; ++i)
      busy += std::min(b, busy_[i].second) - std::max(a, busy_[i].first);
    return (b - a) - busy;
  }
  void take(double a, double b) {  // marks [a, b) busy; it was free
    size_t i = first_ending_after(a);
    if (i > 0 && busy_[i - 1].second >= a) --i;  // touches the interval before
    if (i < busy_.size() && busy_[i].second >= a && busy_[i].first <= b) {
      busy_[i].first = std::min(busy_[i].first, a);
      busy_[i].second = std::max(busy_[i].second, b);
      while (i + 1 < busy_.size() && busy_[i + 1].first <= busy_[i].second) {
        busy_[i].second = std::max(busy_[i].second, busy_[i + 1].second);
        busy_.erase(busy_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      }
    } else {
      busy_.insert(busy_.begin() + static_cast<std::ptrdiff_t>(i), {a, b});
    }
  }

  double mixed_;
  std::vector<std::pair<double, double>> busy_;
};

// The lanes whose work runs on the host's cores when the devices are host devices.
bool runs_on_host_cores(const Lane& lane) {
  return lane.kind != LaneKind::nvme_read && lane.kind != LaneKind::nvme_write;
}

}  // namespace

HardwareProfile HardwareProfile::from_json_text(const std::string& text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e400
    fail(
        "hardware profile {}: not valid JSON ({}); fix the file or write it again with strata tune",
        where, e.what());
  }
  if (!j.is_object())
    fail("hardware profile {}: /: expected an object of rates, found {}", where, j.type_name());
  HardwareProfile p;
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      if (!value.is_string())
        fail("hardware profile {}: /name: expected a string, found {}", where, value.type_name());
      p.name = value.get<std::string>();
      continue;
    }
    if (key == "notes") {
      read_notes(value, where, p);
      continue;
    }
    if (key == "nvme") {
      read_nvme(value, where, p);
      continue;
    }
    if (key == "nvme_mixed") {
      if (!value.is_number() || !(value.get<double>() >= 1 && value.get<double>() <= 2))
        fail(
            "hardware profile {}: /nvme_mixed: {} is not a number from 1 (the drives read or "
            "write, one at a time) to 2 (both at full rate at once); measure it with strata tune",
            where, value.dump());
      p.nvme_mixed = value.get<double>();
      continue;
    }
    if (key == "device_copy_bytes_per_s") {
      p.device_copy_bytes_per_s = read_rate(value, where, "/" + key);
      continue;
    }
    if (key == "reduce_bytes_per_s") {
      p.reduce_bytes_per_s = read_rate(value, where, "/" + key);
      continue;
    }
    if (key == "nvme_read_latency_s" || key == "nvme_write_latency_s") {
      const double x = read_rate(value, where, "/" + key);
      if (x > 1)
        fail(
            "hardware profile {}: /{}: {} s is not a per-call latency (a drive's is tens of "
            "microseconds); measure it with strata tune",
            where, key, value.dump());
      (key == "nvme_read_latency_s" ? p.nvme_read_latency_s : p.nvme_write_latency_s) = x;
      continue;
    }
    if (key == "gpu_stats_elements_per_s") {
      p.gpu_stats_elements_per_s = read_rate(value, where, "/" + key);
      continue;
    }
    if (key == "host_cpu_mixed") {
      if (!value.is_number() ||
          !(value.get<double>() == 0 || (value.get<double>() >= 1 && value.get<double>() <= 2)))
        fail(
            "hardware profile {}: /host_cpu_mixed: {} is neither 0 (the device lanes do not run "
            "on the host's cores: a GPU) nor a number from 1 (host cores serve one lane at a "
            "time) to 2 (two at full speed); measure it with strata tune on host devices",
            where, value.dump());
      p.host_cpu_mixed = value.get<double>();
      continue;
    }
    if (!is_rate_key(key))
      fail("hardware profile {}: /{}: unknown key; the keys are name, notes, nvme, {}, {}", where,
           key, optional_keys(), rate_keys());
  }
  for (const RateField& f : kFields) {
    if (!j.contains(f.key))
      fail("hardware profile {}: /{}: missing; every rate is a key (0 when it was not measured)",
           where, f.key);
    p.*f.member = read_rate(j.at(f.key), where, std::string("/") + f.key);
  }
  return p;
}

HardwareProfile HardwareProfile::load(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    fail("hardware profile {}: cannot open it ({}); check the path, or write one with strata tune",
         path, errno_text(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return from_json_text(text.str(), path);
}

std::string HardwareProfile::to_json() const {
  nlohmann::ordered_json j;
  j["name"] = name;
  for (const RateField& f : kFields) j[f.key] = this->*f.member;
  j["nvme_mixed"] = nvme_mixed;
  j["device_copy_bytes_per_s"] = device_copy_bytes_per_s;
  j["host_cpu_mixed"] = host_cpu_mixed;
  j["gpu_stats_elements_per_s"] = gpu_stats_elements_per_s;
  j["reduce_bytes_per_s"] = reduce_bytes_per_s;
  j["nvme_read_latency_s"] = nvme_read_latency_s;
  j["nvme_write_latency_s"] = nvme_write_latency_s;
  if (!notes.empty()) {
    nlohmann::ordered_json n = nlohmann::ordered_json::object();
    for (const RateField& f : kFields)  // in the rates' order, not the map's
      if (const auto it = notes.find(f.key); it != notes.end()) n[f.key] = it->second;
    for (const char* key : kOptional)
      if (const auto it = notes.find(key); it != notes.end()) n[key] = it->second;
    j["notes"] = n;
  }
  if (nvme_block_size > 0 || nvme_queue_depth > 0 || !nvme_paths.empty()) {
    nlohmann::ordered_json n;
    n["block_size"] = nvme_block_size;
    n["queue_depth"] = nvme_queue_depth;
    n["paths"] = nlohmann::ordered_json::array();
    for (const NvmePathRate& r : nvme_paths)
      n["paths"].push_back({{"path", r.path},
                            {"read_bytes_per_s", r.read_bytes_per_s},
                            {"write_bytes_per_s", r.write_bytes_per_s},
                            {"direct", r.direct}});
    j["nvme"] = n;
  }
  return j.dump(2) + "\n";
}

double task_seconds(const Task& task, const Lane& lane, int ranks, const HardwareProfile& profile,
                    double optimizer_cost) {
  const HardwareProfile& p = profile;
  double work = 0, rate = 0, local = 0;
  const char* field = "";
  auto use = [&](double w, double r, const char* f) {
    work = w;
    rate = r;
    field = f;
  };
  const auto bytes = static_cast<double>(task.bytes);
  const auto elements = static_cast<double>(task.elements);
  const bool on_gpu = lane.kind == LaneKind::compute;
  switch (task.kind) {
    case TaskKind::param_read:
    case TaskKind::optim_read:
    case TaskKind::grad_read:
      use(bytes, p.nvme_read_bytes_per_s, "nvme_read_bytes_per_s");
      if (bytes > 0) local = p.nvme_read_latency_s;
      break;
    case TaskKind::optim_write:
    case TaskKind::param_write:
    case TaskKind::grad_write:
      use(bytes, p.nvme_write_bytes_per_s, "nvme_write_bytes_per_s");
      if (bytes > 0) local = p.nvme_write_latency_s;
      break;
    case TaskKind::param_h2d:
    case TaskKind::param_upload:
    case TaskKind::act_h2d:
      use(bytes, p.h2d_bytes_per_s, "h2d_bytes_per_s");
      break;
    case TaskKind::grad_d2h:
    case TaskKind::grad_offload:
    case TaskKind::param_d2h:
    case TaskKind::act_d2h:
      use(bytes, p.d2h_bytes_per_s, "d2h_bytes_per_s");
      break;
    case TaskKind::gather:
    case TaskKind::reduce_scatter:
      // What the rank writes in its own memory besides (clearing working gradients) goes at
      // the device's copy rate, or free where the profile has none (simulator.h).
      if (p.device_copy_bytes_per_s > 0)
        local = static_cast<double>(task.local_bytes) / p.device_copy_bytes_per_s;
      if (ranks > 1 && task.kind == TaskKind::reduce_scatter && p.reduce_bytes_per_s > 0)
        use(bytes, p.reduce_bytes_per_s, "reduce_bytes_per_s");
      else if (ranks > 1)  // and a reduce-scatter where the profile has no rate of its own
        use(bytes, p.comm_bytes_per_s, "comm_bytes_per_s");
      else if (p.device_copy_bytes_per_s > 0)
        use(bytes, p.device_copy_bytes_per_s, "device_copy_bytes_per_s");
      break;
    case TaskKind::forward:
    case TaskKind::backward:
      use(task.flops, p.gpu_flops, "gpu_flops");
      break;
    case TaskKind::adam:  // the rates are Adam's; another optimizer's update costs its bytes
      if (on_gpu)
        use(elements * optimizer_cost, p.gpu_adam_elements_per_s, "gpu_adam_elements_per_s");
      else
        use(elements * optimizer_cost, p.adam_elements_per_s, "adam_elements_per_s");
      break;
    case TaskKind::grad_stats:
      if (on_gpu && p.gpu_stats_elements_per_s > 0)  // 0: the Adam rate bounds it (above)
        use(elements, p.gpu_stats_elements_per_s, "gpu_stats_elements_per_s");
      else if (on_gpu)
        use(elements, p.gpu_adam_elements_per_s, "gpu_adam_elements_per_s");
      else
        use(elements, p.stats_elements_per_s, "stats_elements_per_s");
      break;
    case TaskKind::grad_accumulate:
      if (on_gpu)
        use(elements, p.gpu_adam_elements_per_s, "gpu_adam_elements_per_s");
      else
        use(elements, p.stats_elements_per_s, "stats_elements_per_s");
      break;
  }
  if (work > 0 && !(rate > 0))
    fail(
        "hardware profile '{}': {} is {}, but task {} ({} {} unit {}) needs it; measure it "
        "(strata tune) or set it in the profile",
        p.name, field, rate, task.id, lane.name(), task_kind_name(task.kind), task.unit);
  return (work > 0 ? work / rate : 0.0) + local + p.task_latency_s;
}

Prediction simulate(const Schedule& schedule, const HardwareProfile& profile, int steps) {
  if (steps < 1)
    fail("simulate: {} steps asked for; at least 1 is needed (3 reach the steady state)", steps);
  const std::vector<Task>& tasks = schedule.tasks;
  const size_t n = tasks.size();
  std::vector<double> duration(n);
  for (size_t i = 0; i < n; ++i) {
    const Task& t = tasks[i];
    if (t.lane < 0 || static_cast<size_t>(t.lane) >= schedule.lanes.size())
      fail("simulate: task {} is on lane {}, but the schedule has {} lanes; validate() it first",
           t.id, t.lane, schedule.lanes.size());
    duration[i] = task_seconds(t, schedule.lanes[static_cast<size_t>(t.lane)], schedule.ranks,
                               profile, schedule.optimizer_cost);
  }
  // Groups are consecutive: the end (one past) of the group starting at each task.
  std::vector<size_t> group_end(n, 0);
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    if (tasks[i].group >= 0)
      while (j < n && tasks[j].group == tasks[i].group) ++j;
    group_end[i] = j;
    i = j;
  }

  Prediction pred;
  Timeline& tl = pred.timeline;
  tl.steps = steps;
  tl.spans.reserve(n * static_cast<size_t>(steps));
  std::vector<double> lane_free(schedule.lanes.size(), 0.0);
  std::vector<double> end_prev(n, 0.0), start(n), end(n);
  SharedTimeline drives(profile.nvme_mixed);
  const bool cores_shared = profile.host_cpu_mixed > 0;
  SharedTimeline cores(cores_shared ? profile.host_cpu_mixed : 1.0);
  for (int s = 0; s < steps; ++s) {
    auto ready = [&](size_t i) {
      const Task& t = tasks[i];
      double r = lane_free[static_cast<size_t>(t.lane)];
      for (int d : t.deps) r = std::max(r, end[static_cast<size_t>(d)]);
      if (s > 0)
        for (int p : t.prev) r = std::max(r, end_prev[static_cast<size_t>(p)]);
      return r;
    };
    for (size_t i = 0; i < n; i = group_end[i]) {
      double at = 0, length = 0;
      for (size_t k = i; k < group_end[i]; ++k) {
        at = std::max(at, ready(k));
        length = std::max(length, duration[k]);
      }
      if (length > 0) {
        bool on_cores = cores_shared;
        for (size_t k = i; k < group_end[i]; ++k)
          on_cores = on_cores && runs_on_host_cores(schedule.lanes[size_t(tasks[k].lane)]);
        if (group_end[i] == i + 1 && is_nvme_lane(schedule.lanes[size_t(tasks[i].lane)]))
          at = drives.fit(at, length);
        else if (on_cores)  // a group is one call: it takes the cores once
          at = cores.fit(at, length);
      }
      for (size_t k = i; k < group_end[i]; ++k) {
        start[k] = at;
        end[k] = at + length;
        lane_free[static_cast<size_t>(tasks[k].lane)] = end[k];
        tl.spans.push_back(TaskSpan{static_cast<int>(k), s, start[k], end[k]});
      }
    }
    end_prev = end;
  }

  const StepStats st = step_stats(schedule, tl, steps - 1);
  pred.step_s = st.step_s;
  pred.critical_lane = st.busiest_lane;
  pred.overlap = st.overlap;
  pred.nvme_busy_s = st.nvme_busy_s;
  for (size_t l = 0; l < schedule.lanes.size(); ++l)
    pred.lanes.push_back(LaneTime{schedule.lanes[l].name(), st.lane_busy_s[l]});
  double first = n ? start[0] : 0;
  for (size_t i = 0; i < n; ++i) first = std::min(first, start[i]);
  pred.start_s.resize(n);
  pred.end_s.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pred.start_s[i] = start[i] - first;
    pred.end_s[i] = end[i] - first;
  }
  return pred;
}

}  // namespace strata
