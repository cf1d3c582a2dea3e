#include "engine/heads.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <queue>
#include <tuple>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "io/ggml_types.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "sampling/sampler.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

WeightMatrix f32_matrix(const float* data, int64_t rows, int64_t cols) {
  WeightMatrix m;
  m.type = DType::F32;
  m.rows = rows;
  m.cols = cols;
  m.data = reinterpret_cast<const uint8_t*>(data);
  m.row_stride = size_t(cols) * sizeof(float);
  return m;
}

// out[c][r] = in[r][c] for an r x c matrix.
std::vector<float> transpose(std::span<const float> in, int64_t rows, int64_t cols) {
  std::vector<float> out(in.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
  return out;
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

}  // namespace

std::vector<int32_t> corpus_segments(const std::vector<std::vector<int32_t>>& documents, int ctx, int min_len,
                                     std::vector<int32_t>& lengths) {
  check(ctx >= 1 && min_len >= 1, "corpus_segments: ctx and min_len must be positive (got {}, {})", ctx, min_len);
  std::vector<int32_t> kept;
  lengths.clear();
  for (const auto& doc : documents)
    for (size_t at = 0; at < doc.size(); at += size_t(ctx)) {
      const int32_t n = int32_t(std::min(doc.size() - at, size_t(ctx)));
      if (n < min_len) continue;
      kept.insert(kept.end(), doc.begin() + int64_t(at), doc.begin() + int64_t(at) + n);
      lengths.push_back(n);
    }
  return kept;
}

namespace {

// The buffers of corpus_states' passes, reused from pass to pass (a pass of 512 tokens of a 152 K
// vocabulary has 311 MB of logits).
struct PassBuffers {
  std::vector<float> h, logits;
};

// One forward pass over consecutive segments [first, last) that start at row `row`, each its own
// sequence (slots from 0 up, one per token); appends their hidden states and predictions.
void segments_pass(const Model& target, std::span<const int32_t> tokens, std::span<const int32_t> segments,
                   size_t first, size_t last, int64_t row, KvCache& kv, PassBuffers& buf, std::vector<float>& all,
                   std::vector<int32_t>* predicted) {
  Batch batch(target.config().n_kv_groups());
  int32_t slot = 0;
  for (size_t s = first; s < last; ++s) {
    const int32_t len = segments[s], seq = int32_t(s - first);
    for (int g = 0; g < batch.n_groups(); ++g) {
      batch.block_tables[g].emplace_back(size_t(len));
      std::iota(batch.block_tables[g].back().begin(), batch.block_tables[g].back().end(), slot);
    }
    for (int32_t p = 0; p < len; ++p, ++slot) batch.add(tokens[size_t(row++)], p, seq, slot, true);
  }
  std::vector<float>& h = buf.h;
  std::vector<float>& logits = buf.logits;
  if (predicted) {
    target.forward(batch, kv, logits, &h);
    const size_t n_vocab = size_t(target.config().n_vocab);
    for (size_t p = 0; p < batch.size(); ++p)
      predicted->push_back(argmax(std::span<const float>(logits).subspan(p * n_vocab, n_vocab)));
  } else {
    target.forward_hidden(batch, kv, h);
  }
  all.insert(all.end(), h.begin(), h.end());
}

}  // namespace

std::vector<float> corpus_states(const Model& target, std::span<const int32_t> tokens, std::span<const int32_t> segments,
                                 int ctx, std::vector<int32_t>* predicted, const std::function<void(int64_t, int64_t)>& progress) {
  check(ctx >= 1, "corpus_states: ctx must be positive (got {})", ctx);
  int64_t n_rows = 0;
  for (int32_t len : segments) {
    check(len >= 1 && len <= ctx, "corpus_states: a segment of {} tokens (1..{} allowed)", len, ctx);
    n_rows += len;
  }
  check(n_rows <= int64_t(tokens.size()), "corpus_states: segments of {} tokens over a corpus of {}", n_rows, tokens.size());
  std::vector<float> all;
  all.reserve(size_t(n_rows * target.config().n_embd));
  KvCache kv(target.config(), ctx);
  PassBuffers buf;
  if (predicted) predicted->clear();
  int64_t row = 0;
  for (size_t first = 0; first < segments.size();) {
    size_t last = first;
    int64_t n = 0;  // the pass's tokens
    for (; last < segments.size() && n + segments[last] <= ctx; ++last) n += segments[last];
    segments_pass(target, tokens, segments, first, last, row, kv, buf, all, predicted);
    row += n, first = last;
    if (progress) progress(row, n_rows);
  }
  return all;
}

std::vector<int32_t> head_labels(std::span<const int32_t> tokens, const std::vector<int32_t>* predicted,
                                 std::span<const int32_t> index, int k, std::span<const int32_t> segments,
                                 int64_t n_rows) {
  std::vector<int32_t> labels(static_cast<size_t>(n_rows), -1);
  int64_t start = 0;
  for (int32_t len : segments) {
    const int64_t end = std::min(start + len, n_rows);
    for (int64_t i = start; i + 2 + k < end; ++i) {
      const int64_t j = i + 2 + k;  // the token head k guesses
      labels[size_t(i)] = index[size_t(predicted ? (*predicted)[size_t(j - 1)] : tokens[size_t(j)])];
    }
    start += len;
    if (start >= n_rows) break;
  }
  return labels;
}

std::vector<int32_t> frequent_tokens(std::span<const int32_t> tokens, int32_t n, int32_t n_vocab) {
  std::vector<int64_t> count(size_t(n_vocab), 0);
  for (int32_t t : tokens)
    if (t >= 0 && t < n_vocab) ++count[size_t(t)];
  std::vector<int32_t> ids(static_cast<size_t>(n_vocab), 0);
  for (int32_t i = 0; i < n_vocab; ++i) ids[size_t(i)] = i;
  n = std::min(n, n_vocab);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                    [&](int32_t a, int32_t b) { return count[a] != count[b] ? count[a] > count[b] : a < b; });
  ids.resize(size_t(n));
  return ids;
}

