#include "engine/engine_loop.h"

#include <future>

#include "base/cpu.h"
#include "base/error.h"

namespace serval {

void TokenStream::push(TokenEvent ev) {
  std::function<void()> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
    notify = notify_;
  }
  cv_.notify_one();
  if (notify) notify();
}

void TokenStream::set_notify(std::function<void()> notify) {
  std::lock_guard<std::mutex> lock(mu_);
  notify_ = std::move(notify);
}

std::optional<TokenEvent> TokenStream::try_next() {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) return std::nullopt;
  TokenEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

std::optional<TokenEvent> TokenStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  TokenEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

EngineLoop::EngineLoop(Engine& engine) : engine_(engine), snapshot_(engine.stats()), thread_([this] { run(); }) {}

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
  apply_compute_threads();  // OpenMP's thread count is per thread: this one starts with the default
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
      apply_compute_threads();  // a no-op unless the setting changed
      try {
        engine_.step();
      } catch (const std::exception& e) {
        // A failed step must not lose requests silently: every one ends with the error.
        run_on_engine_failure(e.what());
      }
    }
    // Counted after scheduling: a request just added is not "waiting" until a step could not take it.
    waiting_.store(int64_t(engine_.scheduler().waiting().size()), std::memory_order_relaxed);
    const EngineStats snapshot = engine_.stats();
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    snapshot_ = snapshot;
  }
}

void EngineLoop::run_on_engine_failure(const std::string& message) { engine_.fail_all(message); }

std::shared_ptr<TokenStream> EngineLoop::submit(std::vector<int32_t> prompt, GenerationParams params) {
  auto stream = std::make_shared<TokenStream>();
  stream->id = submit_into(std::move(prompt), std::move(params), stream);
  return stream;
}

RequestId EngineLoop::submit_into(std::vector<int32_t> prompt, GenerationParams params, std::shared_ptr<TokenStream> stream) {
  // Checked here, on the caller's thread, so a bad request throws at once; the add itself is queued
  // for the engine thread and this returns without waiting for the current step to end.
  engine_.check_request(prompt, params);
  const RequestId id = engine_.reserve_id();
  post([this, id, prompt = std::move(prompt), params = std::move(params), stream]() mutable {
    try {
      engine_.add_request(std::move(prompt), std::move(params), [stream](const TokenEvent& ev) { stream->push(ev); }, id);
    } catch (const std::exception& e) {  // not expected after check_request; still, the stream gets its end
      TokenEvent ev;
      ev.id = id;
      ev.finished = true;
      ev.reason = FinishReason::Error;
      ev.error = e.what();
      stream->push(std::move(ev));
    }
  });
  return id;
}

void EngineLoop::abort(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (exited_) return;  // nothing is left to abort
  commands_.push_back([this, id] { engine_.abort(id); });
  cv_.notify_one();
}

void EngineLoop::run_on_engine(const std::function<void(Engine&)>& fn) {
  std::promise<void> done;
  auto future = done.get_future();
  post([&] {
    try {
      fn(engine_);
      done.set_value();
    } catch (...) {  // the caller's error: rethrown to it, the engine thread carries on
      done.set_exception(std::current_exception());
    }
  });
  future.get();
}

EngineStats EngineLoop::stats() {
  EngineStats s;
  run_on_engine([&](Engine& e) { s = e.stats(); });
  return s;
}

EngineStats EngineLoop::stats_snapshot() const {
  std::lock_guard<std::mutex> lock(snapshot_mu_);
  return snapshot_;
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
