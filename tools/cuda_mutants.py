#!/usr/bin/env python3
"""Mutation check of the emulated CUDA tests: applies small deliberate bugs to
the CUDA kernels and their host code one at a time (a dropped barrier, an
off-by-one bound, a wrong stride, a wrong cuBLAS/cuDNN argument, a missing
stream wait or event, a bad launch configuration), runs the emulated cross-backend tests, and
reports which mutants they catch. A mutant is caught when a test fails
(wrong values, or the emulator reporting misuse).

Run from the repository root (a few minutes; each mutant rebuilds one object):
    python3 tools/cuda_mutants.py [--only NAME[,NAME...]] [--tests TARGET[,TARGET...]] [--asan]
--tests runs only those targets (e.g. the drawn-case tests alone,
//core:kernels_drawn_nn_emu_test, to show that they catch a mutant without
the hand-written cases).
--asan runs the tests under AddressSanitizer without the caching allocator
(as CI's third step does); mutants marked ASAN (an out-of-bounds access that
leaves the values right) are only run then.
The file under test is restored after every mutant, also on Ctrl-C.
--check builds nothing: it checks that every mutant's original text occurs
once in its file (tools/lint.sh runs it, so a mutant whose code changed is
named when it changes, not when someone next runs the mutants).
"""
import argparse
import subprocess
import sys
import time

TESTS = [
    "//core:kernels_drawn_emu_test",
    "//core:kernels_drawn_nn_emu_test",
    "//core:ops_cuda_emu_test",
    "//core:ops_nn_cuda_emu_test",
    "//core:attention_cuda_emu_test",
    "//optim:optim_cuda_emu_test",
    "//optim:grad_scaler_emu_test",
    "//data:loader_emu_test",
    "//core:float8_emu_test",
    "//core:bias_gelu_emu_test",
]

