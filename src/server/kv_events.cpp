#include "server/kv_events.h"

#include <chrono>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "base/error.h"

namespace serval {

using Json = nlohmann::json;  // not serval::json (api_request.h: ordered_json)

namespace {

const char* tag_of(KvEvent::Kind k) {
  switch (k) {
    case KvEvent::Kind::BlockStored: return "BlockStored";
    case KvEvent::Kind::BlockRemoved: return "BlockRemoved";
    case KvEvent::Kind::AllBlocksCleared: return "AllBlocksCleared";
  }
  return "";
}

Json parent_json(const KvEvent& e) { return e.parent_hash ? Json(*e.parent_hash) : Json(nullptr); }

// vLLM's fields in declaration order (lora_id and lora_name are null: Serval has no adapters).
Json event_array(const KvEvent& e, const KvEventsConfig& cfg) {
  switch (e.kind) {
    case KvEvent::Kind::BlockStored:
      return Json::array({tag_of(e.kind), e.block_hashes, parent_json(e), e.token_ids, cfg.block_size, nullptr,
                          cfg.medium, nullptr});
    case KvEvent::Kind::BlockRemoved: return Json::array({tag_of(e.kind), e.block_hashes, cfg.medium});
    case KvEvent::Kind::AllBlocksCleared: break;
  }
  return Json::array({tag_of(e.kind)});
}

Json event_map(const KvEvent& e, const KvEventsConfig& cfg) {
  Json j = {{"type", tag_of(e.kind)}};
  if (e.kind == KvEvent::Kind::AllBlocksCleared) return j;
  j["block_hashes"] = e.block_hashes;
  if (e.kind == KvEvent::Kind::BlockStored) {
    j["parent_block_hash"] = parent_json(e);
    j["token_ids"] = e.token_ids;
    j["block_size"] = cfg.block_size;
    j["lora_id"] = nullptr;
    j["lora_name"] = nullptr;
  }
  j["medium"] = cfg.medium;
  return j;
}

bool binds(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

std::string seq_bytes(int64_t seq) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint64_t(seq) >> (56 - 8 * i) & 0xff);
  return out;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

void parse_kv_events_config(const std::string& text, KvEventsConfig& cfg) {
  const Json j = Json::parse(text, nullptr, false);
  check(j.is_object(), "--kv-events-config must be a JSON object");
  auto str = [&](const char* key, std::string& out) {
    if (!j.contains(key) || j[key].is_null()) return;
    check(j[key].is_string(), "--kv-events-config: {} must be a string", key);
    out = j[key].get<std::string>();
  };
  auto num = [&](const char* key, auto& out, int64_t lo) {
    if (!j.contains(key)) return;
    check(j[key].is_number_integer() && j[key].get<int64_t>() >= lo, "--kv-events-config: {} must be an integer >= {}", key, lo);
    out = j[key].get<std::remove_reference_t<decltype(out)>>();
  };
  auto flag = [&](const char* key, bool& out) {
    if (!j.contains(key)) return;
    check(j[key].is_boolean(), "--kv-events-config: {} must be a boolean", key);
    out = j[key].get<bool>();
  };
  std::string publisher = "zmq";
  str("publisher", publisher);
  check(publisher == "zmq" || publisher == "null", "--kv-events-config: publisher must be zmq or null");
  bool on = false;
  flag("enable_kv_cache_events", on);
  cfg.endpoint = on && publisher == "zmq" ? "tcp://*:5557" : "";
  std::string endpoint, replay, topic;
  str("endpoint", endpoint);
  str("replay_endpoint", replay);
  str("topic", topic);
  if (!cfg.endpoint.empty() && !endpoint.empty()) cfg.endpoint = endpoint;
  cfg.replay_endpoint = cfg.endpoint.empty() ? "" : replay;
  cfg.topic = topic;
  num("buffer_steps", cfg.buffer_steps, 1);
  num("hwm", cfg.hwm, 0);
}

std::string encode_kv_event_batch(double ts, const std::vector<KvEvent>& events, const KvEventsConfig& cfg) {
  const bool as_map = cfg.encoding == "map";
  Json list = Json::array();
  for (const auto& e : events) list.push_back(as_map ? event_map(e, cfg) : event_array(e, cfg));
  const Json batch = as_map ? Json{{"ts", ts}, {"events", std::move(list)}, {"data_parallel_rank", cfg.data_parallel_rank}}
                            : Json::array({ts, std::move(list), cfg.data_parallel_rank});
  const std::vector<uint8_t> bytes = Json::to_msgpack(batch);
  return {bytes.begin(), bytes.end()};
}

struct KvEventPublisher::Sockets {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::unique_ptr<zmq::socket_t> replay;
  std::deque<std::pair<int64_t, std::string>> buffer;  // (sequence, payload) of the latest batches
};

KvEventPublisher::KvEventPublisher(KvEventsConfig cfg) : cfg_(std::move(cfg)), sockets_(std::make_unique<Sockets>()) {
  check(cfg_.encoding == "array" || cfg_.encoding == "map", "KV events encoding must be array or map, not {}", cfg_.encoding);
  try {
    sockets_->pub.set(zmq::sockopt::sndhwm, cfg_.hwm);
    sockets_->pub.set(zmq::sockopt::linger, 1000);
    if (binds(cfg_.endpoint))
      sockets_->pub.bind(cfg_.endpoint);
    else
      sockets_->pub.connect(cfg_.endpoint);
    if (!cfg_.replay_endpoint.empty()) {
      sockets_->replay = std::make_unique<zmq::socket_t>(sockets_->ctx, zmq::socket_type::router);
      sockets_->replay->set(zmq::sockopt::linger, 0);
      sockets_->replay->bind(cfg_.replay_endpoint);
    }
  } catch (const zmq::error_t& e) {
    throw Error(fmt::format("KV events: cannot open {}: {}", cfg_.endpoint, e.what()));
  }
  thread_ = std::thread([this] { run(); });
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void KvEventPublisher::publish(std::vector<KvEvent> events) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(now_seconds(), std::move(events));
  }
  cv_.notify_all();
}

uint64_t KvEventPublisher::sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sent_;
}

