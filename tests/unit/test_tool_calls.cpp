// Tool calls: parsing recorded model outputs (tests/data/tool_calls/, sources in its README), the
// streaming hold-back offset, the template-to-format guess, call ids, and the grammars that force a
// call (checked with the GBNF matcher, and parsed back).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "server/tool_calls.h"
#include "test_support.h"

namespace serval {
namespace {

using ojson = nlohmann::ordered_json;
constexpr size_t npos = std::string_view::npos;
constexpr ToolFormat H = ToolFormat::Hermes, L = ToolFormat::Llama3Json, M = ToolFormat::Mistral;
constexpr ToolFormat O = ToolFormat::Harmony, D = ToolFormat::DeepSeekR1, V = ToolFormat::DeepSeekV31;
constexpr ToolFormat Q = ToolFormat::Qwen3Coder;

std::string data(const std::string& file) {
  return test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tool_calls/" + file);
}

const ojson& tools(const std::string& set) {
  static const ojson all = ojson::parse(data("tools.json"));
  static const ojson none = ojson::array();
  return set.empty() ? none : all.at(set);
}

// The calls as `name(arguments); ...`, arguments as parsed (compact JSON).
std::string calls_text(const ParsedToolOutput& p) {
  std::string s;
  for (const auto& c : p.calls) s += (s.empty() ? "" : "; ") + c.name + "(" + c.arguments + ")";
  return s;
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

constexpr const char* paris_call() { return R"(get_weather({"city":"Paris"}))"; }

struct Recorded {
  const char* file;
  ToolFormat format;
  const char* tool_set;  // in tools.json; "" for no tools
  const char* content;   // "*": all the text, trimmed; "A…B": starts with A, ends with B
  const char* calls;
};

const Recorded kRecorded[] = {
    {"hermes_qwen_docs_two_calls.txt", H, "qwen_docs", "",
     R"(get_current_temperature({"location":"San Francisco, CA, USA"}); get_temperature_date({"location":"San Francisco, CA, USA","date":"2024-10-01"}))"},
    {"hermes_qwen14b_prose_then_call.txt", H, "qwen_docs", "To provide you…Let's start with today's temperature.",
     R"(get_current_temperature({"location":"San Francisco, California, USA"}))"},
    {"hermes_coder15_fence.txt", H, "weather", "", R"(get_weather({"city":"Paris","unit":"celsius"}))"},
    {"hermes_coder15_fence.txt", H, "", "*", ""},
    {"hermes_coder15_double_brace.txt", H, "weather", "", R"(get_weather({"city":"Paris","unit":"celsius"}))"},
    {"hermes_coder15_fence_two_calls.txt", H, "weather", "", R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima"}))"},
    {"hermes_coder15_unknown_function.txt", H, "weather", "*", ""},
    {"hermes_coder15_prose_only.txt", H, "weather", "*", ""},
    {"hermes_coder15_two_objects.txt", H, "weather", "",
     R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima","unit":"celsius"}))"},
    {"hermes_coder15_comma_objects.txt", H, "weather", "", R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima"}))"},
    {"hermes_coder05_content_then_calls.txt", H, "weather", "Let me check.",
     R"(get_weather({"city":"Tokyo"}); get_weather({"city":"Oslo"}))"},
    {"hermes_coder05_tag_unclosed.txt", H, "weather", "", R"(get_time({"city":"Sydney","unit":"fahrenheit"}))"},
    {"hermes_coder05_tag_truncated.txt", H, "weather", "*", ""},
    {"hermes_coder05_tag_unknown_function.txt", H, "weather", "*", ""},
    {"hermes_constructed_mixed.txt", H, "weather",
     "I'll check both cities.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Madrid\"}\n</tool_call>",
     R"(get_weather({"city":"Oslo"}); get_time({"city":"Madrid"}))"},
    {"hermes_qwen_docs_two_calls.txt", L, "qwen_docs", "*", ""},
    {"llama3_meta_docs_json.txt", L, "llama_docs", "", R"(trending_songs({"n":"10","genre":"all"}))"},
    {"llama3_meta_docs_builtin.txt", L, "llama_docs", "*", ""},
    {"llama3_meta_docs_answer.txt", L, "llama_docs", "*", ""},
    {"llama3_constructed_semicolon.txt", L, "llama_docs", "", R"(get_weather({"city":"Paris"}); trending_songs({"n":"5"}))"},
    {"mistral_ollama_docs_v3.txt", M, "mistral_docs", "",
     R"(get_current_weather({"location":"San Francisco, CA","format":"celsius"}))"},
    {"mistral_common_v3_template.txt", M, "mistral_docs", "",
     R"(get_current_weather({"location":"Paris, France","format":"celsius"}))"},
    {"mistral_common_v11_template.txt", M, "mistral_docs", "",
     R"(get_current_weather({"location":"Paris, France","format":"celsius"}))"},
    {"mistral_common_v13_template.txt", M, "mistral_docs", "",
     R"(get_current_weather({"location":"Paris, France","format":"celsius"}); get_current_weather({"location":"Tokyo, Japan","format":"celsius"}))"},
    {"mistral_constructed_unknown.txt", M, "mistral_docs", "*", ""},
    {"harmony_openai_docs_call.txt", O, "weather", "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>",
     R"(get_weather({"city":"San Francisco"}))"},
    {"harmony_template_two_calls.txt", O, "weather", "I will look both up.<|end|>",
     R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima"}))"},
    {"harmony_final_only.txt", O, "weather", "*", ""},
    {"harmony_unknown_function.txt", O, "weather", "*", ""},
    {"harmony_openai_docs_call.txt", O, "", "*", ""},
    {"deepseek_r1_template.txt", D, "weather", "", paris_call()},
    {"deepseek_v31_template_two_calls.txt", V, "weather", "Let me check.",
     R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima"}))"},
    {"deepseek_v31_template_two_calls.txt", D, "weather", "Let me check.",  // the parser reads both spellings
     R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima"}))"},
    {"hermes_coder15_fence.txt", O, "weather", "*", ""},
    {"qwen3_coder_template_two_calls.txt", Q, "weather", "Let me check.",
     R"(get_time({"city":"Sydney"}); get_weather({"city":"Lima","unit":"celsius"}))"},
    {"qwen3_coder_template_typed.txt", Q, "typed", "",  // values typed by the schema (Python's True a boolean)
     R"(search_code({"query":"fn main() {\n    println!(\"<hi>\");\n}","max_results":5,"threshold":0.25,"case_sensitive":true,"paths":["src","tests"],"options":{"regex":false}}))"},
    {"qwen3_coder_template_two_calls.txt", Q, "typed", "*", ""},  // unknown functions: all content
    {"qwen3_coder_template_two_calls.txt", H, "weather", "*", ""},  // no JSON in the blocks: not Hermes calls
};

TEST(ToolCallParse, RecordedOutputs) {
  for (const auto& r : kRecorded) {
    const std::string text = data(r.file);
    ASSERT_FALSE(text.empty()) << r.file;
    const ParsedToolOutput p = parse_tool_calls(text, r.format, tools(r.tool_set));
    SCOPED_TRACE(std::string(r.file) + " as " + to_string(r.format) + " with tools '" + r.tool_set + "'");
    EXPECT_EQ(calls_text(p), r.calls);
    const std::string want = r.content;
    if (want == "*") {
      EXPECT_EQ(p.content, trimmed(text));
    } else if (size_t dots = want.find("…"); dots != npos) {
      EXPECT_TRUE(p.content.starts_with(want.substr(0, dots)) && p.content.ends_with(want.substr(dots + 3))) << p.content;
    } else {
      EXPECT_EQ(p.content, want);
    }
  }
}

// Edge cases around the recorded shapes, written inline.
TEST(ToolCallParse, EdgeCases) {
  struct Case {
    ToolFormat format;
    const char* text;
    const char* content;
    const char* calls;
  };
  const Case cases[] = {
      {H, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\nI hope this helps.",
       "I hope this helps.", R"(get_time({"city":"Oslo"}))"},
      {H, R"(<tool_call>{"name": "get_time", "arguments": null}</tool_call>)", "", "get_time({})"},
      {H, R"(<tool_call>{"name": "get_time"}</tool_call>)", "", "get_time({})"},
      {H, R"(<tool_call>{"name": "get_time", "arguments": "[1]"}</tool_call>)", "*", ""},
      {H, R"(<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>)", "*", ""},
      {H, R"(<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}} trailing</tool_call>)", "*", ""},
      {H, "```json\n{\"name\": \"get_time\", \"arguments\": {}}\n```\nThat is all.", "*", ""},
      {H, "```python\n{\"name\": \"get_time\", \"arguments\": {}}\n```", "*", ""},
      {H, "Call it like {\"name\": \"get_time\", \"arguments\": {}}", "*", ""},
      {L, R"({"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>)", "", R"(get_weather({"city":"Paris"}))"},
      {L, R"({"name": "get_weather", "arguments": {"city": "Paris"}})", "", R"(get_weather({"city":"Paris"}))"},
      {L, R"(Let me see. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}})", "Let me see.",
       R"(get_weather({"city":"Paris"}))"},
      {L, R"(Let me see. {"name": "get_weather", "parameters": {"city": "Paris"}})", "*", ""},
      {M, R"(Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Oslo"}}] Anything else?)", "Sure. Anything else?",
       R"(get_time({"city":"Oslo"}))"},
      {M, R"([TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_joke[ARGS]{})", R"([TOOL_CALLS]get_joke[ARGS]{})",
       R"(get_time({"city":"Oslo"}))"},
      {M, R"([TOOL_CALLS]get time[ARGS]{"city": "Oslo"})", "*", ""},
      {M, R"([{"name": "get_time", "arguments": {"city": "Oslo"}}])", "", R"(get_time({"city":"Oslo"}))"},
      // Qwen3-Coder: without <tool_call>, a parameter left open, text after the block, a value not
      // matching its type kept as text, null, a parameter the schema does not name, a broken block
      {Q, "<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function>", "", R"(get_time({"city":"Oslo"}))"},
      {Q, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=unit>\ncelsius\n</function>\n</tool_call>\nDone.",
       "Done.", R"(get_weather({"city":"Oslo","unit":"celsius"}))"},
      {Q, "<tool_call>\n<function=get_time>\n<parameter=city>\nnull\n</parameter>\n<parameter=when>\n5\n</parameter>\n</function>\n</tool_call>",
       "", R"(get_time({"city":null,"when":"5"}))"},
      {Q, "<tool_call>\n<function=get_time>\nstray text\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>", "*", ""},
      {Q, "<tool_call>\n<function=get_joke>\n</function>\n</tool_call>", "*", ""},
  };
  for (const auto& c : cases) {
    const ParsedToolOutput p = parse_tool_calls(c.text, c.format, tools("weather"));
    EXPECT_EQ(p.content, std::string(c.content) == "*" ? trimmed(c.text) : c.content) << c.text;
    EXPECT_EQ(calls_text(p), c.calls) << c.text;
  }
}

