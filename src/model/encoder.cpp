#include "model/encoder.h"

#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "io/tensor_names.h"
#include "tensor/dequant.h"
#include "tokenizer/load.h"

namespace serval {
namespace encoder_load {

namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json(const fs::path& p) {
  try {
    return json::parse(read_text_file(p.string()));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
}

// Binds the encoder's tensors by GGUF name, checking shapes (GGUF order: ne[0] = columns).
class EncoderBinder {
 public:
  EncoderBinder(std::function<const TensorRef*(const std::string&)> lookup, std::string source)
      : lookup_(std::move(lookup)), source_(std::move(source)) {}

  WeightMatrix matrix(const std::string& name, int64_t rows, int64_t cols, bool required = true) {
    const TensorRef* t = find(name, required);
    if (!t) return {};
    expect(*t, {uint64_t(cols), uint64_t(rows)});
    WeightMatrix m{t->type, rows, cols, t->data, row_bytes(t->type, size_t(cols))};
    cpu::prepare_weights(m);
    return m;
  }
  std::vector<float> vec(const std::string& name, int64_t n, bool required = true) {
    const TensorRef* t = find(name, required);
    if (!t) return {};
    expect(*t, {uint64_t(n)});
    std::vector<float> out(static_cast<size_t>(n));
    dequantize_row(t->type, t->data, out.data(), size_t(n));
    return out;
  }
  const TensorRef* find(const std::string& name, bool required) {
    const TensorRef* t = lookup_(name);
    check(t || !required, "{}: missing tensor '{}'", source_, name);
    return t;
  }

 private:
  void expect(const TensorRef& t, std::vector<uint64_t> ne) {
    check(t.ne == ne, "{}: tensor '{}' has shape [{}], expected [{}]", source_, t.name, fmt::join(t.ne, ", "),
          fmt::join(ne, ", "));
  }
  std::function<const TensorRef*(const std::string&)> lookup_;
  std::string source_;
};

EncoderWeights bind(const EncoderConfig& c, EncoderBinder& b) {
  EncoderWeights w;
  const int64_t E = c.n_embd, F = c.n_ff;
  w.tok_embd = b.matrix("token_embd.weight", c.n_vocab, E);
  w.pos_embd = b.matrix("position_embd.weight", c.n_pos, E);
  w.type_embd = b.matrix("token_types.weight", c.n_type, E);
  w.embd_norm_w = b.vec("token_embd_norm.weight", E);
  w.embd_norm_b = b.vec("token_embd_norm.bias", E);
  for (int64_t il = 0; il < c.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    EncoderLayer l;
    l.wq = b.matrix(p + "attn_q.weight", E, E), l.bq = b.vec(p + "attn_q.bias", E);
    l.wk = b.matrix(p + "attn_k.weight", E, E), l.bk = b.vec(p + "attn_k.bias", E);
    l.wv = b.matrix(p + "attn_v.weight", E, E), l.bv = b.vec(p + "attn_v.bias", E);
    l.wo = b.matrix(p + "attn_output.weight", E, E), l.bo = b.vec(p + "attn_output.bias", E);
    l.attn_norm_w = b.vec(p + "attn_output_norm.weight", E), l.attn_norm_b = b.vec(p + "attn_output_norm.bias", E);
    l.ffn_up = b.matrix(p + "ffn_up.weight", F, E), l.b_up = b.vec(p + "ffn_up.bias", F);
    l.ffn_down = b.matrix(p + "ffn_down.weight", E, F), l.b_down = b.vec(p + "ffn_down.bias", E);
    l.out_norm_w = b.vec(p + "layer_output_norm.weight", E), l.out_norm_b = b.vec(p + "layer_output_norm.bias", E);
    // Where the CPU has BF16 matrix tiles, the layer's products run in them (ops.h: prepare_bf16_tiles).
    for (WeightMatrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_up, &l.ffn_down}) cpu::prepare_bf16_tiles(*m);
    w.layers.push_back(std::move(l));
  }
  if (c.n_classes > 0) {
    w.cls = b.matrix("cls.weight", E, E), w.cls_b = b.vec("cls.bias", E);
    w.cls_out = b.matrix("cls.output.weight", c.n_classes, E), w.cls_out_b = b.vec("cls.output.bias", c.n_classes);
  }
  return w;
}

}  // namespace encoder_load

using encoder_load::EncoderBinder;
using encoder_load::json;
namespace fs = std::filesystem;

Pooling pooling_from_name(const std::string& name) {
  static const std::map<std::string, Pooling> names = {
      {"none", Pooling::None}, {"mean", Pooling::Mean}, {"cls", Pooling::Cls}, {"last", Pooling::Last}, {"rank", Pooling::Rank}};
  const auto it = names.find(name);
  check(it != names.end(), "unknown pooling '{}' (mean, cls, last, rank, none)", name);
  return it->second;
}

const char* pooling_name(Pooling p) {
  switch (p) {
    case Pooling::None: return "none";
    case Pooling::Mean: return "mean";
    case Pooling::Cls: return "cls";
    case Pooling::Last: return "last";
    case Pooling::Rank: return "rank";
  }
  return "?";
}

void EncoderConfig::validate(const std::string& src) const {
  check(n_vocab > 0 && n_embd > 0 && n_layer > 0 && n_head > 0 && n_ff > 0 && n_pos > 0 && n_type > 0,
        "{}: encoder hyperparameters must be positive (vocab {}, embd {}, layers {}, heads {}, ff {}, positions {}, "
        "types {})", src, n_vocab, n_embd, n_layer, n_head, n_ff, n_pos, n_type);
  check(n_layer <= 1024 && n_embd <= (1 << 16) && n_ff <= (1 << 20) && n_pos <= (1 << 20) && n_type <= 1024 &&
            n_vocab <= INT32_MAX,
        "{}: encoder hyperparameters are absurdly large", src);
  check(n_embd % n_head == 0, "{}: embedding size {} is not a multiple of {} heads", src, n_embd, n_head);
  check(std::isfinite(eps) && eps > 0, "{}: bad LayerNorm epsilon", src);
  check(n_classes >= 0 && n_classes <= 1 << 16, "{}: bad number of classes {}", src, n_classes);
  for (int64_t d : matryoshka_dims) check(d > 0 && d <= n_embd, "{}: Matryoshka dimension {} out of range", src, d);
}

namespace encoder_load {

class GgufEncoder : public EncoderModel {
 public:
  explicit GgufEncoder(const std::string& path) : file_(path) {
    path_ = path;
    const GgufFile& g = file_;
    EncoderConfig& c = config_;
    c.arch = g.get_string("general.architecture");
    check(c.arch == "bert", "{}: '{}' is not an encoder architecture (bert)", path, c.arch);
    const std::string a = c.arch + ".";
    c.n_embd = g.get_int(a + "embedding_length");
    c.n_layer = g.get_int(a + "block_count");
    c.n_head = g.get_int(a + "attention.head_count");
    c.n_ff = g.get_int(a + "feed_forward_length");
    c.n_pos = g.get_int(a + "context_length");
    c.eps = float(g.find_float(a + "attention.layer_norm_epsilon").value_or(1e-12));
    c.pooling = Pooling(g.find_int(a + "pooling_type").value_or(int64_t(Pooling::Mean)));
    check(int(c.pooling) >= 0 && int(c.pooling) <= 4, "{}: unknown pooling type {}", path, int(c.pooling));
    c.n_vocab = int64_t(g.get_array("tokenizer.ggml.tokens").size());
    const TensorRef* types = file_.find_tensor("token_types.weight");
    check(types && types->ne.size() == 2, "{}: missing tensor 'token_types.weight'", path);
    c.n_type = int64_t(types->ne[1]);
    if (g.has("serval.matryoshka_dimensions"))
      for (int64_t d : g.get_array("serval.matryoshka_dimensions").ints) c.matryoshka_dims.push_back(d);
    if (const TensorRef* out = file_.find_tensor("cls.output.weight"))
      c.n_classes = out->ne.size() == 2 ? int64_t(out->ne[1]) : 1;
    c.validate(path);
    EncoderBinder binder([this](const std::string& n) { return file_.find_tensor(n); }, path);
    weights_ = bind(c, binder);
    tokenizer_ = std::make_unique<Tokenizer>(vocab_from_gguf(g));
    check(tokenizer_->vocab().kind == TokenizerKind::WordPiece, "{}: an encoder needs a WordPiece (bert) tokenizer", path);
  }

