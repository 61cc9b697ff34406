// testing.h: helpers shared by the GoogleTest suites.
#pragma once

#include "core/error.h"

#include <gtest/gtest.h>
#if defined(STRATA_BINARY_PATH)
#include <nlohmann/json.hpp>
#endif
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <string>

// The sanitizer a build runs under: STRATA_TEST_ASAN, STRATA_TEST_TSAN. GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__; clang 14, which CI's sanitizer builds use,
// defines neither and answers __has_feature instead.
#if defined(__SANITIZE_ADDRESS__)
#define STRATA_TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define STRATA_TEST_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(STRATA_TEST_ASAN)
#define STRATA_TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(STRATA_TEST_TSAN)
#define STRATA_TEST_TSAN 1
#endif
#endif

namespace strata::test {

// Runs `fn` and returns the message of the strata::Error it throws. A test fails when it
// throws nothing, and the result is then empty.
template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no strata::Error was thrown";
  return "";
}

// Runs `fn`, expecting a strata::Error whose message holds every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> parts) {
  const std::string msg = error_message(fn);
  for (const std::string& part : parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
}

// What a shell command printed on stdout and its exit status (-1 when it did not exit).
struct CommandResult {
  int status = -1;
  std::string out;
};
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int wait_status = pclose(pipe);
  if (WIFEXITED(wait_status)) r.status = WEXITSTATUS(wait_status);
  return r;
}

#if defined(STRATA_BINARY_PATH)
// The tool a `cli` suite runs: STRATA_TEST_BINARY where it is set (ctest sets it to strata_emu
// for the suites' *OnAGpu* tests on the CUDA emulator), the build's own strata otherwise.
inline const char* strata_binary() {
  const char* other = std::getenv("STRATA_TEST_BINARY");
  return other != nullptr && *other != '\0' ? other : STRATA_BINARY_PATH;
}
#define STRATA_BINARY ::strata::test::strata_binary()

// Why the tool under test sees no GPU ("" when it sees one), from its `info --json`: the
// tool's view, not this process's, since the two may be different builds.
inline const std::string& binary_without_gpu() {
  static const std::string why = [] {
    const CommandResult r = run_command(std::string("'") + STRATA_BINARY + "' info --json");
    if (r.status != 0) return "`strata info --json` exited " + std::to_string(r.status);
    const nlohmann::json info = nlohmann::json::parse(r.out, nullptr, false);
    if (info.is_discarded() || !info.contains("gpus") || !info.contains("cuda"))
      return std::string("`strata info --json` printed no gpus and cuda");
    if (!info["gpus"].empty()) return std::string();
    return info["cuda"].value("status", std::string("?")) + ": " +
           info["cuda"].value("detail", std::string());
  }();
  return why;
}
#define STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU()                                  \
  if (const std::string& why = ::strata::test::binary_without_gpu(); !why.empty()) \
  GTEST_SKIP() << "no GPU: " << why
#endif

// A fresh directory under the system's temporary directory (mkdtemp), removed with everything
// in it when the test is done.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix) {
    std::string name = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (mkdtemp(name.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << name << " failed";
    path = name;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace strata::test
