#include "tokenizer/load.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"

namespace serval {
namespace {

TokenAttr attr_from_gguf_type(int64_t t) {
  switch (t) {
    case 2: return TokenAttr::Unknown;
    case 3: return TokenAttr::Control;
    case 4: return TokenAttr::UserDefined;
    case 5: return TokenAttr::Unused;
    case 6: return TokenAttr::Byte;
    default: return TokenAttr::Normal;
  }
}

nlohmann::json read_json(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

// [CLS] text [SEP]: llama.cpp's converter writes the separator's id but no key for [CLS] (its runtime
// assumes the BERT ids); Serval's writes both as bos and separator. Normalization: uncased unless
// Serval's keys say otherwise (llama.cpp's runtime always lowercases and strips accents).
void set_wordpiece_specials(Vocab& v, const GgufFile& g) {
  auto find = [&](const char* text) -> int32_t {
    for (size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i] == text) return int32_t(i);
    return -1;
  };
  const int32_t cls = find("[CLS]");
  if (cls >= 0 && !g.has("tokenizer.ggml.bos_token_id")) v.bos = cls;
  v.eos = static_cast<int32_t>(g.find_int("tokenizer.ggml.seperator_token_id").value_or(find("[SEP]")));
  if (v.unk < 0) v.unk = find("[UNK]");
  v.add_bos = v.add_eos = true;
  v.add_space_prefix = true;
  v.wordpiece.lowercase = g.find_bool("serval.tokenizer.lowercase").value_or(true);
  v.wordpiece.strip_accents = g.find_bool("serval.tokenizer.strip_accents").value_or(v.wordpiece.lowercase);
}

// A WordPiece tokenizer.json (BERT): its vocabulary in GGUF's spelling, its normalizer's flags, and
// [CLS] / [SEP] around the text.
Vocab wordpiece_from_json(const nlohmann::json& j, const std::string& path) {
  Vocab v;
  v.kind = TokenizerKind::WordPiece;
  const auto& model = j.at("model");
  check(model.value("continuing_subword_prefix", "##") == "##", "{}: WordPiece prefix other than '##' is unsupported", path);
  v.wordpiece.max_chars_per_word = model.value("max_input_chars_per_word", 100);
  const auto& vocab = model.at("vocab");
  v.tokens.resize(vocab.size());
  for (auto& [text, id] : vocab.items()) {
    const auto i = id.get<int64_t>();
    check(i >= 0 && i < static_cast<int64_t>(vocab.size()), "{}: token id {} out of range", path, i);
    v.tokens[i] = wordpiece_to_phantom(text);
  }
  v.attrs.assign(v.tokens.size(), TokenAttr::Normal);
  for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
    const auto i = t.at("id").get<int64_t>();
    check(i >= 0 && i < static_cast<int64_t>(v.tokens.size()), "{}: added token id {} out of range", path, i);
    v.tokens[i] = t.at("content").get<std::string>();
    v.attrs[i] = t.value("special", false) ? TokenAttr::Control : TokenAttr::UserDefined;
  }
  const auto& norm = j.value("normalizer", nlohmann::json());
  if (norm.is_object()) {
    check(norm.value("type", "") == "BertNormalizer", "{}: WordPiece with a '{}' normalizer is unsupported", path,
          norm.value("type", ""));
    v.wordpiece.clean_text = norm.value("clean_text", true);
    v.wordpiece.chinese_chars = norm.value("handle_chinese_chars", true);
    v.wordpiece.lowercase = norm.value("lowercase", true);
    const auto& strip = norm.value("strip_accents", nlohmann::json());
    v.wordpiece.strip_accents = strip.is_boolean() ? strip.get<bool>() : v.wordpiece.lowercase;
  } else {
    v.wordpiece.clean_text = v.wordpiece.chinese_chars = v.wordpiece.lowercase = v.wordpiece.strip_accents = false;
  }
  auto id_of = [&](const std::string& text) -> int32_t {
    for (size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i] == text) return int32_t(i);
    return -1;
  };
  v.unk = id_of(model.value("unk_token", "[UNK]"));
  v.bos = id_of("[CLS]");
  v.eos = id_of("[SEP]");
  v.pad = id_of("[PAD]");
  // [CLS] text [SEP] when the file's post-processor adds them (BertProcessing or a template); none without one.
  const auto& post = j.value("post_processor", nlohmann::json());
  v.add_bos = v.add_eos = post.is_object() && post.dump().find("[CLS]") != std::string::npos;
  v.add_space_prefix = true;
  return v;
}

