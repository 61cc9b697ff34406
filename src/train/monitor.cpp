// monitor.cpp: TensorBoard event files and DeepSpeed's CSV files (see monitor.h).
#include "train/monitor.h"

#include "core/error.h"
#include "model/file_io.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace strata {

namespace fs = std::filesystem;

namespace {

// The table of the reflected CRC-32C, one byte at a time (the records are a few dozen bytes).
constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32c = crc32c_table();

// TFRecord's checksum: the CRC rotated right by 15 bits plus a constant, so that a CRC of
// data holding CRCs is not degenerate.
uint32_t masked_crc(const void* data, size_t bytes) {
  const uint32_t c = crc32c(data, bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protocol buffer wire format: what an Event with a scalar summary needs.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <typename T>
void put_fixed(std::string& out, T v) {
  static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_varint(out, uint64_t{field} << 3 | 2);  // length-delimited
  put_varint(out, bytes.size());
  out.append(bytes);
}
// Event.wall_time (1, double) and Event.step (2, int64).
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1u << 3 | 1);  // 64-bit
  put_fixed(e, wall_time);
  put_varint(e, 2u << 3 | 0);  // varint
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

// Seconds since 1970, as Event.wall_time holds them.
double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

void make_dir(const fs::path& dir, std::string_view what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail(
        "{} {}: cannot create the directory ({}); name one this user can write (the "
        "config's output_path and job_name, or the --{}-dir flag)",
        what, dir.string(), ec ? ec.message() : "a file of that name is in the way",
        what == "csv_monitor" ? "csv-monitor" : what);
}

}  // namespace

void keep_lines(const fs::path& file,
                const std::function<bool(const std::string& line, size_t index)>& keep,
                std::string_view what) {
  std::ifstream in(file);
  if (!in) return;
  std::string kept, line;
  bool dropped = false;
  for (size_t i = 0; std::getline(in, line); ++i) {
    if (keep(line, i))
      kept += line + "\n";
    else
      dropped = true;
  }
  if (in.bad()) fail("{} {}: reading it failed; check the file and the disk", what, file.string());
  if (!dropped) return;
  AtomicFile out(file);  // its errors name the file
  out.write(kept.data(), kept.size());
  out.commit();
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < bytes; ++i) c = kCrc32c[(c ^ p[i]) & 0xffu] ^ (c >> 8);
  return ~c;
}

TensorBoardWriter::TensorBoardWriter(const fs::path& dir) {
  make_dir(dir, "tensorboard");
  // Named as TensorBoard's own writers name theirs; the last part tells apart two writers of
  // one process started in the same second.
  static std::atomic<int> serial{0};
  file_ = dir / fmt::format("events.out.tfevents.{:010d}.{}.{}.{}",
                            static_cast<long long>(std::time(nullptr)), host_name(), getpid(),
                            serial++);
  out_.open(file_, std::ios::binary | std::ios::app);
  if (!out_)
    fail("tensorboard {}: cannot create the event file ({}); check the directory's permissions",
         file_.string(), std::strerror(errno));
  // The first event says which version of the format follows.
  std::string e = event_header(unix_seconds(), 0);
  put_bytes(e, 3, "brain.Event:2");
  record(e);
  flush();
}

void TensorBoardWriter::record(const std::string& event) {
  std::string header;
  put_fixed(header, static_cast<uint64_t>(event.size()));
  put_fixed(header, masked_crc(header.data(), sizeof(uint64_t)));
  out_.write(header.data(), static_cast<std::streamsize>(header.size()));
  out_.write(event.data(), static_cast<std::streamsize>(event.size()));
  const uint32_t crc = masked_crc(event.data(), event.size());
  out_.write(reinterpret_cast<const char*>(&crc), sizeof crc);
}

void TensorBoardWriter::scalar(std::string_view tag, float value, int64_t step, double wall_time) {
  std::string v;  // Summary.Value: tag (1), simple_value (2, float)
  put_bytes(v, 1, tag);
  put_varint(v, 2u << 3 | 5);  // 32-bit
  put_fixed(v, value);
  std::string summary;  // Summary: value (1, repeated)
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);  // Event.summary (5)
  record(e);
}

