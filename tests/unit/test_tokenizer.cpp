// Tokenizer conformance: every vector in ../shared/tokenizer-tests (ids from llama.cpp), round trips
// on random Unicode text, special tokens and the streaming UTF-8 behaviour of pieces.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "base/utf8.h"
#include "io/gguf.h"
#include "test_support.h"
#include "tokenizer/load.h"

namespace serval {
namespace {

std::vector<std::string> split_inputs(const std::string& s) {
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(sep, pos)) != std::string::npos; pos = hit + sep.size()) out.push_back(s.substr(pos, hit - pos));
  return out;  // the piece after the last separator is empty and ignored
}

std::vector<std::vector<int32_t>> parse_outputs(const std::string& s) {
  std::vector<std::vector<int32_t>> out;
  std::istringstream lines(s);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream ids(line);
    std::vector<int32_t> v;
    for (int32_t id; ids >> id;) v.push_back(id);
    out.push_back(v);
  }
  return out;
}

class VocabTest : public ::testing::TestWithParam<std::string> {
 protected:
  Tokenizer load() const {
    GgufFile g(test::shared_path("tokenizer-tests/ggml-vocab-" + GetParam() + ".gguf"));
    return Tokenizer(vocab_from_gguf(g));
  }
};

TEST_P(VocabTest, MatchesReferenceIds) {
  const Tokenizer tok = load();
  const std::string base = test::shared_path("tokenizer-tests/ggml-vocab-" + GetParam() + ".gguf");
  const auto inputs = split_inputs(test::read_file(base + ".inp"));
  const auto expected = parse_outputs(test::read_file(base + ".out"));
  ASSERT_EQ(inputs.size(), expected.size());
  int failures = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto got = tok.encode(inputs[i], /*add_special=*/false, /*parse_special=*/false);
    EXPECT_EQ(got, expected[i]) << "input #" << i << ": '" << inputs[i] << "'";
    failures += got != expected[i];
    // Decoding the reference ids gives back the input (SPM: minus the space it prefixed).
    EXPECT_EQ(tok.decode(expected[i]), inputs[i]) << "decode of input #" << i;
  }
  EXPECT_EQ(failures, 0);
}

// Random strings over ASCII, Latin, CJK, emoji and whitespace: decode(encode(s)) == s.
TEST_P(VocabTest, RandomUnicodeRoundTrip) {
  const Tokenizer tok = load();
  std::mt19937 rng(1234);
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x20, 0x7E}, {0xA0, 0x24F}, {0x370, 0x3FF}, {0x400, 0x4FF}, {0x4E00, 0x4FFF}, {0x1F600, 0x1F64F}, {0x9, 0xA}};
  for (int iter = 0; iter < 200; ++iter) {
    std::string s;
    const int len = 1 + int(rng() % 40);
    for (int i = 0; i < len; ++i) {
      const auto& r = ranges[rng() % ranges.size()];
      s += utf8_encode(r.first + rng() % (r.second - r.first + 1));
    }
    const auto ids = tok.encode(s, false, false);
    EXPECT_EQ(tok.decode(ids), s) << "round trip of '" << s << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(SharedVectors, VocabTest,
                         ::testing::Values("llama-spm", "phi-3", "gpt-2", "starcoder", "deepseek-coder"));

// The vocabularies of the fetched models (Gemma 3 SentencePiece, Qwen2 byte-level BPE with the qwen2
// pre-tokenizer) on tests/data/tokenizer-extra.inp; the expected ids were produced by llama.cpp
// (commit c392e5094, vocab-only load; Gemma's tokenizer keys under the gemma2 architecture, which
// that llama.cpp knows). tests/data/README.md says how.
class ModelVocabTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelVocabTest, MatchesLlamaCppIds) {
  const std::string model = test::cached_model(GetParam());
  ASSERT_FALSE(model.empty()) << GetParam() << " is not in the model cache: run scripts/setup";
  GgufFile g(model);
  const Tokenizer tok(vocab_from_gguf(g));
  const std::string data = std::string(SERVAL_SOURCE_DIR) + "/tests/data/";
  const auto inputs = split_inputs(test::read_file(data + "tokenizer-extra.inp"));
  const auto expected = parse_outputs(test::read_file(data + GetParam() + ".tokenizer.out"));
  ASSERT_EQ(inputs.size(), expected.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(tok.encode(inputs[i], false, false), expected[i]) << "input #" << i << ": '" << inputs[i] << "'";
    EXPECT_EQ(tok.decode(expected[i]), inputs[i]) << "decode of input #" << i;
  }
}

