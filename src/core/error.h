// error.h: the one error type strata throws.
//
// Every message says what failed, the value that caused it, and what to do about it,
// e.g. "device host:0: out of memory: request 300 MiB, cap 256 MiB; raise --device-memory".
// Library code throws strata::Error; only tools/ turns it into an exit status.
#pragma once

#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace strata {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throw an Error built with fmt (std::format) syntax.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// strerror() for the calling thread, thread-safe.
std::string errno_text(int err);

}  // namespace strata
