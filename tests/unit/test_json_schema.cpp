// JSON Schema to GBNF: for each feature, instances valid and invalid under the JSON Schema spec
// (written by hand, or computed by plain arithmetic for numeric bounds) against the grammar; then
// the schemas that must be refused, with the keyword and the JSON pointer in the message.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace serval::grammar {
namespace {

using json = nlohmann::ordered_json;
using Cases = std::vector<std::pair<std::string, bool>>;  // instance text, valid

json J(const char* text) { return json::parse(text); }

Grammar compile(const json& schema) { return parse_gbnf(json_schema_to_gbnf(schema)); }

void expect_cases(const json& schema, const Cases& cases) {
  const std::string text = json_schema_to_gbnf(schema);
  const Grammar g = parse_gbnf(text);
  for (const auto& [instance, valid] : cases) {
    if (valid) {
      EXPECT_TRUE(json::accept(instance)) << "bad test data: " << instance;  // the data itself is JSON
    }
    EXPECT_EQ(matches(g, instance), valid) << schema.dump() << "\non " << instance << "\n" << text;
  }
}

void expect_refused(const json& schema, const std::vector<std::string>& parts) {
  try {
    json_schema_to_gbnf(schema);
    ADD_FAILURE() << "accepted " << schema.dump();
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(JsonSchema, AnyValueAndJsonObject) {
  const Cases any = {{"1", true}, {"\"s\"", true}, {"null", true}, {"[1,{\"a\":[true,false]}]", true},
                     {"{\"a\":{\"b\":{\"c\":[]}}}", true}, {"-0.5e-3", true}, {"{", false}, {"[1,]", false},
                     {"01", false}, {"'a'", false}, {"nul", false}, {"{\"a\" 1}", false}, {"{a:1}", false}};
  expect_cases(json::object(), any);
  expect_cases(json(true), any);
  expect_cases(json{{"description", "anything"}, {"title", "t"}}, any);
  const Grammar obj = parse_gbnf(json_object_gbnf());
  EXPECT_TRUE(matches(obj, "{}"));
  EXPECT_TRUE(matches(obj, "{\"a\": [1, {\"b\": null}], \"c\": \"\\u00e9\"}"));
  EXPECT_FALSE(matches(obj, "[]"));
  EXPECT_FALSE(matches(obj, "\"a\""));
  EXPECT_FALSE(matches(obj, "{\"a\":}"));
}

TEST(JsonSchema, PrimitiveTypes) {
  expect_cases({{"type", "boolean"}}, {{"true", true}, {"false", true}, {"1", false}, {"True", false}});
  expect_cases({{"type", "null"}}, {{"null", true}, {"\"null\"", false}});
  expect_cases({{"type", "integer"}}, {{"0", true}, {"-12", true}, {"12345678901234567890", true}, {"1.5", false},
                                       {"01", false}, {"+1", false}, {"--1", false}, {"\"1\"", false}});
  expect_cases({{"type", "number"}}, {{"0", true}, {"-0", true}, {"1.5", true}, {"-1.5e10", true}, {"1E+2", true},
                                      {"0.001", true}, {"01", false}, {"1.", false}, {".5", false}, {"1e", false},
                                      {"0x1", false}, {"NaN", false}, {"Infinity", false}});
  expect_cases({{"type", json::array({"string", "null"})}},
               {{"\"a\"", true}, {"null", true}, {"1", false}, {"{}", false}});
  expect_cases({{"type", "integer"}, {"nullable", true}}, {{"3", true}, {"null", true}, {"\"3\"", false}});
}

TEST(JsonSchema, StringEscapesAndControlCharacters) {
  expect_cases({{"type", "string"}}, {
      {R"("")", true}, {R"("a\"b")", true}, {R"("\\ \/ \b \f \n \r \t")", true}, {R"("\u00e9\u00E9")", true},
      {R"("\ud83d\ude00")", true}, {"\"é日😀\"", true}, {"\"a\x01\"", false}, {"\"a\nb\"", false},
      {"\"\t\"", false}, {R"("\x41")", false}, {R"("\u12")", false}, {R"("\a")", false}, {R"("a)", false},
      {R"("a"")", false},
      // Lone surrogate escapes are no characters: refused (a choice; decoders such as nlohmann's reject them).
      {R"("\ud800")", false}, {R"("\udc00\ud800")", false}});
}

TEST(JsonSchema, StringLengthsCountCharacters) {
  expect_cases({{"type", "string"}, {"minLength", 2}, {"maxLength", 3}}, {
      {R"("ab")", true}, {R"("abc")", true}, {R"("a")", false}, {R"("abcd")", false}, {R"("a\n")", true},
      {R"("\n\t\"\\")", false}, {R"("\u00e9\u00e9\u00e9")", true}, {"\"éé\"", true}, {"\"日本語\"", true},
      {"\"日本語x\"", false}, {"\"😀😀😀😀\"", false}, {"\"😀\"", false},
      {R"("\ud83d\ude00\ud83d\ude00")", true},
      {R"("\ud83d\ude00")", false}});
  expect_cases({{"type", "string"}, {"maxLength", 0}}, {{R"("")", true}, {R"("a")", false}});
  expect_cases({{"minLength", 1}}, {{R"("a")", true}, {R"("")", false}});  // type inferred from the keyword
}

TEST(JsonSchema, PatternsAreFullMatches) {
  expect_cases({{"type", "string"}, {"pattern", "^[a-z]+\\d$"}},
               {{R"("ab1")", true}, {R"("z0")", true}, {R"("ab")", false}, {R"("Ab1")", false}, {R"("ab12")", false}});
  // Characters JSON escapes: the pattern a"b\c, then a tab and any one character but a newline.
  expect_cases({{"type", "string"}, {"pattern", "a\"b\\\\c\\t."}},
               {{R"("a\"b\\c\t\"")", true}, {R"("a\"b\\c\tx")", true}, {R"("a\"b\\c\t\\")", true},
                {R"("a\"b\\c\t\n")", false}, {R"("a"b\c\tx")", false}, {R"("a\"b\\c\t")", false}});
  expect_cases({{"type", "string"}, {"pattern", "^(ab){1,2}$"}, {"minLength", 2}, {"maxLength", 4}},
               {{R"("ab")", true}, {R"("abab")", true}, {R"("aba")", false}});  // lengths implied by the pattern
}

TEST(JsonSchema, Formats) {
  expect_cases({{"type", "string"}, {"format", "date"}}, {
      {R"("2024-02-29")", true}, {R"("2000-02-29")", true}, {R"("2023-02-28")", true}, {R"("2024-12-31")", true},
      {R"("2023-02-29")", false}, {R"("1900-02-29")", false}, {R"("2024-04-31")", false}, {R"("2024-13-01")", false},
      {R"("2024-00-10")", false}, {R"("2024-1-01")", false}, {R"("24-01-01")", false}});
  expect_cases({{"type", "string"}, {"format", "time"}}, {
      {R"("12:34:56Z")", true}, {R"("23:59:59.123+05:30")", true}, {R"("00:00:00-00:00")", true},
      {R"("24:00:00Z")", false}, {R"("12:34:56")", false}, {R"("12:60:00Z")", false}, {R"("12:34:56+5:30")", false}});
  expect_cases({{"type", "string"}, {"format", "date-time"}}, {
      {R"("2024-01-15T08:30:00Z")", true}, {R"("2024-01-15t08:30:00.5+01:00")", true},
      {R"("2024-01-15 08:30:00Z")", false}, {R"("2024-01-15T08:30Z")", false}});
  expect_cases({{"type", "string"}, {"format", "uuid"}}, {
      {R"("123e4567-e89b-12d3-a456-426614174000")", true}, {R"("123E4567-E89B-12D3-A456-426614174000")", true},
      {R"("123e4567e89b12d3a456426614174000")", false}, {R"("123e4567-e89b-12d3-a456-42661417400g")", false}});
  expect_cases({{"type", "string"}, {"format", "ipv4"}}, {
      {R"("192.168.0.1")", true}, {R"("0.0.0.0")", true}, {R"("255.255.255.255")", true},
      {R"("256.1.1.1")", false}, {R"("01.2.3.4")", false}, {R"("1.2.3")", false}});
  expect_cases({{"type", "string"}, {"format", "email"}}, {
      {R"("a.b@example.com")", true}, {R"("x+y@host")", true}, {R"("a@@b.com")", false}, {R"("@b.com")", false},
      {R"("a.@b.com")", false}, {R"("a@-b.com")", false}});
  expect_cases({{"type", "string"}, {"format", "uuid"}, {"maxLength", 36}, {"minLength", 36}},
               {{R"("123e4567-e89b-12d3-a456-426614174000")", true}});
}


// Every combination of present and absent properties, compact and pretty-printed: valid exactly
// when the required ones are present (the comma rules are where converters usually go wrong).
TEST(JsonSchema, OptionalPropertiesEveryCombination) {
  const std::vector<std::pair<std::string, json>> props = {{"a", 1}, {"b", "x"}, {"c", true}, {"d", nullptr}};
  const std::vector<std::vector<std::string>> required_sets = {{}, {"b"}, {"a", "d"}, {"c"}, {"a", "b", "c", "d"}};
  for (const auto& required : required_sets) {
    const json schema = {{"type", "object"},
                         {"properties", {{"a", {{"type", "integer"}}}, {"b", {{"type", "string"}}},
                                         {"c", {{"type", "boolean"}}}, {"d", {{"type", "null"}}}}},
                         {"required", required}};
    const Grammar g = compile(schema);
    for (int mask = 0; mask < 16; ++mask) {
      json inst = json::object();
      bool valid = true;
      for (int i = 0; i < 4; ++i) {
        const bool present = (mask >> i) & 1;
        if (present) inst[props[size_t(i)].first] = props[size_t(i)].second;
        if (!present && std::count(required.begin(), required.end(), props[size_t(i)].first)) valid = false;
      }
      EXPECT_EQ(matches(g, inst.dump()), valid) << schema.dump() << " on " << inst.dump();
      EXPECT_EQ(matches(g, inst.dump(2)), valid) << inst.dump(2);
      EXPECT_EQ(matches(g, inst.dump(4)), valid) << inst.dump(4);
    }
    for (const char* bad : {R"({"a":1,})", R"({,"a":1})", R"({"a":1,,"b":"x"})", R"({"a":1 "b":"x"})",
                            R"({"a":1,"b":"x","c":true,"d":null,})", R"({"a":1,"a":1})"}) {
      EXPECT_FALSE(matches(g, bad)) << bad;
    }
  }
}

TEST(JsonSchema, AdditionalProperties) {
  expect_cases({{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"additionalProperties", false}},
               {{R"({"a":1})", true}, {"{}", true}, {R"({"a":1,"b":2})", false}, {R"({"b":2})", false}});
  // true: other keys after the declared ones, but never a declared key (in any spelling) with a wrong value.
  expect_cases({{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}, {"ab", {{"type", "string"}}}}},
                {"additionalProperties", true}},
               {{R"({"a":1,"x":[1]})", true}, {R"({"b":null,"abc":1,"":2})", true}, {R"({"x":1,"y":{}})", true},
                {R"({"a":1,"ab":"s","a\"b":3,"é\n":4})", true}, {R"({"a":"s"})", false}, {R"({"\u0061":"s"})", false},
                {R"({"a\u0062":1})", false}, {R"({"x":1,"a":"s"})", false}});
  expect_cases({{"type", "object"}, {"properties", {{"name", {{"type", "string"}}}}}, {"required", {"name"}},
                {"additionalProperties", {{"type", "integer"}}}},
               {{R"({"name":"n","k":1,"j":2})", true}, {R"({"name":"n","k":"v"})", false}, {R"({"name":1})", false},
                {R"({"k":1})", false}});
  expect_cases({{"additionalProperties", {{"type", "integer"}}}}, {{R"({"x":1})", true}, {R"({"x":"1"})", false}});
  // Declared keys that JSON escapes are excluded from the other keys too.
  expect_cases(J(R"({"properties": {"n\nl": {"type": "integer"}, "q\"": {"type": "integer"}},
                     "additionalProperties": true})"),
               {{R"({"n\nl":1,"n\n":"s","q":"s","q\"\"":"s"})", true}, {R"({"n\nl":"s"})", false},
                {R"({"q\"":"s"})", false}, {R"({"n\u000al":"s"})", false}});
  // A required property that is not declared: any value (or the additionalProperties schema).
  expect_cases({{"required", {"x"}}}, {{R"({"x":{}})", true}, {R"({"x":1})", true}, {"{}", false}});
  expect_cases({{"properties", {{"a", false}}}, {"additionalProperties", true}},
               {{R"({"b":1})", true}, {R"({"a":1})", false}});
}

