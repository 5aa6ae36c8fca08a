// mlp_kernel: a transformer's feed-forward block for few rows of x (decode: M <= 16) in one launch,
//     h = act(x · W_fcᵀ + b_fc)           act: GELU tanh, or SwiGLU (W_fc = gate rows over up rows)
//     y = h · W_projᵀ + b_proj + residual
// in float16 / bfloat16 on tensor cores, float32 accumulation, h and y each rounded once to T.
//
// The two-launch MLP (fused_attn.linear twice: linear_mma_kernel, then linear_splitk_kernel, chained by
// programmatic dependent launch) pays for the dependency between them with the first grid's drain and
// the second's griddepcontrol.wait, which returns only once the whole first grid has completed and
// flushed. Here one grid does both: a block computes its tiles of h exactly as linear_mma_kernel does
// (the same lane operands, loop and block sum from linear_kernel.cuh: h is bit for bit that kernel's),
// stores them, counts itself on `arrived` and, while it spins until every block has, already has its
// first W_proj pieces in flight; then it computes its part of y as linear_splitk_kernel does (a tile of
// 16 W_proj rows, split along K over a thread-block cluster, the splits' sums pushed into rank 0's
// shared memory and added in rank order: splitk_reduce_store). h crosses memory once, through L2.
// Measured slower than the two launches in GPT-2's decode step (H100, bench/NOTES.md session 17), also
// with both weights' first pieces in registers from the start (2 blocks per SM): fused_attn.mlp's
// default is the two launches; this kernel is its single_launch=True.
//
// Grid: (16-row tiles of W_proj) x splits, clusters of `splits` along y; block b (= y * tiles + x) owns
// the h tiles b, b + blocks, ... For GPT-2 (768 -> 3072 -> 768) the launcher picks 4 splits: 192 blocks,
// one h tile each (24 chunks of 32 k: 3 per warp, all in flight before the wait) and one quarter of a
// W_proj tile's K (again 3 chunks per warp). The spin is a wait on other blocks of the same grid: it is
// correct only if they are all resident together, so the launcher checks that the device holds that
// many clusters at once (mlp_max_clusters, cudaOccupancyMaxActiveClusters) and otherwise runs the two
// launches. The counters reset themselves: every block, at its end (past its spin), counts itself on
// `left`, and the last one zeroes both (no block reads `arrived` any more by then); so one launch at a
// time per workspace.
//
// Tests: tests/test_mlp.py (test_single_launch_*); benchmark: bench/bench_mlp.py (provider
// fused_1launch, against fused: the two launches).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "../common/cluster.cuh"
#include "../common/grid_sync.cuh"
#include "../linear/linear_splitk.cuh"
#include "mlp_launch.h"

