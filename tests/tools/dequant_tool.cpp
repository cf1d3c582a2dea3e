// Test helper: dequantizes raw blocks or a named GGUF tensor to float32 so that the Python tests
// can compare Serval against an independent implementation (the gguf package).
//   dequant_tool raw TYPE_ID IN.bin N_ELEMENTS OUT.f32
//   dequant_tool gguf FILE.gguf TENSOR_NAME OUT.f32
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "base/error.h"
#include "io/gguf.h"
#include "tensor/dequant.h"

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    std::vector<float> out;
    if (mode == "raw" && argc == 6) {
      std::ifstream in(argv[3], std::ios::binary);
      const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
      const auto info = serval::dtype_info(uint32_t(std::stoul(argv[2])));
      serval::check(info.has_value(), "unsupported type {}", argv[2]);
      const size_t n = std::stoul(argv[4]);
      serval::check(bytes.size() == serval::row_bytes(info->type, n), "size mismatch");
      out.resize(n);
      serval::dequantize_row(info->type, bytes.data(), out.data(), n);
    } else if (mode == "gguf" && argc == 5) {
      serval::GgufFile file(argv[2]);
      const auto* t = file.find_tensor(argv[3]);
      serval::check(t != nullptr, "no tensor {}", argv[3]);
      out.resize(t->n_elements());
      serval::dequantize_row(t->type, t->data, out.data(), out.size());
    } else {
      std::cerr << "usage: dequant_tool raw TYPE_ID IN N OUT | gguf FILE TENSOR OUT\n";
      return 2;
    }
    std::ofstream(argv[argc - 1], std::ios::binary).write(reinterpret_cast<const char*>(out.data()), out.size() * 4);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