 private:
  GgufFile file_;
};

// The pooling of a sentence-transformers directory (1_Pooling/config.json), mean otherwise.
Pooling hf_pooling(const fs::path& dir) {
  const fs::path p = dir / "1_Pooling" / "config.json";
  if (!fs::exists(p)) return Pooling::Mean;
  const json j = read_json(p);
  if (j.value("pooling_mode_cls_token", false)) return Pooling::Cls;
  if (j.value("pooling_mode_lasttoken", false)) return Pooling::Last;
  check(j.value("pooling_mode_mean_tokens", true), "{}: unsupported pooling (mean, cls, last)", p.string());
  return Pooling::Mean;
}

class HfEncoder : public EncoderModel {
 public:
  explicit HfEncoder(const fs::path& dir) : file_((dir / "model.safetensors").string()) {
    path_ = dir.string();
    const fs::path config_path = dir / "config.json";
    const json j = read_json(config_path);
    EncoderConfig& c = config_;
    try {
      check(j.value("model_type", "") == "bert", "{}: model_type '{}' is not an encoder (bert)", config_path.string(),
            j.value("model_type", ""));
      check(j.value("hidden_act", "gelu") == "gelu", "{}: hidden_act '{}' is unsupported (gelu)", config_path.string(),
            j.value("hidden_act", ""));
      check(j.value("position_embedding_type", "absolute") == "absolute", "{}: only absolute positions are supported",
            config_path.string());
      c.n_vocab = j.at("vocab_size"), c.n_embd = j.at("hidden_size"), c.n_layer = j.at("num_hidden_layers");
      c.n_head = j.at("num_attention_heads"), c.n_ff = j.at("intermediate_size");
      c.n_pos = j.at("max_position_embeddings"), c.n_type = j.value("type_vocab_size", 2);
      c.eps = j.value("layer_norm_eps", 1e-12f);
      if (j.contains("matryoshka_dimensions") && j["matryoshka_dimensions"].is_array())
        c.matryoshka_dims = j["matryoshka_dimensions"].get<std::vector<int64_t>>();
      else if (j.value("is_matryoshka", false))
        c.matryoshka_dims = {c.n_embd};
    } catch (const json::exception& e) {
      fail("{}: missing or mistyped field: {}", config_path.string(), e.what());
    }
    for (const auto& t : file_.tensors())
      if (const std::string n = bert_gguf_name(t.name); !n.empty()) by_gguf_name_[n] = &t;
    const bool classifier = by_gguf_name_.count("cls.output.weight") > 0;
    if (classifier) c.n_classes = int64_t(by_gguf_name_["cls.output.weight"]->ne.size() == 2 ? by_gguf_name_["cls.output.weight"]->ne[1] : 1);
    c.pooling = classifier ? Pooling::Rank : hf_pooling(dir);
    c.validate(config_path.string());
    EncoderBinder binder([this](const std::string& n) -> const TensorRef* {
      const auto it = by_gguf_name_.find(n);
      return it == by_gguf_name_.end() ? nullptr : it->second;
    }, path_);
    weights_ = bind(c, binder);
    Vocab v = vocab_from_tokenizer_json((dir / "tokenizer.json").string());
    check(v.kind == TokenizerKind::WordPiece, "{}: an encoder needs a WordPiece tokenizer.json", path_);
    check(int64_t(v.tokens.size()) == c.n_vocab, "{}: tokenizer has {} tokens but the model {}", path_, v.tokens.size(), c.n_vocab);
    tokenizer_ = std::make_unique<Tokenizer>(std::move(v));
  }

