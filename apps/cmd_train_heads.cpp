// `serval train-heads`: decoding heads for a frozen model (engine/heads.h), Medusa-style or, with
// --token-input, Hydra-style. Runs the model over a text corpus once (its final hidden states, Serval's
// own kernels), then trains each head with Adam to predict the token 2 + k places ahead, over the
// corpus's most frequent tokens; writes the heads to a small GGUF file for `--spec heads FILE`, and the
// loss curves to a PNG.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "apps/commands.h"
#include "apps/png_plot.h"
#include "base/error.h"
#include "base/file_util.h"
#include "engine/engine.h"
#include "engine/heads.h"
#include "model/model.h"

namespace serval::cli {
namespace {

struct TrainOptions {
  std::string model, output, loss_png, states;
  std::string response_template;  // rows before its last occurrence in a document carry no label
  std::vector<std::string> corpus;
  int heads = 4, vocab = 4096, ctx = 512, epochs = 2, batch = 64, threads = 0;
  int64_t max_tokens = 32768;
  bool self_distill = false;
  bool parse_special = false;  // chat transcripts: <|im_start|> and the like are their special tokens
  bool token_input = false;    // Hydra-style heads: each also reads the token before the one it guesses
  bool recurrent = false;      // token-input heads, each past the first reading the previous one's output
  std::string labels = "model";  // what a head learns to guess: the model's own prediction, or the corpus token
  int prompt_len = 32;
  float lr = 1e-3f;
  uint64_t seed = 1;
};

using Clock = std::chrono::steady_clock;

void progress(const char* what, int64_t done, int64_t total, const std::string& extra = "") {
  const int width = 30, filled = total ? int(width * done / total) : width;
  fmt::print(stderr, "\r{:<8} [{}{}] {}/{} {}", what, std::string(size_t(filled), '#'), std::string(size_t(width - filled), '.'),
             done, total, extra);
  if (done == total) fmt::print(stderr, "\n");
}

// The corpus: its files (or every file under a directory), each tokenized as one document, cut so that
// they hold max_tokens in all (self-distillation takes prompts from all of them). Per document also a
// mask, 1 for the rows that may carry a label: with --response-template, those from the template's last
// token in the document on (the row that predicts the response's first token, and the response); a
// document without the template, or every document when there is none, is all 1.
struct Documents {
  std::vector<std::vector<int32_t>> tokens, masks;
};

// Where a document's response starts: the number of tokens of its text up to the end of the
// template's last occurrence (the text is searched, not the tokens, which a tokenizer may split
// differently at the start of a text); 0 without one.
size_t response_start(const std::string& text, const std::string& response_template, const Tokenizer& tok,
                      bool parse_special) {
  if (response_template.empty()) return 0;
  const size_t at = text.rfind(response_template);
  if (at == std::string::npos) return 0;
  return tok.encode(text.substr(0, at + response_template.size()), false, parse_special).size();
}

Documents corpus_documents(const TrainOptions& o, const Tokenizer& tok) {
  Documents docs;
  int64_t total = 0;
  for (const auto& path : o.corpus) {
    std::vector<std::string> files;
    if (std::filesystem::is_directory(path)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(path))
        if (e.is_regular_file()) files.push_back(e.path().string());
      std::sort(files.begin(), files.end());
    } else {
      files.push_back(path);
    }
    for (const auto& f : files) {
      if (!o.self_distill && total >= o.max_tokens) break;
      const std::string text = read_text_file(f);
      auto& t = docs.tokens.emplace_back(tok.encode(text, false, o.parse_special));
      if (!o.self_distill && total + int64_t(t.size()) > o.max_tokens) t.resize(size_t(o.max_tokens - total));
      total += int64_t(t.size());
      auto& mask = docs.masks.emplace_back(t.size(), 1);
      const size_t start = response_start(text, o.response_template, tok, o.parse_special);
      std::fill(mask.begin(), mask.begin() + int64_t(std::min(mask.size(), start > 0 ? start - 1 : 0)), 0);
    }
  }
  return docs;
}

// Self-distillation: each window keeps its first prompt_len corpus tokens and continues with the
// model's own greedy output, so the heads learn what the model itself will say. Windows run as
// concurrent requests on the engine.
std::vector<int32_t> self_distilled(const Model& m, std::span<const int32_t> corpus, int ctx, int prompt_len,
                                    int64_t max_tokens) {
  check(prompt_len >= 1 && prompt_len < ctx, "--prompt-len must be 1..ctx-1 (got {})", prompt_len);
  check(int64_t(corpus.size()) > prompt_len, "the corpus has {} tokens, fewer than --prompt-len", corpus.size());
  // Prompts are spread evenly over the corpus (wrapping when it is smaller than the data).
  const int64_t n_windows = std::max<int64_t>(2, max_tokens / ctx), n_starts = int64_t(corpus.size()) - prompt_len;
  EngineConfig cfg;
  cfg.num_blocks = int32_t(16 * ((ctx + 15) / 16 + 1));
  cfg.scheduler.max_seqs = 16;
  cfg.prefix_caching = false;
  Engine engine(m, cfg);
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(n_windows));
  int64_t done = 0;
  for (int64_t w = 0; w < n_windows; ++w) {
    const int64_t start = (w * std::max<int64_t>(1, n_starts / n_windows)) % n_starts;  // spread over the corpus
    out[size_t(w)].assign(corpus.begin() + start, corpus.begin() + start + prompt_len);
    GenerationParams p;
    p.sampling.temperature = 0;
    p.sampling.compute_logprob = false;
    p.max_tokens = ctx - prompt_len;
    p.ignore_eos = true;
    engine.add_request(out[size_t(w)], p, [&out, &done, w](const TokenEvent& ev) {
      if (!ev.finished) out[size_t(w)].push_back(ev.token), ++done;
    });
  }
  const int64_t total = n_windows * (ctx - prompt_len);
  const auto t0 = Clock::now();
  for (int64_t i = 0; engine.step(); ++i)
    if (i % 8 == 0) {
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      progress("generate", done, total, fmt::format("{:.0f} tokens/s", double(done) / s));
    }
  progress("generate", total, total);
  std::vector<int32_t> tokens;
  for (const auto& o : out) tokens.insert(tokens.end(), o.begin(), o.end());
  return tokens;
}

