// Tensor metadata, views (shared memory, strides), copies, dtype conversion,
// the 16-bit float types, allocator statistics and printing.
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/ops.h"

namespace ember {
namespace {

Tensor iota(const Shape& s, DType t = DType::Float32) { return arange(shape_numel(s), t).view(s); }

TEST(Tensor, EmptyHasContiguousStrides) {
  Tensor t = Tensor::empty({2, 3, 4});
  EXPECT_EQ(t.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.device(), kCPU);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
}

TEST(Tensor, FromVectorAndToVectorRoundTrip) {
  Tensor t = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(Tensor::from_vector({1, 2, 3}, {2, 2}), Error);
}

TEST(Tensor, ViewSharesStorage) {
  Tensor t = iota({2, 3});
  Tensor v = t.view({3, 2});
  EXPECT_TRUE(v.shares_storage(t));
  v.fill_(7);
  EXPECT_EQ(t.to_vector(), std::vector<double>(6, 7.0));
  EXPECT_EQ(t.view({-1}).sizes(), (Shape{6}));
  EXPECT_THROW(t.view({4, -1}), Error);
  EXPECT_THROW(t.view({-1, -1}), Error);
}

TEST(Tensor, TransposeIsAStridedView) {
  Tensor t = iota({2, 3});
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.sizes(), (Shape{3, 2}));
  EXPECT_EQ(tt.strides(), (Shape{1, 3}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // view needs compatible strides; reshape copies.
  EXPECT_THROW(tt.view({6}), Error);
  Tensor r = tt.reshape({6});
  EXPECT_FALSE(r.shares_storage(t));
  EXPECT_EQ(r.to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_TRUE(t.reshape({3, 2}).shares_storage(t));
}

TEST(Tensor, PermuteSliceNarrowSelect) {
  Tensor t = iota({2, 3, 4});
  Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(p.sizes(), (Shape{4, 2, 3}));
  // p[i][j][k] = t[j][k][i] = 12j + 4k + i
  std::vector<double> v = p.to_vector();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 3; ++k) EXPECT_EQ(v[i * 6 + j * 3 + k], 12 * j + 4 * k + i);
  EXPECT_THROW(t.permute({0, 0, 1}), Error);

  Tensor s = t.slice(2, 1, 4, 2);  // columns 1 and 3
  EXPECT_EQ(s.sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(s.select(0, 1).select(0, 2).to_vector(), (std::vector<double>{21, 23}));
  Tensor n = t.narrow(1, 1, 2);
  EXPECT_EQ(n.sizes(), (Shape{2, 2, 4}));
  EXPECT_EQ(n.storage_offset(), 4);
  EXPECT_THROW(t.narrow(1, 2, 2), Error);
  EXPECT_EQ(t.select(-1, -1).to_vector(), (std::vector<double>{3, 7, 11, 15, 19, 23}));
}

TEST(Tensor, ExpandSqueezeUnsqueeze) {
  Tensor t = Tensor::from_vector({1, 2, 3}, {3, 1});
  Tensor e = t.expand({2, 3, 4});
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(sum(e).item(), 2 * 4 * 6);
  EXPECT_THROW(t.expand({2, 2}), Error);
  EXPECT_EQ(t.unsqueeze(0).sizes(), (Shape{1, 3, 1}));
  EXPECT_EQ(t.unsqueeze(-1).sizes(), (Shape{3, 1, 1}));
  EXPECT_EQ(t.squeeze().sizes(), (Shape{3}));
  EXPECT_EQ(t.squeeze(0).sizes(), (Shape{3, 1}));
  EXPECT_EQ(t.squeeze(1).sizes(), (Shape{3}));
  EXPECT_EQ(t.flatten().sizes(), (Shape{3}));
}

TEST(Tensor, ContiguousCloneCopy) {
  Tensor t = iota({3, 4});
  Tensor c = t.t().contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_vector()[1], 4);
  Tensor k = t.clone();
  k.fill_(0);
  EXPECT_EQ(t.to_vector()[5], 5);  // clone does not alias
  // copy_ into a strided view broadcasts and casts.
  Tensor dst = zeros({4, 3});
  dst.t().copy_(Tensor::from_vector({1, 2, 3, 4}, {4}, DType::Int32));
  EXPECT_EQ(dst.to_vector(), (std::vector<double>{1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4}));
}

TEST(Tensor, DtypeConversion) {
  Tensor t = Tensor::from_vector({-1.5, 0.0, 2.7, 300.0}, {4}, DType::Float64);
  EXPECT_EQ(t.to(DType::Int32).to_vector(), (std::vector<double>{-1, 0, 2, 300}));
  EXPECT_EQ(t.to(DType::Bool).to_vector(), (std::vector<double>{1, 0, 1, 1}));
  EXPECT_EQ(t.to(DType::Float16).to_vector(), (std::vector<double>{-1.5, 0.0, 2.69921875, 300.0}));
  EXPECT_EQ(t.to(DType::BFloat16).to_vector(), (std::vector<double>{-1.5, 0.0, 2.703125, 300.0}));
  EXPECT_TRUE(t.to(DType::Float64).is_same(t));  // no copy
}

TEST(Half, RoundTripsAndRoundsToNearestEven) {
  // Every finite half value survives half -> float -> half.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    EXPECT_EQ(Half::from_float(Half::to_float(h)), h) << bits;
  }
  EXPECT_EQ(static_cast<float>(Half(65504.f)), 65504.f);
  EXPECT_TRUE(std::isinf(static_cast<float>(Half(65520.f))));  // halfway to inf rounds up
  EXPECT_EQ(static_cast<float>(Half(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(static_cast<float>(Half(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_EQ(static_cast<float>(Half(5.96046448e-8f)), 5.96046448e-8f);  // smallest subnormal
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(std::nanf("")))));
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 1.0f / 256)), 1.0f);           // tie -> even
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(static_cast<float>(BFloat16(std::numeric_limits<float>::infinity()))));
}

TEST(Tensor, ItemAndErrors) {
  EXPECT_EQ(scalar_tensor(3.5).item(), 3.5);
  EXPECT_EQ(Tensor::from_vector({42}, {1, 1}, DType::Int64).item<int64_t>(), 42);
  try {
    iota({2, 2}).item();
    FAIL() << "item on 4 elements should throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[2,2]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tensor().sizes(), Error);
  EXPECT_THROW(Tensor::empty({-1}), Error);
  EXPECT_THROW(iota({2, 3}).transpose(0, 2), Error);
}

TEST(Tensor, PrintingShowsValuesShapeDtypeDevice) {
  std::string s = Tensor::from_vector({1, 2.5, 3, 4}, {2, 2}).str();
  EXPECT_NE(s.find("[[1.0000, 2.5000],"), std::string::npos) << s;
  EXPECT_NE(s.find("shape=[2,2]"), std::string::npos) << s;
  EXPECT_NE(s.find("dtype=float32"), std::string::npos) << s;
  EXPECT_NE(s.find("device=cpu"), std::string::npos) << s;
  std::string big = zeros({100, 100}, DType::Int64).str();
  EXPECT_NE(big.find("..."), std::string::npos);
  EXPECT_LT(big.size(), 2000u);
}

TEST(Device, ParsesAndReportsCuda) {
  EXPECT_EQ(Device("cpu"), kCPU);
  EXPECT_EQ(Device("cuda:1").index, 1);
  EXPECT_TRUE(Device("cuda").is_cuda());
  EXPECT_THROW(Device("tpu"), Error);
  EXPECT_THROW(Device("cuda:x"), Error);
  if (!cuda_is_available()) {
    EXPECT_FALSE(cuda_unavailable_reason().empty());
    EXPECT_THROW(zeros({2}, cuda_device(0)), Error);
  }
}

TEST(Allocator, CpuStatsTrackLiveBytes) {
  AllocatorStats before = cpu_allocator()->stats();
  {
    Tensor t = Tensor::empty({1000});
    AllocatorStats during = cpu_allocator()->stats();
    EXPECT_GE(during.allocated, before.allocated + 4000);
    EXPECT_GE(during.peak_allocated, during.allocated);
  }
  EXPECT_EQ(cpu_allocator()->stats().allocated, before.allocated);
}

TEST(Allocator, PeakRestartsFromWhatIsAllocatedNow) {
  { Tensor big = Tensor::empty({1 << 20}); }  // 4 MiB, freed: the peak remembers it
  Tensor keep = Tensor::empty({1000});
  const size_t now = cpu_allocator()->stats().allocated;
  EXPECT_GE(cpu_allocator()->stats().peak_allocated, size_t{4} << 20);
  cpu_allocator()->reset_peak_stats();
  EXPECT_EQ(cpu_allocator()->stats().peak_allocated, now);
  { Tensor t = Tensor::empty({1 << 18}); }  // 1 MiB
  EXPECT_EQ(cpu_allocator()->stats().peak_allocated, now + (size_t{1} << 20));
}

TEST(Allocator, CpuCachesLargeBlocks) {
  { Tensor t = Tensor::empty({1 << 22}); }  // 16 MiB, now cached
  AllocatorStats s1 = cpu_allocator()->stats();
  { Tensor t = Tensor::empty({1 << 22}); }
  AllocatorStats s2 = cpu_allocator()->stats();
  EXPECT_EQ(s2.num_device_allocs, s1.num_device_allocs);  // reused, not re-allocated
  EXPECT_EQ(s2.num_allocs, s1.num_allocs + 1);
  cpu_allocator()->empty_cache();
  EXPECT_LT(cpu_allocator()->stats().reserved, s2.reserved);
}

}  // namespace
}  // namespace ember