TEST(JsonSchema, EnumAndConst) {
  expect_cases({{"enum", {"a", 1, nullptr, {{"k", {1, 2}}}, json::array({true})}}},
               {{R"("a")", true}, {"1", true}, {"null", true}, {R"({"k":[1,2]})", true}, {"[true]", true},
                {R"("b")", false}, {"2", false}, {R"({"k":[1]})", false}, {"[false]", false}, {"true", false}});
  expect_cases({{"const", {{"a", {{"b", nullptr}}}}}},
               {{R"({"a":{"b":null}})", true}, {R"({"a":{"b":0}})", false}, {"{}", false}});
  expect_cases({{"type", "string"}, {"enum", {"x", "y", 3}}}, {{R"("x")", true}, {"3", false}});
  expect_cases({{"enum", {"é\"\n"}}}, {{R"("é\"\n")", true}, {R"("é\"")", false}});
  expect_cases({{"const", 2.5}}, {{"2.5", true}, {"2", false}});
}

TEST(JsonSchema, AnyOfOneOf) {
  expect_cases({{"anyOf", {{{"type", "string"}, {"maxLength", 2}}, {{"type", "integer"}, {"minimum", 0}}}}},
               {{R"("ab")", true}, {R"("abc")", false}, {"5", true}, {"-1", false}, {"true", false}});
  // Sibling keywords apply to every branch.
  expect_cases({{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}, {"b", {{"type", "integer"}}}}},
                {"anyOf", {{{"required", {"a"}}}, {{"required", {"b"}}}}}},
               {{"{}", false}, {R"({"a":1})", true}, {R"({"b":2})", true}, {R"({"a":1,"b":2})", true}});
  const json cat = J(R"({"type": "object", "required": ["kind"],
                         "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}})");
  const json dog = J(R"({"type": "object", "required": ["kind"],
                         "properties": {"kind": {"const": "dog"}, "bark": {"type": "boolean"}}})");
  expect_cases({{"oneOf", {cat, dog}}}, {{R"({"kind":"cat","lives":9})", true}, {R"({"kind":"dog","bark":true})", true},
                                        {R"({"kind":"cow"})", false}, {R"({"lives":9})", false}});
  expect_cases({{"oneOf", {{{"type", "string"}}, {{"type", "null"}}, {{"enum", {1, 2}}}}}},
               {{R"("s")", true}, {"null", true}, {"2", true}, {"3", false}});
}

