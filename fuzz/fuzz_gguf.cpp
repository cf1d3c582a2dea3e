// libFuzzer harness: any byte string given to the GGUF parser (and the config / tokenizer built
// from it) must give either a parsed file or serval::Error, never a crash or sanitizer report; also
// when read as a shape file (GgufFile::Data::Absent).
#include <cstddef>
#include <cstdint>

#include "base/error.h"
#include "io/gguf.h"
#include "model/config.h"
#include "tokenizer/load.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    serval::GgufFile file("fuzz-input", std::span<const uint8_t>(data, size));
    for (const auto& t : file.tensors()) {
      volatile uint8_t sink = t.nbytes > 0 ? t.data[t.nbytes - 1] : 0;  // every tensor's bytes are in bounds
      (void)sink;
    }
    try { serval::config_from_gguf(file); } catch (const serval::Error&) {}
    try { serval::Tokenizer tok(serval::vocab_from_gguf(file)); tok.encode("Hello world", true); } catch (const serval::Error&) {}
  } catch (const serval::Error&) {
  }
  try {  // read as a shape file (--load-format dummy): no data pointers, the same checks otherwise
    serval::GgufFile shape("fuzz-input", std::span<const uint8_t>(data, size), serval::GgufFile::Data::Absent);
    for (const auto& t : shape.tensors())
      if (t.data != nullptr) __builtin_trap();
    try { serval::config_from_gguf(shape); } catch (const serval::Error&) {}
  } catch (const serval::Error&) {
  }
  return 0;
}
