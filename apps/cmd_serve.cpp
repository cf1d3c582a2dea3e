// `serval serve MODEL`: the OpenAI-compatible server. SIGTERM / SIGINT drain gracefully and exit 0.
#include <fmt/core.h>
#include <signal.h>

#include <filesystem>
#include <sstream>
#include <thread>

#include "apps/commands.h"
#include "apps/engine_flags.h"
#include "base/error.h"
#include "base/file_util.h"
#include "engine/engine_loop.h"
#include "server/http_server.h"

namespace serval::cli {
namespace {

struct ServeOptions {
  std::string model, chat_template_file;
  ServerConfig server;
  EngineFlags engine{"0.25"};
  int threads = 0;
};

void run_serve(ServeOptions& o) {
  // Signals go to one watcher thread: block them before any other thread exists.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  set_threads(o.threads);
  const std::string path = resolve_model_path(o.model);
  if (o.server.served_model_name.empty()) {  // a cached name as given; a file without its .gguf
    std::string name = std::filesystem::path(o.model).filename().string();
    if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
    o.server.served_model_name = name.empty() ? o.model : name;
  }
  if (!o.chat_template_file.empty()) {
    o.server.chat_template = read_text_file(o.chat_template_file);
  }
  HttpServer server(o.server);
  server.start();  // /health answers 503 while the model loads
  fmt::print(stderr, "serval: listening on http://{}:{} (loading {})\n", o.server.host, server.port(), path);
  auto model = Model::load(path);
  Engine engine(*model, o.engine.config());
  fmt::print(stderr, "serval: {}\n", engine.capacity().describe(engine.max_model_len()));
  EngineLoop loop(engine);
  server.attach(*model, loop);
  const std::string url = fmt::format("http://{}:{}", o.server.host, server.port());
  fmt::print(stderr,
             "serval: ready: {} serves '{}' — open {}/ in a browser, or try\n"
             "  curl {}/v1/chat/completions -H 'Content-Type: application/json' -d "
             "'{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n",
             url, o.server.served_model_name, url, url, o.server.served_model_name);
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
  loop.stop();
  fmt::print(stderr, "serval: stopped\n");
}

}  // namespace

void add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with a web page at /");
  auto o = std::make_shared<ServeOptions>();
  auto& s = o->server;
  cmd->add_option("model", o->model, "GGUF file, safetensors directory or cached model name")->required();
  cmd->add_option("--host", s.host, "address to bind (default 127.0.0.1)");
  cmd->add_option("--port", s.port, "port (default 8080; 0 picks a free one)");
  cmd->add_option("--api-key", s.api_key, "require 'Authorization: Bearer KEY'");
  cmd->add_flag("--cors", s.cors, "allow cross-origin requests");
  cmd->add_option("--served-model-name", s.served_model_name, "model name clients use (default: the file name)");
  cmd->add_option("--chat-template", o->chat_template_file, "Jinja chat template file (default: the model's)");
  o->engine.add_to(cmd);
  cmd->add_option("--max-waiting", s.max_waiting, "queued requests before 429 (default 256)");
  cmd->add_option("--max-body-bytes", s.max_body_bytes, "largest request body (default 4 MiB)");
  cmd->add_option("--request-timeout", s.request_timeout_s, "seconds before a request is aborted (default 600)");
  cmd->add_option("--drain-timeout", s.drain_timeout_s, "seconds in-flight requests get on SIGTERM (default 30)");
  cmd->add_option("-t,--threads", o->threads, "compute threads");
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace serval::cli
