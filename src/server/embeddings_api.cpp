#include "server/embeddings_api.h"

#include <fmt/core.h>
#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>

namespace serval {
namespace embeddings {

// Refuses any field not in `known`, naming it (a client that sends one expects it to work).
void refuse_unknown_fields(const json& body, const std::set<std::string>& known) {
  for (const auto& [key, value] : body.items())
    if (!known.count(key)) bad_request(fmt::format("'{}' is not supported by this endpoint", key), key);
}

int64_t int_field(const json& body, const char* key, int64_t lo, int64_t hi) {
  const json& v = body[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    bad_request(fmt::format("'{}' must be an integer in [{}, {}]", key, lo, hi), key);
  return v.get<int64_t>();
}

// A text's input: [CLS] text [SEP], refused when empty or longer than the model's positions unless
// truncated (the last `keep` tokens are kept, as vLLM's truncate_prompt_tokens).
EncoderInput text_input(const std::string& text, const PoolingTarget& model, int64_t keep, const std::string& param) {
  if (text.empty()) bad_request("an input must not be an empty string", param);
  EncoderInput in = model.tokenize(text);
  const int64_t limit = model.max_tokens;
  if (keep > 0 && int64_t(in.tokens.size()) > keep) {
    in.tokens.erase(in.tokens.begin(), in.tokens.end() - keep);
    in.types.resize(in.tokens.size());
  }
  if (int64_t(in.tokens.size()) > limit)
    bad_request(fmt::format("an input of {} tokens is longer than the model's maximum of {} (send "
                            "truncate_prompt_tokens to keep the last tokens)", in.tokens.size(), limit), param);
  return in;
}

EncoderInput ids_input(const json& ids, const PoolingTarget& model, const std::string& param) {
  if (ids.empty()) bad_request("a list of token ids must not be empty", param);
  if (int64_t(ids.size()) > model.max_tokens)
    bad_request(fmt::format("an input of {} tokens is longer than the model's maximum of {}", ids.size(),
                            model.max_tokens), param);
  EncoderInput in;
  for (const auto& id : ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= model.n_vocab)
      bad_request(fmt::format("token ids must be integers in [0, {})", model.n_vocab), param);
    in.tokens.push_back(id.get<int32_t>());
  }
  in.types.assign(in.tokens.size(), 0);
  return in;
}

std::vector<EncoderInput> parse_input(const json& input, const PoolingTarget& model, int64_t keep) {
  if (input.is_string()) return {text_input(input.get<std::string>(), model, keep, "input")};
  if (!input.is_array() || input.empty())
    bad_request("'input' must be a string, a list of strings, a list of token ids or a list of such lists", "input");
  if (input.size() > kMaxEmbeddingInputs)
    bad_request(fmt::format("'input' has {} items; at most {} are accepted per request", input.size(), kMaxEmbeddingInputs),
                "input");
  if (input[0].is_number_integer()) return {ids_input(input, model, "input")};
  std::vector<EncoderInput> out;
  for (size_t i = 0; i < input.size(); ++i) {
    const std::string param = fmt::format("input[{}]", i);
    if (input[i].is_string()) out.push_back(text_input(input[i].get<std::string>(), model, keep, param));
    else if (input[i].is_array()) out.push_back(ids_input(input[i], model, param));
    else bad_request("each item of 'input' must be a string or a list of token ids", param);
  }
  return out;
}

std::string base64_floats(const std::vector<float>& v) {
  static_assert(std::endian::native == std::endian::little, "base64 embeddings are little-endian float32");
  std::string out(4 * ((v.size() * sizeof(float) + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), reinterpret_cast<const unsigned char*>(v.data()),
                                int(v.size() * sizeof(float)));
  out.resize(size_t(n));
  return out;
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void require_cross_encoder(const PoolingTarget& model, const ApiContext& ctx) {
  if (model.n_classes <= 0)
    bad_request(fmt::format("The model '{}' is an embedding model without a classification head; reranking and "
                            "scoring need a cross-encoder (a BertForSequenceClassification model)", ctx.model_name));
}

std::string document_text(const json& d, const std::string& param) {
  if (d.is_string()) return d.get<std::string>();
  if (d.is_object() && d.contains("text") && d["text"].is_string()) return d["text"].get<std::string>();
  bad_request("a document must be a string or an object with a string 'text'", param);
}

std::vector<std::string> string_list(const json& v, const char* key, size_t max_items) {
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array() || v.empty()) bad_request(fmt::format("'{}' must be a string or a non-empty list of strings", key), key);
  if (v.size() > max_items) bad_request(fmt::format("'{}' has {} items; at most {} are accepted", key, v.size(), max_items), key);
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) out.push_back(document_text(v[i], fmt::format("{}[{}]", key, i)));
  return out;
}

// [CLS] a [SEP] b [SEP], refused when longer than the model's positions.
EncoderInput pair_input(const PoolingTarget& model, const std::string& a, const std::string& b, const std::string& param) {
  EncoderInput in = model.tokenize_pair(a, b);
  if (int64_t(in.tokens.size()) > model.max_tokens)
    bad_request(fmt::format("a query and document of {} tokens are longer than the model's maximum of {}",
                            in.tokens.size(), model.max_tokens), param);
  return in;
}

}  // namespace embeddings

using namespace embeddings;

void l2_normalize(std::vector<float>& v) {
  double ss = 0;
  for (float f : v) ss += double(f) * f;
  const double inv = ss > 0 ? 1.0 / std::sqrt(ss) : 0.0;
  for (float& f : v) f = float(f * inv);
}

PoolingTarget pooling_target(const EncoderModel& model) {
  PoolingTarget t;
  const auto& c = model.config();
  t.max_tokens = c.n_pos, t.n_vocab = c.n_vocab, t.n_embd = c.n_embd, t.n_classes = c.n_classes;
  t.matryoshka_dims = c.matryoshka_dims;
  t.tokenize = [&model](const std::string& s) { return model.tokenize(s); };
  t.tokenize_pair = [&model](const std::string& a, const std::string& b) { return model.tokenize_pair(a, b); };
  return t;
}

EmbeddingJob parse_embeddings_request(const json& body, const PoolingTarget& model, const ApiContext& ctx) {
  refuse_unknown_fields(body, {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"});
  check_model_name(body, ctx);
  if (!body.contains("input")) bad_request("'input' is required", "input");
  EmbeddingJob job;
  if (body.contains("encoding_format") && !body["encoding_format"].is_null()) {
    const json& f = body["encoding_format"];
    if (!f.is_string() || (f != "float" && f != "base64")) bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format");
    job.base64 = f == "base64";
  }
  if (body.contains("dimensions") && !body["dimensions"].is_null()) {
    const auto& dims = model.matryoshka_dims;
    if (dims.empty())
      bad_request(fmt::format("The model '{}' is not Matryoshka-trained: 'dimensions' would give poor embeddings, "
                              "so it is not accepted", ctx.model_name), "dimensions");
    job.dimensions = int_field(body, "dimensions", 1, model.n_embd);
    if (dims.size() > 1 && std::find(dims.begin(), dims.end(), job.dimensions) == dims.end())
      bad_request(fmt::format("'dimensions' must be one of the model's Matryoshka dimensions"), "dimensions");
  }
  int64_t keep = 0;
  if (body.contains("truncate_prompt_tokens") && !body["truncate_prompt_tokens"].is_null()) {
    keep = int_field(body, "truncate_prompt_tokens", -1, model.max_tokens);
    if (keep == -1) keep = model.max_tokens;
    if (keep == 0) bad_request("'truncate_prompt_tokens' must be -1 or positive", "truncate_prompt_tokens");
  }
  job.inputs = parse_input(body["input"], model, keep);
  for (const auto& in : job.inputs) job.prompt_tokens += int64_t(in.tokens.size());
  return job;
}

json embeddings_response(const EmbeddingJob& job, std::vector<std::vector<float>> vectors, const std::string& model_name) {
  json data = json::array();
  for (size_t i = 0; i < vectors.size(); ++i) {
    std::vector<float>& v = vectors[i];
    if (job.dimensions > 0) v.resize(size_t(job.dimensions));
    l2_normalize(v);
    data.push_back({{"object", "embedding"}, {"index", i}, {"embedding", job.base64 ? json(base64_floats(v)) : json(v)}});
  }
  return json{{"object", "list"}, {"data", std::move(data)}, {"model", model_name},
              {"usage", {{"prompt_tokens", job.prompt_tokens}, {"total_tokens", job.prompt_tokens}}}};
}

RerankJob parse_rerank_request(const json& body, const PoolingTarget& model, const ApiContext& ctx) {
  refuse_unknown_fields(body, {"model", "query", "documents", "top_n", "return_documents", "user"});
  check_model_name(body, ctx);
  require_cross_encoder(model, ctx);
  if (!body.contains("query") || !body["query"].is_string() || body["query"].get<std::string>().empty())
    bad_request("'query' must be a non-empty string", "query");
  if (!body.contains("documents")) bad_request("'documents' is required", "documents");
  if (body["documents"].is_string()) bad_request("'documents' must be a list", "documents");
  RerankJob job;
  job.documents = string_list(body["documents"], "documents", kMaxRerankDocuments);
  job.top_n = job.documents.size();
  if (body.contains("top_n") && !body["top_n"].is_null())
    job.top_n = size_t(std::min<int64_t>(int_field(body, "top_n", 1, INT32_MAX), int64_t(job.documents.size())));
  if (body.contains("return_documents") && !body["return_documents"].is_null()) {
    if (!body["return_documents"].is_boolean()) bad_request("'return_documents' must be a boolean", "return_documents");
    job.return_documents = body["return_documents"].get<bool>();
  }
  const std::string query = body["query"].get<std::string>();
  for (size_t i = 0; i < job.documents.size(); ++i) {
    job.inputs.push_back(pair_input(model, query, job.documents[i], fmt::format("documents[{}]", i)));
    job.tokens += int64_t(job.inputs.back().tokens.size());
  }
  return job;
}

double relevance_score(float logit) { return 1.0 / (1.0 + std::exp(-double(logit))); }

std::vector<size_t> rank_by_logit(const std::vector<float>& logits) {
  std::vector<size_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  return order;
}

json rerank_response(const RerankJob& job, const std::vector<float>& logits, const std::string& model_name) {
  const std::vector<size_t> order = rank_by_logit(logits);
  json results = json::array();
  for (size_t k = 0; k < job.top_n && k < order.size(); ++k) {
    const size_t i = order[k];
    json r{{"index", i}, {"relevance_score", relevance_score(logits[i])}};
    if (job.return_documents) r["document"] = {{"text", job.documents[i]}};
    results.push_back(std::move(r));
  }
  return json{{"id", fmt::format("rerank-{}", unix_seconds())}, {"model", model_name}, {"object", "list"},
              {"usage", {{"prompt_tokens", job.tokens}, {"total_tokens", job.tokens}}}, {"results", std::move(results)}};
}

RerankJob parse_score_request(const json& body, const PoolingTarget& model, const ApiContext& ctx) {
  refuse_unknown_fields(body, {"model", "text_1", "text_2", "user", "encoding_format"});
  check_model_name(body, ctx);
  require_cross_encoder(model, ctx);
  if (!body.contains("text_1") || !body.contains("text_2")) bad_request("'text_1' and 'text_2' are required", "text_1");
  const auto a = string_list(body["text_1"], "text_1", kMaxRerankDocuments);
  const auto b = string_list(body["text_2"], "text_2", kMaxRerankDocuments);
  if (a.size() != 1 && a.size() != b.size())
    bad_request(fmt::format("'text_1' has {} items and 'text_2' {}: give one text_1, or lists of the same length",
                            a.size(), b.size()), "text_1");
  RerankJob job;
  for (size_t i = 0; i < b.size(); ++i) {
    job.inputs.push_back(pair_input(model, a.size() == 1 ? a[0] : a[i], b[i], fmt::format("text_2[{}]", i)));
    job.tokens += int64_t(job.inputs.back().tokens.size());
  }
  job.top_n = b.size();
  return job;
}

json score_response(const RerankJob& job, const std::vector<float>& logits, const std::string& model_name) {
  json data = json::array();
  for (size_t i = 0; i < logits.size(); ++i) data.push_back({{"index", i}, {"object", "score"}, {"score", relevance_score(logits[i])}});
  const int64_t now = unix_seconds();
  return json{{"id", fmt::format("score-{}", now)}, {"object", "list"}, {"created", now}, {"model", model_name},
              {"data", std::move(data)}, {"usage", {{"prompt_tokens", job.tokens}, {"total_tokens", job.tokens}}}};
}

const char* const kDefaultRerankTemplate =
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a "
    "web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: "
    "{document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

std::string rerank_prompt(const std::string& tmpl, const std::string& query, const std::string& document) {
  static const std::string q = "{query}", d = "{document}";
  std::string out;
  for (size_t i = 0; i < tmpl.size();) {
    if (tmpl.compare(i, q.size(), q) == 0) {
      out += query, i += q.size();
    } else if (tmpl.compare(i, d.size(), d) == 0) {
      out += document, i += d.size();
    } else {
      out += tmpl[i++];
    }
  }
  return out;
}

DecoderScorer decoder_scorer(const Model& model, const std::vector<std::string>& tokens) {
  check(tokens.size() == 1 || tokens.size() == 2, "a decoder reranker scores by one token or by two (false, true)");
  std::vector<std::vector<float>> rows;
  for (const auto& name : tokens) {
    const int32_t id = model.tokenizer().find(name);
    check(id >= 0, "the reranker's token '{}' is not in the vocabulary (see --classifier-from-token)", name);
    rows.push_back(model.output_row(id));
  }
  DecoderScorer s;
  s.w_true = std::move(rows.back());
  if (rows.size() == 2) s.w_false = std::move(rows.front());
  s.softcap = model.config().final_softcap;
  return s;
}

std::string rerank_template_for(const Model& model, const std::string& given) {
  if (!given.empty()) return given;
  const std::string& own = model.tokenizer().vocab().rerank_template;
  return own.empty() ? kDefaultRerankTemplate : own;
}

float DecoderScorer::logit(const std::vector<float>& hidden) const {
  auto token_logit = [&](const std::vector<float>& w) {
    double acc = 0;
    for (size_t i = 0; i < w.size() && i < hidden.size(); ++i) acc += double(w[i]) * double(hidden[i]);
    return softcap > 0 ? double(softcap) * std::tanh(acc / double(softcap)) : acc;
  };
  return float(w_false.empty() ? token_logit(w_true) : token_logit(w_true) - token_logit(w_false));
}

}  // namespace serval
