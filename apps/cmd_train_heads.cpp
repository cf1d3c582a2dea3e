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
  std::string model, output, loss_png;
  std::vector<std::string> corpus;
  int heads = 4, vocab = 4096, ctx = 512, epochs = 2, batch = 64, threads = 0;
  int64_t max_tokens = 32768;
  bool self_distill = false;
  bool parse_special = false;  // chat transcripts: <|im_start|> and the like are their special tokens
  bool token_input = false;    // Hydra-style heads: each also reads the token before the one it guesses
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

// The corpus files (or every file under a directory), tokenized and cut at max_tokens.
std::vector<int32_t> corpus_tokens(const TrainOptions& o, const Tokenizer& tok) {
  std::vector<int32_t> tokens;
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
      const auto t = tok.encode(read_text_file(f), false, o.parse_special);
      tokens.insert(tokens.end(), t.begin(), t.end());
      if (!o.self_distill && int64_t(tokens.size()) >= o.max_tokens) break;  // self-distillation: prompts from all
    }
  }
  if (!o.self_distill && int64_t(tokens.size()) > o.max_tokens) tokens.resize(size_t(o.max_tokens));
  check(o.self_distill || int64_t(tokens.size()) >= 2 * o.ctx, "the corpus has {} tokens; at least two windows of {} are needed",
        tokens.size(), o.ctx);
  return tokens;
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

// How often the model's own prediction after a token is the corpus's next token.
void print_agreement(std::span<const int32_t> tokens, std::span<const int32_t> predicted) {
  int64_t same = 0, n = std::min<int64_t>(int64_t(predicted.size()), int64_t(tokens.size()) - 1);
  for (int64_t i = 0; i < n; ++i) same += predicted[size_t(i)] == tokens[size_t(i + 1)];
  fmt::print(stderr, "the model's own prediction is the corpus's next token at {:.1f} % of {} tokens\n",
             n > 0 ? 100.0 * double(same) / double(n) : 0.0, n);
}

