#include "base/file_util.h"

#include <fstream>
#include <sstream>

#include "base/error.h"

namespace serval {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "{}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  check(!in.bad(), "{}: read error", path);
  return ss.str();
}

}  // namespace serval
