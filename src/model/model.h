// A loaded model (config, weights, tokenizer) and its forward pass over one flattened batch.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace serval {

// K and V of every layer in slots of kv_dim elements (F16 by default, as llama.cpp; or F32);
// a sequence owns a list of slots, one per position.
class KvCache {
 public:
  KvCache(const ModelConfig& config, int64_t n_slots, DType type = DType::F16);
  int64_t n_slots() const { return n_slots_; }
  int64_t kv_dim() const { return kv_dim_; }
  DType type() const { return type_; }
  // Stores one token's K and V (kv_dim floats each) of `layer` in `slot`.
  void write(int64_t layer, int32_t slot, const float* k, const float* v);
  // The layer's pools for the attention kernel.
  KvLayerView view(int64_t layer) const;
  uint64_t bytes() const { return uint64_t(k_.size()) * 2 * n_slots_ * kv_dim_ * elem_bytes_; }

 private:
  int64_t n_slots_, kv_dim_;
  DType type_;
  size_t elem_bytes_;
  std::vector<std::vector<uint8_t>> k_, v_;
};

// One step's tokens from any number of sequences, each with its position and KV slot.
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_ids;  // index into slot_tables
  std::vector<int32_t> slots;    // KV slot this token's K/V is written to
  std::vector<uint8_t> want_logits;
  // Per sequence: slot of each position 0..max position in this batch (earlier tokens included).
  std::vector<std::vector<int32_t>> slot_tables;

  // Appends one token.
  void add(int32_t token, int32_t pos, int32_t seq, int32_t slot, bool logits);
  size_t size() const { return tokens.size(); }
};

struct LoadOptions {
  std::string tokenizer_json;  // optional: override the tokenizer with a Hugging Face tokenizer.json
};

class Model {
 public:
  // Loads a GGUF file, a .safetensors file or a Hugging Face model directory; throws Error.
  static std::unique_ptr<Model> load(const std::string& path, const LoadOptions& options = {});
  virtual ~Model() = default;

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& path() const { return path_; }

  // Runs the batch; writes logits [rows with want_logits, n_vocab] in batch order.
  void forward(const Batch& batch, KvCache& kv, std::vector<float>& logits) const;

 protected:
  Model() = default;
  std::string path_;
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;

 private:
  void attention_block(int64_t il, const Batch& batch, KvCache& kv, std::vector<float>& x) const;
  void ffn_block(int64_t il, int64_t n_tok, std::vector<float>& x) const;
  void apply_rope(float* vec, int64_t n_heads, int32_t pos, bool swa_layer) const;
};

}  // namespace serval