void KvEventPublisher::run() {
  while (true) {
    std::deque<std::pair<double, std::vector<KvEvent>>> batches;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Short waits while a replay socket may have requests to answer.
      const auto wait = std::chrono::milliseconds(sockets_->replay ? 10 : 200);
      cv_.wait_for(lock, wait, [&] { return stopping_ || !queue_.empty(); });
      batches.swap(queue_);
      stop = stopping_;
    }
    for (const auto& [ts, events] : batches) send_batch(ts, events);
    if (sockets_->replay) serve_replays();
    if (stop) break;
  }
}

void KvEventPublisher::send_batch(double ts, const std::vector<KvEvent>& events) {
  int64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = int64_t(sent_++);
  }
  std::string payload = encode_kv_event_batch(ts, events, cfg_);
  const std::string seq_frame = seq_bytes(seq);
  // PUB never blocks: past the high-water mark ZeroMQ drops the message (subscribers see the gap in
  // the sequence numbers and ask the replay socket).
  sockets_->pub.send(zmq::buffer(cfg_.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
  sockets_->pub.send(zmq::buffer(seq_frame), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
  sockets_->pub.send(zmq::buffer(payload), zmq::send_flags::dontwait);
  if (!sockets_->replay) return;
  sockets_->buffer.emplace_back(seq, std::move(payload));
  while (int64_t(sockets_->buffer.size()) > cfg_.buffer_steps) sockets_->buffer.pop_front();
}

// A request is [identity, "", start sequence (8 bytes, big-endian)]; the answer is every buffered
// batch from that sequence on as [identity, "", sequence, payload], then [identity, "", -1, ""].
void KvEventPublisher::serve_replays() {
  auto& router = *sockets_->replay;
  while (true) {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(router, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
    if (frames.size() != 3 || frames[2].size() != 8) continue;  // malformed: ignored
    uint64_t start = 0;
    for (size_t i = 0; i < 8; ++i) start = start << 8 | uint8_t(frames[2].data<char>()[i]);
    const std::string id = frames[0].to_string();
    auto reply = [&](const std::string& seq, const std::string& payload) {
      router.send(zmq::buffer(id), zmq::send_flags::sndmore);
      router.send(zmq::buffer(std::string()), zmq::send_flags::sndmore);
      router.send(zmq::buffer(seq), zmq::send_flags::sndmore);
      router.send(zmq::buffer(payload), zmq::send_flags::none);
    };
    for (const auto& [seq, payload] : sockets_->buffer)
      if (uint64_t(seq) >= start) reply(seq_bytes(seq), payload);
    reply(seq_bytes(-1), "");
  }
}

}  // namespace serval
