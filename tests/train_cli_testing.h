// train_cli_testing.h: what the suites that drive `strata train` as a user does share: running
// the binary (STRATA_BINARY, defined by tests/CMakeLists.txt), a small byte-token corpus,
// reading files and metrics back.
#pragma once

#include "testing.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace strata::test {

// `args` with `--devices host` added when it runs a command on devices and names none: without
// it strata takes cuda:0 on a machine with a GPU, an arena there takes the GPU's free memory,
// and ctest -j runs many of these at once. These suites test the host backend, as CI does; their
// *OnAGpu* tests name cuda:0 with a 1 GiB --device-memory and carry the gpu label too.
inline std::string on_host_unless_named(const std::string& args) {
  const std::string verb = args.substr(0, args.find(' '));
  const bool on_devices = verb == "train" || verb == "eval" || verb == "generate" || verb == "tune";
  return on_devices && args.find("--devices") == std::string::npos ? args + " --devices host"
                                                                   : args;
}

// `strata ARGS` through the shell, stdout and stderr together.
inline CommandResult strata(const std::string& args) {
  return run_command(std::string("'") + STRATA_BINARY + "' " + on_host_unless_named(args) +
                     " 2>&1");
}

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// RUN/metrics.jsonl, one object per line.
inline std::vector<nlohmann::json> metrics(const std::filesystem::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Byte tokens of repetitive English-like text (the byte tokenizer's ids), llm.c format, made by
// `strata tokenize` in `dir`.
inline std::filesystem::path make_data(const std::filesystem::path& dir) {
  const std::filesystem::path txt = dir / "text.txt", bin = dir / "text.bin";
  std::ofstream f(txt);
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"};
  uint32_t x = 12345;
  for (int line = 0; line < 600; ++line) {
    for (int w = 0; w < 10; ++w) {
      x = x * 1103515245u + 12345u;
      f << words[(x >> 16) % 9] << (w == 9 ? "\n" : " ");
    }
  }
  f.close();
  const CommandResult r =
      strata("tokenize --tokenizer byte --input " + txt.string() + " --output " + bin.string());
  EXPECT_EQ(r.status, 0) << r.out;
  return bin;
}

}  // namespace strata::test