namespace fused_attn {

namespace mlp {

using linear::kMmaShortChunks;
using linear::kMmaShortMinBlocks;
using linear::kMmaStageX;
using linear::kMmaWarps;
using linear::MmaLane;
using linear::MmaOutputIn;

static_assert(kMlpThreads == kLinearMmaThreads, "mma_block_sum sums kMmaWarps warps");

// NT n-tiles of 8 rows of x (NT = 1: up to 8 rows, 2: up to 16). linear_mma_kernel's short build
// (kMmaShortChunks in flight per warp, kMmaShortMinBlocks blocks per SM).
template <typename T, int NT>
__global__ void __launch_bounds__(kMlpThreads, kMmaShortMinBlocks) mlp_kernel(const MlpParams p) {
  constexpr int CH = kMmaShortChunks;
  constexpr bool kStageX = kMmaStageX && NT == 2;  // linear_kernel.cuh: the grid is resident at once
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using namespace linear;
  launch_dependents_early(p.fc.pdl_early);  // pdl.cuh: every block waits below before it exits
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  splitk_reduce_init<NT>(rank);  // phase 1: this block has started (splitk_reduce_store waits for it)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned blocks = gridDim.x * gridDim.y;
  const int64_t block = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t fc_cols = p.fc.activation == kActSwiglu ? 8 : 16;
  const int64_t fc_tiles = (p.fc.n_out + fc_cols - 1) / fc_cols;
  const int fc_chunks = (p.fc.k + 31) / 32;
  // This block's slice of W_proj: tile blockIdx.x, chunks [begin, end) of K.
  const int proj_chunks = (p.proj.k + 31) / 32, per = (proj_chunks + splits - 1) / splits;
  const int begin = rank * per, end = min(proj_chunks, begin + per);
  const int64_t proj_col0 = int64_t(blockIdx.x) * 16;

  // h: the first tile's weights (and the owning warps' biases) on their way before the wait.
  uint4 wa[CH][2];
  MmaOutputIn out_in;
  int64_t col0 = block * fc_cols;
  mma_load_weights<T, NT, CH>(p.fc, mma_lane<T, NT>(p.fc, col0, lane), warp, fc_chunks, kMmaWarps, wa);
  if (warp < NT) mma_load_output_bias<T>(p.fc, col0, warp, out_in);
  wait_for_primary();  // x and the residual are the previous kernel's outputs
  for (int64_t tile = block; tile < fc_tiles; tile += blocks) {
    const MmaLane<T, NT> L = mma_lane<T, NT>(p.fc, col0, lane);
    if (tile != block) mma_load_weights<T, NT, CH>(p.fc, L, warp, fc_chunks, kMmaWarps, wa);
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    mma_accumulate<T, NT, CH, kStageX>(p.fc, L, warp, fc_chunks, kMmaWarps, wa, acc);
    // After the last tile W_proj's first pieces go out, in flight through the stores, the arrival and the
    // spin. (Also prefetching them into L2 at the start, beside the W_fc stream, measured slower: GPT-2 M 4
    // 12.1 -> 13.6 us, H100, bench/NOTES.md session 17.)
    if (tile + blocks >= fc_tiles)
      mma_load_weights<T, NT, CH>(p.proj, mma_lane<T, NT>(p.proj, proj_col0, lane), begin + warp, end, kMmaWarps,
                                  wa);
    float s[4];
    if (mma_block_sum<NT, CH, kStageX>(acc, s)) mma_store<T>(p.fc, col0, warp, s, out_in);
    __syncthreads();  // the owning warps have read mma_block_sum's shared memory (reused next)
    col0 += int64_t(blocks) * fc_cols;
    if (tile + blocks < fc_tiles && warp < NT) mma_load_output_bias<T>(p.fc, col0, warp, out_in);
  }
  if (block >= fc_tiles)  // a block without an h tile
    mma_load_weights<T, NT, CH>(p.proj, mma_lane<T, NT>(p.proj, proj_col0, lane), begin + warp, end, kMmaWarps,
                                wa);

  // One release arrival per block, after the block's h stores (ordered before it by the __syncthreads
  // above: the release is cumulative over what the barrier made this thread observe).
  if (threadIdx.x == 0) add_release(p.arrived, 1u);
  const bool stores = rank == 0 && warp < NT;  // rank 0's owning warps store y
  if (stores) {
    mma_load_output_bias<T>(p.proj, proj_col0, warp, out_in);
    mma_load_output_residual<T>(p.proj, proj_col0, warp, out_in);
  }
  if (threadIdx.x == 0) wait_at_least(p.arrived, blocks);
  __syncthreads();  // thread 0's acquire: every block's h is visible to this block's loads below

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  mma_accumulate<T, NT, CH, kStageX>(p.proj, mma_lane<T, NT>(p.proj, proj_col0, lane), begin + warp, end, kMmaWarps, wa,
                            acc);
  launch_dependents();
  float s[4];
  const bool owner = mma_block_sum<NT, CH, kStageX>(acc, s);  // warp t < NT holds n-tile t of this split
  splitk_reduce_store<T, NT>(p.proj, proj_col0, owner, s, out_in, splits, rank);
  // Counted out by the last warp (never an owner: rank 0's stores go on while its atomic is out): the last
  // block past its wait (every block counts itself only after it) sets the counters back to 0.
  if (threadIdx.x == kMlpThreads - 32 && atomicAdd(p.left, 1u) == blocks - 1) {
    atomicExch(p.arrived, 0u);
    atomicExch(p.left, 0u);
  }
#else
  __trap();  // launched only where mlp_max_clusters says it was compiled (sm_90 and later)
#endif
}

}  // namespace mlp

template <typename T, int MT>
cudaError_t launch_mlp(const MlpParams& params, int splits, cudaStream_t stream) {
  static_assert(MT == 8 || MT == 16, "the tensor-core kernels take one or two n-tiles of 8 rows of x");
  MlpParams p = params;
  p.fc = with_pdl_early(p.fc, p.fc.m);
  const dim3 grid(unsigned((p.proj.n_out + 15) / 16), unsigned(splits));
  return launch_clustered(true, dim3(1, unsigned(splits), 1), mlp::mlp_kernel<T, MT / 8>, grid, dim3(kMlpThreads), 0,
                          stream, p);
}

template <typename T, int MT>
int mlp_max_clusters(int splits) {
  const auto kernel = mlp::mlp_kernel<T, MT / 8>;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.binaryVersion < 90) return 0;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, unsigned(splits));
  config.blockDim = dim3(kMlpThreads);
  cudaLaunchAttribute attr_cluster[1];
  attr_cluster[0].id = cudaLaunchAttributeClusterDimension;
  attr_cluster[0].val.clusterDim.x = 1;
  attr_cluster[0].val.clusterDim.y = unsigned(splits);
  attr_cluster[0].val.clusterDim.z = 1;
  config.attrs = attr_cluster;
  config.numAttrs = 1;
  int clusters = 0;
  return cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess ? clusters : 0;
}

}  // namespace fused_attn
