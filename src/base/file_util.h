// Reading whole files with errors that name the file.
#pragma once
#include <string>

namespace serval {

// The file's bytes; throws Error ("PATH: cannot open") when it cannot be read.
std::string read_text_file(const std::string& path);

}  // namespace serval