DecodingHeads DecodingHeads::create(const Model& target, int n_heads, std::vector<int32_t> vocab, bool token_input,
                                    bool recurrent) {
  check(n_heads >= 1 && n_heads <= 16, "the number of heads must be 1..16 (got {})", n_heads);
  check(token_input || !recurrent, "recurrent heads are token-input heads");
  check(!vocab.empty(), "the heads' vocabulary is empty");
  DecodingHeads h;
  h.n_embd = int32_t(target.config().n_embd);
  h.n_vocab = target.tokenizer().n_vocab();
  h.token_input = token_input;
  h.recurrent = recurrent;
  h.vocab = std::move(vocab);
  const size_t d = size_t(h.n_embd);
  h.w.assign(size_t(n_heads), std::vector<float>(d * size_t(h.n_in()), 0.0f));
  h.b.assign(size_t(n_heads), std::vector<float>(d, 0.0f));
  h.init_output(target);
  return h;
}

void DecodingHeads::init_output(const Model& target) {
  check(!target.config().shard.split(), "decoding heads need the whole model's output matrix (not with --tp / --pp)");
  const size_t d = size_t(n_embd);
  out.assign(vocab.size() * d, 0.0f);
  for (size_t v = 0; v < vocab.size(); ++v) get_row(target.weights().output, vocab[v], out.data() + v * d);
  out_t = transpose(out, int64_t(vocab.size()), int64_t(d));
  this->target = &target;
}

