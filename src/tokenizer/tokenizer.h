// Tokenizers: SentencePiece-style (scores, byte fallback), byte-level BPE with named pre-tokenizers,
// Hugging Face BPE from tokenizer.json, and BERT's WordPiece. Built from GGUF metadata or tokenizer.json.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenize.h"
#include "tokenizer/wordpiece.h"

namespace serval {

enum class TokenAttr : uint8_t { Normal, Unknown, Control, UserDefined, Unused, Byte };

enum class TokenizerKind {
  Spm,            // SentencePiece: merge adjacent pieces by highest score, byte fallback
  ByteLevelBpe,   // GPT-2 style: bytes mapped to printable code points, merges by rank
  CharBpe,        // tokenizer.json BPE over characters with merges by rank and byte fallback
  WordPiece,      // BERT: normalized words split greedily into the longest known pieces
};

struct Vocab {
  TokenizerKind kind = TokenizerKind::Spm;
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<TokenAttr> attrs;
  std::unordered_map<std::string, int32_t> merge_ranks;  // "left right" -> rank (BPE kinds)
  PreTokenizer pre = PreTokenizer::None;
  std::vector<std::string> pre_regex;  // byte-level BPE: a tokenizer.json's own split regexes (else `pre`'s)
  bool nfc = false;                    // byte-level BPE: NFC-normalize the text first (tokenizer.json's NFC)
  bool add_space_prefix = true;  // SPM: prefix the text with a space (as U+2581)
  bool ignore_merges = false;    // BPE: a pre-token that is a whole token is emitted as-is
  WordPieceOptions wordpiece;    // WordPiece: normalization (its tokens are spelled as GGUF spells them,
                                 // wordpiece_to_phantom); bos is [CLS] and eos [SEP]
  int32_t bos = -1, eos = -1, eot = -1, unk = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  std::vector<int32_t> end_of_generation;  // EOS, EOT and similar ids that end a reply
  std::string chat_template;
  std::string rerank_template;  // GGUF tokenizer.chat_template.rerank: a decoder reranker's prompt
};

class Tokenizer {
 public:
  explicit Tokenizer(Vocab vocab);

  // Text to ids. add_special: BOS/EOS as the vocabulary asks; parse_special: control tokens
  // written in the text (e.g. "<|im_start|>") become their ids.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special = false) const;
  // The bytes a token stands for (may be part of a UTF-8 character). Control tokens give "" unless
  // render_special.
  std::string token_to_piece(int32_t id, bool render_special = false) const;
  // Ids to text (bytes joined; SPM drops the leading space it added).
  std::string decode(std::span<const int32_t> ids, bool render_special = false) const;

  const Vocab& vocab() const { return vocab_; }
  int32_t n_vocab() const { return static_cast<int32_t>(vocab_.tokens.size()); }
  // True when `id` ends generation (EOS, EOT, ...).
  bool is_end_of_generation(int32_t id) const;
  // Id of a token text, or -1.
  int32_t find(std::string_view text) const;

 private:
  Vocab vocab_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> pre_regex_;      // byte-level BPE: the split regexes in use
  std::vector<int32_t> special_by_length_;  // control / user-defined tokens, longest first
  std::vector<int32_t> byte_to_token_;      // SPM/CharBpe byte fallback ids (or -1)

  void encode_fragment(std::string_view text, bool first_fragment, std::vector<int32_t>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void emit_with_byte_fallback(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_wordpiece_word(std::string_view word, std::vector<int32_t>& out) const;
};

// Byte-level BPE's mapping of a byte to its printable code point (GPT-2 convention), as UTF-8.
const std::string& byte_to_unicode(uint8_t b);

}  // namespace serval
