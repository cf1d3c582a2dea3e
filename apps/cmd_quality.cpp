// `serval quality -m REF -m CAND... -f TEXT`: how far each candidate model (a quantization of the
// reference, say) is from the reference on a text, the way llama-perplexity's --kl-divergence measures
// it, for many files in one run. Chunks follow `serval perplexity` (CTX tokens starting with BOS, the
// second half scored). The reference runs first; its logits at the scored positions go to a temporary
// file (unlinked at once: positions x n_vocab x 4 bytes on disk under $TMPDIR, never all in memory).
// Then each candidate runs, one model loaded at a time, and at every scored position
// KL(ref || cand) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v)) is summed in double from both float
// logits, with the same log-softmax for both (a model against itself gives exactly 0).
#include <fcntl.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/png_plot.h"
#include "base/error.h"
#include "base/file_util.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/session.h"

namespace serval::cli {
namespace {

namespace fs = std::filesystem;

struct QualityOptions {
  std::vector<std::string> models;
  std::string file, cache_type = "f16", json, png;
  int ctx = 512, threads = 0, max_chunks = -1, batch = 512;
};

// What one model scored. The KL fields stay empty for the reference.
struct ModelResult {
  std::string path;
  uint64_t file_bytes = 0;
  double bpw = 0, ppl = 0, ppl_err = 0, dppl_pct = 0;
  bool reference = false;
  double kl_mean = 0, kl_median = 0, kl_p99 = 0, kl_max = 0, top1_pct = 0;
};

// The chunks of the text: chunk c is tokens [c * ctx, (c + 1) * ctx); rows [first, ctx - 1) are scored.
struct Chunking {
  std::vector<int32_t> tokens;
  int64_t ctx = 0, n_chunks = 0, first = 0;
  int64_t rows() const { return ctx - 1 - first; }  // scored rows per chunk
};

// A row's log-softmax, kept as perplexity computes it: log p(v) = x_v - max - log_sum.
struct RowStats {
  float max = 0;
  double log_sum = 0;
  int64_t argmax = 0;
  double logp(float x) const { return double(x) - max - log_sum; }
};

RowStats row_stats(const float* row, int64_t n) {
  RowStats s;
  s.max = row[0];
  for (int64_t v = 1; v < n; ++v)
    if (row[v] > s.max) s.max = row[v], s.argmax = v;
  double sum = 0;
  for (int64_t v = 0; v < n; ++v) sum += std::exp(double(row[v]) - s.max);
  s.log_sum = std::log(sum);
  return s;
}

double kl_row(const float* ref, const RowStats& rs, const float* cand, const RowStats& cs, int64_t n) {
  double kl = 0;
  for (int64_t v = 0; v < n; ++v) {
    const double lr = rs.logp(ref[v]), lc = cs.logp(cand[v]);
    kl += std::exp(lr) * (lr - lc);
  }
  return kl;
}

// The reference's scored logit rows in an unlinked temporary file, written once and read per chunk.
class ReferenceRows {
 public:
  explicit ReferenceRows(int64_t n_vocab) : n_vocab_(n_vocab) {
    const char* dir = std::getenv("TMPDIR");
    std::string name = std::string(dir && *dir ? dir : "/tmp") + "/serval-quality-XXXXXX";
    fd_ = mkstemp(name.data());
    check(fd_ >= 0, "cannot create a temporary file in {} (set TMPDIR)", fs::path(name).parent_path().string());
    unlink(name.c_str());
  }
  ~ReferenceRows() { close(fd_); }
  ReferenceRows(const ReferenceRows&) = delete;
  ReferenceRows& operator=(const ReferenceRows&) = delete;

  void append(const float* rows, int64_t n) {
    const size_t bytes = size_t(n * n_vocab_) * sizeof(float);
    check(pwrite(fd_, rows, bytes, off_t(size_) * off_t(sizeof(float))) == ssize_t(bytes),
          "writing the reference's logits to a temporary file failed (disk full? set TMPDIR)");
    size_ += n * n_vocab_;
  }
  void read(int64_t first_row, int64_t n, std::vector<float>& out) const {
    out.resize(size_t(n * n_vocab_));
    const size_t bytes = out.size() * sizeof(float);
    check(pread(fd_, out.data(), bytes, off_t(first_row * n_vocab_) * off_t(sizeof(float))) == ssize_t(bytes),
          "reading the reference's logits back failed");
  }

