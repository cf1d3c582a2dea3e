// JSON Schema to GBNF: the grammar of the JSON texts a schema accepts, for constrained decoding.
// The supported keywords and how each is enforced are listed in docs/structured-output.md; a schema
// using anything else is refused with serval::Error naming the keyword and where it is (a JSON
// pointer), never silently unenforced.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace serval::grammar {

// GBNF text whose rule "root" matches the JSON values valid under `schema` (with bounded
// whitespace between tokens). Throws serval::Error for an unsupported or invalid schema.
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema);

// GBNF text whose rule "root" matches any JSON object (response_format json_object).
std::string json_object_gbnf();

}  // namespace serval::grammar