TEST(JsonSchema, AllOfAndRefWithSiblings) {
  const json base = {{"type", "object"}, {"properties", {{"id", {{"type", "integer"}}}}}, {"required", {"id"}}};
  const json extension = J(R"({"properties": {"extra": {"type": "boolean"}}, "required": ["extra"]})");
  expect_cases({{"$defs", {{"Base", base}}}, {"allOf", {{{"$ref", "#/$defs/Base"}}, extension}}},
               {{R"({"id":1,"extra":true})", true}, {R"({"id":1})", false}, {R"({"extra":true})", false},
                {R"({"id":"x","extra":true})", false}});
  expect_cases({{"allOf", {{{"type", "integer"}, {"minimum", 0}}, {{"maximum", 10}}, {{"maximum", 20}}}}},
               {{"0", true}, {"10", true}, {"-1", false}, {"11", false}});
  // The first branch forbids every property it does not declare, so b is never allowed.
  expect_cases({{"allOf", {{{"properties", {{"a", {{"type", "integer"}}}}}, {"additionalProperties", false}},
                           {{"properties", {{"b", {{"type", "integer"}}}}}}}}},
               {{R"({"a":1})", true}, {R"({"a":1,"b":2})", false}, {R"({"b":2})", false}});
  expect_cases({{"$defs", {{"S", {{"type", "string"}, {"minLength", 2}}}}}, {"$ref", "#/$defs/S"}, {"maxLength", 3}},
               {{R"("ab")", true}, {R"("abc")", true}, {R"("a")", false}, {R"("abcd")", false}});
}

