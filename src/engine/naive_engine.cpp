#include "engine/naive_engine.h"

#include <algorithm>
#include <chrono>

#include "base/error.h"

namespace serval {

NaiveEngine::NaiveEngine(const Model& model, int32_t batch_size, DType kv_type)
    : model_(model), batch_size_(batch_size), kv_type_(kv_type) {
  check(batch_size > 0, "batch size must be positive");
}

namespace {

struct Row {
  const NaiveRequest* req;
  size_t index;
  std::vector<int32_t> tokens;  // prompt then output
  Sampler sampler;
  bool done = false;
  int32_t base_slot;   // first slot of the row's contiguous reservation
  int32_t pad;         // padding positions before the prompt
  std::vector<int32_t> table;  // slot of each real position
};

}  // namespace

NaiveResult NaiveEngine::run(const std::vector<NaiveRequest>& requests) {
  NaiveResult res;
  res.outputs.resize(requests.size());
  res.ttft_s.resize(requests.size());
  res.e2e_s.resize(requests.size());
  const auto t0 = std::chrono::steady_clock::now();
  auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const auto& tok = model_.tokenizer();
  const int64_t n_vocab = model_.config().n_vocab;
  std::vector<float> logits;
  for (size_t start = 0; start < requests.size(); start += batch_size_) {
    const size_t end = std::min(requests.size(), start + size_t(batch_size_));
    int32_t longest = 0, max_new = 0;
    for (size_t i = start; i < end; ++i) {
      longest = std::max(longest, int32_t(requests[i].prompt.size()));
      max_new = std::max(max_new, requests[i].params.max_tokens);
    }
    const int32_t row_len = longest + max_new;  // reserved per request, contiguously
    KvCache cache(model_.config(), int64_t(end - start) * row_len, kv_type_);
    std::vector<Row> rows;
    for (size_t i = start; i < end; ++i) {
      Row r{&requests[i], i, requests[i].prompt, Sampler(requests[i].params.sampling)};
      r.base_slot = int32_t(i - start) * row_len;
      r.pad = longest - int32_t(r.tokens.size());
      rows.push_back(std::move(r));
    }
    // Padding tokens: computed like real ones, each a sequence of its own (masked out of the rest).
    auto add_padding = [&](Batch& b, int32_t slot) {
      for (auto& t : b.block_tables) t.push_back({slot});
      b.add(tok.vocab().pad >= 0 ? tok.vocab().pad : 0, 0, int32_t(b.block_tables[0].size() - 1), slot, false);
    };
    bool prefill = true;
    for (int32_t step = 0;; ++step) {
      Batch b(model_.config().n_kv_groups());
      std::vector<int> logit_of(rows.size(), -1);
      int n_logits = 0;
      for (size_t k = 0; k < rows.size(); ++k) {
        Row& r = rows[k];
        if (prefill) {
          for (int32_t p = 0; p < r.pad; ++p) add_padding(b, r.base_slot + p);
        }
        if (r.done) {  // finished rows keep computing padding until the batch ends
          add_padding(b, r.base_slot + longest + step - 1);
          continue;
        }
        const int32_t seq = int32_t(b.block_tables[0].size());
        for (auto& t : b.block_tables) t.push_back({});
        const int32_t first = prefill ? 0 : int32_t(r.tokens.size()) - 1;
        for (int32_t p = 0; p < int32_t(r.tokens.size()); ++p) {
          const int32_t slot = r.base_slot + r.pad + p;
          for (auto& t : b.block_tables) t.back().push_back(slot);
          if (p >= first) b.add(r.tokens[p], p, seq, slot, p + 1 == int32_t(r.tokens.size()));
        }
        logit_of[k] = n_logits++;
      }
      if (n_logits == 0) break;
      model_.forward(b, cache, logits);
      res.computed_tokens += int64_t(b.size());
      for (size_t k = 0; k < rows.size(); ++k) {
        Row& r = rows[k];
        if (logit_of[k] < 0) continue;
        const std::span<const float> row(logits.data() + logit_of[k] * n_vocab, n_vocab);
        const int32_t t = r.sampler.sample(row, r.tokens).token;
        r.tokens.push_back(t);
        auto& out = res.outputs[r.index];
        out.push_back(t);
        if (out.size() == 1) res.ttft_s[r.index] = now();
        const auto& stops = r.req->params.stop_token_ids;
        const bool stop = (!r.req->params.ignore_eos && tok.is_end_of_generation(t)) ||
                          std::find(stops.begin(), stops.end(), t) != stops.end();
        if (stop || int32_t(out.size()) >= r.req->params.max_tokens) {
          r.done = true;
          res.e2e_s[r.index] = now();
        }
      }
      double used = 0;
      for (const Row& r : rows) used += double(r.tokens.size()) - (r.done ? 0 : 1);
      res.used_slot_steps += used;
      res.reserved_slot_steps += double(rows.size()) * row_len;
      prefill = false;
      if (std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.done; })) break;
    }
  }
  res.seconds = now();
  return res;
}

}  // namespace serval
