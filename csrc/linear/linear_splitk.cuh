// linear_splitk_kernel: y = act(x · Wᵀ + b) + residual for 4 to 16 rows of x in float16 / bfloat16,
// on tensor cores, where W has too few rows for linear_mma_kernel's one block per 16 weight rows to
// fill the GPU (GPT-2's c_proj: N = 768 gives 48 tiles for 132 SMs).
//
// The same weight stream as linear_mma_kernel (linear_kernel.cuh): K x N x sizeof(T) bytes read once
// (4.7 MB at 3072 x 768 in 16-bit types, ~1.6 us at the copy bandwidth), x (a few KB) from L1. The
// tile of 16 weight rows (8 gate over 8 up rows with SwiGLU) is split along K over the blocks of a
// thread-block cluster (grid: tiles x splits, cluster 1 x splits; linear.cpp's splitk_splits keeps the
// grid near 1.5 blocks a SM, at most 8 splits, the portable cluster size): each block computes the
// mma.sync partial sums of its slice of K with linear_mma_kernel's lane operands, loop and block sum
// (mma_lane, mma_accumulate, mma_block_sum); every other block of the cluster pushes its sums into the
// rank-0 block's shared memory (distributed shared memory, st.async onto rank 0's mbarrier) and exits,
// and rank 0 adds them in rank order and applies the epilogue (mma_store: bias, GELU tanh or SwiGLU,
// residual, one rounding).
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
#include "../common/mbarrier.cuh"
#include "linear_kernel.cuh"

namespace fused_attn {

namespace linear {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Where the splits' sums land in rank 0's shared memory: its mbarrier (the pushes' bytes complete on it),
// then a slot per other split, owning warp and lane (4 floats: the lane's s).
template <int NT>
struct SplitkLanding {
  uint64_t bar;
  float4 pushed[kLinearMaxSplits - 1][NT][32];
};

template <int NT>
__device__ __forceinline__ SplitkLanding<NT>& splitk_landing() {
  __shared__ SplitkLanding<NT> landing;
  return landing;
}

// At the kernel's start, every block of the cluster: rank 0 initializes its landing's mbarrier, then every
// thread arrives (relaxed) on the cluster barrier's first phase, which splitk_reduce_store waits for.
template <int NT>
__device__ __forceinline__ void splitk_reduce_init(int rank) {
  if (rank == 0 && threadIdx.x == 0) {
    mbarrier_init_for_pushes(&splitk_landing<NT>().bar);
  }
  cluster_arrive_relaxed();  // phase 1: this block has started (rank 0: its mbarrier exists)
}

// The end of a split-K block of the cluster (called by all its threads once, after mma_block_sum;
// `owner`: warp t < NT holding n-tile t's sums of this split in s; cluster, splits and rank: the
// caller's, which called splitk_reduce_init at its start): every other split's owning lanes push their
// sums into rank 0's landing (st.async, the bytes counted on its mbarrier) and the block exits; rank 0
// waits on its own mbarrier for the (splits - 1) x NT x 512 bytes, adds them in rank order and applies
// the epilogue (mma_store with out_in, loaded ahead by its owning warps). No cluster barrier after the
// start's. (Measured against the pushes under a release / acquire cluster barrier: docs/lab-notes/linear-mlp.md;
// rank 0 reading each split's shared memory in turn between two barriers measured 20 us slower per GPT-2
// B16 step.)
template <typename T, int NT, int kAct = kActRuntime>
__device__ __forceinline__ void splitk_reduce_store(const LinearParams& p, int64_t col0, bool owner, float (&s)[4],
                                                    const MmaOutputIn& out_in, int splits, int rank) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  SplitkLanding<NT>& landing = splitk_landing<NT>();
  cluster_wait();  // phase 1: every block has started, rank 0's mbarrier initialized
  if (rank != 0) {
    if (owner)
      push_f32x4(cluster_addr(&landing.pushed[rank - 1][warp][lane], 0), make_float4(s[0], s[1], s[2], s[3]),
                 cluster_addr(&landing.bar, 0));
    return;  // nothing reads this block's shared memory
  }
  if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&landing.bar, uint32_t((splits - 1) * NT * 32 * 16));
  if (!owner) return;
  mbarrier_wait(&landing.bar, 0);  // every split's sums have landed
  float4 other[kLinearMaxSplits - 1];
#pragma unroll
  for (int r = 1; r < kLinearMaxSplits; ++r)
    other[r - 1] = r < splits ? landing.pushed[r - 1][warp][lane] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 1; r < kLinearMaxSplits; ++r) {
    if (r >= splits) continue;
    s[0] += other[r - 1].x;
    s[1] += other[r - 1].y;
    s[2] += other[r - 1].z;
    s[3] += other[r - 1].w;
  }
  mma_store<T, kAct>(p, col0, warp, s, out_in);
}
#endif