// A line chart of each head's smoothed training loss, drawn on a png_plot canvas.
void write_loss_png(const std::string& path, const std::vector<std::vector<double>>& curves) {
  const int W = 640, H = 400, margin = 40;
  Canvas img(W, H);
  const Rgb black{0, 0, 0}, colors[6] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},
                                        {214, 39, 40}, {148, 103, 189}, {140, 86, 75}};
  for (int x = margin; x < W - margin / 2; ++x) img.pixel(x, H - margin, black);
  for (int y = margin / 2; y < H - margin; ++y) img.pixel(margin, y, black);
  double hi = 0;
  size_t n = 0;
  for (const auto& c : curves)
    for (double v : c) hi = std::max(hi, v), n = std::max(n, c.size());
  if (n < 2 || hi <= 0) return;
  for (size_t k = 0; k < curves.size(); ++k) {
    for (size_t i = 1; i < curves[k].size(); ++i) {
      const double x0 = margin + double(i - 1) / double(n - 1) * (W - 1.5 * margin), x1 = margin + double(i) / double(n - 1) * (W - 1.5 * margin);
      const double y0 = H - margin - curves[k][i - 1] / hi * (H - 1.5 * margin), y1 = H - margin - curves[k][i] / hi * (H - 1.5 * margin);
      const int steps = int(std::max(std::abs(x1 - x0), std::abs(y1 - y0))) + 1;
      for (int s = 0; s <= steps; ++s)
        for (int t = 0; t < 2; ++t)
          img.pixel(int(x0 + (x1 - x0) * s / steps), int(y0 + (y1 - y0) * s / steps) + t, colors[k % 6]);
    }
  }
  img.write_png(path);
}

