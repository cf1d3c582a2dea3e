#include "engine/scheduler.h"

#include <algorithm>

#include "base/error.h"

namespace serval {

Scheduler::Scheduler(KvManager& kv, SchedulerConfig config) : kv_(kv), config_(config) {
  check(config_.max_batched_tokens > 0 && config_.max_seqs > 0, "max batched tokens and max seqs must be positive");
}

bool Scheduler::before(const Request* a, const Request* b) const {
  if (config_.policy == SchedulingPolicy::Priority && a->params.priority != b->params.priority)
    return a->params.priority < b->params.priority;
  return a->arrival < b->arrival;
}

void Scheduler::add(Request* r) {
  r->state = RequestState::Waiting;
  auto pos = std::upper_bound(waiting_.begin(), waiting_.end(), r, [&](auto* a, auto* b) { return before(a, b); });
  waiting_.insert(pos, r);
}

void Scheduler::remove(Request* r) {
  // Only the queue the request is in: running (short), or waiting (sorted: a binary search).
  if (r->state == RequestState::Running) {
    auto it = std::find(running_.begin(), running_.end(), r);
    if (it != running_.end()) running_.erase(it);
  } else {
    auto cmp = [&](auto* a, auto* b) { return before(a, b); };
    auto [lo, hi] = std::equal_range(waiting_.begin(), waiting_.end(), r, cmp);
    auto it = std::find(lo, hi, r);
    if (it != hi) waiting_.erase(it);
  }
  r->kv.release();
}

Request* Scheduler::pick_victim() const {
  // The running request served last: the most recent arrival, or the lowest priority.
  return *std::max_element(running_.begin(), running_.end(), [&](auto* a, auto* b) { return before(a, b); });
}

void Scheduler::preempt(Request* r, SchedulerOutput& out, int64_t& budget) {
  auto it = std::find_if(out.scheduled.begin(), out.scheduled.end(), [&](auto& s) { return s.request == r; });
  if (it != out.scheduled.end()) {  // planned earlier in this step: give its tokens back
    budget += it->num_new_tokens;
    out.num_tokens -= it->num_new_tokens;
    out.scheduled.erase(it);
  }
  running_.erase(std::remove(running_.begin(), running_.end(), r), running_.end());
  r->kv.release();
  r->num_computed_tokens = 0;
  r->cut_draft(0);
  r->state = RequestState::Preempted;
  ++r->n_preemptions;
  ++stats_.preemptions;
  out.preempted.push_back(r);
  auto pos = std::upper_bound(waiting_.begin(), waiting_.end(), r, [&](auto* a, auto* b) { return before(a, b); });
  waiting_.insert(pos, r);
}

// Plans `r`'s next tokens, preempting others (or `r`) until its KV fits. False if `r` was preempted.
// Proposed (draft) tokens go after the known ones, as far as the budget and the free blocks allow;
// they are dropped before anyone is preempted for them.
bool Scheduler::schedule_running(Request* r, SchedulerOutput& out, int64_t& budget) {
  const int64_t pending = r->num_tokens() - r->num_computed_tokens;
  int64_t n_new = std::min(pending + int64_t(r->draft.size()), budget);
  r->cut_draft(size_t(std::max<int64_t>(0, n_new - pending)));
  if (!r->draft.empty() && !kv_.can_allocate(&r->kv, nullptr, r->num_computed_tokens + n_new)) {
    r->cut_draft(0);
    n_new = std::min(pending, budget);
  }
  if (n_new <= 0) return true;
  while (!kv_.can_allocate(&r->kv, nullptr, r->num_computed_tokens + n_new)) {
    Request* victim = pick_victim();
    preempt(victim, out, budget);
    if (victim == r) return false;
  }
  kv_.grow(r->kv, r->num_computed_tokens + n_new);
  out.scheduled.push_back({r, n_new});
  out.num_tokens += n_new;
  budget -= n_new;
  return true;
}

void Scheduler::schedule_waiting(SchedulerOutput& out, int64_t& budget) {
  while (!waiting_.empty() && budget > 0 && int32_t(running_.size()) < config_.max_seqs) {
    Request* r = waiting_.front();
    kv_.hash_blocks(r->tokens, r->block_hashes, r->cache_salt());  // only blocks not hashed before
    // Prompt log-probabilities need the prompt's logits, mean pooling its hidden states: no prefix-cache
    // hit then.
    const PrefixHit hit = kv_.find_prefix_hashed(r->block_hashes, r->needs_every_prompt_row() ? 0 : r->num_tokens());
    const int64_t n_new = std::min(r->num_tokens() - hit.n_tokens, budget);
    if (!kv_.can_allocate(nullptr, &hit, hit.n_tokens + n_new)) break;
    waiting_.pop_front();
    stats_.prefix_queries += r->num_tokens();
    stats_.prefix_hits += hit.n_tokens;
    r->kv = kv_.allocate(hit, hit.n_tokens + n_new);
    r->num_computed_tokens = hit.n_tokens;
    if (r->cached_prompt_tokens < 0) r->cached_prompt_tokens = hit.n_tokens;
    r->state = RequestState::Running;
    running_.push_back(r);
    out.scheduled.push_back({r, n_new});
    out.num_tokens += n_new;
    budget -= n_new;
  }
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_batched_tokens;
  // Running requests first, in the order they are served; a preemption shrinks the list.
  std::vector<Request*> order = running_;
  std::sort(order.begin(), order.end(), [&](auto* a, auto* b) { return before(a, b); });
  for (Request* r : order) {
    if (budget <= 0) break;
    if (r->state != RequestState::Running) continue;  // preempted earlier in this step
    schedule_running(r, out, budget);
  }
  if (out.preempted.empty()) schedule_waiting(out, budget);
  return out;
}

}  // namespace serval
