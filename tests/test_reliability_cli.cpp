// test_reliability_cli.cpp: nothing is lost under crashes and faults (issue 9), each case
// driving the real binary as a user's run does: host backend, the tiny model, its optimizer
// state homed on the NVMe tier (so swap writes happen every step) and a checkpoint every two
// steps.
//   - SIGKILL at random moments and while a checkpoint is being written, at least 20 times,
//     resuming after each: every complete checkpoint stays intact, each resume starts from the
//     newest one, and the final files equal an uninterrupted run's byte for byte;
//   - a flipped byte anywhere in a checkpoint is named (file, and tensor for a safetensors
//     file), and resume refuses it unless --resume-fallback;
//   - injected NVMe faults (EIO, ENOSPC, a corrupted block) stop the run naming the swap file
//     and the operation; the last checkpoint verifies and resumes to the uninterrupted result;
//     short I/O is resumed and changes nothing;
//   - a checkpoint write that fails part-way (the file-size limit) leaves the previous one.
#include "model/safetensors.h"
#include "train/checkpoint.h"
#include "train/checkpoint_dir.h"
#include "train_cli_testing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <thread>

extern char** environ;

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::slurp;

using Clock = std::chrono::steady_clock;

// A `strata` process started with fork/exec, its output in a log file.
struct Child {
  pid_t pid = -1;
  fs::path log;
};

struct SpawnOptions {
  std::vector<std::string> env;  // NAME=VALUE added to ours
  uint64_t file_size_limit = 0;  // RLIMIT_FSIZE (SIGXFSZ ignored, so writes fail with EFBIG)
};

Child spawn(const std::string& args, const fs::path& log, const SpawnOptions& o = {}) {
  // Everything the child needs is built before fork: it only calls async-signal-safe functions.
  std::vector<std::string> words{STRATA_BINARY};
  std::istringstream in(test::on_host_unless_named(args));
  for (std::string w; in >> w;) words.push_back(w);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings = o.env;
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0) << log;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    if (o.file_size_limit > 0) {
      ::signal(SIGXFSZ, SIG_IGN);
      const rlimit rl{o.file_size_limit, o.file_size_limit};
      ::setrlimit(RLIMIT_FSIZE, &rl);
    }
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(fd);
  return {pid, log};
}