// The training rows: the corpus's kept tokens, their segments (each read from its own start), the
// model's final hidden states of every token and, with --labels model, its own prediction after each.
struct Rows {
  std::vector<int32_t> tokens, segments, predicted;
  std::vector<int32_t> trained;  // 1 where a row may carry a label (--response-template), else 0
  std::vector<float> hidden;
  int64_t n = 0;  // rows: the segments' total
};

constexpr int kMinSegment = 16;  // a document's last run shorter than this is left out
constexpr char kStatesMagic[] = "serval-heads-states 1\n";

template <class T>
void write_vector(std::ofstream& f, const std::vector<T>& v) {
  const uint64_t n = v.size();
  f.write(reinterpret_cast<const char*>(&n), sizeof n);
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(n * sizeof(T)));
}

// Reads an array written by write_vector, of at most `at_most` entries.
template <class T>
std::vector<T> read_vector(std::ifstream& f, uint64_t at_most) {
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), sizeof n);
  check(f.good() && n <= at_most, "a states file's array of {} entries is longer than the file or cut short", n);
  std::vector<T> v(static_cast<size_t>(n));
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(T)));
  check(f.good(), "a states file is cut short");
  return v;
}

// --states FILE: the forward pass's results, so that training again on the same corpus, model and
// labels skips it. The file also holds what it was made from (model file, tokens, segments), and is
// refused if any of them differs.
void save_states(const std::string& path, const std::string& model, const Rows& r) {
  std::ofstream f(path, std::ios::binary);
  f.write(kStatesMagic, sizeof kStatesMagic - 1);
  write_vector(f, std::vector<char>(model.begin(), model.end()));
  write_vector(f, r.tokens), write_vector(f, r.segments), write_vector(f, r.hidden), write_vector(f, r.predicted);
  check(f.good(), "could not write {}", path);
  fmt::print(stderr, "wrote {} (the forward pass's results: --states reads them next time)\n", path);
}

bool load_states(const std::string& path, const std::string& model, bool want_predicted, int64_t d, Rows& r) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return false;
  const uint64_t size = uint64_t(f.tellg());  // no array can hold more entries than the file has bytes
  f.seekg(0);
  std::string magic(sizeof kStatesMagic - 1, '\0');
  f.read(magic.data(), std::streamsize(magic.size()));
  check(f.good() && magic == kStatesMagic, "{} is not a states file of serval train-heads", path);
  const auto name = read_vector<char>(f, 4096);
  const auto tokens = read_vector<int32_t>(f, size), segments = read_vector<int32_t>(f, size);
  check(std::string(name.begin(), name.end()) == model && tokens == r.tokens && segments == r.segments,
        "{} was made from another model or corpus: delete it or name another file with --states", path);
  r.hidden = read_vector<float>(f, uint64_t(r.n * d));
  r.predicted = read_vector<int32_t>(f, uint64_t(r.n));
  check(int64_t(r.hidden.size()) == r.n * d && (r.predicted.size() == size_t(r.n)) == want_predicted,
        "{} was made with other --labels: delete it or name another file with --states", path);
  fmt::print(stderr, "read the forward pass's results from {}\n", path);
  return true;
}

// How often the model's own prediction after a token is the corpus's next token (within segments).
void print_agreement(const Rows& r) {
  int64_t same = 0, n = 0, start = 0;
  for (int32_t len : r.segments) {
    for (int64_t i = start; i + 1 < start + len; ++i, ++n) same += r.predicted[size_t(i)] == r.tokens[size_t(i + 1)];
    start += len;
  }
  fmt::print(stderr, "the model's own prediction is the corpus's next token at {:.1f} % of {} tokens\n",
             n > 0 ? 100.0 * double(same) / double(n) : 0.0, n);
}

