// Readers for on-disk datasets: IDX (MNIST, Fashion-MNIST; plain or gzip)
// and CIFAR-10's binary batches.
//
//   data::FashionMNIST train;                  // /usr/share/datasets/fashion-mnist
//   train.images();  // uint8 [60000,1,28,28]; train.labels(): int64 [60000]
//
//   absl::StatusOr<data::ImageLabelData> d = data::load_mnist(root, /*train=*/false);
//   if (!d.ok()) std::cerr << d.status();      // names the file and the problem
//
// The absl::StatusOr functions are the I/O boundary: a missing, truncated or
// malformed file is an expected outcome there, reported as a Status whose
// message names the file and what is wrong with it. The dataset classes turn
// a bad Status into ember::Error, like every other ember constructor. Images
// stay uint8 in memory (a quarter of float32's bytes); the DataLoader's
// transforms convert them per batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "data/dataset.h"

namespace ember::data {

inline constexpr char kFashionMnistRoot[] = "/usr/share/datasets/fashion-mnist";

// All bytes of `path`, gunzipped if it is gzip data (detected from the
// content, not the name). NotFound if it cannot be opened, DataLoss if the
// gzip stream is corrupt or cut short.
absl::StatusOr<std::vector<uint8_t>> read_file_bytes(const std::string& path);

// An IDX file as a CPU tensor with the file's dims. Element types: 0x08
// (uint8), 0x0C (int32), 0x0D (float32), 0x0E (float64); big-endian on disk.
absl::StatusOr<Tensor> read_idx(const std::string& path);

struct ImageLabelData {
  Tensor images;  // uint8 [N, C, H, W]
  Tensor labels;  // int64 [N]
};

// MNIST and Fashion-MNIST have ten classes, 0..9.
constexpr int64_t kMnistClasses = 10;

// An IDX image file [N,H,W] (N, H, W > 0) and label file [N], checked to
// agree, with every label in 0..num_classes-1 (checked at load; the error
// names the file and the record).
absl::StatusOr<ImageLabelData> read_mnist(const std::string& images_path, const std::string& labels_path,
                                          int64_t num_classes = kMnistClasses);
// {train,t10k}-{images-idx3,labels-idx1}-ubyte under `root`, with or without
// .gz (the .gz file wins when both exist). MNIST and Fashion-MNIST alike.
absl::StatusOr<ImageLabelData> load_mnist(const std::string& root, bool train);

// CIFAR-10 binary batches: records of 1 label byte (0..9) + 3072 pixel bytes
// (R, G, B planes of 32x32), concatenated in the order given.
absl::StatusOr<ImageLabelData> read_cifar10(const std::vector<std::string>& paths);
// data_batch_1..5.bin (train) or test_batch.bin under `root`
// (e.g. the extracted cifar-10-batches-bin directory).
absl::StatusOr<ImageLabelData> load_cifar10(const std::string& root, bool train);

// A TensorDataset over loaded images and labels; throws ember::Error with the
// loader's message when the files are missing or bad.
class ImageDataset : public TensorDataset {
 public:
  explicit ImageDataset(const ImageLabelData& d) : TensorDataset(d.images, d.labels) {}
  const Tensor& images() const { return data(); }
  const Tensor& labels() const { return targets(); }
};

class MNIST : public ImageDataset {
 public:
  MNIST(const std::string& root, bool train = true);
};

class FashionMNIST : public MNIST {
 public:
  explicit FashionMNIST(const std::string& root = kFashionMnistRoot, bool train = true) : MNIST(root, train) {}
};

class CIFAR10 : public ImageDataset {
 public:
  CIFAR10(const std::string& root, bool train = true);
};

}  // namespace ember::data