# (name, kind, file, exact original text, replacement). Not here: dropping
# the stream synchronisations after a device-to-host cudaMemcpyAsync into
# pageable memory (tensor.cc, index.cu): CUDA documents that such a copy
# returns only once complete, so those are not bugs on a GPU either. Nor
# gemm_cuda's k == 0 branch: the op layer answers an empty inner dimension
# with zero_() before reaching it, so no test can see it.
MUTANTS = [
    ("grouped_input_b_orientation", "wrong stride", "core/ops/grouped_matmul.cu",
     "        cuda::warp_mma<T, BK / 16, true>(acc, a_frag, bs(buf) + wn, BN + 8, lane);",
     "        cuda::warp_mma<T, BK / 16, false>(acc, a_frag, bs(buf) + wn * (BK + 8), BK + 8, lane);"),
    ("grouped_row_tile_base", "wrong stride", "core/ops/grouped_matmul.cu",
     "    row0 = start + t * BM;", "    row0 = t * BM;"),
    ("grouped_weight_rows_end", "off-by-one bound", "core/ops/grouped_matmul.cu",
     "      load_tile<BK, BN>(bs(buf), p.b, p.K, start + k0, end, n0, p.K);",
     "      load_tile<BK, BN>(bs(buf), p.b, p.K, start + k0, end + 1, n0, p.K);"),
    ("grouped_stage_barrier", "dropped barrier", "core/ops/grouped_matmul.cu",
     "    cuda::cp_async_wait_all();\n    __syncthreads();  // step s is in",
     "    cuda::cp_async_wait_all();\n    // step s is in"),
    ("group_order_scan_barrier", "dropped barrier", "core/ops/grouped_matmul.cu",
     "      __syncthreads();\n      scan[tid] += add;", "      scan[tid] += add;"),
    ("bn_block_sum_barrier", "dropped barrier", "core/ops/batch_norm.cu",
     "  if (lane == 0) warp_states[warp] = merged;\n  __syncthreads();\n",
     "  if (lane == 0) warp_states[warp] = merged;\n"),
    ("bn_rows_tile_barrier", "dropped barrier", "core/ops/batch_norm.cu",
     "  for (int j = 0; j < VEC; ++j) rows[ty * tile + tx * VEC + j] = Op::finish(st[j]);\n  __syncthreads();\n",
     "  for (int j = 0; j < VEC; ++j) rows[ty * tile + tx * VEC + j] = Op::finish(st[j]);\n"),
    ("softmax_rows_barrier", "dropped barrier", "core/ops/softmax.cu",
     "    if (lane == 0) row_smem[warp] = st;\n    __syncthreads();\n",
     "    if (lane == 0) row_smem[warp] = st;\n"),
    ("reduce_rows_barrier", "dropped barrier", "core/ops/reduce.cu",
     "    if (lane == 0) row_smem[warp] = acc;\n    __syncthreads();\n",
     "    if (lane == 0) row_smem[warp] = acc;\n"),
    ("unary_tail_bound", "off-by-one bound", "core/ops/unary.cu",
     "  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride())",
     "  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n - 1; i += cuda::grid_stride())"),
    ("optimizer_tail_bound", "off-by-one bound", "core/ops/optimizer.cu",
     "    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {",
     "    for (int64_t i = done + threadIdx.x; i < n - 1; i += blockDim.x) {"),
    ("optimizer_master_reseed_dropped", "lost update", "core/ops/optimizer.cu",
     "          if constexpr (LOW) x[0] = optim_fns::master_value(x[0], rl.v[j]);\n",
     "\n"),
    ("optimizer_master_tail_writeback", "lost update", "core/ops/optimizer.cu",
     "      if constexpr (LOW) low[i] = static_cast<G>(x[0]);\n",
     "\n"),
    ("amp_found_inf_dropped", "lost flag", "core/ops/optimizer.cu",
     "    if (found) *found_inf = 1.f;\n",
     "    (void)found;\n"),
    ("amp_unscale_inv_scale", "wrong operand", "core/ops/optimizer.cu",
     "return {found_inf, static_cast<C>(*inv_scale)}; }",
     "return {found_inf, static_cast<C>(*found_inf)}; }"),
    ("add_bias_channel", "wrong index", "core/ops/conv.cu",
     "    const int64_t ch = (i / inner) % c;\n    y[i] = cuda::cast_value<T, A>(static_cast<A>(y[i]) + static_cast<A>(b[ch]));",
     "    const int64_t ch = (i / inner) % c;\n    y[i] = cuda::cast_value<T, A>(static_cast<A>(y[i]) + static_cast<A>(b[ch > 0 ? ch - 1 : 0]));"),
    ("strided_offsets_stride", "wrong stride", "core/ops/cuda_utils.cuh",
     "        off[o] = static_cast<int64_t>(static_cast<uint64_t>(off[o]) + cu * static_cast<uint64_t>(it.strides[o][d]));",
     "        off[o] = static_cast<int64_t>(static_cast<uint64_t>(off[o]) + cu * static_cast<uint64_t>(it.strides[o][d > 0 ? d - 1 : d]));"),
    ("cudnn_tensor_strides", "wrong stride", "core/ops/conv.cu",
     "to_int(st[0]), to_int(st[1]), to_int(st[2]), to_int(st[3])",
     "to_int(st[0]), to_int(st[1]), to_int(st[3]), to_int(st[2])"),
    ("cublas_transpose_a", "wrong cuBLAS transpose flag", "core/ops/matmul.cu",
     "const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;",
     "const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_N : CUBLAS_OP_T;"),
    ("cudnn_padding_swapped", "wrong cuDNN argument", "core/ops/conv.cu",
     "cudnnSetConvolution2dDescriptor(d_, to_int(g.ph), to_int(g.pw),",
     "cudnnSetConvolution2dDescriptor(d_, to_int(g.pw), to_int(g.ph),"),
    ("loader_consumer_wait", "missing stream wait", "data/batch_memory.cc",
     "  copy.done->block(Stream::current(device_.index));\n",
     ""),
    ("loader_copy_done_record", "missing event record", "data/batch_memory.cc",
     "  c.done->record(side);\n",
     ""),
    ("unary_tail_write_past_end", "out-of-bounds access (ASAN)", "core/ops/unary.cu",
     "  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride())",
     "  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i <= n; i += cuda::grid_stride())"),
    # x's pointer left out of the vector path's alignment test: a slice at an
    # odd offset loads 16 bytes from an address a GPU faults on, which the
    # host reads anyway; only UBSan's alignment check (--config=asan) sees it.
    ("rope_vec_unaligned_x", "misaligned vector access (ASAN)", "core/ops/rope.cu",
     "      pairs, {xp, y.data<T>()},", "      pairs, {y.data<T>()},"),
    # Found by a new user's mutation round (the round that asked for
    # drawn kernel cases): no listed case pooled with a window wider than tall,
    # and no CUDA case fed a NaN; the drawn pooling cases catch both. The
    # pooling bodies have since moved to pool.h, shared by the CPU and
    # CUDA kernels, so these change the reference too: what catches them is
    # the CPU's own tests (//core:ops_nn_test: NaN propagation, gradcheck).
    ("max_pool_bwd_width_window", "wrong operand", "core/ops/pool.h",
     "  pool_covering(iw, g.ow, g.kw, g.by_sw, g.pw, &ow0, &ow1);\n  A acc = 0;\n  for (I oh = oh0; oh < oh1; ++oh) {",
     "  pool_covering(iw, g.ow, g.kh, g.by_sw, g.pw, &ow0, &ow1);\n  A acc = 0;\n  for (I oh = oh0; oh < oh1; ++oh) {"),
    ("max_pool_nan_rule", "special value dropped", "core/ops/pool.h",
     "      if (v > best || v != v) {\n        best = v;",
     "      if (v > best) {\n        best = v;"),
    # The 32-bit index path's divisions (int_div.h), which only the CUDA
    # kernels take: the 33rd bit of the multiplier dropped, and the window
    # place's column taken with the row's stride (the shared body: the CPU's
    # own tests catch it, strides (2, 1) in the pooling cases).
    ("int_div32_multiplier_high_bit", "wrong value (a quotient without the multiplier's 33rd bit)",
     "core/ops/int_div.h",
     "    return static_cast<int32_t>((hi + u) >> s);", "    return static_cast<int32_t>(hi >> s);"),
    ("max_pool_bwd_place_stride", "wrong operand (the window place's column by the row stride)", "core/ops/pool.h",
     "      if (static_cast<I>(indices[o]) == row - ow * g.sw)", "      if (static_cast<I>(indices[o]) == row - ow * g.sh)"),
    ("rope_vec_table_offset", "wrong index (a vector's tables read at its pair's chunk, not its pair)",
     "core/ops/rope.cu", "to = t * g.half + i;", "to = t * g.half + i / V;"),
    ("rope_position_of_row", "wrong index (the position taken as the row's batch index)", "core/ops/rope.cu",
     "const I t = r - g.by_seq.div(r) * g.by_seq.d;", "const I t = g.by_seq.div(r);"),
    ("copy_vec_outer_strides", "wrong stride (a vector copy's outer strides left in elements)", "core/ops/copy.cu",
     "      for (int d = 0; d < in; ++d) v.strides[o][d] /= VEC;", "      for (int d = 0; d < in; ++d) (void)v;"),
    ("copy_vec_stride_check", "missing check (an outer stride VEC does not divide)", "core/ops/copy.cu",
     "        if (it.strides[o][d] % VEC != 0) return std::nullopt;", "        (void)d;"),
    ("size_divs_dim", "wrong index (each dim divided by its outer neighbour's size)", "core/ops/cuda_utils.cuh",
     "s.size[d] = IntDiv<int32_t>(it.sizes[d]);", "s.size[d] = IntDiv<int32_t>(it.sizes[d - 1]);"),
    # The round's other six, which hand-written cases caught too; the drawn
    # cases must catch them alone (--tests with the kernels_drawn targets).
    ("attention_ds_no_delta", "dropped term", "core/ops/attention.cu",
     "    dp[w * kmax + j] = j < lim ? p[w * kmax + j] * (g - di) * scale : T(0);",
     "    dp[w * kmax + j] = j < lim ? p[w * kmax + j] * g * scale : T(0);"),
    ("attention_softmax_masked_keys", "mask ignored", "core/ops/attention.cu",
     "  for (int64_t j = lane; j < lim; j += kWarp) sum += exp(row[j] - m);",
     "  for (int64_t j = lane; j < kmax; j += kWarp) sum += exp(row[j] - m);"),
    ("attention_dropout_bwd", "mask ignored", "core/ops/attention.cu",
     "    if (a.dropout_p > 0 && j < lim) g = drop(a, b, i, j, g);",
     "    (void)lim;"),
    ("layer_norm_last_tile", "off-by-one bound", "core/ops/layer_norm.cu",
     "  for (int64_t t = 0; t < tiles; ++t) {",
     "  for (int64_t t = 0; t < tiles - 1; ++t) {"),
    ("bn_unbiased_variance", "wrong formula", "core/ops/batch_norm.cu",
     "  const A var = w.m2 / w.n;",
     "  const A var = w.m2 / (w.n - 1);"),
    ("foreach_sum_squares_skip", "off-by-one bound", "core/ops/foreach.cu",
     "    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) acc += static_cast<double>(p[i]) * static_cast<double>(p[i]);",
     "    for (int64_t i = threadIdx.x; i < m - 1; i += blockDim.x) acc += static_cast<double>(p[i]) * static_cast<double>(p[i]);"),
    ("foreach_slice_base", "wrong offset", "core/ops/foreach.cu",
     "tab.first_chunk[t0 + i] - base};",
     "tab.first_chunk[t0 + i]};"),
    ("foreach_mul_tail", "off-by-one bound", "core/ops/foreach.cu",
     "    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) p[i] *= k;",
     "    for (int64_t i = threadIdx.x; i < m - 1; i += blockDim.x) p[i] *= k;"),
    ("float8_amax_tail", "off-by-one bound", "core/ops/float8.cu",
     "  for (int64_t i = nv * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride()) m = umax(m, abs_bits(x[i]));",
     "  for (int64_t i = nv * VEC + cuda::global_thread_id(); i < n - 1; i += cuda::grid_stride()) m = umax(m, abs_bits(x[i]));"),
    ("float8_amax_block", "a block's other warps dropped", "core/ops/float8.cu",
     "    for (int w = 1; w < static_cast<int>(blockDim.x) / cuda::kWarpSize; ++w) m = umax(m, partial[w]);",
     "    for (int w = 1; w < 1; ++w) m = umax(m, partial[w]);"),
    ("float8_cast_unsaturated", "saturation dropped", "core/ops/float8.cu",
     "      o.v[j].x = F8::format::from_float(y, true);",
     "      o.v[j].x = F8::format::from_float(y, false);"),
    ("float8_inverse_scale", "wrong scale", "core/ops/float8.cu",
     "  out[1] = 1.0f / s;",
     "  out[1] = s;"),
    ("float8_lt_layout", "wrong cuBLASLt argument", "core/ops/float8.cu",
     "set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);",
     "set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N);"),
    ("float8_plan_stale_scales", "a cached cuBLASLt plan keeps its first call's scale pointers",
     "core/ops/float8.cu",
     "  cuda::set_attr(plan.call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b.raw_data());\n",
     ""),
    ("bias_gelu_bias_column", "wrong index", "core/ops/bias_gelu.cu",
     "    const int64_t c0 = (v * VEC) % cols;\n    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];\n    const VecN<T, VEC> bv",
     "    const int64_t c0 = v % cols;\n    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];\n    const VecN<T, VEC> bv"),
    ("bias_gelu_backward_unbiased", "dropped operand", "core/ops/bias_gelu.cu",
     "      out.v[j] = static_cast<T>(binary_fn<OP, C>(static_cast<C>(gv.v[j]), biased<T, C>(xv.v[j], bv.v[j]), C(1)));",
     "      out.v[j] = static_cast<T>(binary_fn<OP, C>(static_cast<C>(gv.v[j]), static_cast<C>(xv.v[j]), C(1)));"),
    ("bn_relu_mask_sums", "mask off by the boundary", "core/ops/batch_norm.cu",
     "    if constexpr (MASK) g = cast_value<A>(y[i]) > A(0) ? g : A(0);",
     "    if constexpr (MASK) g = cast_value<A>(y[i]) >= A(0) ? g : A(0);"),
    ("bn_relu_rows_epilogue", "dropped epilogue", "core/ops/batch_norm.cu",
     "      if constexpr (EPI == kRelu) val = relu_of(val);",
     "      (void)val;"),
    ("bn_add_relu_unrounded", "dropped rounding", "core/ops/batch_norm.cu",
     "      if constexpr (EPI == kAddRelu) o = relu_of(cast_value<A>(cast_value<T>(o)) + cast_value<A>(mv.v[j]));",
     "      if constexpr (EPI == kAddRelu) o = relu_of(o + cast_value<A>(mv.v[j]));"),
    ("bn_add_relu_rows_residual", "dropped operand", "core/ops/batch_norm.cu",
     "      if constexpr (EPI == kAddRelu) val = relu_of(cast_value<A>(cast_value<T>(val)) + cast_value<A>(mv.v[j]));",
     "      if constexpr (EPI == kAddRelu) val = relu_of(val);"),
    ("bn_residual_grad_unmasked", "dropped mask", "core/ops/batch_norm.cu",
     "      if constexpr (STORE) vz.v[j] = cast_value<T>(g);",
     "      if constexpr (STORE) vz.v[j] = vg.v[j];"),
    ("bn_dx_unmasked_dy", "wrong operand", "core/ops/batch_norm.cu",
     "      launch_affine<T, A, kPlain>(d, zp, train ? xp : nullptr, nullptr, coef, dxp, dev, stream);",
     "      launch_affine<T, A, kPlain>(d, gp, train ? xp : nullptr, nullptr, coef, dxp, dev, stream);"),
    ("index_sort_unstable", "unstable sort (ties out of item order)", "core/ops/index.cu",
     "      for (int j = 0; j < kSortItems; ++j) {\n        if (first + j >= n) break;\n",
     "      for (int jj = 0; jj < kSortItems; ++jj) {\n        const int j = kSortItems - 1 - jj;\n"
     "        if (first + j >= n) continue;\n"),
    ("index_sort_scan_barrier", "dropped barrier", "core/ops/index.cu",
     "        partial[t] += v;\n        __syncthreads();\n",
     "        partial[t] += v;\n"),
    ("index_sort_thread_rank", "wrong rank (a neighbour's)", "core/ops/index.cu",
     "for (int d = 0; d < kDigits; ++d) rank[d] = counts[d * kSortThreads + t] - counts[d * kSortThreads];",
     "for (int d = 0; d < kDigits; ++d) rank[d] = counts[d * kSortThreads + (t ^ 1)] - counts[d * kSortThreads];"),
    ("flash_dq_row_lse", "wrong row's statistics", "core/ops/attention_flash.cu",
     "        const float p = ok ? cuda::exp2_ftz(fmaf(s[nt][e], sl, -ls[e / 2])) : 0.f;",
     "        const float p = ok ? cuda::exp2_ftz(fmaf(s[nt][e], sl, -ls[0])) : 0.f;"),
    ("flash_dq_tile_barrier", "dropped barrier (one stage)", "core/ops/attention_flash.cu",
     "      __syncthreads();  // every warp is done with the last tile's k and v\n",
     ""),
    ("flash_smem_opt_in_once", "stale cache (a kernel's shared-memory opt-in kept at its first size)",
     "core/ops/attention.cuh",
     "  if (smem <= 48 * 1024 || smem <= slot.load()) return;",
     "  if (smem <= 48 * 1024 || slot.load() > 0) return;"),
    ("tf32_one_product", "lost precision (3xTF32's small parts' products dropped: one TF32 product)",
     "core/ops/mma_tiles.cuh",
     "#pragma unroll\n  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.small, b[n].big);\n#pragma unroll\n"
     "  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.big, b[n].small);\n",
     ""),
    ("tf32_row_small_pass", "lost precision (mma_row_3xtf32's pass of a-small products dropped)",
     "core/ops/mma_tiles.cuh",
     "#pragma unroll\n  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.small, b[n].big);\n", ""),
    ("tf32_split_small_whole", "wrong value (3xTF32's small part taken as the whole element)",
     "core/ops/mma_tiles.cuh",
     "  const float small = x - b;", "  const float small = x;"),
    ("tf32_acc_unpermuted", "wrong layout (an accumulator read as an A fragment without the k permutation)",
     "core/ops/attention_tf32.cu",
     "  put(c[2], f.big[1], f.small[1]);\n  put(c[1], f.big[2], f.small[2]);",
     "  put(c[1], f.big[1], f.small[1]);\n  put(c[2], f.big[2], f.small[2]);"),
    ("tf32_bwd_ds_barrier", "dropped barrier (dS^T read for dQ before every warp wrote it)",
     "core/ops/attention_tf32.cu",
     "    __syncthreads();  // dS^T is whole\n",
     ""),
    ("tf32_bwd_tile_in_barrier", "dropped barrier (dS^T of the next tile written while dQ reads this one's)",
     "core/ops/attention_tf32.cu",
     "    cuda::cp_async_wait_all();\n    __syncthreads();  // the tile is in\n",
     "    cuda::cp_async_wait_all();\n"),
    ("tf32_fwd_causal_diag", "off by one (the causal mask lets each row see the next key)",
     "core/ops/attention_tf32.cu",
     "{ mask_scores(s, keys_left, diag, 0, g, t); }",
     "{ mask_scores(s, keys_left, diag + 1, 0, g, t); }"),
    ("flash_dq_next_stage_same", "wrong buffer (two stages: the next key tile loaded over the one being worked on)",
     "core/ops/attention_flash.cu",
     "      stage(j0 + kKeys, st ^ 1);",
     "      stage(j0 + kKeys, st);"),
    ("flash_bwd_p_barrier", "dropped barrier (P and dS read before every warp wrote them)", "core/ops/attention_flash.cu",
     "    __syncthreads();  // P and dS are whole\n",
     ""),
    ("flash_bwd_stage_barrier", "dropped barrier (one stage: the next q and dO over the tile dK and dV still read)",
     "core/ops/attention_flash.cu",
     "      __syncthreads();                              // every warp is done with q, dO, lse and delta\n",
     ""),
    ("flash_bwd_next_stage_same", "wrong buffer (two stages: the next tile loaded over the one being worked on)",
     "core/ops/attention_flash.cu",
     "    if (two && i0 + kRows < a.tq) stage(i0 + kRows, st ^ 1);",
     "    if (two && i0 + kRows < a.tq) stage(i0 + kRows, st);"),
    ("flash_bwd_stage_not_alternating", "wrong buffer (two stages: every tile read from the first)",
     "core/ops/attention_flash.cu",
     "    const int st = two ? static_cast<int>(it & 1) : 0;\n    const uint16_t* qs = q0 + st * QS;",
     "    const int st = 0 * it;\n    const uint16_t* qs = q0 + st * QS;"),
    ("flash_bwd_row_lse", "wrong row's statistics", "core/ops/attention_flash.cu",
     "lr[mt][h] = ls[sq + mt * 16 + g + 8 * h] * kLog2e, dr[mt][h] = dl[sq + mt * 16 + g + 8 * h];",
     "lr[mt][h] = ls[sq + mt * 16 + g] * kLog2e, dr[mt][h] = dl[sq + mt * 16 + g + 8 * h];"),
    ("flash_bwd_lse_units", "wrong units (lse in natural log, not log2)", "core/ops/attention_flash.cu",
     "lr[mt][h] = ls[sq + mt * 16 + g + 8 * h] * kLog2e,",
     "lr[mt][h] = ls[sq + mt * 16 + g + 8 * h],"),
    ("flash_bwd_dq_column_part", "wrong index (every warp on the first dQ columns)", "core/ops/attention_flash.cu",
     "qd = warp / QM * (QN * 8);",
     "qd = 0 * warp / QM * (QN * 8);"),
    ("flash_bwd_dkv_column_half", "wrong index (every warp on the first half of dK's and dV's columns)",
     "core/ops/attention_flash.cu",
     "vd = warp / KG * (D / 2);",
     "vd = 0 * warp / KG * (D / 2);"),
    ("flash_bwd_tile_causal_mask", "mask dropped (the diagonal tiles taken as whole)", "core/ops/attention_flash.cu",
     "(a.causal && j0 + KEYS - 1 > i0)) {",
     "(a.causal && j0 > i0)) {"),
    ("flash_fwd_causal_edge", "off-by-one mask (both forwards' mask_scores)", "core/ops/attention.cuh",
     "if (jl >= keys_left || jl > il + diag) s[nt][e] = -INFINITY;",
     "if (jl >= keys_left || jl > il + diag + 1) s[nt][e] = -INFINITY;"),
    ("flash_fwd_keys_left", "off-by-one bound (both forwards' mask_scores)", "core/ops/attention.cuh",
     "if (jl >= keys_left || jl > il + diag) s[nt][e] = -INFINITY;",
     "if (jl > keys_left || jl > il + diag) s[nt][e] = -INFINITY;"),
    ("flash_fwd_edge_tile", "mask skipped (the diagonal's tiles that start before the warp's first row)",
     "core/ops/attention.cuh",
     "if (j0 + KEYS > tk || (causal && j0 + KEYS - 1 > wrow))",
     "if (j0 + KEYS > tk || (causal && j0 > wrow))"),
    ("flash_fwd_block_kend", "wrong bound (a block's keys end a key tile past its first row, not past its last)",
     "core/ops/attention.cuh",
     "const int last = (f.i0 + BR < f.tq ? f.i0 + BR : f.tq) - 1;",
     "const int last = (f.i0 + KEYS < f.tq ? f.i0 + KEYS : f.tq) - 1;"),
    ("flash_fwd_row_tile_mask", "wrong index (a warp's second row tile masked as its first)",
     "core/ops/attention_flash.cu",
     "mask_scores(s[mt], keys_left, diag, 16 * mt, g, t);",
     "mask_scores(s[mt], keys_left, diag, 0 * mt, g, t);"),
    ("flash_fwd_softmax_rescale", "dropped rescale (the output kept at an old maximum's scale)",
     "core/ops/attention.cuh",
     "for (int nt = 0; nt < DT; ++nt) o[nt][2 * h] *= alpha, o[nt][2 * h + 1] *= alpha;",
     "for (int nt = 0; nt < DT; ++nt) o[nt][2 * h] *= 1.f, o[nt][2 * h + 1] *= 1.f;"),
    ("flash_fwd_interleaved_ntile", "wrong index (interleaved P v: both halves of an A fragment from one n-tile)",
     "core/ops/attention_flash.cu",
     "probabilities<false>(s[mt][2 * kk + h], base[mt], l[mt],",
     "probabilities<false>(s[mt][2 * kk], base[mt], l[mt],"),
    ("flash_fwd_interleaved_row_base", "wrong row (interleaved P v: the second row tile's exponentials at the "
     "first's maximum)", "core/ops/attention_flash.cu",
     "probabilities<false>(s[mt][2 * kk + h], base[mt], l[mt],",
     "probabilities<false>(s[mt][2 * kk + h], base[0], l[mt],"),
    ("flash_fwd_row_tile_lse", "wrong row (a warp's second row tile's statistics at its first's rows)",
     "core/ops/attention_flash.cu",
     "finish_rows(m[mt], l[mt], f.sl, a, f.b, f.tq, wrow + 16 * mt, g, t, lse,",
     "finish_rows(m[mt], l[mt], f.sl, a, f.b, f.tq, wrow + 0 * mt, g, t, lse,"),
    ("flash_bwd_causal_edge", "off-by-one mask", "core/ops/attention_flash.cu",
     "if (!(kr < keys_left && c < rows_left && kr - c <= diag)) s[mt][nt][e] = 0.f;",
     "if (!(kr < keys_left && c < rows_left && kr - c < diag)) s[mt][nt][e] = 0.f;"),
    ("flash_tile_row_stride", "wrong stride (rows taken as dense)", "core/ops/attention.cuh",
     "  const uint16_t* from = src + (r0 + r) * row + c;",
     "  const uint16_t* from = src + (r0 + r) * D + c;"),
    ("flash_head_group_stride", "wrong stride (the expanded keys' groups)", "core/ops/attention.cuh",
     "{ return h.i0 * s0 + h.i1 * s1 + h.i2 * s2; }",
     "{ return h.i0 * s0 + h.i1 * s1 + h.i2 * s1; }"),
    ("flash_output_standin_dropped", "output left in its stand-in", "core/ops/attention_flash.cu",
     "    if (o.t.raw_data() != x.raw_data()) x.copy_(o.t.view(x.sizes()));",
     "    (void)x;"),
    ("flash_dk_row_stride", "wrong stride (dk's rows taken as dense)", "core/ops/attention_flash.cu",
     "const int64_t ko = dk0 + j * rdk.row + vd + 2 * t,",
     "const int64_t ko = dk0 + j * D + vd + 2 * t,"),
    ("dropout_pair_halves_swapped", "wrong element (the pair's traded dropout bits under the other row)",
     "core/ops/attention.cuh",
     "  return h ? other | mine << 2 : mine | other << 2;",
     "  return h ? mine | other << 2 : other | mine << 2;"),
    ("dropout_pair_sent_own_half", "wrong element (a lane sends its own keys' bits, not its partner's)",
     "core/ops/attention.cuh",
     "other = __shfl_xor_sync(0xffffffffu, own >> (2 - 2 * h) & 3u, 1);",
     "other = __shfl_xor_sync(0xffffffffu, own >> (2 * h) & 3u, 1);"),
    ("dropout_t_bit_place", "wrong element (S^T: a traded dropout bit under the lane's own group)",
     "core/ops/attention.cuh",
     "bits |= (__shfl_xor_sync(0xffffffffu, own, 4 * m) >> c & 1u) << (c ^ m);",
     "bits |= (__shfl_xor_sync(0xffffffffu, own, 4 * m) >> c & 1u) << (c ^ (m & 1));"),
    ("dropout_t_group_swapped", "wrong element (S^T: lanes draw the groups of each other's query and key row)",
     "core/ops/attention.cuh",
     "const uint32_t own = d.group(a, b, i + c % 2, j - c + 8 * (c / 2));",
     "const uint32_t own = d.group(a, b, i + c / 2, j - c + 8 * (c % 2));"),
    ("bernoulli_group_word", "wrong word (every element of a Philox call takes its first word)", "core/ops/random.cu",
     "        out[i] = cuda::cast_value<T, double>(r.v[w] < ki ? 1.0 : 0.0);",
     "        out[i] = cuda::cast_value<T, double>(r.v[0] < ki ? 1.0 : 0.0);"),
    # cp.async's waits and commits: the emulation lands a copy only at its
    # thread's wait for a committed group (cuda_emu.h), so these show there.
    ("flash_fwd_v_wait", "missing cp.async wait (P v reads v's tile before it lands)", "core/ops/attention_flash.cu",
     "      cuda::cp_async_wait_all();\n      __syncthreads();  // v's tile is in; every warp is done with k's\n",
     "      __syncthreads();  // v's tile is in; every warp is done with k's\n"),
    ("flash_fwd_first_commit", "uncommitted cp.async (q's and the first k tile's copies in no group)",
     "core/ops/attention.cuh",
     "  load_tile<D, KEYS>(f.kb, rk.row, 0, f.tk, ks);\n  cuda::cp_async_commit();\n",
     "  load_tile<D, KEYS>(f.kb, rk.row, 0, f.tk, ks);\n"),
    ("flash_bwd_stage_wait", "missing cp.async wait (a query tile read before it lands)", "core/ops/attention_flash.cu",
     "    cuda::cp_async_wait_all();\n    // The tile is in; every warp is done with the last P and dS, and with\n",
     "    // The tile is in; every warp is done with the last P and dS, and with\n"),
    ("flash_dq_stage_wait", "missing cp.async wait (a key tile read before it lands)", "core/ops/attention_flash.cu",
     "    cuda::cp_async_wait_all();\n    // The tiles (and, the first time, q and dO) are in; with two stages,\n",
     "    // The tiles (and, the first time, q and dO) are in; with two stages,\n"),
    ("flash_tf32_v_wait", "missing cp.async wait (P V reads v's tile before it lands)", "core/ops/attention_tf32.cu",
     "    cuda::cp_async_wait_all();\n    __syncthreads();  // v's tile is in; every warp is done with k's\n",
     "    __syncthreads();  // v's tile is in; every warp is done with k's\n"),
    ("grouped_stage_wait", "missing cp.async wait (a step's tiles read before they land)", "core/ops/grouped_matmul.cu",
     "    cuda::cp_async_wait_all();\n    __syncthreads();  // step s is in",
     "    __syncthreads();  // step s is in"),
    # The row normalisations' register chunks and weight-gradient tiles.
    ("norm_fwd_chunk_reload", "stale registers (a wide row's output pass from its last chunk)",
     "core/ops/norm_rows.cuh",
     "  T* yr = y + r * n;\n  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {\n    if (!one) xs.load(xr, n, c0, lane);\n",
     "  T* yr = y + r * n;\n  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {\n"),
    ("norm_dx_chunk_reload", "stale registers (a wide row's dx pass from its last chunk)", "core/ops/norm_rows.cuh",
     "    if (!one) {\n      dys.load(dyr, n, c0, lane);\n      xs.load(xr, n, c0, lane);\n    }\n",
     ""),
    ("norm_wgrad_tile_end", "off-by-one bound (a partial tile's last row summed twice)", "core/ops/layer_norm.cu",
     "      if (r + k < r1)\n#pragma unroll\n", "      if (r + k <= r1)\n#pragma unroll\n"),
    ("norm_vec_width_check", "missing check (vectors over a width they do not divide)", "core/ops/norm_rows.cuh",
     "n, ptrs, [&](auto vec, unsigned) { launch(vec); }, n % vec_width<T>() == 0);",
     "n, ptrs, [&](auto vec, unsigned) { launch(vec); }, true);"),
    ("bn_stats_launch_config", "bad launch configuration", "core/ops/batch_norm.cu",
     "stats_finalize_kernel<A><<<cuda::grid_for(d.c, kFinalizeChannels), cuda::kBlockSize, 0, stream>>>(",
     "stats_finalize_kernel<A><<<cuda::grid_for(d.c, kFinalizeChannels), 4 * cuda::kBlockSize + 32, 0, stream>>>("),
]