TEST(JsonSchema, RefsAndRecursion) {
  const json tree = J(R"({"type": "object", "required": ["value"],
                          "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}}})");
  expect_cases(tree, {{R"({"value":1,"children":[{"value":2},{"value":3,"children":[{"value":4,"children":[]}]}]})",
                       true},
                      {R"({"value":1,"children":[{}]})", false},
                      {R"({"value":1,"children":[{"value":2,"children":[1]}]})", false}});
  const json list = J(R"({"$ref": "#/$defs/Node",
                          "$defs": {"Node": {
                              "type": "object", "required": ["v", "next"],
                              "properties": {"v": {"type": "integer"},
                                             "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}}})");
  expect_cases(list, {{R"({"v":1,"next":{"v":2,"next":null}})", true}, {R"({"v":1,"next":{"v":2}})", false}});
  // Recursion through a $ref with sibling keywords: the merged schema becomes a recursive rule too.
  const json nested = J(R"({"$ref": "#/$defs/N",
                            "$defs": {"N": {"type": "object",
                                            "properties": {"v": {"type": "integer"},
                                                           "c": {"$ref": "#/$defs/N", "required": ["v"]}}}}})");
  expect_cases(nested, {{R"({"c":{"v":1,"c":{"v":2}}})", true}, {"{}", true}, {R"({"c":{"c":{"v":1}}})", false},
                        {R"({"c":{"v":1,"c":{}}})", false}});
  const json defs = {{"type", "object"}, {"definitions", {{"pos", {{"type", "integer"}, {"minimum", 1}}}}},
                     {"properties", {{"a", {{"$ref", "#/definitions/pos"}}}, {"b", {{"$ref", "#/properties/a"}}},
                                     {"c", {{"$ref", "#/definitions/pos"}}}}}};
  expect_cases(defs, {{R"({"a":1,"b":2,"c":3})", true}, {R"({"a":1,"b":0})", false}, {R"({"c":0})", false}});
  const std::string text = json_schema_to_gbnf(defs);
  EXPECT_EQ(text.find("pos ::="), text.rfind("pos ::=")) << text;  // one rule for the repeated $ref
  const json escaped = J(R"({"$defs": {"a/b": {"type": "integer"}, "c~d": {"type": "string"}, "e f": {"type": "null"}},
                             "type": "array",
                             "prefixItems": [{"$ref": "#/$defs/a~1b"}, {"$ref": "#/$defs/c~0d"},
                                             {"$ref": "#/$defs/e%20f"}]})");
  expect_cases(escaped, {{R"([1,"s",null])", true}, {R"(["s",1,null])", false}});
}

TEST(JsonSchema, Arrays) {
  const Grammar g = compile({{"type", "array"}, {"items", {{"type", "integer"}}}, {"minItems", 2}, {"maxItems", 4}});
  for (int n = 0; n <= 6; ++n) {
    json a = json::array();
    for (int i = 0; i < n; ++i) a.push_back(i);
    EXPECT_EQ(matches(g, a.dump()), n >= 2 && n <= 4) << a.dump();
    EXPECT_EQ(matches(g, a.dump(2)), n >= 2 && n <= 4) << a.dump(2);
  }
  EXPECT_FALSE(matches(g, R"([1,"2"])"));
  const json tuple = J(R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                           "items": false})");
  expect_cases(tuple,
               {{"[]", true}, {R"(["a"])", true}, {R"(["a",1])", true}, {R"(["a",1,2])", false}, {"[1]", false}});
  expect_cases(J(R"({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"},
                     "minItems": 2})"),
               {{R"(["a",true,false])", true}, {R"(["a"])", false}, {R"(["a","b"])", false}});
  expect_cases({{"type", "array"}, {"items", {{{"type", "null"}}, {{"type", "integer"}}}}, {"additionalItems", false}},
               {{"[null,1]", true}, {"[null,1,2]", false}});  // draft 4-2019 tuple form
  expect_cases({{"type", "array"}, {"uniqueItems", true}, {"maxItems", 1}},
               {{"[]", true}, {"[1]", true}, {"[1,1]", false}});
  expect_cases({{"type", "array"}, {"maxItems", 0}}, {{"[]", true}, {"[ ]", true}, {"[1]", false}});
}

