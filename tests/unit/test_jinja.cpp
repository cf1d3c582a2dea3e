// The chat-template engine on hostile templates: every limit in jinja::Limits, checked integer
// arithmetic at its boundaries, and that the real chat templates still render as before.
#include <gtest/gtest.h>

#include <time.h>

#include <fstream>
#include <sstream>
#include <string>

#include "base/error.h"
#include "server/jinja.h"

namespace serval::jinja {
namespace {

using json = nlohmann::ordered_json;

// `ctx` null (as `{}` makes it) stands for no variables.
std::string render(const std::string& src, const json& ctx = json::object(), const Limits& lim = Limits()) {
  if (ctx.is_null()) return Template(src, lim).render(json::object());
  return Template(src, lim).render(ctx);  // not copied: a deeply nested ctx must reach the engine as is
}

// The serval::Error message of parsing and rendering `src`; fails the test when there is none.
std::string error_of(const std::string& src, const json& ctx = json::object(), const Limits& lim = Limits()) {
  try {
    const std::string out = render(src, ctx, lim);
    ADD_FAILURE() << "no error; rendered " << out.size() << " bytes: " << out.substr(0, 200);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR(src, fragment, ...) EXPECT_PRED_FORMAT2(testing::IsSubstring, fragment, error_of(src, ##__VA_ARGS__))

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// No timings are asserted: that a limit stopped the render early is shown by its error message
// (the limit is hit long before the loop's own end).

// ---------------------------------------------------------------- integer arithmetic

// A tag ends at the first closing delimiter outside string literals, as Jinja lexes it: Qwen2.5-Coder
// 1.5B's template writes "{{\"name\": ...}}" inside a {{- "..." }} expression.
TEST(JinjaLexer, ClosingDelimitersInsideStringsDoNotEndTheTag) {
  EXPECT_EQ(render("{{ \"a}}b\" }}"), "a}}b");
  EXPECT_EQ(render("{{- 'x}}' -}} y"), "x}}y");
  EXPECT_EQ(render("{% set s = \"%}\" %}[{{ s }}]"), "[%}]");
  EXPECT_EQ(render("{{ \"q\\\"}}\" }}"), "q\"}}") << "an escaped quote does not end the string";
  EXPECT_EQ(render("{# a \" #}b"), "b") << "comments have no strings";
  EXPECT_THROW(render("{{ \"never closed }}"), Error);
}

TEST(JinjaArithmetic, AdditionAndSubtractionAtInt64Bounds) {
  EXPECT_EQ(render("{{ 9223372036854775806 + 1 }}"), "9223372036854775807");
  EXPECT_ERROR("{{ 9223372036854775807 + 1 }}", "integer overflow in '+'");
  EXPECT_EQ(render("{{ -9223372036854775807 - 1 }}"), "-9223372036854775808");
  EXPECT_ERROR("{{ -9223372036854775807 - 2 }}", "integer overflow in '-'");
}

TEST(JinjaArithmetic, UnaryMinusOfInt64MinOverflows) {
  EXPECT_EQ(render("{{ -(9223372036854775807) }}"), "-9223372036854775807");
  EXPECT_ERROR("{{ -(-9223372036854775807 - 1) }}", "integer overflow in '-'");
  EXPECT_ERROR("{{ (-9223372036854775807 - 1)|abs }}", "integer overflow");
  EXPECT_EQ(render("{{ (-9223372036854775807)|abs }}"), "9223372036854775807");
}

TEST(JinjaArithmetic, Multiplication) {
  EXPECT_EQ(render("{{ 3037000499 * 3037000499 }}"), "9223372030926249001");
  EXPECT_ERROR("{{ 3037000500 * 3037000500 }}", "integer overflow in '*'");
  EXPECT_ERROR("{{ (-9223372036854775807 - 1) * -1 }}", "integer overflow in '*'");
}

TEST(JinjaArithmetic, FloorDivisionAndModuloFollowPython) {
  EXPECT_EQ(render("{{ 7 // 2 }} {{ 7 // -2 }} {{ -7 // 2 }} {{ -7 // -2 }}"), "3 -4 -4 3");
  EXPECT_EQ(render("{{ 7 % 2 }} {{ 7 % -2 }} {{ -7 % 2 }} {{ -7 % -2 }}"), "1 -1 1 -1");
  EXPECT_EQ(render("{{ 7.5 % -2 }} {{ -7.5 // 2 }}"), "-0.5 -4.0");
  EXPECT_EQ(render("{{ 9223372036854775807 // 1 }}"), "9223372036854775807");  // exact, not via double
}

TEST(JinjaArithmetic, Int64MinByMinusOneDoesNotTrap) {
  // The request that used to kill the server with SIGFPE. Python (and Jinja2) give 0: exact, so no error.
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_ERROR("{{ (-9223372036854775807 - 1) // -1 }}", "integer overflow in '//'");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) // 1 }}"), "-9223372036854775808");
}

TEST(JinjaArithmetic, DivisionByZeroIsATemplateError) {
  EXPECT_ERROR("{{ 7 // 0 }}", "division by zero");
  EXPECT_ERROR("{{ 7 % 0 }}", "modulo by zero");
  EXPECT_ERROR("{{ 7 / 0 }}", "division by zero");
  EXPECT_ERROR("{{ 7.0 % 0.0 }}", "division by zero");
  EXPECT_ERROR("{{ 0 ** -1 }}", "division by zero");
}

TEST(JinjaArithmetic, PowerIsCheckedAndParsesAsJinja2) {
  EXPECT_EQ(render("{{ 2 ** 62 }}"), "4611686018427387904");
  EXPECT_ERROR("{{ 2 ** 63 }}", "integer overflow in '**'");
  EXPECT_EQ(render("{{ (-2) ** 63 }}"), "-9223372036854775808");
  EXPECT_ERROR("{{ 3 ** 9223372036854775807 }}", "integer overflow in '**'");
  EXPECT_EQ(render("{{ 1 ** 9223372036854775807 }} {{ (-1) ** 9223372036854775807 }} {{ 0 ** 0 }}"), "1 -1 1");
  EXPECT_EQ(render("{{ 2 ** -1 }}"), "0.5");
  EXPECT_EQ(render("{{ -2 ** 2 }} {{ 2 ** 3 ** 2 }}"), "4 64");  // as Jinja2: unary binds tighter, left-associative
}

TEST(JinjaArithmetic, OutOfRangeNumbersAreErrors) {
  EXPECT_ERROR("{{ 9223372036854775808 }}", "out of range");
  EXPECT_ERROR("{{ n + 1 }}", "out of range", (json{{"n", 18446744073709551615ull}}));
  EXPECT_EQ(render("{{ n + 1 }}", json{{"n", 9223372036854775806ull}}), "9223372036854775807");
  EXPECT_ERROR("{{ (10.0 ** 300)|int }}", "integer overflow");
  EXPECT_ERROR("{{ '99999999999999999999'|int }}", "integer overflow");
  EXPECT_EQ(render("{{ 3.9|int }} {{ '-12'|int }}"), "3 -12");
  // An integer stays exact (not through a double): 2^63 - 1 and 2^53 + 1.
  EXPECT_EQ(render("{{ 9223372036854775807|int }} {{ n|int }}", json{{"n", 9007199254740993LL}}),
            "9223372036854775807 9007199254740993");
}

// ---------------------------------------------------------------- sizes from template data

TEST(JinjaSizes, StringRepetition) {
  EXPECT_EQ(render("{{ 'ab' * 3 }}|{{ 3 * 'ab' }}|{{ 'a' * 0 }}|{{ 'a' * -5 }}|{{ '' * 9223372036854775807 }}"), "ababab|ababab|||");
  EXPECT_ERROR("{{ 'a' * 9223372036854775807 }}", "string size limit");
  Limits lim;
  lim.max_string_bytes = 10;
  EXPECT_EQ(render("{{ 'ab' * 5 }}", {}, lim), "ababababab");
  EXPECT_ERROR("{{ 'ab' * 6 }}", "string size limit", {}, lim);
}

TEST(JinjaSizes, ListRepetition) {
  EXPECT_EQ(render("{{ [1, 2] * 2 }} {{ 2 * [1] }} {{ [1] * -3 }}"), "[1, 2, 1, 2] [1, 1] []");
  EXPECT_ERROR("{{ [1] * 1000000000 }}", "list size limit");
  EXPECT_ERROR("{{ [1, 2] * 9223372036854775807 }}", "list size limit");
}

TEST(JinjaSizes, Range) {
  EXPECT_EQ(render("{{ range(5, 0, -2) }} {{ range(3) }} {{ range(3, 3) }} {{ range(0, 5, 9223372036854775807) }}"),
            "[5, 3, 1] [0, 1, 2] [] [0]");
  EXPECT_EQ(render("{{ range(-9223372036854775807 - 1, 9223372036854775807, 9223372036854775807) }}"),
            "[-9223372036854775808, -1, 9223372036854775806]");
  EXPECT_EQ(render("{{ range(9223372036854775807, -9223372036854775807 - 1, -9223372036854775807 - 1) }}"),
            "[9223372036854775807, -1]");
  EXPECT_ERROR("{{ range(1, 2, 0) }}", "step is zero");
  EXPECT_ERROR("{{ range(-9223372036854775807 - 1, 9223372036854775807) }}", "list size limit");
  EXPECT_ERROR("{{ range('a') }}", "needs an integer");
  Limits lim;
  lim.max_list_items = 5;
  EXPECT_EQ(render("{{ range(5)|length }}", {}, lim), "5");
  EXPECT_ERROR("{{ range(6) }}", "list size limit", {}, lim);
}

TEST(JinjaSizes, HugeRangeLoopFailsFast) {
  EXPECT_ERROR("{% for i in range(100000000) %}x{% endfor %}", "list size limit exceeded (range() of 100000000 items");
}

TEST(JinjaSizes, Slicing) {
  EXPECT_EQ(render("{{ 'hello'[-9223372036854775807 - 1:9223372036854775807] }}|{{ 'hello'[9223372036854775807:] }}|"
                   "{{ 'hello'[:-9223372036854775807 - 1] }}|{{ [1, 2, 3][-100:-1] }}|{{ 'hello'[3:1] }}|{{ 'hello'[1:none] }}"),
            "hello|||[1, 2]||ello");
  EXPECT_EQ(render("{{ 'abc'[-9223372036854775807 - 1] }}|{{ [1][9223372036854775807] }}"), "|");
  EXPECT_ERROR("{{ 'abc'[1.5:] }}", "needs an integer");
}

TEST(JinjaSizes, JoinIsBounded) {
  Limits lim;
  lim.max_string_bytes = 1000;
  EXPECT_EQ(render("{{ (['a' * 10] * 100)|join }}", {}, lim).size(), 1000u);
  EXPECT_ERROR("{{ (['a' * 10] * 100)|join(',') }}", "string size limit", {}, lim);
  EXPECT_ERROR("{{ (['a' * 1000000] * 20)|join }}", "string size limit");
}

TEST(JinjaSizes, ReplaceAndConcatenationAreBounded) {
  EXPECT_ERROR("{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}", "string size limit");
  EXPECT_ERROR("{% set s = 'a' * 10000000 %}{{ s ~ s }}", "string size limit");
  EXPECT_ERROR("{% set s = 'a' * 10000000 %}{{ s + s }}", "string size limit");
  EXPECT_ERROR("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "list size limit");
}

TEST(JinjaSizes, SplitAndListOfAStringAreBounded) {
  Limits lim;
  lim.max_list_items = 10;
  EXPECT_EQ(render("{{ ('a,' * 9 ~ 'a').split(',')|length }}", {}, lim), "10");
  EXPECT_ERROR("{{ ('a,' * 10 ~ 'a').split(',') }}", "list size limit", {}, lim);
  EXPECT_ERROR("{{ ('a ' * 11).split() }}", "list size limit", {}, lim);
  EXPECT_ERROR("{{ ('a' * 11)|list }}", "list size limit", {}, lim);
  EXPECT_ERROR("{% for c in 'a' * 11 %}{% endfor %}", "list size limit", {}, lim);
}

TEST(JinjaSizes, TojsonIndentIsBounded) {
  EXPECT_EQ(render("{{ [1]|tojson(indent=2) }}"), "[\n  1\n]");
  EXPECT_ERROR("{{ [1]|tojson(indent=9223372036854775807) }}", "string size limit");
  EXPECT_ERROR("{{ [[[[1]]]]|tojson(indent=10000000) }}", "string size limit");
}

TEST(JinjaSizes, StripWithAHugeCharacterSetIsLinear) {
  EXPECT_EQ(render("{{ ('a' * 10000000).strip('b' * 10000000 ~ 'a') }}|"), "|");
}

TEST(JinjaSizes, StrftimeWithAHugeFormatDoesNotOverflow) {
  EXPECT_EQ(render("{{ strftime_now('%Y' * 1000) }}"), "");
  EXPECT_EQ(render("{{ strftime_now('%Y')|length }}"), "4");
}

// ---------------------------------------------------------------- loops, output, work

TEST(JinjaLimits, LoopIterations) {
  // With the default limits the work limit may stop this first; either way it stops, and fast.
  EXPECT_ERROR("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "limit exceeded");
  Limits unlimited_work;
  unlimited_work.max_work = uint64_t(1) << 40;
  EXPECT_ERROR("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
               "loop iteration limit exceeded (more than 1000000 iterations", {}, unlimited_work);
  Limits lim;
  lim.max_loop_iterations = 10;
  EXPECT_EQ(render("{% for i in range(10) %}{{ i }}{% endfor %}", {}, lim), "0123456789");
  EXPECT_ERROR("{% for i in range(11) %}{{ i }}{% endfor %}", "loop iteration limit", {}, lim);
  EXPECT_ERROR("{% for i in range(5) %}{% endfor %}{% for i in range(6) %}{% endfor %}", "loop iteration limit", {}, lim);
  EXPECT_ERROR("{% for i in range(11) if false %}{% endfor %}", "loop iteration limit", {}, lim);  // filtering counts
}

TEST(JinjaLimits, OutputSize) {
  Limits lim;
  lim.max_output_bytes = 10;
  EXPECT_EQ(render("{{ 'x' * 10 }}", {}, lim), "xxxxxxxxxx");
  EXPECT_ERROR("{{ 'x' * 11 }}", "output size limit exceeded (more than 10 bytes)", {}, lim);
  EXPECT_ERROR("xxxxxxxxxx{{ 'x' }}", "output size limit", {}, lim);
  EXPECT_ERROR("{% set s %}{{ 'x' * 11 }}{% endset %}", "output size limit", {}, lim);  // captures too
  EXPECT_ERROR("{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}", "output size limit");
}

TEST(JinjaLimits, WorkBoundsQuadraticSearches) {
  EXPECT_ERROR("{% set h = 'a' * 16000000 %}{% set n = 'a' * 8000000 ~ 'b' %}{{ n in h }}", "work limit exceeded");
  EXPECT_ERROR("{% set h = 'a' * 16000000 %}{{ h.replace('a' * 8000000 ~ 'b', '') }}", "work limit exceeded");
  EXPECT_ERROR("{% set h = 'a' * 16000000 %}{{ h.split('a' * 8000000 ~ 'b') }}", "work limit exceeded");
}

TEST(JinjaLimits, WorkBoundsRepeatedLargeOperations) {
  EXPECT_ERROR("{% set s = 'a' * 1000000 %}{% for i in range(1000) %}{% for j in range(1000) %}{% if s == s ~ '' %}{% endif %}{% endfor %}{% endfor %}",
               "work limit exceeded");
  EXPECT_ERROR("{% set l = range(100000) %}{% for i in range(1000) %}{% for j in range(1000) %}{% if -1 in l %}{% endif %}{% endfor %}{% endfor %}",
               "work limit exceeded");
  EXPECT_ERROR("{% set s = 'a' * 1000000 %}{% for i in range(1000) %}{% for j in range(1000) %}{% set t = s.strip %}{% endfor %}{% endfor %}", "work limit exceeded");
  Limits lim;
  lim.max_work = 100000;
  EXPECT_ERROR("{% for i in range(100000) %}{% endfor %}", "work limit exceeded (the render does more than max_work = 100000", {}, lim);
}

// ---------------------------------------------------------------- depth

TEST(JinjaDepth, DeepParenthesesDoNotOverflowTheStack) {
  EXPECT_EQ(render("{{ " + repeat("(", 90) + "1" + repeat(")", 90) + " }}"), "1");
  EXPECT_ERROR("{{ " + repeat("(", 100000) + "1" + repeat(")", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ " + repeat("(", 1000000) + " }}", "nesting depth limit");
}

TEST(JinjaDepth, DeepBracketsAndBraces) {
  EXPECT_ERROR("{{ " + repeat("[", 100000) + repeat("]", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ " + repeat("{'a': ", 100000) + "1" + repeat("}", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ f" + repeat("(", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ x" + repeat("[0", 100000) + " }}", "expression nesting depth limit");
}

TEST(JinjaDepth, LongOperatorChainsAreBounded) {
  EXPECT_EQ(render("{{ 1" + repeat(" + 1", 50) + " }}"), "51");
  EXPECT_ERROR("{{ 1" + repeat(" + 1", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ 'a'" + repeat(" ~ 'a'", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ x" + repeat(".a", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ x" + repeat("|trim", 100000) + " }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ " + repeat("not ", 100000) + "x }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ " + repeat("- ", 100000) + "1 }}", "expression nesting depth limit");
  EXPECT_ERROR("{{ 1" + repeat(" if x else 1", 100000) + " }}", "expression nesting depth limit");
}

TEST(JinjaDepth, NestedStatements) {
  EXPECT_EQ(render(repeat("{% if true %}", 50) + "ok" + repeat("{% endif %}", 50)), "ok");
  EXPECT_ERROR(repeat("{% if true %}", 100000) + repeat("{% endif %}", 100000), "statement nesting depth limit");
  EXPECT_ERROR(repeat("{% for i in [1] %}", 100000), "statement nesting depth limit");
}

TEST(JinjaDepth, RecursiveFilterCalls) {
  // A string iterates as itself in `map`, so map('map') would recurse forever.
  EXPECT_ERROR("{{ 'a'|map('map') }}", "recursion depth limit exceeded");
}

TEST(JinjaDepth, SelfCallingMacro) {
  // A macro that calls itself forever stops at the call depth limit, as an error.
  EXPECT_ERROR("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion depth limit exceeded");
}

// Macros (arguments by position and name, defaults evaluated at the call, recursion), loop controls,
// Python slices with steps, markupsafe's + of safe strings, and empty strings being false: expected
// values are what Jinja2 renders (checked by hand in Python).
TEST(JinjaTemplates, MacrosLoopControlsSlicesAndMarkup) {
  EXPECT_EQ(render("{% macro m(a, b=2) %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }},{{ m(1, 3) }},{{ m(b=5, a=4) }}"), "1-2,1-3,4-5");
  EXPECT_EQ(render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"), "321");
  EXPECT_EQ(render("{% set x = 7 %}{% macro g() %}{{ x }}{% endmacro %}{{ g() }}"), "7");
  EXPECT_ERROR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "takes 1 arguments");
  EXPECT_ERROR("{% macro m(a) %}{% endmacro %}{{ m(c=1) }}", "no argument 'c'");
  EXPECT_EQ(render("{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"), "023");
  EXPECT_ERROR("{% break %}", "outside a for loop");
  EXPECT_ERROR("{% for i in [1] %}{% macro m() %}{% break %}{% endmacro %}{% endfor %}", "outside a for loop");
  EXPECT_EQ(render("{{ [1, 2, 3, 4][::-1] }}|{{ 'abcdef'[1:5:2] }}|{{ [1, 2, 3, 4, 5][-1:0:-2] }}|{{ [1, 2][5:] }}"), "[4, 3, 2, 1]|bd|[5, 3]|[]");
  EXPECT_ERROR("{{ [1][::0] }}", "step cannot be zero");
  EXPECT_EQ(render("{{ '<a>'|safe + '\"b\"' }}|{{ '<a>' ~ ('\"b\"'|safe) }}|{{ 'x'|e }}{{ '<'|e }}"), "<a>&#34;b&#34;|<a>\"b\"|x&lt;");
  EXPECT_EQ(render("{% set s = '' %}{% if s %}yes{% else %}no{% endif %}{% if 'a' %}!{% endif %}"), "no!");
  EXPECT_EQ(render("{{ [3, 1, 2]|min }}{{ [3, 1, 2]|max }}{% for k, v in {'b': 1, 'A': 2}|dictsort %}{{ k }}{{ v }}{% endfor %}"), "13A2b1");
  EXPECT_EQ(render("{% if 'abc'.content is defined %}d{% else %}u{% endif %}"), "u");
}

TEST(JinjaDepth, DeepValues) {
  EXPECT_ERROR("{% set ns = namespace(x=0) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
               "value nesting depth limit");
  EXPECT_ERROR("{% set ns = namespace(x=0) %}{% for i in range(1000) %}{% set ns.x = ns %}{% endfor %}",
               "value nesting depth limit");
  EXPECT_ERROR("{% set ns = namespace(x=0) %}{% for i in range(1000) %}{% set ns.x = {'a': ns.x} %}{% endfor %}",
               "value nesting depth limit");
  // Doubling a namespace that holds itself twice: exponential size, stopped by the limits.
  EXPECT_ERROR("{% set ns = namespace(a=1) %}{% for i in range(64) %}{% set ns.a = ns %}{% set ns.b = ns %}{% endfor %}",
               "limit exceeded");
}

TEST(JinjaDepth, DeeplyNestedInputIsRejectedNotRecursedInto) {
  json deep = 1;
  for (int i = 0; i < 100000; ++i) {
    json a = json::array();
    a.push_back(std::move(deep));
    deep = std::move(a);
  }
  const json ctx = {{"x", std::move(deep)}};
  EXPECT_ERROR("{{ x }}", "value nesting depth limit", ctx);
}

// ---------------------------------------------------------------- other errors stay template errors

TEST(JinjaErrors, LibraryExceptionsBecomeTemplateErrors) {
  EXPECT_ERROR("{{ 'abc'.startswith() }}", "chat template:");
  EXPECT_ERROR("{{ 'abc'|replace('a') }}", "chat template:");
  EXPECT_ERROR("{{ (1, 2)|map }}", "chat template:");
  EXPECT_ERROR("{% for a, b in [1] %}{% endfor %}", "cannot unpack");
  EXPECT_ERROR("{{ 1|items }}", "items needs a mapping");
}

// ---------------------------------------------------------------- real templates are unaffected

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(JinjaTemplates, RealChatTemplatesRenderAsBefore) {
  const std::map<std::string, std::string> known = {  // the formats documented by the model makers
      {"chatml", "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"},
      {"qwen2.5", "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                  "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"},
      {"llama3", "<s><|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"},
      {"gemma3", "<s><start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"},
      {"mistral-v1", "<s> [INST] How are you? [/INST]"},
  };
  const json ctx = {{"messages", json::array({{{"role", "user"}, {"content", "How are you?"}}})},
                    {"add_generation_prompt", true}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
  for (const auto& [name, expected] : known) {
    const std::string source = read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/chat_templates/" + name + ".jinja");
    ASSERT_FALSE(source.empty()) << name;
    EXPECT_EQ(Template(source).render(ctx), expected) << name;
  }
}

TEST(JinjaTemplates, LongConversationStaysWithinTheDefaultLimits) {
  // 2000 messages, 4 MiB of content (the HTTP body limit): a legitimate worst case must render.
  json messages = json::array();
  for (int i = 0; i < 2000; ++i)
    messages.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", std::string(2000, 'a' + i % 26)}});
  const json ctx = {{"messages", messages}, {"add_generation_prompt", true}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
  for (const char* name : {"chatml", "qwen2.5", "llama3", "gemma3", "mistral-v1"}) {
    const std::string source = read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/chat_templates/" + name + ".jinja");
    const std::string out = Template(source).render(ctx);
    EXPECT_GT(out.size(), 4000000u) << name;
  }
}

TEST(JinjaTemplates, ForElseRunsForAnEmptySequenceAndParsingGoesOn) {
  const std::string t = "{% for x in xs %}{{ x }}{% else %}empty{% endfor %}!{% for y in xs %}-{% endfor %}.";
  EXPECT_EQ(render(t, json{{"xs", json::array()}}), "empty!.");
  EXPECT_EQ(render(t, json{{"xs", {1, 2}}}), "12!--.");
  EXPECT_ERROR("{% for x in xs %}{% else %}", "missing {% endfor %}", json{{"xs", json::array()}});
}

TEST(JinjaTemplates, CommonExpressionsStillWork) {
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for m in messages if m.role == 'user' %}{% set ns.n = ns.n + 1 %}"
                   "{{ loop.index }}:{{ m.content|trim }}{% if not loop.last %},{% endif %}{% endfor %}={{ ns.n }}",
                   json{{"messages", json::array({{{"role", "user"}, {"content", " a "}},
                                                  {{"role", "assistant"}, {"content", "b"}},
                                                  {{"role", "user"}, {"content", "c"}}})}}),
            "1:a,2:c=2");
  EXPECT_EQ(render("{{ {'a': [1, 2.5, none, true, 'x']}|tojson }}"), "{\"a\": [1, 2.5, null, true, \"x\"]}");
  EXPECT_EQ(render("{{ 'a,b'.split(',')|join('-') }} {{ 10 / 4 }} {{ 'x' ~ 1 }} {{ [3, 1][1:] }}"), "a-b 2.5 x1 [1]");
}

}  // namespace
}  // namespace serval::jinja