DecodingHeads DecodingHeads::load(const std::string& path, const Model& target) {
  GgufFile f(path);
  check(f.find_string("general.architecture").value_or("") == "serval-heads",
        "{} is not a decoding-heads file (general.architecture is not 'serval-heads')", path);
  DecodingHeads h;
  h.n_embd = int32_t(f.get_int("serval-heads.n_embd"));
  h.n_vocab = int32_t(f.get_int("serval-heads.n_vocab"));
  const int64_t n_heads = f.get_int("serval-heads.count");
  h.token_input = f.find_int("serval-heads.token_input").value_or(0) != 0;
  h.recurrent = f.find_int("serval-heads.recurrent").value_or(0) != 0;
  check(h.token_input || !h.recurrent, "{}: recurrent heads must be token-input heads", path);
  check(h.n_embd == target.config().n_embd, "{}: heads for hidden size {}, the model's is {}", path, h.n_embd,
        target.config().n_embd);
  check(h.n_vocab == target.tokenizer().n_vocab(), "{}: heads for a vocabulary of {} tokens, the model's has {}", path,
        h.n_vocab, target.tokenizer().n_vocab());
  check(n_heads >= 1 && n_heads <= 16, "{}: {} heads (1..16 expected)", path, n_heads);
  auto tensor = [&](const std::string& name, uint64_t n) {
    const TensorRef* t = f.find_tensor(name);
    check(t != nullptr, "{}: tensor '{}' is missing", path, name);
    check(t->type == DType::F32 && t->n_elements() == n, "{}: tensor '{}' must be F32 with {} elements", path, name, n);
    const float* p = reinterpret_cast<const float*>(t->data);
    return std::vector<float>(p, p + n);
  };
  const TensorRef* vt = f.find_tensor("heads.vocab");
  check(vt != nullptr && vt->type == DType::F32 && vt->ne.size() == 1 && vt->ne[0] >= 1,
        "{}: tensor 'heads.vocab' (F32 token ids) is missing or malformed", path);
  for (float id : tensor("heads.vocab", vt->ne[0])) {
    check(id >= 0 && id < float(h.n_vocab) && id == std::floor(id), "{}: vocabulary entry {} is not a token id", path, id);
    h.vocab.push_back(int32_t(id));
  }
  const uint64_t d = uint64_t(h.n_embd);
  for (int64_t k = 0; k < n_heads; ++k) {
    h.w.push_back(tensor("heads." + std::to_string(k) + ".weight", d * uint64_t(h.n_in())));
    h.b.push_back(tensor("heads." + std::to_string(k) + ".bias", d));
  }
  h.init_output(target);
  h.prepare_to_propose();
  return h;
}

void DecodingHeads::save(const std::string& path, const std::string& target_name) const {
  GgufWriter g;
  g.add_string("general.architecture", "serval-heads");
  g.add_string("serval-heads.target", target_name);
  g.add_u32("serval-heads.count", uint32_t(n_heads()));
  g.add_u32("serval-heads.n_embd", uint32_t(n_embd));
  g.add_u32("serval-heads.n_vocab", uint32_t(n_vocab));
  g.add_u32("serval-heads.token_input", token_input ? 1 : 0);
  if (recurrent) g.add_u32("serval-heads.recurrent", 1);
  std::vector<float> ids(vocab.begin(), vocab.end());  // exact below 2^24
  g.add_f32_tensor("heads.vocab", {ids.size()}, ids.data());
  const uint64_t d = uint64_t(n_embd);
  for (int k = 0; k < n_heads(); ++k) {
    g.add_f32_tensor("heads." + std::to_string(k) + ".weight", {uint64_t(n_in()), d}, w[size_t(k)].data());
    g.add_f32_tensor("heads." + std::to_string(k) + ".bias", {d}, b[size_t(k)].data());
  }
  g.write(path);
}

void DecodingHeads::input(const float* h, int32_t token, float* x) const {
  const int64_t d = n_embd;
  std::copy(h, h + d, x);
  if (!token_input) return;
  check(target != nullptr && token >= 0 && token < n_vocab, "internal: token-input heads without a token");
  float* e = x + d;
  get_row(target->weights().tok_embd, token, e);
  double ss = 0;
  for (int64_t i = 0; i < d; ++i) ss += double(e[i]) * e[i];
  const float scale = float(1.0 / std::sqrt(ss / double(d) + 1e-6));
  for (int64_t i = 0; i < d; ++i) e[i] *= scale;
}

void DecodingHeads::training_input(const float* h_r, std::span<const int32_t> tokens, int64_t r, int k,
                                   float* x) const {
  input(h_r, tokens[size_t(std::min<int64_t>(r + 1 + k, int64_t(tokens.size()) - 1))], x);
}

namespace {

// a holds W_k x on entry; on exit a = h + SiLU(W_k x + b_k), h being x's first values (z gets W_k x + b_k).
void silu_residual(const std::vector<float>& bias, const float* x, float* a, float* z) {
  for (size_t i = 0; i < bias.size(); ++i) {
    const float zi = a[i] + bias[i];
    if (z) z[i] = zi;
    a[i] = x[i] + zi * sigmoid(zi);
  }
}

}  // namespace

