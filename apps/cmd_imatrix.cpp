// `serval imatrix`: llama-imatrix's importance matrix. The text is split into CTX-token chunks, each
// starting with BOS (as `serval perplexity`); every weight matrix product of at least 16 input rows
// adds the squares of its input activations to the entry of that weight (output.weight only with
// --process-output). The result is written in llama.cpp's GGUF or .dat format (quant/imatrix.h) for
// `serval quantize --imatrix` or llama-quantize.
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>

#include "apps/commands.h"
#include "base/error.h"
#include "base/file_util.h"
#include "model/session.h"
#include "quant/imatrix.h"

namespace serval::cli {
namespace {

struct ImatrixOptions {
  std::string model, file, out = "imatrix.gguf", format, tokenizer;
  std::vector<std::string> in_files;
  int ctx = 512, batch = 512, threads = 0, max_chunks = -1;
  bool process_output = false, no_ppl = false;
};

// llama.cpp ignores products of fewer rows (single-token decoding would dominate otherwise).
constexpr int64_t kMinRows = 16;

bool writes_dat(const ImatrixOptions& o) {
  if (o.format.empty()) return o.out.size() >= 4 && o.out.compare(o.out.size() - 4, 4, ".dat") == 0;
  check(o.format == "gguf" || o.format == "dat", "--output-format must be gguf or dat, not '{}'", o.format);
  return o.format == "dat";
}

// The input width of every matrix the model reports to its observer, by name.
std::map<std::string, int64_t> input_widths(const Model& model) {
  std::map<std::string, int64_t> w;
  const auto& layers = model.weights().layers;
  for (size_t il = 0; il < layers.size(); ++il) {
    const auto& L = layers[il];
    const std::string p = "blk." + std::to_string(il) + ".";
    for (const auto& [kind, m] : {std::pair{"attn_q", &L.wq}, {"attn_k", &L.wk}, {"attn_v", &L.wv},
                                  {"attn_output", &L.wo}, {"ffn_gate", &L.w_gate}, {"ffn_up", &L.w_up},
                                  {"ffn_down", &L.w_down}})
      if (!m->empty()) w[p + kind + ".weight"] = m->cols;
    for (const auto& [kind, m] : {std::pair{"ffn_gate_inp", &L.router}, {"ffn_gate_shexp", &L.sh_gate},
                                  {"ffn_up_shexp", &L.sh_up}, {"ffn_down_shexp", &L.sh_down}})
      if (!m->empty()) w[p + kind + ".weight"] = m->cols;
    for (const auto& [kind, experts] : {std::pair{"ffn_gate_exps", &L.exp_gate}, {"ffn_up_exps", &L.exp_up},
                                        {"ffn_down_exps", &L.exp_down}})
      if (!experts->empty()) w[p + kind + ".weight"] = (*experts)[0].cols;
  }
  w["output.weight"] = model.config().n_embd;
  return w;
}

// Adds `from` (read from `path`) to `into`. A .dat file counts calls of one chunk each (it has no
// chunk size, so its chunk_size is 0): its entries are taken as `ctx` rows per call, as llama.cpp does.
void combine(Imatrix& into, const Imatrix& from, const std::string& path, const std::map<std::string, int64_t>& widths,
             int64_t ctx) {
  const double scale = from.chunk_size > 0 ? 1.0 : double(ctx);
  for (const auto& [name, e] : from.entries) {
    const auto w = widths.find(name);
    check(w != widths.end(), "{}: '{}' is not a weight matrix of this model (an imatrix of another model?)", path, name);
    check(e.n_per_row() == w->second || (e.counts.size() == 1 && e.n_per_row() % w->second == 0),  // .dat: experts' rows
          "{}: '{}' has {} x {} values, this model's matrix takes {} inputs (an imatrix of another model?)", path, name,
          e.counts.size(), e.n_per_row(), w->second);
    ImatrixEntry& d = into.entries[name];
    if (d.counts.empty()) d.sum2.assign(e.sum2.size(), 0.0), d.counts.assign(e.counts.size(), 0.0);
    check(d.counts.size() == e.counts.size(), "{}: '{}' has {} matrices, another file {}", path, name, e.counts.size(),
          d.counts.size());
    for (size_t i = 0; i < e.sum2.size(); ++i) d.sum2[i] += e.sum2[i] * scale;
    for (size_t i = 0; i < e.counts.size(); ++i) d.counts[i] += e.counts[i] * scale;
  }
  into.chunk_count += from.chunk_count;
  if (into.chunk_size == 0) into.chunk_size = from.chunk_size;
  into.datasets.insert(into.datasets.end(), from.datasets.begin(), from.datasets.end());
}

// Running perplexity over the second half of each chunk (llama.cpp's convention).
struct Perplexity {
  double nll = 0;
  int64_t count = 0;