 private:
  SafetensorsFile file_;
  std::map<std::string, const TensorRef*> by_gguf_name_;
};

}  // namespace encoder_load

bool EncoderModel::is_encoder(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path config = fs::path(path) / "config.json";
    if (!fs::exists(config)) return false;
    try {
      return json::parse(read_text_file(config.string())).value("model_type", "") == "bert";
    } catch (const std::exception&) {
      return false;
    }
  }
  if (fs::path(path).extension() != ".gguf" || !fs::is_regular_file(path, ec)) return false;
  try {
    return GgufFile(path).find_string("general.architecture").value_or("") == "bert";
  } catch (const Error&) {
    return false;
  }
}

std::unique_ptr<EncoderModel> EncoderModel::load(const std::string& path) {
  check(fs::exists(path), "{}: no such file or directory", path);
  if (fs::is_directory(path)) return std::make_unique<encoder_load::HfEncoder>(fs::path(path));
  return std::make_unique<encoder_load::GgufEncoder>(path);
}

EncoderInput EncoderModel::tokenize(const std::string& text) const {
  EncoderInput in;
  in.tokens = tokenizer_->encode(text, /*add_special=*/true, /*parse_special=*/true);
  in.types.assign(in.tokens.size(), 0);
  return in;
}

EncoderInput EncoderModel::tokenize_pair(const std::string& a, const std::string& b) const {
  EncoderInput in = tokenize(a);
  std::vector<int32_t> second = tokenizer_->encode(b, false, true);
  if (tokenizer_->vocab().eos >= 0) second.push_back(tokenizer_->vocab().eos);
  in.tokens.insert(in.tokens.end(), second.begin(), second.end());
  in.types.resize(in.tokens.size(), config_.n_type > 1 ? 1 : 0);
  return in;
}

