// `serval quantize IN.gguf OUT.gguf TYPE [NTHREADS]`: llama-quantize's arguments and tensor choices
// (docs/quantization.md). With --method gptq, the input model first runs over the calibration text
// (--calib-file) to measure each matrix's input Hessian (quant/gptq.h).
#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <thread>

#include "apps/commands.h"
#include "base/error.h"
#include "base/file_util.h"
#include "io/gguf.h"
#include "model/session.h"
#include "quant/imatrix.h"
#include "quant/quantize_model.h"

namespace serval::cli {
namespace {

struct QuantizeCliOptions {
  std::string in, out, type, output_tensor_type, token_embedding_type, imatrix, calib_file;
  int threads = 0, calib_ctx = 512, calib_chunks = 8;
  QuantizeOptions q;
};

// The calibration text's chunks of `ctx` tokens, each starting with BOS when the model adds one.
std::vector<std::vector<int32_t>> calib_chunks(const QuantizeCliOptions& o, const Tokenizer& tok) {
  const std::vector<int32_t> tokens = tok.encode(read_text_file(o.calib_file), /*add_special=*/true);
  const int64_t n = std::min<int64_t>(int64_t(tokens.size()) / o.calib_ctx, o.calib_chunks);
  check(n > 0, "{}: {} tokens is fewer than one chunk of {} (--calib-ctx)", o.calib_file, tokens.size(), o.calib_ctx);
  std::vector<std::vector<int32_t>> r;
  for (int64_t c = 0; c < n; ++c) {
    r.emplace_back(tokens.begin() + c * o.calib_ctx, tokens.begin() + (c + 1) * o.calib_ctx);
    if (tok.vocab().add_bos && tok.vocab().bos >= 0) r.back()[0] = tok.vocab().bos;
  }
  return r;
}

// Each weight matrix's input Hessian over the calibration text (not output.weight's: GPTQ leaves the
// output and the embedding to the plain searches). q/k/v and gate/up see one input: one Hessian each.
HessianSet collect_hessians(const QuantizeCliOptions& o) {
  check(o.calib_ctx >= 16 && o.calib_chunks >= 1, "--calib-ctx must be at least 16 and --calib-chunks at least 1");
  auto model = Model::load(o.in);
  const auto chunks = calib_chunks(o, model->tokenizer());
  HessianSet set;
  std::shared_ptr<Hessian> last;
  const float* last_x = nullptr;
  model->set_matmul_observer([&](const std::string& name, const float* x, int64_t n_tok, int64_t cols) {
    if (name == "output.weight") return;
    const bool follower = name.ends_with("attn_k.weight") || name.ends_with("attn_v.weight") || name.ends_with("ffn_up.weight");
    auto& h = set[name];
    if (follower && x == last_x && last) {
      h = last;
      return;
    }
    if (!h) h = std::make_shared<Hessian>(cols);
    h->add(x, n_tok);
    last = h, last_x = x;
  });
  SingleSequence seq(*model, o.calib_ctx);
  for (size_t c = 0; c < chunks.size(); ++c) {
    seq.reset();
    seq.eval(chunks[c], false, o.calib_ctx);
    last_x = nullptr;
    fmt::print(stderr, "serval quantize: gptq calibration chunk {}/{}\n", c + 1, chunks.size());
  }
  model->set_matmul_observer(nullptr);
  return set;
}

// ^C or SIGTERM: the temporary output is removed and the process ends (no partial file is left).
void watch_signals(const std::string& tmp_path) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, tmp_path] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::remove(tmp_path.c_str());
    fmt::print(stderr, "\nserval quantize: interrupted; no output written\n");
    _exit(128 + sig);
  }).detach();
}

void show_progress(size_t i, size_t n, const TensorChoice& c) {
  const bool tty = isatty(fileno(stderr));
  const std::string what = c.convert ? fmt::format("{} -> {}", dtype_info(c.from).name, dtype_info(c.to).name)
                                     : fmt::format("{} (copied)", dtype_info(c.from).name);
  fmt::print(stderr, "{}[{:4}/{}] {:<36} {:<16}{}", tty ? "\r" : "", i, n, c.name, what, tty && i < n ? "" : "\n");
}