struct IntegerBounds {
  json keywords;
  int64_t lo, hi;  // the integers valid under them
};

TEST(JsonSchema, IntegerBoundsEveryValue) {
  const int64_t none = 1000;
  const std::vector<IntegerBounds> configs = {
      {{{"minimum", 7}, {"maximum", 123}}, 7, 123},       {{{"minimum", -5}, {"maximum", 5}}, -5, 5},
      {{{"minimum", 0}}, 0, none},                        {{{"maximum", -10}}, -none, -10},
      {{{"exclusiveMinimum", -20}, {"exclusiveMaximum", 150}}, -19, 149},
      {{{"minimum", 99}, {"maximum", 101}}, 99, 101},
      {{{"minimum", 10}, {"maximum", 10}}, 10, 10},       {{{"minimum", -150}, {"maximum", -99}}, -150, -99},
      {{{"minimum", 1.5}, {"maximum", 50.5}}, 2, 50},     {{{"minimum", 5}, {"exclusiveMinimum", true}}, 6, none},
      {{{"minimum", -100}, {"exclusiveMaximum", 0}}, -100, -1}, {{{"exclusiveMinimum", -0.5}}, 0, none},
      {{{"minimum", -9}, {"maximum", 190}}, -9, 190},     {{{"minimum", 0}, {"maximum", 0}}, 0, 0},
      {{{"maximum", 19}, {"minimum", -199}}, -199, 19},   {{{"minimum", 100}, {"maximum", 199}}, 100, 199},
      {{{"minimum", -137}, {"maximum", 164}}, -137, 164}, {{{"minimum", 23}, {"maximum", 187}}, 23, 187},
      {{{"minimum", 105}, {"maximum", 150}}, 105, 150}};
  for (const IntegerBounds& c : configs) {
    json schema = c.keywords;
    schema["type"] = "integer";
    const Grammar g = compile(schema);
    for (int64_t n = -200; n <= 200; ++n) {
      ASSERT_EQ(matches(g, std::to_string(n)), n >= c.lo && n <= c.hi) << schema.dump() << " on " << n;
    }
    EXPECT_FALSE(matches(g, "1.0"));
    EXPECT_FALSE(matches(g, "007"));
  }
}