INSTANTIATE_TEST_SUITE_P(FetchedModels, ModelVocabTest,
                         ::testing::Values("gemma-3-270m", "qwen2.5-coder-0.5b-instruct"),
                         [](const auto& info) { return info.param == "gemma-3-270m" ? std::string("Gemma3") : std::string("Qwen2"); });

TEST(Tokenizer, Stories260kPrompt) {
  GgufFile g(test::shared_path("models/stories260K.gguf"));
  Tokenizer tok(vocab_from_gguf(g));
  // Prompt ids recorded by llama.cpp in models/reference/stories260K-once-upon-a-time.json.
  EXPECT_EQ(tok.encode("Once upon a time", true), (std::vector<int32_t>{1, 403, 407, 261, 378}));
}

TEST(Tokenizer, HuggingFaceJsonMatchesGgufVocabulary) {
  const auto hf = vocab_from_tokenizer_json(test::shared_path("models/TinyStories-656K/tokenizer.json"));
  GgufFile g(test::shared_path("models/TinyStories-656K-Q8_0.gguf"));
  const auto gg = vocab_from_gguf(g);
  ASSERT_EQ(hf.tokens.size(), gg.tokens.size());
  EXPECT_EQ(hf.tokens, gg.tokens);
  EXPECT_EQ(hf.bos, 1);
  EXPECT_EQ(hf.eos, 2);
  EXPECT_TRUE(hf.add_bos);
}

TEST(Tokenizer, HuggingFaceBpeMergesAndRoundTrip) {
  Tokenizer tok(vocab_from_tokenizer_json(test::shared_path("models/TinyStories-656K/tokenizer.json")));
  const std::string text = "Once upon a time, there was a little dog named Max. He liked to run.";
  const auto ids = tok.encode(text, true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 3) << "merges should give multi-character tokens";
  // This vocabulary has no byte tokens: a character it cannot spell becomes <unk> (id 0).
  const auto unk = tok.encode("\xE4\xBD\xA0", false);
  EXPECT_NE(std::find(unk.begin(), unk.end(), 0), unk.end());
}

TEST(Tokenizer, SpecialTokensParsedOnlyWhenAsked) {
  GgufFile g(test::shared_path("tokenizer-tests/ggml-vocab-phi-3.gguf"));
  Tokenizer tok(vocab_from_gguf(g));
  const int32_t end = tok.find("<|end|>");
  ASSERT_GE(end, 0);
  const auto with = tok.encode("hi<|end|>", false, true);
  const auto without = tok.encode("hi<|end|>", false, false);
  EXPECT_NE(std::find(with.begin(), with.end(), end), with.end());
  EXPECT_EQ(std::find(without.begin(), without.end(), end), without.end());
  EXPECT_TRUE(tok.is_end_of_generation(end));
}

TEST(Tokenizer, PiecesStreamWithoutBrokenUtf8) {
  GgufFile g(test::shared_path("tokenizer-tests/ggml-vocab-gpt-2.gguf"));
  Tokenizer tok(vocab_from_gguf(g));
  const std::string text = "emoji 😀 and 你好 and é";
  const auto ids = tok.encode(text, false);
  Utf8StreamDecoder dec;
  std::string out;
  for (int32_t id : ids) {
    const std::string chunk = dec.push(tok.token_to_piece(id));
    EXPECT_EQ(utf8_decode(chunk).size(), utf8_split_chars(chunk).size());
    for (auto ch : utf8_split_chars(chunk)) EXPECT_GT(utf8_sequence_length(ch, 0), 0u) << "broken UTF-8 emitted";
    out += chunk;
  }
  out += dec.flush();
  EXPECT_EQ(out, text);
}

