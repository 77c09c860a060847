// IDX and CIFAR-10 readers. Every check compares what a header or format
// promises with the bytes actually there, before any tensor is allocated
// from header values, so a corrupt header cannot ask for terabytes.
#include "data/readers.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ember::data {
namespace {

// Closes a gzFile on every return path.
struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

std::string gz_error(gzFile f) {
  int errnum = 0;
  const char* msg = gzerror(f, &errnum);
  return errnum == Z_ERRNO ? std::strerror(errno) : std::string(msg ? msg : "unknown zlib error");
}

uint32_t load_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

struct IdxType {
  DType dtype;
  size_t size;
};

bool idx_type(uint8_t code, IdxType* t) {
  switch (code) {
    case 0x08: *t = {DType::UInt8, 1}; return true;
    case 0x0C: *t = {DType::Int32, 4}; return true;
    case 0x0D: *t = {DType::Float32, 4}; return true;
    case 0x0E: *t = {DType::Float64, 8}; return true;
    default: return false;
  }
}

// The first of `candidates` under `root` that exists, else the first one
// (whose open then fails with a message naming it).
std::string pick_file(const std::string& root, const std::vector<std::string>& candidates) {
  for (const std::string& c : candidates) {
    std::string p = (std::filesystem::path(root) / c).string();
    std::error_code ec;
    if (std::filesystem::is_regular_file(p, ec)) return p;
  }
  return (std::filesystem::path(root) / candidates.front()).string();
}

template <typename T>
T value_or_throw(absl::StatusOr<T> s) {
  EMBER_CHECK(s.ok(), s.status().message());
  return *std::move(s);
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> read_file_bytes(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return absl::FailedPreconditionError(absl::StrCat(path, ": is a directory, not a file"));
  errno = 0;
  // gzopen reads non-gzip files as they are, so one path serves .gz and plain.
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  if (!f) {
    std::string why = errno ? std::strerror(errno) : "out of memory";
    return errno == ENOENT ? absl::NotFoundError(absl::StrCat(path, ": cannot open: ", why))
                           : absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", why));
  }
  gzbuffer(f.get(), 1 << 20);
  std::vector<uint8_t> bytes;
  // The decompressed size is unknown until the end: read through a buffer
  // that is not zero-filled and append what arrived, so a small file costs
  // what it holds (before, every read zero-filled 16 MiB).
  constexpr size_t kChunk = size_t{1} << 20;
  std::unique_ptr<uint8_t[]> chunk(new uint8_t[kChunk]);
  for (;;) {
    int n = gzread(f.get(), chunk.get(), static_cast<unsigned>(kChunk));
    if (n < 0) return absl::DataLossError(absl::StrCat(path, ": read failed: ", gz_error(f.get())));
    bytes.insert(bytes.end(), chunk.get(), chunk.get() + n);
    if (static_cast<size_t>(n) < kChunk) break;
  }
  int errnum = 0;
  gzerror(f.get(), &errnum);
  if (errnum != Z_OK)
    return absl::DataLossError(absl::StrCat(path, ": corrupt or truncated gzip data: ", gz_error(f.get())));
  bytes.shrink_to_fit();
  return bytes;
}

absl::StatusOr<Tensor> read_idx(const std::string& path) {
  absl::StatusOr<std::vector<uint8_t>> read = read_file_bytes(path);
  if (!read.ok()) return read.status();
  const std::vector<uint8_t>& b = *read;
  auto bad = [&](auto&&... parts) { return absl::DataLossError(absl::StrCat(path, ": ", parts...)); };
  if (b.size() < 4)
    return bad("truncated: ", b.size(), " bytes, shorter than the 4-byte IDX magic number");
  IdxType type;
  if (b[0] != 0 || b[1] != 0 || !idx_type(b[2], &type) || b[3] == 0)
    return bad("bad magic number 0x", absl::Hex(load_be32(b.data()), absl::kZeroPad8),
               ": not an IDX file (expected 0x0000TTNN: two zero bytes, an element type code 08/0C/0D/0E and "
               "the number of dims)");
  const size_t ndim = b[3];
  const size_t header = 4 + 4 * ndim;
  if (b.size() < header)
    return bad("truncated header: ", ndim, " dims need a ", header, "-byte header but the file has ", b.size(),
               " bytes");
  Shape dims(ndim);
  uint64_t count = 1;
  for (size_t d = 0; d < ndim; ++d) {
    dims[d] = load_be32(b.data() + 4 + 4 * d);
    // Dims are < 2^32 each; past 2^48 elements the file cannot be real.
    if (dims[d] != 0 && count > (uint64_t{1} << 48) / static_cast<uint64_t>(dims[d]))
      return bad("header dims ", shape_str(dims), " are implausibly large");
    count *= static_cast<uint64_t>(dims[d]);
  }
  const uint64_t expected = count * type.size, actual = b.size() - header;
  if (actual < expected)
    return bad("truncated: header dims ", shape_str(dims), " need ", expected, " bytes of data but only ", actual,
               " follow the header");
  if (actual > expected)
    return bad("header dims ", shape_str(dims), " account for ", expected, " bytes of data but ", actual,
               " follow the header (", actual - expected, " unexpected trailing bytes)");
  Tensor t = Tensor::empty(dims, type.dtype);
  const uint8_t* src = b.data() + header;
  uint8_t* dst = static_cast<uint8_t*>(t.raw_data());
  if (type.size == 1) {
    std::memcpy(dst, src, expected);
  } else {  // big-endian on disk
    for (uint64_t i = 0; i < count; ++i)
      for (size_t k = 0; k < type.size; ++k) dst[i * type.size + k] = src[i * type.size + type.size - 1 - k];
  }
  return t;
}

absl::StatusOr<ImageLabelData> read_mnist(const std::string& images_path, const std::string& labels_path,
                                          int64_t num_classes) {
  EMBER_CHECK(num_classes > 0, "read_mnist: num_classes must be positive, got ", num_classes);
  absl::StatusOr<Tensor> images = read_idx(images_path);
  if (!images.ok()) return images.status();
  absl::StatusOr<Tensor> labels = read_idx(labels_path);
  if (!labels.ok()) return labels.status();
  if (images->dim() != 3 || images->dtype() != DType::UInt8)
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": expected uint8 images [N,H,W], got ",
                                                   dtype_name(images->dtype()), " ", shape_str(images->sizes())));
  if (labels->dim() != 1 || labels->dtype() != DType::UInt8)
    return absl::InvalidArgumentError(absl::StrCat(labels_path, ": expected uint8 labels [N], got ",
                                                   dtype_name(labels->dtype()), " ", shape_str(labels->sizes())));
  const int64_t n = images->size(0);
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(images_path, ": holds no images (header dims ",
                                                             shape_str(images->sizes()), ")"));
  if (images->size(1) == 0 || images->size(2) == 0)
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": header dims ", shape_str(images->sizes()),
                                                   " declare ", images->size(1), "x", images->size(2),
                                                   " images; an image needs at least one pixel"));
  if (labels->size(0) != n)
    return absl::InvalidArgumentError(absl::StrCat("images and labels of different lengths: ", images_path, " has ",
                                                   n, " images but ", labels_path, " has ", labels->size(0),
                                                   " labels"));
  ImageLabelData d;
  d.images = images->view({n, 1, images->size(1), images->size(2)});
  d.labels = Tensor::empty({n}, DType::Int64);
  const uint8_t* src = labels->data<uint8_t>();
  int64_t* dst = d.labels.data<int64_t>();
  // Checked now, not when the label's batch reaches the loss hours later.
  for (int64_t i = 0; i < n; ++i) {
    if (src[i] >= num_classes)
      return absl::InvalidArgumentError(absl::StrCat(labels_path, ": label ", i, " is ", int{src[i]},
                                                     ", outside 0..", num_classes - 1, " (", num_classes,
                                                     " classes)"));
    dst[i] = src[i];
  }
  return d;
}

