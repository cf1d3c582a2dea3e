// libFuzzer harness for the tokenizers: encode / decode / streaming decode on every shared vocabulary.
//
// Input: one byte that picks the vocabulary (modulo their number), then the text. Vocabularies, in
// this order (loaded once, in LLVMFuzzerInitialize):
//   0.. every ../shared/tokenizer-tests/*.gguf, sorted by name (deepseek-coder, gpt-2, llama-spm,
//       phi-3, starcoder today: SentencePiece and byte-level BPE with three pre-tokenizers),
//   then ../shared/models/stories260K.gguf (llama2.c SentencePiece),
//   then ../shared/models/TinyStories-656K/tokenizer.json (Hugging Face character BPE),
//   then the gpt-2 vocabulary with the llama-bpe (Llama 3, ignore_merges) and the qwen2 pre-tokenizers,
//   which no shared vocabulary uses,
//   then the WordPiece vocabularies of tests/data/embeddings (tiny_bert: uncased, tiny_cross_encoder:
//   cased), which are lossy (lowercasing, [UNK]): only the id-range and no-crash properties apply.
// Properties (a violation aborts, so the fuzzer reports the input):
//   - every id from encode (with and without BOS/EOS and special-token parsing) is in range;
//   - decode(encode(s)) == s without special-token parsing, and decode(encode(s, parse_special),
//     render_special) == s, for every vocabulary that can spell any byte (byte-level BPE, or all 256
//     <0xXX> byte tokens), on valid UTF-8 text (for SentencePiece-style vocabularies, text without
//     U+2581, which stands for a space there; for byte-level BPE, text whose every byte's character
//     is a token: a byte without one is dropped, as llama.cpp drops it);
//   - streaming decode (Utf8StreamDecoder over token_to_piece) only ever emits valid UTF-8, and for
//     valid text gives the pieces joined;
//   - decode and token_to_piece of arbitrary ids (also out of range) do not crash.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"
#include "base/utf8.h"
#include "fuzz_common.h"
#include "io/gguf.h"
#include "tokenizer/load.h"
#include "tokenizer/tokenizer.h"

namespace {

using serval::fuzz::violation;

struct Entry {
  std::string name;
  std::unique_ptr<serval::Tokenizer> tok;
  bool spells_every_byte = false;
  // Byte-level BPE: the bytes whose character is a token. A byte without one is dropped, as llama.cpp
  // drops it (StarCoder's vocabulary has no token for 0xF1, which starts code points U+40000-U+7FFFF).
  std::array<bool, 256> spelled{};
};
std::vector<Entry> vocabs;

void add(std::string name, serval::Vocab v) {
  Entry e;
  e.name = std::move(name);
  e.tok = std::make_unique<serval::Tokenizer>(std::move(v));
  const bool byte_level = e.tok->vocab().kind == serval::TokenizerKind::ByteLevelBpe;
  bool all = byte_level;
  for (int b = 0; b < 256 && byte_level; ++b) e.spelled[size_t(b)] = e.tok->find(serval::byte_to_unicode(uint8_t(b))) >= 0;
  if (!all) {
    all = true;
    char buf[8];
    for (int b = 0; b < 256 && all; ++b) {
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      all = e.tok->find(buf) >= 0;
    }
  }
  e.spells_every_byte = all;
  vocabs.push_back(std::move(e));
}

bool valid_utf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = serval::utf8_sequence_length(s, pos);
    if (n == 0) return false;
    pos += n;
  }
  return true;
}

std::string show(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F && c != '\\') out += char(c);
    else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    }
  }
  return out;
}

