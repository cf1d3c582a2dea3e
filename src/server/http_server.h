// The OpenAI-compatible HTTP server: talks only to the EngineLoop (or, for an encoder model, to its
// EmbeddingService). Completions and chat completions (streaming over SSE or not), embeddings,
// rerank and score, models, tokenize/detokenize, health, Prometheus metrics,
// limits (queue, body size, context, timeout), API key, CORS, a web page, graceful drain.
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_loop.h"
#include "server/metrics.h"
#include "server/reasoning.h"

namespace serval {

namespace jinja {
class Template;
}
class EncoderModel;

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;                 // empty: no authentication
  bool cors = false;                   // allow cross-origin requests (any origin)
  size_t max_body_bytes = 4u << 20;    // larger bodies get 413
  int max_waiting = 256;               // more queued requests get 429
  double request_timeout_s = 600;      // a request running longer is aborted
  double drain_timeout_s = 30;         // on SIGTERM, in-flight requests get this long to finish
  std::string served_model_name;       // the `model` clients send (default: the file's name)
  std::string chat_template;           // overrides the model's template (Jinja source)
  bool trust_request_chat_template = false;  // accept `chat_template` in request bodies
  int io_threads = 2;                  // event loop threads (all connections)
  int api_threads = 4;                 // request parsing, tokenizing, submitting to the engine
  bool reuse_port = false;             // SO_REUSEPORT (several servers on one port): only when asked
  double keep_alive_timeout_s = 5;     // idle keep-alive connections are closed after this
  double header_timeout_s = 10;        // slow headers (slowloris) are cut off after this
  double body_timeout_s = 60;          // slow bodies likewise
  std::string ssl_certfile, ssl_keyfile;  // both set: serve HTTPS
  // Metric names in /metrics: "serval" (serval:...) or "vllm" (the same metrics also under vLLM's
  // vllm:... names, for routers and gateways that read those).
  std::string metrics_names = "serval";
  ReasoningFormat reasoning = ReasoningFormat::None;  // --reasoning-parser: split the thinking in chat replies
  size_t responses_store = 256;  // Responses API: responses kept for previous_response_id (oldest dropped)
  bool decoder_embeddings = false;  // a generating model also serves /v1/embeddings (last-token pooling)
  bool decoder_mean_pooling = false;  // ... with mean pooling instead (--pooling mean)
  // A generating model also serves /v1/rerank and /score (a decoder reranker): the prompt template
  // (empty: the GGUF's tokenizer.chat_template.rerank, else kDefaultRerankTemplate) and the tokens
  // whose logits score it ([false, true], or one token).
  bool decoder_rerank = false;
  std::string rerank_template;
  std::vector<std::string> classifier_tokens = {"no", "yes"};
  bool runtime_lora = false;  // vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter are on
  size_t max_loras = 64;      // LoRA adapters loaded at once (startup and run time together)
};

class HttpServer {
 public:
  explicit HttpServer(ServerConfig config);
  ~HttpServer();

  // Starts listening (GET /health answers 503 until attach()); throws Error if the port is taken.
  void start();
  // Serves `loop`'s engine from now on. The model's LoRA adapters change only through the loop's
  // engine thread (runtime loading, ServerConfig::runtime_lora).
  void attach(Model& model, EngineLoop& loop);
  // Serves an encoder model from now on: /v1/embeddings, and /v1/rerank and /score when it is a
  // cross-encoder; the generation routes answer 400.
  // `pooling` overrides the model's (--pooling).
  void attach_encoder(const EncoderModel& model, std::optional<int> pooling = std::nullopt);
  // Blocks until stop() (called from a signal watcher or another thread).
  void wait();
  // Graceful: refuse new requests, let in-flight ones finish (up to the drain timeout), then close.
  void drain_and_stop();
  int port() const { return bound_port_; }
  size_t peak_connections() const;
  const ServerConfig& config() const { return config_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ServerConfig config_;
  int bound_port_ = 0;
};

}  // namespace serval
