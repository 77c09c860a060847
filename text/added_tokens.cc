// Matching added tokens (text/added_tokens.h): a byte trie per pass, walked
// only at bytes that start some token.
#include "text/added_tokens.h"

#include <algorithm>

namespace ember::text {

namespace {

// Rust regex's Unicode \w (what Hugging Face's single_word checks with),
// spelled in PCRE2's classes: Alphabetic is approximated by L and Nl.
constexpr std::string_view kWordChar = R"([\p{L}\p{Nl}\p{Nd}\p{M}\p{Pc}\x{200C}\x{200D}])";

size_t prev_char_start(std::string_view text, size_t pos) {
  do --pos;
  while (pos > 0 && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80);
  return pos;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) : tokens_(tokens) {
  bool rules = false;
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const AddedToken& tok = tokens_[t];
    if (tok.content.empty()) continue;  // Hugging Face ignores empty tokens
    rules |= tok.single_word || tok.lstrip || tok.rstrip;
    Trie& trie = passes_[tok.normalized ? 1 : 0];
    trie.first_byte[static_cast<unsigned char>(tok.content[0])] = true;
    int32_t node = 0;
    for (unsigned char c : tok.content) {
      auto& ch = trie.nodes[node].children;
      auto it = std::lower_bound(ch.begin(), ch.end(), c, [](const auto& e, unsigned char b) { return e.first < b; });
      if (it != ch.end() && it->first == c) {
        node = it->second;
      } else {
        const auto child = static_cast<int32_t>(trie.nodes.size());
        ch.insert(it, {c, child});
        trie.nodes.emplace_back();
        node = child;
      }
    }
    // Two tokens with the same content: the later one's id wins, as a
    // later insert into Hugging Face's map does.
    trie.nodes[node].token = static_cast<int32_t>(t);
  }
  if (rules) {
    word_char_ = std::make_unique<Regex>(kWordChar);
    space_ = std::make_unique<Regex>(R"(\s)");
  }
}

std::vector<AddedTokenMatcher::Match> AddedTokenMatcher::find(int p, std::string_view text, size_t begin,
                                                              size_t end) const {
  const Trie& trie = passes_[p];
  std::vector<Match> out;
  size_t pos = begin;
  while (pos < end) {
    if (!trie.first_byte[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t i = pos; i < end; ++i) {
      const auto& ch = trie.nodes[node].children;
      const auto c = static_cast<unsigned char>(text[i]);
      auto it = std::lower_bound(ch.begin(), ch.end(), c, [](const auto& e, unsigned char b) { return e.first < b; });
      if (it == ch.end() || it->first != c) break;
      node = it->second;
      if (trie.nodes[node].token >= 0) best = trie.nodes[node].token, best_end = i + 1;
    }
    if (best >= 0) {
      out.push_back({pos, best_end, best});
      pos = best_end;
    } else {
      ++pos;
    }
  }
  return out;
}

std::vector<AddedTokenMatcher::Match> AddedTokenMatcher::resolve(std::string_view text, size_t begin, size_t end,
                                                                 std::vector<Match> found) const {
  if (!word_char_) return found;
  std::string_view sentence = text.substr(0, end);
  auto is_word = [&](size_t at) {
    size_t e;
    return word_char_->match_at(sentence, at, &e);
  };
  auto is_space = [&](size_t at, size_t* e) { return space_->match_at(sentence, at, e); };
  std::vector<Match> out;
  size_t start_offset = begin;
  for (Match m : found) {
    if (m.begin < start_offset) continue;  // inside the previous token's rstrip
    const AddedToken& tok = tokens_[m.token];
    if (tok.single_word) {
      const bool start_space = m.begin == begin || !is_word(prev_char_start(sentence, m.begin));
      const bool stop_space = m.end == end || !is_word(m.end);
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t s = m.begin, e;
      while (s > start_offset) {
        const size_t c = prev_char_start(sentence, s);
        if (!is_space(c, &e)) break;
        s = c;
      }
      m.begin = s;
    }
    if (tok.rstrip) {
      size_t e;
      while (m.end < end && is_space(m.end, &e)) m.end = e;
    }
    out.push_back(m);
    start_offset = m.end;
  }
  return out;
}

}  // namespace ember::text