Rows corpus_rows(const TrainOptions& o, const Model& m) {
  auto docs = corpus_documents(o, m.tokenizer());
  Rows r;
  if (o.self_distill) {
    std::vector<int32_t> all;
    for (const auto& doc : docs.tokens) all.insert(all.end(), doc.begin(), doc.end());
    r.tokens = self_distilled(m, all, o.ctx, o.prompt_len, o.max_tokens);
    r.segments.assign(r.tokens.size() / size_t(o.ctx), o.ctx);
    r.tokens.resize(r.segments.size() * size_t(o.ctx));  // whole windows only
  } else {
    r.tokens = corpus_segments(docs.tokens, o.ctx, kMinSegment, r.segments);
    std::vector<int32_t> same;  // the masks' segments are the tokens'
    r.trained = corpus_segments(docs.masks, o.ctx, kMinSegment, same);
  }
  if (r.trained.empty()) r.trained.assign(r.tokens.size(), 1);
  r.n = int64_t(r.tokens.size());
  check(r.segments.size() >= 2, "the corpus makes {} segments of {} to {} tokens; at least two are needed (one is held out)",
        r.segments.size(), kMinSegment, o.ctx);
  const std::string model = std::filesystem::path(m.path()).filename().string();
  const bool want_predicted = o.labels == "model";
  if (!o.states.empty() && load_states(o.states, model, want_predicted, m.config().n_embd, r)) return r;
  const auto t0 = Clock::now();
  r.hidden = corpus_states(m, r.tokens, r.segments, o.ctx, want_predicted ? &r.predicted : nullptr,
                           [&](int64_t done, int64_t total) {
                             const double s = std::chrono::duration<double>(Clock::now() - t0).count();
                             progress("forward", done, total, fmt::format("{:.0f} tokens/s", double(done) / s));
                           });
  if (!o.states.empty()) save_states(o.states, model, r);
  return r;
}

// Rows from the last segments on (at least 1/20 of them, at least one segment) are held out.
int64_t training_rows(const Rows& r) {
  int64_t n_train = r.n;
  for (size_t s = r.segments.size(); s-- > 1 && r.n - n_train < std::max<int64_t>(1, r.n / 20);) n_train -= r.segments[s];
  return n_train;
}

// For recurrent heads: every row's output of head k, its input built on `features` (the previous
// head's outputs, or the hidden states for head 0), which head k + 1 reads in place of h.
std::vector<float> next_features(const DecodingHeads& heads, const Rows& r, const float* features, int k) {
  const int64_t d = heads.n_embd, in = heads.n_in(), chunk = 4096;
  std::vector<float> out(static_cast<size_t>(r.n * d)), x;
  for (int64_t r0 = 0; r0 < r.n; r0 += chunk) {
    const int64_t n = std::min(chunk, r.n - r0);
    x.resize(size_t(n * in));
    for (int64_t i = 0; i < n; ++i) heads.training_input(features + (r0 + i) * d, r.tokens, r0 + i, k, x.data() + i * in);
    heads.block_rows(k, x.data(), n, out.data() + r0 * d);
    for (int64_t i = 0; i < n; ++i) heads.chain_features(x.data() + i * in, out.data() + (r0 + i) * d);
  }
  return out;
}

