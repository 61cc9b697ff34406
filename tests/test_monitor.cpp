// test_monitor.cpp: the TensorBoard event files and CSV files of `strata train`'s monitors
// (train/monitor.h). CRC-32C against the check values of RFC 3720; the event file decoded
// here record by record and field by field (tests/reference/tfevents_reader.py decodes a
// training run's independently, in test_train_reference); the CSV files as DeepSpeed's
// csv_monitor writes them.
#include "train/monitor.h"

#include "testing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;

TEST(Crc32c, MatchesTheCheckValuesOfRfc3720) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  std::vector<unsigned char> b(32, 0x00);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x8A9136AAu);
  std::fill(b.begin(), b.end(), 0xFF);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x62A8AB43u);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x46DD794Eu);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x113FDB5Cu);
  // Continued over two pieces, the same as over the whole.
  EXPECT_EQ(crc32c(digits.data() + 4, 5, crc32c(digits.data(), 4)), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

// A decoder of what the writer writes, for the tests: TFRecord framing with both checksums,
// then the Event's fields.
struct Event {
  double wall_time = -1;
  int64_t step = -1;
  std::string file_version, tag;
  float value = NAN;
  int session_status = -1;  // SessionLog.status, where the event is one
};

uint32_t masked(const std::string& s) {
  const uint32_t c = crc32c(s.data(), s.size());
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

uint64_t varint(const std::string& b, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0; pos < b.size(); shift += 7) {
    const auto byte = static_cast<unsigned char>(b[pos++]);
    v |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80u) == 0) return v;
  }
  ADD_FAILURE() << "a varint runs past the end";
  return v;
}

std::string bytes(const std::string& b, size_t& pos) {
  const size_t n = varint(b, pos);
  EXPECT_LE(pos + n, b.size());
  std::string s = b.substr(pos, n);
  pos += n;
  return s;
}

Event decode_event(const std::string& b) {
  Event e;
  for (size_t pos = 0; pos < b.size();) {
    const uint64_t key = varint(b, pos);
    if (key == (1u << 3 | 1)) {
      std::memcpy(&e.wall_time, b.data() + pos, 8);
      pos += 8;
    } else if (key == (2u << 3 | 0)) {
      e.step = static_cast<int64_t>(varint(b, pos));
    } else if (key == (3u << 3 | 2)) {
      e.file_version = bytes(b, pos);
    } else if (key == (6u << 3 | 2)) {
      const std::string log = bytes(b, pos);
      size_t lp = 0;
      EXPECT_EQ(varint(log, lp), 1u << 3 | 0) << "SessionLog.status";
      e.session_status = static_cast<int>(varint(log, lp));
      EXPECT_EQ(lp, log.size());
    } else if (key == (5u << 3 | 2)) {
      const std::string summary = bytes(b, pos);
      size_t sp = 0;
      EXPECT_EQ(varint(summary, sp), 1u << 3 | 2) << "Summary.value";
      const std::string value = bytes(summary, sp);
      EXPECT_EQ(sp, summary.size()) << "one value per summary";
      size_t vp = 0;
      EXPECT_EQ(varint(value, vp), 1u << 3 | 2) << "Value.tag";
      e.tag = bytes(value, vp);
      EXPECT_EQ(varint(value, vp), 2u << 3 | 5) << "Value.simple_value";
      std::memcpy(&e.value, value.data() + vp, 4);
      EXPECT_EQ(vp + 4, value.size());
    } else {
      ADD_FAILURE() << "unexpected field key " << key;
      break;
    }
  }
  return e;
}

std::vector<Event> read_events(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  std::vector<Event> events;
  for (size_t pos = 0; pos < data.size();) {
    if (pos + 12 > data.size()) {
      ADD_FAILURE() << "a record header cut short";
      break;
    }
    const std::string header = data.substr(pos, 8);
    uint64_t length = 0;
    uint32_t header_crc = 0, body_crc = 0;
    std::memcpy(&length, header.data(), 8);
    std::memcpy(&header_crc, data.data() + pos + 8, 4);
    EXPECT_EQ(header_crc, masked(header)) << "record " << events.size();
    if (pos + 16 + length > data.size()) {
      ADD_FAILURE() << "a record cut short";
      break;
    }
    const std::string body = data.substr(pos + 12, length);
    std::memcpy(&body_crc, data.data() + pos + 12 + length, 4);
    EXPECT_EQ(body_crc, masked(body)) << "record " << events.size();
    events.push_back(decode_event(body));
    pos += 16 + length;
  }
  return events;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Monitor, TensorBoardEventsDecodeToTheScalarsWritten) {
  const test::TempDir dir("strata-monitor");
  MonitorSettings s;
  s.tensorboard.enabled = true;
  s.tensorboard.output_path = dir.path.string();
  s.tensorboard.job_name = "job";
  {
    Monitor m(s);
    ASSERT_TRUE(m.enabled());
    EXPECT_NE(m.describe().find((dir.path / "job").string()), std::string::npos) << m.describe();
    m.write({{"Train/Samples/train_loss", 5.5, 8}, {"Train/Samples/lr", 1e-3, 8}});
    // A step past 2^31 samples and a negative value survive the encoding.
    m.write({{"Train/Samples/train_loss", -0.25, int64_t{3} << 33}});
  }
  const std::vector<fs::path> files = event_files(dir.path / "job");
  ASSERT_EQ(files.size(), 1u);
  const std::vector<Event> e = read_events(files[0]);
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0].file_version, "brain.Event:2");
  EXPECT_GT(e[0].wall_time, 1.7e9);  // seconds since 1970, after 2023
  EXPECT_EQ(e[1].tag, "Train/Samples/train_loss");
  EXPECT_EQ(e[1].value, 5.5f);
  EXPECT_EQ(e[1].step, 8);
  EXPECT_EQ(e[2].tag, "Train/Samples/lr");
  EXPECT_EQ(e[2].value, 1e-3f);
  EXPECT_EQ(e[2].step, 8);
  EXPECT_EQ(e[3].value, -0.25f);
  EXPECT_EQ(e[3].step, int64_t{3} << 33);
  EXPECT_GE(e[3].wall_time, e[1].wall_time);

  // A second writer (a run resumed from the checkpoint at 8 samples) adds a file beside the
  // first, as TensorBoard expects, starting with a session start at 9: TensorBoard drops what
  // the first logged from 9 on.
  {
    Monitor m(s);
    m.resume_at(8);
    m.write({{"Train/Samples/train_loss", 4.0, 16}});
  }
  std::vector<fs::path> both = event_files(dir.path / "job");
  ASSERT_EQ(both.size(), 2u);
  if (read_events(both[0]).size() != 4u) std::swap(both[0], both[1]);  // same second: by pid
  const std::vector<Event> resumed = read_events(both[1]);
  ASSERT_EQ(resumed.size(), 3u);
  EXPECT_EQ(resumed[0].file_version, "brain.Event:2");
  EXPECT_EQ(resumed[1].session_status, 1) << "START";
  EXPECT_EQ(resumed[1].step, 9);
  EXPECT_EQ(resumed[1].tag, "");
  EXPECT_EQ(resumed[2].tag, "Train/Samples/train_loss");
  EXPECT_EQ(resumed[2].step, 16);
}

