#include "engine/engine.h"

#include "engine/capacity.h"

#include <algorithm>
#include <fmt/core.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <limits>
#include <optional>

#include "base/error.h"
#include "model/shard.h"

namespace serval {

uint64_t kv_budget_from_string(const std::string& text) {
  check(!text.empty(), "empty KV cache size");
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    fail("bad KV cache size '{}' (bytes like 512MiB / 2GB, or a fraction of free memory like 0.5)", text);
  }
  std::string unit = text.substr(pos);
  for (auto& ch : unit) ch = char(std::tolower(ch));
  check(std::isfinite(value) && value > 0, "KV cache size must be positive, got '{}'", text);
  if (unit.empty() && value <= 1.0) {  // a fraction of available memory
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return uint64_t(value * double(pages) * double(page));
  }
  const std::vector<std::pair<std::string, double>> units = {
      {"", 1}, {"b", 1}, {"k", 1e3}, {"kb", 1e3}, {"kib", 1024.0}, {"m", 1e6}, {"mb", 1e6}, {"mib", 1048576.0},
      {"g", 1e9}, {"gb", 1e9}, {"gib", 1073741824.0}};
  for (const auto& [name, mult] : units)
    if (unit == name) return uint64_t(value * mult);
  fail("bad KV cache size unit in '{}'", text);
}

std::string KvCapacity::describe(int64_t max_model_len) const {
  return fmt::format(
      "KV cache{}: {}, {} bytes per token ({}), {} blocks of {} tokens "
      "= {} tokens, {:.1f} MiB; {:.2f} sequences of the full context ({} tokens) fit",
      ranks > 1 ? fmt::format(" (each of {} ranks; the largest share)", ranks) : "", dtype, bytes_per_token, formula, num_blocks, block_size, tokens, double(bytes) / 1048576.0, full_context_sequences, max_model_len);
}

namespace {

// KV bytes per token of the largest rank's cache: the budget is per rank (as vLLM's is per GPU), and
// every rank holds the same slots. The whole model's when it is not split.
int64_t rank_kv_bytes_per_token(const ModelConfig& c, double dtype_bytes) {
  if (!c.shard.split()) return c.kv_bytes_per_token(dtype_bytes);
  int64_t most = 0;
  for (int stage = 0; stage < c.shard.pp; ++stage)
    for (int r = 0; r < c.shard.tp; ++r) {
      ModelConfig rank = c;
      rank.shard = make_shard_layout(c, c.shard.tp, c.shard.pp, r, stage);
      most = std::max(most, rank.local_kv_bytes_per_token(dtype_bytes));
    }
  return most;
}

}  // namespace

Engine::Engine(const Model& model, EngineConfig config) : model_(model), config_(std::move(config)) {
  const auto& c = model_.config();
  check(model_.n_logits() == c.n_vocab, "the served model must compute all {} logits (only a draft model's are cut)",
        c.n_vocab);
  max_model_len_ = config_.max_model_len > 0 ? std::min(config_.max_model_len, c.n_ctx_train) : c.n_ctx_train;
  const double dtype_bytes = bytes_per_elem(config_.kv_type);
  capacity_.bytes_per_token = rank_kv_bytes_per_token(c, dtype_bytes);
  if (c.mla)
    capacity_.formula = fmt::format("MLA: {} layers x ({} latent + {} rotated key values) x dtype bytes", c.n_layer,
                                    c.kv_lora_rank, c.qk_rope_dim);
  capacity_.dtype = kv_cache_type_name(config_.kv_type);
  capacity_.ranks = c.shard.tp * c.shard.pp;
  capacity_.block_size = config_.block_size;
  const uint64_t bytes_per_block = uint64_t(capacity_.bytes_per_token) * config_.block_size;
  capacity_.num_blocks = config_.num_blocks > 0 ? config_.num_blocks : int32_t(config_.kv_cache_bytes / bytes_per_block);
  check(capacity_.num_blocks > 0, "KV cache budget of {} bytes holds no block of {} tokens ({} bytes)",
        config_.kv_cache_bytes, config_.block_size, bytes_per_block);
  capacity_.tokens = int64_t(capacity_.num_blocks) * config_.block_size;
  capacity_.bytes = uint64_t(capacity_.num_blocks) * bytes_per_block;
  capacity_.full_context_sequences = double(capacity_.tokens) / double(max_model_len_);

  KvManagerConfig kc;
  kc.block_size = config_.block_size;
  kc.prefix_caching = config_.prefix_caching;
  for (int g = 0; g < c.n_kv_groups(); ++g) {
    kc.blocks_per_group.push_back(capacity_.num_blocks);
    kc.window_per_group.push_back(c.kv_group_is_swa(g) ? c.sliding_window : 0);
  }
  kv_ = std::make_unique<KvManager>(kc);
  cache_ = std::make_unique<KvCache>(model_.config(), capacity_.tokens, config_.kv_type);
  scheduler_ = std::make_unique<Scheduler>(*kv_, config_.scheduler);
  batch_ = Batch(c.n_kv_groups());
  batch_.block_size = config_.block_size;
  proposer_ = make_proposer(config_.spec, model_, config_.block_size);
  counters_.spec.accepted_per_pos.assign(size_t(config_.spec.draft_max), 0);
}

