// `serval serve MODEL`: the OpenAI-compatible server. SIGTERM / SIGINT drain gracefully and exit 0.
#include <cstdlib>
#include <fmt/core.h>
#include <signal.h>

#include <filesystem>
#include <sstream>
#include <thread>

#include "apps/commands.h"
#include "apps/engine_flags.h"
#include "apps/lora_flags.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "base/file_util.h"
#include "engine/engine_loop.h"
#include "model/encoder.h"
#include "server/http_server.h"
#include "server/kv_events.h"

namespace serval::cli {
namespace {

struct ServeOptions {
  std::string model, chat_template_file;
  ServerConfig server;
  EngineFlags engine{"0.25"};
  int threads = 0;
  ParallelFlags parallel;  // --tp / --pp under mpirun
  KvEventsConfig kv_events;
  std::string kv_events_config;  // vLLM's --kv-events-config JSON
  std::string pooling;           // --pooling: /v1/embeddings pooling (default: the model's; a decoder's last)
  std::string task, runner;      // vLLM's --task / --runner, checked against the model
  LoraFlags lora;
  bool embeddings = false, reranking = false;  // llama-server's --embeddings / --reranking
  std::string rerank_template_file;
};

// vLLM's --task / --runner and llama-server's --embeddings / --reranking name what the server is for;
// an encoder serves the pooling APIs, a decoder generates (and may also embed and rerank). A flag that
// asks for what the model cannot serve is refused at startup.
void check_model_role(const ServeOptions& o, bool encoder, const std::string& path) {
  const bool generate_asked = o.runner == "generate" || o.task == "generate";
  check(!(encoder && generate_asked), "{}: an encoder (embedding) model cannot generate text (--task/--runner generate)", path);
  check(encoder || (o.task != "classify" && o.task != "reward"),
        "{}: --task {} needs a classification model; a decoder serves rerank and score as a yes/no reranker "
        "(--reranking or --task score)", path, o.task);
}

// An encoder model: the pooling APIs only (no engine, no KV cache).
void serve_encoder(ServeOptions& o, HttpServer& server, const std::string& path, std::unique_ptr<EncoderModel>& encoder) {
  encoder = EncoderModel::load(path);
  const auto& c = encoder->config();
  std::optional<int> pooling;
  if (!o.pooling.empty()) pooling = int(pooling_from_name(o.pooling));
  check(!o.reranking || c.n_classes > 0, "{}: --reranking needs a cross-encoder (a model with a classification head)", path);
  server.attach_encoder(*encoder, pooling);
  fmt::print(stderr, "serval: encoder {} ({} layers, {} dimensions, {} positions, {} pooling{})\n", c.arch, c.n_layer,
             c.n_embd, c.n_pos, pooling_name(pooling ? Pooling(*pooling) : c.pooling),
             c.n_classes > 0 ? ", cross-encoder: /v1/rerank and /score" : "");
}

// Publishes the engine's KV cache events when asked to (null otherwise).
std::unique_ptr<KvEventPublisher> start_kv_events(ServeOptions& o, Engine& engine) {
  if (!o.kv_events_config.empty()) parse_kv_events_config(o.kv_events_config, o.kv_events);
  if (!o.kv_events.enabled()) return nullptr;
  check(o.engine.config().prefix_caching, "KV events need prefix caching (drop --no-prefix-caching)");
  o.kv_events.block_size = engine.capacity().block_size;
  auto publisher = std::make_unique<KvEventPublisher>(o.kv_events);
  engine.set_kv_event_sink([p = publisher.get()](std::vector<KvEvent> events) { p->publish(std::move(events)); });
  fmt::print(stderr, "serval: KV cache events on {} ({} encoding{})\n", o.kv_events.endpoint, o.kv_events.encoding,
             o.kv_events.replay_endpoint.empty() ? "" : ", replays on " + o.kv_events.replay_endpoint);
  return publisher;
}

// Serves until SIGTERM / SIGINT (then drains) or until the server stops by itself.
void wait_for_signal(const ServeOptions& o, HttpServer& server, sigset_t signals) {
  std::thread watcher([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    fmt::print(stderr, "serval: signal {}: draining (up to {} s)\n", sig, o.server.drain_timeout_s);
    server.drain_and_stop();
  });
  server.wait();
  // If the server stopped for another reason, wake the watcher.
  pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  fmt::print(stderr, "serval: stopped (at most {} connections were open at once)\n", server.peak_connections());
}

void run_serve(ServeOptions& o) {
  // Signals go to one watcher thread: block them before any other thread exists.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  set_threads(o.threads);
  const std::string path = resolve_model_path(o.model);
  // A rank > 0 of a split model serves rank 0's steps inside load() and never gets further (it must
  // not bind the port); only rank 0 serves HTTP.
  if (o.parallel.worker_rank()) o.parallel.load(path);
  if (o.server.served_model_name.empty()) {  // a cached name as given; a file without its .gguf
    std::string name = std::filesystem::path(o.model).filename().string();
    if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
    o.server.served_model_name = name.empty() ? o.model : name;
  }
  if (!o.chat_template_file.empty()) {
    o.server.chat_template = read_text_file(o.chat_template_file);
  }
  const char* scheme = o.server.ssl_certfile.empty() ? "http" : "https";
  const bool encoder_model = EncoderModel::is_encoder(path);
  check_model_role(o, encoder_model, path);
  o.server.decoder_embeddings = !encoder_model && (o.embeddings || o.runner == "pooling" || o.task == "embed" ||
                                                   o.task == "embedding");
  if (const char* env = std::getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING"))
    o.server.runtime_lora |= std::string(env) == "True" || std::string(env) == "true" || std::string(env) == "1";
  o.server.decoder_rerank = !encoder_model && (o.reranking || o.task == "score");
  check(encoder_model || o.pooling.empty() || o.pooling == "mean" || o.pooling == "last",
        "{}: a decoder pools its embeddings by the last token or the mean (--pooling last|mean), not '{}'", path, o.pooling);
  o.server.decoder_mean_pooling = !encoder_model && o.pooling == "mean";
  if (!o.rerank_template_file.empty()) o.server.rerank_template = read_text_file(o.rerank_template_file);
  std::unique_ptr<EncoderModel> encoder;  // outlives the server, whose embedding worker reads it
  HttpServer server(o.server);
  server.start();  // /health answers 503 while the model loads
  fmt::print(stderr, "serval: listening on {}://{}:{} (loading {})\n", scheme, o.server.host, server.port(), path);
  if (encoder_model) {
    serve_encoder(o, server, path, encoder);
    fmt::print(stderr,
               "serval: ready: {}://{}:{} serves '{}' — try\n  curl {}://{}:{}/v1/embeddings -H 'Content-Type: "
               "application/json' -d '{{\"input\": \"Hello!\"}}'\n",
               scheme, o.server.host, server.port(), o.server.served_model_name, scheme, o.server.host, server.port());
    return wait_for_signal(o, server, signals);
  }
  auto model = o.parallel.load(path);
  o.engine.spec.load_heads(*model);
  if (const size_t n = o.lora.load(*model); n > 0) {
    check(n <= o.server.max_loras, "{} LoRA adapters given, more than --max-loras {}", n, o.server.max_loras);
    fmt::print(stderr, "serval: {} LoRA adapter{} (requests choose one by its name as `model`, or by `lora`)\n", n,
               n == 1 ? "" : "s");
  }
  if (o.engine.max_model_len > 0)  // LongRoPE picks its factors by the context in use
    model->set_context_length(std::min(o.engine.max_model_len, model->config().n_ctx_train));
  Engine engine(*model, o.engine.config());
  fmt::print(stderr, "serval: {}\n", engine.capacity().describe(engine.max_model_len()));
  fmt::print(stderr, "serval: scheduling: at most {} running requests, {} tokens per step\n", o.engine.max_seqs,
             o.engine.max_batched_tokens);
  const auto kv_events = start_kv_events(o, engine);  // outlives the loop, which feeds it
  EngineLoop loop(engine);
  server.attach(*model, loop);
  const std::string url = fmt::format("{}://{}:{}", scheme, o.server.host, server.port());
  fmt::print(stderr,
             "serval: ready: {} serves '{}' — open {}/ in a browser, or try\n"
             "  curl {}/v1/chat/completions -H 'Content-Type: application/json' -d "
             "'{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n",
             url, o.server.served_model_name, url, url, o.server.served_model_name);
  wait_for_signal(o, server, signals);
  loop.stop();
}

void add_kv_events_flags(CLI::App* cmd, ServeOptions& o) {
  auto& k = o.kv_events;
  cmd->add_option("--kv-events-endpoint", k.endpoint,
                  "publish KV cache events (vLLM's schema, msgpack over ZeroMQ PUB) here, e.g. tcp://*:5557");
  cmd->add_option("--kv-events-replay-endpoint", k.replay_endpoint, "ZeroMQ ROUTER address that replays recent event batches");
  cmd->add_option("--kv-events-topic", k.topic, "topic frame of every event message (default empty)");
  cmd->add_option("--kv-events-encoding", k.encoding, "array (default: vLLM up to 0.11, llm-d, Dynamo) or map (current vLLM)")
      ->check(CLI::IsMember({"array", "map"}));
  cmd->add_option("--kv-events-config", o.kv_events_config,
                  "vLLM's JSON form: {\"enable_kv_cache_events\": true, \"endpoint\": ..., \"replay_endpoint\": ..., \"topic\": ...}");
}

}  // namespace

void add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with a web page at /");
  auto o = std::make_shared<ServeOptions>();
  auto& s = o->server;
  cmd->add_option("model,-m,--model", o->model, "GGUF file, safetensors directory or cached model name")->required();
  cmd->add_option("--host", s.host, "address to bind (default 127.0.0.1)");
  cmd->add_option("--port", s.port, "port (default 8080; 0 picks a free one)");
  cmd->add_option("--api-key", s.api_key, "require 'Authorization: Bearer KEY'");
  cmd->add_flag("--cors", s.cors, "allow cross-origin requests");
  cmd->add_option("--served-model-name", s.served_model_name, "model name clients use (default: the file name)");
  cmd->add_option("--chat-template", o->chat_template_file, "Jinja chat template file (default: the model's)");
  o->engine.add_to(cmd);
  o->engine.add_ctx_size(cmd);
  cmd->add_option("--max-waiting", s.max_waiting, "queued requests before 429 (default 256)");
  cmd->add_option("--max-body-bytes", s.max_body_bytes, "largest request body (default 4 MiB)");
  cmd->add_option("--request-timeout", s.request_timeout_s, "seconds before a request is aborted (default 600)");
  cmd->add_option("--drain-timeout", s.drain_timeout_s, "seconds in-flight requests get on SIGTERM (default 30)");
  cmd->add_option("-t,--threads", o->threads, "compute threads");
  cmd->add_flag("--trust-request-chat-template", s.trust_request_chat_template,
                "accept a `chat_template` in request bodies (off: such requests get 400)");
  cmd->add_option("--ssl-certfile", s.ssl_certfile, "PEM certificate chain: serve HTTPS (with --ssl-keyfile)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--ssl-keyfile", s.ssl_keyfile, "PEM private key for --ssl-certfile")->check(CLI::ExistingFile);
  cmd->add_option("--timeout-keep-alive", s.keep_alive_timeout_s, "seconds an idle keep-alive connection stays open (default 5)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--timeout-header", s.header_timeout_s, "seconds a client gets to send its headers (default 10)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--timeout-body", s.body_timeout_s, "seconds a client gets to send its body (default 60)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--http-threads", s.io_threads, "event-loop threads for all connections (default 2)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--api-threads", s.api_threads, "threads that parse and submit requests (default 4)")
      ->check(CLI::Range(1, 256));
  cmd->add_flag("--reuse-port", s.reuse_port, "bind with SO_REUSEPORT so several servers share the port");
  cmd->add_option("--metrics-names", s.metrics_names, "metric names in /metrics: serval (default) or vllm (also vLLM's vllm:... names, for routers)")
      ->check(CLI::IsMember({"serval", "vllm"}));
  cmd->add_option_function<std::string>(
         "--reasoning-parser,--reasoning-format",
         [&s](const std::string& name) {
           const auto format = reasoning_format_from_name(name);
           if (!format)
             throw CLI::ValidationError("--reasoning-parser", fmt::format("'{}': one of {}", name, reasoning_format_names()));
           s.reasoning = *format;
         },
         "split a reasoning model's <think> section into reasoning_content: deepseek_r1 (the output starts in "
         "the thinking), qwen3 (thinking when the output or the prompt opens <think>), gpt_oss (harmony's "
         "analysis channel); llama.cpp's "
         "--reasoning-format deepseek/auto are qwen3's rule, none (default) leaves it in content");
  cmd->add_option("--responses-store", s.responses_store,
                  "Responses API: responses kept in memory for previous_response_id and GET /v1/responses/ID, the "
                  "oldest dropped first (default 256; 0 keeps none)");
  add_kv_events_flags(cmd, *o);
  o->lora.add_to(cmd);
  cmd->add_flag("--allow-runtime-lora", s.runtime_lora,
                "serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)");
  cmd->add_option("--max-loras", s.max_loras, "LoRA adapters loaded at once, at startup and at run time (default 64)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--pooling", o->pooling,
                  "/v1/embeddings pooling: mean, cls or last (default: the model's; a decoder's: last, or mean)")
      ->check(CLI::IsMember({"mean", "cls", "last"}));
  cmd->add_flag("--embeddings,--embedding", o->embeddings,
                "llama-server's: serve /v1/embeddings (an encoder always does; a decoder then also serves last-token "
                "embeddings, as Qwen3-Embedding pools)");
  cmd->add_flag("--reranking,--rerank", o->reranking,
                "llama-server's: serve /v1/rerank and /score (a cross-encoder, or a decoder reranker such as "
                "Qwen3-Reranker scored by the logits of --classifier-from-token)");
  cmd->add_option("--classifier-from-token", s.classifier_tokens,
                  "a decoder reranker's tokens: FALSE,TRUE (default no,yes: the sigmoid of their logits' "
                  "difference) or one token (the sigmoid of its logit); vLLM's classifier_from_token")
      ->delimiter(',')
      ->expected(1, 2);
  cmd->add_option("--rerank-template", o->rerank_template_file,
                  "a decoder reranker's prompt file with {query} and {document} (default: the GGUF's "
                  "tokenizer.chat_template.rerank, else Qwen3-Reranker's)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--task", o->task, "vLLM's: generate, embed, score, classify, reward or auto (checked against the model)")
      ->check(CLI::IsMember({"auto", "generate", "embed", "embedding", "score", "classify", "reward"}));
  cmd->add_option("--runner", o->runner, "vLLM's: generate, pooling or auto (checked against the model)")
      ->check(CLI::IsMember({"auto", "generate", "pooling"}));
  o->parallel.add_to(cmd);
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace serval::cli
