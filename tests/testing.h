// testing.h: helpers shared by the GoogleTest suites.
#pragma once

#include "core/error.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

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

}  // namespace strata::test