absl::StatusOr<ImageLabelData> load_mnist(const std::string& root, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images = prefix + "-images-idx3-ubyte", labels = prefix + "-labels-idx1-ubyte";
  return read_mnist(pick_file(root, {images + ".gz", images}), pick_file(root, {labels + ".gz", labels}),
                    kMnistClasses);
}

absl::StatusOr<ImageLabelData> read_cifar10(const std::vector<std::string>& paths) {
  constexpr int64_t kPixels = 3 * 32 * 32, kRecord = 1 + kPixels;
  if (paths.empty()) return absl::InvalidArgumentError("read_cifar10: no files given");
  std::vector<std::vector<uint8_t>> files;
  int64_t n = 0;
  for (const std::string& path : paths) {
    absl::StatusOr<std::vector<uint8_t>> b = read_file_bytes(path);
    if (!b.ok()) return b.status();
    if (b->empty() || b->size() % kRecord != 0)
      return absl::DataLossError(absl::StrCat(path, ": size ", b->size(), " bytes is not a positive multiple of the ",
                                              kRecord, "-byte CIFAR-10 record (1 label byte + 3072 pixels); ",
                                              "truncated or not a CIFAR-10 binary batch"));
    for (size_t r = 0; r < b->size(); r += kRecord)
      if ((*b)[r] > 9)
        return absl::DataLossError(absl::StrCat(path, ": record ", r / kRecord, " has label ", int{(*b)[r]},
                                                "; CIFAR-10 labels are 0..9 (not a CIFAR-10 binary batch?)"));
    n += static_cast<int64_t>(b->size()) / kRecord;
    files.push_back(*std::move(b));
  }
  ImageLabelData d;
  d.images = Tensor::empty({n, 3, 32, 32}, DType::UInt8);
  d.labels = Tensor::empty({n}, DType::Int64);
  uint8_t* img = d.images.data<uint8_t>();
  int64_t* lab = d.labels.data<int64_t>();
  for (const auto& b : files)
    for (size_t r = 0; r < b.size(); r += kRecord, img += kPixels) {
      *lab++ = b[r];
      std::memcpy(img, b.data() + r + 1, kPixels);
    }
  return d;
}

absl::StatusOr<ImageLabelData> load_cifar10(const std::string& root, bool train) {
  std::vector<std::string> paths;
  if (train) {
    for (int i = 1; i <= 5; ++i) paths.push_back((std::filesystem::path(root) / absl::StrCat("data_batch_", i, ".bin")).string());
  } else {
    paths.push_back((std::filesystem::path(root) / "test_batch.bin").string());
  }
  return read_cifar10(paths);
}

MNIST::MNIST(const std::string& root, bool train) : ImageDataset(value_or_throw(load_mnist(root, train))) {}

CIFAR10::CIFAR10(const std::string& root, bool train) : ImageDataset(value_or_throw(load_cifar10(root, train))) {}

}  // namespace ember::data