ASAN_FLAGS = ["--config=asan", "--test_env=EMBER_NO_CUDA_MEMORY_CACHING=1"]


def run_tests(flags):
    t = time.time()
    p = subprocess.run(["bazel", "test", "--noshow_progress", "--test_output=summary"] + flags + TESTS,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = [l.split()[0] for l in p.stdout.splitlines() if l.startswith("//") and
              ("FAILED" in l or "TIMEOUT" in l or "NO STATUS" in l)]
    return p.returncode, failed, time.time() - t, p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only the mutants of these names (comma-separated)")
    ap.add_argument("--tests", help="run only these test targets (comma-separated)")
    ap.add_argument("--asan", action="store_true", help="run the tests under ASan, without memory caching")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutant's original text occurs once in its file (no builds)")
    args = ap.parse_args()
    if args.check:
        stale = [f"{name}: {path} holds its original text {open(path).read().count(old)} times"
                 for name, _, path, old, _ in MUTANTS if open(path).read().count(old) != 1]
        if stale:
            sys.exit("cuda_mutants: mutants whose code changed (update them):\n  " + "\n  ".join(stale))
        print(f"cuda_mutants: all {len(MUTANTS)} mutants apply")
        return
    flags = ASAN_FLAGS if args.asan else []
    if args.tests:
        TESTS[:] = args.tests.split(",")
    rc, failed, secs, out = run_tests(flags)
    if rc != 0:
        sys.exit("cuda_mutants: the unmutated tests do not pass; fix them first:\n" + out[-3000:])
    print(f"baseline: {len(TESTS)} emulated test targets pass ({secs:.0f} s)")
    rows, caught = [], 0
    for name, kind, path, old, new in MUTANTS:
        if args.only and name not in args.only.split(","):
            continue
        if "(ASAN)" in kind and not args.asan:
            print(f"{name:24} {kind:32} skipped: only --asan can see it")
            continue
        src = open(path).read()
        if src.count(old) != 1:
            sys.exit(f"cuda_mutants: {name}: the original text occurs {src.count(old)} times in {path} "
                     "(the code changed; update the mutant)")
        try:
            open(path, "w").write(src.replace(old, new))
            rc, failed, secs, out = run_tests(flags)
        finally:
            open(path, "w").write(src)
        build_broke = rc != 0 and not failed
        if build_broke:
            sys.exit(f"cuda_mutants: {name} does not build, which proves nothing:\n{out[-3000:]}")
        hit = rc != 0
        caught += hit
        rows.append((name, kind, path, ", ".join(t.split(":")[1] for t in failed) if hit else "NOT CAUGHT"))
        print(f"{name:24} {kind:32} {'caught by ' + rows[-1][3] if hit else 'NOT CAUGHT'} ({secs:.0f} s)",
              flush=True)
    print()
    print("| mutant | kind | file | caught by |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| `{r[0]}` | {r[1]} | `{r[2]}` | {r[3]} |")
    print(f"\ncaught {caught} of {len(rows)} mutants{' (under ASan)' if args.asan else ''}")
    sys.exit(0 if caught == len(rows) else 1)


if __name__ == "__main__":
    main()
