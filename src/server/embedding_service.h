// Runs an encoder model for the server: one worker thread takes the queued requests in order and
// encodes their inputs in batches of at most `max_batch_tokens` tokens, several requests' inputs in one
// batch when they ask for the same thing (the encoder is batch invariant: an input's result does not
// depend on what it was batched with). Callers block until their request is done.
#pragma once
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "model/encoder.h"

namespace serval {

class EmbeddingService {
 public:
  explicit EmbeddingService(const EncoderModel& model, int64_t max_batch_tokens = 8192);
  ~EmbeddingService();
  EmbeddingService(const EmbeddingService&) = delete;
  EmbeddingService& operator=(const EmbeddingService&) = delete;

  // Pooled, unnormalized vectors, one per input.
  std::vector<std::vector<float>> embed(std::vector<EncoderInput> inputs, Pooling pooling);
  // The classification head's first logit per input (cross-encoders).
  std::vector<float> classify(std::vector<EncoderInput> inputs);

  const EncoderModel& model() const { return model_; }
  // Inputs and tokens encoded so far (for /metrics).
  int64_t inputs_done() const { return inputs_done_; }
  int64_t tokens_done() const { return tokens_done_; }

 private:
  struct Job {
    bool classify = false;
    Pooling pooling = Pooling::Mean;
    std::vector<EncoderInput> inputs;
    std::vector<std::vector<float>> out;
    size_t next = 0, done = 0;  // inputs taken into a batch / finished
    std::promise<void> finished;
  };
  std::vector<std::vector<float>> run(Job& job);
  void work();
  void run_batch(std::vector<std::pair<Job*, size_t>>& picks);

  const EncoderModel& model_;
  const int64_t max_batch_tokens_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> queue_;
  bool stop_ = false;
  std::atomic<int64_t> inputs_done_{0}, tokens_done_{0};
  std::thread worker_;
};

}  // namespace serval