// One step of a tokenizer.json pre-tokenizer as split regexes (appended to `out`); returns whether it
// is the byte-level step. Fails for a step Serval cannot reproduce exactly.
bool add_pre_step(const nlohmann::json& step, std::vector<std::string>& out, const std::string& path) {
  const std::string type = step.value("type", "");
  if (type == "ByteLevel") {
    check(!step.value("add_prefix_space", false), "{}: a ByteLevel pre-tokenizer with add_prefix_space is unsupported", path);
    if (step.value("use_regex", true)) out.push_back(pre_tokenizer_regexes(PreTokenizer::Gpt2).front());
    return true;
  }
  if (type == "Digits") {
    out.push_back(step.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
    return false;
  }
  check(type == "Split", "{}: unsupported pre-tokenizer '{}' (Sequence, Split, Digits and ByteLevel are supported)", path, type);
  const std::string behavior = step.value("behavior", "");
  check(behavior == "Isolated" && !step.value("invert", false),
        "{}: a Split pre-tokenizer with behavior '{}'{} is unsupported (Isolated is)", path, behavior,
        step.value("invert", false) ? " inverted" : "");
  const auto& pattern = step.at("pattern");
  if (pattern.contains("Regex")) {
    out.push_back(pattern.at("Regex").get<std::string>());
  } else {
    const std::string literal = pattern.at("String").get<std::string>();
    check(literal.find("\\E") == std::string::npos, "{}: a Split string containing \\E is unsupported", path);
    out.push_back("\\Q" + literal + "\\E");
  }
  check_pre_tokenizer_regex(out.back());
  return false;
}

// A byte-level tokenizer.json's split regexes, in order (Sequence steps in turn), from its own
// pre_tokenizer; fails unless exactly one step is ByteLevel.
std::vector<std::string> byte_level_regexes(const nlohmann::json& pre, const std::string& path) {
  std::vector<std::string> out;
  int byte_level = 0;
  if (pre.value("type", "") == "Sequence") {
    for (const auto& step : pre.at("pretokenizers")) byte_level += add_pre_step(step, out, path);
  } else {
    byte_level += add_pre_step(pre, out, path);
  }
  check(byte_level == 1, "{}: expected one ByteLevel step in the pre-tokenizer", path);
  return out;
}

// A byte-level tokenizer.json's normalizer: none or NFC.
bool byte_level_nfc(const nlohmann::json& j, const std::string& path) {
  const auto& norm = j.value("normalizer", nlohmann::json());
  if (norm.is_null()) return false;
  check(norm.value("type", "") == "NFC", "{}: a '{}' normalizer on a byte-level BPE is unsupported (NFC is)", path,
        norm.value("type", ""));
  return true;
}

}  // namespace

Vocab vocab_from_gguf(const GgufFile& g) {
  Vocab v;
  const std::string model = g.get_string("tokenizer.ggml.model");
  if (model == "llama") v.kind = TokenizerKind::Spm;
  else if (model == "gpt2") v.kind = TokenizerKind::ByteLevelBpe;
  else if (model == "bert") v.kind = TokenizerKind::WordPiece;
  else fail("{}: unsupported tokenizer model '{}' (llama, gpt2 and bert are supported)", g.path(), model);
  v.tokens = g.get_array("tokenizer.ggml.tokens").strings;
  check(!v.tokens.empty(), "{}: tokenizer.ggml.tokens is empty or not a string array", g.path());
  const size_t n = v.tokens.size();
  if (g.has("tokenizer.ggml.scores")) {
    const auto& s = g.get_array("tokenizer.ggml.scores").floats;
    check(s.size() == n, "{}: tokenizer.ggml.scores has {} entries for {} tokens", g.path(), s.size(), n);
    v.scores.assign(s.begin(), s.end());
  }
  if (g.has("tokenizer.ggml.token_type")) {
    const auto& t = g.get_array("tokenizer.ggml.token_type").ints;
    check(t.size() == n, "{}: tokenizer.ggml.token_type has {} entries for {} tokens", g.path(), t.size(), n);
    for (auto x : t) v.attrs.push_back(attr_from_gguf_type(x));
  }
  if (v.kind == TokenizerKind::ByteLevelBpe) {
    const auto& merges = g.get_array("tokenizer.ggml.merges").strings;
    for (size_t i = 0; i < merges.size(); ++i) v.merge_ranks.emplace(merges[i], static_cast<int32_t>(i));
    const std::string pre = g.find_string("tokenizer.ggml.pre").value_or("default");
    v.pre = pre_tokenizer_from_name(pre);
    v.ignore_merges = v.pre == PreTokenizer::Llama3;
    v.add_space_prefix = false;
  } else {
    v.add_space_prefix = g.find_bool("tokenizer.ggml.add_space_prefix").value_or(true);
  }
  auto id = [&](const char* key) { return static_cast<int32_t>(g.find_int(key).value_or(-1)); };
  v.bos = id("tokenizer.ggml.bos_token_id");
  v.eos = id("tokenizer.ggml.eos_token_id");
  v.eot = id("tokenizer.ggml.eot_token_id");
  v.unk = id("tokenizer.ggml.unknown_token_id");
  v.pad = id("tokenizer.ggml.padding_token_id");
  v.add_bos = g.find_bool("tokenizer.ggml.add_bos_token").value_or(v.kind == TokenizerKind::Spm);
  v.add_eos = g.find_bool("tokenizer.ggml.add_eos_token").value_or(false);
  v.chat_template = g.find_string("tokenizer.chat_template").value_or("");
  v.rerank_template = g.find_string("tokenizer.chat_template.rerank").value_or("");
  if (v.kind == TokenizerKind::WordPiece) set_wordpiece_specials(v, g);
  return v;
}

