#include "server/http_server.h"

#include <fmt/core.h>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <condition_variable>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "base/error.h"
#include "server/api_request.h"
#include "server/completion_run.h"
#include "server/embedding_service.h"
#include "server/embeddings_api.h"
#include "server/http_transport.h"
#include "server/jinja.h"
#include "server/lora_admin.h"
#include "server/messages_api.h"
#include "server/openapi.h"
#include "server/responses_api.h"
#include "server/web_page.h"

namespace serval {

namespace net = boost::asio;
using SteadyClock = std::chrono::steady_clock;

namespace {

http::Response json_response(int status, const json& body) { return http::Response{status, "application/json", dump(body), {}}; }

http::Response error_response(const ApiError& e) { return json_response(e.status, error_json(e)); }

// Anthropic's clients read errors in Anthropic's shape: the Messages API's paths answer in it.
bool is_messages_path(const std::string& path) { return path.rfind("/v1/messages", 0) == 0; }

http::Response error_for(const http::Request& req, const ApiError& e) {
  return is_messages_path(req.path) ? json_response(e.status, anthropic_error_json(e)) : error_response(e);
}

// The transport's own refusals (malformed HTTP, oversize headers or body) in the API's error shape.
http::Response transport_error(int status, const std::string& message, const std::string& path) {
  http::Request req;
  req.path = path;
  return error_for(req, ApiError{status, message, status == 413 ? "invalid_request_error" : "bad_request"});
}

}  // namespace

struct HttpServer::Impl {
  using Exchange = std::shared_ptr<http::Exchange>;
  // A route answers on the I/O thread (cheap, never waits for the engine) or on an API thread.
  struct Route {
    bool inline_on_io;
    void (Impl::*fn)(http::Request&, Exchange);
  };
  // Checks every request passes before its route; a response ends it there.
  using Filter = std::optional<http::Response> (Impl::*)(const http::Request&) const;

  ServerConfig cfg;
  const std::string model_name;
  ResponseStore responses;
  std::unique_ptr<http::Transport> transport;
  net::thread_pool api_pool;
  std::map<std::pair<std::string, std::string>, Route> routes;
  // Set by attach() / attach_encoder() before `ready` is published; read only after it is true.
  std::atomic<const Model*> model{nullptr};
  EngineLoop* loop = nullptr;                 // null when serving an encoder
  std::unique_ptr<EmbeddingService> embedder;  // an encoder's, else null
  Pooling pooling = Pooling::Mean;             // of /v1/embeddings
  PoolingTarget target;                        // what the pooling APIs check requests against
  DecoderScorer scorer;                        // a decoder reranker's (ServerConfig::decoder_rerank)
  std::unique_ptr<LoraAdmin> lora_admin;        // with --allow-runtime-lora, else null
  std::atomic<bool> ready{false};
  std::unique_ptr<jinja::Template> chat_template;
  ApiContext api;
  Metrics metrics;
  std::atomic<bool> draining{false};
  std::atomic<int> in_flight{0};
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;

  explicit Impl(ServerConfig c)
      : cfg(std::move(c)), model_name(cfg.served_model_name), responses(cfg.responses_store), api_pool(size_t(std::max(1, cfg.api_threads))) {
    add_routes();
  }

  void add_routes();
  void handle(http::Request& req, Exchange ex);
  http::Headers common_headers() const;
  void reply(const Exchange& ex, http::Response r) const;
  template <typename F>
  void guarded(const http::Request& req, const Exchange& ex, F&& fn) const;

  std::optional<http::Response> preflight(const http::Request& req) const;
  std::optional<http::Response> authenticate(const http::Request& req) const;
  std::optional<http::Response> require_model(const http::Request& req) const;
  std::optional<http::Response> route_fits_model(const http::Request& req) const;
  std::optional<http::Response> refuse_while_draining(const http::Request& req) const;

