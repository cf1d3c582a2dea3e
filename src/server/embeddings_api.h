// The pooling APIs of an encoder model: OpenAI's /v1/embeddings, the rerank endpoint llama-server and
// vLLM share (/v1/rerank, /rerank: query + documents, Jina/Cohere's shape) and vLLM's /score
// (text_1 / text_2). Parsing and validation (every refusal an ApiError naming the field) and the
// replies; the encoding itself is EmbeddingService's. No I/O, so it can be fuzzed on its own.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "model/encoder.h"
#include "model/model.h"
#include "server/api_request.h"

namespace serval {

// Bounds on what one request may ask for (OpenAI's: 2,048 inputs per embeddings request).
inline constexpr size_t kMaxEmbeddingInputs = 2048;
inline constexpr size_t kMaxRerankDocuments = 2048;

// What the pooling APIs need of the served model: an encoder, or a decoder used as an embedder.
struct PoolingTarget {
  int64_t max_tokens = 0;  // the longest input
  int64_t n_vocab = 0;
  int64_t n_embd = 0;
  int64_t n_classes = 0;   // a classification head's outputs (cross-encoders), else 0
  std::vector<int64_t> matryoshka_dims;
  std::function<EncoderInput(const std::string&)> tokenize;
  std::function<EncoderInput(const std::string&, const std::string&)> tokenize_pair;  // when n_classes > 0
};
PoolingTarget pooling_target(const EncoderModel& model);

struct EmbeddingJob {
  std::vector<EncoderInput> inputs;
  bool base64 = false;      // encoding_format "base64": little-endian float32 bytes, base64-encoded
  int64_t dimensions = 0;   // 0: the model's; else the leading `dimensions` values, re-normalized
  int64_t prompt_tokens = 0;
};

// A /v1/embeddings body: `input` a string, a list of strings, a list of token ids or a list of such
// lists; `encoding_format`, `dimensions` (Matryoshka models only), `user`, and vLLM's
// `truncate_prompt_tokens` (keep the last k tokens; -1: the model's limit). Texts get [CLS] ... [SEP];
// token ids are used as given.
EmbeddingJob parse_embeddings_request(const json& body, const PoolingTarget& model, const ApiContext& ctx);
// The response: one embedding per input (normalized after any truncation to `dimensions`).
json embeddings_response(const EmbeddingJob& job, std::vector<std::vector<float>> vectors, const std::string& model_name);

struct RerankJob {
  std::vector<std::string> documents;
  std::vector<EncoderInput> inputs;  // [CLS] query [SEP] document [SEP] per document
  size_t top_n = 0;                  // results returned, best first
  bool return_documents = false;
  int64_t tokens = 0;
};
// {query, documents (strings or {"text": ...}), top_n, return_documents}.
RerankJob parse_rerank_request(const json& body, const PoolingTarget& model, const ApiContext& ctx);
// The relevance score of a logit (its sigmoid), and the indices of `logits` best first (ties: the lower
// index first). Shared by the rerank replies and `serval rerank`.
double relevance_score(float logit);
void l2_normalize(std::vector<float>& v);
std::vector<size_t> rank_by_logit(const std::vector<float>& logits);
// Jina/Cohere's shape: results sorted by relevance_score (the sigmoid of the cross-encoder's logit).
json rerank_response(const RerankJob& job, const std::vector<float>& logits, const std::string& model_name);

// A decoder as a reranker (Qwen3-Reranker; vLLM's classifier_from_token): a (query, document) pair is
// one prompt, and its relevance logit is the logit of the "true" token at the prompt's last position
// minus that of the "false" token, so that the sigmoid of it is the softmax probability of "true" over
// the two (one token alone: the sigmoid of its logit). Logits are computed in F32 from the final hidden
// state and the dequantized output rows.
struct DecoderScorer {
  std::vector<float> w_true, w_false;  // output rows; w_false empty with one token
  float softcap = 0;                   // the model's final logit soft-capping (Gemma 2), 0: none
  float logit(const std::vector<float>& hidden) const;
};
// The scorer of a decoder `model` by `tokens` ([false, true], or one token; each a token of its
// vocabulary). Throws Error naming a token it lacks.
DecoderScorer decoder_scorer(const Model& model, const std::vector<std::string>& tokens);
// Qwen3-Reranker's prompt (the model card's, with its default instruction).
extern const char* const kDefaultRerankTemplate;
// `given` when set, else the model's (GGUF tokenizer.chat_template.rerank), else kDefaultRerankTemplate.
std::string rerank_template_for(const Model& model, const std::string& given);
// `tmpl` with its {query} and {document} replaced by the texts (the texts themselves are not searched).
std::string rerank_prompt(const std::string& tmpl, const std::string& query, const std::string& document);

// vLLM's /score: text_1 and text_2 each a string or a list; one text_1 is scored against every text_2,
// otherwise the lists pair up index by index.
RerankJob parse_score_request(const json& body, const PoolingTarget& model, const ApiContext& ctx);
json score_response(const RerankJob& job, const std::vector<float>& logits, const std::string& model_name);

}  // namespace serval