TEST(JsonSchema, IntegerBoundsRandomMagnitudes) {
  std::mt19937_64 rng(42);
  auto random_value = [&] {
    const int64_t scale = int64_t(std::pow(10.0, double(rng() % 16)));
    return int64_t(rng() % uint64_t(2 * scale + 1)) - scale;
  };
  for (int t = 0; t < 40; ++t) {
    int64_t lo = random_value(), hi = random_value();
    if (lo > hi) std::swap(lo, hi);
    json schema = {{"type", "integer"}};
    if (t % 4 != 1) schema["minimum"] = lo;
    if (t % 4 != 2) schema["maximum"] = hi;
    const Grammar g = compile(schema);
    std::vector<int64_t> probes = {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 0, -1, 1};
    for (int i = 0; i < 60; ++i) probes.push_back(i % 2 ? random_value() : lo + int64_t(rng() % uint64_t(hi - lo + 1)));
    for (int64_t n : probes) {
      const bool valid = (!schema.contains("minimum") || n >= lo) && (!schema.contains("maximum") || n <= hi);
      ASSERT_EQ(matches(g, std::to_string(n)), valid) << schema.dump() << " on " << n;
    }
  }
}

TEST(JsonSchema, NumberBounds) {
  expect_cases({{"type", "number"}, {"minimum", 0}, {"maximum", 1}},
               {{"0", true}, {"0.5", true}, {"1", true}, {"1.0", true}, {"1.000", true}, {"0.999", true}, {"0.0", true},
                {"1.01", false}, {"-0.1", false}, {"2", false}, {"-1", false}});
  expect_cases({{"type", "number"}, {"exclusiveMinimum", 0}, {"exclusiveMaximum", 1}},
               {{"0", false}, {"0.0", false}, {"0.01", true}, {"0.10", true}, {"1", false}, {"0.999", true},
                {"1.0", false}});
  // Random decimals against plain comparisons (short fractions: doubles compare exactly with integers).
  const std::vector<json> configs = {{{"minimum", -3}, {"maximum", 7}}, {{"exclusiveMinimum", -3}, {"maximum", 0}},
                                     {{"minimum", 2}}, {{"exclusiveMaximum", -2}},
                                     {{"minimum", -1}, {"exclusiveMaximum", 1}}};
  std::mt19937 rng(9);
  for (json schema : configs) {
    schema["type"] = "number";
    const Grammar g = compile(schema);
    for (int i = 0; i < 400; ++i) {
      const int whole = int(rng() % 25) - 12;
      std::string text = std::to_string(whole);
      if (rng() % 2) {
        text += ".";
        for (int d = 0, n = 1 + int(rng() % 3); d < n; ++d) text += char('0' + rng() % 10);
      }
      if (whole == 0 && rng() % 2) text = "-" + text;
      const double v = std::stod(text);
      if (text[0] == '-' && v == 0) continue;  // "-0.0" is 0, written without the sign here
      const bool valid = (!schema.contains("minimum") || v >= schema["minimum"].get<double>()) &&
                         (!schema.contains("maximum") || v <= schema["maximum"].get<double>()) &&
                         (!schema.contains("exclusiveMinimum") || v > schema["exclusiveMinimum"].get<double>()) &&
                         (!schema.contains("exclusiveMaximum") || v < schema["exclusiveMaximum"].get<double>());
      ASSERT_EQ(matches(g, text), valid) << schema.dump() << " on " << text;
    }
  }
}

