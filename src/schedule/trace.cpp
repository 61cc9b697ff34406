// trace.cpp: timelines as Chrome trace JSON, their per-step statistics and their validation.
//
// A step's time is the end of its last task minus the end of the previous step's last task
// (for step 0: minus its first start), so that with steps overlapping (the next forward
// starting during the optimizer) consecutive step times add up to the run's length. A lane's
// busy time in a step is the sum of that step's task durations on it.
#include "schedule/trace.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>

namespace strata {

namespace {

std::string describe(const Schedule& s, int id) {
  const Task& t = s.tasks[static_cast<size_t>(id)];
  const std::string lane = t.lane >= 0 && static_cast<size_t>(t.lane) < s.lanes.size()
                               ? s.lanes[static_cast<size_t>(t.lane)].name()
                               : fmt::format("lane {}", t.lane);
  std::string d = fmt::format("task {} ({} {}", id, lane, task_kind_name(t.kind));
  if (t.unit >= 0) d += fmt::format(" u={}", t.unit);
  if (t.micro_batch >= 0) d += fmt::format(" m={}", t.micro_batch);
  return d + ")";
}

std::string ms(double seconds) {
  return fmt::format("{:.6f} ms", seconds * 1e3);
}

// spans[step][task]: the span, or null; fails on a span that names no task or step.
std::vector<std::vector<const TaskSpan*>> index_spans(const Schedule& s, const Timeline& tl) {
  if (tl.steps < 0) fail("timeline: {} steps; a timeline has 0 or more steps", tl.steps);
  std::vector<std::vector<const TaskSpan*>> at(static_cast<size_t>(tl.steps),
                                               std::vector<const TaskSpan*>(s.tasks.size()));
  for (const TaskSpan& sp : tl.spans) {
    if (sp.task < 0 || static_cast<size_t>(sp.task) >= s.tasks.size())
      fail("timeline: a span names task {}, but the schedule has tasks 0..{}", sp.task,
           static_cast<int>(s.tasks.size()) - 1);
    if (sp.step < 0 || sp.step >= tl.steps)
      fail("timeline: a span of {} names step {}, but the timeline has steps 0..{}",
           describe(s, sp.task), sp.step, tl.steps - 1);
    const TaskSpan*& slot = at[static_cast<size_t>(sp.step)][static_cast<size_t>(sp.task)];
    if (slot != nullptr)
      fail("timeline: {} ran twice in step {} (at {} and at {}); every task runs once a step",
           describe(s, sp.task), sp.step, ms(slot->start_s), ms(sp.start_s));
    slot = &sp;
  }
  return at;
}

}  // namespace

bool is_nvme_lane(const Lane& lane) {
  return lane.kind == LaneKind::nvme_read || lane.kind == LaneKind::nvme_write;
}

double union_seconds(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0, open = 0, close = 0;
  bool any = false;
  for (const auto& [a, b] : intervals) {
    if (b <= a) continue;
    if (!any || a > close) {
      if (any) total += close - open;
      open = a;
      close = b;
      any = true;
    } else {
      close = std::max(close, b);
    }
  }
  if (any) total += close - open;
  return total;
}

StepStats step_stats(const Schedule& schedule, const Timeline& timeline, int step) {
  if (step < 0 || step >= timeline.steps)
    fail("step statistics: step {} asked for, but the timeline has steps 0..{}", step,
         timeline.steps - 1);
  StepStats st;
  st.lane_busy_s.assign(schedule.lanes.size(), 0.0);
  constexpr double inf = std::numeric_limits<double>::infinity();
  double first = inf, last = -inf, last_before = -inf;
  std::vector<std::pair<double, double>> nvme;
  for (const TaskSpan& sp : timeline.spans) {
    if (sp.step == step - 1) last_before = std::max(last_before, sp.end_s);
    if (sp.task >= 0 && static_cast<size_t>(sp.task) < schedule.tasks.size() &&
        is_nvme_lane(
            schedule.lanes[static_cast<size_t>(schedule.tasks[static_cast<size_t>(sp.task)].lane)]))
      nvme.emplace_back(sp.start_s, sp.end_s);  // every step's: clipped to this one's period
    if (sp.step != step) continue;
    if (sp.task < 0 || static_cast<size_t>(sp.task) >= schedule.tasks.size())
      fail("step statistics: a span names task {}, but the schedule has {} tasks", sp.task,
           schedule.tasks.size());
    first = std::min(first, sp.start_s);
    last = std::max(last, sp.end_s);
    const int lane = schedule.tasks[static_cast<size_t>(sp.task)].lane;
    st.lane_busy_s[static_cast<size_t>(lane)] += sp.end_s - sp.start_s;
  }
  if (last == -inf) return st;  // nothing ran in that step
  const double begin = step > 0 && last_before > -inf ? last_before : first;
  st.step_s = last - begin;
  for (auto& [a, b] : nvme) {
    a = std::max(a, begin);
    b = std::min(b, last);
  }
  st.nvme_busy_s = union_seconds(std::move(nvme));
  for (size_t l = 0; l < st.lane_busy_s.size(); ++l)
    if (st.busiest_lane < 0 ||
        st.lane_busy_s[l] > st.lane_busy_s[static_cast<size_t>(st.busiest_lane)])
      st.busiest_lane = static_cast<int>(l);
  if (st.busiest_lane >= 0 && st.step_s > 0)
    st.overlap =
        std::max(st.lane_busy_s[static_cast<size_t>(st.busiest_lane)], st.nvme_busy_s) / st.step_s;
  return st;
}

std::string trace_json(const Schedule& schedule, const Timeline& timeline) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "strata"}}}});
  for (size_t l = 0; l < schedule.lanes.size(); ++l) {
    const int tid = static_cast<int>(l) + 1;
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", schedule.lanes[l].name()}}}});
    // Keeps the tracks in the schedule's lane order rather than by name.
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"sort_index", tid}}}});
  }
  for (const TaskSpan& sp : timeline.spans) {
    if (sp.task < 0 || static_cast<size_t>(sp.task) >= schedule.tasks.size())
      fail("trace: a span names task {}, but the schedule has {} tasks", sp.task,
           schedule.tasks.size());
    const Task& t = schedule.tasks[static_cast<size_t>(sp.task)];
    std::string name(task_kind_name(t.kind));
    if (t.unit >= 0) name += fmt::format(" u{}", t.unit);
    events.push_back({{"name", name},
                      {"cat", std::string(task_kind_name(t.kind))},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", t.lane + 1},
                      {"ts", sp.start_s * 1e6},
                      {"dur", (sp.end_s - sp.start_s) * 1e6},
                      {"args",
                       {{"task", t.id},
                        {"unit", t.unit},
                        {"micro_batch", t.micro_batch},
                        {"step", sp.step},
                        {"bytes", t.bytes},
                        {"local_bytes", t.local_bytes},
                        {"flops", t.flops},
                        {"elements", t.elements}}}});
  }
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  return doc.dump();
}

