#include "core/bytes.h"
#include "core/error.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(Bytes, ParsesBinaryAndSiUnits) {
  EXPECT_EQ(parse_bytes("24GiB"), 24ull << 30);
  EXPECT_EQ(parse_bytes("1.5TB"), 1'500'000'000'000ull);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("512 mib"), 512ull << 20);
  EXPECT_EQ(parse_bytes(" 4096 "), 4096u);
  EXPECT_EQ(parse_bytes("4096B"), 4096u);
  EXPECT_EQ(parse_bytes("5e8"), 500'000'000u);
  EXPECT_EQ(parse_bytes("1e9"), 1'000'000'000u);
  EXPECT_EQ(parse_bytes("2G"), 2ull << 30);
  EXPECT_EQ(parse_bytes("0.5KiB"), 512u);
  EXPECT_EQ(parse_bytes("18446744073709551615"), 18446744073709551615ull);
  EXPECT_EQ(parse_bytes("1KB"), 1000u);
  EXPECT_EQ(parse_bytes("1.5 GiB"), 3ull << 29);
}

TEST(Bytes, RejectsBadStringsNamingThem) {
  for (const char* bad : {"", "abc", "-1GiB", "12 parsecs", "1.5", "0.3B", "1b", "GiB",
                          "99999999999999999999", "20EB", "1e", "1.2.3MiB", "1e400"}) {
    try {
      const uint64_t v = parse_bytes(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted as " << v;
    } catch (const Error& e) {
      const std::string msg = e.what();
      if (*bad) {
        EXPECT_NE(msg.find(std::string("'") + bad), std::string::npos) << msg;
      }
    }
  }
}

TEST(Bytes, Formats) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1 KiB");
  EXPECT_EQ(format_bytes(3ull << 29), "1.5 GiB");
  EXPECT_EQ(format_bytes(24ull << 30), "24 GiB");
  EXPECT_EQ(format_bytes(512ull << 20), "512 MiB");
  for (uint64_t v : {1ull << 20, 3ull << 29, 7ull << 40, 4096ull})
    EXPECT_EQ(parse_bytes(format_bytes(v)), v);
}

}  // namespace
}  // namespace strata