void Engine::check_request(const std::vector<int32_t>& prompt, const GenerationParams& params) const {
  const auto& tok = model_.tokenizer();
  check(!prompt.empty(), "the prompt is empty");
  for (int32_t t : prompt) check(t >= 0 && t < tok.n_vocab(), "prompt token {} is outside the vocabulary", t);
  params.sampling.validate(tok.n_vocab());
  check(params.max_tokens >= 1, "max_tokens must be at least 1 (got {})", params.max_tokens);
  check(params.draft_max >= -1, "the draft length must be -1 (the server's), 0 (off) or positive (got {})",
        params.draft_max);
  check(params.adapter == -1 || model_.has_adapter(params.adapter), "LoRA adapter {} is not loaded", params.adapter);
  check(std::isfinite(params.adapter_scale), "the LoRA scale must be finite");
  check(!params.embed_mean || params.embed, "mean pooling is for embedding requests");
  check(!params.embed || (params.draft_max == 0 && !params.grammar && params.prompt_logprobs < 0),
        "an embedding request takes no speculation, grammar or prompt log-probabilities");
  const int64_t total = int64_t(prompt.size()) + params.max_tokens;
  check(int64_t(prompt.size()) < max_model_len_, "the prompt has {} tokens; the model's context is {} tokens",
        prompt.size(), max_model_len_);
  const int64_t needed = std::min(total, max_model_len_);
  check(kv_->fits_alone(needed, config_.scheduler.max_batched_tokens),
        "the request needs KV for {} tokens but the whole cache holds {} tokens", needed, capacity_.tokens);
}

RequestId Engine::add_request(std::vector<int32_t> prompt, GenerationParams params, TokenCallback on_token,
                              RequestId id) {
  check_request(prompt, params);
  check(!requests_.count(id), "request id {} is in use", id);
  if (id == 0) id = reserve_id();
  auto r = std::make_unique<Request>(id, std::move(prompt), std::move(params), std::move(on_token), arrivals_++);
  if (r->params.grammar) r->matcher = std::make_unique<grammar::GrammarMatcher>(r->params.grammar, token_vocab());
  scheduler_->add(r.get());
  counters_.prompt_tokens += r->n_prompt;
  requests_.emplace(id, std::move(r));
  return id;
}

bool Engine::abort(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  finish(*it->second, FinishReason::Abort);
  return true;
}

void Engine::abort_all() {
  while (!requests_.empty()) finish(*requests_.begin()->second, FinishReason::Abort);
}

void Engine::fail_all(const std::string& message) {
  while (!requests_.empty()) finish(*requests_.begin()->second, FinishReason::Error, message);
}

void Engine::finish(Request& r, FinishReason reason, const std::string& error, std::vector<float> embedding) {
  scheduler_->remove(&r);  // frees the KV blocks now
  if (proposer_ && (reason == FinishReason::Stop || reason == FinishReason::Length)) proposer_->finished(r);
  if (proposer_) proposer_->forget(r);
  r.state = RequestState::Finished;
  r.finish_reason = reason;
  TokenEvent ev;
  ev.id = r.id;
  ev.finished = true;
  ev.reason = reason;
  ev.error = error;
  ev.cached_tokens = std::max<int64_t>(0, r.cached_prompt_tokens);
  ev.embedding = std::move(embedding);
  const RequestId id = r.id;
  auto cb = std::move(r.on_token);
  requests_.erase(id);
  if (cb) cb(ev);
}

