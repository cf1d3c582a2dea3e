#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>

#include "base/error.h"
#include "base/utf8.h"

namespace serval {
namespace {

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK
constexpr double kNoMerge = std::numeric_limits<double>::quiet_NaN();

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  while (true) {
    size_t hit = s.find(from, pos);
    out.append(s.substr(pos, hit == std::string_view::npos ? std::string_view::npos : hit - pos));
    if (hit == std::string_view::npos) return out;
    out.append(to);
    pos = hit + from.size();
  }
}

// Greedy pairwise merging of adjacent symbols: repeatedly joins the adjacent pair with the lowest
// cost (ties: leftmost first) until no pair has a cost. `pair_cost(left, right)` returns NaN when
// the pair cannot merge. Returns the final symbols as views into `text`.
template <typename PairCost>
std::vector<std::string_view> merge_symbols(std::string_view text, PairCost pair_cost) {
  struct Symbol { int prev, next; size_t start, len; };
  struct Candidate { double cost; int left, right; size_t len; };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.cost > b.cost || (a.cost == b.cost && a.left > b.left);
  };
  std::vector<Symbol> sym;
  size_t pos = 0;
  for (auto ch : utf8_split_chars(text)) {
    const int i = static_cast<int>(sym.size());
    sym.push_back({i - 1, i + 1, pos, ch.size()});
    pos += ch.size();
  }
  if (!sym.empty()) sym.back().next = -1;
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> queue(worse);
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const double cost = pair_cost(text.substr(sym[left].start, sym[left].len), text.substr(sym[right].start, sym[right].len));
    if (!std::isnan(cost)) queue.push({cost, left, right, sym[left].len + sym[right].len});
  };
  for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& l = sym[c.left];
    Symbol& r = sym[c.right];
    if (l.len == 0 || r.len == 0 || l.next != c.right || l.len + r.len != c.len) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = c.left;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }
  std::vector<std::string_view> out;
  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) out.push_back(text.substr(sym[i].start, sym[i].len));
  return out;
}

std::array<std::string, 256> make_byte_to_unicode() {
  std::array<std::string, 256> table;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    table[b] = utf8_encode(printable ? uint32_t(b) : next++);
  }
  return table;
}

int unicode_to_byte(uint32_t cp) {
  static const auto table = [] {
    std::unordered_map<uint32_t, int> m;
    for (int b = 0; b < 256; ++b) m[utf8_decode(byte_to_unicode(uint8_t(b)))[0]] = b;
    return m;
  }();
  auto it = table.find(cp);
  return it == table.end() ? -1 : it->second;
}

// "<0x4A>" -> 0x4A, or -1.
int parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (char c : t.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else return -1;
  }
  return v;
}

}  // namespace

const std::string& byte_to_unicode(uint8_t b) {
  static const auto table = make_byte_to_unicode();
  return table[b];
}

