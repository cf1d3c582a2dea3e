// Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on top of the chat path: a
// Messages body is checked field by field and translated into the chat-completions body it means
// (system prompt, text / tool_use / tool_result blocks, tools and tool_choice, stop_sequences, thinking),
// which then goes through the same validation, template and engine as /v1/chat/completions. The reply
// side (content blocks, stop_reason, Anthropic's stream events) is in completion_run's Messages part.
// No I/O, so it is fuzzed with the other request parsers.
#pragma once
#include "server/api_request.h"

namespace serval {

// A /v1/messages body (count_only: a /v1/messages/count_tokens body, which has no max_tokens) as a
// /v1/chat/completions body. Throws ApiError (400) naming the field for anything refused.
json messages_to_chat(const json& body, bool count_only = false);

// An error in Anthropic's shape: {"type": "error", "error": {"type": "invalid_request_error", "message"}}.
json anthropic_error_json(const ApiError& e);

// Anthropic's stop_reason for a finished choice (its finish_reason, and the stop string that ended it,
// if one did): end_turn, max_tokens, stop_sequence, tool_use; null when the request was aborted (client
// gone, timeout, shutdown).
json anthropic_stop_reason(const std::string& finish_reason, const std::string& stop_string);

}  // namespace serval
