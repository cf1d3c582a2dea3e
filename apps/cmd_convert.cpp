// `serval convert HF_DIR OUT.gguf [--outtype f16|bf16|f32|q8_0]`: a Hugging Face checkpoint to GGUF, as
// llama.cpp's convert_hf_to_gguf.py writes it (docs/quantization.md).
#include <fmt/core.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "apps/commands.h"
#include "model/dummy.h"
#include "quant/convert.h"

namespace serval::cli {
namespace {

struct ConvertCliOptions {
  std::string dir, out, outtype = "f16", base;
};

void show_progress(size_t i, size_t n, const std::string& name, DType type) {
  const bool tty = isatty(fileno(stderr));
  fmt::print(stderr, "{}[{:4}/{}] {:<36} {:<6}{}", tty ? "\r" : "", i, n, name, dtype_info(type).name,
             tty && i < n ? "" : "\n");
}

void run_convert(const ConvertCliOptions& o) {
  if (std::filesystem::exists(std::filesystem::path(o.dir) / "adapter_config.json")) {  // a PEFT LoRA adapter
    convert_lora_to_gguf(o.dir, o.base, o.out, parse_convert_type(o.outtype));
    return void(fmt::print(stderr, "serval convert: LoRA adapter {} -> {} ({})\n", o.dir, o.out, o.outtype));
  }
  ConvertOptions c;
  c.outtype = parse_convert_type(o.outtype);
  c.progress = show_progress;
  convert_hf_to_gguf(o.dir, o.out, c);
  fmt::print(stderr, "serval convert: {} -> {} ({})\n", o.dir, o.out, o.outtype);
}

struct ExportShapeOptions {
  std::string model, out;
  bool full = false;
};

}  // namespace

void add_export_shape(CLI::App& app) {
  auto* cmd = app.add_subcommand("export-shape", "write a model's shape file (its GGUF header without weights, a few MB) for "
                                                 "--load-format dummy, or with --full a whole GGUF of the dummy weights");
  auto o = std::make_shared<ExportShapeOptions>();
  cmd->add_option("model", o->model, "GGUF model, or a shape file")->required();
  cmd->add_option("output", o->out, "file to write")->required();
  cmd->add_flag("--full", o->full, "write the weights --load-format dummy makes into a whole GGUF (llama.cpp loads the same bytes)");
  cmd->callback([o] {
    export_shape(resolve_model_path(o->model), o->out, o->full);
    fmt::print(stderr, "serval export-shape: {} -> {}{}\n", o->model, o->out, o->full ? " (dummy weights)" : " (shape only)");
  });
}

void add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "convert a Hugging Face checkpoint (Llama, Mixtral, Qwen2, Qwen3, Qwen2/Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2, Gemma 2, Gemma 3, Phi-3, BERT) or a PEFT LoRA adapter to GGUF");
  auto o = std::make_shared<ConvertCliOptions>();
  cmd->add_option("hf_dir", o->dir, "directory with config.json, safetensors (or an index and shards), tokenizer.json")
      ->required();
  cmd->add_option("output", o->out, "GGUF file to write")->required();
  cmd->add_option("--outtype", o->outtype, "type of the 2-D weights: f16 (default), bf16, f32, q8_0");
  cmd->add_option("--base", o->base, "a PEFT LoRA adapter's base model directory (default: its base_model_name_or_path)");
  cmd->callback([o] { run_convert(*o); });
}

}  // namespace serval::cli
