// KV cache events for KV-aware routers, in vLLM's event schema: batches of BlockStored / BlockRemoved /
// AllBlocksCleared, msgpack over a ZeroMQ PUB socket as [topic, 8-byte big-endian sequence, payload],
// with an optional ROUTER socket that replays recent batches from a sequence number on.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kv/kv_events.h"

namespace serval {

struct KvEventsConfig {
  // PUB address; empty: no events. Bound when it names a wildcard (`tcp://*:5557`), `::`, ipc:// or
  // inproc://, connected otherwise (as vLLM decides).
  std::string endpoint;
  std::string replay_endpoint;  // ROUTER address for replays; empty: none
  std::string topic;            // first frame of every message
  // "array": each event a tagged array, the batch [ts, events, data_parallel_rank] (vLLM's layout up
  // to v0.11, read by llm-d and Dynamo). "map": the same fields as maps with a "type" tag (vLLM's
  // current msgspec layout).
  std::string encoding = "array";
  int64_t buffer_steps = 10000;  // batches kept for replay
  int hwm = 100000;              // ZeroMQ send high-water mark
  int data_parallel_rank = 0;
  int32_t block_size = 16;  // tokens per block, stated in BlockStored
  std::string medium = "CPU";

  bool enabled() const { return !endpoint.empty(); }
};

// vLLM's `--kv-events-config` JSON (enable_kv_cache_events, publisher, endpoint, replay_endpoint,
// buffer_steps, hwm, topic) into `cfg`; throws Error naming a bad field.
void parse_kv_events_config(const std::string& json_text, KvEventsConfig& cfg);

// One batch's msgpack payload (the third frame).
std::string encode_kv_event_batch(double ts, const std::vector<KvEvent>& events, const KvEventsConfig& cfg);

class KvEventPublisher {
 public:
  // Opens the sockets; throws Error when an address cannot be bound or is malformed.
  explicit KvEventPublisher(KvEventsConfig cfg);
  ~KvEventPublisher();  // sends what is queued (within a second), then closes
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Queues one batch stamped with the current time; any thread, never blocks on the network.
  void publish(std::vector<KvEvent> events);
  // Batches sent so far (the next sequence number).
  uint64_t sent() const;

 private:
  struct Sockets;
  KvEventsConfig cfg_;
  std::unique_ptr<Sockets> sockets_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<double, std::vector<KvEvent>>> queue_;
  uint64_t sent_ = 0;
  bool stopping_ = false;
  std::thread thread_;

  void run();
  void send_batch(double ts, const std::vector<KvEvent>& events);
  void serve_replays();
};

}  // namespace serval