void check_ids(const serval::Tokenizer& tok, const std::vector<int32_t>& ids, const char* what) {
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) violation("encode gave an id out of range", what);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(serval::fuzz::shared_path("tokenizer-tests")))
    if (e.path().extension() == ".gguf") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  serval::Vocab gpt2;
  for (const auto& f : files) {
    serval::GgufFile g(f.string());
    serval::Vocab v = serval::vocab_from_gguf(g);
    if (f.filename() == "ggml-vocab-gpt-2.gguf") gpt2 = v;
    add(f.filename().string(), std::move(v));
  }
  {
    serval::GgufFile g(serval::fuzz::shared_path("models/stories260K.gguf"));
    add("stories260K.gguf", serval::vocab_from_gguf(g));
  }
  add("TinyStories-656K/tokenizer.json",
      serval::vocab_from_tokenizer_json(serval::fuzz::shared_path("models/TinyStories-656K/tokenizer.json")));
  if (!gpt2.tokens.empty()) {
    serval::Vocab llama3 = gpt2;
    llama3.pre = serval::PreTokenizer::Llama3;
    llama3.ignore_merges = true;
    add("gpt-2 with llama-bpe pre-tokenizer", std::move(llama3));
    serval::Vocab qwen2 = gpt2;
    qwen2.pre = serval::PreTokenizer::Qwen2;
    add("gpt-2 with qwen2 pre-tokenizer", std::move(qwen2));
  }
  for (const char* name : {"tiny_bert", "tiny_cross_encoder"})
    add(std::string(name) + "/tokenizer.json",
        serval::vocab_from_tokenizer_json(std::string(SERVAL_SOURCE_DIR) + "/tests/data/embeddings/" + name + "/tokenizer.json"));
  if (vocabs.empty()) violation("no vocabulary loaded");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Entry& e = vocabs[data[0] % vocabs.size()];
  const serval::Tokenizer& tok = *e.tok;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool valid = valid_utf8(text);
  // SentencePiece writes spaces as U+2581, so a U+2581 in the text comes back as a space.
  const bool bytes_spelled = std::all_of(text.begin(), text.end(), [&](char c) {
    return tok.vocab().kind != serval::TokenizerKind::ByteLevelBpe || e.spelled[uint8_t(c)];
  });
  const bool round_trips = e.spells_every_byte && bytes_spelled && valid &&
                           (tok.vocab().kind == serval::TokenizerKind::ByteLevelBpe ||
                            text.find("\xE2\x96\x81") == std::string_view::npos);
  const std::string ctx = e.name + ": '" + show(text) + "'";

  // Plain text: special tokens stay text.
  const auto ids = tok.encode(text, /*add_special=*/false, /*parse_special=*/false);
  check_ids(tok, ids, ctx.c_str());
  const std::string back = tok.decode(ids);
  if (round_trips && back != text)
    violation("decode(encode(s)) != s", ctx + " gave '" + show(back) + "'");

  // With BOS/EOS and special tokens parsed.
  const auto sids = tok.encode(text, /*add_special=*/true, /*parse_special=*/true);
  check_ids(tok, sids, ctx.c_str());
  const auto& v = tok.vocab();
  if (v.add_bos && v.bos >= 0 && (sids.empty() || sids.front() != v.bos)) violation("BOS missing", ctx);
  if (v.add_eos && v.eos >= 0 && (sids.empty() || sids.back() != v.eos)) violation("EOS missing", ctx);
  const auto pids = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
  check_ids(tok, pids, ctx.c_str());
  const std::string sback = tok.decode(pids, /*render_special=*/true);
  if (round_trips && sback != text)
    violation("decode(encode(s, parse_special), render_special) != s", ctx + " gave '" + show(sback) + "'");
  (void)tok.decode(sids, /*render_special=*/false);

  // Streaming: complete characters only, and for valid text exactly the pieces joined.
  serval::Utf8StreamDecoder stream;
  std::string streamed, joined;
  for (int32_t id : ids) {
    const std::string piece = tok.token_to_piece(id);
    joined += piece;
    const std::string chunk = stream.push(piece);
    if (!valid_utf8(chunk)) violation("streaming decode emitted broken UTF-8", ctx + " chunk '" + show(chunk) + "'");
    streamed += chunk;
  }
  const std::string tail = stream.flush();
  if (!valid_utf8(tail)) violation("streaming decode flushed broken UTF-8", ctx);
  streamed += tail;
  if (valid_utf8(joined) && streamed != joined)
    violation("streamed text differs from the pieces joined", ctx + " streamed '" + show(streamed) + "'");
  // SentencePiece-style decode drops the space it prefixed; otherwise decode is the pieces joined.
  if (back != joined && !(joined.size() == back.size() + 1 && joined[0] == ' ' && joined.compare(1, back.size(), back) == 0))
    violation("decode is neither the pieces joined nor them minus the prefixed space", ctx);

  // Arbitrary ids (in range, negative and past the end) must decode without crashing.
  std::vector<int32_t> raw((size - 1) / 4);
  if (!raw.empty()) std::memcpy(raw.data(), data + 1, raw.size() * 4);
  for (auto& id : raw) {
    // Mostly valid ids, some far out of range.
    if ((id & 0xF) != 0) id = int32_t(uint32_t(id) % uint32_t(tok.n_vocab()));
  }
  (void)tok.decode(raw, false);
  (void)tok.decode(raw, true);
  for (int32_t id : raw) (void)tok.token_to_piece(id, true);
  return 0;
}