  // logits[n_ctx][n_vocab] of a chunk; next_tokens[j]: the token after position j.
  void add_chunk(const std::vector<float>& logits, const int32_t* next_tokens, int64_t n_ctx, int64_t n_vocab) {
    for (int64_t j = n_ctx / 2; j < n_ctx - 1; ++j) {
      const float* row = logits.data() + j * n_vocab;
      float mx = row[0];
      for (int64_t v = 1; v < n_vocab; ++v) mx = std::max(mx, row[v]);
      double sum = 0;
      for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(double(row[v]) - mx);
      nll += -(double(row[next_tokens[j]]) - mx - std::log(sum));
      ++count;
    }
  }
  double value() const { return std::exp(nll / double(count)); }
};

// The chunks of the text's tokens, each starting with BOS when the model adds one.
std::vector<std::vector<int32_t>> chunks_of(const ImatrixOptions& o, const Tokenizer& tok) {
  auto r = text_chunks(tok, o.file, o.ctx, o.max_chunks, "-c");
  fmt::print(stderr, "imatrix: {} chunks of {}, batch {}\n", r.size(), o.ctx, o.batch);
  return r;
}

// Runs the chunks with the observer adding to `m`.
void collect(const ImatrixOptions& o, Model& model, Imatrix& m) {
  const auto chunks = chunks_of(o, model.tokenizer());
  model.set_matmul_observer([&](const std::string& name, const float* x, int64_t n_tok, int64_t cols) {
    if (n_tok < kMinRows || (name == "output.weight" && !o.process_output)) return;
    m.add(name, x, n_tok, cols);
  });
  // Every expert's rows, however few (llama.cpp collects all of its indirect products).
  model.set_expert_observer([&](const std::string& name, int64_t e, int64_t n_e, const float* x, int64_t rows, int64_t cols) {
    m.add(name, x, rows, cols, e, n_e);
  });
  SingleSequence seq(model, o.ctx);
  Perplexity ppl;
  const bool all_logits = !o.no_ppl || o.process_output;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto t0 = std::chrono::steady_clock::now();
    seq.reset();
    const auto& chunk = chunks[c];
    const std::vector<float> logits = seq.eval(chunk, all_logits, o.batch);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("[{}/{}] {:.2f} s", c + 1, chunks.size(), secs);
    if (!o.no_ppl) {
      ppl.add_chunk(logits, chunk.data() + 1, o.ctx, model.tokenizer().n_vocab());
      fmt::print("  PPL {:.4f}", ppl.value());
    }
    fmt::print("\n");
    std::fflush(stdout);
  }
  model.set_matmul_observer(nullptr);
  model.set_expert_observer(nullptr);
  for (const auto& [name, e] : m.entries)
    for (double v : e.sum2) check(std::isfinite(v), "{}: non-finite activations (the model overflows on this text)", name);
  m.chunk_count += int(chunks.size());
  m.datasets.push_back(o.file);
}

void run_imatrix(ImatrixOptions o) {
  set_threads(o.threads);
  const bool dat = writes_dat(o);
  check(!o.file.empty() || !o.in_files.empty(), "give a text (-f) to collect over, or --in-file files to combine");
  check(o.ctx >= 4, "-c must be at least 4");
  check(o.batch >= 1, "-b must be at least 1");
  o.batch = std::min(o.batch, o.ctx);
  check(o.file.empty() || std::filesystem::is_regular_file(o.file), "{}: no such text file (-f)", o.file);
  std::vector<std::pair<std::string, Imatrix>> inputs;
  for (const auto& f : o.in_files) inputs.emplace_back(f, load_imatrix(f));
  auto model = Model::load(resolve_model_path(o.model), {o.tokenizer});
  const auto widths = input_widths(*model);
  Imatrix m;
  for (const auto& [path, in] : inputs) combine(m, in, path, widths, o.ctx);
  if (!o.file.empty()) collect(o, *model, m);
  if (!o.file.empty() || m.chunk_size == 0) m.chunk_size = o.ctx;  // combining only: the files' own
  check(!m.entries.empty(), "no matrix had {} or more input rows: nothing to write", kMinRows);
  save_imatrix(m, o.out, dat);
  fmt::print(stderr, "imatrix: {} entries, {} chunks of {} written to {} ({})\n", m.entries.size(), m.chunk_count,
             m.chunk_size, o.out, dat ? "dat" : "gguf");
}

}  // namespace

void add_imatrix(CLI::App& app) {
  auto* cmd = app.add_subcommand("imatrix", "Importance matrix (llama-imatrix): activation statistics for quantize --imatrix");
  auto o = std::make_shared<ImatrixOptions>();
  cmd->add_option("-m,--model,model", o->model, "model")->required();
  cmd->add_option("-f,--file", o->file, "text file to run the model over");
  cmd->add_option("-o,--output", o->out, "output file (default imatrix.gguf)");
  cmd->add_option("--output-format", o->format, "gguf or dat (default: dat when the output name ends in .dat, else gguf)");
  cmd->add_option("--in-file", o->in_files, "start from this imatrix file (GGUF or .dat; repeatable: they are summed)");
  cmd->add_option("-c,--ctx-size", o->ctx, "chunk (context) size (default 512)");
  cmd->add_option("-b,--batch-size", o->batch, "tokens per forward pass (default 512; products under 16 rows are not counted)");
  cmd->add_option("--chunks", o->max_chunks, "process at most this many chunks");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->add_flag("--process-output", o->process_output, "also collect output.weight");
  cmd->add_flag("--no-ppl", o->no_ppl, "do not compute the perplexity");
  cmd->add_option("--tokenizer", o->tokenizer, "use this tokenizer.json instead of the model's");
  cmd->callback([o] { run_imatrix(*o); });
}

}  // namespace serval::cli