TEST(ToolCallParse, IdsAreWellFormedAndUnique) {
  const std::regex shape("call_[A-Za-z0-9]{24}");
  const auto p = parse_tool_calls(data("mistral_common_v13_template.txt"), M, tools("mistral_docs"));
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_TRUE(std::regex_match(p.calls[0].id, shape)) << p.calls[0].id;
  EXPECT_NE(p.calls[0].id, p.calls[1].id);
  std::vector<std::vector<std::string>> ids(4);
  std::vector<std::thread> threads;
  for (auto& v : ids) threads.emplace_back([&v] { for (int k = 0; k < 5000; ++k) v.push_back(new_tool_call_id()); });
  for (auto& t : threads) t.join();
  std::set<std::string> all;
  for (const auto& v : ids) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), 20000u);
  EXPECT_TRUE(std::regex_match(*all.begin(), shape));
}

TEST(ToolCallFormat, GuessedFromTemplateSource) {
  const std::string dir = std::string(SERVAL_SOURCE_DIR) + "/tests/data/chat_templates/";
  const std::pair<std::string, ToolFormat> cases[] = {
      {test::read_file(dir + "qwen2.5.jinja"), H},
      {test::read_file(dir + "qwen2.5-coder-1.5b.jinja"), H},
      {test::read_file(dir + "llama3.jinja"), H},      // Llama 3.0: no tool markers, the default
      {test::read_file(dir + "mistral-v1.jinja"), H},  // no tool markers either
      {"{{- '[TOOL_CALLS][' }}{%- for tool in message['tool_calls'] %}", M},
      {"{{- '[AVAILABLE_TOOLS]' + (tools| tojson) + '[/AVAILABLE_TOOLS]' }}", M},
      {"{{- '<|python_tag|>' + tool_call.name + '.call(' }}", L},
      {"{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary}' }}ipython", L},
      {"{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary}' }}", H},
      {"{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + tool_call.name + \"<|channel|>commentary \" }}", O},
      {"{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}", D},
      {"{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] }}", V},
      {"{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}", Q},
  };
  for (const auto& [src, want] : cases) EXPECT_EQ(std::string(to_string(tool_format_for_template(src))), to_string(want)) << src;
}