void run_train_heads(TrainOptions& o) {
  set_threads(o.threads);
  check(o.heads >= 1 && o.heads <= 16 && o.vocab >= 2 && o.ctx >= 8 && o.epochs >= 1 && o.batch >= 1 && o.lr > 0,
        "bad training settings (heads 1..16, vocab >= 2, ctx >= 8, epochs >= 1, batch >= 1, lr > 0)");
  auto m = Model::load(resolve_model_path(o.model));
  const int64_t d = m->config().n_embd;
  auto tokens = corpus_tokens(o, m->tokenizer());
  if (o.self_distill) tokens = self_distilled(*m, tokens, o.ctx, o.prompt_len, o.max_tokens);
  std::vector<int32_t> predicted;
  std::vector<int32_t>* model_labels = o.labels == "model" ? &predicted : nullptr;
  const auto t0 = Clock::now();
  const std::vector<float> hidden = corpus_states(*m, tokens, o.ctx, model_labels, [&](int64_t done, int64_t total) {
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    progress("forward", done, total, fmt::format("{:.0f} tokens/s", double(done * o.ctx) / s));
  });
  const int64_t n_rows = int64_t(hidden.size()) / d;
  if (model_labels) print_agreement(tokens, predicted);
  // The subset: the most frequent of the tokens the heads learn to guess.
  const std::span<const int32_t> guessed = model_labels ? std::span<const int32_t>(predicted) : std::span(tokens).first(size_t(n_rows));
  DecodingHeads heads =
      DecodingHeads::create(*m, o.heads, frequent_tokens(guessed, o.vocab, m->tokenizer().n_vocab()), o.token_input);
  std::vector<int32_t> index(static_cast<size_t>(m->tokenizer().n_vocab()), -1);
  for (size_t v = 0; v < heads.vocab.size(); ++v) index[size_t(heads.vocab[v])] = int32_t(v);
  // The last window (at least 1/20 of the rows) is held out for validation.
  const int64_t n_val = std::max<int64_t>(o.ctx, (n_rows / 20) / o.ctx * o.ctx), n_train = n_rows - n_val;
  HeadTrainer trainer(heads, o.lr);
  std::vector<std::vector<double>> curves(size_t(o.heads));
  std::mt19937_64 rng(o.seed);
  std::vector<int64_t> order(static_cast<size_t>(n_train));
  std::iota(order.begin(), order.end(), 0);
  const int64_t steps_per_epoch = (n_train + o.batch - 1) / o.batch;
  const int64_t in = heads.n_in();
  auto add_input = [&](std::vector<float>& x, int64_t r, int k) {
    x.resize(x.size() + size_t(in));
    heads.training_input(hidden.data() + r * d, std::span(tokens).first(size_t(n_rows)), r, k,
                         x.data() + x.size() - size_t(in));
  };
  std::vector<float> h_batch;
  std::vector<int32_t> l_batch;
  for (int k = 0; k < o.heads; ++k) {
    const auto labels = head_labels(tokens, model_labels, index, k, o.ctx, n_rows);
    double smooth = 0;
    for (int e = 0; e < o.epochs; ++e) {
      std::shuffle(order.begin(), order.end(), rng);
      for (int64_t s = 0; s < steps_per_epoch; ++s) {
        h_batch.clear(), l_batch.clear();
        for (int64_t i = s * o.batch; i < std::min(n_train, (s + 1) * o.batch); ++i) {
          const int64_t r = order[size_t(i)];
          add_input(h_batch, r, k);
          l_batch.push_back(labels[size_t(r)]);
        }
        const double l = trainer.step(k, h_batch, l_batch);
        smooth = (e == 0 && s == 0) ? l : 0.98 * smooth + 0.02 * l;
        curves[size_t(k)].push_back(smooth);
        if (s % 10 == 0 || s + 1 == steps_per_epoch)
          progress(fmt::format("head {}", k).c_str(), e * steps_per_epoch + s + 1, o.epochs * steps_per_epoch,
                   fmt::format("epoch {} loss {:.3f}", e + 1, smooth));
      }
    }
    // Held-out rows: head k's top-1 on its own input (for token-input heads, the true previous token).
    std::vector<float> xv;
    for (int64_t r = n_train; r < n_rows; ++r) add_input(xv, r, k);
    const std::span<const int32_t> lv(labels.data() + n_train, size_t(n_val));
    int64_t right = 0, n_lab = 0;
    for (int64_t r = 0; r < n_val; ++r) {
      if (lv[size_t(r)] < 0) continue;
      right += heads.guess(k, xv.data() + r * in) == heads.vocab[size_t(lv[size_t(r)])];
      ++n_lab;
    }
    fmt::print(stderr, "head {}: validation loss {:.3f}, top-1 accuracy {:.1f} % ({} of {} held-out {} tokens)\n", k,
               trainer.loss(k, xv, lv), n_lab ? 100.0 * double(right) / double(n_lab) : 0.0, right, n_lab, o.labels);
  }
  heads.save(o.output, std::filesystem::path(m->path()).filename().string());
  fmt::print(stderr, "wrote {} ({} heads, {} vocabulary entries, {} training tokens)\n", o.output, o.heads,
             heads.vocab.size(), n_train);
  if (!o.loss_png.empty()) write_loss_png(o.loss_png, curves), fmt::print(stderr, "wrote {}\n", o.loss_png);
}

}  // namespace

void add_train_heads(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train-heads", "Train decoding heads for --spec heads (Medusa-style, or Hydra-style with --token-input)");
  auto o = std::make_shared<TrainOptions>();
  cmd->add_option("-m,--model", o->model, "the (frozen) target model")->required();
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
  cmd->add_option("--labels", o->labels,
                  "what each head learns to guess: 'model' (default), the model's own greedy prediction of that "
                  "token after the corpus text before it; 'corpus', the corpus token itself")
      ->check(CLI::IsMember({"model", "corpus"}));
  cmd->add_option("--prompt-len", o->prompt_len, "with --self-distill: corpus tokens kept per window (default 32)");
  cmd->add_option("--loss-png", o->loss_png, "write the training loss curves to this PNG");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->callback([o] { run_train_heads(*o); });
}

}  // namespace serval::cli
