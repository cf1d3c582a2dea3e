// Medusa-style decoding heads on a frozen target (Cai et al. 2024, "Medusa"): head k turns the
// target's final hidden state h (after the output norm, at the position that predicted token t+1)
// into a guess of token t+2+k:
//
//   a_k = h + SiLU(W_k h + b_k),  scores = U_S a_k,  guess = S[argmax scores]
//
// U_S is the target's own (frozen) output matrix restricted to S, a frequency-ranked subset of the
// vocabulary, so a head costs d^2 + |S| d multiply-adds. Heads are trained by `serval train-heads`
// (HeadTrainer below) and stored in a small GGUF file.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace serval {

class Model;

struct DecodingHeads {
  int32_t n_embd = 0;
  int32_t n_vocab = 0;             // the target's vocabulary size (checked at load)
  std::vector<int32_t> vocab;      // S: the token ids the heads can propose
  std::vector<std::vector<float>> w, b;  // per head: W [n_embd x n_embd] row-major (out, in), b [n_embd]
  std::vector<float> out;          // U_S [|S| x n_embd], from the target (not stored in the file)
  std::vector<float> out_t;        // U_S transposed [n_embd x |S|], for training's backward pass

  int n_heads() const { return int(w.size()); }
  // Zero-initialised heads (a_k = h + SiLU(0) = h + 0: the head starts as the target's own head).
  static DecodingHeads create(const Model& target, int n_heads, std::vector<int32_t> vocab);
  // Loads a heads file made for `target`; throws Error naming the mismatch.
  static DecodingHeads load(const std::string& path, const Model& target);
  void save(const std::string& path, const std::string& target_name) const;
  // The target's output rows of the subset (and their transpose).
  void init_output(const Model& target);

  // a = h + SiLU(W_k h + b_k); z (optional) gets W_k h + b_k.
  void block(int k, const float* h, float* a, float* z = nullptr) const;
  // Guesses of heads 0 .. n-1 from one hidden state.
  void propose(const float* h, int n, std::vector<int32_t>& guesses) const;
  // A token tree of at most n_nodes tokens (Medusa's tree, grown best first as in EAGLE-2): a token at
  // depth k + 1 is one of head k's `width` likeliest, and the tree takes the tokens whose paths have
  // the highest products of head probabilities. parents[i] is the index of token i's parent (-1: the
  // token the hidden state predicted), parents before children.
  void propose_tree(const float* h, int n_nodes, int width, std::vector<int32_t>& tokens,
                    std::vector<int32_t>& parents) const;
};

// The most frequent `n` token ids of `tokens` (ties: the lower id), most frequent first.
std::vector<int32_t> frequent_tokens(std::span<const int32_t> tokens, int32_t n, int32_t n_vocab);

// Trains one head at a time with Adam on cross-entropy over the subset, by hand-written backprop of
// the residual block (U_S stays frozen).
class HeadTrainer {
 public:
  HeadTrainer(DecodingHeads& heads, float learning_rate);
  // One step on rows h[r] (n_embd floats each) with labels[r] = index into heads.vocab, or -1 to skip.
  // Returns the mean cross-entropy of the labelled rows (before the update); 0 if none.
  double step(int k, std::span<const float> h, std::span<const int32_t> labels);
  // Mean cross-entropy of head k without updating (validation).
  double loss(int k, std::span<const float> h, std::span<const int32_t> labels) const;
  // Gradients of the mean cross-entropy with respect to W_k and b_k (for tests); returns the loss.
  double gradients(int k, std::span<const float> h, std::span<const int32_t> labels, std::vector<float>& dw,
                   std::vector<float>& db) const;

 private:
  DecodingHeads& heads_;
  float lr_;
  std::vector<std::vector<float>> m_w_, v_w_, m_b_, v_b_;  // Adam moments per head
  std::vector<int64_t> t_;                                 // Adam steps per head
};

}  // namespace serval