// Waits for the child; its exit status, or -1 when it was killed, or -2 when it was still
// running after `timeout_s` (a hang: it is then killed).
int wait_exit(const Child& c, double timeout_s = 120) {
  const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    int st = 0;
    const pid_t r = ::waitpid(c.pid, &st, WNOHANG);
    if (r == c.pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (Clock::now() > end) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &st, 0);
      return -2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// Whether the child has exited (reaping it) within `s` seconds.
bool exited_within(const Child& c, double s) {
  const auto end = Clock::now() + std::chrono::duration<double>(s);
  while (Clock::now() < end) {
    int st = 0;
    if (::waitpid(c.pid, &st, WNOHANG) == c.pid) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

void kill_child(const Child& c) {
  ::kill(c.pid, SIGKILL);
  int st = 0;
  ::waitpid(c.pid, &st, 0);
}

// Whether a checkpoint of `run` was being written or removed: a temporary directory, one
// being removed, or a step directory without its COMPLETE marker.
bool checkpoint_in_progress(const fs::path& run) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run / kCheckpointsFolder, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-step-", 0) == 0 || name.rfind(".old-step-", 0) == 0) return true;
    if (checkpoint_step(name) && !fs::exists(e.path() / kCheckpointCompleteMarker)) return true;
  }
  return false;
}

// The loss of each step, the last record of a step winning (a resumed run repeats steps).
std::map<int64_t, double> losses(const fs::path& run) {
  std::map<int64_t, double> out;
  for (const json& j : test::metrics(run)) out[j["step"].get<int64_t>()] = j["loss"];
  return out;
}

void expect_same_final_files(const fs::path& a, const fs::path& b, int64_t step) {
  const fs::path last = fs::path(kCheckpointsFolder) / checkpoint_dir_name(step);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(slurp(a / last / file) == slurp(b / last / file))
        << file << " of step " << step << " differs from the uninterrupted run's";
  EXPECT_EQ(losses(a), losses(b));
}

std::string base_args(const fs::path& data, int64_t steps, int keep = 2) {
  return "train --model tiny --init random --seed 5 --seq-len 32 --micro-batch 2 --lr 2e-3 "
         "--clip 0.5 --threads 1 --offload-optimizer nvme --offload-param cpu --save-every 2 "
         "--steps-per-print 1 --keep " +
         std::to_string(keep) + " --data " + data.string() + " --steps " + std::to_string(steps);
}

TEST(Reliability, SigkillAnywhereLosesNothing) {
  const test::TempDir dir("strata-crash");
  const fs::path data = test::make_data(dir.path), a = dir.path / "a", b = dir.path / "b";
  constexpr int64_t kSteps = 200;
  const std::string base = base_args(data, kSteps);

  // How long a run takes to start and write its first checkpoint, and a whole run.
  auto t0 = Clock::now();
  const Child first = spawn(base_args(data, 2) + " --run-dir " + (dir.path / "first").string(),
                            dir.path / "first.log");
  ASSERT_EQ(wait_exit(first), 0) << slurp(first.log);
  const double startup = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  const Child ref = spawn(base + " --run-dir " + a.string(), dir.path / "a.log");
  ASSERT_EQ(wait_exit(ref), 0) << slurp(ref.log);
  const double whole = std::chrono::duration<double>(Clock::now() - t0).count();

  // Kills come after a random delay of at most the start-up time and a twentieth of a run, so
  // each attempt moves the run a little (or not at all: some die while starting or restoring);
  // every third one instead waits for a checkpoint to be in progress.
  std::mt19937_64 rng(20261123);
  std::uniform_real_distribution<double> delay(0.0, startup + whole / 20);
  int kills = 0, mid_checkpoint = 0, resumes_checked = 0, restarts = 0;
  for (int attempt = 0; attempt < 80 && kills < 24; ++attempt) {
    const auto done = complete_checkpoints(b);
    const std::string args = base + " --run-dir " + b.string() + (done.empty() ? "" : " --resume");
    const Child c = spawn(args, dir.path / "b.log");
    bool finished = false;
    if (kills % 3 == 2) {
      // Each attempt starts (or restores) again before it steps: the wait allows for that.
      const auto end = Clock::now() + std::chrono::duration<double>(startup + whole / 12);
      while (Clock::now() < end && !checkpoint_in_progress(b))
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      finished = exited_within(c, 0);
    } else {
      finished = exited_within(c, delay(rng));
    }
    if (finished) {
      // A loaded machine can make the delays long against the run: the run got to its end
      // between kills. Check it and start the crash run over.
      expect_same_final_files(a, b, kSteps);
      fs::remove_all(b);
      ++restarts;
      continue;
    }
    kill_child(c);
    ++kills;
    if (checkpoint_in_progress(b)) ++mid_checkpoint;
    // Nothing complete is ever damaged, and a resume starts from the newest complete one.
    for (const auto& [step, path] : complete_checkpoints(b))
      EXPECT_EQ(checkpoint_damage(path), "") << "after kill " << kills;
    const std::string out = slurp(c.log);
    if (!done.empty() && out.find("resumed from ") != std::string::npos) {
      ++resumes_checked;
      EXPECT_NE(out.find("resumed from " + done.back().second.string() + " at step " +
                         std::to_string(done.back().first)),
                std::string::npos)
          << out;
    }
  }
  EXPECT_GE(kills, 20);
  EXPECT_GE(mid_checkpoint, 1) << "no kill landed while a checkpoint was being written";
  const Child last = spawn(
      base + " --run-dir " + b.string() + (complete_checkpoints(b).empty() ? "" : " --resume"),
      dir.path / "b.log");
  ASSERT_EQ(wait_exit(last), 0) << slurp(last.log);
  expect_same_final_files(a, b, kSteps);
  RecordProperty("kills", kills);
  RecordProperty("kills_during_checkpoint_writes", mid_checkpoint);
  RecordProperty("resumes_checked", resumes_checked);
  RecordProperty("runs_that_ended_between_kills", restarts);
  std::printf("%d kills (%d while a checkpoint was being written), %d resumes checked\n", kills,
              mid_checkpoint, resumes_checked);
}

// Flips one bit of byte `at` of `file`.
void flip(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x01));
}