// Found by fuzz_tokenizer: decode read the attribute of an id outside the vocabulary.
TEST(Tokenizer, DecodeSkipsIdsOutsideTheVocabulary) {
  GgufFile g(test::shared_path("tokenizer-tests/ggml-vocab-llama-spm.gguf"));
  Tokenizer tok(vocab_from_gguf(g));
  const auto ids = tok.encode("Hello", false);
  std::vector<int32_t> with_bad{-1, 1 << 30};
  with_bad.insert(with_bad.end(), ids.begin(), ids.end());
  with_bad.push_back(tok.n_vocab());
  EXPECT_EQ(tok.decode(with_bad), "Hello");
  EXPECT_EQ(tok.decode(with_bad, /*render_special=*/true), "Hello");
}

// BERT's normalizer and pre-tokenizer, against the rules of Hugging Face's BertNormalizer /
// BertPreTokenizer worked by hand (the whole pipeline is checked against tokenizers in test_embeddings.py).
TEST(WordPiece, NormalizesAndSplitsAsBert) {
  const WordPieceOptions uncased;
  using V = std::vector<std::string>;
  EXPECT_EQ(wordpiece_words("H\xC3\xA9llo, WORLD!", uncased), (V{"hello", ",", "world", "!"}));
  EXPECT_EQ(wordpiece_words("\xE4\xB8\xAD\xE6\x96\x87" "ab", uncased), (V{"\xE4\xB8\xAD", "\xE6\x96\x87", "ab"}));  // CJK alone
  EXPECT_EQ(wordpiece_words("a\x07" "b\tc\xC2\xA0" "d", uncased), (V{"ab", "c", "d"}));  // control dropped, NBSP a space
  EXPECT_EQ(wordpiece_words("\xC4\xB0z", uncased), (V{"iz"}));  // U+0130 -> i + combining dot, stripped
  WordPieceOptions cased;
  cased.lowercase = cased.strip_accents = false;
  EXPECT_EQ(wordpiece_words("H\xC3\xA9llo, WORLD!", cased), (V{"H\xC3\xA9llo", ",", "WORLD", "!"}));
  EXPECT_EQ(wordpiece_words("   ", uncased), V{});
}

TEST(WordPiece, GreedyLongestMatchAndUnknownWords) {
  Vocab v;
  v.kind = TokenizerKind::WordPiece;
  v.tokens = {"[UNK]", "[CLS]", "[SEP]", "\xE2\x96\x81un", "\xE2\x96\x81unaff", "able", "aff", "\xE2\x96\x81x"};
  v.attrs = {TokenAttr::Control, TokenAttr::Control, TokenAttr::Control, TokenAttr::Normal, TokenAttr::Normal,
             TokenAttr::Normal, TokenAttr::Normal, TokenAttr::Normal};
  v.unk = 0, v.bos = 1, v.eos = 2, v.add_bos = v.add_eos = true;
  const Tokenizer tok(v);
  // "unaffable": longest first piece "unaff", then "able" (not "un" + "aff" + ...).
  EXPECT_EQ(tok.encode("unaffable x", true), (std::vector<int32_t>{1, 4, 5, 7, 2}));
  EXPECT_EQ(tok.encode("unaffablez", false), (std::vector<int32_t>{0}));  // a piece matches nothing: [UNK] whole
  EXPECT_EQ(tok.encode(std::string(101, 'x'), false), (std::vector<int32_t>{0}));  // over 100 characters
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, 4, 5, 7, 2}), "unaffable x");
  EXPECT_EQ(wordpiece_to_phantom("##ing"), "ing");
  EXPECT_EQ(wordpiece_to_phantom("[MASK]"), "[MASK]");
  EXPECT_EQ(wordpiece_to_phantom("the"), "\xE2\x96\x81the");
}

// Byte-level BPE tokenizer.json files split with their own pre-tokenizer: toy vocabularies trained by
// Hugging Face tokenizers with the pre_tokenizer (and normalizer) blocks of real families' files;
// expected ids from Hugging Face tokenizers (tests/data/tokenizers/record.py).
class PreTokenizerJsonTest : public ::testing::TestWithParam<std::string> {
 protected:
  static std::string dir() { return std::string(SERVAL_SOURCE_DIR) + "/tests/data/tokenizers/"; }
  static nlohmann::json read(const std::string& name) { return nlohmann::json::parse(test::read_file(dir() + name)); }
  void expect_reference_ids(const Tokenizer& tok) const {
    const auto texts = read("corpus.json")["texts"];
    const auto expected = read("reference.json")[GetParam()];
    ASSERT_EQ(texts.size(), expected.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i].get<std::string>();
      EXPECT_EQ(tok.encode(text, false, false), expected[i].get<std::vector<int32_t>>()) << GetParam() << " #" << i << ": '" << text << "'";
    }
  }
};