Tokenizer::Tokenizer(Vocab vocab) : vocab_(std::move(vocab)) {
  const auto n = vocab_.tokens.size();
  check(n > 0, "tokenizer has an empty vocabulary");
  if (vocab_.attrs.size() != n) vocab_.attrs.assign(n, TokenAttr::Normal);
  if (vocab_.scores.size() != n) vocab_.scores.assign(n, 0.0f);
  byte_to_token_.assign(256, -1);
  pre_regex_ = vocab_.pre_regex.empty() ? pre_tokenizer_regexes(vocab_.pre) : vocab_.pre_regex;
  for (int32_t id = 0; id < static_cast<int32_t>(n); ++id) {
    token_to_id_.emplace(vocab_.tokens[id], id);
    const auto attr = vocab_.attrs[id];
    if (attr == TokenAttr::Control || attr == TokenAttr::UserDefined) special_by_length_.push_back(id);
    if (int b = parse_byte_token(vocab_.tokens[id]); b >= 0 && vocab_.kind != TokenizerKind::ByteLevelBpe)
      byte_to_token_[b] = id;
  }
  std::stable_sort(special_by_length_.begin(), special_by_length_.end(), [&](int32_t a, int32_t b) {
    return vocab_.tokens[a].size() > vocab_.tokens[b].size();
  });
  // An id outside the vocabulary (GGUF files use 0xFFFFFFFF for "none") means the token is absent.
  for (int32_t* id : {&vocab_.bos, &vocab_.eos, &vocab_.eot, &vocab_.unk, &vocab_.pad})
    if (*id < 0 || *id >= static_cast<int32_t>(n)) *id = -1;
  if (vocab_.eos >= 0) vocab_.end_of_generation.push_back(vocab_.eos);
  if (vocab_.eot >= 0) vocab_.end_of_generation.push_back(vocab_.eot);
  for (const char* name : {"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "<|eom_id|>"})
    if (int32_t id = find(name); id >= 0 && vocab_.attrs[id] == TokenAttr::Control) vocab_.end_of_generation.push_back(id);
  std::sort(vocab_.end_of_generation.begin(), vocab_.end_of_generation.end());
  vocab_.end_of_generation.erase(std::unique(vocab_.end_of_generation.begin(), vocab_.end_of_generation.end()),
                                 vocab_.end_of_generation.end());
}

int32_t Tokenizer::find(std::string_view text) const {
  auto it = token_to_id_.find(std::string(text));
  return it == token_to_id_.end() ? -1 : it->second;
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::binary_search(vocab_.end_of_generation.begin(), vocab_.end_of_generation.end(), id);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  // Split the text around special tokens (user-defined ones always; control ones when asked).
  struct Fragment { std::string_view text; int32_t token; };
  std::vector<Fragment> frags{{text, -1}};
  for (int32_t id : special_by_length_) {
    if (!parse_special && vocab_.attrs[id] != TokenAttr::UserDefined) continue;
    const std::string& tok = vocab_.tokens[id];
    if (tok.empty()) continue;
    std::vector<Fragment> next;
    for (const auto& f : frags) {
      if (f.token >= 0) { next.push_back(f); continue; }
      size_t pos = 0;
      for (size_t hit; (hit = f.text.find(tok, pos)) != std::string_view::npos; pos = hit + tok.size()) {
        if (hit > pos) next.push_back({f.text.substr(pos, hit - pos), -1});
        next.push_back({{}, id});
      }
      if (pos < f.text.size()) next.push_back({f.text.substr(pos), -1});
    }
    frags = std::move(next);
  }
  std::vector<int32_t> out;
  if (add_special && vocab_.add_bos && vocab_.bos >= 0) out.push_back(vocab_.bos);
  bool first = true;
  for (const auto& f : frags) {
    if (f.token >= 0) out.push_back(f.token);
    else encode_fragment(f.text, first, out);
    first = false;
  }
  if (add_special && vocab_.add_eos && vocab_.eos >= 0) out.push_back(vocab_.eos);
  return out;
}

void Tokenizer::encode_fragment(std::string_view text, bool first_fragment, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  switch (vocab_.kind) {
    case TokenizerKind::Spm:
    case TokenizerKind::CharBpe: {
      std::string s = replace_all(text, " ", kSpmSpace);
      if (vocab_.add_space_prefix && first_fragment) s.insert(0, kSpmSpace);
      if (vocab_.kind == TokenizerKind::Spm) encode_spm(s, out);
      else encode_bpe_word(s, out);
      return;
    }
    case TokenizerKind::WordPiece:
      for (const auto& word : wordpiece_words(text, vocab_.wordpiece)) encode_wordpiece_word(word, out);
      return;
    case TokenizerKind::ByteLevelBpe: {
      std::string normalized;  // only when the tokenizer normalizes (NFC); else the text is split as it is
      if (vocab_.nfc) normalized = nfc_normalize(text);
      for (const auto& word : pre_tokenize(pre_regex_, vocab_.nfc ? std::string_view(normalized) : text)) {
        std::string mapped;
        for (unsigned char b : word) mapped += byte_to_unicode(b);
        encode_bpe_word(mapped, out);
      }
      return;
    }
  }
}

void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  auto cost = [&](std::string_view l, std::string_view r) -> double {
    const int32_t id = find(std::string(l) + std::string(r));
    return id < 0 ? kNoMerge : -double(vocab_.scores[id]);  // highest score merges first
  };
  for (auto piece : merge_symbols(text, cost)) emit_with_byte_fallback(piece, out);
}

void Tokenizer::encode_bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (vocab_.ignore_merges) {
    if (int32_t id = find(word); id >= 0) { out.push_back(id); return; }
  }
  auto cost = [&](std::string_view l, std::string_view r) -> double {
    std::string key;
    key.reserve(l.size() + r.size() + 1);
    key.append(l).append(" ").append(r);
    auto it = vocab_.merge_ranks.find(key);
    return it == vocab_.merge_ranks.end() ? kNoMerge : double(it->second);
  };
  for (auto piece : merge_symbols(word, cost)) {
    if (vocab_.kind == TokenizerKind::CharBpe) {
      emit_with_byte_fallback(piece, out);
      continue;
    }
    if (int32_t id = find(piece); id >= 0) { out.push_back(id); continue; }
    for (auto ch : utf8_split_chars(piece))
      if (int32_t id = find(ch); id >= 0) out.push_back(id);
  }
}