TEST(Reliability, AFlippedByteAnywhereIsNamed) {
  const test::TempDir dir("strata-flip");
  const fs::path data = test::make_data(dir.path), run = dir.path / "run";
  test::CommandResult r = test::strata(base_args(data, 6, 0) + " --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const fs::path ckpt = run / "checkpoints/step-6";
  ASSERT_EQ(checkpoint_damage(ckpt), "");
  // The small files byte by byte; the safetensors files at their edges and at random places.
  std::mt19937_64 rng(9);
  int tried = 0;
  for (const char* name : {"COMPLETE", "config.json", "trainer_state.json", "model.safetensors",
                           "optimizer.safetensors"}) {
    const fs::path file = ckpt / name;
    const uint64_t size = fs::file_size(file);
    std::vector<uint64_t> at;
    if (size < 8192) {
      for (uint64_t i = 0; i < size; ++i) at.push_back(i);
    } else {
      at = {0, 7, 8, 9, 100, size / 2, size - 1};
      for (int i = 0; i < 40; ++i) at.push_back(rng() % size);
    }
    for (uint64_t i : at) {
      flip(file, i);
      const std::string d = checkpoint_damage(ckpt);
      EXPECT_NE(d.find(name), std::string::npos) << name << " byte " << i << ": '" << d << "'";
      flip(file, i);
      ++tried;
    }
  }
  EXPECT_EQ(checkpoint_damage(ckpt), "");
  RecordProperty("bytes_flipped", tried);

  // A flipped data byte names the tensor; resume refuses and says what to do.
  const fs::path opt = ckpt / "optimizer.safetensors";
  const SafetensorsReader reader = SafetensorsReader::open(opt);
  const SafetensorsEntry& victim = reader.tensors().at(1);
  flip(opt, victim.offset + victim.bytes / 2);
  // A resume verifies the optimizer file's tensors as it reads them (checkpoint_damage without
  // optimizer_data passes the checkpoint); the whole check names the tensor.
  EXPECT_EQ(checkpoint_damage(ckpt, false), "");
  EXPECT_NE(checkpoint_damage(ckpt).find(victim.name), std::string::npos);
  const std::string resume = base_args(data, 8, 0) + " --run-dir " + run.string();
  r = test::strata(resume + " --resume");
  EXPECT_NE(r.status, 0);
  for (const std::string& part : {ckpt.string(), std::string("optimizer.safetensors"), victim.name,
                                  std::string("--resume-fallback"), std::string("step-4")})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from:\n" << r.out;
  // So does --resume-from the checkpoint itself, which the restore finds damaged.
  r = test::strata(resume + " --resume-from " + ckpt.string());
  EXPECT_NE(r.status, 0);
  for (const std::string& part : {ckpt.string(), std::string("optimizer.safetensors"), victim.name,
                                  std::string("--resume-fallback")})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from:\n" << r.out;
  EXPECT_EQ(r.out.find("resumed from"), std::string::npos) << r.out;
  r = test::strata("export " + run.string() + " --out " + (dir.path / "hf").string());
  EXPECT_NE(r.status, 0) << "a damaged checkpoint was exported";
  EXPECT_NE(r.out.find(victim.name), std::string::npos) << r.out;
  // A truncated file is named with both sizes.
  fs::resize_file(run / "checkpoints/step-4/model.safetensors", 1000);
  EXPECT_NE(checkpoint_damage(run / "checkpoints/step-4").find("model.safetensors is 1000 bytes"),
            std::string::npos);

  // --resume-fallback skips both damaged ones, resumes from step 2 and ends where an
  // uninterrupted run does. The damaged ones are set aside whole, not taken for the resumed
  // run's newest by the --keep rotation.
  r = test::strata(resume + " --resume-fallback");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + (run / "checkpoints/step-2").string()), std::string::npos)
      << r.out;
  for (const char* aside : {"abandoned-step-4", "abandoned-step-6"}) {
    EXPECT_TRUE(fs::exists(run / "checkpoints" / aside / "COMPLETE")) << aside << ": " << r.out;
    EXPECT_NE(checkpoint_damage(run / "checkpoints" / aside), "") << aside;
  }
  const fs::path ref = dir.path / "ref";
  r = test::strata(base_args(data, 8) + " --run-dir " + ref.string());
  ASSERT_EQ(r.status, 0) << r.out;
  expect_same_final_files(ref, run, 8);
}

// The first run with STRATA_NVME_FAULTS=KIND@K, for K growing from 8, that fails after having
// completed at least one checkpoint; its output.
std::string first_failure_after_a_checkpoint(const std::string& kind, const std::string& base,
                                             const fs::path& dir) {
  for (uint64_t k = 8; k < 20000; k = k * 3 / 2) {
    const fs::path run = dir / (kind + "-" + std::to_string(k));
    const Child c = spawn(base + " --run-dir " + run.string(), dir / (kind + ".log"),
                          {{"STRATA_NVME_FAULTS=" + kind + "@" + std::to_string(k)}});
    const int status = wait_exit(c, 60);
    if (status == -2) {
      ADD_FAILURE() << kind << "@" << k << ": the run hung\n" << slurp(c.log);
      return "";
    }
    if (status != 0 && !complete_checkpoints(run).empty()) {
      fs::rename(run, dir / "faulted");
      return slurp(c.log);
    }
    fs::remove_all(run);
  }
  ADD_FAILURE() << kind << ": no fault position failed the run after a checkpoint";
  return "";
}

