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
  // Next event if one is queued, without waiting.
  std::optional<TokenEvent> try_next();
  // Called (on the producing thread, outside the stream's lock) after every push: event-driven
  // readers use it to schedule a drain instead of blocking a thread in next(). Set before submitting.
  void set_notify(std::function<void()> notify);
  RequestId id = 0;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  std::function<void()> notify_;
};

class EngineLoop {
 public:
  explicit EngineLoop(Engine& engine);
  ~EngineLoop();  // stops the thread (aborting what is left)

  // Queues a request; throws Error (from the engine's checks) synchronously.
  std::shared_ptr<TokenStream> submit(std::vector<int32_t> prompt, GenerationParams params);
  // Queues a request whose events go to `stream` (shared by several requests); returns its id at once
  // (an abort of it queued later is applied after it). Throws Error for a request the engine refuses.
  RequestId submit_into(std::vector<int32_t> prompt, GenerationParams params, std::shared_ptr<TokenStream> stream);
  // Aborts a request (no effect if it has finished).
  void abort(RequestId id);
  // Runs `fn` on the engine thread between steps and waits for it (stats, views); an exception
  // thrown by `fn` is rethrown here (the engine thread carries on).
  void run_on_engine(const std::function<void(Engine&)>& fn);
  EngineStats stats();
  // The engine's statistics as of the end of its last iteration, without waiting for the engine.
  EngineStats stats_snapshot() const;
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
  mutable std::mutex snapshot_mu_;
  EngineStats snapshot_;
  bool stopping_ = false;
  bool exited_ = false;
  std::thread thread_;

  void run();
  void run_on_engine_failure(const std::string& message);
  void post(std::function<void()> command);
};

}  // namespace serval
