// log.cpp: one mutex serialises lines so that threads never interleave within a line.
#include "core/log.h"

#include "core/error.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

namespace strata {
namespace {

std::atomic<int>& level_storage() {
  static std::atomic<int> level = [] {
    const char* env = std::getenv("STRATA_LOG");
    if (env == nullptr || *env == '\0') return static_cast<int>(LogLevel::warn);
    try {
      return static_cast<int>(parse_log_level(env));
    } catch (const Error& e) {
      std::fprintf(stderr, "strata: warn: %s\n", e.what());
      return static_cast<int>(LogLevel::warn);
    }
  }();
  return level;
}

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

constexpr const char* kNames[] = {"error", "warn", "info", "debug", "trace"};

}  // namespace

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may not be buf).
  return strerror_r(err, buf, sizeof buf);
}

LogLevel log_level() {
  return static_cast<LogLevel>(level_storage().load(std::memory_order_relaxed));
}

void set_log_level(LogLevel level) {
  level_storage().store(static_cast<int>(level));
}

LogLevel parse_log_level(std::string_view text) {
  for (int i = 0; i < 5; ++i)
    if (text == kNames[i]) return static_cast<LogLevel>(i);
  fail("log level '{}' is not known; use one of error, warn, info, debug, trace", text);
}

void log_write(LogLevel level, std::string_view message) {
  std::lock_guard lock(log_mutex());
  std::fprintf(stderr, "strata: %s: %.*s\n", kNames[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
}

bool first_time(std::string_view key) {
  static std::set<std::string, std::less<>> seen;
  std::lock_guard lock(log_mutex());
  return seen.emplace(key).second;
}

}  // namespace strata