void EncoderModel::check_input(const EncoderInput& in) const {
  check(!in.tokens.empty(), "an encoder input must have at least one token");
  check(int64_t(in.tokens.size()) <= config_.n_pos, "an input of {} tokens is longer than the model's {} positions",
        in.tokens.size(), config_.n_pos);
  check(in.types.size() == in.tokens.size(), "internal: token types do not match the tokens");
  for (size_t i = 0; i < in.tokens.size(); ++i) {
    check(in.tokens[i] >= 0 && in.tokens[i] < config_.n_vocab, "token id {} is outside the vocabulary of {}",
          in.tokens[i], config_.n_vocab);
    check(in.types[i] >= 0 && in.types[i] < config_.n_type, "token type {} is outside the model's {}", in.types[i],
          config_.n_type);
  }
}

std::vector<float> EncoderModel::forward(const std::vector<EncoderInput>& inputs) const {
  const int64_t E = config_.n_embd;
  int64_t n_tok = 0;
  for (const auto& in : inputs) {
    check_input(in);
    n_tok += int64_t(in.tokens.size());
  }
  std::vector<float> x(size_t(n_tok * E));
  std::vector<std::pair<int64_t, const EncoderInput*>> rows;  // token -> (position, input)
  for (const auto& in : inputs)
    for (size_t p = 0; p < in.tokens.size(); ++p) rows.emplace_back(int64_t(p), &in);
  parallel_for(n_tok, [&](int64_t t) {
    const auto [p, in] = rows[size_t(t)];
    float* row = x.data() + t * E;
    std::vector<float> add(static_cast<size_t>(E));
    get_row(weights_.tok_embd, in->tokens[size_t(p)], row);
    get_row(weights_.pos_embd, p, add.data());
    for (int64_t i = 0; i < E; ++i) row[i] += add[size_t(i)];
    get_row(weights_.type_embd, in->types[size_t(p)], add.data());
    for (int64_t i = 0; i < E; ++i) row[i] += add[size_t(i)];
    layer_norm(row, weights_.embd_norm_w.data(), weights_.embd_norm_b.data(), row, E, config_.eps);
  });
  for (const auto& l : weights_.layers) {
    attention_block(l, inputs, x);
    ffn_block(l, n_tok, x);
  }
  return x;
}

