// libFuzzer harness for the HTTP request validator (src/server/api_request.h).
//
// Input: one control byte, then the request body. Control byte bits:
//   bit 0      chat (/v1/chat/completions) rather than /v1/completions
//   bits 1-3   the chat template (tests/data/chat_templates/*.jinja sorted, modulo their number)
//   bit 4      the server trusts a `chat_template` in the request body
//   bits 5-6   1: /tokenize, 2: /detokenize or, with bit 4, a pooling API of an encoder (bits 1-2: 0
//              /v1/embeddings, 1 /v1/rerank, 2 /score, 3 /v1/embeddings), 3: Anthropic's /v1/messages
//              (bit 0: /v1/messages/count_tokens) or, with bit 4, OpenAI's /v1/responses (an empty
//              response store); 0: a generation request
// The pooling APIs run against tests/data/embeddings/tiny_cross_encoder (a 128-position BERT with a
// classification head): an accepted request's inputs must be within the model's positions and
// vocabulary, and no more than the documented number.
// The context is built once from ../shared/models/stories260K.gguf. The body goes through
// parse_json_body and the request parser; a refusal must be an ApiError (whose JSON form must
// serialize); anything else escaping, a crash or a sanitizer report is a finding. An accepted
// request must be within the limits the parser promises (prompt ids in the vocabulary, prompt plus
// max_tokens within the context, n in 1..16, ...).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"
#include "base/file_util.h"
#include "fuzz_common.h"
#include "model/model.h"
#include "model/encoder.h"
#include "server/api_request.h"
#include "server/embeddings_api.h"
#include "server/jinja.h"
#include "server/messages_api.h"
#include "server/responses_api.h"
#include "tokenizer/tokenizer.h"

namespace {

using serval::fuzz::violation;

std::unique_ptr<serval::Model> model;
std::unique_ptr<serval::EncoderModel> encoder;
std::vector<std::unique_ptr<serval::jinja::Template>> templates;

void check_ids(const std::vector<int32_t>& ids, const serval::Tokenizer& tok, const char* what) {
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) violation(what);
}

void check_job(const serval::GenJob& job, bool chat, const serval::ApiContext& ctx) {
  if (job.chat != chat) violation("GenJob.chat");
  if (job.prompt.empty()) violation("accepted an empty prompt");
  check_ids(job.prompt, *ctx.tokenizer, "prompt id out of range");
  const int64_t max_tokens = job.params.max_tokens;
  if (max_tokens < 1 || int64_t(job.prompt.size()) + max_tokens > ctx.max_model_len)
    violation("prompt plus max_tokens exceed the context");
  if (job.n < 1 || job.n > 16) violation("n out of range");
  if (job.logprobs < -1 || job.logprobs > 20) violation("logprobs out of range");
  if (job.stops.size() > 16) violation("too many stop strings");
  for (const auto& s : job.stops)
    if (s.empty()) violation("empty stop string");
}

// OpenAI's Responses API: translated to a chat body (no response is stored, so any previous_response_id
// must be refused), which must then parse (or be refused) as one.
void responses_request(const serval::json& body, const serval::ApiContext& ctx) {
  static const serval::ResponseStore store(4);
  const serval::ResponsesJob rj = serval::responses_to_chat(body, store);
  check_job(serval::parse_generation_request(rj.chat, true, ctx), true, ctx);
}

// Anthropic's Messages API: translated to a chat body, which must then parse (or be refused) as one.
void messages_request(const serval::json& body, bool count_only, const serval::ApiContext& ctx) {
  const serval::json chat = serval::messages_to_chat(body, count_only);
  if (count_only) {
    (void)serval::render_chat(chat, ctx);
    return;
  }
  const serval::GenJob job = serval::parse_generation_request(chat, true, ctx);
  check_job(job, true, ctx);
  if (job.n != 1) violation("a Messages request asked for more than one choice");
}

void check_inputs(const std::vector<serval::EncoderInput>& inputs, size_t max_inputs) {
  if (inputs.empty() || inputs.size() > max_inputs) violation("accepted a number of inputs out of range");
  for (const auto& in : inputs) {
    if (in.tokens.empty() || int64_t(in.tokens.size()) > encoder->config().n_pos) violation("input length out of range");
    if (in.types.size() != in.tokens.size()) violation("token types do not match the tokens");
    for (int32_t id : in.tokens)
      if (id < 0 || id >= encoder->config().n_vocab) violation("input id out of range");
  }
}

// /v1/embeddings, /v1/rerank or /score on the encoder.
void pooling_request(const serval::json& body, int which) {
  serval::ApiContext ctx;
  ctx.tokenizer = &encoder->tokenizer();
  ctx.max_model_len = encoder->config().n_pos;
  ctx.model_name = "tiny-reranker";
  static const serval::PoolingTarget target = serval::pooling_target(*encoder);
  if (which == 1 || which == 2) {
    const serval::RerankJob job = which == 1 ? serval::parse_rerank_request(body, target, ctx)
                                             : serval::parse_score_request(body, target, ctx);
    check_inputs(job.inputs, serval::kMaxRerankDocuments);
    if (job.top_n < 1 || job.top_n > job.inputs.size()) violation("top_n out of range");
    return;
  }
  const serval::EmbeddingJob job = serval::parse_embeddings_request(body, target, ctx);
  check_inputs(job.inputs, serval::kMaxEmbeddingInputs);
  if (job.dimensions != 0) violation("accepted dimensions for a model that is not Matryoshka-trained");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace fs = std::filesystem;
  model = serval::Model::load(serval::fuzz::shared_path("models/stories260K.gguf"));
  encoder = serval::EncoderModel::load(std::string(SERVAL_SOURCE_DIR) + "/tests/data/embeddings/tiny_cross_encoder");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(std::string(SERVAL_SOURCE_DIR) + "/tests/data/chat_templates"))
    if (e.path().extension() == ".jinja") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files)
    templates.push_back(std::make_unique<serval::jinja::Template>(serval::read_text_file(f.string())));
  if (templates.empty()) violation("no chat template found");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const bool chat = control & 1;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const serval::Tokenizer& tok = model->tokenizer();

  serval::ApiContext ctx;
  ctx.tokenizer = &tok;
  ctx.max_model_len = model->config().n_ctx_train;
  ctx.chat_template = templates[(control >> 1 & 7) % templates.size()].get();
  ctx.trust_request_chat_template = control >> 4 & 1;
  ctx.model_name = "stories260K";

  try {
    const serval::json body = serval::parse_json_body(text);
    if (!body.is_object()) violation("parse_json_body accepted a non-object");
    switch (control >> 5 & 3) {
      case 1: check_ids(serval::parse_tokenize_request(body, ctx), tok, "/tokenize gave an id out of range"); break;
      case 2:
        if (control >> 4 & 1) pooling_request(body, control >> 1 & 3);
        else check_ids(serval::parse_detokenize_request(body, ctx), tok, "/detokenize accepted an id out of range");
        break;
      case 3:
        if (control >> 4 & 1) responses_request(body, ctx);
        else messages_request(body, chat, ctx);
        break;
      default: check_job(serval::parse_generation_request(body, chat, ctx), chat, ctx); break;
    }
  } catch (const serval::ApiError& e) {
    if (e.status < 400 || e.status > 599) violation("ApiError with a status that is not an error");
    (void)serval::dump(serval::error_json(e));  // the reply must serialize, whatever bytes the message holds
    (void)serval::dump(serval::anthropic_error_json(e));
  }
  return 0;
}
