// test_bench_io.cpp: runs the built `strata bench io` small (its path is compiled in as
// STRATA_BINARY) on /tmp in each --rw mode and checks what a script sees: exit 0 and one
// JSON object with bytes_per_s and iops after verification, and a usable error otherwise.
#include <string>

#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

using Result = strata::test::CommandResult;

Result run(const std::string& args) {
  return strata::test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " 2>&1");
}

TEST(BenchIo, EachModeReportsVerifiedJson) {
  for (const char* rw : {"read", "write", "randread", "randwrite"}) {
    const Result r = run(std::string("bench io --path /tmp --size 8MiB --block 64KiB --qd 8 "
                                     "--threads 2 --json --rw ") +
                         rw);
    ASSERT_EQ(r.status, 0) << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not valid JSON:\n" << r.out;
    EXPECT_EQ(j["rw"], rw);
    EXPECT_GT(j["bytes_per_s"].get<double>(), 0);
    EXPECT_GT(j["iops"].get<double>(), 0);
    EXPECT_EQ(j["size_bytes"].get<uint64_t>(), 8u << 20);
    EXPECT_EQ(j["verified"], true);
  }
}

TEST(BenchIo, SwapStoreModeStripesAndVerifies) {
  // One thread, and three at once on the store's channels (a ring each).
  for (const char* threads : {"1", "3"})
    for (const char* rw : {"read", "write"}) {
      SCOPED_TRACE(std::string(rw) + " threads " + threads);
      const Result r = run(std::string("bench io --store --path /tmp --path /dev/shm --size 8MiB "
                                       "--block 256KiB --qd 4 --json --threads ") +
                           threads + " --rw " + rw);
      ASSERT_EQ(r.status, 0) << r.out;
      const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << "not valid JSON:\n" << r.out;
      EXPECT_EQ(j["store"], true);
      EXPECT_EQ(j["threads"], std::stoi(threads));
      EXPECT_EQ(j["verified"], true);
      EXPECT_GT(j["bytes_per_s"].get<double>(), 0);
    }
}

TEST(BenchIo, BadArgumentsAreUsableErrors) {
  Result r = run("bench io --path /tmp --size 8MiB --block 1000");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("--block 1000 is not a positive multiple of 4 KiB"), std::string::npos)
      << r.out;
  r = run("bench io --path /nonexistent-strata-dir --size 8MiB");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("/nonexistent-strata-dir is not a directory"), std::string::npos) << r.out;
}

}  // namespace
