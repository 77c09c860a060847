// Links every system-library wrapper in third_party/BUILD and calls one
// function of each, so a wrong link flag or a missing package fails here
// rather than in whichever later target first needs the library.
#include <absl/strings/str_cat.h>
#include <cblas.h>
#include <dnnl.h>
#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>
#if EMBER_WITH_CUDA
#include <cublas_v2.h>
#include <cudnn.h>
#include <nccl.h>
#endif

TEST(Wrappers, AbseilStrCat) { EXPECT_EQ(absl::StrCat("ember", 1), "ember1"); }

TEST(Wrappers, OpenBlasComputesADot) {
  float x[3] = {1, 2, 3}, y[3] = {4, 5, 6};
  EXPECT_FLOAT_EQ(cblas_sdot(3, x, 1, y, 1), 32.f);
}

TEST(Wrappers, OneDnnVersion) {
  const dnnl_version_t* v = dnnl_version();
  EXPECT_GE(v->major, 2);
}

TEST(Wrappers, GlooHashStore) {
  gloo::rendezvous::HashStore store;
  store.set("k", {1, 2, 3});
  EXPECT_EQ(store.get("k"), (std::vector<char>{1, 2, 3}));
}

#if EMBER_WITH_CUDA  // the CPU-only configuration links no CUDA library
TEST(Wrappers, CudaLibrariesLoadWithoutAGpu) {
  EXPECT_GE(cudnnGetVersion(), 90000u);
  int nccl = 0;
  EXPECT_EQ(ncclGetVersion(&nccl), ncclSuccess);
  EXPECT_GE(nccl, 22800);
  int cublas = 0;
  EXPECT_EQ(cublasGetProperty(MAJOR_VERSION, &cublas), CUBLAS_STATUS_SUCCESS);
  EXPECT_GE(cublas, 13);
}
#endif
