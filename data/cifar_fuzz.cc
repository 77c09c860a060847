// Fuzz target: read_cifar10 on arbitrary bytes (one batch file; the input's
// first byte splits it into two files when odd). Whatever loads has one
// 3x32x32 image per label and labels below 10.
#include <cstdint>
#include <string>
#include <vector>

#include "data/readers.h"
#include "data/readers_fuzz_util.h"

using ember::data::fuzzing::MemFile;
using ember::data::fuzzing::require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool two = data[0] & 1;
  const size_t cut = two ? 1 + (size - 1) / 2 : size;
  MemFile a(data + 1, cut - 1), b(data + cut, size - cut);
  std::vector<std::string> paths = {a.path()};
  if (two) paths.push_back(b.path());
  auto d = ember::data::read_cifar10(paths);
  if (d.ok()) {
    require(d->images.dim() == 4 && d->images.size(1) == 3 && d->images.size(2) == 32 && d->images.size(3) == 32,
            "cifar_fuzz", "image shape");
    require(d->images.size(0) == d->labels.size(0), "cifar_fuzz", "images and labels counts differ");
    for (double l : d->labels.to_vector()) require(l >= 0 && l < 10, "cifar_fuzz", "a label out of range loaded");
  }
  return 0;
}
