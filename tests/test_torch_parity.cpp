// test_torch_parity.cpp: strata's CPU Adam against torch.optim.AdamW and torch.optim.Adam.
//
// Runs tests/reference/adam_reference.py (with the Python that has Debian's python3-torch,
// compiled in as STRATA_PYTHON) into a temporary directory, replays the same inputs through
// CpuAdam on every SIMD path, and compares the whole 100-step fp32 trajectory and the final m, v
// with |ours - torch| <= 1e-6 |torch| + 1e-7 (an absolute term for values near zero).
// Without torch the test reports a skip, not a pass.
#include "cpu_adam/cpu_adam.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace strata {
namespace {

struct TorchRun {
  int64_t n = 0, steps = 0;
  double lr, beta1, beta2, eps, weight_decay;
  std::vector<float> p0, grads, trajectory, m, v;
};

TorchRun read_run(const std::string& path) {
  TorchRun r;
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(&r.n), 8);
  f.read(reinterpret_cast<char*>(&r.steps), 8);
  for (double* d : {&r.lr, &r.beta1, &r.beta2, &r.eps, &r.weight_decay})
    f.read(reinterpret_cast<char*>(d), 8);
  const auto floats = [&](std::vector<float>& a, int64_t count) {
    a.resize(static_cast<size_t>(count));
    f.read(reinterpret_cast<char*>(a.data()), count * 4);
  };
  floats(r.p0, r.n);
  floats(r.grads, r.steps * r.n);
  floats(r.trajectory, r.steps * r.n);
  floats(r.m, r.n);
  floats(r.v, r.n);
  if (!f) ADD_FAILURE() << path << " is shorter than its header says";
  return r;
}

// Counts and reports (the first few) elements outside the tolerance.
int compare(const char* what, const float* ours, const float* torch, int64_t n, int64_t step,
            const std::string& label) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double tol = 1e-6 * std::abs(static_cast<double>(torch[i])) + 1e-7;
    if (std::abs(static_cast<double>(ours[i]) - torch[i]) > tol && bad++ < 5)
      ADD_FAILURE() << label << " " << what << " at step " << step << ", element " << i
                    << ": strata " << ours[i] << ", torch " << torch[i];
  }
  return bad;
}

class TorchParity : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_torch_parity_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    const std::string command = std::string("'") + STRATA_PYTHON + "' '" + STRATA_REFERENCE_DIR +
                                "/adam_reference.py' '" + dir_.string() + "' 2>&1";
    const int status = std::system(command.c_str());
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
      GTEST_SKIP() << "PyTorch is not importable by " << STRATA_PYTHON
                   << "; install python3-torch to run the parity test";
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << " failed";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void check(const char* mode, bool adamw) {
    const TorchRun t = read_run((dir_ / (std::string(mode) + ".bin")).string());
    ASSERT_GT(t.n, 0);
    const AdamParams params{.lr = static_cast<float>(t.lr),
                            .beta1 = static_cast<float>(t.beta1),
                            .beta2 = static_cast<float>(t.beta2),
                            .eps = static_cast<float>(t.eps),
                            .weight_decay = static_cast<float>(t.weight_decay),
                            .adamw = adamw};
    for (const std::string& simd : CpuAdam::available_paths()) {
      CpuAdam adam({.threads = 2, .simd = simd});
      const size_t n = static_cast<size_t>(t.n);
      std::vector<float> p = t.p0, m(n, 0.0f), v(n, 0.0f);
      const std::string label = std::string(mode) + " (" + simd + ")";
      int bad = 0;
      for (int64_t s = 0; s < t.steps && bad == 0; ++s) {
        const GradShard g{t.grads.data() + s * t.n, DType::f32, n};
        ASSERT_TRUE(adam.update({p.data(), m.data(), v.data(), n}, g, s + 1, params, 1.0f, {}));
        bad += compare("param", p.data(), t.trajectory.data() + s * t.n, t.n, s + 1, label);
      }
      bad += compare("m", m.data(), t.m.data(), t.n, t.steps, label);
      bad += compare("v", v.data(), t.v.data(), t.n, t.steps, label);
      EXPECT_EQ(bad, 0) << label;
    }
  }

  std::filesystem::path dir_;
};

TEST_F(TorchParity, AdamWTrajectoryMatchesTorch) {
  check("adamw", true);
}
TEST_F(TorchParity, AdamTrajectoryMatchesTorch) {
  check("adam", false);
}

}  // namespace
}  // namespace strata