void DecodingHeads::block_rows(int k, const float* x, int64_t n, float* a) const {
  const int64_t d = n_embd, in = n_in();
  cpu::matmul(f32_matrix(w[size_t(k)].data(), d, in), x, a, n);
  for (int64_t r = 0; r < n; ++r) silu_residual(b[size_t(k)], x + r * in, a + r * d, nullptr);
}

void DecodingHeads::chain_features(const float* base, float* a) const {
  double sb = 0, sa = 0;
  for (int64_t i = 0; i < n_embd; ++i) sb += double(base[i]) * base[i], sa += double(a[i]) * a[i];
  const float scale = sa > 0 ? float(std::sqrt(sb / sa)) : 1.0f;
  for (int64_t i = 0; i < n_embd; ++i) a[i] *= scale;
}

void DecodingHeads::block(int k, const float* x, float* a, float* z) const {
  const int64_t d = n_embd, in = n_in();
  for (int64_t i = 0; i < d; ++i) a[i] = cpu::dot(w[size_t(k)].data() + i * in, x, in);
  silu_residual(b[size_t(k)], x, a, z);
}

struct DecodingHeads::Quantized {
  std::vector<std::vector<uint8_t>> bytes;  // U_S, then W_0 .. W_{n-1}
  WeightMatrix out;
  std::vector<WeightMatrix> w;
};

void DecodingHeads::prepare_to_propose(DType type) {
  check(type == DType::Q4_0 || type == DType::Q8_0, "decoding heads propose from Q4_0 or Q8_0 copies");
  quantized.reset();
  if (n_embd % 32 != 0) return;
  auto q = std::make_shared<Quantized>();
  q->bytes.reserve(size_t(n_heads()) + 1);  // no reallocation: the matrices point into these buffers
  auto make = [&](const std::vector<float>& m, int64_t rows, int64_t cols) {
    const size_t rb = row_bytes(type, size_t(cols));
    std::vector<uint8_t>& bytes = q->bytes.emplace_back(size_t(rows) * rb);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(type, m.data() + r * cols, bytes.data() + size_t(r) * rb, size_t(cols));
    WeightMatrix wm;
    wm.type = type, wm.rows = rows, wm.cols = cols, wm.data = bytes.data(), wm.row_stride = rb;
    cpu::prepare_weights(wm);
    return wm;
  };
  q->out = make(out, int64_t(vocab.size()), n_embd);
  for (int k = 0; k < n_heads(); ++k) q->w.push_back(make(w[size_t(k)], n_embd, n_in()));
  quantized = std::move(q);
}

std::vector<float> DecodingHeads::scores(int k, const float* x, std::vector<float>* features) const {
  const int64_t d = n_embd, nv = int64_t(vocab.size());
  std::vector<float> a(static_cast<size_t>(d)), s(static_cast<size_t>(nv));
  if (!quantized) {
    block(k, x, a.data());
    cpu::matmul(f32_matrix(out.data(), nv, d), a.data(), s.data(), 1);
  } else {
    cpu::matmul(quantized->w[size_t(k)], x, a.data(), 1);
    silu_residual(b[size_t(k)], x, a.data(), nullptr);
    cpu::matmul(quantized->out, a.data(), s.data(), 1);
  }
  if (features) chain_features(x, a.data()), *features = std::move(a);
  return s;
}

int32_t DecodingHeads::guess(int k, const float* x) const {
  const std::vector<float> s = scores(k, x);
  return vocab[size_t(std::max_element(s.begin(), s.end()) - s.begin())];
}

void DecodingHeads::propose(const float* h, int32_t last, int n, std::vector<int32_t>& guesses, float p_min) const {
  std::vector<int32_t> parents;  // a tree of width 1 is the chain: each guess's parent is the one before
  propose_tree(h, last, n, 1, guesses, parents, p_min);
}