 private:
  int64_t n_vocab_, size_ = 0;
  int fd_ = -1;
};

// Sums over the scored positions of one model.
struct Tally {
  double nll = 0, nll2 = 0;
  int64_t count = 0, same_top = 0;
  std::vector<double> kl;

  void finish(ModelResult& r) {
    const double mean = nll / double(count), var = nll2 / double(count) - mean * mean;
    r.ppl = std::exp(mean);
    r.ppl_err = var > 0 && count > 1 ? std::sqrt(var / double(count - 1)) * r.ppl : 0;
    if (kl.empty()) return;
    double sum = 0;
    for (double k : kl) sum += k;
    r.kl_mean = sum / double(kl.size());
    std::sort(kl.begin(), kl.end());
    r.kl_median = quantile(0.5), r.kl_p99 = quantile(0.99), r.kl_max = kl.back();
    r.top1_pct = 100.0 * double(same_top) / double(count);
  }
  // Linear interpolation between the order statistics (numpy's default).
  double quantile(double q) const {
    const double pos = q * double(kl.size() - 1);
    const size_t lo = size_t(pos), hi = std::min(lo + 1, kl.size() - 1);
    return kl[lo] + (pos - double(lo)) * (kl[hi] - kl[lo]);
  }
};

// File size and bits per weight: every tensor's bytes x 8 over its element count, summed over the file
// (a GGUF file, a .safetensors file, or the .safetensors files of a model directory).
void file_weights(const std::string& path, ModelResult& r) {
  std::vector<std::string> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  } else {
    files.push_back(path);
  }
  uint64_t bytes = 0, elements = 0;
  auto add = [&](const std::vector<TensorRef>& ts) {
    for (const auto& t : ts) bytes += t.nbytes, elements += t.n_elements();
  };
  for (const auto& f : files) {
    r.file_bytes += fs::file_size(f);
    if (fs::path(f).extension() == ".safetensors") {
      add(SafetensorsFile(f).tensors());
    } else {
      add(GgufFile(f).tensors());
    }
  }
  r.bpw = elements ? 8.0 * double(bytes) / double(elements) : 0;
}

Chunking make_chunking(const Model& model, const std::string& text, const QualityOptions& o) {
  Chunking c;
  c.tokens = model.tokenizer().encode(text, /*add_special=*/true);
  c.ctx = o.ctx;
  c.n_chunks = int64_t(c.tokens.size()) / c.ctx;
  if (o.max_chunks >= 0) c.n_chunks = std::min<int64_t>(c.n_chunks, o.max_chunks);
  check(c.n_chunks > 0, "{}: {} tokens is fewer than one chunk of {} (need at least 2 x ctx for a meaningful score)", o.file,
        c.tokens.size(), c.ctx);
  c.first = c.ctx / 2;
  fmt::print(stderr, "quality: {} tokens, {} chunks of {}, {} scored positions\n", c.tokens.size(), c.n_chunks, c.ctx,
             c.n_chunks * c.rows());
  return c;
}

// Runs the model over every chunk; fn(chunk, rows) gets the logits of the chunk's scored rows.
template <class Fn>
void for_each_chunk(const Model& model, const Chunking& c, const QualityOptions& o, Fn&& fn) {
  SingleSequence seq(model, c.ctx, parse_cache_type(o.cache_type));
  const auto& vocab = model.tokenizer().vocab();
  const bool add_bos = vocab.add_bos && vocab.bos >= 0;
  const std::string name = fs::path(model.path()).filename().string();
  const bool tty = isatty(fileno(stderr));
  for (int64_t chunk = 0; chunk < c.n_chunks; ++chunk) {
    std::vector<int32_t> input(c.tokens.begin() + chunk * c.ctx, c.tokens.begin() + (chunk + 1) * c.ctx);
    if (add_bos) input[0] = vocab.bos;
    seq.reset();
    const std::vector<float> logits = seq.eval(input, /*all_logits=*/true, o.batch);
    fn(chunk, logits.data() + c.first * model.config().n_vocab);
    if (tty) fmt::print(stderr, "\r{}: chunk {}/{}", name, chunk + 1, c.n_chunks);
  }
  fmt::print(stderr, "{}{}: {} chunks\n", tty ? "\r" : "", name, c.n_chunks);
}

// The next token's negative log-likelihood at scored row j of `chunk`.
double row_nll(const Chunking& c, int64_t chunk, int64_t j, const float* row, const RowStats& s) {
  const int32_t target = c.tokens[size_t(chunk * c.ctx + c.first + j + 1)];
  return -s.logp(row[target]);
}

// The reference: its perplexity; its scored rows go to `store`, their log-softmax to `stats`.
ModelResult run_reference(const Model& m, const Chunking& c, const QualityOptions& o, ReferenceRows& store,
                          std::vector<RowStats>& stats) {
  const int64_t nv = m.config().n_vocab, n = c.rows();
  Tally t;
  for_each_chunk(m, c, o, [&](int64_t chunk, const float* rows) {
    store.append(rows, n);
    stats.resize(size_t((chunk + 1) * n));
    RowStats* s = stats.data() + chunk * n;
    parallel_for(n, [&](int64_t j) { s[j] = row_stats(rows + j * nv, nv); });
    for (int64_t j = 0; j < n; ++j) {
      const double nll = row_nll(c, chunk, j, rows + j * nv, s[j]);
      t.nll += nll, t.nll2 += nll * nll, ++t.count;
    }
  });
  ModelResult r;
  r.reference = true;
  t.finish(r);
  return r;
}

// A candidate: its perplexity, and its KL divergence from the reference and top-1 agreement with it.
ModelResult run_candidate(const Model& m, const Chunking& c, const QualityOptions& o, const ReferenceRows& store,
                          const std::vector<RowStats>& ref_stats) {
  const int64_t nv = m.config().n_vocab, n = c.rows();
  Tally t;
  std::vector<float> ref;
  std::vector<RowStats> cs(static_cast<size_t>(n));
  std::vector<double> kl(static_cast<size_t>(n));
  for_each_chunk(m, c, o, [&](int64_t chunk, const float* rows) {
    store.read(chunk * n, n, ref);
    const RowStats* rs = ref_stats.data() + chunk * n;
    parallel_for(n, [&](int64_t j) {
      cs[size_t(j)] = row_stats(rows + j * nv, nv);
      kl[size_t(j)] = kl_row(ref.data() + j * nv, rs[j], rows + j * nv, cs[size_t(j)], nv);
    });
    for (int64_t j = 0; j < n; ++j) {
      const double nll = row_nll(c, chunk, j, rows + j * nv, cs[size_t(j)]);
      t.nll += nll, t.nll2 += nll * nll, ++t.count;
      t.same_top += cs[size_t(j)].argmax == rs[j].argmax;
      t.kl.push_back(kl[size_t(j)]);
    }
  });
  ModelResult r;
  t.finish(r);
  return r;
}

// A candidate must see the same tokens over the same vocabulary, or the comparison means nothing.
void check_compatible(const Model& m, int64_t ref_vocab, const Chunking& c, const std::string& text) {
  check(m.config().n_vocab == ref_vocab,
        "{}: a vocabulary of {} tokens, the reference has {}: KL divergence needs the same vocabulary", m.path(),
        m.config().n_vocab, ref_vocab);
  check(m.tokenizer().encode(text, /*add_special=*/true) == c.tokens,
        "{}: tokenizes the text differently from the reference (another tokenizer?)", m.path());
}

std::string kl_cell(const ModelResult& r, double v) { return r.reference ? "-" : fmt::format("{:.6f}", v); }

void print_table(const std::vector<ModelResult>& results) {
  size_t w = 5;
  for (const auto& r : results) w = std::max(w, fs::path(r.path).filename().string().size());
  fmt::print("{:<{}} {:>12} {:>7} {:>6} {:>10} {:>9} {:>8} {:>10} {:>10} {:>10} {:>8}\n", "model", w, "bytes", "GiB",
             "bpw", "PPL", "+/-", "dPPL %", "KL mean", "KL median", "KL p99", "top-1 %");
  for (const auto& r : results) {
    fmt::print("{:<{}} {:>12} {:>7.3f} {:>6.2f} {:>10.4f} {:>9.5f} {:>8.3f} {:>10} {:>10} {:>10} {:>8}\n",
               fs::path(r.path).filename().string(), w, r.file_bytes, double(r.file_bytes) / (1 << 30), r.bpw, r.ppl,
               r.ppl_err, r.dppl_pct, kl_cell(r, r.kl_mean), kl_cell(r, r.kl_median), kl_cell(r, r.kl_p99),
               r.reference ? "-" : fmt::format("{:.2f}", r.top1_pct));
  }
}

void write_json(const std::string& path, const QualityOptions& o, const Chunking& c,
                const std::vector<ModelResult>& results) {
  nlohmann::json models = nlohmann::json::array();
  for (const auto& r : results) {
    nlohmann::json m = {{"path", r.path},       {"file_bytes", r.file_bytes}, {"gib", double(r.file_bytes) / (1 << 30)},
                        {"bpw", r.bpw},         {"ppl", r.ppl},               {"ppl_err", r.ppl_err},
                        {"dppl_pct", r.dppl_pct}, {"reference", r.reference}};
    for (auto [key, v] : {std::pair{"kl_mean", r.kl_mean}, {"kl_median", r.kl_median}, {"kl_p99", r.kl_p99},
                          {"kl_max", r.kl_max}, {"top1_pct", r.top1_pct}})
      m[key] = r.reference ? nlohmann::json(nullptr) : nlohmann::json(v);
    models.push_back(std::move(m));
  }
  const nlohmann::json doc = {{"text", o.file},         {"ctx", c.ctx},       {"chunks", c.n_chunks},
                              {"positions", c.n_chunks * c.rows()}, {"models", models}};
  std::ofstream f(path);
  f << doc.dump(2) << "\n";
  check(f.good(), "cannot write '{}'", path);
}

void write_png(const std::string& path, const std::vector<ModelResult>& results) {
  ScatterPanel kl{"mean KL divergence from the reference (log)", "bits per weight", true, {}};
  ScatterPanel ppl{"PPL change from the reference (%)", "bits per weight", false, {}};
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const std::string label = fs::path(r.path).stem().string().substr(0, 24);
    if (!r.reference) kl.points.push_back({r.bpw, r.kl_mean, label, int(i)});
    ppl.points.push_back({r.bpw, r.dppl_pct, label, int(i)});
  }
  write_scatter_png(path, {kl, ppl});
}