TEST(Monitor, CsvFilesAreDeepSpeedsAndAppendAcrossRuns) {
  const test::TempDir dir("strata-monitor");
  MonitorSettings s;
  s.csv.enabled = true;
  s.csv.directory = dir.path / "csv";
  {
    Monitor m(s);
    m.write({{"Train/Samples/train_loss", 5.519834487937217, 8}, {"Train/Samples/lr", 1e-05, 8}});
    m.write({{"Train/Samples/train_loss", 4.25, 16}, {"Train/Samples/lr", 2e-05, 16}});
  }
  EXPECT_EQ(slurp(dir.path / "csv" / "Train_Samples_train_loss.csv"),
            "step,train_loss\n8,5.519834487937217\n16,4.25\n");
  EXPECT_EQ(slurp(dir.path / "csv" / "Train_Samples_lr.csv"), "step,lr\n8,1e-05\n16,2e-05\n");
  {
    Monitor m(s);  // resumed: rows appended, the header not repeated
    m.write({{"Train/Samples/train_loss", 3.0, 24}, {"Eval/Samples/eval loss", 2.5, 24}});
  }
  EXPECT_EQ(slurp(dir.path / "csv" / "Train_Samples_train_loss.csv"),
            "step,train_loss\n8,5.519834487937217\n16,4.25\n24,3\n");
  EXPECT_EQ(slurp(dir.path / "csv" / "Eval_Samples_eval_loss.csv"), "step,eval loss\n24,2.5\n");
  // Resumed from the checkpoint at 8 samples after a kill cut a row short: the rows past 8 go
  // (they are trained again), the torn one too; another CSV file of the directory is not
  // touched.
  std::ofstream(dir.path / "csv" / "Train_Samples_lr.csv", std::ios::app) << "24,";
  std::ofstream(dir.path / "csv" / "other.csv") << "step,x\n100,1\n";
  {
    Monitor m(s);
    m.resume_at(8);
    m.write({{"Train/Samples/train_loss", 4.5, 16}});
  }
  EXPECT_EQ(slurp(dir.path / "csv" / "Train_Samples_train_loss.csv"),
            "step,train_loss\n8,5.519834487937217\n16,4.5\n");
  EXPECT_EQ(slurp(dir.path / "csv" / "Train_Samples_lr.csv"), "step,lr\n8,1e-05\n");
  EXPECT_EQ(slurp(dir.path / "csv" / "Eval_Samples_eval_loss.csv"), "step,eval loss\n");
  EXPECT_EQ(slurp(dir.path / "csv" / "other.csv"), "step,x\n100,1\n");
}

TEST(Monitor, DisabledWritesNothingAndAnUnusableDirectoryIsNamed) {
  const test::TempDir dir("strata-monitor");
  MonitorSettings off;
  off.tensorboard.output_path = off.csv.output_path = dir.path.string();
  {
    Monitor m(off);
    EXPECT_FALSE(m.enabled());
    EXPECT_EQ(m.describe(), "");
    m.write({{"Train/Samples/train_loss", 1.0, 1}});
  }
  EXPECT_TRUE(fs::is_empty(dir.path));

  std::ofstream(dir.path / "file") << "x";
  for (const bool tensorboard : {true, false}) {
    MonitorSettings s;
    MonitorTarget& t = tensorboard ? s.tensorboard : s.csv;
    t.enabled = true;
    t.output_path = (dir.path / "file").string();  // a file where the directory would go
    t.job_name = "job";
    test::expect_error([&] { Monitor m(s); },
                       {tensorboard ? "tensorboard" : "csv_monitor",
                        (dir.path / "file" / "job").string(), "output_path"});
  }
}

}  // namespace
}  // namespace strata