  void get_health(http::Request&, Exchange ex);
  void get_page(http::Request&, Exchange ex);
  void get_openapi(http::Request&, Exchange ex);
  void get_metrics(http::Request&, Exchange ex);
  void get_models(http::Request&, Exchange ex);
  void get_lora_adapters(http::Request&, Exchange ex);
  void post_load_lora(http::Request& req, Exchange ex);
  void post_unload_lora(http::Request& req, Exchange ex);
  void get_engine_state(http::Request&, Exchange ex);
  void get_engine_blocks(http::Request&, Exchange ex);
  void post_reset_prefix_cache(http::Request&, Exchange ex);
  void post_tokenize(http::Request& req, Exchange ex);
  void post_detokenize(http::Request& req, Exchange ex);
  void post_completions(http::Request& req, Exchange ex) { generate(req, std::move(ex), false); }
  void post_chat(http::Request& req, Exchange ex) { generate(req, std::move(ex), true); }
  void post_messages(http::Request& req, Exchange ex);
  void post_count_tokens(http::Request& req, Exchange ex);
  void post_responses(http::Request& req, Exchange ex);
  void get_response(const http::Request& req, Exchange ex);
  void post_embeddings(http::Request& req, Exchange ex);
  void post_rerank(http::Request& req, Exchange ex);
  void post_score(http::Request& req, Exchange ex);
  std::vector<std::vector<float>> embed_with_engine(std::vector<EncoderInput> inputs, bool mean);
  std::vector<float> classify(std::vector<EncoderInput> inputs);
  void attach_decoder_pooling(const Model& model);
  void generate(http::Request& req, Exchange ex, bool chat);
  void start_run(const http::Request& req, Exchange ex, GenJob job);
  json engine_state();
};

void HttpServer::Impl::add_routes() {
  routes = {
      {{"GET", "/health"}, {true, &Impl::get_health}},
      {{"GET", "/"}, {true, &Impl::get_page}},
      {{"GET", "/openapi.json"}, {true, &Impl::get_openapi}},
      {{"GET", "/metrics"}, {true, &Impl::get_metrics}},
      {{"GET", "/v1/models"}, {true, &Impl::get_models}},
      {{"GET", "/lora-adapters"}, {true, &Impl::get_lora_adapters}},
      {{"POST", "/v1/load_lora_adapter"}, {false, &Impl::post_load_lora}},
      {{"POST", "/v1/unload_lora_adapter"}, {false, &Impl::post_unload_lora}},
      {{"GET", "/engine/state"}, {false, &Impl::get_engine_state}},
      {{"GET", "/engine/blocks"}, {false, &Impl::get_engine_blocks}},
      {{"POST", "/reset_prefix_cache"}, {false, &Impl::post_reset_prefix_cache}},
      {{"POST", "/tokenize"}, {false, &Impl::post_tokenize}},
      {{"POST", "/detokenize"}, {false, &Impl::post_detokenize}},
      {{"POST", "/v1/completions"}, {false, &Impl::post_completions}},
      {{"POST", "/v1/chat/completions"}, {false, &Impl::post_chat}},
      {{"POST", "/v1/messages"}, {false, &Impl::post_messages}},
      {{"POST", "/v1/messages/count_tokens"}, {false, &Impl::post_count_tokens}},
      {{"POST", "/v1/responses"}, {false, &Impl::post_responses}},
      {{"POST", "/v1/embeddings"}, {false, &Impl::post_embeddings}},
      {{"POST", "/embeddings"}, {false, &Impl::post_embeddings}},
      {{"POST", "/v1/rerank"}, {false, &Impl::post_rerank}},
      {{"POST", "/rerank"}, {false, &Impl::post_rerank}},
      {{"POST", "/v2/rerank"}, {false, &Impl::post_rerank}},
      {{"POST", "/score"}, {false, &Impl::post_score}},
      {{"POST", "/v1/score"}, {false, &Impl::post_score}},
  };
}

http::Headers HttpServer::Impl::common_headers() const {
  if (!cfg.cors) return {};
  return {{"Access-Control-Allow-Origin", "*"},
          {"Access-Control-Allow-Headers", "Authorization, Content-Type, X-Api-Key, Anthropic-Version"},
          {"Access-Control-Allow-Methods", "GET, POST, OPTIONS"}};
}

void HttpServer::Impl::reply(const Exchange& ex, http::Response r) const {
  for (auto& h : common_headers()) r.headers.push_back(std::move(h));
  ex->respond(std::move(r));
}

template <typename F>
void HttpServer::Impl::guarded(const http::Request& req, const Exchange& ex, F&& fn) const {
  try {
    fn();
  } catch (const ApiError& e) {
    reply(ex, error_for(req, e));
  } catch (const Error& e) {
    reply(ex, error_for(req, ApiError{400, e.what()}));
  } catch (const std::exception& e) {
    reply(ex, error_for(req, ApiError{500, std::string("internal error: ") + e.what(), "internal_server_error"}));
  }
}

std::optional<http::Response> HttpServer::Impl::preflight(const http::Request& req) const {
  if (!cfg.cors || req.method != "OPTIONS") return std::nullopt;
  return http::Response{204, "", "", {}};
}

std::optional<http::Response> HttpServer::Impl::authenticate(const http::Request& req) const {
  static const std::set<std::string> open_paths = {"/health", "/", "/metrics", "/openapi.json"};
  if (cfg.api_key.empty() || open_paths.count(req.path) || req.header("Authorization") == "Bearer " + cfg.api_key ||
      req.header("X-Api-Key") == cfg.api_key)  // Anthropic's clients send the key this way
    return std::nullopt;
  return error_for(req, ApiError{401, "Invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                 "authentication_error"});
}

static bool is_api_path(const std::string& path) {
  return path.rfind("/v1/", 0) == 0 || path.rfind("/v2/", 0) == 0 || path == "/tokenize" || path == "/detokenize" ||
         path.rfind("/engine/", 0) == 0 || path == "/reset_prefix_cache" || path == "/embeddings" || path == "/rerank" ||
         path == "/score";
}

// The routes only a generating (decoder) model serves, and those only an encoder serves.
static bool is_generation_path(const std::string& path) {
  static const std::set<std::string> paths = {"/v1/completions", "/v1/chat/completions", "/v1/messages",
                                              "/v1/messages/count_tokens", "/v1/responses", "/engine/state",
                                              "/engine/blocks", "/reset_prefix_cache", "/v1/load_lora_adapter",
                                              "/v1/unload_lora_adapter"};
  return paths.count(path) > 0 || path.rfind("/v1/responses/", 0) == 0;
}
static bool is_pooling_path(const std::string& path) {
  static const std::set<std::string> paths = {"/v1/embeddings", "/embeddings", "/v1/rerank", "/rerank", "/v2/rerank",
                                              "/score", "/v1/score"};
  return paths.count(path) > 0;
}

std::optional<http::Response> HttpServer::Impl::route_fits_model(const http::Request& req) const {
  if (embedder && is_generation_path(req.path))
    return error_for(req, ApiError{400, fmt::format("The model '{}' is an embedding model: it serves /v1/embeddings{}, "
                                                    "not text generation", model_name,
                                                    embedder->model().config().n_classes > 0 ? ", /v1/rerank and /score" : ""),
                                   "invalid_request_error"});
  const bool embeddings_path = req.path == "/v1/embeddings" || req.path == "/embeddings";
  const bool decoder_serves = embeddings_path ? cfg.decoder_embeddings : cfg.decoder_rerank;
  if (!embedder && is_pooling_path(req.path) && !decoder_serves)
    return error_for(req, ApiError{400, fmt::format("The model '{}' generates text; {} need an encoder model (serve "
                                                    "all-MiniLM-L6-v2 or a cross-encoder){}", model_name,
                                                    embeddings_path ? "embeddings" : "rerank and score",
                                                    embeddings_path ? ", or this one with --embeddings for last-token embeddings"
                                                                    : ", or a decoder reranker with --reranking"),
                                   "invalid_request_error"});
  return std::nullopt;
}

std::optional<http::Response> HttpServer::Impl::require_model(const http::Request& req) const {
  if (!is_api_path(req.path) || ready) return std::nullopt;
  return error_for(req, ApiError{503, "The model is still loading", "service_unavailable"});
}

std::optional<http::Response> HttpServer::Impl::refuse_while_draining(const http::Request& req) const {
  if (!is_api_path(req.path) || req.method != "POST" || !draining) return std::nullopt;
  http::Response r = error_for(req, ApiError{503, "The server is shutting down", "service_unavailable"});
  r.headers.emplace_back("Retry-After", "5");
  return r;
}

// Runs on an I/O thread for every request.
void HttpServer::Impl::handle(http::Request& req, Exchange ex) {
  static constexpr Filter filters[] = {&Impl::preflight, &Impl::authenticate, &Impl::require_model,
                                       &Impl::route_fits_model, &Impl::refuse_while_draining};
  for (Filter f : filters)
    if (auto r = (this->*f)(req)) return reply(ex, std::move(*r));
  if (req.method == "GET" && req.path.rfind("/v1/responses/", 0) == 0)  // the one route with an id in its path
    return guarded(req, ex, [&] { get_response(req, ex); });
  const auto it = routes.find({req.method, req.path});
  if (it == routes.end()) {
    const bool known_path = std::any_of(routes.begin(), routes.end(), [&](auto& r) { return r.first.second == req.path; });
    return reply(ex, error_for(req, known_path ? ApiError{405, fmt::format("{} is not allowed on {}", req.method, req.path)}
                                               : ApiError{404, "Not found", "NotFoundError"}));
  }
  const Route route = it->second;
  if (route.inline_on_io) return guarded(req, ex, [&] { (this->*route.fn)(req, ex); });
  net::post(api_pool, [this, route, req = std::move(req), ex]() mutable {
    guarded(req, ex, [&] { (this->*route.fn)(req, ex); });
  });
}

void HttpServer::Impl::get_health(http::Request&, Exchange ex) {
  const char* status = !ready ? "loading" : draining ? "draining" : "ok";
  reply(ex, json_response(std::string(status) == "ok" ? 200 : 503, json{{"status", status}}));
}

void HttpServer::Impl::get_page(http::Request&, Exchange ex) {
  reply(ex, http::Response{200, "text/html; charset=utf-8", web_page_html(), {}});
}

void HttpServer::Impl::get_openapi(http::Request&, Exchange ex) {
  reply(ex, http::Response{200, "application/json", openapi_json(), {}});
}

void HttpServer::Impl::get_metrics(http::Request&, Exchange ex) {
  const EngineStats s = ready && loop ? loop->stats_snapshot() : EngineStats{};
  std::string text = metrics.render(s, model_name);
  if (cfg.metrics_names == "vllm") text += vllm_aliases(text);
  reply(ex, http::Response{200, "text/plain; version=0.0.4", text, {}});
}

void HttpServer::Impl::get_models(http::Request&, Exchange ex) {
  json data = json::array({json{{"id", model_name}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "serval"},
                                {"max_model_len", api.max_model_len}}});
  for (const auto& a : *api.adapters.get())  // vLLM lists each adapter with the base model as its parent
    if (!a.name.empty())
      data.push_back({{"id", a.name}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "serval"},
                      {"root", a.path}, {"parent", model_name}, {"max_model_len", api.max_model_len}});
  reply(ex, json_response(200, json{{"object", "list"}, {"data", std::move(data)}}));
}

// llama-server's list of the loaded adapters (requests pick one with `lora: [{"id", "scale"}]`).
void HttpServer::Impl::get_lora_adapters(http::Request&, Exchange ex) {
  json list = json::array();
  const auto adapters = api.adapters.get();
  for (size_t i = 0; i < adapters->size(); ++i)
    if (const auto& a = (*adapters)[i]; !a.name.empty())
      list.push_back({{"id", i}, {"name", a.name}, {"path", a.path}, {"scale", a.scale}, {"rank", a.rank}});
  reply(ex, json_response(200, list));
}

// vLLM's runtime adapter updates: plain-text replies, as vLLM's.
static const char* kRuntimeLoraOff =
    "Runtime LoRA updates are off: start the server with --allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)";

void HttpServer::Impl::post_load_lora(http::Request& req, Exchange ex) {
  if (!lora_admin) throw ApiError{404, kRuntimeLoraOff, "NotFoundError"};
  reply(ex, http::Response{200, "text/plain; charset=utf-8", lora_admin->load(parse_json_body(req.body)), {}});
}

void HttpServer::Impl::post_unload_lora(http::Request& req, Exchange ex) {
  if (!lora_admin) throw ApiError{404, kRuntimeLoraOff, "NotFoundError"};
  reply(ex, http::Response{200, "text/plain; charset=utf-8", lora_admin->unload(parse_json_body(req.body)), {}});
}

void HttpServer::Impl::get_engine_state(http::Request&, Exchange ex) { reply(ex, json_response(200, engine_state())); }

void HttpServer::Impl::post_tokenize(http::Request& req, Exchange ex) {
  const std::vector<int32_t> ids = parse_tokenize_request(parse_json_body(req.body), api);
  reply(ex, json_response(200, json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", api.max_model_len}}));
}

void HttpServer::Impl::post_detokenize(http::Request& req, Exchange ex) {
  const std::vector<int32_t> ids = parse_detokenize_request(parse_json_body(req.body), api);
  reply(ex, json_response(200, json{{"prompt", api.tokenizer->decode(ids)}}));
}

// Runs on an API thread: validate, submit, then the run goes on by itself on the I/O threads.
void HttpServer::Impl::generate(http::Request& req, Exchange ex, bool chat) {
  const json body = parse_json_body(req.body);
  check_model_name(body, api);
  start_run(req, std::move(ex), parse_generation_request(body, chat, api));
}

// Anthropic's Messages API: the body as the chat request it means, answered in Anthropic's shapes.
void HttpServer::Impl::post_messages(http::Request& req, Exchange ex) {
  const json body = messages_to_chat(parse_json_body(req.body));
  check_model_name(body, api);
  GenJob job = parse_generation_request(body, true, api);
  job.messages_api = true;
  start_run(req, std::move(ex), std::move(job));
}

void HttpServer::Impl::post_count_tokens(http::Request& req, Exchange ex) {
  const json body = messages_to_chat(parse_json_body(req.body), /*count_only=*/true);
  check_model_name(body, api);
  const std::string prompt = render_chat(body, api);
  reply(ex, json_response(200, json{{"input_tokens", api.tokenizer->encode(prompt, false, true).size()}}));
}

// OpenAI's Responses API: the body as the chat request it means (with previous_response_id's
// conversation before it), answered as a response object and stored unless `store` is false.
void HttpServer::Impl::post_responses(http::Request& req, Exchange ex) {
  ResponsesJob rj = responses_to_chat(parse_json_body(req.body), responses);
  check_model_name(rj.chat, api);
  GenJob job = parse_generation_request(rj.chat, true, api);
  job.responses_api = true;
  job.store_response = rj.store;
  job.responses_echo = std::move(rj.echo);
  job.conversation = std::move(rj.conversation);
  start_run(req, std::move(ex), std::move(job));
}

void HttpServer::Impl::post_embeddings(http::Request& req, Exchange ex) {
  EmbeddingJob job = parse_embeddings_request(parse_json_body(req.body), target, api);
  auto vectors = embedder ? embedder->embed(std::move(job.inputs), pooling)
                         : embed_with_engine(std::move(job.inputs), cfg.decoder_mean_pooling);
  reply(ex, json_response(200, embeddings_response(job, std::move(vectors), model_name)));
}

void HttpServer::Impl::post_rerank(http::Request& req, Exchange ex) {
  RerankJob job = parse_rerank_request(parse_json_body(req.body), target, api);
  reply(ex, json_response(200, rerank_response(job, classify(std::move(job.inputs)), model_name)));
}

void HttpServer::Impl::post_score(http::Request& req, Exchange ex) {
  RerankJob job = parse_score_request(parse_json_body(req.body), target, api);
  reply(ex, json_response(200, score_response(job, classify(std::move(job.inputs)), model_name)));
}

// A cross-encoder's logits, or a decoder reranker's from the last prompt token's hidden state.
std::vector<float> HttpServer::Impl::classify(std::vector<EncoderInput> inputs) {
  if (embedder) return embedder->classify(std::move(inputs));
  std::vector<float> logits;
  for (const auto& h : embed_with_engine(std::move(inputs), /*mean=*/false)) logits.push_back(scorer.logit(h));
  return logits;
}

// A decoder as an embedder: each input a prefill-only request in the engine's continuous batch (beside
// the generating ones); its final event carries the last prompt token's hidden state, or the mean of
// all of them (`mean`).
std::vector<std::vector<float>> HttpServer::Impl::embed_with_engine(std::vector<EncoderInput> inputs, bool mean) {
  const int64_t waiting = loop->waiting();
  if (waiting >= cfg.max_waiting)
    throw ApiError{429, fmt::format("The server is busy ({} requests waiting); retry later", waiting), "rate_limit_exceeded"};
  auto stream = std::make_shared<TokenStream>();
  std::map<RequestId, size_t> index;
  GenerationParams params;
  params.embed = true;
  params.embed_mean = mean;
  params.max_tokens = 1;
  params.draft_max = 0;
  try {
    for (size_t i = 0; i < inputs.size(); ++i) index[loop->submit_into(std::move(inputs[i].tokens), params, stream)] = i;
  } catch (...) {  // the engine refused one: the others go too
    for (const auto& [id, i] : index) loop->abort(id);
    throw;
  }
  std::vector<std::vector<float>> out(index.size());
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(int64_t(cfg.request_timeout_s * 1000));
  for (size_t done = 0; done < index.size();) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    std::optional<TokenEvent> ev = left.count() > 0 ? stream->next(left) : std::nullopt;
    if (!ev) {
      for (const auto& [id, i] : index) loop->abort(id);
      throw ApiError{504, "The embedding request timed out", "timeout"};
    }
    if (!ev->finished) continue;
    if (ev->embedding.empty()) {
      for (const auto& [id, i] : index) loop->abort(id);
      throw ApiError{500, ev->error.empty() ? "An embedding request was aborted" : ev->error, "internal_server_error"};
    }
    out[index.at(ev->id)] = std::move(ev->embedding);
    ++done;
  }
  return out;
}

void HttpServer::Impl::get_response(const http::Request& req, Exchange ex) {
  const std::string id = req.path.substr(std::string("/v1/responses/").size());
  const auto entry = responses.get(id);
  if (!entry)
    throw ApiError{404, fmt::format("No response '{}' is stored (the store keeps the newest {})", id, responses.capacity()),
                   "invalid_request_error", "response_id", "not_found"};
  reply(ex, json_response(200, entry->response));
}

// Submits a validated job (429 when too many are waiting); the run then goes on by itself.
void HttpServer::Impl::start_run(const http::Request& req, Exchange ex, GenJob job) {
  const int64_t waiting = loop->waiting();
  if (waiting >= cfg.max_waiting) {
    http::Response r = error_for(req, 
        ApiError{429, fmt::format("The server is busy ({} requests waiting); retry later", waiting), "rate_limit_exceeded"});
    r.headers.emplace_back("Retry-After", "1");
    return reply(ex, std::move(r));
  }
  RunContext ctx;
  ctx.model = model.load();
  ctx.loop = loop;
  ctx.metrics = &metrics;
  ctx.model_name = model_name;
  ctx.timeout = std::chrono::milliseconds(int64_t(cfg.request_timeout_s * 1000));
  ctx.extra_headers = common_headers();
  ctx.on_finished = [this] { --in_flight; };
  ctx.responses = &responses;
  auto run = std::make_shared<CompletionRun>(std::move(ctx), std::move(job), ex, transport->executor());
  ++in_flight;
  if (draining) {  // drain_and_stop may have seen in_flight == 0 already: refuse rather than start late
    --in_flight;
    return reply(ex, *refuse_while_draining(req));
  }
  try {
    run->start();
  } catch (...) {
    --in_flight;
    throw;
  }
}

// The prefix-cache index of the first KV group (the one KV events describe): every cached block's
// chain hash, and the block holding it.
void HttpServer::Impl::get_engine_blocks(http::Request&, Exchange ex) {
  json j;
  loop->run_on_engine([&](Engine& e) {
    const auto& pool = e.kv_manager().pool(0);
    json blocks = json::array();
    for (int32_t b = 0; b < pool.n_blocks(); ++b)
      if (const auto h = pool.hash_of(b)) blocks.push_back({{"block", b}, {"hash", *h}, {"ref_count", pool.ref_count(b)}});
    j = json{{"block_size", e.capacity().block_size}, {"num_blocks", pool.n_blocks()}, {"cached", std::move(blocks)}};
  });
  reply(ex, json_response(200, j));
}

// vLLM's endpoint: drops the cached prefixes no request holds.
void HttpServer::Impl::post_reset_prefix_cache(http::Request&, Exchange ex) {
  loop->run_on_engine([](Engine& e) { e.reset_prefix_cache(); });
  reply(ex, json_response(200, json{{"status", "ok"}}));
}

json HttpServer::Impl::engine_state() {
  json j;
  loop->run_on_engine([&](Engine& e) {
    const EngineStats s = e.stats();
    std::string blocks;
    const auto& kv = e.kv_manager();
    for (int g = 0; g < kv.n_groups(); ++g) {
      const auto& pool = kv.pool(g);
      for (int32_t b = 0; b < pool.n_blocks() && blocks.size() < 16384; ++b) {
        const int32_t rc = pool.ref_count(b);
        blocks += rc > 1 ? 's' : rc == 1 ? 'u' : pool.hash_of(b) ? 'c' : 'f';
      }
    }
    json running = json::array(), waiting = json::array();
    for (const Request* r : e.scheduler().running())
      running.push_back({{"id", r->id}, {"prompt", r->n_prompt}, {"generated", r->num_output_tokens()},
                         {"computed", r->num_computed_tokens}});
    for (const Request* r : e.scheduler().waiting())
      waiting.push_back({{"id", r->id}, {"prompt", r->n_prompt}, {"generated", r->num_output_tokens()},
                         {"preempted", r->n_preemptions > 0}});
    j = json{{"running", running}, {"waiting", waiting}, {"kv_usage", s.kv_usage}, {"blocks", blocks},
             {"block_size", e.capacity().block_size}, {"prefix_queries", s.prefix_queries}, {"prefix_hits", s.prefix_hits},
             {"preemptions", s.preemptions}, {"generation_tokens", s.generation_tokens},
             {"spec", {{"method", e.spec_name()}, {"drafts", s.spec.drafts},
                       {"draft_tokens", s.spec.draft_tokens}, {"accepted_tokens", s.spec.accepted_tokens}}}};
  });
  j["latency"] = json::parse(metrics.recent_json());
  j["model"] = model_name;
  return j;
}

HttpServer::HttpServer(ServerConfig config) : impl_(std::make_unique<Impl>(config)), config_(std::move(config)) {
  http::TransportConfig t;
  t.host = config_.host;
  t.port = config_.port;
  t.io_threads = config_.io_threads;
  t.reuse_port = config_.reuse_port;
  t.max_body_bytes = config_.max_body_bytes;
  t.keep_alive_timeout_s = config_.keep_alive_timeout_s;
  t.header_timeout_s = config_.header_timeout_s;
  t.body_timeout_s = config_.body_timeout_s;
  t.ssl_certfile = config_.ssl_certfile;
  t.ssl_keyfile = config_.ssl_keyfile;
  Impl* impl = impl_.get();
  impl_->transport = std::make_unique<http::Transport>(
      t, [impl](http::Request& req, std::shared_ptr<http::Exchange> ex) { impl->handle(req, std::move(ex)); },
      &transport_error);
}

HttpServer::~HttpServer() {
  impl_->transport->stop();
  impl_->api_pool.join();
}

void HttpServer::start() {
  bound_port_ = impl_->transport->listen();
  impl_->transport->run();
}

size_t HttpServer::peak_connections() const { return impl_->transport->peak_connections(); }

void HttpServer::attach(Model& model, EngineLoop& loop) {
  impl_->loop = &loop;
  ApiContext& api = impl_->api;
  api.tokenizer = &model.tokenizer();
  api.model_name = impl_->model_name;
  api.trust_request_chat_template = config_.trust_request_chat_template;
  api.reasoning = config_.reasoning;
  std::vector<AdapterList::Adapter> adapters;
  for (const auto& a : model.adapters()) adapters.push_back({a->name, a->path, a->scale, a->rank});
  api.adapters.set(std::move(adapters));
  if (config_.runtime_lora)
    impl_->lora_admin = std::make_unique<LoraAdmin>(model, loop, api.adapters, impl_->model_name, config_.max_loras);
  loop.run_on_engine([&](Engine& e) { api.max_model_len = e.max_model_len(); });
  const std::string source = config_.chat_template.empty() ? model.tokenizer().vocab().chat_template : config_.chat_template;
  api.tool_format = tool_format_for_template(source);
  if (!source.empty()) {
    try {
      impl_->chat_template = std::make_unique<jinja::Template>(source);
    } catch (const Error& e) {
      api.chat_template_error = e.what();
    }
  }
  api.chat_template = impl_->chat_template.get();
  impl_->attach_decoder_pooling(model);
  impl_->model.store(&model);
  impl_->ready = true;  // publishes everything above
}

// A decoder as an embedder (--embeddings: last-token pooling) or a reranker (--reranking).
void HttpServer::Impl::attach_decoder_pooling(const Model& model) {
  PoolingTarget& t = target;
  t.max_tokens = api.max_model_len - 1, t.n_vocab = model.config().n_vocab, t.n_embd = model.config().n_embd;
  const Tokenizer& tok = model.tokenizer();
  auto encode = [&tok](const std::string& s) {
    EncoderInput in;
    in.tokens = tok.encode(s, /*add_special=*/true, /*parse_special=*/true);
    in.types.assign(in.tokens.size(), 0);
    return in;
  };
  t.tokenize = encode;
  if (!cfg.decoder_rerank) return;
  const std::string tmpl = rerank_template_for(model, cfg.rerank_template);
  t.n_classes = 1;
  t.tokenize_pair = [encode, tmpl](const std::string& q, const std::string& d) { return encode(rerank_prompt(tmpl, q, d)); };
  scorer = decoder_scorer(model, cfg.classifier_tokens);
}

void HttpServer::attach_encoder(const EncoderModel& model, std::optional<int> pooling) {
  impl_->pooling = pooling ? Pooling(*pooling) : model.config().pooling == Pooling::Rank ? Pooling::Cls : model.config().pooling;
  ApiContext& api = impl_->api;
  api.tokenizer = &model.tokenizer();
  api.model_name = impl_->model_name;
  api.max_model_len = model.config().n_pos;
  impl_->embedder = std::make_unique<EmbeddingService>(model);
  impl_->target = pooling_target(model);
  impl_->ready = true;  // publishes everything above
}

void HttpServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->stop_mu);
  impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

void HttpServer::drain_and_stop() {
  impl_->draining = true;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(int64_t(config_.drain_timeout_s * 1000));
  while (impl_->in_flight > 0 && SteadyClock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (impl_->loop) {
    impl_->loop->run_on_engine([](Engine& e) { e.abort_all(); });  // what is left gets its final event
  }
  const auto grace = SteadyClock::now() + std::chrono::seconds(5);
  while (impl_->in_flight > 0 && SteadyClock::now() < grace) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the last bytes reach their clients
  impl_->transport->stop();
  impl_->api_pool.join();  // nothing new reaches it now; what it runs finishes before the engine goes
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  impl_->stopped = true;
  impl_->stop_cv.notify_all();
}

}  // namespace serval