TEST(ToolCallStart, MarkersAndTheirPrefixes) {
  struct Case {
    const char* text;
    ToolFormat format;
    size_t start;
  };
  const Case cases[] = {
      {"Hello", H, npos}, {"Hello <", H, 6}, {"Hello <tool_c", H, 6}, {"Hello <tool_call>\n{", H, 6},
      {"a < b", H, npos}, {"a <b>", H, npos}, {"", H, 0}, {"Done.\n", H, 6},
      // untagged Hermes (Qwen2.5-Coder): a line that may still become a ```json fence or {"name" ...
      {"```", H, 0}, {"``", H, 0}, {"```JS", H, 0}, {"```json\n{\n  \"na", H, 0}, {"```jsx", H, npos},
      {"Sure.\n```python\nprint(1)", H, npos}, {"{{\"name\"", H, 0}, {"[{\"name\": \"f\"", H, 0},
      {"Let me check.\n{\"name\": \"get", H, 14}, {"{\"type\": \"object\"}", H, 0},  // any key may come first
      {"int main()\n{\n  return 0;\n}", H, npos},
      // Llama 3: <|python_tag|>, or a reply that opens with '{'
      {"<|python", L, 0}, {"Sure <|pyt", L, 5}, {"  {\"name\"", L, 0}, {"The answer", L, npos}, {"<", L, 0},
      {"x <|python_tag|>{", L, 2}, {"[{\"name\"", L, 0}, {"[get_weather(city='Paris')]", L, npos},
      // Mistral: [TOOL_CALLS], or a reply that opens with an array of objects
      {"[TOOL_CALLS][{", M, 0}, {"Hi [TOOL", M, 3}, {"Okay [TOOL_CALLS]get", M, 5}, {"[", M, 0},
      {"[ {\"name\"", M, 0}, {"[1, 2]", M, npos}, {"Okay", M, npos},
      // harmony: any message marker (the reasoning parser leaves only calls' headers in the answer)
      {"It is sunny.", O, npos}, {"Hi <|chan", O, 3}, {"Hi <|start|>assistant to=", O, 3}, {"a < b", O, npos},
      // DeepSeek: its calls block or a call
      {"Let me check.<｜tool", D, 13}, {"<｜tool▁call▁begin｜>", V, 0}, {"Fine.", V, npos},
      // Qwen3-Coder: <tool_call> or a bare <function=
      {"Sure.\n<tool_", Q, 6}, {"Sure.\n<function=get", Q, 6}, {"a < b", Q, npos}, {"x <funct", Q, 2},
  };
  for (const auto& c : cases) EXPECT_EQ(tool_call_start(c.text, c.format), c.start) << to_string(c.format) << ": " << c.text;
}

