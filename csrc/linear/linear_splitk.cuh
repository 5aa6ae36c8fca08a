// linear_splitk_kernel: y = act(x · Wᵀ + b) + residual for 4 to 16 rows of x in float16 / bfloat16,
// on tensor cores, where W has too few rows for linear_mma_kernel's one block per 16 weight rows to
// fill the GPU (GPT-2's c_proj: N = 768 gives 48 tiles for 132 SMs).
//
// The same weight stream as linear_mma_kernel (linear_kernel.cuh): K x N x sizeof(T) bytes read once
// (4.7 MB at 3072 x 768 in 16-bit types, ~1.6 us at the copy bandwidth), x (a few KB) from L1. The
// tile of 16 weight rows (8 gate over 8 up rows with SwiGLU) is split along K over the blocks of a
// thread-block cluster (grid: tiles x splits, cluster 1 x splits; the launcher picks splits so that
// tiles x splits covers the SMs twice, at most 8, the portable cluster size): each block computes the
// mma.sync partial sums of its slice of K with linear_mma_kernel's lane operands, loop and block sum
// (mma_lane, mma_accumulate, mma_block_sum); every other block of the cluster stores its sums into the
// rank-0 block's shared memory (distributed shared memory, cluster.map_shared_rank) and exits, and rank
// 0 adds them in rank order and applies the epilogue (mma_store: bias, GELU tanh or SwiGLU, residual,
// one rounding).
// One launch, no workspace, no atomics: the result is the same from run to run. Launched
// programmatically (common/pdl.cuh): the first weight loads are issued before wait_for_primary().
// Needs sm_90 (clusters); the launcher checks linear_splitk_arch.
//
// Tests: tests/test_linear.py (test_split_k_path_gpu), tests/sanitizer_cases.py; benchmark:
// bench/bench_linear.py (3072 x 768 and 768 x 768 at M = 16).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "../common/cluster.cuh"
#include "linear_kernel.cuh"

