// JSON Schema to GBNF. A Converter walks the schema and writes one rule per referenced definition,
// per property or item schema that is more than a name, and a few helper rules; the fixed JSON
// rules (ws, string, number, ...) are appended at the end, only those used.
//
// - `$ref`s become rules, made once per target, so recursive schemas become recursive rules. A
//   reference that comes back to itself before an object or array is opened would be left
//   recursion, and is refused.
// - allOf (and $ref with sibling keywords) is merged keyword by keyword into one schema; anyOf and
//   oneOf with sibling keywords distribute the siblings into each branch.
// - Objects: declared properties in order; the comma rules (`rest` rules) cover every combination
//   of optional properties. Additional properties, where allowed, come after the declared ones and
//   their keys are any key but the declared ones (a trie of the declared keys).
// - Integer bounds become digit-range grammars built on decimal strings (exact for any size).
#include "grammar/json_schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "base/utf8.h"
#include "grammar/gbnf.h"
#include "grammar/json_text.h"

namespace serval::grammar {

namespace {

using json = nlohmann::ordered_json;

constexpr int64_t kMaxCount = 10000;  // the largest minItems, maxItems, minLength, maxLength
constexpr size_t kMaxDigits = 20;     // digits of a number's integer part (and of its fraction)
constexpr size_t kMaxNameLength = 64;
constexpr int kMaxDepth = 200;               // nesting of schemas (the converter recurses)
constexpr size_t kMaxGrammarSize = 1 << 20;  // the GBNF parser's limit on text
const std::string kQuote = R"("\"")";  // the GBNF literal of a double quote
const std::string kSep = R"(ws "," ws )";

// ---- The fixed JSON rules ----

struct Primitive {
  const char* name;
  const char* body;
  const char* deps;  // the primitives it uses, space-separated
};

const Primitive kPrimitives[] = {
    {"ws", R"(([ \t] | "\r"? "\n" [ \t]{0,40})?)", ""},
    {"value", "object | array | string | number | boolean | null", "object array string number boolean null"},
    {"object", R"("{" ws (string ws ":" ws value (ws "," ws string ws ":" ws value)* ws)? "}")", "ws string value"},
    {"array", R"("[" ws (value (ws "," ws value)* ws)? "]")", "ws value"},
    {"string", R"("\"" string-char* "\"")", "string-char"},
    {"string-char",
     R"([^"\\\x00-\x1F] | "\\" ["\\/bfnrt] | "\\u" string-bmp | )"
     R"("\\u" [dD] [89abAB] hex hex "\\u" [dD] [c-fC-F] hex hex)",
     "string-bmp hex"},
    {"string-bmp", R"([0-9a-cA-CeEfF] hex hex hex | [dD] [0-7] hex hex)", "hex"},
    {"hex", "[0-9a-fA-F]", ""},
    {"key-char", R"([^"\\\x00-\x1F] | key-escape)", "key-escape"},
    {"key-escape", R"("\\" ["\\bfnrt] | "\\u00" ("0" [0-7bef] | "1" [0-9a-f]))", ""},
    {"number", R"("-"? int-part frac? exp?)", "int-part frac exp"},
    {"integer", R"("-"? int-part)", "int-part"},
    {"int-part", R"("0" | [1-9] [0-9]{0,19})", ""},
    {"frac", R"("." [0-9]{1,20})", ""},
    {"exp", R"([eE] [-+]? [0-9]{1,3})", ""},
    {"boolean", R"("true" | "false")", ""},
    {"null", R"("null")", ""},
};

// ---- Keywords ----

