// PCRE2 (8-bit, UTF + UCP, JIT) behind text/regex.h.
#include "text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <utility>

#include "core/exception.h"

namespace ember::text {

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs dominate most text: skip them 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

// Per-thread scratch shared by every Regex: match data for one ovector pair
// (only the whole match is read) and a JIT stack larger than PCRE2's 32 KiB
// default, so long whitespace runs under `\s+(?!\S)` cannot exhaust it.
struct ThreadScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadScratch() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~ThreadScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
    pcre2_match_data_free(md);
  }
};

ThreadScratch& scratch() {
  thread_local ThreadScratch s;
  return s;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

Regex::Regex(std::string_view pattern) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
  EMBER_CHECK(code != nullptr, "regex '", pattern_, "': ", pcre2_message(err), " at offset ", offset);
  // Without JIT (a PCRE2 built without it) matching still works, slower.
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  code_ = code;
}

Regex::~Regex() {
  if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

Regex::Regex(Regex&& other) noexcept
    : pattern_(std::move(other.pattern_)), code_(std::exchange(other.code_, nullptr)), jit_(other.jit_) {}

Regex& Regex::operator=(Regex&& other) noexcept {
  if (this != &other) {
    if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
    pattern_ = std::move(other.pattern_);
    code_ = std::exchange(other.code_, nullptr);
    jit_ = other.jit_;
  }
  return *this;
}

namespace {

int run(const void* code, bool jit, std::string_view text, size_t from, uint32_t options) {
  ThreadScratch& s = scratch();
  const auto* re = static_cast<const pcre2_code*>(code);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  int rc = jit ? pcre2_jit_match(re, subject, text.size(), from, options, s.md, s.mctx)
               : pcre2_match(re, subject, text.size(), from, options | PCRE2_NO_UTF_CHECK, s.md, s.mctx);
  // rc == 0: the ovector (one pair) is too small for the groups, but the
  // whole match, all we read, is there.
  if (rc == PCRE2_ERROR_NOMATCH) return 0;
  EMBER_CHECK(rc >= 0, "regex match failed: ", pcre2_message(rc));
  return 1;
}

}  // namespace

bool Regex::find(std::string_view text, size_t from, size_t* begin, size_t* end) const {
  // NOTEMPTY: a pattern that can match the empty string yields its next
  // non-empty match instead, so splitting always advances.
  if (!run(code_, jit_, text, from, PCRE2_NOTEMPTY)) return false;
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch().md);
  *begin = ov[0];
  *end = ov[1];
  return true;
}

bool Regex::match_at(std::string_view text, size_t at, size_t* end) const {
  // ANCHORED at match time is not JIT-compiled: take the interpreter.
  ThreadScratch& s = scratch();
  int rc = pcre2_match(static_cast<const pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                       at, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, s.md, s.mctx);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  EMBER_CHECK(rc >= 0, "regex match failed: ", pcre2_message(rc));
  *end = pcre2_get_ovector_pointer(s.md)[1];
  return true;
}

}  // namespace ember::text
