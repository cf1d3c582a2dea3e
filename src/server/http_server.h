// The OpenAI-compatible HTTP server: talks only to the EngineLoop. Completions and chat
// completions (streaming over SSE or not), models, tokenize/detokenize, health, Prometheus metrics,
// limits (queue, body size, context, timeout), API key, CORS, a web page, graceful drain.
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "engine/engine_loop.h"
#include "server/metrics.h"

namespace httplib {
class Server;
class Request;
class Response;
}  // namespace httplib

namespace serval {

namespace jinja {
class Template;
}

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
  int threads = 64;                    // HTTP worker threads (one per open connection)
};

class HttpServer {
 public:
  explicit HttpServer(ServerConfig config);
  ~HttpServer();

  // Starts listening (GET /health answers 503 until attach()); throws Error if the port is taken.
  void start();
  // Serves `loop`'s engine from now on.
  void attach(const Model& model, EngineLoop& loop);
  // Blocks until stop() (called from a signal watcher or another thread).
  void wait();
  // Graceful: refuse new requests, let in-flight ones finish (up to the drain timeout), then close.
  void drain_and_stop();
  int port() const { return bound_port_; }
  const ServerConfig& config() const { return config_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ServerConfig config_;
  int bound_port_ = 0;
};

}  // namespace serval