namespace {
// The calling thread's buffers for a layer's intermediates, reused from layer to layer and call to call
// (a step of 600 tokens would otherwise allocate and zero about 9 MB per layer).
struct EncoderScratch {
  std::vector<float> q, k, v, att, o, up, down;
};
EncoderScratch& scratch() {
  thread_local EncoderScratch s;
  return s;
}
float* sized(std::vector<float>& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// x = LayerNorm(x + (y + bias)) row by row, for n_tok rows.
void residual_norm(float* x, int64_t n_tok, const float* y, const std::vector<float>& bias, const std::vector<float>& w,
                   const std::vector<float>& b, int64_t E, float eps) {
  parallel_for(n_tok, [&](int64_t t) {
    float* r = x + t * E;
    const float* yr = y + t * E;
    for (int64_t i = 0; i < E; ++i) r[i] += yr[i] + bias[size_t(i)];
    layer_norm(r, w.data(), b.data(), r, E, eps);
  });
}
}  // namespace

void EncoderModel::attention_block(const EncoderLayer& l, const std::vector<EncoderInput>& inputs,
                                   std::vector<float>& x) const {
  const int64_t E = config_.n_embd, n_tok = int64_t(x.size()) / E, n = n_tok * E;
  EncoderScratch& sc = scratch();
  float *q = sized(sc.q, n), *k = sized(sc.k, n), *v = sized(sc.v, n), *att = sized(sc.att, n), *o = sized(sc.o, n);
  const cpu::MatmulOut outs[] = {{&l.wq, q, l.bq.data()}, {&l.wk, k, l.bk.data()}, {&l.wv, v, l.bv.data()}};
  cpu::matmul_many(outs, x.data(), n_tok);
  // Every token of an input attends every token of that input.
  std::vector<cpu::RowSpan> spans;
  int64_t start = 0;
  for (const auto& in : inputs) {
    spans.push_back({start, int64_t(in.tokens.size())});
    start += int64_t(in.tokens.size());
  }
  const AttentionShape shape{int(config_.n_head), int(config_.n_head), int(config_.d_head()),
                             float(1.0 / std::sqrt(double(config_.d_head())))};
  cpu::attention_dense(shape, q, k, v, spans, att);
  cpu::matmul(l.wo, att, o, n_tok);
  residual_norm(x.data(), n_tok, o, l.bo, l.attn_norm_w, l.attn_norm_b, E, config_.eps);
}

void EncoderModel::ffn_block(const EncoderLayer& l, int64_t n_tok, std::vector<float>& x) const {
  const int64_t E = config_.n_embd, F = config_.n_ff;
  EncoderScratch& sc = scratch();
  float *up = sized(sc.up, n_tok * F), *down = sized(sc.down, n_tok * E);
  const cpu::MatmulOut up_gelu[] = {{&l.ffn_up, up, l.b_up.data(), true}};
  cpu::matmul_many(up_gelu, x.data(), n_tok);
  cpu::matmul(l.ffn_down, up, down, n_tok);
  residual_norm(x.data(), n_tok, down, l.b_down, l.out_norm_w, l.out_norm_b, E, config_.eps);
}

std::vector<std::vector<float>> EncoderModel::embed(const std::vector<EncoderInput>& inputs, Pooling pooling,
                                                    bool normalize) const {
  check(pooling == Pooling::Mean || pooling == Pooling::Cls || pooling == Pooling::Last,
        "embeddings need mean, cls or last pooling, not {}", pooling_name(pooling));
  const int64_t E = config_.n_embd;
  const std::vector<float> h = forward(inputs);
  std::vector<std::vector<float>> out;
  int64_t start = 0;
  for (const auto& in : inputs) {
    const int64_t len = int64_t(in.tokens.size());
    std::vector<float> e(size_t(E), 0.0f);
    if (pooling == Pooling::Mean) {
      for (int64_t i = 0; i < E; ++i) {
        double s = 0;
        for (int64_t t = 0; t < len; ++t) s += h[size_t((start + t) * E + i)];
        e[size_t(i)] = float(s / double(len));
      }
    } else {
      const int64_t t = start + (pooling == Pooling::Cls ? 0 : len - 1);
      std::copy(h.begin() + t * E, h.begin() + (t + 1) * E, e.begin());
    }
    if (normalize) {
      double ss = 0;
      for (float f : e) ss += double(f) * f;
      const double inv = ss > 0 ? 1.0 / std::sqrt(ss) : 0.0;
      for (float& f : e) f = float(f * inv);
    }
    out.push_back(std::move(e));
    start += len;
  }
  return out;
}

std::vector<float> EncoderModel::classify(const std::vector<EncoderInput>& inputs) const {
  check(config_.n_classes > 0, "{}: the model has no classification head (it is not a cross-encoder)", path_);
  const int64_t E = config_.n_embd;
  const std::vector<float> h = forward(inputs);
  const int64_t n = int64_t(inputs.size());
  std::vector<float> first(size_t(n * E)), pooled(size_t(n * E)), logits(size_t(n * config_.n_classes));
  int64_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::copy(h.begin() + start * E, h.begin() + (start + 1) * E, first.begin() + i * E);
    start += int64_t(inputs[size_t(i)].tokens.size());
  }
  const cpu::MatmulOut dense[] = {{&weights_.cls, pooled.data(), weights_.cls_b.data()}},
                        out_proj[] = {{&weights_.cls_out, logits.data(), weights_.cls_out_b.data()}};
  cpu::matmul_many(dense, first.data(), n);
  for (float& f : pooled) f = std::tanh(f);
  cpu::matmul_many(out_proj, pooled.data(), n);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = logits[size_t(i * config_.n_classes)];
  return out;
}

}  // namespace serval