void run_quality(const QualityOptions& o) {
  set_threads(o.threads);
  check(o.ctx >= 4, "-c must be at least 4");
  std::vector<std::string> paths;
  for (const auto& m : o.models) paths.push_back(resolve_model_path(m));  // every file exists before any runs
  const std::string text = read_text_file(o.file);
  std::vector<ModelResult> results;
  std::unique_ptr<ReferenceRows> store;
  std::vector<RowStats> ref_stats;
  Chunking c;
  int64_t n_vocab = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    auto model = Model::load(paths[i]);  // one model in memory at a time
    if (i == 0) {
      c = make_chunking(*model, text, o);
      n_vocab = model->config().n_vocab;
      store = std::make_unique<ReferenceRows>(n_vocab);
      results.push_back(run_reference(*model, c, o, *store, ref_stats));
    } else {
      check_compatible(*model, n_vocab, c, text);
      results.push_back(run_candidate(*model, c, o, *store, ref_stats));
      results.back().dppl_pct = 100.0 * (results.back().ppl / results[0].ppl - 1);
    }
    results.back().path = paths[i];
    file_weights(paths[i], results.back());
  }
  print_table(results);
  if (!o.json.empty()) write_json(o.json, o, c, results), fmt::print(stderr, "wrote {}\n", o.json);
  if (!o.png.empty()) write_png(o.png, results), fmt::print(stderr, "wrote {}\n", o.png);
}

}  // namespace