void run_quantize(QuantizeCliOptions& o) {
  const FileType ft = parse_file_type(o.type);
  if (!o.output_tensor_type.empty()) o.q.output_tensor_type = parse_tensor_type(o.output_tensor_type);
  if (!o.token_embedding_type.empty()) o.q.token_embedding_type = parse_tensor_type(o.token_embedding_type);
  check(o.in != o.out, "the output would overwrite the input");
  set_threads(o.threads);
  Imatrix imatrix;
  if (!o.imatrix.empty()) {
    imatrix = load_imatrix(o.imatrix);
    o.q.imatrix = &imatrix, o.q.imatrix_path = o.imatrix;
    fmt::print(stderr, "serval quantize: imatrix {}: {} entries, {} chunks\n", o.imatrix, imatrix.entries.size(),
               imatrix.chunk_count);
  }
  HessianSet hessians;
  if (o.q.method == "gptq") {
    check(!o.calib_file.empty(), "--method gptq needs calibration text (--calib-file)");
    check(o.q.gptq_damp >= 0 && std::isfinite(o.q.gptq_damp), "--gptq-damp must be a non-negative number");
    choose_types(GgufFile(o.in), ft, o.q);  // refuse a bad input before the calibration run
    hessians = collect_hessians(o);
    o.q.hessians = &hessians;
  }
  watch_signals(o.out + ".tmp");
  const QuantizeReport r = quantize_file(o.in, o.out, ft, o.q, show_progress);
  if (!r.awq_alphas.empty()) {
    int scaled = 0;
    double sum = 0;
    for (const auto& [group, alpha] : r.awq_alphas) scaled += alpha > 0, sum += alpha;
    fmt::print(stderr, "serval quantize: awq: {} of {} groups scaled (mean alpha {:.2f})\n", scaled, r.awq_alphas.size(),
               sum / double(r.awq_alphas.size()));
  }
  if (o.q.method == "gptq") fmt::print(stderr, "serval quantize: gptq: {} matrices rounded with their Hessians\n", r.gptq);
  if (r.without_imatrix > 0)
    fmt::print(stderr, "serval quantize: {} quantized tensors had no imatrix entry (quantized without it)\n",
               r.without_imatrix);
  for (const auto& w : r.warnings) fmt::print(stderr, "warning: {}\n", w);
  const double mib = 1024.0 * 1024.0;
  fmt::print(stderr, "serval quantize: {} -> {} ({}): {} tensors converted, {} copied; {:.2f} MiB -> {:.2f} MiB ({:.2f} bits per weight)\n",
             o.in, o.out, ft.name, r.converted, r.copied, double(r.bytes_in) / mib, double(r.bytes_out) / mib,
             8.0 * double(r.bytes_out) / double(std::max<uint64_t>(1, r.n_params)));
}

}  // namespace

void add_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "write a GGUF file in another tensor type (llama-quantize's arguments and choices)");
  auto o = std::make_shared<QuantizeCliOptions>();
  cmd->add_option("input", o->in, "GGUF file to read (F32, F16 or BF16 weights; quantized ones with --allow-requantize)")
      ->required()->check(CLI::ExistingFile);
  cmd->add_option("output", o->out, "GGUF file to write")->required();
  cmd->add_option("type", o->type,
                  "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K "
                  "(or llama.cpp's number; Q3_K, Q4_K, Q5_K mean the _M mixtures)")->required();
  cmd->add_option("nthreads", o->threads, "threads (default: the cores available)");
  cmd->add_flag("--allow-requantize", o->q.allow_requantize, "accept quantized inputs (dequantized first: precision is lost twice)");
  cmd->add_flag("--leave-output-tensor", o->q.leave_output_tensor, "copy output.weight as it is");
  cmd->add_option("--imatrix", o->imatrix, "importance matrix (serval imatrix or llama-imatrix; GGUF or .dat)");
  cmd->add_option("--method", o->q.method,
                  "rtn (default), awq (activation-aware channel scales; needs --imatrix) or gptq (Hessian error "
                  "compensation; needs --calib-file)");
  cmd->add_option("--calib-file", o->calib_file, "--method gptq: text the input model runs over to measure each matrix's inputs")
      ->check(CLI::ExistingFile);
  cmd->add_option("--calib-ctx", o->calib_ctx, "--method gptq: tokens per calibration chunk (default 512)");
  cmd->add_option("--calib-chunks", o->calib_chunks, "--method gptq: at most this many chunks (default 8)");
  cmd->add_option("--gptq-damp", o->q.gptq_damp, "--method gptq: diagonal damping, a fraction of the mean (default 0.01)");
  cmd->add_flag("--pure", o->q.pure, "every quantized tensor gets TYPE (no per-tensor choices)");
  cmd->add_option("--output-tensor-type", o->output_tensor_type, "type of output.weight");
  cmd->add_option("--token-embedding-type", o->token_embedding_type, "type of token_embd.weight");
  cmd->callback([o] { run_quantize(*o); });
}

}  // namespace serval::cli
