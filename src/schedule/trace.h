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
#include <utility>
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
//
// The nvme.read and nvme.write lanes share the drives (one swap store over every nvme path;
// the lanes run at once, each on its own ring, and split the drives' bandwidth), so the NVMe
// tier's busy time is the union of their busy intervals, not either lane's. The overlap is
// the busiest resource's share of the step: the busiest lane's busy time, or the drives' when
// that is larger, over the step time.
struct StepStats {
  double step_s = 0;
  std::vector<double> lane_busy_s;  // per lane of the schedule
  int busiest_lane = -1;
  double nvme_busy_s = 0;  // the union of the nvme lanes' busy intervals
  double overlap = 0;      // max(busiest lane's busy time, nvme_busy_s) / step_s
};
// Whether a lane is one of the NVMe tier's (they share the drives).
bool is_nvme_lane(const Lane& lane);
// The length of the union of [start, end) intervals.
double union_seconds(std::vector<std::pair<double, double>> intervals);
StepStats step_stats(const Schedule& schedule, const Timeline& timeline, int step);

std::string trace_json(const Schedule& schedule, const Timeline& timeline);
void write_trace(const std::string& path, const Schedule& schedule, const Timeline& timeline);

// Throws Error naming the first violation (task, step, lane and the times involved).
void check_timeline(const Schedule& schedule, const Timeline& timeline);

}  // namespace strata