// Streaming every recorded output token by token (here: byte by byte): the hold-back offset never
// moves back, and what was streamed before it is the start of the final content, never call text.
TEST(ToolCallStart, StreamedPrefixIsTheStartOfTheFinalContent) {
  for (const auto& r : kRecorded) {
    const std::string text = data(r.file);
    size_t sent = 0;
    for (size_t n = 0; n <= text.size(); ++n) {
      const size_t start = std::min(tool_call_start(std::string_view(text).substr(0, n), r.format), n);
      ASSERT_GE(start, sent) << r.file << " at " << n;
      sent = start;
    }
    const ParsedToolOutput p = parse_tool_calls(text, r.format, tools(r.tool_set));
    EXPECT_TRUE(p.content.starts_with(trimmed(text.substr(0, sent)))) << r.file << ": streamed " << text.substr(0, sent);
    if (!p.calls.empty()) {
      EXPECT_LT(sent, text.size()) << r.file;
    }
  }
}

// The grammar that forces a call: texts in each format, whether they match, and what parsing a
// matching one gives back.
TEST(ToolCallGbnf, MatchesValidCallsOnlyAndParsesBack) {
  struct Case {
    ToolFormat format;
    bool parallel;
    const char* text;
    const char* calls;  // nullptr: must not match
  };
  const char* paris = R"(get_weather({"city":"Paris"}))";
  const Case cases[] = {
      {H, false, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", paris},
      {H, false, R"(<tool_call>{"name":"get_time","arguments":{"city":"Oslo"}}</tool_call>)", R"(get_time({"city":"Oslo"}))"},
      {H, false, R"(<tool_call>{"name": "get_joke", "arguments": {"city": "Paris"}}</tool_call>)", nullptr},
      {H, false, R"(<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>)", nullptr},
      {H, false, R"(<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>)", nullptr},
      {H, false, R"(<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "kelvin"}}</tool_call>)", nullptr},
      {H, false, R"(<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>)", nullptr},
      {H, false, R"(Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>)", nullptr},
      {H, false, R"(<tool_call>{"name": "get_time", "arguments": {"city": "A"}}</tool_call><tool_call>{"name": "get_time", "arguments": {"city": "B"}}</tool_call>)", nullptr},
      {H, true, "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"city\": \"A\"}}</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {\"city\": \"B\"}}</tool_call>",
       R"(get_time({"city":"A"}); get_time({"city":"B"}))"},
      {L, false, R"({"name": "get_weather", "parameters": {"city": "Paris"}})", paris},
      {L, false, R"(<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}})", paris},
      {L, false, R"({"name": "get_weather", "arguments": {"city": "Paris"}})", nullptr},
      {L, false, R"({"name": "get_time", "parameters": {"city": "A"}}; {"name": "get_time", "parameters": {"city": "B"}})", nullptr},
      {L, true, R"({"name": "get_time", "parameters": {"city": "A"}}; {"name": "get_time", "parameters": {"city": "B"}})",
       R"(get_time({"city":"A"}); get_time({"city":"B"}))"},
      {M, false, R"([TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}])", paris},
      {M, false, R"([{"name": "get_weather", "arguments": {"city": "Paris"}}])", paris},
      {M, false, R"([TOOL_CALLS][{"name": "get_weather", "arguments": {"town": "Paris"}}])", nullptr},
      {M, true, R"([TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {"city": "Paris"}}])",
       R"(get_time({"city":"A"}); get_weather({"city":"Paris"}))"},
      {O, false, R"(<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>)", paris},
      {O, false, R"(<|channel|>commentary to=functions.get_joke <|constrain|>json<|message|>{"city": "Paris"}<|call|>)", nullptr},
      {O, true, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"city\": \"A\"}<|call|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
       R"(get_time({"city":"A"}); get_weather({"city":"Paris"}))"},
      {D, false, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", paris},
      {D, false, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", nullptr},
      {V, true, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
                "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": \"A\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       R"(get_weather({"city":"Paris"}); get_time({"city":"A"}))"},
  };
  const std::string q_paris = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
  const std::string q_both = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                             "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>";
  const std::string q_kelvin = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                               "<parameter=unit>\nkelvin\n</parameter>\n</function>\n</tool_call>";
  const auto q = grammar::parse_gbnf(tool_call_gbnf(tools("weather"), Q, "", false));
  EXPECT_TRUE(grammar::matches(q, q_paris));
  EXPECT_EQ(calls_text(parse_tool_calls(q_paris, Q, tools("weather"))), paris);
  EXPECT_TRUE(grammar::matches(q, q_both));
  EXPECT_FALSE(grammar::matches(q, q_kelvin));  // not in the enum
  EXPECT_FALSE(grammar::matches(q, "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"));  // city is required
  EXPECT_FALSE(grammar::matches(q, "<tool_call>\n<function=get_joke>\n</function>\n</tool_call>"));
  EXPECT_FALSE(grammar::matches(q, q_paris + "\n" + q_paris));
  EXPECT_TRUE(grammar::matches(grammar::parse_gbnf(tool_call_gbnf(tools("weather"), Q, "", true)), q_paris + "\n" + q_paris));
  // Typed parameters: JSON under each property's schema; a string is text (a '<' inside is fine).
  const auto typed = grammar::parse_gbnf(tool_call_gbnf(tools("typed"), Q, "", false));
  const std::string search = "<tool_call>\n<function=search_code>\n<parameter=query>\nfn main() {\n    println!(\"<hi>\");\n}\n"
                             "</parameter>\n<parameter=max_results>\n5\n</parameter>\n<parameter=case_sensitive>\ntrue\n"
                             "</parameter>\n</function>\n</tool_call>";
  EXPECT_TRUE(grammar::matches(typed, search));
  EXPECT_EQ(calls_text(parse_tool_calls(search, Q, tools("typed"))),
            R"(search_code({"query":"fn main() {\n    println!(\"<hi>\");\n}","max_results":5,"case_sensitive":true}))");
  EXPECT_FALSE(grammar::matches(typed, "<tool_call>\n<function=search_code>\n<parameter=query>\nx\n</parameter>\n"
                                       "<parameter=max_results>\nfive\n</parameter>\n</function>\n</tool_call>"));
  for (const auto& c : cases) {
    const grammar::Grammar g = grammar::parse_gbnf(tool_call_gbnf(tools("weather"), c.format, "", c.parallel));
    EXPECT_EQ(grammar::matches(g, c.text), c.calls != nullptr) << to_string(c.format) << ": " << c.text;
    if (c.calls) {
      EXPECT_EQ(calls_text(parse_tool_calls(c.text, c.format, tools("weather"))), c.calls) << c.text;
    }
  }
}

TEST(ToolCallGbnf, NamedFunctionOnlyAndUnknownNamesRefused) {
  const auto g = grammar::parse_gbnf(tool_call_gbnf(tools("weather"), H, "get_time", false));
  EXPECT_TRUE(grammar::matches(g, R"(<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>)"));
  EXPECT_FALSE(grammar::matches(g, R"(<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>)"));
  EXPECT_NE(test::error_message([] { tool_call_gbnf(tools("weather"), H, "get_joke", false); }).find("get_joke"), npos);
  EXPECT_NE(test::error_message([] { tool_call_gbnf(ojson::array(), M, "", false); }), "no error");
  const ojson odd = ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}])");
  EXPECT_NE(test::error_message([&] { tool_call_gbnf(odd, H, "", false); }).find("parameters of function 'f'"), npos);
}

TEST(ToolCallGbnf, FunctionWithoutParametersTakesAnyObject) {
  const ojson ping = ojson::parse(R"([{"type": "function", "function": {"name": "ping"}}])");
  const auto g = grammar::parse_gbnf(tool_call_gbnf(ping, H, "", false));
  EXPECT_TRUE(grammar::matches(g, R"(<tool_call>{"name": "ping", "arguments": {}}</tool_call>)"));
  EXPECT_TRUE(grammar::matches(g, R"(<tool_call>{"name": "ping", "arguments": {"x": [1, {"y": null}]}}</tool_call>)"));
  EXPECT_FALSE(grammar::matches(g, R"(<tool_call>{"name": "ping", "arguments": 5}</tool_call>)"));
  EXPECT_FALSE(grammar::matches(g, R"(<tool_call>{"name": "ping", "arguments": [1]}</tool_call>)"));
}

TEST(ToolCallGbnf, ParametersWithoutTypeStillDescribeAnObject) {
  const ojson fns = ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {}}}])");
  const auto g = grammar::parse_gbnf(tool_call_gbnf(fns, L, "", false));
  EXPECT_TRUE(grammar::matches(g, R"({"name": "f", "parameters": {"a": 1}})"));
  EXPECT_FALSE(grammar::matches(g, R"({"name": "f", "parameters": 5})"));
  EXPECT_FALSE(grammar::matches(g, R"({"name": "f", "parameters": "x"})"));
}

TEST(ToolCallGbnf, RulePrefixSkipsLiteralsClassesBoundsAndComments) {
  const std::string g = "root ::= item (\",\" item){0,3} # item list\nitem ::= \"a \\\" item\" | [a-z\\]] | str-1\n";
  EXPECT_EQ(prefix_gbnf_rules(g, "fn0-"),
            "fn0-root ::= fn0-item (\",\" fn0-item){0,3} # item list\nfn0-item ::= \"a \\\" item\" | [a-z\\]] | fn0-str-1\n");
}

}  // namespace
}  // namespace serval
