// libFuzzer harness for the Hugging Face model layout: a safetensors file image and a config.json.
//
// Input: CONFIG_JSON "\n--safetensors--\n" SAFETENSORS_BYTES. Without the separator the whole input
// is tried as both. Each part must give a parsed value or serval::Error, never a crash, a sanitizer
// report or another exception; what parses must be self-consistent (every tensor's bytes inside the
// file and matching its shape; a config that passed validation). When both parse, the weights are
// bound as the loader does (every shape checked against the config).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "base/error.h"
#include "fuzz_common.h"
#include "io/ggml_types.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"

namespace {

constexpr std::string_view kSeparator = "\n--safetensors--\n";

int config_fd = -1;
std::string config_path;

// config_from_hf reads a path: the text goes into an in-memory file.
void write_config(std::string_view text) {
  if (ftruncate(config_fd, 0) != 0 || pwrite(config_fd, text.data(), text.size(), 0) != ssize_t(text.size()))
    serval::fuzz::violation("cannot write the in-memory config.json");
}

// GGUF tensor names to Hugging Face names, as the safetensors loader maps them (Llama / Qwen2).
std::string hf_name(const std::string& n) {
  if (n == "token_embd.weight") return "model.embed_tokens.weight";
  if (n == "output_norm.weight") return "model.norm.weight";
  if (n == "output.weight") return "lm_head.weight";
  if (n.rfind("blk.", 0) != 0) return "";
  const size_t dot = n.find('.', 4);
  if (dot == std::string::npos) return "";
  const std::string layer = n.substr(4, dot - 4), rest = n.substr(dot + 1);
  const size_t dot2 = rest.find('.');
  if (dot2 == std::string::npos) return "";
  const std::string part = rest.substr(0, dot2), suffix = rest.substr(dot2);
  static const std::pair<const char*, const char*> map[] = {
      {"attn_norm", "input_layernorm"},  {"attn_q", "self_attn.q_proj"},   {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},    {"attn_output", "self_attn.o_proj"}, {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},     {"ffn_up", "mlp.up_proj"},          {"ffn_down", "mlp.down_proj"}};
  for (const auto& [from, to] : map)
    if (part == from) return "model.layers." + layer + "." + to + suffix;
  return "";
}

void check_tensors(const serval::SafetensorsFile& file, std::span<const uint8_t> bytes) {
  for (const auto& t : file.tensors()) {
    SERVAL_FUZZ_REQUIRE(file.find_tensor(t.name) == &t, t.name);
    SERVAL_FUZZ_REQUIRE(!t.ne.empty() && t.ne.size() <= 4, t.name);
    unsigned __int128 n = 1;
    for (uint64_t d : t.ne) n *= d;
    n *= serval::dtype_info(t.type).block_bytes;
    SERVAL_FUZZ_REQUIRE(n == t.nbytes, "tensor byte size does not match its shape: " + t.name);
    SERVAL_FUZZ_REQUIRE(reinterpret_cast<uintptr_t>(t.data) % serval::dtype_info(t.type).block_bytes == 0,
                        "tensor data not aligned to its elements: " + t.name);
    SERVAL_FUZZ_REQUIRE(t.data >= bytes.data() && t.nbytes <= uint64_t(bytes.data() + bytes.size() - t.data),
                        "tensor data outside the file: " + t.name);
    if (t.nbytes > 0) {
      volatile uint8_t sink = t.data[0] ^ t.data[t.nbytes - 1];
      (void)sink;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  config_fd = memfd_create("fuzz-config.json", 0);
  if (config_fd < 0) serval::fuzz::violation("memfd_create failed");
  config_path = "/proc/self/fd/" + std::to_string(config_fd);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find(kSeparator);
  const std::string_view config_text = cut == std::string_view::npos ? input : input.substr(0, cut);
  const std::span<const uint8_t> st_bytes =
      cut == std::string_view::npos ? std::span(data, size) : std::span(data, size).subspan(cut + kSeparator.size());

  std::optional<serval::SafetensorsFile> file;
  try {
    file.emplace("fuzz.safetensors", st_bytes);
    check_tensors(*file, st_bytes);
  } catch (const serval::Error&) {
    file.reset();
  }

  std::optional<serval::ModelConfig> config;
  try {
    write_config(config_text);
    config = serval::config_from_hf(config_path);
    SERVAL_FUZZ_REQUIRE(config->n_layer > 0 && size_t(config->n_layer) == config->layer_is_swa.size());
    SERVAL_FUZZ_REQUIRE(config->q_dim() > 0 && config->kv_dim() > 0 && config->kv_bytes_per_token(4) > 0);
    SERVAL_FUZZ_REQUIRE(config->n_kv_groups() == 1);
    SERVAL_FUZZ_REQUIRE(config->n_ctx_train > 0 && config->rope_linear_scale > 0 && config->attn_scale > 0);
  } catch (const serval::Error&) {
  }

  if (file && config) {
    try {
      auto lookup = [&](const std::string& n) -> const serval::TensorRef* {
        const std::string name = hf_name(n);
        if (name.empty()) return nullptr;
        const serval::TensorRef* t = file->find_tensor(name);
        if (!t && name == "model.embed_tokens.weight") t = file->find_tensor("lm_head.weight");
        return t;
      };
      serval::bind_weights(*config, lookup, "fuzz.safetensors");
    } catch (const serval::Error&) {
    }
  }
  return 0;
}