// Trains head k over the first n_train rows, its inputs built on `features` (n_embd values a row: the
// hidden states, or a recurrent head's predecessor's outputs); returns its smoothed training-loss curve.
std::vector<double> train_head(const TrainOptions& o, const Rows& r, const float* features, DecodingHeads& heads,
                               HeadTrainer& trainer, int k, std::span<const int32_t> labels, int64_t n_train,
                               std::mt19937_64& rng) {
  const int64_t d = heads.n_embd, in = heads.n_in();
  std::vector<int64_t> order;  // the rows with a label
  for (int64_t row = 0; row < n_train; ++row)
    if (labels[size_t(row)] >= 0 && r.trained[size_t(row)]) order.push_back(row);
  n_train = int64_t(order.size());
  const int64_t steps_per_epoch = (n_train + o.batch - 1) / o.batch;
  std::vector<float> x_batch(size_t(o.batch * in));
  std::vector<int32_t> l_batch;
  std::vector<double> curve;
  double smooth = 0;
  for (int e = 0; e < o.epochs; ++e) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t s = 0; s < steps_per_epoch; ++s) {
      const int64_t first = s * o.batch, n = std::min<int64_t>(o.batch, n_train - first);
      l_batch.resize(size_t(n));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = order[size_t(first + i)];
        heads.training_input(features + row * d, r.tokens, row, k, x_batch.data() + i * in);
        l_batch[size_t(i)] = labels[size_t(row)];
      }
      const double l = trainer.step(k, std::span(x_batch).first(size_t(n * in)), l_batch);
      smooth = (e == 0 && s == 0) ? l : 0.98 * smooth + 0.02 * l;
      curve.push_back(smooth);
      if (s % 10 == 0 || s + 1 == steps_per_epoch)
        progress(fmt::format("head {}", k).c_str(), e * steps_per_epoch + s + 1, o.epochs * steps_per_epoch,
                 fmt::format("epoch {} loss {:.3f}", e + 1, smooth));
    }
  }
  return curve;
}

// Head k's loss and top-1 on the held-out rows (for token-input heads, on the true previous token).
void validate_head(const TrainOptions& o, const Rows& r, const float* features, const DecodingHeads& heads,
                   const HeadTrainer& trainer, int k, std::span<const int32_t> labels, int64_t n_train) {
  const int64_t d = heads.n_embd, in = heads.n_in(), n_val = r.n - n_train;
  std::vector<float> xv(size_t(n_val * in));
  for (int64_t i = 0; i < n_val; ++i) heads.training_input(features + (n_train + i) * d, r.tokens, n_train + i, k, xv.data() + i * in);
  std::vector<int32_t> lv(labels.begin() + n_train, labels.end());
  for (int64_t i = 0; i < n_val; ++i)
    if (!r.trained[size_t(n_train + i)]) lv[size_t(i)] = -1;
  int64_t right = 0, n_lab = 0;
  for (int64_t i = 0; i < n_val; ++i) {
    if (lv[size_t(i)] < 0) continue;
    right += heads.guess(k, xv.data() + i * in) == heads.vocab[size_t(lv[size_t(i)])];
    ++n_lab;
  }
  fmt::print(stderr, "head {}: validation loss {:.3f}, top-1 accuracy {:.1f} % ({} of {} held-out {} tokens)\n", k,
             trainer.loss(k, xv, lv), n_lab ? 100.0 * double(right) / double(n_lab) : 0.0, right, n_lab, o.labels);
}

void run_train_heads(TrainOptions& o) {
  set_threads(o.threads);
  check(o.heads >= 1 && o.heads <= 16 && o.vocab >= 2 && o.ctx >= 8 && o.epochs >= 1 && o.batch >= 1 && o.lr > 0,
        "bad training settings (heads 1..16, vocab >= 2, ctx >= 8, epochs >= 1, batch >= 1, lr > 0)");
  auto m = Model::load(resolve_model_path(o.model));
  const Rows r = corpus_rows(o, *m);
  const std::vector<int32_t>* model_labels = o.labels == "model" ? &r.predicted : nullptr;
  if (model_labels) print_agreement(r);
  // The subset: the most frequent of the tokens the heads learn to guess.
  std::vector<int32_t> guessed;  // what the trained rows' heads learn to guess
  for (int64_t i = 0; i < r.n; ++i)
    if (r.trained[size_t(i)]) guessed.push_back(model_labels ? r.predicted[size_t(i)] : r.tokens[size_t(i)]);
  DecodingHeads heads =
      DecodingHeads::create(*m, o.heads, frequent_tokens(guessed, o.vocab, m->tokenizer().n_vocab()),
                            o.token_input || o.recurrent, o.recurrent);
  std::vector<int32_t> index(static_cast<size_t>(m->tokenizer().n_vocab()), -1);
  for (size_t v = 0; v < heads.vocab.size(); ++v) index[size_t(heads.vocab[v])] = int32_t(v);
  const int64_t n_train = training_rows(r);
  HeadTrainer trainer(heads, o.lr);
  std::vector<std::vector<double>> curves;
  std::mt19937_64 rng(o.seed);
  std::vector<float> chained;  // recurrent heads: the previous head's outputs, which head k reads
  for (int k = 0; k < o.heads; ++k) {
    const float* features = k > 0 && o.recurrent ? chained.data() : r.hidden.data();
    const auto labels = head_labels(r.tokens, model_labels, index, k, r.segments, r.n);
    curves.push_back(train_head(o, r, features, heads, trainer, k, labels, n_train, rng));
    validate_head(o, r, features, heads, trainer, k, labels, n_train);
    if (o.recurrent && k + 1 < o.heads) chained = next_features(heads, r, features, k);
  }
  heads.save(o.output, std::filesystem::path(m->path()).filename().string());
  fmt::print(stderr, "wrote {} ({} heads, {} vocabulary entries, {} training tokens in {} segments)\n", o.output, o.heads,
             heads.vocab.size(), n_train, r.segments.size());
  if (!o.loss_png.empty()) write_loss_png(o.loss_png, curves), fmt::print(stderr, "wrote {}\n", o.loss_png);
}

}  // namespace