bool Engine::should_stop(const Request& r, int32_t token) const {
  if (!r.params.ignore_eos && model_.tokenizer().is_end_of_generation(token)) return true;
  const auto& stops = r.params.stop_token_ids;
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

void Engine::build_batch(const SchedulerOutput& plan) {
  const int n_groups = model_.config().n_kv_groups();
  const int64_t bs = config_.block_size;
  Batch& batch = batch_;
  batch.tokens.clear();
  batch.positions.clear();
  batch.seq_ids.clear();
  batch.want_logits.clear();
  for (int g = 0; g < n_groups; ++g) {
    batch.slots[g].clear();
    batch.block_tables[g].resize(plan.scheduled.size());
  }
  batch.table_block_size.assign(plan.scheduled.size(), int32_t(bs));
  logit_row_.clear();
  prompt_rows_.clear();
  int64_t n_logits = 0;
  batch.adapter.clear();
  batch.adapter_scale.clear();
  batch.want_hidden.clear();
  pool_rows_.clear();
  int64_t n_pool = 0;
  bool adapters = false;  // a request with a LoRA adapter: every token gets its request's (or -1)
  bool pooling = false;   // a mean-pooled embedding: every token gets a want_hidden flag
  for (size_t s = 0; s < plan.scheduled.size(); ++s) {
    adapters |= plan.scheduled[s].request->params.adapter >= 0;
    pooling |= plan.scheduled[s].request->mean_pooled();
  }
  for (size_t s = 0; s < plan.scheduled.size(); ++s) {
    Request& r = *plan.scheduled[s].request;
    const int64_t begin = r.num_computed_tokens, end = begin + plan.scheduled[s].num_new_tokens;
    // The block table: one entry per block_size positions, 0 .. end - 1. The request's copy from the
    // previous step is still a prefix of it (same allocation) but for blocks a window freed since.
    const int64_t n_blocks = (end + bs - 1) / bs;
    if (r.batch_tables_serial != r.kv.serial() || int(r.batch_tables.size()) != n_groups) {
      r.batch_tables.assign(n_groups, {});
      r.batch_tables_live.assign(n_groups, 0);
      r.batch_tables_serial = r.kv.serial();
    }
    for (int g = 0; g < n_groups; ++g) {
      const auto& blocks = r.kv.table(g);
      auto& copy = r.batch_tables[g];
      const int64_t live = r.kv.first_live_block(g);
      for (int64_t b = r.batch_tables_live[g]; b < std::min<int64_t>(live, int64_t(copy.size())); ++b) copy[b] = -1;
      r.batch_tables_live[g] = live;
      if (int64_t(copy.size()) > n_blocks) copy.resize(n_blocks);
      else copy.insert(copy.end(), blocks.begin() + int64_t(copy.size()), blocks.begin() + n_blocks);
      batch.block_tables[g][s] = std::move(copy);
      copy.clear();
    }
    const int64_t n_known = r.num_tokens();  // then the draft tokens, each with its logits row
    const bool tree = !r.draft_parents.empty() && end > n_known;
    if (tree) prepare_tree(r, n_known);
    // Prompt rows whose logits give a prompt token's log-probability (row p: token p + 1).
    const int64_t lp_begin = r.wants_prompt_logits() ? std::max(begin, r.prompt_logprobs_done - 1) : end;
    const int64_t lp_end = std::min(end, r.n_prompt - 1);
    prompt_rows_.push_back({lp_begin, std::max<int64_t>(0, lp_end - lp_begin), n_logits});
    n_logits += prompt_rows_.back().count;
    for (int64_t p = begin; p < end; ++p) {
      if (tree && p >= n_known) {
        add_tree_node(r, p - n_known, n_known);
        continue;
      }
      const bool logits = p >= n_known - 1 || (p >= lp_begin && p < lp_end);
      batch.tokens.push_back(p < n_known ? r.tokens[p] : r.draft[p - n_known]);
      batch.positions.push_back(int32_t(p));
      batch.seq_ids.push_back(int32_t(s));
      batch.want_logits.push_back(logits);
      for (int g = 0; g < n_groups; ++g) batch.slots[g].push_back(int32_t(r.kv.table(g)[p / bs] * bs + p % bs));
    }
    logit_row_.push_back(end >= n_known ? n_logits : -1);
    n_logits += std::max<int64_t>(0, end - n_known + 1);
    if (pooling) {  // prompt positions before the last (whose state comes with its logits row)
      const int64_t count = r.mean_pooled() ? std::max<int64_t>(0, std::min(end, r.n_prompt - 1) - begin) : 0;
      pool_rows_.push_back({begin, count, n_pool});
      n_pool += count;
      batch.want_hidden.resize(batch.tokens.size() - size_t(end - begin), 0);
      batch.want_hidden.resize(batch.tokens.size() - size_t(end - begin) + size_t(count), 1);
      batch.want_hidden.resize(batch.tokens.size(), 0);
    }
    if (adapters) {
      batch.adapter.resize(batch.tokens.size(), int16_t(r.params.adapter));
      batch.adapter_scale.resize(batch.tokens.size(), r.params.adapter_scale);
    }
  }
  n_logit_rows_ = n_logits;
}

// Depth of each draft token (1: a child of the last known token), parents before children.
static void tree_depths(std::span<const int32_t> parents, std::vector<int32_t>& depth) {
  depth.clear();
  for (int32_t parent : parents) depth.push_back(parent < 0 ? 1 : depth[size_t(parent)] + 1);
}

void Engine::prepare_tree(const Request& r, int64_t n_known) {
  const int64_t bs = config_.block_size;
  tree_depths(r.draft_parents, tree_depth_);
  tree_prefix_.resize(size_t(model_.config().n_kv_groups()));
  for (int g = 0; g < int(tree_prefix_.size()); ++g) {
    const auto& table = r.kv.table(g);
    const int64_t live = r.kv.first_live_block(g);
    auto& slots = tree_prefix_[size_t(g)];
    slots.resize(size_t(n_known));
    for (int64_t p = 0; p < n_known; ++p) slots[size_t(p)] = p / bs < live ? -1 : int32_t(table[p / bs] * bs + p % bs);
  }
}

void Engine::add_tree_node(const Request& r, int64_t node, int64_t n_known) {
  const int64_t bs = config_.block_size;
  Batch& batch = batch_;
  const int32_t seq = int32_t(batch.block_tables[0].size());
  const int64_t storage = n_known + node;
  batch.tokens.push_back(r.draft[size_t(node)]);
  batch.positions.push_back(int32_t(n_known - 1 + tree_depth_[size_t(node)]));
  batch.seq_ids.push_back(seq);
  batch.want_logits.push_back(true);
  batch.table_block_size.push_back(1);
  for (int g = 0; g < batch.n_groups(); ++g) {
    const auto& table = r.kv.table(g);
    auto slot_of = [&](int64_t p) { return int32_t(table[p / bs] * bs + p % bs); };
    batch.slots[g].push_back(slot_of(storage));
    std::vector<int32_t> slots = tree_prefix_[size_t(g)];
    const size_t at = slots.size();
    for (int64_t a = node; a >= 0; a = r.draft_parents[size_t(a)]) slots.push_back(slot_of(n_known + a));
    std::reverse(slots.begin() + int64_t(at), slots.end());  // root first
    batch.block_tables[g].push_back(std::move(slots));
  }
}

void Engine::return_block_tables(const SchedulerOutput& plan) {
  for (size_t s = 0; s < plan.scheduled.size(); ++s) {
    Request& r = *plan.scheduled[s].request;
    for (int g = 0; g < int(r.batch_tables.size()); ++g) {
      r.batch_tables[g] = std::move(batch_.block_tables[g][s]);
      batch_.block_tables[g][s].clear();
    }
  }
}

void Engine::propose_drafts() {
  if (!proposer_) return;
  const auto& running = scheduler_->running();
  for (Request* r : running) r->cut_draft(0);
  if (int64_t(running.size()) > config_.spec.max_running) return;  // the batch is big enough: no gain
  spec_reqs_.clear();
  spec_limits_.clear();
  for (Request* r : running) {
    if (r->num_tokens() - r->num_computed_tokens != 1) continue;  // still in prefill
    if (r->matcher) continue;  // constrained: no speculation
    const int32_t cap = r->params.draft_max < 0 ? config_.spec.draft_max : std::min(r->params.draft_max, config_.spec.draft_max);
    if (r->spec_len == 0) r->spec_len = cap;
    // n accepted tokens and one more: never past max_tokens or the context.
    const int64_t room = std::min(r->params.max_tokens - r->num_output_tokens(), max_model_len_ - r->num_tokens()) - 1;
    const int64_t limit = std::min<int64_t>({cap, proposer_->sizes_own_drafts() ? cap : r->spec_len, room});
    if (limit < config_.spec.draft_min) continue;
    spec_reqs_.push_back(r);
    spec_limits_.push_back(int32_t(limit));
  }
  if (!spec_reqs_.empty()) proposer_->propose(spec_reqs_, spec_limits_);
  for (Request* r : spec_reqs_)
    if (int32_t(r->draft.size()) < config_.spec.draft_min) r->cut_draft(0);
}

const std::shared_ptr<const grammar::TokenVocab>& Engine::token_vocab() {
  if (!token_vocab_) {
    const Tokenizer& tok = model_.tokenizer();
    std::vector<std::string> bytes(size_t(tok.n_vocab()));
    std::vector<int32_t> eog;
    for (int32_t id = 0; id < tok.n_vocab(); ++id) {
      bytes[size_t(id)] = tok.token_to_piece(id);
      if (tok.is_end_of_generation(id)) eog.push_back(id);
    }
    token_vocab_ = std::make_shared<const grammar::TokenVocab>(std::move(bytes), std::move(eog));
  }
  return token_vocab_;
}

std::optional<SampleResult> Engine::sample_next(Request& r, std::span<const float> logits) {
  if (!r.matcher) return r.sampler.sample(logits, r.tokens);
  std::shared_ptr<const grammar::TokenMask> mask;
  try {
    mask = r.matcher->allowed();
  } catch (const Error& e) {
    return finish(r, FinishReason::Error, e.what()), std::nullopt;
  }
  masked_logits_.assign(logits.begin(), logits.end());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  size_t allowed = 0;
  for (size_t w = 0; w < mask->bits.size(); ++w) {
    const uint64_t bits = mask->bits[w];
    allowed += size_t(std::popcount(bits));
    for (size_t i = w * 64; i < std::min(logits.size(), w * 64 + 64); ++i)
      if (!((bits >> (i - w * 64)) & 1)) masked_logits_[i] = neg_inf;
  }
  if (allowed == 0) return finish(r, FinishReason::Error, "the grammar allows no token here"), std::nullopt;
  SampleResult s = r.sampler.sample(masked_logits_, r.tokens);
  try {
    if (r.matcher->accept(s.token)) return s;
    return finish(r, FinishReason::Error, "the grammar refused the sampled token"), std::nullopt;
  } catch (const Error& e) {
    return finish(r, FinishReason::Error, e.what()), std::nullopt;
  }
}

bool Engine::emit(Request& r, const SampleResult& sample) {
  r.tokens.push_back(sample.token);
  ++counters_.generation_tokens;
  r.t_last_token = Clock::now();
  if (r.num_output_tokens() == 1) r.t_first_token = r.t_last_token;
  if (r.on_token)
    r.on_token({r.id, sample.token, sample.logprob, sample.top, false, FinishReason::None, "",
                std::max<int64_t>(0, r.cached_prompt_tokens)});
  if (should_stop(r, sample.token)) return finish(r, FinishReason::Stop), false;
  if (r.num_output_tokens() >= r.params.max_tokens || r.num_tokens() >= max_model_len_)
    return finish(r, FinishReason::Length), false;
  return true;
}

void Engine::record_verification(size_t n_draft, size_t n_accepted) {
  if (n_draft == 0) return;
  auto& st = counters_.spec;
  ++st.drafts;
  st.draft_tokens += int64_t(n_draft);
  st.accepted_tokens += int64_t(n_accepted);
  for (size_t i = 0; i < n_accepted && i < st.accepted_per_pos.size(); ++i) ++st.accepted_per_pos[i];
}

int64_t Engine::accept_tokens(Request& r, int64_t row) {
  const std::vector<int32_t> draft = std::move(r.draft);
  std::vector<int32_t> parents = std::move(r.draft_parents);
  const bool tree = !parents.empty();
  r.cut_draft(0);
  if (!tree)
    for (size_t i = 0; i < draft.size(); ++i) parents.push_back(int32_t(i) - 1);
  const int64_t n_vocab = model_.config().n_vocab, n_known = r.num_tokens();
  std::vector<int32_t> path;  // kept draft tokens, root first
  int64_t at = row;
  bool alive = true;
  while (alive) {
    const std::span<const float> logits(logits_.data() + at * n_vocab, size_t(n_vocab));
    const std::optional<SampleResult> sampled = sample_next(r, logits);
    if (!sampled) return -1;
    const SampleResult& sample = *sampled;
    const int32_t parent = path.empty() ? -1 : path.back();
    int32_t next = -1;  // the child of `parent` that the sample matches
    for (size_t i = size_t(parent + 1); i < draft.size() && next < 0; ++i)
      if (parents[i] == parent && draft[i] == sample.token) next = int32_t(i);
    alive = emit(r, sample);  // false: r is gone
    if (alive && r.matcher && r.matcher->is_complete()) alive = false, finish(r, FinishReason::Stop);
    if (next < 0) break;
    path.push_back(next);
    at = row + 1 + next;
  }
  record_verification(draft.size(), path.size());
  if (!alive) return -1;
  if (tree) move_kept_kv(r, n_known, path);
  if (!draft.empty()) {  // the deepest draft token's depth is a chain's length
    tree_depths(parents, tree_depth_);
    const size_t depth = size_t(*std::max_element(tree_depth_.begin(), tree_depth_.end()));
    r.spec_len = next_spec_len(r.spec_len, depth, path.size(), config_.spec.draft_max);
  }
  return at;
}

void Engine::move_kept_kv(const Request& r, int64_t n_known, std::span<const int32_t> path) {
  const int64_t bs = config_.block_size;
  for (size_t d = 0; d < path.size(); ++d) {
    if (path[d] == int32_t(d)) continue;  // already in place
    const int64_t from = n_known + path[d], to = n_known + int64_t(d);
    for (int g = 0; g < model_.config().n_kv_groups(); ++g) {
      const auto& table = r.kv.table(g);
      cache_->copy_slot(g, int32_t(table[from / bs] * bs + from % bs), int32_t(table[to / bs] * bs + to % bs));
    }
  }
}

void Engine::emit_prompt_logprobs(Request& r, const PromptRows& rows) {
  const int64_t n_vocab = model_.config().n_vocab;
  for (int64_t k = 0; k < rows.count; ++k) {
    const int64_t p = rows.first + k;
    const std::span<const float> logits(logits_.data() + (rows.row + k) * n_vocab, size_t(n_vocab));
    SampleResult lp = logprobs_of(logits, r.tokens[size_t(p + 1)], r.params.prompt_logprobs);
    r.prompt_logprobs_done = p + 2;
    if (!r.on_token) continue;
    TokenEvent ev{r.id, lp.token, lp.logprob, std::move(lp.top)};
    ev.prompt = true;
    r.on_token(ev);
  }
}

bool Engine::step() {
  const bool worked = run_step();
  flush_kv_events();  // a failed step's events go with the next one
  return worked;
}

void Engine::set_kv_event_sink(KvEventSink sink) {
  kv_event_sink_ = std::move(sink);
  if (kv_event_sink_ && !kv_->events_enabled()) kv_->enable_events();
}

void Engine::flush_kv_events() {
  if (!kv_event_sink_) return;
  auto events = kv_->take_events();
  if (!events.empty()) kv_event_sink_(std::move(events));
}

void Engine::reset_prefix_cache() {
  kv_->reset_prefix_cache();
  flush_kv_events();
}

bool Engine::run_step() {
  propose_drafts();
  const SchedulerOutput plan = scheduler_->schedule();
  if (proposer_)
    for (Request* r : plan.preempted) proposer_->forget(*r);
  if (plan.empty()) return false;
  build_batch(plan);
  bool embeds = !batch_.want_hidden.empty();  // hidden states are an output: an embedding reaches its
  for (size_t s = 0; s < plan.scheduled.size(); ++s)  // last prompt token, or mean-pools this step's
    embeds |= plan.scheduled[s].request->params.embed && logit_row_[s] >= 0;
  try {
    const bool hidden = embeds || (proposer_ && proposer_->wants_hidden());
    model_.forward(batch_, *cache_, logits_, hidden ? &hidden_ : nullptr);
  } catch (...) {
    return_block_tables(plan);
    throw;
  }
  return_block_tables(plan);
  ++counters_.steps;
  counters_.computed_tokens += int64_t(batch_.size());
  for (size_t s = 0; s < plan.scheduled.size(); ++s) {
    Request& r = *plan.scheduled[s].request;
    r.num_computed_tokens += plan.scheduled[s].num_new_tokens;
    emit_prompt_logprobs(r, prompt_rows_[s]);
    if (r.mean_pooled()) pool_hidden(r, s);
    if (r.params.embed && logit_row_[s] >= 0) {  // prefill done: the last prompt token's state is the result
      const int64_t d = model_.config().n_embd;
      const float* h = hidden_.data() + logit_row_[s] * d;
      finish(r, FinishReason::Stop, "", r.mean_pooled() ? std::move(r.pool_sum) : std::vector<float>(h, h + d));
      continue;
    }
    const int64_t last_row = logit_row_[s] >= 0 ? accept_tokens(r, logit_row_[s]) : -2;
    if (last_row == -1) continue;  // finished
    // KV of rejected draft tokens is left in its slots, to be overwritten: not computed.
    r.num_computed_tokens = std::min(r.num_computed_tokens, r.num_tokens() - 1);
    if (proposer_ && last_row >= 0)
      proposer_->verified(r, hidden_.empty() ? nullptr : hidden_.data() + last_row * model_.config().n_embd);
    kv_->hash_blocks(r.tokens, r.block_hashes, r.cache_salt());  // only blocks not hashed before
    kv_->commit_hashed(r.kv, r.block_hashes, r.num_computed_tokens, r.tokens);
  }
  return true;
}

void Engine::pool_hidden(Request& r, size_t s) {
  const int64_t d = model_.config().n_embd;
  r.pool_sum.resize(size_t(d), 0.0f);
  auto add = [&](int64_t pos, int64_t row) {
    if (pos < r.pooled) return;  // computed again after a preemption: already in the sum
    const float* h = hidden_.data() + row * d;
    for (int64_t i = 0; i < d; ++i) r.pool_sum[size_t(i)] += h[i];
    r.pooled = pos + 1;
  };
  const PromptRows& rows = pool_rows_[s];
  for (int64_t k = 0; k < rows.count; ++k) add(rows.first + k, n_logit_rows_ + rows.row + k);
  if (logit_row_[s] < 0) return;
  add(r.n_prompt - 1, logit_row_[s]);
  for (float& v : r.pool_sum) v /= float(r.n_prompt);
}

bool Engine::adapter_in_use(int32_t id) const {
  return std::any_of(requests_.begin(), requests_.end(), [&](const auto& r) { return r.second->params.adapter == id; });
}

EngineStats Engine::stats() const {
  EngineStats s = counters_;
  s.running = int64_t(scheduler_->running().size());
  s.waiting = int64_t(scheduler_->waiting().size());
  s.kv_usage = kv_->usage();
  s.prefix_queries = scheduler_->stats().prefix_queries;
  s.prefix_hits = scheduler_->stats().prefix_hits;
  s.preemptions = scheduler_->stats().preemptions;
  for (int g = 0; g < kv_->n_groups(); ++g) {
    s.blocks_total += kv_->pool(g).n_blocks();
    s.blocks_free += kv_->pool(g).n_free();
    s.blocks_cached_free += kv_->pool(g).n_cached_free();
  }
  for (const Request* r : scheduler_->running()) {
    s.reserved_slots += r->kv.blocks_held() * config_.block_size;
    s.used_slots += r->num_computed_tokens * kv_->n_groups();
  }
  const ModelConfig& mc = model_.config();
  s.expert_tokens.assign(size_t(mc.n_expert), 0);
  for (int64_t il = 0; il < mc.n_layer; ++il)
    for (int64_t e = 0; e < mc.n_expert; ++e) s.expert_tokens[size_t(e)] += model_.expert_tokens(il, e);
  return s;
}

}  // namespace serval
