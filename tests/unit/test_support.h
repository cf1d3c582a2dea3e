// Shared helpers for the unit tests: paths of the shared fixtures, error messages.
#pragma once
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "base/error.h"
#include "kernels/isa.h"

namespace serval::test {

// Restores the detected ISA level when a test ends (tests force lower levels with cpu::force_isa).
struct IsaGuard {
  ~IsaGuard() { cpu::force_isa(cpu::detected_isa()); }
};

inline std::string shared_path(const std::string& rel) { return std::string(SERVAL_SHARED_DIR) + "/" + rel; }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Cached model path (set up by scripts/setup), or "" when it is not there.
inline std::string cached_model(const std::string& name) {
  const char* env = std::getenv("SERVAL_MODEL_CACHE");
  const char* home = std::getenv("HOME");
  const std::string dir = env && *env ? env : std::string(home ? home : ".") + "/.cache/serval/models";
  const std::string p = dir + "/" + name + ".gguf";
  return std::filesystem::exists(p) ? p : "";
}

// The serval::Error message `fn` throws, or "no error".
template <class F>
std::string error_message(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace serval::test