void add_train_heads(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train-heads", "Train decoding heads for --spec heads (Medusa-style, or Hydra-style with --token-input)");
  auto o = std::make_shared<TrainOptions>();
  cmd->add_option("-m,--model,model", o->model, "the (frozen) target model")->required();
  cmd->add_option("-f,--file", o->corpus, "training text: files or directories (repeatable)")->required();
  cmd->add_option("-o,--output", o->output, "heads file to write (GGUF)")->required();
  cmd->add_option("--heads", o->heads, "number of heads (default 4)");
  cmd->add_option("--vocab", o->vocab, "most frequent corpus tokens the heads can propose (default 4096)");
  cmd->add_option("--tokens", o->max_tokens, "corpus tokens used at most (default 32768)");
  cmd->add_option("-c,--ctx-size", o->ctx, "window the model reads at once (default 512)");
  cmd->add_option("--epochs", o->epochs, "passes over the corpus (default 2)");
  cmd->add_option("--batch", o->batch, "rows per Adam step (default 64)");
  cmd->add_option("--lr", o->lr, "Adam learning rate (default 1e-3)");
  cmd->add_option("--seed", o->seed, "shuffling seed (default 1)");
  cmd->add_flag("--self-distill", o->self_distill,
                "train on the model's own greedy continuations of each window's first tokens");
  cmd->add_flag("--parse-special", o->parse_special,
                "the corpus's special-token texts (chat markup such as <|im_start|>) are those tokens");
  cmd->add_flag("--token-input", o->token_input,
                "Hydra-style heads: each also reads the embedding of the token before the one it guesses");
  cmd->add_flag("--recurrent", o->recurrent,
                "token-input heads chained on features (EAGLE-style): each head past the first reads the previous "
                "head's output instead of the model's hidden state (implies --token-input)");
  cmd->add_option("--labels", o->labels,
                  "what each head learns to guess: 'model' (default), the model's own greedy prediction of that "
                  "token after the corpus text before it; 'corpus', the corpus token itself")
      ->check(CLI::IsMember({"model", "corpus"}));
  cmd->add_option("--prompt-len", o->prompt_len, "with --self-distill: corpus tokens kept per window (default 32)");
  cmd->add_option("--response-template", o->response_template,
                  "train only on what follows this text's last occurrence in each document (a chat transcript's "
                  "answer: $'<|im_start|>assistant\\n' in bash, with --parse-special); documents without it are "
                  "trained whole");
  cmd->add_option("--states", o->states,
                  "keep the forward pass's results in this file (made if absent, read if present and made from "
                  "the same model, corpus and labels): training again skips the pass");
  cmd->add_option("--loss-png", o->loss_png, "write the training loss curves to this PNG");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->callback([o] { run_train_heads(*o); });
}

}  // namespace serval::cli
