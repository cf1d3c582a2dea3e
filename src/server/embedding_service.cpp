#include "server/embedding_service.h"

#include "base/cpu.h"

namespace serval {

EmbeddingService::EmbeddingService(const EncoderModel& model, int64_t max_batch_tokens)
    : model_(model), max_batch_tokens_(max_batch_tokens), worker_([this] { work(); }) {}

EmbeddingService::~EmbeddingService() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::vector<std::vector<float>> EmbeddingService::embed(std::vector<EncoderInput> inputs, Pooling pooling) {
  Job job;
  job.pooling = pooling;
  job.inputs = std::move(inputs);
  return run(job);
}

std::vector<float> EmbeddingService::classify(std::vector<EncoderInput> inputs) {
  Job job;
  job.classify = true;
  job.inputs = std::move(inputs);
  std::vector<float> out;
  for (auto& v : run(job)) out.push_back(v.at(0));
  return out;
}

std::vector<std::vector<float>> EmbeddingService::run(Job& job) {
  if (job.inputs.empty()) return {};
  job.out.resize(job.inputs.size());
  std::future<void> done = job.finished.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(&job);
  }
  cv_.notify_one();
  done.get();  // rethrows the encoder's error, if any
  return std::move(job.out);
}

// The next batch: inputs of the queued jobs in order, while they ask for what the first one asks for
// and fit in max_batch_tokens (one input always fits: a longer one runs alone).
void EmbeddingService::work() {
  apply_compute_threads();
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_ && queue_.empty()) return;
    std::vector<std::pair<Job*, size_t>> picks;
    int64_t tokens = 0;
    const Job* first = queue_.front();
    for (Job* job : queue_) {
      if (job->classify != first->classify || (!job->classify && job->pooling != first->pooling)) break;
      for (; job->next < job->inputs.size(); ++job->next) {
        const int64_t n = int64_t(job->inputs[job->next].tokens.size());
        if (!picks.empty() && tokens + n > max_batch_tokens_) break;
        picks.emplace_back(job, job->next);
        tokens += n;
      }
      if (job->next < job->inputs.size()) break;
    }
    lock.unlock();
    run_batch(picks);
    lock.lock();
    while (!queue_.empty() && queue_.front()->done == queue_.front()->inputs.size()) {
      queue_.front()->finished.set_value();
      queue_.pop_front();
    }
  }
}

void EmbeddingService::run_batch(std::vector<std::pair<Job*, size_t>>& picks) {
  std::vector<EncoderInput> inputs;
  for (auto& [job, i] : picks) inputs.push_back(job->inputs[i]);
  try {
    if (picks.front().first->classify) {
      const std::vector<float> logits = model_.classify(inputs);
      for (size_t k = 0; k < picks.size(); ++k) picks[k].first->out[picks[k].second] = {logits[k]};
    } else {
      auto vecs = model_.embed(inputs, picks.front().first->pooling, /*normalize=*/false);
      for (size_t k = 0; k < picks.size(); ++k) picks[k].first->out[picks[k].second] = std::move(vecs[k]);
    }
  } catch (...) {
    // Every job in the batch fails; the worker goes on with the next.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [job, i] : picks) {
      if (job->done == job->inputs.size()) continue;
      job->done = job->inputs.size();
      job->next = job->inputs.size();
      job->finished.set_exception(std::current_exception());
      std::erase(queue_, job);
    }
    return;
  }
  int64_t tokens = 0;
  for (auto& in : inputs) tokens += int64_t(in.tokens.size());
  inputs_done_ += int64_t(inputs.size());
  tokens_done_ += tokens;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [job, i] : picks) ++job->done;
}

}  // namespace serval
