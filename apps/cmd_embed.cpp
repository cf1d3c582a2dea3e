// `serval embed` (texts to embeddings) and `serval rerank` (a query against documents), printing JSON:
// on an encoder model (model/encoder.h), or on a decoder through the engine as the server runs it
// (last-token or mean pooling; a yes/no reranker).
#include <fmt/core.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "base/error.h"
#include "base/file_util.h"
#include "engine/engine.h"
#include "model/encoder.h"
#include "server/embeddings_api.h"

namespace serval::cli {
namespace {

// A decoder's final hidden states of `texts`, pooled by the last token or the mean: prefill-only
// requests in one continuous batch, as the server runs them.
std::vector<std::vector<float>> decoder_pool(const Model& model, const std::vector<std::string>& texts, bool mean) {
  Engine engine(model, EngineConfig{});
  std::vector<std::vector<float>> out(texts.size());
  std::string error;
  for (size_t i = 0; i < texts.size(); ++i) {
    GenerationParams p;
    p.embed = true, p.embed_mean = mean;
    p.max_tokens = 1, p.draft_max = 0;
    engine.add_request(model.tokenizer().encode(texts[i], /*add_special=*/true, /*parse_special=*/true), p,
                       [&out, &error, i](const TokenEvent& ev) {
                         if (ev.finished && ev.embedding.empty()) error = ev.error;
                         if (ev.finished) out[i] = ev.embedding;
                       });
  }
  while (engine.has_work()) engine.step();
  check(error.empty(), "{}", error);
  return out;
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
  cmd->add_option("--pooling", o->pooling, "mean, cls or last (default: the model's; a decoder's: last, or mean)");
  cmd->add_flag("--no-normalize", o->no_normalize, "leave the vectors unnormalized (default: L2-normalized)");
  cmd->add_option("-b,--batch-size", o->batch, "texts encoded together")->check(CLI::Range(1, 4096));
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->callback([o] {
    set_threads(o->threads);
    const std::string path = resolve_model_path(o->model);
    if (!EncoderModel::is_encoder(path)) {
      check(o->pooling.empty() || o->pooling == "last" || o->pooling == "mean",
            "{}: a decoder pools its embeddings by the last token or the mean, not '{}'", path, o->pooling);
      const auto model = Model::load(path);
      const std::vector<std::string> texts = gather_texts(o->prompts, o->file);
      auto vecs = decoder_pool(*model, texts, o->pooling == "mean");
      nlohmann::json data = nlohmann::json::array();
      for (size_t i = 0; i < vecs.size(); ++i) {
        if (!o->no_normalize) l2_normalize(vecs[i]);
        data.push_back({{"index", i}, {"embedding", vecs[i]}});
      }
      const char* pooling = o->pooling == "mean" ? "mean" : "last";
      return fmt::print("{}\n", nlohmann::json{{"model", path}, {"pooling", pooling}, {"data", data}}.dump());
    }
    const auto model = EncoderModel::load(path);
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
  struct Opts {
    std::string model, query, file, template_file;
    std::vector<std::string> docs, tokens = {"no", "yes"};
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-m,--model,model", o->model, "a cross-encoder (BERT with a classification head) or a decoder reranker")
      ->required();
  cmd->add_option("-q,--query", o->query, "the query")->required();
  cmd->add_option("-d,--document", o->docs, "a document (repeatable)");
  cmd->add_option("-f,--file", o->file, "a file of documents, one per line");
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)");
  cmd->add_option("--classifier-from-token", o->tokens, "a decoder reranker's tokens: FALSE,TRUE (default no,yes) or one")
      ->delimiter(',')
      ->expected(1, 2);
  cmd->add_option("--rerank-template", o->template_file,
                  "a decoder reranker's prompt file with {query} and {document} (default: the model's, else Qwen3-Reranker's)")
      ->check(CLI::ExistingFile);
  cmd->callback([o] {
    set_threads(o->threads);
    const std::string path = resolve_model_path(o->model);
    const std::vector<std::string> docs = gather_texts(o->docs, o->file);
    std::vector<float> logits;
    if (EncoderModel::is_encoder(path)) {
      const auto model = EncoderModel::load(path);
      std::vector<EncoderInput> inputs;
      for (const auto& d : docs) inputs.push_back(model->tokenize_pair(o->query, d));
      logits = model->classify(inputs);
    } else {  // a decoder: the yes/no logits of each (query, document) prompt's last token
      const auto model = Model::load(path);
      const DecoderScorer scorer = decoder_scorer(*model, o->tokens);
      const std::string tmpl =
          rerank_template_for(*model, o->template_file.empty() ? "" : read_text_file(o->template_file));
      std::vector<std::string> prompts;
      for (const auto& d : docs) prompts.push_back(rerank_prompt(tmpl, o->query, d));
      for (const auto& h : decoder_pool(*model, prompts, /*mean=*/false)) logits.push_back(scorer.logit(h));
    }
    nlohmann::json results = nlohmann::json::array();
    for (size_t i : rank_by_logit(logits))
      results.push_back({{"index", i}, {"relevance_score", relevance_score(logits[i])}, {"logit", logits[i]}});
    fmt::print("{}\n", nlohmann::json{{"model", path}, {"results", results}}.dump());
  });
}

}  // namespace serval::cli