void TensorBoardWriter::restart_at(int64_t step, double wall_time) {
  std::string e = event_header(wall_time, step);
  put_bytes(e, 6, std::string_view("\x08\x01", 2));  // Event.session_log: status START
  record(e);
}

void TensorBoardWriter::flush() {
  out_.flush();
  if (!out_)
    fail("tensorboard {}: writing the event file failed ({}); check the disk's free space",
         file_.string(), std::strerror(errno));
}

CsvMonitor::CsvMonitor(const fs::path& dir) : dir_(dir) {
  make_dir(dir, "csv_monitor");
}

void CsvMonitor::scalar(const std::string& tag, double value, int64_t step) {
  auto it = files_.find(tag);
  if (it == files_.end()) {
    std::string name = tag;
    for (char& c : name)
      if (c == '/' || c == ' ') c = '_';
    const fs::path path = dir_ / (name + ".csv");
    std::error_code ec;
    const bool fresh = !fs::exists(path, ec) || fs::file_size(path, ec) == 0;
    std::ofstream f(path, std::ios::app);
    if (!f)
      fail("csv_monitor {}: cannot open the file ({}); check the directory's permissions",
           path.string(), std::strerror(errno));
    if (fresh) f << "step," << tag.substr(tag.rfind('/') + 1) << "\n";
    it = files_.emplace(tag, std::move(f)).first;
  }
  it->second << step << "," << fmt::format("{}", value) << "\n";
}

void CsvMonitor::trim_after(int64_t step) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const fs::path& path = entry.path();
    // Only the files of the tags strata writes: the directory may hold others.
    const std::string name = path.filename().string();
    if (path.extension() != ".csv" ||
        (name.rfind("Train_Samples_", 0) != 0 && name.rfind("Eval_Samples_", 0) != 0))
      continue;
    // The header, then rows `step,value`; a row cut short by a kill has no value and goes.
    keep_lines(
        path,
        [step](const std::string& line, size_t index) {
          const size_t comma = line.find(',');
          int64_t row_step = 0;
          return index == 0 ||
                 (comma != std::string::npos && comma + 1 < line.size() &&
                  std::sscanf(line.c_str(), "%" SCNd64, &row_step) == 1 && row_step <= step);
        },
        "csv_monitor");
  }
}

void CsvMonitor::flush() {
  for (auto& [tag, f] : files_) {
    f.flush();
    if (!f)
      fail("csv_monitor {}: writing the file for {} failed ({}); check the disk's free space",
           dir_.string(), tag, std::strerror(errno));
  }
}

Monitor::Monitor(const MonitorSettings& s) {
  if (s.tensorboard.enabled)
    tensorboard_ = std::make_unique<TensorBoardWriter>(s.tensorboard.dir());
  if (s.csv.enabled) csv_ = std::make_unique<CsvMonitor>(s.csv.dir());
}

Monitor::~Monitor() = default;

bool Monitor::enabled() const {
  return tensorboard_ != nullptr || csv_ != nullptr;
}

void Monitor::write(const std::vector<MonitorEvent>& events) {
  const double now = unix_seconds();
  for (const MonitorEvent& e : events) {
    if (tensorboard_) tensorboard_->scalar(e.tag, static_cast<float>(e.value), e.step, now);
    if (csv_) csv_->scalar(e.tag, e.value, e.step);
  }
  if (tensorboard_) tensorboard_->flush();
  if (csv_) csv_->flush();
}

void Monitor::resume_at(int64_t step) {
  if (tensorboard_) {
    tensorboard_->restart_at(step + 1, unix_seconds());
    tensorboard_->flush();
  }
  if (csv_) csv_->trim_after(step);
}

std::string Monitor::describe() const {
  std::string s;
  if (tensorboard_) s = fmt::format("tensorboard {}", tensorboard_->file().string());
  if (csv_) s += fmt::format("{}csv {}/", s.empty() ? "" : "; ", csv_->dir().string());
  return s;
}

}  // namespace strata
