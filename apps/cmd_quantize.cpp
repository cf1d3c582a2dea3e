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
#include "apps/gptq_calib.h"
#include "base/error.h"
#include "io/gguf.h"
#include "quant/imatrix.h"
#include "quant/quantize_model.h"

namespace serval::cli {
namespace {

struct QuantizeCliOptions {
  std::string in, out, type, output_tensor_type, token_embedding_type, imatrix;
  int threads = 0;
  GptqCalibration calib;
  QuantizeOptions q;
};

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
  if (o.q.method == "gptq") {
    check(!o.calib.text.empty(), "--method gptq needs calibration text (--calib-file)");
    check(o.q.gptq_damp >= 0 && std::isfinite(o.q.gptq_damp), "--gptq-damp must be a non-negative number");
    o.calib.model = o.in;
    o.q.hessians = gptq_hessians(o.calib, choose_types(GgufFile(o.in), ft, o.q));
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
  cmd->add_option("--calib-file", o->calib.text, "--method gptq: text the input model runs over to measure each matrix's inputs")
      ->check(CLI::ExistingFile);
  cmd->add_option("--calib-ctx", o->calib.ctx, "--method gptq: tokens per calibration chunk (default 512)");
  cmd->add_option("--calib-chunks", o->calib.chunks, "--method gptq: at most this many chunks (default 8)");
  cmd->add_option("--gptq-layers", o->calib.layers_per_pass,
                  "--method gptq: layers measured per run over the text (default: as many as 4 GiB of Hessians hold)");
  cmd->add_option("--gptq-damp", o->q.gptq_damp, "--method gptq: diagonal damping, a fraction of the mean (default 0.01)");
  cmd->add_flag("--pure", o->q.pure, "every quantized tensor gets TYPE (no per-tensor choices)");
  cmd->add_option("--output-tensor-type", o->output_tensor_type, "type of output.weight");
  cmd->add_option("--token-embedding-type", o->token_embedding_type, "type of token_embd.weight");
  cmd->callback([o] { run_quantize(*o); });
}

}  // namespace serval::cli
