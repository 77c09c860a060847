// safetensors files (https://github.com/huggingface/safetensors): named
// tensors behind a JSON header, readable by torch/numpy/JAX and executing no
// code on load, which is why checkpoints use them.
//
// Layout: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON
//   {"__metadata__": {"k": "v"},                       (optional)
//    "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}
// padded with spaces to a multiple of 8, then the data section: each tensor's
// bytes, row-major little-endian, at [begin, end) relative to the data
// section; tensors are packed in order with no gaps.
//
//   save_safetensors("w.safetensors", {{"weight", w}, {"bias", b}}, {{"format", "pt"}});
//   auto f = load_safetensors("w.safetensors");   // StatusOr<SafetensorsFile>
//   if (!f.ok()) ...;  f->find("weight")
//
// Errors name the file and the problem (truncated file, invalid JSON,
// unknown dtype, bad offsets, ...). Files are trusted for nothing: every
// offset and shape is checked against the file size before memory is touched.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace ember {

struct SafetensorsFile {
  // In data-section order, which is the order they were saved in.
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;
  // nullptr when absent.
  const Tensor* find(const std::string& name) const;
};

// The safetensors dtype string ("F32", "BF16", "BOOL", ...) of an ember dtype.
const char* safetensors_dtype_name(DType t);

// The whole file as bytes: header, padding, data. Tensors on CUDA are copied
// to the CPU, non-contiguous ones made contiguous; names must be unique,
// non-empty and not "__metadata__".
absl::StatusOr<std::string> serialize_safetensors(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                  const std::map<std::string, std::string>& metadata = {});

// Parses a whole file held in memory; `source` names it in errors.
absl::StatusOr<SafetensorsFile> parse_safetensors(std::string_view bytes, const std::string& source = "<memory>");

// Writes `path` atomically: the bytes go to "<path>.tmp", which is fsynced and
// renamed over `path` (then the directory is fsynced), so readers see the old
// file or the complete new one. The tensors are streamed, not copied whole.
absl::Status save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Reads `path` into CPU tensors, reading each tensor's bytes straight into
// its storage after the header has been validated against the file size.
absl::StatusOr<SafetensorsFile> load_safetensors(const std::string& path);

// load_safetensors's checks without reading the tensors: the file opens, its
// header parses, and every tensor lies inside the file (a truncated file
// fails). Cheap whatever the file's size.
absl::Status check_safetensors_file(const std::string& path);

}  // namespace ember
