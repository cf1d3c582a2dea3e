// OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) on top of the chat path: a
// Responses body (input items, instructions, function tools, text.format, previous_response_id) is
// checked and translated into the chat-completions body it means; the reply side (output items and the
// response.* stream events) is in completion_run's Responses part. Stored responses live in a bounded
// in-memory ResponseStore, the oldest dropped first. No I/O.
#pragma once
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "server/api_request.h"

namespace serval {

// Responses kept for previous_response_id and GET /v1/responses/{id}: at most `capacity` of them and
// `max_bytes` of JSON in all; the oldest go first. Thread-safe.
class ResponseStore {
 public:
  struct Entry {
    json response;      // the response object as returned
    json conversation;  // the chat messages up to and including its output (without its instructions)
  };
  explicit ResponseStore(size_t capacity, size_t max_bytes = size_t(256) << 20);
  void put(const std::string& id, json response, json conversation);
  std::optional<Entry> get(const std::string& id) const;
  size_t capacity() const { return capacity_; }

 private:
  mutable std::mutex mu_;
  size_t capacity_, max_bytes_, bytes_ = 0;
  std::deque<std::string> order_;  // oldest first
  std::unordered_map<std::string, std::pair<Entry, size_t>> items_;  // with its size in bytes
};

// A Responses request as the chat request it means.
struct ResponsesJob {
  json chat;          // a /v1/chat/completions body
  json conversation;  // its messages without the instructions (what a later previous_response_id continues)
  json echo;          // the request's settings the response object repeats (instructions, tools, text, ...)
  bool store = true;
};

// Throws ApiError (400, naming the field) for anything refused, a previous_response_id not in `store` included.
ResponsesJob responses_to_chat(const json& body, const ResponseStore& store);

}  // namespace serval
