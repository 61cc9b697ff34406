// log.h: levelled logging to stderr.
//
// The level comes from STRATA_LOG (error, warn, info, debug, trace) or set_log_level().
// warn_once() prints a message only the first time its key is seen: use it for fallbacks
// that would otherwise repeat every step (buffered I/O instead of O_DIRECT, unpinned memory).
#pragma once

#include <fmt/format.h>
#include <string>
#include <string_view>

namespace strata {

enum class LogLevel { error = 0, warn = 1, info = 2, debug = 3, trace = 4 };

LogLevel log_level();
void set_log_level(LogLevel level);
// Parses "error", "warn", "info", "debug", "trace"; throws Error on anything else.
LogLevel parse_log_level(std::string_view text);
void log_write(LogLevel level, std::string_view message);
// True the first time `key` is passed, false after.
bool first_time(std::string_view key);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level <= log_level()) log_write(level, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void log_error(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::error, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::warn, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_info(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::info, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::debug, format, std::forward<Args>(args)...);
}
template <typename... Args>
void warn_once(std::string_view key, fmt::format_string<Args...> format, Args&&... args) {
  if (first_time(key)) log(LogLevel::warn, format, std::forward<Args>(args)...);
}

}  // namespace strata
