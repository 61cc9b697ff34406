// test_cli.cpp: runs the built `strata` binary (its path is compiled in as STRATA_BINARY)
// and checks what a user and a script see: `--help` lists `info`, `info` and `info --json`
// exit 0 on any machine, GPU or not, and the JSON holds the six documented sections.
#include <set>
#include <string>

#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

using Result = strata::test::CommandResult;

Result run(const std::string& args) {
  return strata::test::run_command(std::string("'") + STRATA_BINARY + "' " + args);
}

TEST(Cli, HelpListsInfo) {
  const Result r = run("--help 2>&1");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("info"), std::string::npos) << r.out;
}

TEST(Cli, InfoJsonHasEverySection) {
  const Result r = run("info --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << "not valid JSON:\n" << r.out;
  for (const char* key : {"cpu", "memory", "gpus", "cuda", "io_uring", "filesystems"})
    EXPECT_TRUE(j.contains(key)) << "missing key " << key;

  const std::set<std::string> statuses = {"not compiled", "compiled, no driver",
                                          "compiled, no device", "ok"};
  ASSERT_TRUE(j["cuda"]["status"].is_string());
  EXPECT_TRUE(statuses.contains(j["cuda"]["status"].get<std::string>())) << j["cuda"];

  EXPECT_TRUE(j["cpu"]["model"].is_string());
  EXPECT_TRUE(j["cpu"]["simd"].is_string());
  EXPECT_TRUE(j["cpu"]["numa_nodes"].is_array());
  EXPECT_GT(j["memory"]["total_bytes"].get<uint64_t>(), 0u);
  const auto& limit = j["memory"]["memlock_limit_bytes"];
  EXPECT_TRUE(limit.is_number_unsigned() || limit == "unlimited") << limit;
  EXPECT_TRUE(j["gpus"].is_array());
  if (j["cuda"]["status"] != "ok") {
    EXPECT_TRUE(j["gpus"].empty());
  }
  for (const auto& g : j["gpus"])
    for (const char* key : {"index", "name", "memory_bytes", "numa_node", "pci_bus_id"})
      EXPECT_TRUE(g.contains(key)) << g;
  EXPECT_TRUE(j["io_uring"]["works"].is_boolean());
  EXPECT_TRUE(j["filesystems"].is_array());
  for (const auto& fs : j["filesystems"]) {
    EXPECT_TRUE(fs["free_bytes"].is_number_unsigned()) << fs;
    const auto& od = fs["o_direct"];
    EXPECT_TRUE(od.is_boolean() || od == "not writable") << fs;
  }
}

TEST(Cli, InfoTextExitsZeroAndReportsGpus) {
  const Result r = run("info");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("GPU"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("io_uring"), std::string::npos) << r.out;
}

}  // namespace
