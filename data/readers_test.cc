// Readers on the real Fashion-MNIST files (skipped when absent) and on small
// fixtures this test writes, plain and gzip, intact and damaged; plus the
// in-memory and synthetic datasets.
#include "data/readers.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "absl/status/status.h"

namespace ember::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

fs::path temp_dir() {
  static const fs::path dir = [] {
    fs::path d = fs::path(testing::TempDir()) / "ember_readers_test";
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

std::string write_plain(const std::string& name, const Bytes& b) {
  std::string path = (temp_dir() / name).string();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
  return path;
}

std::string write_gz(const std::string& name, const Bytes& b) {
  std::string path = (temp_dir() / name).string();
  gzFile f = gzopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  EXPECT_EQ(gzwrite(f, b.data(), static_cast<unsigned>(b.size())), static_cast<int>(b.size()));
  gzclose(f);
  return path;
}

void put_be32(Bytes& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
}

Bytes idx_bytes(uint8_t type, const std::vector<uint32_t>& dims, const Bytes& payload) {
  Bytes b{0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) put_be32(b, d);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

// n images of h x w with pixel (i, y, x) = i*16 + y*w + x, labels (i*7) % 10.
Bytes image_payload(int n, int h, int w) {
  Bytes p;
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < h * w; ++k) p.push_back(static_cast<uint8_t>(i * 16 + k));
  return p;
}
Bytes label_payload(int n) {
  Bytes p;
  for (int i = 0; i < n; ++i) p.push_back(static_cast<uint8_t>((i * 7) % 10));
  return p;
}

void expect_error(const absl::Status& s, const std::string& path, const std::string& problem) {
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(problem), std::string::npos) << s.message();
}

TEST(FashionMnist, RealFiles) {
  if (!fs::is_directory(kFashionMnistRoot)) GTEST_SKIP() << kFashionMnistRoot << " is absent (dataset-fashion-mnist)";
  FashionMNIST train;
  ASSERT_EQ(train.images().sizes(), (Shape{60000, 1, 28, 28}));
  EXPECT_EQ(train.images().dtype(), DType::UInt8);
  ASSERT_EQ(train.labels().sizes(), (Shape{60000}));
  EXPECT_EQ(train.labels().dtype(), DType::Int64);
  EXPECT_EQ(train.size(), 60000);
  // Values read with Python's gzip module.
  const int64_t* lab = train.labels().data<int64_t>();
  std::vector<int64_t> first(lab, lab + 12);
  EXPECT_EQ(first, (std::vector<int64_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9}));
  std::vector<int> per_class(10, 0);
  for (int64_t i = 0; i < 60000; ++i) {
    ASSERT_GE(lab[i], 0);
    ASSERT_LE(lab[i], 9);
    per_class[lab[i]]++;
  }
  EXPECT_EQ(per_class, std::vector<int>(10, 6000));
  const uint8_t* img = train.images().data<uint8_t>();
  EXPECT_EQ(img[100], 73);   // image 0, row 3, col 16
  EXPECT_EQ(img[127], 136);  // image 0, row 4, col 15
  int64_t sum0 = 0, total = 0;
  for (int k = 0; k < 784; ++k) sum0 += img[k];
  for (int64_t k = 0; k < 60000 * 784; ++k) total += img[k];
  EXPECT_EQ(sum0, 76247);
  EXPECT_EQ(total, 3431114169);  // mean 0.2860 of 255: the usual normalisation constant
  Example e = train.get(0);
  EXPECT_EQ(e.data.sizes(), (Shape{1, 28, 28}));
  EXPECT_EQ(e.label, 9);

  FashionMNIST test(kFashionMnistRoot, /*train=*/false);
  ASSERT_EQ(test.images().sizes(), (Shape{10000, 1, 28, 28}));
  ASSERT_EQ(test.labels().sizes(), (Shape{10000}));
  const int64_t* tl = test.labels().data<int64_t>();
  EXPECT_EQ(std::vector<int64_t>(tl, tl + 12), (std::vector<int64_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5}));
  const uint8_t* ti = test.images().data<uint8_t>();
  int64_t tsum0 = 0;
  for (int k = 0; k < 784; ++k) tsum0 += ti[k];
  EXPECT_EQ(tsum0, 33456);
  EXPECT_EQ(ti[14 * 28 + 14], 110);
}

