// Limits for JSON read from files (safetensors headers, checkpoint
// trainer.json, users' extra JSON). nlohmann::json parses and destroys nested
// values recursively, so a crafted file of a few hundred KB of "[[[[..."
// overflows the stack and kills the process before any error can be raised
// (measured: depth 100,000 segfaults). Every parse of untrusted JSON checks
// these first, in one linear pass, without building anything.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ember {

// Far deeper than any file ember writes (3-4 levels), far below the stack.
constexpr int kMaxJsonDepth = 128;

// "" when `text` nests arrays/objects at most `max_depth` levels deep;
// otherwise why not, with the byte offset where the limit was crossed.
// Brackets inside strings (and escaped quotes) do not count.
std::string json_depth_error(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace ember
