"""A GEMM tile for 33-64 rows of x against cuBLAS at GPT-2's whole-K shapes (H200, ~1 min):

    python -m dev.probe_gemm_rows [--rows 33,48,64] [--splits 1,2,3,4] [--modes 0,1,2,3,4,5] [--reps 200]
        [--kernel-time] [--projections]

At 33-64 rows GPT-2's c_attn (768 -> 2304), c_fc (768 -> 3072, GELU) and lm_head (768 -> 50304 padded) run on
cuBLAS: our linear kernels give each block 16 weight columns, and every block then reads all of x's rows from L2
(96 KB at 64 rows and K 768 against 24 KB of weights), which lost to cuBLAS's GEMM tiles at batch 48 / 64
(docs/lab-notes/linear-mlp.md). The tile measured here is the one that arithmetic asks for:

- a block owns 64 weight columns and all 64 rows of x (four m16 tiles of weight columns x eight n8 tiles of x rows,
  mma.sync m16n8k16, float32 accumulation; warp w takes m-tile w % 4 and x rows 32 (w / 4) .. + 32);
- both operands go global -> shared by cp.async in 64-wide k steps (8 KB of W and 8 KB of x a step, 128-byte rows
  XOR-swizzled for ldmatrix), four stages in flight, so x is read once a 64 columns, a quarter of what the GEMV
  tiles read;
- K is split over a thread-block cluster (grid: column tiles x splits, cluster 1 x splits), so that column tiles x
  splits cover the SMs; each other split writes its partial sums into rank 0's shared memory (distributed shared
  memory, between two cluster barriers), and rank 0 adds them in rank order and applies bias, GELU (tanh) and the
  residual, one rounding to float16;
- launched as a programmatic dependent (PDL), and triggers its dependent after its loop. Before its
  griddepcontrol.wait (the weights are constants) a block has in flight (--modes): 0, its first three stages of
  weights, as our other linear kernels do; 1, those and an L2 prefetch of the rest of its weight slice; 2, its whole
  slice into shared memory of its own (up to 96 KB; x alone then goes through the four-stage ring); 3, the same
  and after the wait x's whole slice at once (no ring: one round trip); 4, mode 3 triggering its dependent at its
  start instead of after its loop; 5, mode 3's residency on warpgroup MMAs (one warpgroup a block, wgmma m64n64k16
  with x's 64 rows as A and the 64 weight columns as B, both read K-major from the same SW128 tiles through
  csrc/common/wgmma.cuh; K / 64 / splits must be 3, 4, 6 or 12).

What it prints, for each row count: the largest error against a float64 product (each mode and split count), the
time a launch in a CUDA graph of 12 layers' weights (a different weight each launch: 12 x 8.3 MB streamed from DRAM,
as in the decode step) for ours at each mode and split count against cuBLAS (torch.addmm; c_fc through
torch._addmm_activation, the cuBLASLt GELU epilogue fused_attn's linear uses above its own kernels' rows), and the
lm_head alone. The chain figure is what moves GPT-2's step: cuBLAS's launches there take 5.1-5.8 us at 64 rows
(bench.profile, 127151d). --kernel-time adds each chain's kernels' own device time a launch (torch.profiler over a
tenth of the replays), which splits a launch's time into its kernel and the hand-off into the next.
Nothing is written into the checkout (load_inline builds under torch's extension cache).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include "common/wgmma.cuh"  // the project's warpgroup MMA (SW128 descriptors, m64n64k16 SS)

namespace cg = cooperative_groups;

constexpr int kCols = 64, kRows = 64, kStepK = 64, kThreads = 256, kStages = 4;
constexpr int kTileBytes = 64 * 128;          // 64 rows of 64 halves
constexpr int kStageBytes = 2 * kTileBytes;   // W's tile, then x's
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kMaxSplits = 4;                 // the landing of the other splits' sums fits the pipeline's memory
constexpr int kMaxSteps = 12;                 // mode 2 holds a block's whole weight slice: K <= 768 at one split
constexpr int kMaxSmemBytes = 2 * kMaxSteps * kTileBytes;  // modes 3, 4: both slices

struct Args {
  const __half* x;
  const __half* w;
  const __half* bias;
  const __half* res;
  __half* out;
  int m, k, n, act;
  // Where a block's weights are before the PDL wait: 0 its first kStages - 1 steps in flight into the pipeline;
  // 1 the same, and its whole slice prefetched into L2; 2 its whole slice in flight into shared memory (a region
  // of its own, x alone through the pipeline).
  int mode;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// Byte offset of 16-byte chunk `chunk` of row `row` in a 64 x 128-byte tile: chunks XOR-swizzled by the row, so the
// eight rows an ldmatrix phase reads (one chunk each) sit in eight different bank groups.
__device__ __forceinline__ int swz(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool live) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float gelu_tanh(float v) {
  const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
  return 0.5f * v * (1.f + tanhf(u));
}

// out[m, n] = act(x[m, k] . w[n, k]^T + bias) + res; k a multiple of 64, m <= 64, rows 16-byte aligned.
__global__ void __launch_bounds__(kThreads) gemm_rows_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int col0 = blockIdx.x * kCols;
  const int all_steps = a.k / kStepK, per = (all_steps + splits - 1) / splits;
  const int first = rank * per, steps = max(0, min(all_steps, first + per) - first);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // Mode 4 triggers its dependent at once (its blocks then wait in griddepcontrol.wait beside this grid's, their
  // weights in flight for the whole of this launch); the others after their loop.
  if (a.mode == 4) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  // Each thread copies chunks tid and tid + 256 of each 512-chunk tile: row c / 8, chunk c % 8.
  const bool resident = a.mode >= 2, x_resident = a.mode >= 3;
  // Step t's tiles: W's and x's halves of pipeline slot t % kStages; or (resident) W's own tile t, then x's ring;
  // or (x_resident) x's own tile t after the weights'.
  auto w_tile = [&](int step) {
    return smem + (resident ? step * kTileBytes : (step % kStages) * kStageBytes);
  };
  auto x_tile = [&](int step) {
    return smem + (x_resident ? (steps + step) * kTileBytes
                   : resident ? steps * kTileBytes + (step % kStages) * kTileBytes
                              : (step % kStages) * kStageBytes + kTileBytes);
  };
  auto issue_w = [&](int step) {
    const int k0 = (first + step) * kStepK;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads, r = c >> 3, ch = c & 7, col = col0 + r;
      const __half* src = a.w + int64_t(min(col, a.n - 1)) * a.k + k0 + ch * 8;
      cp_async16(smem_u32(w_tile(step) + swz(r, ch)), src, col < a.n);
    }
  };
  auto issue_x = [&](int step) {
    const int k0 = (first + step) * kStepK;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads, r = c >> 3, ch = c & 7;
      const __half* src = a.x + int64_t(min(r, a.m - 1)) * a.k + k0 + ch * 8;
      cp_async16(smem_u32(x_tile(step) + swz(r, ch)), src, r < a.m);
    }
  };

  // The weights are constants: before the wait on the previous kernel (PDL) go out their first stages (modes 0, 1),
  // an L2 prefetch of the rest of the slice (mode 1: one 128-byte line a row a step), or the whole slice (mode 2).
  if (a.mode == 1) {
    for (int i = tid; i < kCols * steps; i += kThreads) {
      const int r = i / steps, col = min(col0 + r, a.n - 1);
      const __half* line = a.w + int64_t(col) * a.k + (first + i % steps) * kStepK;
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
    }
  }
  for (int s = 0; s < (resident ? steps : min(kStages - 1, steps)); ++s) issue_w(s);
  if (resident) cp_commit();  // the weights' group, older than every x group below
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (x_resident) {  // all of x's slice at once: one round trip
    for (int s = 0; s < steps; ++s) issue_x(s);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
  } else {
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) issue_x(s);
      cp_commit();  // group s: x's stage s (and group 0 the weights' first stages)
    }
  }

  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  const int mt = warp & 3, nh = warp >> 2;
  for (int t = 0; t < steps; ++t) {
    if (!x_resident) {
      cp_wait<kStages - 2>();  // group t has landed (this thread's copies) ...
      __syncthreads();         // ... and every thread's; slot (t - 1) % kStages is free
      const int next = t + kStages - 1;
      if (next < steps) {
        if (!resident) issue_w(next);
        issue_x(next);
      }
      cp_commit();
    }
    const unsigned char* wt = w_tile(t);
    const unsigned char* xt = x_tile(t);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t af[4];
      ldsm_x4(af, smem_u32(wt + swz(mt * 16 + (lane & 15), kk * 2 + (lane >> 4))));
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int q = lane >> 3, row = nh * 32 + jp * 16 + (q >> 1) * 8 + (lane & 7);
        uint32_t bf[4];
        ldsm_x4(bf, smem_u32(xt + swz(row, kk * 2 + (q & 1))));
        mma16816(acc[2 * jp], af, bf[0], bf[1]);
        mma16816(acc[2 * jp + 1], af, bf[2], bf[3]);
      }
    }
  }
  cp_wait<0>();
  if (a.mode != 4) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (splits > 1) {
    float* land = reinterpret_cast<float*>(smem);  // rank 0's: [splits - 1][kThreads][16]
    cluster.sync();  // every block is past its loop: rank 0's pipeline memory is free
    if (rank != 0) {
      float4* dst = reinterpret_cast<float4*>(cluster.map_shared_rank(land, 0) + ((rank - 1) * kThreads + tid) * 16);
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    }
    cluster.sync();  // the sums have landed
    if (rank != 0) return;
    for (int r = 1; r < splits; ++r) {
      const float4* src = reinterpret_cast<const float4*>(land + ((r - 1) * kThreads + tid) * 16);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 v = src[j];
        acc[j][0] += v.x, acc[j][1] += v.y, acc[j][2] += v.z, acc[j][3] += v.w;
      }
    }
  }
  // acc[j][i]: weight column mt * 16 + lane / 4 (+ 8 for i >= 2), x row nh * 32 + 8 j + 2 (lane % 4) (+ 1 for odd i).
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = nh * 32 + j * 8 + (lane & 3) * 2 + (i & 1);
      const int col = col0 + mt * 16 + (lane >> 2) + (i >> 1) * 8;
      if (row < a.m && col < a.n) {
        float v = acc[j][i];
        if (a.bias != nullptr) v += __half2float(a.bias[col]);
        if (a.act == 1) v = gelu_tanh(v);
        if (a.res != nullptr) v += __half2float(a.res[int64_t(row) * a.n + col]);
        a.out[int64_t(row) * a.n + col] = __float2half_rn(v);
      }
    }
}

// Mode 5: the tile on warpgroup MMAs. One warpgroup (128 threads) a block; both slices whole in shared memory as
// in mode 3 (the weights' before the PDL wait, x's after it), each 64 x 64 tile in the SW128 layout the wgmma
// descriptors read K-major (csrc/common/wgmma.cuh): A = x's 64 rows (M), B = the block's 64 weight columns (N), so
// D[row][col] = x[row] . w[col], 4 k16 instructions a 64-wide k step, one commit for the whole slice. D's
// fragment (the m64n64 accumulator): warp w's rows 16 w + lane / 4 (+ 8 for elements 2, 3 of each n8 group j),
// columns 8 j + 2 (lane % 4) (+ 1), as the attention kernel reads S (flash_scale_mask).
constexpr int kWgThreads = 128;
constexpr int kWgMaxSmemBytes = 2 * kMaxSteps * kTileBytes + 1024;  // + the 1024-byte alignment of the tiles

// STEPS: the 64-wide k steps of a split (K / 64 / splits, the host checks it divides), a constant so that the whole
// wgmma chain unrolls: with a runtime trip count ptxas serializes the chain (C7515).
template <int STEPS>
__device__ __forceinline__ void gemm_rows_wgmma(const Args& a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  unsigned char* const smem = smem_raw + (((raw + 1023) & ~1023u) - raw);  // SW128 tiles start 1024-aligned
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int col0 = blockIdx.x * kCols;
  constexpr int steps = STEPS;
  const int first = rank * STEPS;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  unsigned char* const w_tiles = smem;                      // [STEPS][64 cols][64 k]
  unsigned char* const x_tiles = smem + STEPS * kTileBytes;  // [STEPS][64 rows][64 k]

  for (int s = 0; s < steps; ++s) {
    const int k0 = (first + s) * kStepK;
    for (int c = tid; c < 512; c += kWgThreads) {
      const int r = c >> 3, ch = c & 7, col = col0 + r;
      cp_async16(smem_u32(w_tiles + s * kTileBytes + swz(r, ch)),
                 a.w + int64_t(min(col, a.n - 1)) * a.k + k0 + ch * 8, col < a.n);
    }
  }
  cp_commit();
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  for (int s = 0; s < steps; ++s) {
    const int k0 = (first + s) * kStepK;
    for (int c = tid; c < 512; c += kWgThreads) {
      const int r = c >> 3, ch = c & 7;
      cp_async16(smem_u32(x_tiles + s * kTileBytes + swz(r, ch)),
                 a.x + int64_t(min(r, a.m - 1)) * a.k + k0 + ch * 8, r < a.m);
    }
  }
  cp_commit();
  cp_wait<0>();
  fused_attn::fence_proxy_async_shared();  // the copies, visible to the tensor cores
  __syncthreads();

  float d[32];  // the first instruction does not read it (scale_d 0)
  fused_attn::wgmma_fence();
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t da = fused_attn::sw128_desc(smem_u32(x_tiles + s * kTileBytes) + kk * 32, 16);
      const uint64_t db = fused_attn::sw128_desc(smem_u32(w_tiles + s * kTileBytes) + kk * 32, 16);
      fused_attn::Wgmma<__half, 64>::ss(d, da, db, s > 0 || kk > 0);
    }
  }
  fused_attn::wgmma_commit();
  fused_attn::wgmma_wait<0>();
  fused_attn::wgmma_fence_operands(d);
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (splits > 1) {
    float* land = reinterpret_cast<float*>(smem);  // rank 0's: [splits - 1][32][kWgThreads]
    cluster.sync();  // every block is past its loop: rank 0's tiles are free
    if (rank != 0) {
      float* dst = cluster.map_shared_rank(land, 0) + (rank - 1) * 32 * kWgThreads + tid;
#pragma unroll
      for (int i = 0; i < 32; ++i) dst[i * kWgThreads] = d[i];
    }
    cluster.sync();  // the sums have landed
    if (rank != 0) return;
    for (int r = 1; r < splits; ++r) {
#pragma unroll
      for (int i = 0; i < 32; ++i) d[i] += land[((r - 1) * 32 + i) * kWgThreads + tid];
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + (lane >> 2) + 8 * h, col = col0 + 8 * j + 2 * (lane & 3);
      if (row < a.m && col < a.n) {  // n % 64 == 0 here (the host checks), so col + 1 < n as well
        float v[2] = {d[4 * j + 2 * h], d[4 * j + 2 * h + 1]};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (a.bias != nullptr) v[e] += __half2float(a.bias[col + e]);
          if (a.act == 1) v[e] = gelu_tanh(v[e]);
          if (a.res != nullptr) v[e] += __half2float(a.res[int64_t(row) * a.n + col + e]);
        }
        *reinterpret_cast<__half2*>(a.out + int64_t(row) * a.n + col) = __floats2half2_rn(v[0], v[1]);
      }
    }
#endif
}

__global__ void __launch_bounds__(kWgThreads) gemm_rows_wgmma_kernel(const Args a) {
  switch (a.k / kStepK / int(cg::this_cluster().num_blocks())) {
    case 12: gemm_rows_wgmma<12>(a); break;
    case 6: gemm_rows_wgmma<6>(a); break;
    case 4: gemm_rows_wgmma<4>(a); break;
    case 3: gemm_rows_wgmma<3>(a); break;
    default: break;  // refused on the host
  }
}

void gemm_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> res,
               torch::Tensor out, int64_t act, int64_t splits, bool pdl, int64_t mode) {
  TORCH_CHECK(x.dtype() == torch::kHalf && w.dtype() == torch::kHalf && out.dtype() == torch::kHalf, "float16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  const int m = int(x.size(0)), k = int(x.size(1)), n = int(w.size(0));
  TORCH_CHECK(m >= 1 && m <= kRows && k % kStepK == 0 && w.size(1) == k && out.size(0) == m && out.size(1) == n,
              "x [m <= 64, k % 64 == 0], w [n, k], out [m, n]");
  TORCH_CHECK(splits >= 1 && splits <= kMaxSplits, "splits in 1..4");
  TORCH_CHECK(mode >= 0 && mode <= 5, "mode in 0..5");
  TORCH_CHECK(mode != 5 || n % kCols == 0, "mode 5: n a multiple of 64");
  TORCH_CHECK(mode != 5 || (k / kStepK % splits == 0 && (k / kStepK / splits == 12 || k / kStepK / splits == 6 ||
                                                         k / kStepK / splits == 4 || k / kStepK / splits == 3)),
              "mode 5: k / 64 / splits in {3, 4, 6, 12}");
  const int per = (k / kStepK + int(splits) - 1) / int(splits);
  TORCH_CHECK(mode < 2 || per <= kMaxSteps, "modes 2-5: at most 12 k steps a split");
  static bool attr = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(gemm_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes));
    C10_CUDA_CHECK(cudaFuncSetAttribute(gemm_rows_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kWgMaxSmemBytes));
    return true;
  }();
  (void)attr;
  Args a{reinterpret_cast<const __half*>(x.data_ptr()), reinterpret_cast<const __half*>(w.data_ptr()),
         bias ? reinterpret_cast<const __half*>(bias->data_ptr()) : nullptr,
         res ? reinterpret_cast<const __half*>(res->data_ptr()) : nullptr,
         reinterpret_cast<__half*>(out.data_ptr()), m, k, n, int(act), int(mode)};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned((n + kCols - 1) / kCols), unsigned(splits), 1);
  cfg.blockDim = dim3(mode == 5 ? kWgThreads : kThreads);
  // Mode 2: the slice's tiles and x's ring; 3, 4: both slices (at least the other splits' landing, which reuses
  // the memory).
  const int landing = (int(splits) - 1) * kThreads * 16 * 4;
  const int slices = mode >= 3 ? 2 * per * kTileBytes : per * kTileBytes + kStages * kTileBytes;
  cfg.dynamicSmemBytes = mode >= 2 ? std::max(slices, landing) : kSmemBytes;
  if (mode == 5) cfg.dynamicSmemBytes = std::max(2 * per * kTileBytes, (int(splits) - 1) * 32 * kWgThreads * 4) + 1024;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attrs[2];
  unsigned na = 0;
  if (splits > 1) {
    attrs[na].id = cudaLaunchAttributeClusterDimension;
    attrs[na].val.clusterDim.x = 1;
    attrs[na].val.clusterDim.y = unsigned(splits);
    attrs[na].val.clusterDim.z = 1;
    ++na;
  }
  if (pdl) {
    attrs[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = na;
  if (mode == 5) {
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemm_rows_wgmma_kernel, a));
  } else {
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemm_rows_kernel, a));
  }
}
"""

