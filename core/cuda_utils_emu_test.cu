// The CUDA primitives of core/ops/cuda_utils.cuh under the emulation, where
// their emulated bodies add what a kernel's test cannot see: a misused
// cuda::cp_async dies naming the kernel's own line (a defaulted call site),
// not the wrapper's in cuda_utils.cuh, and a well-used one lands its bytes
// at the wait.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/ops/cuda_utils.cuh"

namespace ember {
namespace {

__global__ void async_copies(const float* in, float* out, int misaligned) {
  __shared__ float4 stage[2];  // 16-byte aligned
  float* tile = &stage[0].x;
  cuda::cp_async<16>(tile + misaligned, in, true);  // the line a misuse names
  cuda::cp_async<16>(tile + 4, in + 4, true);
  cuda::cp_async_commit();
  cuda::cp_async_wait_all();
  for (int k = 0; k < 8; ++k) out[k] = tile[k];
}
constexpr int kMisuseLine = __LINE__ - 6;

class CudaUtilsEmu : public ::testing::Test {
 protected:
  // The emulator's worker pool makes fork-based death tests unsafe.
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(CudaUtilsEmu, AsyncCopiesLandAtTheWait) {
  float *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, 8 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, 8 * sizeof(float)), cudaSuccess);
  for (int k = 0; k < 8; ++k) in[k] = 1.5f * k;  // device memory is host memory here
  async_copies<<<1, 1>>>(in, out, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int k = 0; k < 8; ++k) EXPECT_EQ(out[k], 1.5f * k) << k;
  cudaFree(in);
  cudaFree(out);
}

TEST_F(CudaUtilsEmu, MisalignedAsyncCopyNamesTheCallersLine) {
  float *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, 8 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, 8 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH(
      {
        async_copies<<<1, 1>>>(in, out, 1);
        cudaDeviceSynchronize();
      },
      "async_copies: cp.async of 16 bytes at .*core/cuda_utils_emu_test.cu:" + std::to_string(kMisuseLine) +
          ": block \\(0,0,0\\) thread \\(0,0,0\\): shared address not aligned to 16 bytes");
  cudaFree(in);
  cudaFree(out);
}

}  // namespace
}  // namespace ember
