// Medusa-style decoding heads on a frozen target (Cai et al. 2024, "Medusa"): head k turns the
// target's final hidden state h (after the output norm, at the position that predicted token t+1)
// into a guess of token t+2+k:
//
//   a_k = h + SiLU(W_k h + b_k),  scores = U_S a_k,  guess = S[argmax scores]
//
// U_S is the target's own (frozen) output matrix restricted to S, a frequency-ranked subset of the
// vocabulary, so a head costs d^2 + |S| d multiply-adds. Heads are trained by `serval train-heads`
// (HeadTrainer below) and stored in a small GGUF file.
//
// Token-input heads (Hydra-style, Ankner et al. 2024) also read the token before the one they guess:
// head k's input is x = [h ; e(t_k)], with e the RMS-normalised row of the target's token embedding,
// t_0 the token just sampled and t_k (k > 0) head k-1's guess, so W_k is d x 2d:
//
//   a_k = h + SiLU(W_k x + b_k)
//
// Medusa's heads guess token t+2 without knowing t+1; these know it.
//
// Recurrent heads (token-input heads chained on features, as EAGLE drafts a feature at a time, Li et
// al. 2024, here without EAGLE's attention layer): head k > 0 reads head k-1's output a_{k-1} in place
// of h, so that it sees every guess of the chain before it, not only the last:
//
//   a_0 = h + SiLU(W_0 [h ; e(t_0)] + b_0),  a_k = f_k + SiLU(W_k [f_k ; e(t_k)] + b_k)
//
// with f_k = a_{k-1} rescaled to the RMS of head k-1's own input (chain_features), so that every head
// reads features of h's scale: unscaled, a head's output grows as its guesses sharpen, and the next
// head's training diverged.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/ggml_types.h"

namespace serval {

class Model;

struct DecodingHeads {
  int32_t n_embd = 0;
  int32_t n_vocab = 0;             // the target's vocabulary size (checked at load)
  bool token_input = false;        // x = [h ; e(previous token)] (Hydra) rather than x = h (Medusa)
  bool recurrent = false;          // token-input heads whose h is, for head k > 0, head k-1's output
  std::vector<int32_t> vocab;      // S: the token ids the heads can propose
  std::vector<std::vector<float>> w, b;  // per head: W [n_embd x n_in()] row-major (out, in), b [n_embd]
  std::vector<float> out;          // U_S [|S| x n_embd], from the target (not stored in the file)
  std::vector<float> out_t;        // U_S transposed [n_embd x |S|], for training's backward pass
  const Model* target = nullptr;   // for the token embedding rows of token-input heads (not owned)
  // Quantized copies of U_S and of each W_k (Q4_0 unless asked otherwise), repacked for the GEMM, that
  // proposing reads instead of the F32 matrices (an eighth of the bytes per step); made by
  // prepare_to_propose (load does it). Training and unprepared heads use the F32 matrices.
  struct Quantized;
  std::shared_ptr<const Quantized> quantized;

  int n_heads() const { return int(w.size()); }
  int64_t n_in() const { return token_input ? 2 * int64_t(n_embd) : n_embd; }
  // Zero-initialised heads (a_k = h + SiLU(0) = h + 0: the head starts as the target's own head).
  static DecodingHeads create(const Model& target, int n_heads, std::vector<int32_t> vocab, bool token_input = false,
                              bool recurrent = false);
  // Loads a heads file made for `target`; throws Error naming the mismatch.
  static DecodingHeads load(const std::string& path, const Model& target);
  void save(const std::string& path, const std::string& target_name) const;
  // The target's output rows of the subset (and their transpose).
  void init_output(const Model& target);
  // Makes `quantized` from the current F32 matrices in `type` (Q4_0 or Q8_0; when n_embd is a multiple
  // of their blocks of 32). Q4_0 is the default: the 0.5B's heads propose in 0.45 ms a step rather
  // than 0.8 with the same accepted tokens (docs/speculative.md).
  void prepare_to_propose(DType type = DType::Q4_0);

