// See json_limits.h.
#include "core/json_limits.h"

namespace ember {

std::string json_depth_error(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        return "JSON nested deeper than " + std::to_string(max_depth) + " levels (at byte " + std::to_string(i) +
               "); refusing to parse it";
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return "";
}

}  // namespace ember
