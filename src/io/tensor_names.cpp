#include "io/tensor_names.h"

#include <map>
#include <regex>

namespace serval {

std::string bert_gguf_name(const std::string& hf_name) {
  static const std::map<std::string, std::string> top = {
      {"embeddings.word_embeddings", "token_embd"},   {"embeddings.position_embeddings", "position_embd"},
      {"embeddings.token_type_embeddings", "token_types"}, {"embeddings.LayerNorm", "token_embd_norm"},
      {"pooler.dense", "cls"},                        {"classifier", "cls.output"}};
  static const std::map<std::string, std::string> layer = {
      {"attention.self.query", "attn_q"},         {"attention.self.key", "attn_k"},
      {"attention.self.value", "attn_v"},         {"attention.output.dense", "attn_output"},
      {"attention.output.LayerNorm", "attn_output_norm"}, {"intermediate.dense", "ffn_up"},
      {"output.dense", "ffn_down"},               {"output.LayerNorm", "layer_output_norm"}};
  static const std::regex re(R"((?:bert\.)?(?:encoder\.layer\.(\d+)\.)?(.+)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(hf_name, m, re)) return "";
  const std::string base = m[2], suffix = "." + m[3].str();
  if (!m[1].matched) {
    const auto it = top.find(base);
    return it == top.end() ? "" : it->second + suffix;
  }
  const auto it = layer.find(base);
  return it == layer.end() ? "" : "blk." + m[1].str() + "." + it->second + suffix;
}

}  // namespace serval