  // A head's input (n_in() floats): h, then for token-input heads the normalised embedding of `token`.
  void input(const float* h, int32_t token, float* x) const;
  // Row r's training input for head k: its hidden state h_r and the token 1 + k ahead in `tokens`,
  // the one before head k's label (the last token where there is none: such rows carry no label).
  void training_input(const float* h_r, std::span<const int32_t> tokens, int64_t r, int k, float* x) const;
  // a = h + SiLU(W_k x + b_k), h being x's first n_embd values; z (optional) gets W_k x + b_k.
  void block(int k, const float* x, float* a, float* z = nullptr) const;
  // block() for n rows of inputs x [n, n_in()] into a [n, n_embd], with the F32 matrices (training).
  void block_rows(int k, const float* x, int64_t n, float* a) const;
  // A recurrent head's output a (n_embd values) made into the next head's features, in place: scaled
  // to the RMS of `base`, the first n_embd values of the head's own input.
  void chain_features(const float* base, float* a) const;
  // Head k's scores over the subset for input x (through `quantized` when prepared); `features`
  // (optional) gets the block's output a_k as chain_features makes it, which a recurrent head k + 1
  // reads in place of h.
  std::vector<float> scores(int k, const float* x, std::vector<float>* features = nullptr) const;
  // Head k's likeliest token (an id of the vocabulary) for input x.
  int32_t guess(int k, const float* x) const;
  // Guesses of heads 0 .. n-1 from one hidden state and the token it gave (`last`), stopping before
  // the first guess whose path probability (the product of each head's softmax probability of its
  // guess, this one included) is below p_min: the token tree of width 1.
  void propose(const float* h, int32_t last, int n, std::vector<int32_t>& guesses, float p_min = 0) const;
  // A token tree of at most n_nodes tokens (Medusa's tree, grown best first as in EAGLE-2): a token at
  // depth k + 1 is one of head k's `width` likeliest, and the tree takes the tokens whose paths have
  // the highest products of head probabilities. parents[i] is the index of token i's parent (-1: the
  // token the hidden state predicted, `last`), parents before children. A token-input head's choices
  // depend on the parent's token (a recurrent head's on the parent's whole path), so each expanded node
  // runs its head once. Growth stops where the likeliest candidate's path probability is below p_min.
  void propose_tree(const float* h, int32_t last, int n_nodes, int width, std::vector<int32_t>& tokens,
                    std::vector<int32_t>& parents, float p_min = 0) const;
};

// A corpus cut into segments for the heads' training rows: each document (a file: a chat transcript,
// say) is read from its own start, in runs of at most `ctx` tokens; a last run shorter than `min_len`
// is left out. Returns the kept tokens, and each segment's length in `lengths`.
std::vector<int32_t> corpus_segments(const std::vector<std::vector<int32_t>>& documents, int ctx, int min_len,
                                     std::vector<int32_t>& lengths);

// Training rows of a corpus for the heads: the target's final hidden states (after the output norm) of
// every token of `segments` [n_rows = their sum, n_embd], each segment read as a sequence of its own
// from position 0 (a fresh context), several segments to a forward pass of at most `ctx` tokens. With
// `predicted`, also the target's own greedy prediction after each token (the argmax of its logits over
// the segment so far: what it would say next there). `progress` (optional) hears (rows done, rows)
// after each pass.
std::vector<float> corpus_states(const Model& target, std::span<const int32_t> tokens, std::span<const int32_t> segments,
                                 int ctx, std::vector<int32_t>* predicted = nullptr,
                                 const std::function<void(int64_t, int64_t)>& progress = {});

// Head k's label for each of the first n_rows rows: index[] (the token's position in the heads'
// vocabulary subset, -1 outside it) of the token 2 + k places ahead, -1 where that token is past the
// row's segment. With `predicted` (corpus_states), the target's own guess of that token after the
// corpus up to the token before it, predicted[i + 1 + k]: what the heads must match for their guesses
// to be accepted. Without it, the corpus token itself.
std::vector<int32_t> head_labels(std::span<const int32_t> tokens, const std::vector<int32_t>* predicted,
                                 std::span<const int32_t> index, int k, std::span<const int32_t> segments,
                                 int64_t n_rows);

// The most frequent `n` token ids of `tokens` (ties: the lower id), most frequent first.
std::vector<int32_t> frequent_tokens(std::span<const int32_t> tokens, int32_t n, int32_t n_vocab);

// Trains one head at a time with Adam on cross-entropy over the subset, by hand-written backprop of
// the residual block (U_S stays frozen).
class HeadTrainer {
 public:
  HeadTrainer(DecodingHeads& heads, float learning_rate);
  // One step on input rows x[r] (n_in() floats each: DecodingHeads::input) with labels[r] = index into
  // heads.vocab, or -1 to skip.
  // Returns the mean cross-entropy of the labelled rows (before the update); 0 if none.
  double step(int k, std::span<const float> x, std::span<const int32_t> labels);
  // Mean cross-entropy of head k without updating (validation).
  double loss(int k, std::span<const float> x, std::span<const int32_t> labels) const;
  // Gradients of the mean cross-entropy with respect to W_k and b_k (for tests); returns the loss.
  double gradients(int k, std::span<const float> x, std::span<const int32_t> labels, std::vector<float>& dw,
                   std::vector<float>& db) const;

 private:
  DecodingHeads& heads_;
  float lr_;
  std::vector<std::vector<float>> m_w_, v_w_, m_b_, v_b_;  // Adam moments per head
  std::vector<int64_t> t_;                                 // Adam steps per head
};

}  // namespace serval