TEST(JsonSchema, BoundedWhitespace) {
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "array"}, {"items", {{"type", "integer"}}}}},
                                                           {"b", {{"type", "object"}}}}}};
  const json inst = {{"a", {1, 2}}, {"b", {{"c", {{"d", json::array()}}}}}};
  const Grammar g = compile(schema);
  EXPECT_TRUE(matches(g, inst.dump()));
  for (int indent : {1, 2, 4, 8}) EXPECT_TRUE(matches(g, inst.dump(indent))) << inst.dump(indent);
  EXPECT_TRUE(matches(g, inst.dump(1, '\t')));
  EXPECT_TRUE(matches(g, "{ \"a\" : [ 1 , 2 ] , \"b\" : { } }"));
  EXPECT_TRUE(matches(g, "{\r\n  \"a\": [1,\n\t2]\r\n}"));
  EXPECT_TRUE(matches(g, "{\"a\":[1,\n" + std::string(40, ' ') + "2]}"));
  EXPECT_FALSE(matches(g, "{\"a\":[1,\n" + std::string(41, ' ') + "2]}"));
  EXPECT_FALSE(matches(g, "{\"a\":[1,  2]}"));      // at most one space or tab
  EXPECT_FALSE(matches(g, "{\"a\":[1,\n\n2]}"));    // one line break
  EXPECT_FALSE(matches(g, " {}"));                   // by design, nothing before or after the value
  EXPECT_FALSE(matches(g, "{}\n"));
}

TEST(JsonSchema, RuleNamesAreValidAndUnique) {
  json props = json::object();
  for (const char* name : {"a b", "1", "-", "é", "root", "ws", "a-1", "string", "", "x/y~z", "value", "root-a"}) {
    props[name] = {{"type", "object"}, {"properties", {{"n", {{"type", "integer"}, {"minimum", 1}}}}}};
  }
  const json schema = {{"type", "object"}, {"properties", props}, {"required", {"1", "é"}},
                       {"additionalProperties", true}, {"$defs", {{"ws", {{"type", "integer"}}}}}};
  json with_ref = schema;
  with_ref["properties"]["z"] = {{"$ref", "#/$defs/ws"}};
  const std::string text = json_schema_to_gbnf(with_ref);
  const std::regex rule_line("^([a-zA-Z0-9-]+) ::= .*$");
  std::set<std::string> names;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, rule_line)) << line;
    EXPECT_TRUE(names.insert(m[1]).second) << "duplicate rule " << m[1];
    EXPECT_FALSE(std::regex_search(std::string(m[1]), std::regex("-[0-9]+$"))) << m[1];  // the parser's helper names
  }
  const Grammar g = parse_gbnf(text);
  EXPECT_TRUE(matches(g, R"({"1":{},"é":{"n":2},"":{"n":1},"z":5,"other":[]})"));
  EXPECT_FALSE(matches(g, R"({"1":{"n":0},"é":{}})"));
}

TEST(JsonSchema, ObjectWithoutPropertiesIsAnyObject) {
  expect_cases({{"type", "object"}}, {{"{}", true}, {R"({"a":[1],"b":{"c":null}})", true}, {"[]", false}});
  expect_cases({{"type", "object"}, {"required", {"id"}}},
               {{R"({"id":1,"x":2})", true}, {R"({"id":1})", true}, {R"({"x":2})", false},
                {R"({"id":1,"id":2})", false}});
}

struct Refusal {
  json schema;
  std::vector<std::string> message_parts;  // the keyword and where it is
};