Vocab vocab_from_tokenizer_json(const std::string& path) {
  const auto j = read_json(path);
  Vocab v;
  try {
    const auto& model = j.at("model");
    if (model.value("type", "BPE") == "WordPiece") return wordpiece_from_json(j, path);
    check(model.value("type", "BPE") == "BPE", "{}: only BPE and WordPiece tokenizer.json models are supported", path);
    const auto& vocab = model.at("vocab");
    v.tokens.resize(vocab.size());
    for (auto& [text, id] : vocab.items()) {
      const auto i = id.get<int64_t>();
      check(i >= 0 && i < static_cast<int64_t>(vocab.size()), "{}: token id {} out of range", path, i);
      v.tokens[i] = text;
    }
    v.attrs.assign(v.tokens.size(), TokenAttr::Normal);
    const auto& merges = model.at("merges");
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string m = merges[i].is_string() ? merges[i].get<std::string>()
                                                  : merges[i][0].get<std::string>() + " " + merges[i][1].get<std::string>();
      v.merge_ranks.emplace(m, static_cast<int32_t>(i));
    }
    for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
      const auto i = t.at("id").get<int64_t>();
      if (i >= static_cast<int64_t>(v.tokens.size())) {
        v.tokens.resize(i + 1);
        v.attrs.resize(i + 1, TokenAttr::Unused);
      }
      v.tokens[i] = t.at("content").get<std::string>();
      v.attrs[i] = t.value("special", false) ? TokenAttr::Control : TokenAttr::UserDefined;
    }
    const bool byte_level = j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object() &&
                            j["pre_tokenizer"].dump().find("ByteLevel") != std::string::npos;
    if (byte_level) {
      v.kind = TokenizerKind::ByteLevelBpe;
      v.pre_regex = byte_level_regexes(j["pre_tokenizer"], path);
      v.nfc = byte_level_nfc(j, path);
      v.add_space_prefix = false;
    } else {
      const auto& pre = j.value("pre_tokenizer", nlohmann::json());
      const std::string pre_type = pre.is_object() ? pre.value("type", "") : pre.is_null() ? "" : pre.dump();
      check(pre.is_null() || pre_type == "Metaspace",
            "{}: unsupported pre-tokenizer '{}' for a BPE without ByteLevel (none or Metaspace)", path, pre_type);
      v.kind = TokenizerKind::CharBpe;
      v.add_space_prefix = j.contains("normalizer") && j["normalizer"].dump().find("Prepend") != std::string::npos;
    }
    v.ignore_merges = model.value("ignore_merges", false);
    for (size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i].size() == 6 && v.tokens[i].rfind("<0x", 0) == 0) v.attrs[i] = TokenAttr::Byte;
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = vocab.find(model["unk_token"].get<std::string>());
      if (it != vocab.end()) v.unk = it->get<int32_t>();
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: unexpected tokenizer.json structure: {}", path, e.what());
  }
  const auto config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    const auto c = read_json(config_path.string());
    auto token_id = [&](const char* key) -> int32_t {
      if (!c.contains(key)) return -1;
      const auto& t = c[key];
      const std::string text = t.is_string() ? t.get<std::string>() : t.is_object() ? t.value("content", "") : "";
      for (size_t i = 0; i < v.tokens.size(); ++i)
        if (v.tokens[i] == text) return static_cast<int32_t>(i);
      return -1;
    };
    v.bos = token_id("bos_token");
    v.eos = token_id("eos_token");
    v.pad = token_id("pad_token");
    if (v.unk < 0) v.unk = token_id("unk_token");
    v.add_bos = c.value("add_bos_token", false);
    v.add_eos = c.value("add_eos_token", false);
    if (c.contains("chat_template") && c["chat_template"].is_string()) v.chat_template = c["chat_template"];
  }
  return v;
}

}  // namespace serval
