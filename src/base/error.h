// Error type used across Serval: every failure the user can cause is reported with a clear message.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace serval {

// An error the caller can report to the user as-is (bad file, bad argument, unsupported feature).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws serval::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Throws serval::Error when `condition` is false.
template <typename... Args>
void check(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace serval