// Row group g of a kRowGroups launch: kMmaGroupRows rows of x, residual and out from row g x kMmaGroupRows.
template <typename T>
__device__ __forceinline__ LinearParams splitk_row_group(const LinearParams& p, int g) {
  LinearParams q = p;
  const int first = g * kMmaGroupRows;
  q.m = min(kMmaGroupRows, p.m - first);
  q.x = static_cast<const T*>(p.x) + int64_t(first) * p.x_stride;
  if (p.residual != nullptr) q.residual = static_cast<const T*>(p.residual) + int64_t(first) * p.r_stride;
  q.out = static_cast<T*>(p.out) + int64_t(first) * p.o_stride;
  return q;
}

// NT n-tiles of 8 rows of x (NT = 1: up to 8 rows, 2: up to 16, 4: up to 32); blockIdx.x the tile, the
// cluster (blockIdx.y) the split of K; with kRowGroups (NT 4, 33-64 rows) blockIdx.z the row group.
// kShort: linear_mma_kernel's short build (CH chunks in flight, kMmaShortMinBlocks blocks per SM),
// for a split whose warps' share of K is in flight before the wait; else the long one; four n-tiles: the
// wide build whatever kShort (kMmaWideChunks). kAct: as linear_mma_kernel's.
template <typename T, int NT, bool kShort, bool kStageX, int kAct = kActRuntime, bool kRowGroups = false>
__global__ void __launch_bounds__(kLinearMmaThreads, NT >= 4 ? kMmaWideMinBlocks : kShort ? kMmaShortMinBlocks : 1)
    linear_splitk_kernel(const LinearParams params) {
  constexpr int CH = NT >= 4 ? kMmaWideChunks : kShort ? kMmaShortChunks : kMmaLongChunks;
  static_assert(!kRowGroups || NT == 4, "row groups are the wide build's");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const LinearParams p = kRowGroups ? splitk_row_group<T>(params, int(blockIdx.z)) : params;
  namespace cg = cooperative_groups;
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  splitk_reduce_init<NT>(rank);  // phase 1: this block has started (rank 0: its landing's mbarrier exists)
  // Whole chunks of 32 k per split (the launcher leaves no split empty).
  const int chunks = (p.k + 31) / 32, per = (chunks + splits - 1) / splits;
  const int begin = rank * per, end = min(chunks, begin + per);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Spelled out, not through build_activation, as in linear_mma_kernel (which says why).
  const bool swiglu = kAct == kActRuntime ? p.activation == kActSwiglu : (kAct & kActCodeMask) == kActSwiglu;
  const int64_t col0 = int64_t(blockIdx.x) * (swiglu ? 8 : 16);
  const MmaLane<T, NT> L = mma_lane<T, NT, kAct>(p, col0, lane);
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  uint4 wa[CH][2];
  mma_load_weights<T, NT, CH>(p, L, begin + warp, end, kMmaWarps, wa);
  MmaOutputIn out_in;  // rank 0's owning warps' epilogue operands, loaded ahead (bias before the wait)
  const bool stores = kOutputAhead && rank == 0 && warp < NT;
  if (stores) mma_load_output_bias<T, kAct>(p, col0, warp, out_in);
  wait_for_primary();  // x and (rank 0's epilogue) the residual are the previous kernel's outputs
  if (stores) mma_load_output_residual<T, kAct>(p, col0, warp, out_in);
  mma_accumulate<T, NT, CH, kStageX>(p, L, begin + warp, end, kMmaWarps, wa, acc);
  launch_dependents();

  float s[4];
  const bool owner = mma_block_sum<NT, CH, kStageX>(acc, s);  // warp t < NT holds n-tile t of this split
  splitk_reduce_store<T, NT, kAct>(p, col0, owner, s, out_in, splits, rank);
#else
  __trap();  // launched only where linear_splitk_arch says it was compiled (sm_90 and later)
#endif
}

}  // namespace linear

