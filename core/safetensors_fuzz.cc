// Fuzz target: parse_safetensors on arbitrary bytes (a checkpoint's model
// file is untrusted input). Beyond not crashing, whatever parses must
// describe tensors that lie inside the input, and serialising it again must
// give a file that parses to the same names, dtypes, shapes and bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/safetensors.h"

namespace {
void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "safetensors_fuzz: invariant broken: %s\n", what);
    std::abort();
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto file = ember::parse_safetensors(bytes, "<fuzz input>");
  if (!file.ok()) {
    require(!file.status().message().empty(), "an error without a message");
    return 0;
  }
  size_t total = 0;
  for (const auto& [name, t] : file->tensors) total += t.nbytes();
  require(total <= size, "tensors hold more bytes than the input");
  auto again = ember::serialize_safetensors(file->tensors, file->metadata);
  require(again.ok(), "a parsed file does not serialise");
  auto reparsed = ember::parse_safetensors(*again, "<reserialised>");
  require(reparsed.ok(), "a re-serialised file does not parse");
  require(reparsed->tensors.size() == file->tensors.size(), "tensor count changed");
  for (size_t i = 0; i < file->tensors.size(); ++i) {
    const auto& [n1, a] = file->tensors[i];
    const auto& [n2, b] = reparsed->tensors[i];
    require(n1 == n2 && a.dtype() == b.dtype() && a.sizes() == b.sizes(), "name, dtype or shape changed");
    require(a.nbytes() == b.nbytes() && std::memcmp(a.contiguous().raw_data(), b.contiguous().raw_data(), a.nbytes()) == 0,
            "tensor bytes changed");
  }
  require(reparsed->metadata == file->metadata, "metadata changed");
  return 0;
}