# GPT-2 small's whole-K projections at decode: (name, in, out, activation); the lm_head's vocabulary padded to a
# multiple of 64 as fused_attn.gpt2 pads it above 16 rows.
SHAPES = [("c_attn", 768, 2304, 0), ("c_fc", 768, 3072, 1)]
LM_HEAD = ("lm_head", 768, 50304, 0)
# The 768-column projections (attention's c_proj, the MLP's c_proj), each adding the residual: at 33-64 rows
# fused_attn.linear runs them on its split-K kernel in two row groups (5.37 us a launch in GPT-2's batch-64 step).
PROJECTIONS = [("attn_c_proj", 768, 768), ("mlp_c_proj", 3072, 768)]
LAYERS = 12


def runnable(mode: int, splits: int, k: int) -> bool:
    """Whether gemm_rows takes (mode, splits) at this K (its host checks): modes 2-5 hold a split's whole slice (at
    most 12 k steps of 64), mode 5 unrolls 3, 4, 6 or 12 of them."""
    steps = k // 64
    per = -(-steps // splits)
    if mode >= 2 and per > 12:
        return False
    return mode != 5 or (steps % splits == 0 and steps // splits in (3, 4, 6, 12))


def build():
    return load_inline("probe_gemm_rows", cpp_sources="void gemm_rows(torch::Tensor x, torch::Tensor w, "
                       "c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> res, torch::Tensor out, "
                       "int64_t act, int64_t splits, bool pdl, int64_t mode);",
                       cuda_sources=SOURCE, functions=["gemm_rows"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       extra_include_paths=[str(Path(__file__).resolve().parent.parent / "csrc")], verbose=False)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
    """act(x . w^T + bias) in float64 (act 1: GELU, tanh form)."""
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return torch.nn.functional.gelu(y, approximate="tanh") if act == 1 else y


def cublas(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: int, out: torch.Tensor) -> None:
    """The many-row path's cuBLAS call: the bias (and GELU) in cuBLASLt's epilogue."""
    if act == 1:
        torch._addmm_activation(bias, x, w.t(), use_gelu=True, out=out)
    elif bias is not None:
        torch.addmm(bias, x, w.t(), out=out)
    else:
        torch.mm(x, w.t(), out=out)


def kernel_us(replay, launches: int, reps: int) -> float:
    """Device time of the kernels a launch, from the profiler's records of `reps` replays (each `launches` kernel
    launches): what a chain's time a launch spends inside kernels; the rest is the hand-off between them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total += float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)))
    return total / (reps * launches)


def graph_us(fn, launches: int, reps: int, kernels: list | None = None) -> float:
    """us a launch of fn's CUDA graph (fn issues `launches` launches), median of 5 timings of `reps` replays;
    with `kernels` (a list), the kernels' own device time a launch appended to it (kernel_us)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (cuBLAS's workspace, the extension's attribute)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps / launches)
    if kernels is not None:
        kernels.append(kernel_us(g.replay, launches, max(5, reps // 10)))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="33,48,64", help="comma list of row counts (1-64)")
    ap.add_argument("--splits", default="1,2,3,4", help="comma list of split counts (1-4)")
    ap.add_argument("--modes", default="0,1,2,3,4,5", help="comma list of modes (Args::mode): 0 the first weight "
                    "stages before the PDL wait, 1 and the slice prefetched into L2, 2 the whole slice into shared "
                    "memory, 3 and x's whole slice after the wait, 4 mode 3 with the trigger at the start, 5 mode 3 "
                    "on warpgroup MMAs")
    ap.add_argument("--reps", type=int, default=200, help="graph replays a timing")
    ap.add_argument("--projections", action="store_true",
                    help="also the 768-column projections with their residual (attention's and the MLP's c_proj) "
                    "against fused_attn.linear, which builds the library on its first call")
    ap.add_argument("--kernel-time", action="store_true",
                    help="beside each chain time, its kernels' own device time a launch (torch.profiler): the rest "
                    "of the chain's time a launch is the hand-off between launches")
    args = ap.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    splits = [int(v) for v in args.splits.split(",")]
    modes = [int(v) for v in args.modes.split(",")]
    runs = [(mode, s) for mode in modes for s in splits]  # (mode, split count); runnable() filters them by K
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs an sm_90 GPU")
        return 1
    mod = build()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).half()

    weights = {name: [(randn(n, k, scale=1 / math.sqrt(k)), randn(n, scale=0.1)) for _ in range(LAYERS)]
               for name, k, n, _ in SHAPES}
    print(f"{torch.cuda.get_device_name()}; us a launch in a CUDA graph of {LAYERS} layers' weights "
          f"(median of 5 x {args.reps} replays); ours launched with PDL")
    for m in rows:
        x = randn(m, 768)
        outs = {name: torch.empty(m, n, device=dev, dtype=torch.half) for name, _, n, _ in SHAPES}
        for name, k, n, act in SHAPES:
            w, b = weights[name][0]
            ref = reference(x, w, b, act)
            errs = []
            for mode, s in runs:
                outs[name].fill_(float("nan"))
                mod.gemm_rows(x, w, b, None, outs[name], act, s, True, mode)
                errs.append(f"mode {mode} {s}: {(outs[name].double() - ref).abs().max().item():.2e}")
            cublas(x, w, b, act, outs[name])
            errs.append(f"cuBLAS: {(outs[name].double() - ref).abs().max().item():.2e}")
            print(f"m {m} {name} max |error| against float64, by mode and splits: " + ", ".join(errs))

        def chain(run, shapes):
            def fn():
                for layer in range(LAYERS):
                    for name, _, _, act in shapes:
                        w, b = weights[name][layer]
                        run(w, b, act, outs[name])
            return fn

        cases = [(f"chain (c_attn + c_fc, {2 * LAYERS} launches)", SHAPES)]
        cases += [(f"{shape[0]} alone ({LAYERS} launches)", [shape]) for shape in SHAPES]
        for label, shapes in cases:
            launches = LAYERS * len(shapes)
            line = [f"m {m} {label}:"]
            kernels: list[float] = []  # --kernel-time: each timing's kernels alone, same order
            sink = kernels if args.kernel_time else None
            base = graph_us(chain(lambda w, b, act, out: cublas(x, w, b, act, out), shapes), launches, args.reps,
                            sink)
            line.append(f"cuBLAS {base:.2f}" + (f" [kernel {kernels[-1]:.2f}]" if sink is not None else ""))
            for mode, s in runs:
                t = graph_us(chain(lambda w, b, act, out, s=s, mode=mode: mod.gemm_rows(x, w, b, None, out, act, s,
                                                                                      True, mode), shapes),
                             launches, args.reps, sink)
                line.append(f"mode {mode} {s} splits {t:.2f} ({t / base:.3f})"
                            + (f" [kernel {kernels[-1]:.2f}]" if sink is not None else ""))
            print("  ".join(line))
        name, k, n, _ = LM_HEAD
        w = randn(n, k, scale=1 / math.sqrt(k))
        out = torch.empty(m, n, device=dev, dtype=torch.half)
        base = graph_us(lambda: cublas(x, w, None, 0, out), 1, max(20, args.reps // 10))
        line = [f"m {m} lm_head 768 x 50304 (one launch, 77 MB: {77.3e6 / 4.2e12 * 1e6:.1f} us at 4.2 TB/s): "
                f"cuBLAS {base:.2f}"]
        for mode in modes:
            out.fill_(float("nan"))
            mod.gemm_rows(x, w, None, None, out, 0, 1, True, mode)
            err = (out.double() - reference(x, w, None, 0)).abs().max().item()
            ours = graph_us(lambda: mod.gemm_rows(x, w, None, None, out, 0, 1, True, mode), 1,
                            max(20, args.reps // 10))
            line.append(f"mode {mode} 1 split {ours:.2f} ({ours / base:.3f}, max |error| {err:.2e})")
        print("  ".join(line))
        if args.projections:
            projections(mod, m, runs, args, randn, dev)
    return 0


def projections(mod, m: int, runs, args, randn, dev) -> None:
    """The 768-column projections with their residual in a graph of 12 layers' weights: fused_attn.linear (its
    split-K kernel at 33-64 rows) against the tile's modes at each split count the mode takes."""
    import fused_attn

    for name, k, n in PROJECTIONS:
        layers = [(randn(n, k, scale=1 / math.sqrt(k)), randn(n, scale=0.1)) for _ in range(LAYERS)]
        xk = randn(m, k)
        res = randn(m, n)
        out = torch.empty(m, n, device=dev, dtype=torch.half)
        ref = reference(xk, *layers[0], 0) + res.double()
        lib = fused_attn.linear(xk, *layers[0], residual=res)
        errs = [f"fused_attn.linear: {(lib.double() - ref).abs().max().item():.2e}"]
        todo = [(mode, s) for mode, s in runs if runnable(mode, s, k)]
        for mode, s in todo:
            out.fill_(float("nan"))
            mod.gemm_rows(xk, layers[0][0], layers[0][1], res, out, 0, s, True, mode)
            errs.append(f"mode {mode} {s}: {(out.double() - ref).abs().max().item():.2e}")
        print(f"m {m} {name} ({k} -> {n}, + residual) max |error| against float64: " + ", ".join(errs))
        kernels: list[float] = []
        sink = kernels if args.kernel_time else None

        def library():
            for w, b in layers:
                fused_attn.linear(xk, w, b, residual=res)

        base = graph_us(library, LAYERS, args.reps, sink)
        line = [f"m {m} {name} ({LAYERS} launches): fused_attn.linear {base:.2f}"
                + (f" [kernel {kernels[-1]:.2f}]" if sink is not None else "")]
        for mode, s in todo:
            def tile(mode=mode, s=s):
                for w, b in layers:
                    mod.gemm_rows(xk, w, b, res, out, 0, s, True, mode)

            t = graph_us(tile, LAYERS, args.reps, sink)
            line.append(f"mode {mode} {s} splits {t:.2f} ({t / base:.3f})"
                        + (f" [kernel {kernels[-1]:.2f}]" if sink is not None else ""))
        print("  ".join(line))


if __name__ == "__main__":
    raise SystemExit(main())
