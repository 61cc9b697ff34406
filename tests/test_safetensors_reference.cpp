// test_safetensors_reference.cpp: strata's safetensors files against an independent reader and
// writer (tests/reference/safetensors_check.py: json + struct + torch; Debian 12 has no
// python3-safetensors).
//
// strata writes the tensors the script also knows (F32/BF16/F16, odd shapes, a scalar, an empty
// tensor, and values that round, overflow or go subnormal in 16 bits), single and sharded; the
// script checks the layout the format specifies and every value bit for bit against torch's own
// rounding. Then the script writes the same tensors its own way, and strata must read them to
// the same bits. Without torch the test reports a skip, not a pass.
#include "core/dtype.h"
#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// The same list as SPEC in safetensors_check.py.
const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"t0", DType::f32, {3, 5}},       {"t1", DType::bf16, {17}},
      {"t2", DType::f16, {2, 3, 4}},    {"t3", DType::f32, {}},
      {"t4", DType::bf16, {0, 3}},      {"t5", DType::f16, {1000}},
      {"t6", DType::bf16, {33, 7}},     {"special.bf16", DType::bf16, {6}},
      {"special.f16", DType::f16, {6}},
  };
  return s;
}

// The values as f32, computed as the script computes them.
std::vector<float> values(const Spec& s) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  if (s.name.starts_with("special"))
    return {65520.0f, 1e-7f, -0.0f, 3.0e38f, 1.0e-40f, 1.0f + 1.0f / 256.0f};
  const int64_t k = std::stoll(s.name.substr(1));
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] =
        static_cast<float>(static_cast<double>((i * 7919 + k * 104729) % 20011 - 10005) / 1024.0);
  return v;
}

// The values in the tensor's own dtype, rounded by strata.
std::vector<char> stored(const Spec& s) {
  const std::vector<float> v = values(s);
  std::vector<char> out(v.size() * dtype_size(s.dtype));
  convert(out.data(), s.dtype, v.data(), DType::f32, v.size());
  return out;
}

class SafetensorsReference : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "strata-st-ref-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // Runs the script; false (and a skip) without torch.
  int script(const std::string& mode, const fs::path& path) {
    const std::string command = std::string("'") + STRATA_PYTHON + "' '" + STRATA_REFERENCE_DIR +
                                "/safetensors_check.py' " + mode + " '" + path.string() + "' 2>&1";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  fs::path dir_;
};

TEST_F(SafetensorsReference, OursReadByTheIndependentReaderAndTheirsByOurs) {
  std::vector<std::vector<char>> data;
  std::vector<SafetensorsTensor> tensors;
  for (const Spec& s : specs()) data.push_back(stored(s));
  for (size_t i = 0; i < specs().size(); ++i)
    tensors.push_back({specs()[i].name, specs()[i].dtype, specs()[i].shape, data[i].data()});

  write_safetensors(dir_ / "ours.safetensors", tensors, {{"format", "pt"}});
  const int status = script("verify", dir_ / "ours.safetensors");
  if (status == 77)
    GTEST_SKIP() << "PyTorch is not importable by " << STRATA_PYTHON
                 << "; install python3-torch to run the safetensors reference test";
  EXPECT_EQ(status, 0) << "the independent reader refused ours.safetensors (see above)";

  // Sharded: 2 KiB shards make several files plus the index.
  const std::vector<fs::path> files = write_safetensors_sharded(dir_ / "sharded", tensors, 2048);
  EXPECT_GT(files.size(), 3u);
  EXPECT_EQ(script("verify-dir", dir_ / "sharded"), 0) << "the sharded checkpoint (see above)";

  // The other way: the script's file, read by strata, in its own dtype and converted.
  ASSERT_EQ(script("write", dir_ / "theirs.safetensors"), 0);
  const SafetensorsReader r = SafetensorsReader::open(dir_ / "theirs.safetensors");
  EXPECT_EQ(r.tensors().size(), specs().size());
  EXPECT_EQ(r.metadata().at("writer"), "safetensors_check.py");
  for (const Spec& s : specs()) {
    SCOPED_TRACE(s.name);
    const SafetensorsEntry* e = r.find(s.name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, s.dtype);
    EXPECT_EQ(e->shape, s.shape);
    const std::vector<char> want = stored(s);
    std::vector<char> got(want.size());
    r.read_checked(s.name, got.data(), s.dtype, s.shape);
    EXPECT_EQ(got, want) << "torch's rounding and strata's differ";
    // And widened to f32: exactly the 16-bit value.
    std::vector<float> wide(want.size() / dtype_size(s.dtype)), want_wide(wide.size());
    r.read(s.name, wide.data(), DType::f32);
    convert(want_wide.data(), DType::f32, want.data(), s.dtype, wide.size());
    EXPECT_TRUE(wide.empty() || std::memcmp(wide.data(), want_wide.data(), wide.size() * 4) == 0);
  }
}

}  // namespace
}  // namespace strata
