// Helpers shared by the libFuzzer harnesses.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace serval::fuzz {

// Fails the run: the fuzzer reports the current input as a crash (abort is a "deadly signal").
[[noreturn]] inline void violation(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  if (!detail.empty()) std::fprintf(stderr, "  %.*s\n", static_cast<int>(detail.size()), detail.data());
  std::abort();
}

#define SERVAL_FUZZ_REQUIRE(cond, ...)                                       \
  do {                                                                       \
    if (!(cond)) ::serval::fuzz::violation(#cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// ../shared relative to the source tree (the harness may run from anywhere).
inline std::string shared_path(const std::string& rel) { return std::string(SERVAL_SHARED_DIR) + "/" + rel; }

}  // namespace serval::fuzz
