// GPT-2's bytes_to_unicode table, computed as GPT-2 and Hugging Face do.
#include "text/byte_level.h"

namespace ember::text {

namespace {

struct Tables {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 324> from_cp{};  // every mapped code point is < 324
  Tables() {
    from_cp.fill(-1);
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) to_cp[b] = printable(b) ? b : 256 + n++;
    for (int b = 0; b < 256; ++b) from_cp[to_cp[b]] = static_cast<int16_t>(b);
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return tables().to_cp[b]; }

int codepoint_to_byte(uint32_t cp) { return cp < 324 ? tables().from_cp[cp] : -1; }

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string bytes_to_token(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(byte_to_codepoint(b), out);
  return out;
}

std::optional<std::string> token_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  const auto* p = reinterpret_cast<const unsigned char*>(token.data());
  size_t i = 0;
  while (i < token.size()) {
    // Mapped code points are < U+0144: one or two UTF-8 bytes.
    uint32_t cp;
    if (p[i] < 0x80) {
      cp = p[i++];
    } else if ((p[i] & 0xE0) == 0xC0 && i + 1 < token.size() && (p[i + 1] & 0xC0) == 0x80) {
      cp = ((p[i] & 0x1F) << 6) | (p[i + 1] & 0x3F);
      i += 2;
    } else {
      return std::nullopt;
    }
    const int b = codepoint_to_byte(cp);
    if (b < 0) return std::nullopt;
    out += static_cast<char>(b);
  }
  return out;
}

}  // namespace ember::text