void write_trace(const std::string& path, const Schedule& schedule, const Timeline& timeline) {
  const std::string text = trace_json(schedule, timeline);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    fail("trace {}: cannot create it ({}); check that its directory exists and is writable", path,
         errno_text(errno));
  out << text << "\n";
  out.close();
  if (!out) fail("trace {}: writing failed ({}); check the free space", path, errno_text(errno));
}

void check_timeline(const Schedule& schedule, const Timeline& timeline) {
  const auto at = index_spans(schedule, timeline);
  const size_t n = schedule.tasks.size();
  for (int s = 0; s < timeline.steps; ++s)
    for (size_t i = 0; i < n; ++i) {
      const TaskSpan* sp = at[static_cast<size_t>(s)][i];
      if (sp == nullptr)
        fail("timeline: {} never ran in step {}; every task runs once a step",
             describe(schedule, static_cast<int>(i)), s);
      if (!std::isfinite(sp->start_s) || !std::isfinite(sp->end_s) || sp->end_s < sp->start_s)
        fail("timeline: {} in step {} runs from {} to {}; a span needs finite times, end >= start",
             describe(schedule, static_cast<int>(i)), s, ms(sp->start_s), ms(sp->end_s));
    }
  for (int s = 0; s < timeline.steps; ++s)
    for (size_t i = 0; i < n; ++i) {
      const Task& t = schedule.tasks[i];
      const TaskSpan& sp = *at[static_cast<size_t>(s)][i];
      auto before = [&](int dep, int dep_step, const char* what) {
        const TaskSpan& d = *at[static_cast<size_t>(dep_step)][static_cast<size_t>(dep)];
        if (sp.start_s < d.end_s)
          fail(
              "timeline: {} of step {} started at {}, before its {} {} of step {} ended at {} "
              "(on lane {})",
              describe(schedule, t.id), s, ms(sp.start_s), what, describe(schedule, dep), dep_step,
              ms(d.end_s), schedule.lanes[static_cast<size_t>(t.lane)].name());
      };
      for (int d : t.deps) before(d, s, "dependency");
      if (s > 0)
        for (int p : t.prev) before(p, s - 1, "previous-step dependency");
    }
  // Each lane runs its tasks one at a time, in schedule order, step after step.
  std::vector<const TaskSpan*> last(schedule.lanes.size(), nullptr);
  for (int s = 0; s < timeline.steps; ++s)
    for (size_t i = 0; i < n; ++i) {
      const Task& t = schedule.tasks[i];
      const TaskSpan& sp = *at[static_cast<size_t>(s)][i];
      const TaskSpan*& prev = last[static_cast<size_t>(t.lane)];
      if (prev != nullptr && sp.start_s < prev->end_s)
        fail(
            "timeline: {} of step {} started at {} on lane {} while {} of step {}, before it on "
            "that lane, ran until {}; a lane runs one task at a time, in schedule order",
            describe(schedule, t.id), s, ms(sp.start_s),
            schedule.lanes[static_cast<size_t>(t.lane)].name(), describe(schedule, prev->task),
            prev->step, ms(prev->end_s));
      prev = &sp;
    }
}

}  // namespace strata
