// `serval embed` (texts to embeddings) and `serval rerank` (a query against documents) on an encoder
// model (model/encoder.h), printing JSON.
#include <fmt/core.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "base/error.h"
#include "model/encoder.h"

namespace serval::cli {
namespace {

std::unique_ptr<EncoderModel> load_encoder(const std::string& name) {
  const std::string path = resolve_model_path(name);
  check(EncoderModel::is_encoder(path), "{}: not an encoder (embedding) model; `serval embed` runs BERT-family models",
        path);
  return EncoderModel::load(path);
}

// The -p texts, then the lines of --file.
std::vector<std::string> gather_texts(const std::vector<std::string>& prompts, const std::string& file) {
  std::vector<std::string> texts = prompts;
  if (!file.empty()) {
    std::ifstream in(file);
    check(in.good(), "{}: cannot read", file);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) texts.push_back(line);
  }
  check(!texts.empty(), "no text to embed (give -p TEXT or --file FILE)");
  return texts;
}

}  // namespace

void add_embed(CLI::App& app) {
  auto* cmd = app.add_subcommand("embed", "Print the embeddings of texts as JSON (an encoder model such as all-MiniLM-L6-v2)");
  struct Opts { std::string model, file, pooling; std::vector<std::string> prompts; bool no_normalize = false; int batch = 32, threads = 0; };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-m,--model,model", o->model, "model: GGUF file, sentence-transformers directory or cached name")->required();
  cmd->add_option("-p,--prompt", o->prompts, "a text to embed (repeatable)");
  cmd->add_option("-f,--file", o->file, "a file of texts, one per line");
  cmd->add_option("--pooling", o->pooling, "mean, cls or last (default: the model's)");
  cmd->add_flag("--no-normalize", o->no_normalize, "leave the vectors unnormalized (default: L2-normalized)");
  cmd->add_option("-b,--batch-size", o->batch, "texts encoded together")->check(CLI::Range(1, 4096));
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->callback([o] {
    set_threads(o->threads);
    const auto model = load_encoder(o->model);
    const Pooling pooling = o->pooling.empty() ? model->config().pooling : pooling_from_name(o->pooling);
    const std::vector<std::string> texts = gather_texts(o->prompts, o->file);
    nlohmann::json data = nlohmann::json::array();
    for (size_t b = 0; b < texts.size(); b += size_t(o->batch)) {
      std::vector<EncoderInput> inputs;
      for (size_t i = b; i < std::min(texts.size(), b + size_t(o->batch)); ++i) inputs.push_back(model->tokenize(texts[i]));
      const auto vecs = model->embed(inputs, pooling, !o->no_normalize);
      for (size_t i = 0; i < vecs.size(); ++i)
        data.push_back({{"index", b + i}, {"tokens", inputs[i].tokens.size()}, {"embedding", vecs[i]}});
    }
    fmt::print("{}\n", nlohmann::json{{"model", model->path()}, {"pooling", pooling_name(pooling)}, {"data", data}}.dump());
  });
}

void add_rerank(CLI::App& app) {
  auto* cmd = app.add_subcommand("rerank", "Score documents against a query with a cross-encoder, as JSON (best first)");
  struct Opts { std::string model, query, file; std::vector<std::string> docs; int threads = 0; };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-m,--model,model", o->model, "a cross-encoder model (BERT with a classification head)")->required();
  cmd->add_option("-q,--query", o->query, "the query")->required();
  cmd->add_option("-d,--document", o->docs, "a document (repeatable)");
  cmd->add_option("-f,--file", o->file, "a file of documents, one per line");
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->callback([o] {
    set_threads(o->threads);
    const auto model = load_encoder(o->model);
    const std::vector<std::string> docs = gather_texts(o->docs, o->file);
    std::vector<EncoderInput> inputs;
    for (const auto& d : docs) inputs.push_back(model->tokenize_pair(o->query, d));
    const std::vector<float> logits = model->classify(inputs);
    nlohmann::json results = nlohmann::json::array();
    std::vector<size_t> order(docs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
    for (size_t i : order)
      results.push_back({{"index", i}, {"relevance_score", 1.0 / (1.0 + std::exp(-double(logits[i])))}, {"logit", logits[i]}});
    fmt::print("{}\n", nlohmann::json{{"model", model->path()}, {"results", results}}.dump());
  });
}

}  // namespace serval::cli
