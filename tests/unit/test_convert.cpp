// serval convert's pieces that need no checkpoint: llama.cpp's RoPE permutation of Q/K rows on a
// hand-computed example, the HF -> GGUF tensor names and the tensor types the converter picks.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "base/error.h"
#include "quant/convert.h"

namespace serval {
namespace {

// 2 heads of dimension 4, 1 column: rows per head go from (x0, x1 | y0, y1) to (x0, y0, x1, y1).
TEST(Convert, PermutesRopeRowsPerHead) {
  const std::vector<float> w = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(permute_rope_rows(w.data(), 8, 1, 2), (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
  EXPECT_EQ(permute_rope_rows(w.data(), 8, 1, 1), (std::vector<float>{0, 4, 1, 5, 2, 6, 3, 7}));
}

// Whole rows move: 1 head of dimension 4, 2 columns.
TEST(Convert, PermutesWholeRows) {
  const std::vector<float> w = {0, 10, 1, 11, 2, 12, 3, 13};
  EXPECT_EQ(permute_rope_rows(w.data(), 4, 2, 1), (std::vector<float>{0, 10, 2, 12, 1, 11, 3, 13}));
}

TEST(Convert, RefusesHeadsThatDoNotDivideTheRows) {
  const std::vector<float> w(6);
  EXPECT_THROW(permute_rope_rows(w.data(), 6, 1, 2), Error);
}

TEST(Convert, MapsTensorNames) {
  EXPECT_EQ(gguf_tensor_name("llama", "model.embed_tokens.weight"), "token_embd.weight");
  EXPECT_EQ(gguf_tensor_name("llama", "lm_head.weight"), "output.weight");
  EXPECT_EQ(gguf_tensor_name("qwen2", "model.layers.3.self_attn.k_proj.bias"), "blk.3.attn_k.bias");
  EXPECT_EQ(gguf_tensor_name("llama", "model.layers.0.post_attention_layernorm.weight"), "blk.0.ffn_norm.weight");
  EXPECT_EQ(gguf_tensor_name("gemma3", "model.layers.0.post_attention_layernorm.weight"),
            "blk.0.post_attention_norm.weight");
  EXPECT_EQ(gguf_tensor_name("gemma3", "model.layers.1.pre_feedforward_layernorm.weight"), "blk.1.ffn_norm.weight");
  EXPECT_EQ(gguf_tensor_name("gemma3", "model.layers.1.self_attn.q_norm.weight"), "blk.1.attn_q_norm.weight");
  EXPECT_EQ(gguf_tensor_name("llama", "model.layers.1.self_attn.q_norm.weight"), "");
  EXPECT_EQ(gguf_tensor_name("llama", "model.vision_tower.weight"), "");
}

TEST(Convert, PicksTensorTypesAsLlamaCpp) {
  EXPECT_EQ(converted_type("blk.0.attn_q.weight", 2, 128, DType::Q8_0), DType::Q8_0);
  EXPECT_EQ(converted_type("blk.0.attn_q.weight", 2, 100, DType::Q8_0), DType::F16);  // not whole blocks
  EXPECT_EQ(converted_type("blk.0.attn_q.bias", 1, 128, DType::F16), DType::F32);
  EXPECT_EQ(converted_type("blk.0.attn_norm.weight", 1, 128, DType::BF16), DType::F32);
  EXPECT_EQ(converted_type("token_embd.weight", 2, 128, DType::BF16), DType::BF16);
  EXPECT_THROW(parse_convert_type("q4_0"), Error);
}

}  // namespace
}  // namespace serval