TEST(Reliability, NvmeFaultsStopCleanlyAndTheLastCheckpointResumes) {
  const test::TempDir dir("strata-faults");
  const fs::path data = test::make_data(dir.path), ref = dir.path / "ref";
  const std::string base = base_args(data, 8);
  test::CommandResult r = test::strata(base + " --run-dir " + ref.string());
  ASSERT_EQ(r.status, 0) << r.out;

  const std::map<std::string, std::vector<std::string>> expect = {
      {"eio", {"Input/output error"}},
      {"enospc", {"No space left on device"}},
      {"corrupt", {"checksum", "read"}}};
  for (const auto& [kind, parts] : expect) {
    SCOPED_TRACE(kind);
    const fs::path run = dir.path / "faulted";
    fs::remove_all(run);
    const std::string out = first_failure_after_a_checkpoint(kind, base, dir.path);
    if (out.empty()) continue;
    EXPECT_NE(out.find("strata-swap.bin"), std::string::npos) << out;
    EXPECT_TRUE(out.find("read") != std::string::npos || out.find("write") != std::string::npos)
        << out;
    for (const std::string& p : parts) EXPECT_NE(out.find(p), std::string::npos) << out;
    for (const auto& [step, path] : complete_checkpoints(run))
      EXPECT_EQ(checkpoint_damage(path), "");
    r = test::strata(base + " --run-dir " + run.string() + " --resume");
    ASSERT_EQ(r.status, 0) << r.out;
    expect_same_final_files(ref, run, 8);
  }

  // Short reads and writes are resumed where they stopped: the run is unchanged.
  const fs::path run = dir.path / "short";
  const Child c = spawn(base + " --run-dir " + run.string(), dir.path / "short.log",
                        {{"STRATA_NVME_FAULTS=short@1,short@4,short@9,short@30,short@31"}});
  ASSERT_EQ(wait_exit(c, 60), 0) << slurp(c.log);
  expect_same_final_files(ref, run, 8);
}

TEST(Reliability, AFailedCheckpointWriteKeepsThePreviousOne) {
  const test::TempDir dir("strata-efbig");
  const fs::path data = test::make_data(dir.path), run = dir.path / "run", ref = dir.path / "ref";
  // Optimizer state on the CPU: the swap file's preallocation would hit the limit first.
  const std::string base =
      "train --model tiny --init random --seed 5 --seq-len 32 --micro-batch 2 --lr 2e-3 "
      "--threads 1 --save-every 2 --keep 2 --data " +
      data.string();
  test::CommandResult r = test::strata(base + " --steps 6 --run-dir " + ref.string());
  ASSERT_EQ(r.status, 0) << r.out;
  r = test::strata(base + " --steps 2 --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  // 1 MB: model.safetensors fits, optimizer.safetensors (3 fp32 copies) does not.
  const uint64_t limit = 1'000'000;
  ASSERT_GT(fs::file_size(run / "checkpoints/step-2/optimizer.safetensors"), limit);
  const Child c = spawn(base + " --steps 6 --resume --run-dir " + run.string(),
                        dir.path / "efbig.log", {{}, limit});
  EXPECT_NE(wait_exit(c), 0);
  const std::string out = slurp(c.log);
  EXPECT_NE(out.find("optimizer.safetensors"), std::string::npos) << out;
  EXPECT_NE(out.find("File too large"), std::string::npos) << out;
  EXPECT_NE(out.find("ulimit -f"), std::string::npos) << out;  // reserved, so refused up front
  const auto done = complete_checkpoints(run);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done.back().first, 2);
  EXPECT_EQ(checkpoint_damage(done.back().second), "");
  r = test::strata(base + " --steps 6 --resume --run-dir " + run.string());
  ASSERT_EQ(r.status, 0) << r.out;
  expect_same_final_files(ref, run, 6);
  // The interrupted save's temporary directory does not outlive the next save.
  EXPECT_FALSE(checkpoint_in_progress(run));
}

}  // namespace
}  // namespace strata
