// Encoder models (the BERT family): bidirectional attention over absolute positions and token types,
// post-LayerNorm blocks, GELU. They turn whole texts into pooled embeddings (sentence-transformers
// models such as all-MiniLM-L6-v2) or, with a classification head, into relevance scores (cross-encoder
// rerankers). No KV cache: a text is encoded in one pass. Loaded from GGUF (`bert` as llama.cpp's
// converter and `serval convert` write it) or a Hugging Face / sentence-transformers directory.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tokenizer/tokenizer.h"

namespace serval {

// How a text's token states become one vector (GGUF's {arch}.pooling_type numbering).
enum class Pooling { None = 0, Mean = 1, Cls = 2, Last = 3, Rank = 4 };
// "mean" | "cls" | "last" | "rank" | "none"; throws Error for another name.
Pooling pooling_from_name(const std::string& name);
const char* pooling_name(Pooling p);

struct EncoderConfig {
  std::string arch = "bert";
  int64_t n_vocab = 0, n_embd = 0, n_layer = 0, n_head = 0, n_ff = 0;
  int64_t n_pos = 0;   // absolute positions: the longest text (with [CLS] and [SEP])
  int64_t n_type = 0;  // token types (segments)
  float eps = 1e-12f;
  Pooling pooling = Pooling::Mean;
  std::vector<int64_t> matryoshka_dims;  // empty: not Matryoshka-trained (no `dimensions`)
  int64_t n_classes = 0;                 // classification head outputs (cross-encoders), else 0
  int64_t d_head() const { return n_head > 0 ? n_embd / n_head : 0; }
  void validate(const std::string& source) const;
};

struct EncoderLayer {
  WeightMatrix wq, wk, wv, wo, ffn_up, ffn_down;
  std::vector<float> bq, bk, bv, bo, b_up, b_down;
  std::vector<float> attn_norm_w, attn_norm_b, out_norm_w, out_norm_b;
};

struct EncoderWeights {
  WeightMatrix tok_embd, pos_embd, type_embd;
  std::vector<float> embd_norm_w, embd_norm_b;
  std::vector<EncoderLayer> layers;
  WeightMatrix cls, cls_out;  // classification head: pooler dense (+ tanh), then the classifier
  std::vector<float> cls_b, cls_out_b;
};

// One text to encode: its tokens and their token types (all 0 for a single text).
struct EncoderInput {
  std::vector<int32_t> tokens;
  std::vector<int32_t> types;
};

class EncoderModel {
 public:
  // A GGUF file whose architecture is an encoder, or a directory whose config.json is one.
  static bool is_encoder(const std::string& path);
  static std::unique_ptr<EncoderModel> load(const std::string& path);
  virtual ~EncoderModel() = default;

  const EncoderConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& path() const { return path_; }

  // [CLS] text [SEP] (special tokens written in the text are parsed, as Hugging Face does).
  EncoderInput tokenize(const std::string& text) const;
  // [CLS] a [SEP] b [SEP] with types 0 then 1 (a cross-encoder's query and document).
  EncoderInput tokenize_pair(const std::string& a, const std::string& b) const;

  // The final hidden states of every token of every input, inputs one after another ([tokens, n_embd]).
  // Each input attends only to itself: its rows do not depend on the other inputs (batch invariance).
  std::vector<float> forward(const std::vector<EncoderInput>& inputs) const;
  // One pooled vector per input (mean, cls or last), L2-normalized when `normalize`.
  std::vector<std::vector<float>> embed(const std::vector<EncoderInput>& inputs, Pooling pooling, bool normalize) const;
  // The classification head's first output per input (a cross-encoder's relevance logit).
  std::vector<float> classify(const std::vector<EncoderInput>& inputs) const;

 protected:
  EncoderModel() = default;
  std::string path_;
  EncoderConfig config_;
  EncoderWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;

 private:
  void check_input(const EncoderInput& in) const;
  void attention_block(const EncoderLayer& l, const std::vector<EncoderInput>& inputs, std::vector<float>& x) const;
  void ffn_block(const EncoderLayer& l, int64_t n_tok, std::vector<float>& x) const;
};

}  // namespace serval