TEST(JsonSchema, RefusesWhatItCannotEnforce) {
  const std::vector<Refusal> cases = {
      {J(R"({"properties": {"tags": {"type": "array", "uniqueItems": true}}})"),
       {"'uniqueItems'", "at /properties/tags"}},
      {J(R"({"properties": {"a/b~": {"uniqueItems": true}}})"), {"'uniqueItems'", "at /properties/a~1b~0"}},
      {{{"type", "array"}, {"contains", {{"type", "integer"}}}}, {"'contains'", "at /"}},
      {{{"items", {{"type", "integer"}, {"multipleOf", 3}}}}, {"'multipleOf'", "at /items"}},
      {{{"patternProperties", {{"^x", json::object()}}}}, {"'patternProperties'", "at /"}},
      {{{"type", "object"}, {"minProperties", 1}}, {"'minProperties'"}},
      {{{"properties", {{"a", json::object()}}}, {"maxProperties", 0}}, {"'maxProperties'"}},
      {{{"propertyNames", {{"pattern", "^a"}}}}, {"'propertyNames'"}},
      {{{"dependentRequired", {{"a", {"b"}}}}}, {"'dependentRequired'"}},
      {{{"not", {{"type", "string"}}}}, {"'not'", "at /"}},
      {{{"if", {{"type", "string"}}}, {"then", {{"minLength", 1}}}}, {"'if'"}},
      {{{"anyOf", {{{"unevaluatedProperties", false}}}}}, {"'unevaluatedProperties'", "at /anyOf/0"}},
      {{{"type", "string"}, {"foo", 1}}, {"'foo'"}},
      {{{"$ref", "http://example.com/s.json"}}, {"external $ref"}},
      {{{"$ref", "other.json#/a"}}, {"external $ref"}},
      {{{"$ref", "#node"}}, {"anchor"}},
      {{{"properties", {{"x", {{"$ref", "#/$defs/missing"}}}}}}, {"does not exist", "/properties/x"}},
      {{{"anyOf", {{{"$ref", "#"}}, {{"type", "string"}}}}}, {"left recursion"}},
      {J(R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"})"),
       {"left recursion"}},
      {J(R"({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"})"), {"merges itself"}},
      {J(R"({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A", "minimum": 1}, {"type": "string"}]}},
             "$ref": "#/$defs/A"})"),
       {"left recursion"}},
      {{{"properties", {{"x", {{"$id", "http://other/"}, {"type", "string"}}}}}}, {"'$id'", "/properties/x"}},
      {{{"type", "string"}, {"format", "hostname"}}, {"'format'", "hostname"}},
      {J(R"j({"properties": {"s": {"type": "string", "pattern": "(?=a)"}}})j"),
       {"'pattern'", "/properties/s", "lookahead"}},
      {{{"type", "string"}, {"pattern", "^a+$"}, {"maxLength", 3}}, {"'maxLength'", "'pattern'"}},
      {{{"type", "string"}, {"format", "date"}, {"minLength", 11}}, {"'minLength'", "'format'"}},
      {{{"type", "string"}, {"format", "date"}, {"pattern", "^2"}}, {"'format'", "'pattern'"}},
      {{{"type", "string"}, {"maxLength", 20000}}, {"'maxLength'", "10000"}},
      {{{"type", "array"}, {"maxItems", 20000}}, {"'maxItems'", "10000"}},
      {{{"type", "array"}, {"minItems", 3}, {"maxItems", 2}}, {"'minItems'"}},
      {{{"type", "number"}, {"minimum", 0.5}}, {"'minimum'", "number"}},
      {{{"type", "integer"}, {"minimum", 5}, {"maximum", 4}}, {"no integer"}},
      {{{"oneOf", {{{"type", "string"}}, {{"type", "string"}, {"maxLength", 3}}}}}, {"'oneOf'", "branches 0 and 1"}},
      {{{"oneOf", {{{"type", "integer"}}, {{"type", "number"}}}}}, {"'oneOf'"}},
      {{{"allOf", {{{"type", "string"}, {"pattern", "a"}}, {{"pattern", "b"}}}}}, {"'pattern'", "allOf"}},
      {{{"allOf", {{{"type", "string"}}, {{"type", "integer"}}}}}, {"no 'type' in common"}},
      {{{"type", "object"}, {"required", {"x"}}, {"additionalProperties", false}}, {"'x'", "'additionalProperties'"}},
      {{{"enum", {1, 2}}, {"minimum", 1}}, {"'minimum'", "'enum'"}},
      {{{"type", "strin"}}, {"invalid 'type'"}},
      {{{"type", "integer"}, {"enum", {"a"}}}, {"no value of 'enum'"}},
      {json(false), {"schema false"}},
  };
  for (const Refusal& c : cases) {
    SCOPED_TRACE(c.schema.dump());
    expect_refused(c.schema, c.message_parts);
  }
}

}  // namespace
}  // namespace serval::grammar