namespace fused_attn {

namespace linear {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The end of a split-K block of the cluster (called by all its threads once, after mma_block_sum;
// `owner`: warp t < NT holding n-tile t's sums of this split in s; cluster, splits and rank: the
// caller's): every split pushes its sums into rank 0's shared memory (remote stores: nothing waits for
// them), and rank 0, past one barrier, adds them from its own shared memory in rank order and applies
// the epilogue (mma_store with out_in, loaded ahead by its owning warps). (Rank 0 reading each split's
// shared memory in turn between two barriers measured 20 us slower per GPT-2 B16 step: bench/NOTES.md,
// session 15.) The caller arrived on the cluster barrier (cluster_arrive_relaxed) at its start: its
// first phase guarantees rank 0's memory exists.
template <typename T, int NT>
__device__ __forceinline__ void splitk_reduce_store(const LinearParams& p, int64_t col0, bool owner, float (&s)[4],
                                                    const MmaOutputIn& out_in,
                                                    const cooperative_groups::cluster_group& cluster, int splits,
                                                    int rank) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float pushed[kLinearMaxSplits - 1][NT][4][32];
  cluster_wait();  // phase 1 (arrived at the start): every block has started, rank 0's memory exists
  if (owner && rank != 0) {
    float* dst = cluster.map_shared_rank(&pushed[rank - 1][warp][0][0], 0);
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i * 32 + lane] = s[i];
  }
  cluster_arrive_release();  // phase 2: the pushes, visible to rank 0 after its wait
  if (rank != 0) return;     // block-uniform; nothing reads this block's shared memory
  cluster_wait();
  if (owner) {
    float other[kLinearMaxSplits - 1][4];
#pragma unroll
    for (int r = 1; r < kLinearMaxSplits; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) other[r - 1][i] = r < splits ? pushed[r - 1][warp][i][lane] : 0.f;
#pragma unroll
    for (int r = 1; r < kLinearMaxSplits; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (r < splits) s[i] += other[r - 1][i];
    mma_store<T>(p, col0, warp, s, out_in);
  }
}
#endif

// NT n-tiles of 8 rows of x (NT = 1: up to 8 rows, 2: up to 16); blockIdx.x the tile, the cluster
// (blockIdx.y) the split of K.
// kShort: linear_mma_kernel's short build (CH chunks in flight, kMmaShortMinBlocks blocks per SM),
// for a split whose warps' share of K is in flight before the wait; else the long one.
template <typename T, int NT, bool kShort, bool kStageX>
__global__ void __launch_bounds__(kLinearMmaThreads, kShort ? kMmaShortMinBlocks : 1)
    linear_splitk_kernel(const LinearParams p) {
  constexpr int CH = kShort ? kMmaShortChunks : kMmaLongChunks;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  cluster_arrive_relaxed();  // phase 1: this block has started
  // Whole chunks of 32 k per split (the launcher leaves no split empty).
  const int chunks = (p.k + 31) / 32, per = (chunks + splits - 1) / splits;
  const int begin = rank * per, end = min(chunks, begin + per);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t col0 = int64_t(blockIdx.x) * (p.activation == kActSwiglu ? 8 : 16);
  const MmaLane<T, NT> L = mma_lane<T, NT>(p, col0, lane);
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  uint4 wa[CH][2];
  mma_load_weights<T, NT, CH>(p, L, begin + warp, end, kMmaWarps, wa);
  MmaOutputIn out_in;  // rank 0's owning warps' epilogue operands, loaded ahead (bias before the wait)
  const bool stores = kOutputAhead && rank == 0 && warp < NT;
  if (stores) mma_load_output_bias<T>(p, col0, warp, out_in);
  wait_for_primary();  // x and (rank 0's epilogue) the residual are the previous kernel's outputs
  if (stores) mma_load_output_residual<T>(p, col0, warp, out_in);
  mma_accumulate<T, NT, CH, kStageX>(p, L, begin + warp, end, kMmaWarps, wa, acc);
  launch_dependents();

  float s[4];
  const bool owner = mma_block_sum<NT, CH, kStageX>(acc, s);  // warp t < NT holds n-tile t of this split
  splitk_reduce_store<T, NT>(p, col0, owner, s, out_in, cluster, splits, rank);
#else
  __trap();  // launched only where linear_splitk_arch says it was compiled (sm_90 and later)
#endif
}

}  // namespace linear

template <typename T, int MT>
void launch_linear_splitk(const LinearParams& params, int splits, int sms, cudaStream_t stream) {
  const LinearParams p = linear::with_linear_pdl_early(params);
  static_assert(MT == 8 || MT == 16, "the tensor-core kernels take one or two n-tiles of 8 rows of x");
  const int64_t cols_per_block = p.activation == kActSwiglu ? 8 : 16;
  const dim3 grid(unsigned((p.n_out + cols_per_block - 1) / cols_per_block), unsigned(splits));
  const int64_t chunks = (p.k + 31) / 32, per_split = (chunks + splits - 1) / splits;
  const bool is_short = linear::mma_short(per_split);
  const bool staged = is_short && linear::mma_stage_x<MT / 8>(int64_t(grid.x) * splits, sms);
  const auto kernel = staged     ? linear::linear_splitk_kernel<T, MT / 8, true, MT == 16>
                      : is_short ? linear::linear_splitk_kernel<T, MT / 8, true, false>
                                 : linear::linear_splitk_kernel<T, MT / 8, false, false>;
  launch_clustered(true, dim3(1, unsigned(splits), 1), kernel, grid, dim3(kLinearMmaThreads), 0, stream, p);
}

template <typename T, int MT>
int linear_splitk_arch() {
  static const int arch = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, linear::linear_splitk_kernel<T, MT / 8, true, false>) == cudaSuccess
               ? attr.binaryVersion
               : 0;
  }();
  return arch;
}

}  // namespace fused_attn
