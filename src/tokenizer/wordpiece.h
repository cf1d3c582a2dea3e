// BERT's text pipeline before WordPiece: the normalizer (clean text, space around CJK ideographs,
// accent stripping, lowercasing) and the pre-tokenizer (whitespace and punctuation splits), with the
// semantics of Hugging Face tokenizers' BertNormalizer and BertPreTokenizer. Unicode properties
// (categories, NFD, case mapping) come from utf8proc.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace serval {

struct WordPieceOptions {
  bool clean_text = true;            // drop NUL, U+FFFD and control characters; any whitespace -> ' '
  bool chinese_chars = true;         // CJK ideographs become words of their own
  bool strip_accents = true;         // NFD, then drop combining marks (uncased models)
  bool lowercase = true;             // uncased models
  int max_chars_per_word = 100;      // a longer word is the unknown token
};

// The words of `text` after normalization and pre-tokenization (punctuation characters are words of
// their own; whitespace separates words and is dropped).
std::vector<std::string> wordpiece_words(std::string_view text, const WordPieceOptions& options);

// GGUF spells a WordPiece vocabulary with a "phantom space" (as llama.cpp's converter writes it): a
// word-initial piece "the" is "\u2581the", a continuation "##ing" is "ing", bracketed specials stay.
std::string wordpiece_to_phantom(const std::string& hf_token);

}  // namespace serval
