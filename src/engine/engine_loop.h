// Runs an Engine on its own thread: commands (add, abort) in through a queue, each request's
// tokens out through its TokenStream. Thread-safe; this is what the server talks to.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "engine/engine.h"

namespace serval {

// A request's events, produced by the engine thread and consumed by one reader.
class TokenStream {
 public:
  void push(TokenEvent ev);
  // Next event, waiting at most `timeout`; nullopt on time-out.
  std::optional<TokenEvent> next(std::chrono::milliseconds timeout);
  RequestId id = 0;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
};

class EngineLoop {
 public:
  explicit EngineLoop(Engine& engine);
  ~EngineLoop();  // stops the thread (aborting what is left)

  // Queues a request; throws Error (from the engine's checks) synchronously.
  std::shared_ptr<TokenStream> submit(std::vector<int32_t> prompt, GenerationParams params);
  // Queues a request whose events go to `stream` (shared by several requests); returns its id.
  RequestId submit_into(std::vector<int32_t> prompt, GenerationParams params, std::shared_ptr<TokenStream> stream);
  // Aborts a request (no effect if it has finished).
  void abort(RequestId id);
  // Runs `fn` on the engine thread between steps and waits for it (stats, views).
  void run_on_engine(const std::function<void(Engine&)>& fn);
  EngineStats stats();
  // Requests a step could not schedule, as of the last step (read without waiting for the engine).
  int64_t waiting() const { return waiting_.load(std::memory_order_relaxed); }
  // Stops taking steps after aborting every request (each stream gets its final event).
  void stop();

 private:
  Engine& engine_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  std::atomic<int64_t> waiting_{0};
  bool stopping_ = false;
  bool exited_ = false;
  std::thread thread_;

  void run();
  void run_on_engine_failure(const std::string& message);
  void post(std::function<void()> command);
};

}  // namespace serval
