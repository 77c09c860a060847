// A Unicode regular expression (PCRE2 with JIT, UTF and UCP modes) for the
// pre-tokenizers' split patterns: GPT-2's, or the pattern of a Split
// pre-tokenizer. Unicode classes (\p{L}, \p{N}, \s) come from PCRE2's tables,
// so their Unicode version is PCRE2's (docs/text.md lists the differences
// from Hugging Face's Oniguruma). Also UTF-8 validation: PCRE2 runs without
// its own per-call UTF check, which would rescan the whole subject each call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ember::text {

// GPT-2's pre-tokenization pattern (the ByteLevel pre-tokenizer's).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The byte offset of the first invalid UTF-8 sequence in s (overlong forms,
// surrogates and code points past U+10FFFF count as invalid), or npos.
size_t find_invalid_utf8(std::string_view s);

class Regex {
 public:
  // Throws ember::Error naming the pattern, PCRE2's message and the offset.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(Regex&& other) noexcept;
  Regex& operator=(Regex&& other) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  const std::string& pattern() const { return pattern_; }

  // Finds the next non-empty match in text starting at or after `from`;
  // returns false when there is none. text must be valid UTF-8 and `from` a
  // character boundary. Thread-safe (per-thread match data).
  bool find(std::string_view text, size_t from, size_t* begin, size_t* end) const;

  // Whether the pattern matches at exactly `at` (anchored there); *end gets
  // the match's end.
  bool match_at(std::string_view text, size_t at, size_t* end) const;

  // Calls piece(begin, end) for every piece of text when the matches are
  // isolated (Hugging Face's SplitDelimiterBehavior::Isolated): each match
  // is a piece and so is each gap between matches.
  template <typename F>
  void split_isolated(std::string_view text, F&& piece) const {
    size_t pos = 0, b = 0, e = 0;
    while (pos < text.size() && find(text, pos, &b, &e)) {
      if (b > pos) piece(pos, b);
      piece(b, e);
      pos = e;
    }
    if (pos < text.size()) piece(pos, text.size());
  }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace ember::text
