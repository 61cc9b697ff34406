// monitor.h: each training step's scalars, written where DeepSpeed's monitors write them (the
// config's "tensorboard" and "csv_monitor" sections), so the TensorBoard and the scripts a
// DeepSpeed user already has read a strata run as they read a DeepSpeed one.
//
// - TensorBoard: an event file (`events.out.tfevents.<seconds>.<host>.<pid>.0`) in
//   output_path/job_name: TFRecords (length, masked CRC-32C of the length, an Event protocol
//   buffer, masked CRC-32C of it), the first holding the file version, each next one a scalar
//   summary. A resumed run adds a new file beside the old ones, as a restarted SummaryWriter
//   does, beginning with a session start at the first step it trains (SummaryWriter's
//   purge_step), so TensorBoard drops what an interrupted run logged past its checkpoint.
// - CSV: one file per scalar in output_path/job_name, named by its tag with '/' and ' ' made
//   '_' (`Train_Samples_train_loss.csv`), a header `step,<last part of the tag>` and a row per
//   step, appended to across resumes, with the rows past the checkpoint resumed from dropped.
//
// The tags and steps are DeepSpeed's: `Train/Samples/train_loss`, `Train/Samples/lr` and, with
// fp16, `Train/Samples/loss_scale`, each at the number of samples trained so far.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc`: the checksum
// TFRecords carry.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

// Keeps the lines of a text file for which keep(line, index) holds, through a temporary file
// renamed over it when any goes (a missing file is left missing); `what` names the file's role
// in errors. For logs that a resumed run trims back to its checkpoint.
void keep_lines(const std::filesystem::path& file,
                const std::function<bool(const std::string& line, size_t index)>& keep,
                std::string_view what);

// One of DeepSpeed's monitor sections: off unless enabled; writes to output_path/job_name, or
// to `directory` where a flag gave one.
struct MonitorTarget {
  bool enabled = false;
  std::string output_path;                    // DeepSpeed's default: "" (the working directory)
  std::string job_name = "DeepSpeedJobName";  // DeepSpeed's default
  std::filesystem::path directory;
  std::filesystem::path dir() const {
    return directory.empty() ? std::filesystem::path(output_path) / job_name : directory;
  }
};

struct MonitorSettings {
  MonitorTarget tensorboard, csv;
  bool enabled() const { return tensorboard.enabled || csv.enabled; }
};

struct MonitorEvent {
  std::string tag;  // "Train/Samples/train_loss"
  double value = 0;
  int64_t step = 0;  // samples so far
};

// Writes TensorBoard's event file. Throws Error naming the file when it cannot be created or
// written.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  void scalar(std::string_view tag, float value, int64_t step, double wall_time);
  // A session start at `step`: TensorBoard discards the events of earlier files at `step` and
  // after (what a run logged past the checkpoint it is resumed from).
  void restart_at(int64_t step, double wall_time);
  void flush();
  const std::filesystem::path& file() const { return file_; }

 private:
  void record(const std::string& event);
  std::filesystem::path file_;
  std::ofstream out_;
};

// One CSV file per tag; a file's header is written when the file is new or empty.
class CsvMonitor {
 public:
  explicit CsvMonitor(const std::filesystem::path& dir);
  void scalar(const std::string& tag, double value, int64_t step);
  // Drops the rows past `step` from the files of this directory (before any is written to).
  void trim_after(int64_t step);
  void flush();
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::ofstream> files_;
};

// The monitors the settings enable.
class Monitor {
 public:
  explicit Monitor(const MonitorSettings& settings);
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;
  bool enabled() const;
  // Writes the events to every enabled monitor, then flushes them (so a dashboard follows the
  // run, and a killed run loses nothing it wrote).
  void write(const std::vector<MonitorEvent>& events);
  // A run resumed from the checkpoint at `step` (samples): what was logged after it is dropped,
  // since those steps are trained again.
  void resume_at(int64_t step);
  // Where the monitors write, for the start of a run ("" when none is enabled).
  std::string describe() const;

 private:
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<CsvMonitor> csv_;
};

}  // namespace strata
