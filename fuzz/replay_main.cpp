// replay_main.cpp: runs a fuzz target's LLVMFuzzerTestOneInput over committed inputs, without
// libFuzzer, so that every build (gcc included) replays the corpus as a regression test.
//
// Usage: replay_<target> PATH...  (a file, or a directory whose regular files are all run, in
// name order). Each input is named on stdout before it runs, so a crash or a sanitizer report
// names the input that caused it. An exception other than strata::Error (which the target
// catches) escaping the target, an input running past 60 seconds, or an empty or missing
// corpus fails the run with a non-zero exit.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

constexpr unsigned kSecondsPerInput = 60;

// Written by the SIGALRM handler: the input that ran too long.
const char* g_current = "";

void on_alarm(int) {
  const char prefix[] = "replay: FAILED: an input ran past the time limit (a hang): ";
  (void)!::write(2, prefix, sizeof(prefix) - 1);
  (void)!::write(2, g_current, std::char_traits<char>::length(g_current));
  (void)!::write(2, "\n", 1);
  _exit(3);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  std::vector<fs::path> inputs;
  for (int a = 1; a < argc; ++a) {
    const fs::path arg = argv[a];
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      std::vector<fs::path> found;
      for (const auto& entry : fs::directory_iterator(arg, ec))
        if (entry.is_regular_file()) found.push_back(entry.path());
      if (ec) {
        std::fprintf(stderr, "replay: FAILED: cannot list %s: %s\n", arg.c_str(),
                     ec.message().c_str());
        return 1;
      }
      if (found.empty()) {
        std::fprintf(stderr, "replay: FAILED: %s holds no inputs; the corpus is missing\n",
                     arg.c_str());
        return 1;
      }
      std::sort(found.begin(), found.end());
      inputs.insert(inputs.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(arg, ec)) {
      inputs.push_back(arg);
    } else {
      std::fprintf(stderr, "replay: FAILED: %s is neither a corpus directory nor a file\n",
                   arg.c_str());
      return 1;
    }
  }

  signal(SIGALRM, on_alarm);
  double slowest_s = 0;
  std::string slowest;
  for (const fs::path& input : inputs) {
    std::ifstream in(input, std::ios::binary);
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in),
                                  std::istreambuf_iterator<char>()};
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "replay: FAILED: cannot read %s\n", input.c_str());
      return 1;
    }
    std::printf("replay: %s (%zu bytes)\n", input.c_str(), bytes.size());
    std::fflush(stdout);
    g_current = input.c_str();
    alarm(kSecondsPerInput);
    const auto start = std::chrono::steady_clock::now();
    try {
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "replay: FAILED: %s: an exception escaped the target: %s\n",
                   input.c_str(), e.what());
      return 1;
    } catch (...) {
      std::fprintf(stderr, "replay: FAILED: %s: a non-std exception escaped the target\n",
                   input.c_str());
      return 1;
    }
    alarm(0);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s > slowest_s) {
      slowest_s = s;
      slowest = input.string();
    }
  }
  std::printf("replay: %zu inputs, no crash and no unexpected exception; slowest %.3f s (%s)\n",
              inputs.size(), slowest_s, slowest.c_str());
  return 0;
}