TEST_P(PreTokenizerJsonTest, MatchesHuggingFaceIds) {
  const Vocab v = vocab_from_tokenizer_json(dir() + GetParam() + ".tokenizer.json");
  EXPECT_EQ(v.kind, TokenizerKind::ByteLevelBpe);
  EXPECT_EQ(v.nfc, GetParam() == "qwen2");
  expect_reference_ids(Tokenizer(v));
}

// The named pre-tokenizers a GGUF file selects (tokenizer.ggml.pre) split as the families' own regexes.
TEST_P(PreTokenizerJsonTest, NamedPreTokenizerSplitsTheSame) {
  static const std::map<std::string, std::string> gguf_name = {
      {"qwen2", "qwen2"}, {"llama3", "llama-bpe"}, {"gpt2", "gpt-2"}, {"o200k", "gpt-4o"}, {"deepseek-llm", "deepseek-llm"}};
  const auto it = gguf_name.find(GetParam());
  if (it == gguf_name.end()) GTEST_SKIP() << "no GGUF name for this split sequence";
  Vocab v = vocab_from_tokenizer_json(dir() + GetParam() + ".tokenizer.json");
  EXPECT_EQ(pre_tokenizer_name_of(v.pre_regex), it->second);
  v.pre = pre_tokenizer_from_name(it->second);
  v.pre_regex.clear();
  expect_reference_ids(Tokenizer(v));
}

INSTANTIATE_TEST_SUITE_P(Families, PreTokenizerJsonTest,
                         ::testing::Values("qwen2", "llama3", "gpt2", "o200k", "deepseek-llm", "digits-llama3"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// A pre-tokenizer Serval cannot reproduce is refused with the file's name, never replaced by GPT-2's.
TEST(Tokenizer, UnsupportedPreTokenizerIsRefused) {
  auto base = nlohmann::json::parse(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tokenizers/qwen2.tokenizer.json"));
  const std::string path = testing::TempDir() + "/pre_tokenizer_refused.json";
  auto refused = [&](const nlohmann::json& pre, const std::string& why) {
    auto j = base;
    j["pre_tokenizer"] = pre;
    std::ofstream(path) << j.dump();
    try {
      vocab_from_tokenizer_json(path);
      ADD_FAILURE() << "accepted: " << pre.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  auto split = [](const std::string& re, const std::string& behavior) {
    return nlohmann::json{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", behavior}, {"invert", false}};
  };
  refused({{"type", "Sequence"}, {"pretokenizers", {split("\\p{L}+", "MergedWithPrevious"), byte_level}}}, "MergedWithPrevious");
  refused({{"type", "Sequence"}, {"pretokenizers", {split("[a-", "Isolated"), byte_level}}}, "does not compile");
  refused({{"type", "Sequence"}, {"pretokenizers", {{{"type", "Whitespace"}}, byte_level}}}, "Whitespace");
  refused({{"type", "ByteLevel"}, {"add_prefix_space", true}}, "add_prefix_space");
  refused({{"type", "Sequence"}, {"pretokenizers", {split("\\s+", "Isolated")}}}, "without ByteLevel");
  refused({{"type", "Sequence"}, {"pretokenizers", {byte_level, byte_level}}}, "one ByteLevel");
  base["normalizer"] = {{"type", "NFKC"}};
  refused({{"type", "ByteLevel"}, {"use_regex", true}}, "NFKC");
}

TEST(Tokenizer, NfcComposesOnlyWhatItShould) {
  EXPECT_EQ(nfc_normalize("Cafe\xCC\x81"), "Caf\xC3\xA9");  // e + U+0301 -> U+00E9
  EXPECT_EQ(nfc_normalize("plain ascii"), "plain ascii");
  EXPECT_EQ(nfc_normalize("\xE2\x84\xA6"), "\xCE\xA9");  // U+2126 OHM SIGN is a singleton: U+03A9
  EXPECT_EQ(nfc_normalize("bad \xFF utf-8"), "bad \xFF utf-8");  // left as it is
}

}  // namespace
}  // namespace serval
