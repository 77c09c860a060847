// Every element's coordinate of a row-major shape, and back: the reference
// walks tests compare strided or sharded layouts against.
#pragma once

#include <cstdint>
#include <vector>

namespace ember::testing {

using Coord = std::vector<int64_t>;

// Every coordinate of `shape`, row-major (one empty coordinate for a 0-d shape).
inline std::vector<Coord> all_coords(const Coord& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<Coord> out;
  for (int64_t i = 0; i < n; ++i) {
    Coord c(shape.size());
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1, rest = i; d >= 0; --d) {
      c[d] = rest % shape[d];
      rest /= shape[d];
    }
    out.push_back(c);
  }
  return out;
}

// The row-major index of `coord` in `shape`.
inline int64_t flat_index(const Coord& shape, const Coord& coord) {
  int64_t k = 0;
  for (size_t d = 0; d < shape.size(); ++d) k = k * shape[d] + coord[d];
  return k;
}

}  // namespace ember::testing