namespace linear {
template <typename T, int MT, int kAct>
void launch_splitk_act(const LinearParams& p, int splits, int sms, cudaStream_t stream) {
  static_assert(MT == 8 || MT == 16 || MT == 32 || MT == 64,
                "the split-K kernel takes one, two or four n-tiles of 8 rows of x, or two groups of four");
  const int64_t cols_per_block = p.activation == kActSwiglu ? 8 : 16;
  const unsigned groups = MT == 64 ? unsigned(linear_row_groups(p.m)) : 1;
  const dim3 grid(unsigned((p.n_out + cols_per_block - 1) / cols_per_block), unsigned(splits), groups);
  const dim3 cluster(1, unsigned(splits), 1);
  if constexpr (MT == 64) {  // the wide build in row groups
    launch_clustered(true, cluster, linear_splitk_kernel<T, 4, false, false, kAct, true>, grid,
                     dim3(kLinearMmaThreads), 0, stream, p);
  } else if constexpr (MT == 32) {  // the wide build: one for every split's K
    launch_clustered(true, cluster, linear_splitk_kernel<T, 4, false, false, kAct>, grid, dim3(kLinearMmaThreads), 0,
                     stream, p);
  } else {
    const int64_t chunks = (p.k + 31) / 32, per_split = (chunks + splits - 1) / splits;
    const bool is_short = mma_short(per_split);
    const bool staged = is_short && mma_stage_x<MT / 8>(int64_t(grid.x) * splits, sms);
    const auto kernel = staged     ? linear_splitk_kernel<T, MT / 8, true, MT == 16, kAct>
                        : is_short ? linear_splitk_kernel<T, MT / 8, true, false, kAct>
                                   : linear_splitk_kernel<T, MT / 8, false, false, kAct>;
    launch_clustered(true, cluster, kernel, grid, dim3(kLinearMmaThreads), 0, stream, p);
  }
}

// The build activation as launch_mma_builds picks it.
template <typename T, int MT>
void launch_splitk_builds(const LinearParams& params, int splits, int sms, cudaStream_t stream) {
  const LinearParams p = with_linear_pdl_early(params);
  with_build_activation(p, [&](auto act) { launch_splitk_act<T, MT, decltype(act)::value>(p, splits, sms, stream); });
}
}  // namespace linear

template <typename T, int MT>
void launch_linear_splitk(const LinearParams& p, int splits, int sms, cudaStream_t stream) {
  linear::launch_splitk_builds<T, MT>(p, splits, sms, stream);
}

template <typename T, int MT>
int linear_splitk_arch() {
  static const int arch = [] {
    cudaFuncAttributes attr{};
    constexpr auto kernel = linear::linear_splitk_kernel<T, MT >= 32 ? 4 : MT / 8, MT < 32, false, kArchProbeBuild,
                                                         MT == 64>;
    return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess ? attr.binaryVersion : 0;
  }();
  return arch;
}

}  // namespace fused_attn
