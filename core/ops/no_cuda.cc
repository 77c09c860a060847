// The CUDA launchers of the CPU-only configuration (--config=cpu, or no CUDA
// toolkit): compiled instead of the .cu files, so the op layer links
// unchanged. None can be reached through the public API, because no CUDA
// tensor can exist (cuda_device_count() is 0, so allocating one fails first);
// each still raises a clear error rather than leaving a symbol undefined.
#include "core/ops/kernels.h"
#include "core/ops_optim.h"

namespace ember {
namespace {
[[noreturn]] void no_cuda(const char* fn) {
  EMBER_CHECK(false, fn, ": ember was built without CUDA (CPU-only configuration; build without --config=cpu, "
              "with the CUDA toolkit at /usr/local/cuda or $EMBER_CUDA_PATH, to use GPUs)");
  __builtin_unreachable();
}
}  // namespace

#define EMBER_NO_CUDA(name, ...) \
  void name(__VA_ARGS__) { no_cuda(#name); }

EMBER_NO_CUDA(unary_cuda, UnaryOp, const StridedIter&, double, double)
EMBER_NO_CUDA(binary_cuda, BinaryOp, const StridedIter&, double)
EMBER_NO_CUDA(where_cuda, const StridedIter&)
EMBER_NO_CUDA(copy_cuda, const StridedIter&)
EMBER_NO_CUDA(fill_cuda, const StridedIter&, double)
EMBER_NO_CUDA(arange_cuda, Tensor&, double, double)
EMBER_NO_CUDA(reduce_cuda, ReduceOp, const Tensor&, Tensor&, int64_t, int64_t, int64_t)
EMBER_NO_CUDA(softmax_cuda, const Tensor&, Tensor&, int64_t, int64_t, int64_t, bool)
EMBER_NO_CUDA(gemm_cuda, const GemmArgs&, int)
bool gemm_epilogue_cuda(const GemmArgs&, GemmEpilogue, void*, void*, int) { no_cuda("gemm_epilogue_cuda"); }
GemmEpilogueStats gemm_epilogue_stats() { return {0, 0}; }
EMBER_NO_CUDA(grouped_gemm_offsets_cuda, int, const Tensor&, const Tensor&, const Tensor&, Tensor&)
EMBER_NO_CUDA(group_order_cuda, const Tensor&, int64_t, Tensor&, Tensor&, Tensor&)
EMBER_NO_CUDA(attention_forward_cuda, const AttentionArgs&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
              Tensor*)
EMBER_NO_CUDA(attention_backward_cuda, const AttentionArgs&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, Tensor&, Tensor&, Tensor&, const Tensor*)
EMBER_NO_CUDA(set_attention_cuda_scratch, int64_t)
EMBER_NO_CUDA(attention_flash_forward_cuda, const AttentionArgs&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
              Tensor&)
EMBER_NO_CUDA(attention_flash_backward_cuda, const AttentionArgs&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, const Tensor*)
EMBER_NO_CUDA(set_attention_cuda_flash, bool)
EMBER_NO_CUDA(set_attention_cuda_flash_tiles, FlashTiles)
bool attention_flash_cuda_supports(const AttentionArgs&, DType) { return false; }
int64_t attention_cuda_flash_launches() { return 0; }
EMBER_NO_CUDA(foreach_sum_squares_cuda, const ForeachTable&, DType, Tensor&)
EMBER_NO_CUDA(foreach_mul_cuda, const ForeachTable&, DType, double, const double*, int)
EMBER_NO_CUDA(layer_norm_forward_cuda, const Tensor&, const Tensor&, const Tensor&, double, Tensor&, Tensor&, Tensor&)
EMBER_NO_CUDA(layer_norm_backward_cuda, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
              Tensor*, Tensor*, Tensor*)
EMBER_NO_CUDA(rms_norm_forward_cuda, const Tensor&, const Tensor&, double, Tensor&, Tensor&)
EMBER_NO_CUDA(rms_norm_backward_cuda, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*)
EMBER_NO_CUDA(cross_entropy_forward_cuda, const CrossEntropyArgs&, const Tensor&, const Tensor&, Tensor&, Tensor&,
              Tensor*)
EMBER_NO_CUDA(cross_entropy_backward_cuda, const CrossEntropyArgs&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, Tensor&)
EMBER_NO_CUDA(float8_scale_cuda, const Tensor&, DType, Tensor&)
EMBER_NO_CUDA(to_float8_cuda, const Tensor&, const Tensor&, Tensor&)
EMBER_NO_CUDA(scaled_mm_cuda, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, Tensor&)
ScaledMmPlanStats scaled_mm_plan_stats() { return {}; }
EMBER_NO_CUDA(bias_gelu_forward_cuda, const Tensor&, const Tensor&, bool, Tensor&)
EMBER_NO_CUDA(bias_gelu_backward_cuda, const Tensor&, const Tensor&, const Tensor&, bool, Tensor&)
EMBER_NO_CUDA(swiglu_forward_cuda, const Tensor&, const Tensor&, Tensor&)
EMBER_NO_CUDA(swiglu_backward_cuda, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*)
EMBER_NO_CUDA(rope_cuda, const Tensor&, const Tensor&, const Tensor&, bool, const RopeGeom&, Tensor&)
EMBER_NO_CUDA(index_select_cuda, const Tensor&, const Tensor&, Tensor&, int64_t, int64_t, int64_t)
EMBER_NO_CUDA(gather_cuda, const Tensor&, const Tensor&, Tensor&, int64_t)
EMBER_NO_CUDA(check_index_range_cuda, const Tensor&, int64_t, int64_t, const char*)
EMBER_NO_CUDA(index_add_cuda, Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t)
EMBER_NO_CUDA(scatter_add_cuda, Tensor&, const Tensor&, const Tensor&, int64_t)
EMBER_NO_CUDA(random_cuda, RandomKind, Tensor&, double, double, uint64_t, uint64_t, const Tensor&, const uint64_t*)
EMBER_NO_CUDA(write_rng_state_cuda, uint64_t*, uint64_t, uint64_t, int)
EMBER_NO_CUDA(conv2d_forward_cuda, const ConvGeom&, const Tensor&, const Tensor&, const Tensor&, Tensor&)
EMBER_NO_CUDA(conv2d_backward_cuda, const ConvGeom&, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*)
EMBER_NO_CUDA(batch_norm_stats_cuda, const Tensor&, Tensor&, Tensor&, double, Tensor*, Tensor*, double, Tensor*)
EMBER_NO_CUDA(batch_norm_apply_cuda, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
              bool, const Tensor*)
EMBER_NO_CUDA(batch_norm_backward_cuda, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool,
              Tensor*, Tensor*, Tensor*, const Tensor*, Tensor*)
EMBER_NO_CUDA(max_pool2d_cuda, const PoolGeom&, const Tensor&, Tensor&, Tensor&)
EMBER_NO_CUDA(max_pool2d_backward_cuda, const PoolGeom&, const Tensor&, const Tensor&, Tensor&)
EMBER_NO_CUDA(avg_pool2d_cuda, const PoolGeom&, const Tensor&, Tensor&)
EMBER_NO_CUDA(avg_pool2d_backward_cuda, const PoolGeom&, const Tensor&, Tensor&)
EMBER_NO_CUDA(sgd_step_cuda, const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>&,
              const std::vector<bool>&, const SgdOptions&, DeviceHyper, const std::vector<Tensor>&)
EMBER_NO_CUDA(adam_step_cuda, const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>&,
              const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>&, const AdamKernelArgs&,
              const std::vector<Tensor>&)
EMBER_NO_CUDA(amp_unscale_cuda, const std::vector<Tensor>&, const Tensor&, const Tensor&)
EMBER_NO_CUDA(amp_update_scale_cuda, const Tensor&, const Tensor&, const Tensor&, const AmpScaleArgs&)

void* cublas_handle(int) { no_cuda("cublas_handle"); }

}  // namespace ember