void add_quality(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "quality", "Perplexity, KL divergence from a reference and top-1 agreement of many models on one text");
  auto o = std::make_shared<QualityOptions>();
  cmd->add_option("-m,--model,model", o->models,
                  "model: the first is the reference, each later one a candidate compared with it (one alone: its PPL)")
      ->required();
  cmd->add_option("-f,--file", o->file, "text file")->required();
  cmd->add_option("-c,--ctx-size", o->ctx, "chunk (context) size (default 512)");
  cmd->add_option("-b,--batch-size", o->batch, "tokens per forward pass (default 512)");
  cmd->add_option("--chunks", o->max_chunks, "score at most this many chunks");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", o->cache_type, kKvCacheTypeHelp);
  cmd->add_option("--json", o->json, "also write the table to this JSON file");
  cmd->add_option("--png", o->png, "plot mean KL and PPL change against bits per weight to this PNG");
  cmd->footer(
      "The reference's logits at the scored positions are kept in an unlinked temporary file under $TMPDIR\n"
      "(/tmp by default): positions x n_vocab x 4 bytes, e.g. 4 chunks of 512 with Qwen2.5's 151936 tokens:\n"
      "4 x 255 x 151936 x 4 = 620 MB. Memory holds one model and one chunk's logits at a time.");
  cmd->callback([o] { run_quality(*o); });
}

}  // namespace serval::cli
