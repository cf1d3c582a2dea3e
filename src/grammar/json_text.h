// Shared by the JSON Schema and regex converters (src/grammar): JSON string content.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace serval::grammar::detail {

// Whether JSON must escape the character inside a string (controls, '"' and '\').
inline bool needs_json_escape(uint32_t c) { return c < 0x20 || c == '"' || c == '\\'; }
// JSON's escape for such a character, as nlohmann writes it (short forms, else \u00XX).
std::string json_escape(uint32_t c);
// A regular expression's language as JSON string content (what goes between the quotes), and the
// shortest and longest match in characters (SIZE_MAX: unbounded).
std::string regex_to_json_string_gbnf(std::string_view pattern, std::string_view name, size_t* min_length,
                                      size_t* max_length);

}  // namespace serval::grammar::detail