// Greedy longest-match-first from the left; a word with a piece that matches nothing (or longer than
// max_chars_per_word characters) is the unknown token as a whole.
void Tokenizer::encode_wordpiece_word(std::string_view word, std::vector<int32_t>& out) const {
  const auto chars = utf8_split_chars(word);
  const size_t n = chars.size();
  std::vector<int32_t> pieces;
  bool known = n <= size_t(std::max(vocab_.wordpiece.max_chars_per_word, 0));
  std::string key;
  for (size_t start = 0; known && start < n;) {
    int32_t id = -1;
    size_t end = n;
    for (; end > start; --end) {
      key.assign(start == 0 ? kSpmSpace : std::string_view());
      key.append(chars[start].data(), size_t(chars[end - 1].data() + chars[end - 1].size() - chars[start].data()));
      if ((id = find(key)) >= 0) break;
    }
    if (id < 0) known = false;
    else pieces.push_back(id);
    start = end;
  }
  if (known) out.insert(out.end(), pieces.begin(), pieces.end());
  else if (vocab_.unk >= 0) out.push_back(vocab_.unk);
}

void Tokenizer::emit_with_byte_fallback(std::string_view piece, std::vector<int32_t>& out) const {
  if (int32_t id = find(piece); id >= 0) {
    out.push_back(id);
    return;
  }
  for (unsigned char b : piece) {
    if (byte_to_token_[b] >= 0) out.push_back(byte_to_token_[b]);
    else if (vocab_.unk >= 0) out.push_back(vocab_.unk);
  }
}

std::string Tokenizer::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) return "";
  const std::string& text = vocab_.tokens[id];
  const TokenAttr attr = vocab_.attrs[id];
  if (attr == TokenAttr::Control) return render_special ? text : "";
  if (attr == TokenAttr::UserDefined) return text;
  if (vocab_.kind == TokenizerKind::ByteLevelBpe) {
    std::string out;
    for (uint32_t cp : utf8_decode(text)) {
      const int b = unicode_to_byte(cp);
      if (b >= 0) out += static_cast<char>(b);
      else out += utf8_encode(cp);
    }
    return out;
  }
  if (attr == TokenAttr::Byte || parse_byte_token(text) >= 0) {
    const int b = parse_byte_token(text);
    if (b >= 0) return std::string(1, static_cast<char>(b));
  }
  return replace_all(text, kSpmSpace, " ");
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool render_special) const {
  std::string out;
  bool at_start = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= n_vocab()) continue;  // unknown ids decode to nothing (as token_to_piece)
    std::string piece = token_to_piece(id, render_special);
    // SentencePiece added a space in front of the text; the first piece gives it back.
    if (at_start && vocab_.kind != TokenizerKind::ByteLevelBpe && vocab_.add_space_prefix && !piece.empty() &&
        piece[0] == ' ' && vocab_.attrs[id] != TokenAttr::Control)
      piece.erase(0, 1);
    if (!piece.empty() || vocab_.attrs[id] != TokenAttr::Control) at_start = false;
    out += piece;
  }
  return out;
}

}  // namespace serval