void DecodingHeads::propose_tree(const float* h, int32_t last, int n_nodes, int width, std::vector<int32_t>& tokens,
                                 std::vector<int32_t>& parents, float p_min) const {
  tokens.clear(), parents.clear();
  const int64_t nv = int64_t(vocab.size());
  const int depth = std::min(n_nodes, n_heads());
  width = int(std::min<int64_t>(width, nv));
  if (depth < 1 || width < 1) return;
  // One head's evaluation: its `width` likeliest tokens (index into vocab) with their softmax
  // probabilities, and for recurrent heads its output, which the next head reads.
  struct Eval {
    std::vector<std::pair<int32_t, float>> top;
    std::vector<float> features;
  };
  std::vector<Eval> evals;
  // An evaluation that reads h depends only on the head and the previous token (nothing for Medusa
  // heads): once per head for Medusa heads, once per expanded node for token-input heads, and for
  // recurrent heads past the first, whose input is the parent's path, every time.
  std::map<std::pair<int, int32_t>, size_t> memo;
  std::vector<float> x(static_cast<size_t>(n_in()));
  std::vector<int32_t> order(static_cast<size_t>(nv));
  auto evaluate = [&](int k, const float* f, int32_t previous) -> size_t {
    const bool reads_h = !recurrent || k == 0;
    const std::pair<int, int32_t> key{k, token_input ? previous : -1};
    if (reads_h)
      if (auto it = memo.find(key); it != memo.end()) return it->second;
    input(f, previous, x.data());
    Eval e;
    const std::vector<float> scores = this->scores(k, x.data(), recurrent ? &e.features : nullptr);
    const float mx = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (float s : scores) sum += std::exp(double(s - mx));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + width, order.end(), [&](int32_t a, int32_t b) {
      return scores[size_t(a)] > scores[size_t(b)] || (scores[size_t(a)] == scores[size_t(b)] && a < b);
    });
    for (int j = 0; j < width; ++j)
      e.top.push_back({order[size_t(j)], float(std::exp(double(scores[size_t(order[size_t(j)])] - mx)) / sum)});
    evals.push_back(std::move(e));
    if (reads_h) memo[key] = evals.size() - 1;
    return evals.size() - 1;
  };
  // Best first: a candidate is (path probability, -serial, parent, depth - 1, token id, its evaluation).
  using Cand = std::tuple<double, int64_t, int32_t, int, int32_t, size_t>;
  std::priority_queue<Cand> heap;
  int64_t serial = 0;
  auto offer = [&](double p, int32_t parent, int k, int32_t previous, const float* f) {
    if (k >= depth) return;
    const size_t e = evaluate(k, f, previous);
    for (const auto& [v, q] : evals[e].top) heap.push({p * q, -serial++, parent, k, vocab[size_t(v)], e});
  };
  offer(1.0, -1, 0, last, h);
  while (int(tokens.size()) < n_nodes && !heap.empty()) {
    const auto [p, neg_serial, parent, k, token, e] = heap.top();
    if (p < double(p_min)) break;  // the likeliest candidate left is too unlikely: so is every other
    heap.pop();
    tokens.push_back(token);
    parents.push_back(parent);
    offer(p, int32_t(tokens.size()) - 1, k + 1, token, recurrent ? evals[e].features.data() : h);
  }
}

// ---- training ------------------------------------------------------------------------------------

HeadTrainer::HeadTrainer(DecodingHeads& heads, float learning_rate) : heads_(heads), lr_(learning_rate) {
  const size_t n = size_t(heads.n_heads()), d = size_t(heads.n_embd);
  m_w_.assign(n, std::vector<float>(d * size_t(heads.n_in()), 0.0f));
  v_w_ = m_w_;
  m_b_.assign(n, std::vector<float>(d, 0.0f));
  v_b_ = m_b_;
  t_.assign(n, 0);
}

