// Regular expressions to GBNF, for vLLM's `regex` / `guided_regex` and JSON Schema's `pattern`.
// The supported syntax (a subset of ECMAScript / Python `re` without backreferences or lookaround)
// is listed in docs/structured-output.md; anything else is refused with serval::Error naming it.
#pragma once
#include <string>
#include <string_view>

namespace serval::grammar {

// GBNF text defining rule `name` (and helper rules named "<name>-...") that matches exactly the
// strings the whole pattern matches (as Python's re.fullmatch). `^` at the start and `$` at the end
// are accepted and mean nothing more. Throws serval::Error for unsupported or invalid syntax.
std::string regex_to_gbnf(std::string_view pattern, std::string_view name = "root");

}  // namespace serval::grammar