TEST(ReadIdx, PlainAndGzipFixturesAgree) {
  Bytes images = idx_bytes(0x08, {5, 4, 3}, image_payload(5, 4, 3));
  for (bool gz : {false, true}) {
    std::string path = gz ? write_gz("img.idx.gz", images) : write_plain("img.idx", images);
    absl::StatusOr<Tensor> t = read_idx(path);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->sizes(), (Shape{5, 4, 3}));
    ASSERT_EQ(t->dtype(), DType::UInt8);
    const uint8_t* p = t->data<uint8_t>();
    for (int i = 0; i < 5; ++i)
      for (int k = 0; k < 12; ++k) ASSERT_EQ(p[i * 12 + k], i * 16 + k);
  }
}

TEST(ReadIdx, MultiByteTypesAreBigEndian) {
  Bytes ints;
  for (uint32_t v : {1u, 0xFFFFFFFEu, 70000u}) put_be32(ints, v);
  absl::StatusOr<Tensor> t = read_idx(write_plain("ints.idx", idx_bytes(0x0C, {3}, ints)));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::Int32);
  EXPECT_EQ(t->to_vector(), (std::vector<double>{1, -2, 70000}));
  Bytes floats;
  float f = 1.5f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  put_be32(floats, u);
  t = read_idx(write_gz("float.idx.gz", idx_bytes(0x0D, {1, 1}, floats)));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->to_vector(), (std::vector<double>{1.5}));
}

TEST(ReadIdx, BadFilesNameTheFileAndTheProblem) {
  const Bytes good = idx_bytes(0x08, {5, 4, 3}, image_payload(5, 4, 3));
  // Missing.
  std::string missing = (temp_dir() / "no-such-file.gz").string();
  absl::StatusOr<Tensor> t = read_idx(missing);
  expect_error(t.status(), missing, "cannot open");
  EXPECT_TRUE(absl::IsNotFound(t.status()));
  // A directory.
  expect_error(read_idx(temp_dir().string()).status(), temp_dir().string(), "is a directory");
  // Bad magic: a text file.
  std::string text = write_plain("notes.txt", Bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  expect_error(read_idx(text).status(), text, "bad magic number 0x68656c6c");
  // Unsupported element type 0x0B.
  std::string shorts = write_plain("shorts.idx", idx_bytes(0x0B, {2}, Bytes{0, 1, 0, 2}));
  expect_error(read_idx(shorts).status(), shorts, "bad magic number 0x00000b01");
  // Too short for even the magic number; header cut short.
  std::string tiny = write_plain("tiny.idx", Bytes{0, 0});
  expect_error(read_idx(tiny).status(), tiny, "shorter than the 4-byte IDX magic number");
  std::string header = write_gz("header.idx.gz", Bytes(good.begin(), good.begin() + 10));
  expect_error(read_idx(header).status(), header, "truncated header");
  // Data cut short, plain and gzip.
  Bytes cut(good.begin(), good.end() - 7);
  for (const std::string& p : {write_plain("cut.idx", cut), write_gz("cut.idx.gz", cut)})
    expect_error(read_idx(p).status(), p, "truncated: header dims [5,4,3] need 60 bytes of data but only 53");
  // Counts that disagree with the size: trailing bytes.
  Bytes longer = good;
  longer.insert(longer.end(), {1, 2, 3});
  std::string trailing = write_plain("long.idx", longer);
  expect_error(read_idx(trailing).status(), trailing, "3 unexpected trailing bytes");
  // A gzip stream cut in the middle.
  std::string gz = write_gz("full.idx.gz", idx_bytes(0x08, {200, 28, 28}, image_payload(200, 28, 28)));
  std::ifstream in(gz, std::ios::binary);
  Bytes compressed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  compressed.resize(compressed.size() / 2);
  std::string broken = write_plain("broken.idx.gz", compressed);
  expect_error(read_idx(broken).status(), broken, "corrupt or truncated gzip data");
  // Absurd dims must fail on the size check, not by allocating.
  std::string huge = write_plain("huge.idx", idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu}, Bytes{1, 2}));
  expect_error(read_idx(huge).status(), huge, "implausibly large");
}