const std::set<std::string, std::less<>> kIgnored = {
    "title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "discriminator", "$anchor", "$defs", "definitions"};

const std::set<std::string, std::less<>> kObjectWords = {
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "dependentRequired", "dependentSchemas", "dependencies"};
const std::set<std::string, std::less<>> kArrayWords = {"items", "prefixItems", "additionalItems", "minItems",
                                                        "maxItems", "uniqueItems"};
const std::set<std::string, std::less<>> kStringWords = {"minLength", "maxLength", "pattern", "format"};
const std::set<std::string, std::less<>> kNumberWords = {"minimum", "maximum", "exclusiveMinimum",
                                                         "exclusiveMaximum", "multipleOf"};
const std::set<std::string, std::less<>> kOtherWords = {"type", "enum", "const", "nullable",
                                                        "$ref", "allOf", "anyOf", "oneOf"};

bool known_keyword(const std::string& k) {
  return kObjectWords.count(k) || kArrayWords.count(k) || kStringWords.count(k) || kNumberWords.count(k) ||
         kOtherWords.count(k);
}

constexpr unsigned kNull = 1, kBool = 2, kObject = 4, kArray = 8, kString = 16, kInteger = 32, kNumber = 64;
constexpr unsigned kAllTypes = 127;

// A type name's set of values: "number" includes the integers.
unsigned type_bits(const std::string& name) {
  static const std::map<std::string, unsigned> bits = {
      {"null", kNull}, {"boolean", kBool}, {"object", kObject}, {"array", kArray},
      {"string", kString}, {"integer", kInteger}, {"number", kNumber | kInteger}};
  auto it = bits.find(name);
  return it == bits.end() ? 0 : it->second;
}

unsigned value_bits(const json& v) {
  if (v.is_null()) return kNull;
  if (v.is_boolean()) return kBool;
  if (v.is_object()) return kObject;
  if (v.is_array()) return kArray;
  if (v.is_string()) return kString;
  if (v.is_number_integer()) return kNumber | kInteger;
  const double d = v.get<double>();
  return std::floor(d) == d ? kNumber | kInteger : kNumber;
}

// ---- Small helpers ----

std::string where(const std::string& ptr) { return ptr.empty() ? "/" : ptr; }

std::string child(const std::string& ptr, std::string_view key) {
  std::string out = ptr + "/";
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}
std::string child(const std::string& ptr, std::string_view key, size_t index) {
  return child(ptr, key) + "/" + std::to_string(index);
}

bool is_name(const std::string& e) {
  return !e.empty() && std::all_of(e.begin(), e.end(), [](char c) { return std::isalnum(uint8_t(c)) || c == '-'; });
}

// A valid, readable rule name: [a-zA-Z0-9-]+, no all-digit part (the GBNF parser names its helper
// rules "<parent>-<n>").
std::string sanitize(std::string_view hint) {
  std::string out;
  for (char c : hint) {
    if (std::isalnum(uint8_t(c))) {
      if (std::isdigit(uint8_t(c)) && (out.empty() || out.back() == '-')) out += 'n';
      out += c;
    } else if (!out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  if (out.size() > kMaxNameLength) out.resize(kMaxNameLength);
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "r" : out;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (p.empty()) continue;
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

std::string seq(const std::string& a, const std::string& b) { return join({a, b}, " "); }

// Alternatives as one atom: parenthesized when there are several.
std::string group(const std::vector<std::string>& alts) {
  return alts.size() == 1 ? alts[0] : "(" + join(alts, " | ") + ")";
}

// `atom` repeated min..max times (max < 0: no bound); empty when max == 0.
std::string repeat(const std::string& atom, int64_t min, int64_t max) {
  if (max == 0) return "";
  if (min == 1 && max == 1) return atom;
  if (min == 0 && max == 1) return atom + "?";
  if (max < 0) return atom + (min == 0 ? "*" : min == 1 ? "+" : fmt::format("{{{},}}", min));
  return atom + (min == max ? fmt::format("{{{}}}", min) : fmt::format("{{{},{}}}", min, max));
}

// A character as JSON writes it inside a string (nlohmann's spelling of escapes).
std::string json_unit(uint32_t c) { return detail::needs_json_escape(c) ? detail::json_escape(c) : utf8_encode(c); }

std::string class_char(uint32_t c) {
  if (c == '\\' || c == ']' || c == '[' || c == '-' || c == '^') return fmt::format("\\{}", char(c));
  if (c < 0x20 || c == 0x7F) return fmt::format("\\x{:02X}", c);
  if (c < 0x80) return std::string(1, char(c));
  return c <= 0xFFFF ? fmt::format("\\u{:04X}", c) : fmt::format("\\U{:08X}", c);
}

// ---- Exact integers as decimal strings ----

struct Int {
  bool neg = false;
  std::string mag = "0";  // no leading zeros
};

int mag_cmp(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  return a.compare(b) < 0 ? -1 : a.compare(b) > 0 ? 1 : 0;
}

std::string mag_inc(std::string m) {
  size_t i = m.size();
  while (i > 0 && m[i - 1] == '9') m[--i] = '0';
  if (i == 0) return "1" + m;
  ++m[i - 1];
  return m;
}

std::string mag_dec(std::string m) {  // m > 0
  size_t i = m.size();
  while (m[i - 1] == '0') m[--i] = '9';
  --m[i - 1];
  const size_t nz = m.find_first_not_of('0');
  return nz == std::string::npos ? "0" : m.substr(nz);
}

Int inc(Int x) {
  if (!x.neg) return {false, mag_inc(x.mag)};
  x.mag = mag_dec(x.mag);
  x.neg = x.mag != "0";
  return x;
}

Int dec(Int x) {
  if (x.neg) return {true, mag_inc(x.mag)};
  if (x.mag == "0") return {true, "1"};
  return {false, mag_dec(x.mag)};
}

int cmp(const Int& a, const Int& b) {
  if (a.neg != b.neg) return a.neg ? -1 : 1;
  return a.neg ? -mag_cmp(a.mag, b.mag) : mag_cmp(a.mag, b.mag);
}

Int parse_int(const std::string& s) {
  Int x{s[0] == '-', s[0] == '-' ? s.substr(1) : s};
  if (x.mag == "0") x.neg = false;
  return x;
}

// v rounded up (lower bounds) or down (upper bounds); *exact: v was an integer.
Int to_int(const json& v, bool up, bool* exact) {
  if (v.is_number_integer()) {
    *exact = true;
    return parse_int(v.dump());
  }
  const double d = v.get<double>();
  const double r = up ? std::ceil(d) : std::floor(d);
  *exact = r == d;
  return parse_int(fmt::format("{:.0f}", r));
}

struct Bound {
  Int value;
  bool exclusive = false;
};

// ---- Digit-range grammars ----

std::string lit(const std::string& s) { return gbnf_literal(s); }

std::string digit_class(char a, char b) {
  if (a == b) return lit(std::string(1, a));
  return a == '0' && b == '9' ? "[0-9]" : fmt::format("[{}-{}]", a, b);
}

// Digit strings of one length from lo to hi (lo <= hi; leading zeros are ordinary digits here).
std::string fixed_range(const std::string& lo, const std::string& hi) {
  size_t p = 0;
  while (p < lo.size() && lo[p] == hi[p]) ++p;
  const std::string prefix = p ? lit(lo.substr(0, p)) : "";
  if (p == lo.size()) return prefix;
  const std::string a = lo.substr(p + 1), b = hi.substr(p + 1);
  const bool a_low = a.find_first_not_of('0') == std::string::npos;
  const bool b_high = b.find_first_not_of('9') == std::string::npos;
  const char from = a_low ? lo[p] : char(lo[p] + 1), to = b_high ? hi[p] : char(hi[p] - 1);
  std::vector<std::string> alts;
  if (!a_low) alts.push_back(seq(lit(lo.substr(p, 1)), fixed_range(a, std::string(a.size(), '9'))));
  if (from <= to) alts.push_back(seq(digit_class(from, to), repeat("[0-9]", int64_t(a.size()), int64_t(a.size()))));
  if (!b_high) alts.push_back(seq(lit(hi.substr(p, 1)), fixed_range(std::string(b.size(), '0'), b)));
  return seq(prefix, group(alts));
}

// Decimal numerals (no leading zeros) of the integers lo..hi (no hi: up to kMaxDigits digits).
// Empty when there are none.
std::string nonneg_range(const std::string& lo, std::optional<std::string> hi) {
  if (hi && hi->size() > kMaxDigits) hi = std::string(kMaxDigits, '9');
  if (lo.size() > kMaxDigits || (hi && mag_cmp(lo, *hi) > 0)) return "";
  std::vector<std::string> alts;
  const size_t last = hi ? hi->size() : lo.size();
  size_t run = 0;  // first length of a run of complete lengths (10..99, 100..999, ...)
  auto flush = [&](size_t end) {
    if (run) alts.push_back(seq("[1-9]", repeat("[0-9]", int64_t(run - 1), int64_t(end - 1))));
    run = 0;
  };
  for (size_t d = lo.size(); d <= last; ++d) {
    const std::string a = d == lo.size() ? lo : "1" + std::string(d - 1, '0');
    const std::string b = hi && d == hi->size() ? *hi : std::string(d, '9');
    if (d >= 2 && a == "1" + std::string(d - 1, '0') && b == std::string(d, '9')) {
      if (!run) run = d;
      continue;
    }
    flush(d - 1);
    alts.push_back(fixed_range(a, b));
  }
  flush(last);
  if (!hi && lo.size() < kMaxDigits) {
    alts.push_back(seq("[1-9]", repeat("[0-9]", int64_t(lo.size()), int64_t(kMaxDigits - 1))));
  }
  return group(alts);
}

// The integers in [lo, hi] (inclusive bounds; either may be absent). Empty when there are none.
std::string integer_range(const std::optional<Int>& lo, const std::optional<Int>& hi) {
  std::vector<std::string> alts;
  if (!lo || lo->neg) {  // negative integers -m, m from mlo to mhi
    const std::string mlo = hi && hi->neg ? hi->mag : "1";
    const std::string r = nonneg_range(mlo, lo ? std::optional(lo->mag) : std::nullopt);
    if (!r.empty()) alts.push_back(seq(lit("-"), r));
  }
  if (!hi || !hi->neg) {
    const std::string r = nonneg_range(lo && !lo->neg ? lo->mag : "0", hi ? std::optional(hi->mag) : std::nullopt);
    if (!r.empty()) alts.push_back(r);
  }
  return join(alts, " | ");
}

// Non-negative decimals I or I.F between the integers lo and hi (no hi: unbounded); `frac` is the
// rule of an arbitrary fraction. Empty when there are none.
std::string decimal_range(const std::string& lo, bool lo_ex, const std::optional<std::string>& hi, bool hi_ex) {
  const std::string any = "frac?", zero = R"(("." "0"{1,20})?)";
  const std::string nonzero = R"("." "0"{0,19} [1-9] [0-9]{0,19})";  // a fraction above zero
  if (hi && mag_cmp(lo, *hi) > 0) return "";
  if (hi && lo == *hi) return lo_ex || hi_ex ? "" : seq(lit(lo), zero);
  std::vector<std::string> alts{seq(lit(lo), lo_ex ? nonzero : any)};
  const std::string mid_lo = mag_inc(lo);
  const std::optional<std::string> mid_hi = hi ? std::optional(mag_dec(*hi)) : std::nullopt;
  if (!mid_hi || mag_cmp(mid_lo, *mid_hi) <= 0) {
    const std::string r = nonneg_range(mid_lo, mid_hi);
    if (!r.empty()) alts.push_back(seq(r, any));
  }
  if (hi && !hi_ex) alts.push_back(seq(lit(*hi), zero));
  return group(alts);
}

// Numbers (without exponent) between integer bounds.
std::string number_range(const std::optional<Bound>& lo, const std::optional<Bound>& hi) {
  std::vector<std::string> alts;
  if (!lo || lo->value.neg) {  // -y: y <= -lo, and y >= -hi (or y > 0)
    const bool hi_neg = hi && hi->value.neg;
    const std::string r = decimal_range(hi_neg ? hi->value.mag : "0", hi_neg ? hi->exclusive : true,
                                        lo ? std::optional(lo->value.mag) : std::nullopt, lo && lo->exclusive);
    if (!r.empty()) alts.push_back(seq(lit("-"), r));
  }
  if (!hi || !hi->value.neg) {
    const bool lo_pos = lo && !lo->value.neg;
    const std::string r = decimal_range(lo_pos ? lo->value.mag : "0", lo_pos && lo->exclusive,
                                        hi ? std::optional(hi->value.mag) : std::nullopt, hi && hi->exclusive);
    if (!r.empty()) alts.push_back(r);
  }
  return join(alts, " | ");
}

// ---- Formats, as regular expressions ----

const char* const kDate =
    R"((?:\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|)"
    R"(02-(?:0[1-9]|1\d|2[0-8]))|)"
    R"((?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26]|00)00)-02-29))";
const char* const kTime = R"((?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,9})?(?:[Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d))";

std::string format_regex(const std::string& format) {
  const std::string label = R"([A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)";
  const std::string atom = R"([A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)";
  const std::string octet = R"((?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))";
  if (format == "date") return kDate;
  if (format == "time") return kTime;
  if (format == "date-time") return std::string(kDate) + "[Tt]" + kTime;
  if (format == "uuid") return "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
  if (format == "ipv4") return octet + R"((?:\.)" + octet + "){3}";
  if (format == "email") return atom + R"((?:\.)" + atom + ")*@" + label + R"((?:\.)" + label + ")*";
  return "";
}

// ---- The converter ----

class Converter {
 public:
  explicit Converter(const json& root) : root_(root) {
    for (const Primitive& p : kPrimitives) taken_.insert(p.name);
  }

  std::string run();

 private:
  const json& root_;
  std::vector<std::pair<std::string, std::string>> rules_;  // in order of creation
  std::set<std::string> taken_;
  std::set<std::string> used_;                   // primitives used
  std::map<std::string, std::string> ref_rules_;  // JSON pointer -> rule
  std::vector<std::string> head_refs_;            // refs entered since the last '{' or '['
  std::vector<std::string> flattening_;          // refs being merged inline by flatten()
  std::map<std::string, std::string> merged_rules_;  // a merged schema's text -> the rule holding it
  std::set<std::string> merged_names_;
  int depth_ = 0;                                 // expr() calls in progress

  std::string prim(const std::string& name) {
    used_.insert(name);
    return name;
  }
  std::string new_rule(const std::string& hint);
  void set_rule(const std::string& name, std::string body);
  void drop_rule(const std::string& name);
  std::string hoist(const std::string& hint, const std::string& body) {
    const std::string name = new_rule(hint);
    set_rule(name, body);
    return name;
  }

  void check_schema(const json& s, const std::string& ptr) const;
  std::string ref_target(const json& ref, const std::string& ptr) const;
  const json& resolve(const std::string& target, const std::string& ptr) const;
  unsigned type_set(const json& s, const std::string& ptr, bool infer) const;

  std::string expr(const json& s, const std::string& ptr, const std::string& hint);
  std::string sub(const json& s, const std::string& ptr, const std::string& hint, bool merged = false);
  std::string merged_expr(const json& merged, const std::string& ptr, const std::string& hint);
  std::string ref_rule(const json& ref, const std::string& ptr);
  json flatten(const json& s, const std::string& ptr);
  json merge(json a, json b, const std::string& ptr) const;
  std::string union_expr(const json& s, const std::string& ptr, const std::string& hint);
  void check_exclusive(const std::vector<json>& branches, const std::vector<std::string>& ptrs,
                       const std::string& ptr);
  std::string enum_expr(const json& s, const std::string& ptr) const;
  std::string typed_expr(const json& s, const std::string& ptr, const std::string& hint);
  std::string object_expr(const json& s, const std::string& ptr, const std::string& hint);
  std::string object_body(const std::vector<std::pair<std::string, bool>>& members, const std::string& extra,
                          const std::string& hint);
  std::string extra_key(const std::vector<std::string>& names, const std::string& hint);
  std::string array_expr(const json& s, const std::string& ptr, const std::string& hint);
  std::string string_expr(const json& s, const std::string& ptr, const std::string& hint);
  std::string pattern_expr(const json& s, const std::string& ptr, const std::string& hint, int64_t lo, int64_t hi);
  std::string number_expr(const json& s, const std::string& ptr, bool integer);
  std::optional<Bound> bound(const json& s, const std::string& ptr, bool lower, bool integer) const;
};

std::string Converter::new_rule(const std::string& hint) {
  const std::string base = sanitize(hint);
  std::string name = base;
  for (int k = 2; taken_.count(name); ++k) name = fmt::format("{}-v{}", base, k);
  taken_.insert(name);
  rules_.push_back({name, ""});
  return name;
}

void Converter::set_rule(const std::string& name, std::string body) {
  for (auto& r : rules_) {
    if (r.first == name) r.second = std::move(body);
  }
}

void Converter::drop_rule(const std::string& name) {
  std::erase_if(rules_, [&](const auto& r) { return r.first == name; });
  taken_.erase(name);
}

// Refuses what is not a schema, and every keyword that is neither enforced nor an annotation.
void Converter::check_schema(const json& s, const std::string& ptr) const {
  if (!s.is_object()) fail("a JSON Schema must be an object or a boolean at {}", where(ptr));
  for (const auto& [k, v] : s.items()) {
    if (k == "$id" && !ptr.empty() && !(v.is_string() && v.get<std::string>().starts_with("#"))) {
      fail("'$id' inside a schema (it changes how $ref resolves) is not supported at {}", where(ptr));
    }
    if (!kIgnored.count(k) && !known_keyword(k)) fail("unsupported JSON Schema keyword '{}' at {}", k, where(ptr));
  }
}

std::string Converter::ref_target(const json& ref, const std::string& ptr) const {
  if (!ref.is_string()) fail("'$ref' must be a string at {}", where(ptr));
  const std::string r = ref.get<std::string>();
  if (r.empty() || r[0] != '#') fail("external $ref '{}' is not supported (only '#...' pointers) at {}", r, where(ptr));
  std::string target;  // the fragment, percent-decoded
  for (size_t i = 1; i < r.size(); ++i) {
    if (r[i] == '%' && i + 2 < r.size() && std::isxdigit(uint8_t(r[i + 1])) && std::isxdigit(uint8_t(r[i + 2]))) {
      target += char(std::stoi(r.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      target += r[i];
    }
  }
  if (!target.empty() && target[0] != '/') fail("$ref to an anchor ('{}') is not supported at {}", r, where(ptr));
  return target;
}

const json& Converter::resolve(const std::string& target, const std::string& ptr) const {
  const json* cur = &root_;
  size_t pos = 0;
  while (pos < target.size()) {
    const size_t next = std::min(target.find('/', pos + 1), target.size());
    std::string token;
    for (size_t i = pos + 1; i < next; ++i) {
      if (target[i] == '~' && i + 1 < next && (target[i + 1] == '0' || target[i + 1] == '1')) {
        token += target[++i] == '0' ? '~' : '/';
      } else {
        token += target[i];
      }
    }
    pos = next;
    if (cur->is_object() && cur->contains(token)) {
      cur = &cur->at(token);
    } else if (cur->is_array() && !token.empty() && token.size() < 10 &&
               std::all_of(token.begin(), token.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
               std::stoul(token) < cur->size()) {
      cur = &cur->at(std::stoul(token));
    } else {
      fail("$ref target '#{}' does not exist (at {})", target, where(ptr));
    }
  }
  return *cur;
}

// The types a schema's values may have: its `type` (and `nullable`); without one, the types its
// keywords constrain when `infer` (a subset of what is valid), else every type.
unsigned Converter::type_set(const json& s, const std::string& ptr, bool infer) const {
  unsigned t = 0;
  if (s.contains("type")) {
    const json& ty = s["type"];
    const json list = ty.is_array() ? ty : json::array({ty});
    for (const json& n : list) {
      const unsigned b = n.is_string() ? type_bits(n.get<std::string>()) : 0;
      if (!b) fail("invalid 'type' {} at {}", n.dump(), where(ptr));
      t |= b;
    }
    if (!t) fail("empty 'type' at {}", where(ptr));
  } else if (infer) {
    for (const auto& [k, v] : s.items()) {
      t |= kObjectWords.count(k) ? kObject : kArrayWords.count(k) ? kArray : 0;
      t |= kStringWords.count(k) ? kString : kNumberWords.count(k) ? kNumber | kInteger : 0;
    }
  }
  if (!t) t = kAllTypes;
  if (s.contains("nullable")) {
    if (!s["nullable"].is_boolean()) fail("'nullable' must be a boolean at {}", where(ptr));
    if (s["nullable"].get<bool>()) t |= kNull;
  }
  return t;
}

bool has_validation(const json& s, std::string_view except = "") {
  for (const auto& [k, v] : s.items()) {
    if (!kIgnored.count(k) && k != except) return true;
  }
  return false;
}

std::string Converter::run() {
  taken_.insert("root");
  rules_.push_back({"root", ""});
  ref_rules_[""] = "root";
  head_refs_ = {""};
  set_rule("root", expr(root_, "", "root"));
  std::string out;
  for (const auto& [name, body] : rules_) out += fmt::format("{} ::= {}\n", name, body);
  for (bool grew = true; grew;) {  // add the primitives the used ones need
    grew = false;
    for (const Primitive& p : kPrimitives) {
      if (!used_.count(p.name)) continue;
      std::string_view deps = p.deps;
      while (!deps.empty()) {
        const size_t sp = std::min(deps.find(' '), deps.size());
        grew |= used_.insert(std::string(deps.substr(0, sp))).second;
        deps.remove_prefix(std::min(sp + 1, deps.size()));
      }
    }
  }
  for (const Primitive& p : kPrimitives) {
    if (used_.count(p.name)) out += fmt::format("{} ::= {}\n", p.name, p.body);
  }
  if (out.size() > kMaxGrammarSize) fail("JSON Schema too complex: its grammar is over {} bytes", kMaxGrammarSize);
  return out;
}

std::string Converter::expr(const json& s, const std::string& ptr, const std::string& hint) {
  struct Depth {
    int& d;
    ~Depth() { --d; }
  } depth{++depth_};
  if (depth_ > kMaxDepth) fail("JSON Schema nested more than {} levels deep", kMaxDepth);
  if (s.is_boolean()) {
    if (s.get<bool>()) return prim("value");
    fail("schema false (no value is valid) at {}", where(ptr));
  }
  check_schema(s, ptr);
  if (s.contains("$ref") && !has_validation(s, "$ref")) return ref_rule(s["$ref"], ptr);
  if (s.contains("$ref") || s.contains("allOf")) {
    return merged_expr(flatten(s, ptr), ptr, hint);
  }
  if (s.contains("anyOf") || s.contains("oneOf")) return union_expr(s, ptr, hint);
  if (s.contains("enum") || s.contains("const")) return enum_expr(s, ptr);
  return typed_expr(s, ptr, hint);
}

// A merged schema (flatten's result) is the body of rule `hint`, known by its text: a recursive
// reference that merges to the same schema again becomes a reference to that rule.
std::string Converter::merged_expr(const json& merged, const std::string& ptr, const std::string& hint) {
  const std::string key = "merged " + merged.dump();
  if (std::find(head_refs_.begin(), head_refs_.end(), key) != head_refs_.end()) {
    fail("the schema at {} reaches itself through $ref before any object or array is opened (left recursion)",
         where(ptr));
  }
  if (auto it = merged_rules_.find(key); it != merged_rules_.end()) return it->second;
  merged_rules_[key] = hint;
  merged_names_.insert(hint);
  head_refs_.push_back(key);
  const std::string e = expr(merged, ptr, hint);
  head_refs_.pop_back();
  return e;
}

// A rule name (or a primitive's) for the schema: a rule of its own unless it is a single name.
// `merged`: s is the result of flatten().
std::string Converter::sub(const json& s, const std::string& ptr, const std::string& hint, bool merged) {
  if (s.is_object() && s.contains("$ref") && !has_validation(s, "$ref")) {
    check_schema(s, ptr);
    return ref_rule(s["$ref"], ptr);
  }
  const std::string name = new_rule(hint);
  const std::string e = merged ? merged_expr(s, ptr, name) : expr(s, ptr, name);
  if (is_name(e) && !merged_names_.count(name)) {
    drop_rule(name);
    return e;
  }
  set_rule(name, e);
  return name;
}

std::string Converter::ref_rule(const json& ref, const std::string& ptr) {
  const std::string target = ref_target(ref, ptr);
  if (std::find(head_refs_.begin(), head_refs_.end(), target) != head_refs_.end()) {
    fail("$ref '#{}' at {} reaches itself before any object or array is opened (left recursion)", target,
         where(ptr));
  }
  if (auto it = ref_rules_.find(target); it != ref_rules_.end()) return it->second;
  const size_t slash = target.rfind('/');
  const std::string name = new_rule(target.substr(slash + 1));
  ref_rules_[target] = name;
  head_refs_.push_back(target);
  set_rule(name, expr(resolve(target, ptr), target, name));
  head_refs_.pop_back();
  return name;
}

// The schema with its top-level $ref and allOf merged into one schema (see merge).
json Converter::flatten(const json& s, const std::string& ptr) {
  if (s.is_boolean()) {
    if (s.get<bool>()) return json::object();
    fail("schema false (no value is valid) at {}", where(ptr));
  }
  check_schema(s, ptr);
  json out = s;
  if (out.contains("$ref")) {
    const std::string target = ref_target(out["$ref"], ptr);
    if (std::find(flattening_.begin(), flattening_.end(), target) != flattening_.end()) {
      fail("$ref '#{}' merges itself through allOf or $ref at {}", target, where(ptr));
    }
    flattening_.push_back(target);
    out.erase("$ref");
    out = merge(flatten(resolve(target, ptr), target), out, ptr);
    flattening_.pop_back();
  }
  if (out.contains("allOf")) {
    const json branches = out["allOf"];
    out.erase("allOf");
    if (!branches.is_array() || branches.empty()) fail("'allOf' must be a non-empty array at {}", where(ptr));
    for (size_t i = 0; i < branches.size(); ++i) out = merge(out, flatten(branches[i], child(ptr, "allOf", i)), ptr);
  }
  return out;
}

// Both schemas at once (as allOf).
json both(const json& x, const json& y) {
  if (x == y || (y.is_boolean() && y.get<bool>()) || (x.is_boolean() && !x.get<bool>())) return x;
  if ((x.is_boolean() && x.get<bool>()) || (y.is_boolean() && !y.get<bool>())) return y;
  return json{{"allOf", json::array({x, y})}};
}

// Merges two flattened schemas keyword by keyword; refuses what it cannot combine.
json Converter::merge(json a, json b, const std::string& ptr) const {
  // A property one side declares and the other does not must satisfy the other's additionalProperties.
  auto cross = [](json& x, const json& y) {
    if (!y.contains("additionalProperties") || !x.contains("properties") || !x["properties"].is_object()) return;
    for (auto& [name, sub] : x["properties"].items()) {
      if (!(y.contains("properties") && y["properties"].contains(name))) sub = both(sub, y["additionalProperties"]);
    }
  };
  cross(a, b);
  cross(b, a);
  static const std::set<std::string, std::less<>> take_max = {"minimum", "exclusiveMinimum", "minLength",
                                                              "minItems", "minProperties"};
  static const std::set<std::string, std::less<>> take_min = {"maximum", "exclusiveMaximum", "maxLength",
                                                              "maxItems", "maxProperties"};
  for (const auto& [k, v] : b.items()) {
    if (!a.contains(k)) {
      a[k] = v;
      continue;
    }
    json& cur = a[k];
    if (cur == v || kIgnored.count(k)) continue;
    if (k == "type") {
      const unsigned t = type_set(a, ptr, false) & type_set(b, ptr, false);
      if (!(t & ~kNull) && !(t & kNull)) fail("the allOf branches have no 'type' in common at {}", where(ptr));
      json names = json::array();
      for (const char* n : {"null", "boolean", "object", "array", "string", "number", "integer"}) {
        const unsigned bits = type_bits(n);
        if ((t & bits) == bits && !(std::string(n) == "integer" && (t & kNumber))) names.push_back(n);
      }
      cur = names;
    } else if (k == "properties" && cur.is_object() && v.is_object()) {
      for (const auto& [p, sub] : v.items()) cur[p] = cur.contains(p) ? both(cur[p], sub) : sub;
    } else if (k == "required" && cur.is_array() && v.is_array()) {
      for (const json& n : v) {
        if (std::find(cur.begin(), cur.end(), n) == cur.end()) cur.push_back(n);
      }
    } else if ((k == "additionalProperties" || k == "items") && !cur.is_array() && !v.is_array()) {
      cur = both(cur, v);
    } else if ((take_max.count(k) || take_min.count(k)) && cur.is_number() && v.is_number()) {
      const bool greater = v.get<double>() > cur.get<double>();
      if (greater == bool(take_max.count(k))) cur = v;
    } else if (k == "enum" && cur.is_array() && v.is_array()) {
      json common = json::array();
      for (const json& x : cur) {
        if (std::find(v.begin(), v.end(), x) != v.end()) common.push_back(x);
      }
      cur = common;
    } else if (k == "uniqueItems" && cur.is_boolean() && v.is_boolean()) {
      cur = cur.get<bool>() || v.get<bool>();
    } else {
      fail("keyword '{}' with different values in several allOf branches (or next to $ref) is not supported at {}",
           k, where(ptr));
    }
  }
  return a;
}

std::string Converter::union_expr(const json& s, const std::string& ptr, const std::string& hint) {
  if (s.contains("anyOf") && s.contains("oneOf")) {
    fail("'anyOf' together with 'oneOf' is not supported at {}", where(ptr));
  }
  const std::string key = s.contains("anyOf") ? "anyOf" : "oneOf";
  const json& branches = s[key];
  if (!branches.is_array() || branches.empty()) fail("'{}' must be a non-empty array at {}", key, where(ptr));
  json rest = s;
  rest.erase(key);
  const bool has_rest = has_validation(rest);
  std::vector<std::string> alts, ptrs;
  std::vector<json> used;
  for (size_t i = 0; i < branches.size(); ++i) {
    const std::string bptr = child(ptr, key, i);
    if (branches[i].is_boolean() && !branches[i].get<bool>()) continue;
    const json branch = has_rest ? merge(flatten(rest, ptr), flatten(branches[i], bptr), bptr) : branches[i];
    const std::string e = sub(branch, bptr, fmt::format("{}-{}{}", hint, key, i), has_rest);
    if (std::find(alts.begin(), alts.end(), e) == alts.end()) alts.push_back(e);
    used.push_back(branch);
    ptrs.push_back(bptr);
  }
  if (alts.empty()) fail("no branch of '{}' can be satisfied at {}", key, where(ptr));
  if (key == "oneOf") check_exclusive(used, ptrs, ptr);
  return join(alts, " | ");
}

// What a schema's valid values can be, for telling oneOf branches apart.
struct Shape {
  unsigned types = kAllTypes;
  std::optional<std::vector<json>> values;     // enum / const
  std::map<std::string, std::vector<json>> tags;  // required properties with enum / const values
};

bool share_value(const std::vector<json>& a, const std::vector<json>& b) {
  return std::any_of(a.begin(), a.end(), [&](const json& x) { return std::find(b.begin(), b.end(), x) != b.end(); });
}

Shape shape_of(const json& s, unsigned types) {
  Shape sh;
  sh.types = types;
  if (s.contains("const")) sh.values = std::vector<json>{s["const"]};
  if (s.contains("enum") && s["enum"].is_array()) {
    std::vector<json> vals(s["enum"].begin(), s["enum"].end());
    if (sh.values) std::erase_if(vals, [&](const json& v) { return v != (*sh.values)[0]; });
    sh.values = vals;
  }
  if (sh.values) {
    std::erase_if(*sh.values, [&](const json& v) { return !(value_bits(v) & types); });
    sh.types = 0;
    for (const json& v : *sh.values) sh.types |= value_bits(v);
  }
  if (sh.types != kObject || !s.contains("required") || !s.contains("properties")) return sh;
  for (const json& name : s["required"]) {
    if (!name.is_string() || !s["properties"].contains(name.get<std::string>())) continue;
    const json& p = s["properties"][name.get<std::string>()];
    if (p.is_object() && p.contains("const")) sh.tags[name.get<std::string>()] = {p["const"]};
    else if (p.is_object() && p.contains("enum") && p["enum"].is_array()) {
      sh.tags[name.get<std::string>()] = std::vector<json>(p["enum"].begin(), p["enum"].end());
    }
  }
  return sh;
}

bool disjoint(const Shape& a, const Shape& b) {
  if (!(a.types & b.types)) return true;
  if (a.values && b.values) return !share_value(*a.values, *b.values);
  for (const auto& [name, vals] : a.tags) {
    auto it = b.tags.find(name);
    if (it != b.tags.end() && !share_value(vals, it->second)) return true;
  }
  return false;
}

// oneOf is written as alternatives, which is exact only when no value matches two branches.
void Converter::check_exclusive(const std::vector<json>& branches, const std::vector<std::string>& ptrs,
                                const std::string& ptr) {
  std::vector<Shape> shapes;
  for (size_t i = 0; i < branches.size(); ++i) {
    const json flat = flatten(branches[i], ptrs[i]);
    const unsigned types = type_set(flat, ptrs[i], false);
    shapes.push_back(flat.contains("anyOf") || flat.contains("oneOf") ? Shape{types, {}, {}} : shape_of(flat, types));
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (size_t j = i + 1; j < shapes.size(); ++j) {
      if (!disjoint(shapes[i], shapes[j])) {
        fail("'oneOf' at {}: branches {} and {} may both match a value; only branches told apart by type, by "
             "const/enum values or by a required property's const/enum are supported (use anyOf if overlap is fine)",
             where(ptr), i, j);
      }
    }
  }
}

std::string Converter::enum_expr(const json& s, const std::string& ptr) const {
  for (const auto& [k, v] : s.items()) {
    if (!kIgnored.count(k) && k != "enum" && k != "const" && k != "type" && k != "nullable") {
      fail("'{}' together with 'enum' or 'const' is not supported at {}", k, where(ptr));
    }
  }
  if (s.contains("enum") && (!s["enum"].is_array() || s["enum"].empty())) {
    fail("'enum' must be a non-empty array at {}", where(ptr));
  }
  const Shape sh = shape_of(s, type_set(s, ptr, false));
  std::vector<std::string> alts;
  for (const json& v : *sh.values) {
    const std::string l = lit(v.dump());
    if (std::find(alts.begin(), alts.end(), l) == alts.end()) alts.push_back(l);
  }
  if (alts.empty()) fail("no value of 'enum'/'const' is valid under the schema at {}", where(ptr));
  return join(alts, " | ");
}

std::string Converter::typed_expr(const json& s, const std::string& ptr, const std::string& hint) {
  const unsigned types = type_set(s, ptr, true);
  bool constrained = false;
  for (const auto& [k, v] : s.items()) constrained |= !kIgnored.count(k) && !kOtherWords.count(k);
  if (types == kAllTypes && !constrained) return prim("value");
  std::vector<std::string> alts;
  if (types & kObject) alts.push_back(object_expr(s, ptr, hint));
  if (types & kArray) alts.push_back(array_expr(s, ptr, hint));
  if (types & kString) alts.push_back(string_expr(s, ptr, hint));
  if (types & kInteger) alts.push_back(number_expr(s, ptr, !(types & kNumber)));
  if (types & kBool) alts.push_back(prim("boolean"));
  if (types & kNull) alts.push_back(prim("null"));
  return join(alts, " | ");
}

// A non-negative integer keyword up to kMaxCount (default when absent).
int64_t count_keyword(const json& s, const std::string& key, int64_t absent, const std::string& ptr) {
  if (!s.contains(key)) return absent;
  const json& v = s[key];
  const bool integral =
      v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
  if (!integral || v.get<double>() < 0) fail("'{}' must be a non-negative integer at {}", key, where(ptr));
  if (v.get<double>() > double(kMaxCount)) fail("'{}' above {} is not supported at {}", key, kMaxCount, where(ptr));
  return v.get<int64_t>();
}

bool trivial_schema(const json& s) {
  return (s.is_boolean() && s.get<bool>()) || (s.is_object() && !has_validation(s));
}

void check_object_keywords(const json& s, const std::string& ptr, size_t n_required, size_t n_all, bool extra) {
  for (const char* k : {"patternProperties", "dependentRequired", "dependentSchemas", "dependencies"}) {
    if (s.contains(k) && !(s[k].is_object() && s[k].empty())) {
      fail("unsupported JSON Schema keyword '{}' at {}", k, where(ptr));
    }
  }
  if (s.contains("propertyNames") && !trivial_schema(s["propertyNames"])) {
    fail("unsupported JSON Schema keyword 'propertyNames' at {}", where(ptr));
  }
  if (count_keyword(s, "minProperties", 0, ptr) > int64_t(n_required)) {
    fail("unsupported JSON Schema keyword 'minProperties' (above the number of required properties) at {}", where(ptr));
  }
  const int64_t max = count_keyword(s, "maxProperties", -1, ptr);
  if (max >= 0 && (extra || int64_t(n_all) > max)) {
    fail("unsupported JSON Schema keyword 'maxProperties' (below the number of possible properties) at {}", where(ptr));
  }
}

std::string Converter::object_expr(const json& s, const std::string& ptr, const std::string& hint) {
  const json empty = json::object();
  const json& props = s.contains("properties") ? s["properties"] : empty;
  const json& required = s.contains("required") ? s["required"] : json::array();
  if (!props.is_object()) fail("'properties' must be an object at {}", where(ptr));
  auto is_string = [](const json& r) { return r.is_string(); };
  if (!required.is_array() || !std::all_of(required.begin(), required.end(), is_string)) {
    fail("'required' must be an array of strings at {}", where(ptr));
  }
  const json* ap = s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
  const bool ap_false = ap && ap->is_boolean() && !ap->get<bool>();
  const std::string ap_ptr = child(ptr, "additionalProperties");
  const auto saved = std::exchange(head_refs_, {});
  std::vector<std::pair<std::string, bool>> members;  // "key" ws ":" ws value; required
  std::vector<std::string> names;                     // every declared key
  auto member = [&](const std::string& name, const std::string& value) {
    return seq(lit(json(name).dump()), R"(ws ":" ws )" + value);
  };
  auto is_required = [&](const std::string& n) {
    return std::find(required.begin(), required.end(), n) != required.end();
  };
  for (const auto& [name, schema] : props.items()) {
    names.push_back(name);
    const std::string pptr = child(child(ptr, "properties"), name);
    if (schema.is_boolean() && !schema.get<bool>()) {
      if (is_required(name)) fail("required property '{}' has schema false at {}", name, where(pptr));
      continue;
    }
    members.push_back({member(name, sub(schema, pptr, hint + "-" + name)), is_required(name)});
  }
  for (const json& r : required) {
    const std::string name = r.get<std::string>();
    if (props.contains(name) || std::find(names.begin(), names.end(), name) != names.end()) continue;
    if (ap_false) {
      fail("required property '{}' is not allowed by 'additionalProperties': false at {}", name, where(ptr));
    }
    names.push_back(name);
    members.push_back({member(name, ap ? sub(*ap, ap_ptr, hint + "-" + name) : prim("value")), true});
  }
  // Other keys: where additionalProperties allows them; absent, only for an object schema without
  // `properties` (any object). Otherwise only the declared properties are generated.
  std::string extra;
  if ((ap && !ap_false) || (!ap && !s.contains("properties"))) {
    const std::string value = !ap || trivial_schema(*ap) ? prim("value") : sub(*ap, ap_ptr, hint + "-additional");
    extra = seq(extra_key(names, hint), R"(ws ":" ws )" + value);
  }
  head_refs_ = saved;
  const size_t n_required = size_t(std::count_if(members.begin(), members.end(), [](auto& m) { return m.second; }));
  check_object_keywords(s, ptr, n_required, members.size(), !extra.empty());
  prim("ws");
  return object_body(members, extra, hint);
}

// Members in order, optional ones present or not, then any number of extra members; a comma
// between every two. rest(i) is what may follow once a member before i was written; first(i) the
// non-empty rest starting at i when nothing was written yet.
std::string Converter::object_body(const std::vector<std::pair<std::string, bool>>& members,
                                   const std::string& extra, const std::string& hint) {
  std::string rest = extra.empty() ? "" : "(" + kSep + extra + ")*";
  std::string first = extra.empty() ? "" : seq(extra, rest);
  size_t first_optional = members.size();
  for (size_t i = 0; i < members.size() && first_optional == members.size(); ++i) {
    if (!members[i].second) first_optional = i;
  }
  for (size_t i = members.size(); i-- > 0;) {
    const auto& [kv, required] = members[i];
    std::string next_first = seq(kv, rest);
    if (!required && !first.empty()) next_first += " | " + first;
    rest = required ? seq(kSep + kv, rest) : seq("(" + kSep + kv + ")?", rest);
    first = next_first;
    // rest(i) is used by rest(i-1) and first(i-1): a rule of its own once first() branches.
    if (i > 0 && first_optional < i && !rest.empty() && !is_name(rest)) {
      rest = hoist(fmt::format("{}-rest{}", hint, i), rest);
    }
  }
  if (first.empty()) return R"("{" ws "}")";
  const bool nullable = first_optional == 0 &&
                        std::none_of(members.begin(), members.end(), [](auto& m) { return m.second; });
  if (nullable) return R"("{" ws (()" + first + R"() ws)? "}")";
  return R"("{" ws ()" + first + R"() ws "}")";
}

// Any key but `names`: JSON strings in a canonical spelling (non-control characters unescaped,
// nlohmann's escapes otherwise) so a key has one spelling, and a trie of the names' spellings.
std::string Converter::extra_key(const std::vector<std::string>& names, const std::string& hint) {
  if (names.empty()) return prim("string");
  struct Node {
    std::map<std::string, size_t> kids;
    bool terminal = false;
  };
  std::vector<Node> trie(1);
  for (const std::string& name : names) {
    size_t n = 0;
    for (uint32_t c : utf8_decode(name)) {
      const std::string unit = json_unit(c);
      auto it = trie[n].kids.find(unit);
      if (it == trie[n].kids.end()) {
        trie.emplace_back();
        it = trie[n].kids.emplace(unit, trie.size() - 1).first;
      }
      n = it->second;
    }
    trie[n].terminal = true;
  }
  std::vector<std::string> rule(trie.size());
  for (size_t i = 0; i < trie.size(); ++i) rule[i] = new_rule(fmt::format("{}-key{}", hint, i));
  prim("key-char");
  for (size_t i = 0; i < trie.size(); ++i) {
    std::vector<std::string> alts, escapes;
    std::string raw = R"([^"\\\x00-\x1F)";
    std::set<std::string> kid_escapes;
    for (const auto& [unit, kid] : trie[i].kids) {
      alts.push_back(seq(lit(unit), rule[kid]));
      if (unit[0] == '\\') kid_escapes.insert(unit);
      else raw += class_char(utf8_decode(unit)[0]);
    }
    std::vector<std::string> other{raw + "]"};
    if (kid_escapes.empty()) other.push_back("key-escape");
    for (uint32_t c = 0; c < 0x60 && !kid_escapes.empty(); ++c) {
      if (detail::needs_json_escape(c) && !kid_escapes.count(json_unit(c))) other.push_back(lit(json_unit(c)));
    }
    alts.push_back(seq(group(other), "key-char*"));
    const std::string body = join(alts, " | ");
    set_rule(rule[i], trie[i].terminal ? body : "(" + body + ")?");
  }
  return seq(seq(kQuote, rule[0]), kQuote);
}

std::string Converter::array_expr(const json& s, const std::string& ptr, const std::string& hint) {
  const bool legacy = s.contains("items") && s["items"].is_array() && !s.contains("prefixItems");
  const json no_prefix = json::array();
  const json& prefix = s.contains("prefixItems") ? s["prefixItems"] : legacy ? s["items"] : no_prefix;
  const std::string prefix_key = legacy ? "items" : "prefixItems";
  const std::string items_key = legacy ? "additionalItems" : "items";
  const json* items = s.contains(items_key) ? &s[items_key] : nullptr;
  if (!prefix.is_array() || (items && items->is_array())) fail("invalid '{}' at {}", items_key, where(ptr));
  const int64_t lo = count_keyword(s, "minItems", 0, ptr);
  int64_t hi = count_keyword(s, "maxItems", -1, ptr);
  const auto saved = std::exchange(head_refs_, {});
  std::vector<std::string> tuple;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (prefix[i].is_boolean() && !prefix[i].get<bool>()) break;  // no item i: at most i items
    tuple.push_back(sub(prefix[i], child(ptr, prefix_key, i), fmt::format("{}-item{}", hint, i)));
  }
  const int64_t k = int64_t(tuple.size());
  // Without `items`, a tuple gets no further items unless minItems needs them (a subset of the valid).
  const bool more = tuple.size() < prefix.size() ? false
                    : items                      ? !(items->is_boolean() && !items->get<bool>())
                                                 : prefix.empty() || lo > k;
  std::string item;
  if (more) {
    item = items && !trivial_schema(*items) ? sub(*items, child(ptr, items_key), hint + "-item") : prim("value");
  }
  head_refs_ = saved;
  if (!more) hi = hi < 0 ? k : std::min(hi, k);
  if (hi >= 0 && lo > hi) fail("no array satisfies 'minItems' with 'maxItems' and the items allowed at {}", where(ptr));
  if (s.contains("uniqueItems") && !s["uniqueItems"].is_boolean()) {
    fail("'uniqueItems' must be a boolean at {}", where(ptr));
  }
  if (s.value("uniqueItems", false) && !(hi >= 0 && hi <= 1)) {
    fail("unsupported JSON Schema keyword 'uniqueItems' at {}", where(ptr));
  }
  prim("ws");
  if (hi == 0) return R"("[" ws "]")";
  // The items after the tuple, each after a comma; then the tuple from its end.
  std::string tail = more ? repeat("(" + kSep + item + ")", std::max<int64_t>(0, lo - std::max<int64_t>(k, 1)),
                                   hi < 0 ? -1 : hi - std::max<int64_t>(k, 1))
                          : "";
  for (int64_t i = k - 1; i >= 1; --i) {
    const std::string t = seq(kSep + tuple[size_t(i)], tail);
    tail = i < lo ? t : "(" + t + ")?";
  }
  const std::string body = seq(k ? tuple[0] : item, tail);
  if (lo == 0) return R"("[" ws ()" + body + R"( ws)? "]")";
  return R"("[" ws )" + body + R"( ws "]")";
}

std::string Converter::string_expr(const json& s, const std::string& ptr, const std::string& hint) {
  const int64_t lo = count_keyword(s, "minLength", 0, ptr), hi = count_keyword(s, "maxLength", -1, ptr);
  if (hi >= 0 && lo > hi) fail("'minLength' above 'maxLength' at {}", where(ptr));
  if (s.contains("pattern") || s.contains("format")) return pattern_expr(s, ptr, hint, lo, hi);
  if (lo == 0 && hi < 0) return prim("string");
  return seq(seq(kQuote, repeat(prim("string-char"), lo, hi)), kQuote);
}

// A string matching `pattern` in full, or of a `format`, with every character unescaped but those
// JSON must escape.
std::string Converter::pattern_expr(const json& s, const std::string& ptr, const std::string& hint, int64_t lo,
                                    int64_t hi) {
  if (s.contains("pattern") && s.contains("format")) {
    fail("'format' together with 'pattern' is not supported at {}", where(ptr));
  }
  const std::string key = s.contains("pattern") ? "pattern" : "format";
  if (!s[key].is_string()) fail("'{}' must be a string at {}", key, where(ptr));
  const std::string value = s[key].get<std::string>();
  const std::string regex = key == "pattern" ? value : format_regex(value);
  if (regex.empty()) fail("unsupported 'format' value '{}' at {}", value, where(ptr));
  const std::string name = new_rule(hint + "-" + (key == "pattern" ? key : value));
  size_t min_len = 0, max_len = 0;
  std::string text;
  try {
    text = detail::regex_to_json_string_gbnf(regex, name, &min_len, &max_len);
  } catch (const Error& e) {
    fail("unsupported 'pattern' at {}: {}", where(ptr), e.what());
  }
  if (s.contains("minLength") && min_len < uint64_t(lo)) {
    fail("'minLength' together with '{}' is not supported (some matches are shorter) at {}", key, where(ptr));
  }
  if (s.contains("maxLength") && (max_len == std::numeric_limits<size_t>::max() || max_len > uint64_t(hi))) {
    fail("'maxLength' together with '{}' is not supported (some matches are longer) at {}", key, where(ptr));
  }
  set_rule(name, text.substr(name.size() + 5, text.size() - name.size() - 6));  // "name ::= body\n"
  return seq(seq(kQuote, name), kQuote);
}

// The tighter of minimum / exclusiveMinimum (or maximum / exclusiveMaximum); for integers made
// inclusive; for numbers it must be an integer.
std::optional<Bound> Converter::bound(const json& s, const std::string& ptr, bool lower, bool integer) const {
  const std::string inclusive = lower ? "minimum" : "maximum";
  const std::string exclusive = lower ? "exclusiveMinimum" : "exclusiveMaximum";
  const bool draft4 = s.contains(exclusive) && s[exclusive].is_boolean();
  std::optional<Bound> best;
  auto consider = [&](const std::string& key, bool strict) {
    if (!s[key].is_number()) fail("'{}' must be a number at {}", key, where(ptr));
    bool exact = false;
    Bound b{to_int(s[key], lower, &exact), strict && exact};
    if (!integer && !exact) fail("a non-integer '{}' for a number is not supported at {}", key, where(ptr));
    if (integer && b.exclusive) b = {lower ? inc(b.value) : dec(b.value), false};
    const int c = best ? cmp(b.value, best->value) : 0;
    if (!best || (lower ? c > 0 : c < 0) || (c == 0 && b.exclusive)) best = b;
  };
  if (s.contains(inclusive)) consider(inclusive, draft4 && s[exclusive].get<bool>());
  if (s.contains(exclusive) && !draft4) consider(exclusive, true);
  return best;
}

std::string Converter::number_expr(const json& s, const std::string& ptr, bool integer) {
  if (s.contains("multipleOf")) {
    if (!s["multipleOf"].is_number() || s["multipleOf"].get<double>() != 1.0) {
      fail("unsupported JSON Schema keyword 'multipleOf' (only 1) at {}", where(ptr));
    }
    integer = true;
  }
  const auto lo = bound(s, ptr, true, integer), hi = bound(s, ptr, false, integer);
  if (!lo && !hi) return prim(integer ? "integer" : "number");
  std::string e;
  if (integer) {
    e = integer_range(lo ? std::optional(lo->value) : std::nullopt, hi ? std::optional(hi->value) : std::nullopt);
  } else {
    prim("frac");
    e = number_range(lo, hi);
  }
  if (e.empty()) fail("no {} satisfies the bounds at {}", integer ? "integer" : "number", where(ptr));
  return e;
}

}  // namespace

std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema) {
  // Copying and comparing JSON values recurses: refuse absurd nesting up front (without recursing).
  std::vector<std::pair<const json*, int>> stack{{&schema, 0}};
  while (!stack.empty()) {
    auto [v, depth] = stack.back();
    stack.pop_back();
    if (depth > 4 * kMaxDepth) fail("JSON Schema nested more than {} levels deep", 4 * kMaxDepth);
    if (v->is_structured()) {
      for (const json& c : *v) stack.push_back({&c, depth + 1});
    }
  }
  try {
    return Converter(schema).run();
  } catch (const nlohmann::json::exception& e) {
    fail("invalid JSON Schema: {}", e.what());
  }
}

std::string json_object_gbnf() {
  std::string out = "root ::= object\n";
  for (const char* name : {"ws", "value", "object", "array", "string", "string-char", "string-bmp", "hex", "number",
                           "int-part", "frac", "exp", "boolean", "null"}) {
    for (const Primitive& p : kPrimitives) {
      if (p.name == std::string_view(name)) out += fmt::format("{} ::= {}\n", p.name, p.body);
    }
  }
  return out;
}

}  // namespace serval::grammar
