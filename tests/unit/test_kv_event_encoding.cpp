// KV event batches as msgpack bytes, written out by hand from the msgpack specification.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "server/kv_events.h"

namespace serval {
namespace {

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(char(x));
  return s;
}

std::string str8(const std::string& s) { return char(0xa0 | int(s.size())) + s; }  // fixstr

TEST(KvEventEncoding, ArrayLayoutBytes) {
  KvEventsConfig cfg;
  cfg.block_size = 2;
  const std::vector<KvEvent> events = {
      {KvEvent::Kind::BlockStored, {1}, std::nullopt, {7, 8}},
      {KvEvent::Kind::BlockRemoved, {300}, std::nullopt, {}},
      {KvEvent::Kind::AllBlocksCleared, {}, std::nullopt, {}},
  };
  std::string want = bytes({0x93, 0xcb, 0x3f, 0xb9, 0x99, 0x99, 0x99, 0x99, 0x99, 0x9a, 0x93});  // [0.1, [3 events], ...
  want += bytes({0x98}) + str8("BlockStored") + bytes({0x91, 0x01, 0xc0, 0x92, 0x07, 0x08, 0x02, 0xc0}) + str8("CPU") +
          bytes({0xc0});
  want += bytes({0x93}) + str8("BlockRemoved") + bytes({0x91, 0xcd, 0x01, 0x2c}) + str8("CPU");
  want += bytes({0x91}) + bytes({0xb0}) + "AllBlocksCleared";
  want += bytes({0x00});  // data_parallel_rank
  EXPECT_EQ(encode_kv_event_batch(0.1, events, cfg), want);
}

TEST(KvEventEncoding, MapLayoutNamesEveryField) {
  KvEventsConfig cfg;
  cfg.encoding = "map";
  const std::vector<KvEvent> events = {{KvEvent::Kind::BlockStored, {0xffffffffffffffffull}, 5, {1}}};
  cfg.block_size = 1;
  const auto j = nlohmann::json::from_msgpack(encode_kv_event_batch(2.0, events, cfg));
  EXPECT_EQ(j["ts"], 2.0);
  EXPECT_EQ(j["data_parallel_rank"], 0);
  const auto& e = j["events"][0];
  EXPECT_EQ(e["type"], "BlockStored");
  EXPECT_EQ(e["block_hashes"][0].get<uint64_t>(), 0xffffffffffffffffull) << "hashes are unsigned 64-bit";
  EXPECT_EQ(e["parent_block_hash"], 5);
  EXPECT_EQ(e["token_ids"], nlohmann::json::array({1}));
  EXPECT_EQ(e["block_size"], 1);
  EXPECT_EQ(e["medium"], "CPU");
  EXPECT_TRUE(e["lora_id"].is_null());
}

TEST(KvEventEncoding, VllmConfigJson) {
  KvEventsConfig cfg;
  parse_kv_events_config(R"({"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"})", cfg);
  EXPECT_EQ(cfg.endpoint, "tcp://*:5557");
  EXPECT_EQ(cfg.topic, "kv");
  parse_kv_events_config(R"({"enable_kv_cache_events": false, "endpoint": "tcp://*:1"})", cfg);
  EXPECT_FALSE(cfg.enabled());
  EXPECT_THROW(parse_kv_events_config("[1]", cfg), Error);
  EXPECT_THROW(parse_kv_events_config(R"({"publisher": "kafka"})", cfg), Error);
  EXPECT_THROW(parse_kv_events_config(R"({"hwm": -1})", cfg), Error);
}

TEST(KvEventEncoding, BadEndpointIsAnError) {
  KvEventsConfig cfg;
  cfg.endpoint = "nonsense://x";
  EXPECT_THROW(KvEventPublisher p(cfg), Error);
}

}  // namespace
}  // namespace serval
