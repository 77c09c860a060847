// Added (and special) tokens: found in the text before pre-tokenization and
// emitted as their own ids, as Hugging Face's AddedVocabulary does
// (tokenizer/added_vocabulary.rs): leftmost-longest matches, first over the
// tokens with normalized=false, then over the rest in the text between;
// single_word, lstrip and rstrip as there.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/regex.h"

namespace ember::text {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = true;
};

class AddedTokenMatcher {
 public:
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);

  bool empty() const { return passes_[0].nodes.size() <= 1 && passes_[1].nodes.size() <= 1; }

  // Splits text into runs of ordinary text (segment(begin, end)) and added
  // tokens (token(id)), in order.
  template <typename Seg, typename Tok>
  void split(std::string_view text, Seg&& segment, Tok&& token) const {
    split_pass(0, text, 0, text.size(), segment, token);
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t token = -1;                                       // index into tokens_, or -1
  };
  struct Trie {
    std::vector<Node> nodes{1};
    bool first_byte[256] = {};
  };
  struct Match {
    size_t begin, end;
    int32_t token;
  };

  // The leftmost-longest non-overlapping matches of pass p in [begin, end),
  // before the single_word / strip rules.
  std::vector<Match> find(int p, std::string_view text, size_t begin, size_t end) const;
  // Applies the rules to the matches: the final (begin, end, id) list.
  std::vector<Match> resolve(std::string_view text, size_t begin, size_t end, std::vector<Match> found) const;

  template <typename Seg, typename Tok>
  void split_pass(int p, std::string_view text, size_t begin, size_t end, Seg& segment, Tok& token) const {
    if (begin == end) return;
    if (passes_[p].nodes.size() <= 1) {
      if (p == 0)
        split_pass(1, text, begin, end, segment, token);
      else
        segment(begin, end);
      return;
    }
    size_t pos = begin;
    for (const Match& m : resolve(text, begin, end, find(p, text, begin, end))) {
      if (m.begin > pos) {
        if (p == 0)
          split_pass(1, text, pos, m.begin, segment, token);
        else
          segment(pos, m.begin);
      }
      token(tokens_[m.token].id);
      pos = m.end;
    }
    if (pos < end) {
      if (p == 0)
        split_pass(1, text, pos, end, segment, token);
      else
        segment(pos, end);
    }
  }

  std::vector<AddedToken> tokens_;
  Trie passes_[2];  // [0]: normalized=false, [1]: normalized=true
  std::unique_ptr<Regex> word_char_, space_;
};

}  // namespace ember::text
