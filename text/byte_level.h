// GPT-2's byte-to-unicode mapping: every byte gets a printable code point
// (printable Latin-1 bytes keep theirs, the other 68 get U+0100..U+0143), so
// a byte-level token's bytes are written as a readable string in
// tokenizer.json ("Ġthe" is " the").
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ember::text {

// The code point that byte b is written as.
uint32_t byte_to_codepoint(uint8_t b);

// The byte written as code point cp, or -1 when cp is none of the 256.
int codepoint_to_byte(uint32_t cp);

// Appends the UTF-8 encoding of cp to out.
void append_utf8(uint32_t cp, std::string& out);

// bytes as a byte-level token string (UTF-8).
std::string bytes_to_token(std::string_view bytes);

// The bytes a token string stands for, or nullopt when one of its
// characters is not a byte's code point (or it is not valid UTF-8).
std::optional<std::string> token_to_bytes(std::string_view token);

}  // namespace ember::text