double HeadTrainer::gradients(int k, std::span<const float> x, std::span<const int32_t> labels, std::vector<float>& dw,
                              std::vector<float>& db) const {
  const DecodingHeads& H = heads_;
  const int64_t d = H.n_embd, in = H.n_in(), nv = int64_t(H.vocab.size()), n = int64_t(labels.size());
  check(int64_t(x.size()) == n * in, "internal: {} input values for {} rows", x.size(), n);
  const int64_t n_valid = std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l >= 0; });
  dw.assign(size_t(d * in), 0.0f);
  db.assign(size_t(d), 0.0f);
  if (n_valid == 0) return 0;
  // Forward: z = W x + b, a = h + SiLU(z) (h: x's first d values), scores = U a.
  std::vector<float> z(static_cast<size_t>(n * d)), a(static_cast<size_t>(n * d)), scores(static_cast<size_t>(n * nv));
  cpu::matmul(f32_matrix(H.w[size_t(k)].data(), d, in), x.data(), z.data(), n);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) {
      float& zi = z[size_t(r * d + i)];
      zi += H.b[size_t(k)][size_t(i)];
      a[size_t(r * d + i)] = x[size_t(r * in + i)] + zi * sigmoid(zi);
    }
  cpu::matmul(f32_matrix(H.out.data(), nv, d), a.data(), scores.data(), n);
  // Softmax cross-entropy; scores become dL/dscores = (p - onehot) / n_valid (0 for unlabelled rows).
  double loss = 0;
  for (int64_t r = 0; r < n; ++r) {
    float* s = scores.data() + r * nv;
    if (labels[size_t(r)] < 0) {
      std::fill(s, s + nv, 0.0f);
      continue;
    }
    const float mx = *std::max_element(s, s + nv);
    double sum = 0;
    for (int64_t v = 0; v < nv; ++v) sum += std::exp(double(s[v] - mx));
    loss += std::log(sum) + mx - s[labels[size_t(r)]];
    for (int64_t v = 0; v < nv; ++v) s[v] = float(std::exp(double(s[v] - mx)) / sum / double(n_valid));
    s[labels[size_t(r)]] -= 1.0f / float(n_valid);
  }
  // Backward: dA = G U (U^T as the weight), dZ = dA * SiLU'(z), dW = dZ^T x, db = sum dZ.
  std::vector<float> dz(static_cast<size_t>(n * d));
  cpu::matmul(f32_matrix(H.out_t.data(), d, nv), scores.data(), dz.data(), n);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) {
      const float zi = z[size_t(r * d + i)], s = sigmoid(zi);
      dz[size_t(r * d + i)] *= s * (1.0f + zi * (1.0f - s));
      db[size_t(i)] += dz[size_t(r * d + i)];
    }
  // dW^T[j][i] = sum_r x[r][j] dz[r][i]: dz^T [d x n] as the weight, x^T rows as the activations.
  const std::vector<float> dzt = transpose(dz, n, d), xt = transpose(x, n, in);
  std::vector<float> dwt(static_cast<size_t>(in * d));
  cpu::matmul(f32_matrix(dzt.data(), d, n), xt.data(), dwt.data(), in);
  dw = transpose(dwt, in, d);
  return loss / double(n_valid);
}

double HeadTrainer::loss(int k, std::span<const float> x, std::span<const int32_t> labels) const {
  const DecodingHeads& H = heads_;
  const int64_t d = H.n_embd, in = H.n_in(), nv = int64_t(H.vocab.size()), n = int64_t(labels.size());
  std::vector<float> a(static_cast<size_t>(n * d)), scores(static_cast<size_t>(n * nv));
  for (int64_t r = 0; r < n; ++r) H.block(k, x.data() + r * in, a.data() + r * d);
  cpu::matmul(f32_matrix(H.out.data(), nv, d), a.data(), scores.data(), n);
  double loss = 0;
  int64_t n_valid = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (labels[size_t(r)] < 0) continue;
    const float* s = scores.data() + r * nv;
    const float mx = *std::max_element(s, s + nv);
    double sum = 0;
    for (int64_t v = 0; v < nv; ++v) sum += std::exp(double(s[v] - mx));
    loss += std::log(sum) + mx - s[labels[size_t(r)]];
    ++n_valid;
  }
  return n_valid ? loss / double(n_valid) : 0.0;
}

double HeadTrainer::step(int k, std::span<const float> x, std::span<const int32_t> labels) {
  std::vector<float> dw, db;
  const double l = gradients(k, x, labels, dw, db);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const int64_t t = ++t_[size_t(k)];
  const float c1 = 1.0f / (1.0f - std::pow(b1, float(t))), c2 = 1.0f / (1.0f - std::pow(b2, float(t)));
  auto adam = [&](std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v) {
    for (size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr_ * (m[i] * c1) / (std::sqrt(v[i] * c2) + eps);
    }
  };
  adam(heads_.w[size_t(k)], dw, m_w_[size_t(k)], v_w_[size_t(k)]);
  adam(heads_.b[size_t(k)], db, m_b_[size_t(k)], v_b_[size_t(k)]);
  return l;
}

}  // namespace serval
