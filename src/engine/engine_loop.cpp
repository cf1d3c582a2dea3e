#include "engine/engine_loop.h"

#include <future>

#include "base/error.h"

namespace serval {

void TokenStream::push(TokenEvent ev) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_one();
}

std::optional<TokenEvent> TokenStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  TokenEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

EngineLoop::EngineLoop(Engine& engine) : engine_(engine), thread_([this] { run(); }) {}

EngineLoop::~EngineLoop() {
  stop();
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::post(std::function<void()> command) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    check(!exited_, "the engine is shutting down");
    commands_.push_back(std::move(command));
  }
  cv_.notify_one();
}

void EngineLoop::run() {
  while (true) {
    std::deque<std::function<void()>> commands;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !commands_.empty() || engine_.has_work(); });
      commands.swap(commands_);
      if (stopping_ && commands.empty() && !engine_.has_work()) {
        exited_ = true;
        break;
      }
    }
    for (auto& c : commands) c();
    if (engine_.has_work()) {
      try {
        engine_.step();
      } catch (const std::exception& e) {
        // A failed step must not lose requests silently: every one ends with the error.
        run_on_engine_failure(e.what());
      }
    }
    // Counted after scheduling: a request just added is not "waiting" until a step could not take it.
    waiting_.store(int64_t(engine_.scheduler().waiting().size()), std::memory_order_relaxed);
  }
}

void EngineLoop::run_on_engine_failure(const std::string& message) { engine_.fail_all(message); }

std::shared_ptr<TokenStream> EngineLoop::submit(std::vector<int32_t> prompt, GenerationParams params) {
  auto stream = std::make_shared<TokenStream>();
  stream->id = submit_into(std::move(prompt), std::move(params), stream);
  return stream;
}

RequestId EngineLoop::submit_into(std::vector<int32_t> prompt, GenerationParams params, std::shared_ptr<TokenStream> stream) {
  std::promise<RequestId> result;
  auto future = result.get_future();
  post([&, stream] {
    try {
      result.set_value(engine_.add_request(std::move(prompt), std::move(params),
                                           [stream](const TokenEvent& ev) { stream->push(ev); }));
    } catch (...) {
      result.set_exception(std::current_exception());
    }
  });
  return future.get();  // rethrows the engine's Error
}

void EngineLoop::abort(RequestId id) {
  post([this, id] { engine_.abort(id); });
}

void EngineLoop::run_on_engine(const std::function<void(Engine&)>& fn) {
  std::promise<void> done;
  auto future = done.get_future();
  post([&] {
    fn(engine_);
    done.set_value();
  });
  future.get();
}

EngineStats EngineLoop::stats() {
  EngineStats s;
  run_on_engine([&](Engine& e) { s = e.stats(); });
  return s;
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    commands_.push_back([this] { engine_.abort_all(); });
    stopping_ = true;
  }
  cv_.notify_one();
}

}  // namespace serval