TEST(ReadMnist, FixtureRootAndMismatches) {
  fs::path root = temp_dir() / "mnist";
  fs::create_directories(root);
  auto at = [&](const char* name) { return (root / name).string(); };
  // Train as .gz, test as plain files: load_mnist finds either.
  write_gz("mnist/train-images-idx3-ubyte.gz", idx_bytes(0x08, {5, 4, 3}, image_payload(5, 4, 3)));
  write_gz("mnist/train-labels-idx1-ubyte.gz", idx_bytes(0x08, {5}, label_payload(5)));
  write_plain("mnist/t10k-images-idx3-ubyte", idx_bytes(0x08, {2, 4, 3}, image_payload(2, 4, 3)));
  write_plain("mnist/t10k-labels-idx1-ubyte", idx_bytes(0x08, {3}, label_payload(3)));
  MNIST train(root.string());
  EXPECT_EQ(train.images().sizes(), (Shape{5, 1, 4, 3}));
  EXPECT_EQ(train.labels().to_vector(), (std::vector<double>{0, 7, 4, 1, 8}));
  EXPECT_EQ(train.get(2).data.to_vector()[5], 32 + 5);
  // Images and labels of different lengths.
  absl::StatusOr<ImageLabelData> test = load_mnist(root.string(), false);
  expect_error(test.status(), at("t10k-images-idx3-ubyte"), "different lengths");
  EXPECT_NE(test.status().message().find("has 2 images but"), std::string::npos);
  EXPECT_NE(test.status().message().find(at("t10k-labels-idx1-ubyte") + " has 3 labels"), std::string::npos);
  // Files swapped: the labels file is not an image file.
  expect_error(read_mnist(at("train-labels-idx1-ubyte.gz"), at("train-images-idx3-ubyte.gz")).status(),
               at("train-labels-idx1-ubyte.gz"), "expected uint8 images [N,H,W], got uint8 [5]");
  // Regressions: zero images, zero-sized images and out-of-range labels are
  // named at load (before: a self-contradicting "expected [N,H,W], got
  // [5,0,3]", or an error only when the label's batch reached the loss).
  write_plain("mnist/empty-images", idx_bytes(0x08, {0, 4, 3}, {}));
  write_plain("mnist/zero-h-images", idx_bytes(0x08, {5, 0, 3}, {}));
  write_plain("mnist/bad-labels", idx_bytes(0x08, {5}, {0, 9, 10, 3, 255}));
  expect_error(read_mnist(at("empty-images"), at("train-labels-idx1-ubyte.gz")).status(), at("empty-images"),
               "holds no images (header dims [0,4,3])");
  expect_error(read_mnist(at("zero-h-images"), at("train-labels-idx1-ubyte.gz")).status(), at("zero-h-images"),
               "declare 0x3 images; an image needs at least one pixel");
  expect_error(read_mnist(at("train-images-idx3-ubyte.gz"), at("bad-labels")).status(), at("bad-labels"),
               "label 2 is 10, outside 0..9 (10 classes)");
  EXPECT_TRUE(read_mnist(at("train-images-idx3-ubyte.gz"), at("bad-labels"), 256).ok());  // 256 classes: all fit
  // The throwing wrapper keeps the message.
  try {
    FashionMNIST missing((temp_dir() / "nowhere").string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nowhere/train-images-idx3-ubyte.gz: cannot open"), std::string::npos)
        << e.what();
  }
}

Bytes cifar_records(int n, int label_offset) {
  Bytes b;
  for (int i = 0; i < n; ++i) {
    b.push_back(static_cast<uint8_t>((i + label_offset) % 10));
    for (int k = 0; k < 3072; ++k) b.push_back(static_cast<uint8_t>(i + k / 1024));  // channel plane in pixel value
  }
  return b;
}

TEST(Cifar10, FixtureAndBadFiles) {
  fs::path root = temp_dir() / "cifar";
  fs::create_directories(root);
  for (int i = 1; i <= 5; ++i) write_plain("cifar/data_batch_" + std::to_string(i) + ".bin", cifar_records(2, i));
  write_plain("cifar/test_batch.bin", cifar_records(3, 0));
  CIFAR10 train(root.string());
  ASSERT_EQ(train.images().sizes(), (Shape{10, 3, 32, 32}));
  EXPECT_EQ(train.labels().to_vector(), (std::vector<double>{1, 2, 2, 3, 3, 4, 4, 5, 5, 6}));
  // Record 1 of batch 1: pixel value 1 + channel.
  const uint8_t* img = train.images().data<uint8_t>() + 3072;
  EXPECT_EQ(img[0], 1);
  EXPECT_EQ(img[1024], 2);
  EXPECT_EQ(img[2047], 2);
  EXPECT_EQ(img[3071], 3);
  CIFAR10 test(root.string(), false);
  EXPECT_EQ(test.size(), 3);

  Bytes cut = cifar_records(2, 0);
  cut.pop_back();
  std::string bad_size = write_plain("cifar/cut.bin", cut);
  expect_error(read_cifar10({bad_size}).status(), bad_size, "not a positive multiple of the 3073-byte");
  Bytes bad = cifar_records(3, 0);
  bad[2 * 3073] = 200;
  std::string bad_label = write_plain("cifar/label.bin", bad);
  expect_error(read_cifar10({bad_label}).status(), bad_label, "record 2 has label 200");
  fs::remove(root / "data_batch_3.bin");
  expect_error(load_cifar10(root.string(), true).status(), (root / "data_batch_3.bin").string(), "cannot open");
}

TEST(TensorDataset, ViewsLabelsAndTensorTargets) {
  Tensor x = Tensor::from_vector({0, 1, 2, 3, 4, 5}, {3, 2});
  TensorDataset ds(x, Tensor::from_vector({7, 8, 9}, {3}, DType::Int64));
  EXPECT_EQ(ds.size(), 3);
  Example e = ds.get(1);
  EXPECT_EQ(e.data.to_vector(), (std::vector<double>{2, 3}));
  EXPECT_TRUE(e.data.shares_storage(ds.data()));  // a view, not a copy
  EXPECT_EQ(e.label, 8);
  EXPECT_FALSE(e.target.defined());
  TensorDataset reg(x, Tensor::from_vector({0.5, 1.5, 2.5}, {3, 1}));
  EXPECT_EQ(reg.get(2).target.to_vector(), (std::vector<double>{2.5}));
  EXPECT_THROW(ds.get(3), Error);
  EXPECT_THROW(TensorDataset(x, Tensor::from_vector({1, 2}, {2}, DType::Int64)), Error);
}

TEST(SyntheticImages, DeterministicLearnableAndInRange) {
  SyntheticImages a(1000, {3, 8, 8}, 10, /*seed=*/1), b(1000, {3, 8, 8}, 10, 1), c(1000, {3, 8, 8}, 10, 2);
  std::set<int64_t> labels;
  int differ = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    Example x = a.get(i), y = b.get(i);
    ASSERT_EQ(x.data.sizes(), (Shape{3, 8, 8}));
    ASSERT_EQ(x.data.dtype(), DType::UInt8);
    ASSERT_EQ(x.label, y.label);
    ASSERT_EQ(x.data.to_vector(), y.data.to_vector());
    labels.insert(x.label);
    differ += c.label(i) != x.label;
  }
  EXPECT_EQ(labels.size(), 10u);
  EXPECT_GT(differ, 500);  // another seed, other labels
  // Learnable: the nearest class template (mean image) classifies well.
  std::vector<std::vector<double>> mean(10, std::vector<double>(192, 0.0));
  std::vector<int> count(10, 0);
  for (int64_t i = 0; i < 500; ++i) {
    Example x = a.get(i);
    std::vector<double> v = x.data.to_vector();
    for (int k = 0; k < 192; ++k) mean[x.label][k] += v[k];
    count[x.label]++;
  }
  int correct = 0;
  for (int64_t i = 500; i < 1000; ++i) {
    Example x = a.get(i);
    std::vector<double> v = x.data.to_vector();
    int best = 0;
    double best_d = 1e300;
    for (int k = 0; k < 10; ++k) {
      double d = 0;
      for (int p = 0; p < 192; ++p) d += std::pow(v[p] - mean[k][p] / std::max(count[k], 1), 2);
      if (d < best_d) best_d = d, best = k;
    }
    correct += best == x.label;
  }
  EXPECT_GT(correct, 450);
  EXPECT_THROW(SyntheticImages(10, {8, 8}, 10), Error);
}

}  // namespace
}  // namespace ember::data
