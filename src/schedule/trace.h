// trace.h: a step's timeline as Chrome / Perfetto trace JSON, one track per lane, and its
// validation against the schedule.
//
// The executor records, for every task it runs, the lane, the step and the start and end
// times; the simulator's prediction gives the same for its steps. write_trace() emits the
// trace-event format (`"ph": "X"` complete events, microseconds, one `tid` per lane named by
// a thread_name metadata event) that chrome://tracing and ui.perfetto.dev open.
// check_timeline() is what the tests call: every task of every step ran exactly once, on its
// lane, never overlapping another task of that lane, never before its dependencies (this
// step's and the previous step's `prev`) had ended.
#pragma once

#include "schedule/schedule.h"

#include <string>
#include <vector>

namespace strata {

struct TaskSpan {
  int task = 0;  // id in the schedule
  int step = 0;  // 0, 1, ... in the order run
  double start_s = 0;
  double end_s = 0;
};

struct Timeline {
  std::vector<TaskSpan> spans;  // any order
  int steps = 0;
};

// The lanes' busy times, the step times and the overlap of step `step` of a timeline.
struct StepStats {
  double step_s = 0;
  std::vector<double> lane_busy_s;  // per lane of the schedule
  int busiest_lane = -1;
  double overlap = 0;  // busiest lane's busy time / step_s
};
StepStats step_stats(const Schedule& schedule, const Timeline& timeline, int step);

std::string trace_json(const Schedule& schedule, const Timeline& timeline);
void write_trace(const std::string& path, const Schedule& schedule, const Timeline& timeline);

// Throws Error naming the first violation (task, step, lane and the times involved).
void check_timeline(const Schedule& schedule, const Timeline& timeline);

}  // namespace strata
