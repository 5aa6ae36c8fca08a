// mlp_sliced_kernel: GPT-2's feed-forward block for 1 to 16 rows of x in one launch without a grid-wide
// wait, by slicing the hidden dimension:
//     h = gelu_tanh(x · W_fcᵀ + b_fc)        y = h · W_projᵀ + b_proj + residual
// in float16 / bfloat16 on tensor cores (mma.sync m16n8k16), float32 accumulation, h rounded once to T
// (as the two-launch chain stores it), y rounded once to T.
//
// Block g owns hidden columns [32 g, 32 g + 32): the 32 rows of W_fc and the 32 columns of W_proj that
// touch them (2 x 32 x d x sizeof(T) bytes: 96 KB for GPT-2 small). It copies both slices into shared
// memory (cp.async) before wait_for_primary(), so the whole weight stream of the MLP is requested while
// the previous kernels still run; after the wait it stages x, computes its 16 x 32 tile of h (the K of
// W_fc split over the 8 warps, summed in a fixed order), and multiplies it by its W_proj slice into a
// 16 x d_out partial of y. h never leaves the block: nothing waits for another block's h, which is
// what the two launches (a PDL hop) and mlp_kernel (a grid-wide counter) pay for.
//
// The partials are summed in two levels. A cluster of kMlpSlicedCluster blocks (adjacent slices) adds its
// members' partials through distributed shared memory, rank r taking columns [r d_out / C, (r + 1)
// d_out / C) in rank order; then each rank adds its strip into a float32 accumulator in global memory
// (red.global.add.v4.f32), counts itself on its strip's counter, and the block that brings the count
// to the number of clusters finishes the strip: bias, residual, one rounding, the store, and the
// accumulator and counter set back to zero for the next launch. The order of the cross-cluster float32
// additions depends on timing: y can differ in its last bit from run to run (h and each cluster's sum
// do not).
//
// Shapes: d (in_features) a multiple of 64, hidden a multiple of 32 x kMlpSlicedCluster, d_out a multiple
// of 128, shared memory permitting (the launcher asks); one block per SM (~165 KB for GPT-2 small).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/cluster.cuh"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/vec_dtypes.cuh"
#include "mlp_launch.h"

namespace fused_attn {

namespace mlp {

constexpr int kSlicedWarps = kMlpSlicedThreads / 32;
constexpr int kSlicedTiles = 12;  // n-tiles of 8 output columns a warp holds at once in the second product

// Shared memory layout (bytes from the dynamic base), for d in_features and n out columns.
struct SlicedSmem {
  int wfc, wproj, xs, red, hs, ps, total;
  __host__ __device__ SlicedSmem(int d, int n) {
    wfc = 0;                                          // [32][d] T, 16-byte chunks XOR-swizzled by row % 8
    wproj = wfc + kMlpSlice * d * 2;                  // [n][32] T, swizzled by (row / 2) % 4
    xs = wproj + n * kMlpSlice * 2;                   // [16][d] T (rows >= m zero), swizzled by row % 8
    red = xs + 16 * d * 2;                            // [warps][16][32] float: the K split's partial h
    hs = red + kSlicedWarps * 16 * kMlpSlice * 4;     // [16][32] T, swizzled by (row / 2) % 4
    ps = xs;                                          // [16][n + 8] float: this block's partial y, over
                                                      // xs and red (both read before it is written)
    const int ps_end = ps + 16 * (n + 8) * 4;
    if (ps_end > hs) hs = ps_end;                     // h is read while the partial is written
    total = hs + 16 * kMlpSlice * 2;
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Element offset of 16-byte chunk c of row r in a [rows][len] tile of 16-bit elements whose rows are a
// multiple of 128 bytes: the chunk index XORed with r % 8, so that the 8 rows one ldmatrix phase reads
// at one logical chunk sit in 8 different bank groups.
__device__ __forceinline__ int swz_row8(int r, int c, int len) { return r * len + ((c ^ (r & 7)) << 3); }

__device__ __forceinline__ void red_add_f32x4(float* ptr, float4 v) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ float4 load_cluster_f32x4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
#endif

template <typename T>
__global__ void __launch_bounds__(kMlpSlicedThreads, 1) mlp_sliced_kernel(const MlpSlicedParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  const SlicedSmem L(p.d, p.n);
  T* wfc = reinterpret_cast<T*>(smem + L.wfc);
  T* wproj = reinterpret_cast<T*>(smem + L.wproj);
  T* xs = reinterpret_cast<T*>(smem + L.xs);
  float* red = reinterpret_cast<float*>(smem + L.red);
  T* hs = reinterpret_cast<T*>(smem + L.hs);
  float* ps = reinterpret_cast<float*>(smem + L.ps);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int d = p.d, n = p.n, ps_pitch = n + 8;
  const int64_t h0 = int64_t(blockIdx.x) * kMlpSlice;  // this block's first hidden column

  // 1. Both weight slices on their way before the wait (they are constants of the step).
  const T* w_fc = static_cast<const T*>(p.w_fc);
  const T* w_proj = static_cast<const T*>(p.w_proj);
  const int dc = d / 8;  // 16-byte chunks in a row of x / W_fc
  for (int i = tid; i < kMlpSlice * dc; i += kMlpSlicedThreads) {
    const int r = i / dc, c = i % dc;
    cp_async16(reinterpret_cast<uint4*>(wfc + swz_row8(r, c, d)), w_fc + (h0 + r) * p.fc_stride + c * 8, true);
  }
  for (int i = tid; i < n * 4; i += kMlpSlicedThreads) {
    const int r = i / 4, c = i % 4;
    cp_async16(reinterpret_cast<uint4*>(wproj + swizzled<kMlpSlice>(r, c)), w_proj + r * p.proj_stride + h0 + c * 8,
               true);
  }
  cp_async_commit();
  float bfc = 0.f;  // b_fc of column (tid % 32) of the slice, for the epilogue of h
  if (p.b_fc != nullptr) bfc = to_float(static_cast<const T*>(p.b_fc)[h0 + tid % kMlpSlice]);
  launch_dependents_early(p.pdl_early);
  wait_for_primary();  // x and the residual are earlier kernels' outputs

  // 2. x's rows (zeros past m), then everything in shared memory.
  const T* x = static_cast<const T*>(p.x);
  for (int i = tid; i < 16 * dc; i += kMlpSlicedThreads) {
    const int r = i / dc, c = i % dc;
    cp_async16(reinterpret_cast<uint4*>(xs + swz_row8(r, c, d)), x + (r < p.m ? r : 0) * p.x_stride + c * 8,
               r < p.m);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // 3. h = x · W_fc_sliceᵀ: warp w takes k-steps w, w + 8, ...; 4 n-tiles of 8 hidden columns.
  {
    float acc[4][4] = {};
    for (int ks = warp; ks < d / 16; ks += kSlicedWarps) {
      uint32_t a[4];
      ldmatrix_x4(a, smem_addr(xs + swz_row8(lane % 16, ks * 2 + lane / 16, d)));
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        uint32_t b[4];  // n-tiles j, j + 1: (b0, b1) each
        const int mi = lane / 8;
        ldmatrix_x4(b, smem_addr(wfc + swz_row8((j + mi / 2) * 8 + lane % 8, ks * 2 + mi % 2, d)));
        mma16816<T>(acc[j], a, b[0], b[1]);
        mma16816<T>(acc[j + 1], a, b[2], b[3]);
      }
    }
    // The warps' partial sums to shared memory ([warp][row][col]), then added in warp order.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float* w0 = red + (warp * 16 + g) * kMlpSlice + j * 8 + 2 * t;
      w0[0] = acc[j][0];
      w0[1] = acc[j][1];
      w0[8 * kMlpSlice] = acc[j][2];
      w0[8 * kMlpSlice + 1] = acc[j][3];
    }
  }
  __syncthreads();
  for (int i = tid; i < 16 * kMlpSlice; i += kMlpSlicedThreads) {  // column i % 32: the thread's bfc
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kSlicedWarps; ++w) s += red[w * 16 * kMlpSlice + i];
    const int r = i / kMlpSlice, c = i % kMlpSlice;
    hs[swizzled<kMlpSlice>(r, c / 8) + c % 8] = from_float<T>(gelu_tanh(s + bfc));
  }
  __syncthreads();

  // 4. This block's partial y = h · W_proj_sliceᵀ into ps: warp w takes n-tiles [w tw, (w + 1) tw),
  //    kSlicedTiles at a time (2 k-steps: the slice's 32 hidden columns).
  uint32_t a[2][4];
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) ldmatrix_x4(a[ks], smem_addr(hs + swizzled<kMlpSlice>(lane % 16, ks * 2 + lane / 16)));
  const int tw = n / 8 / kSlicedWarps;
  for (int base = 0; base < tw; base += kSlicedTiles) {
    float acc[kSlicedTiles][4] = {};
#pragma unroll
    for (int j = 0; j < kSlicedTiles; j += 2) {
      if (base + j < tw) {
        const int tile = warp * tw + base + j, mi = lane / 8;
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          uint32_t b[4];
          ldmatrix_x4(b, smem_addr(wproj + swizzled<kMlpSlice>((tile + mi / 2) * 8 + lane % 8, ks * 2 + mi % 2)));
          mma16816<T>(acc[j], a[ks], b[0], b[1]);
          mma16816<T>(acc[j + 1], a[ks], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kSlicedTiles; ++j) {
      if (base + j < tw) {
        const int col = (warp * tw + base + j) * 8 + 2 * t;
        *reinterpret_cast<float2*>(ps + g * ps_pitch + col) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(ps + (g + 8) * ps_pitch + col) = make_float2(acc[j][2], acc[j][3]);
      }
    }
  }
  cluster_arrive_release();
  cluster_wait();  // every block of the cluster has its partial in shared memory

  // 5. Rank r adds the cluster's partials of its strip in rank order, then into the accumulator.
  const int rank = int(blockIdx.x % kMlpSlicedCluster), strip = n / kMlpSlicedCluster, s4 = strip / 4;
  for (int i = tid; i < p.m * s4; i += kMlpSlicedThreads) {
    const int r = i / s4, col = rank * strip + (i % s4) * 4;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int q = 0; q < kMlpSlicedCluster; ++q) {
      const float4 v = load_cluster_f32x4(cluster_addr(ps + r * ps_pitch + col, q));
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    red_add_f32x4(p.acc + r * n + col, s);
  }
  cluster_arrive_relaxed();  // this block's remote reads are done (the matching wait is at the end)
  __threadfence();           // this thread's additions before the block's count
  __syncthreads();
  __shared__ bool last;
  if (tid == 0) {
    const unsigned clusters = gridDim.x / kMlpSlicedCluster;
    last = atomicAdd(p.counters + rank, 1u) == clusters - 1;
  }
  __syncthreads();
  if (last) {  // 6. every cluster's strip is in the accumulator: finish it
    __threadfence();
    const T* b_proj = static_cast<const T*>(p.b_proj);
    const T* residual = static_cast<const T*>(p.residual);
    T* out = static_cast<T*>(p.out);
    for (int i = tid; i < p.m * s4; i += kMlpSlicedThreads) {
      const int r = i / s4, col = rank * strip + (i % s4) * 4;
      float* accp = p.acc + r * n + col;
      const float4 s = __ldcg(reinterpret_cast<const float4*>(accp));
      float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float y = v[e];
        if (b_proj != nullptr) y += to_float(b_proj[col + e]);
        if (residual != nullptr) y = __fadd_rn(y, to_float(residual[r * p.r_stride + col + e]));
        out[r * p.o_stride + col + e] = from_float<T>(y);
      }
      __stcg(reinterpret_cast<float4*>(accp), make_float4(0.f, 0.f, 0.f, 0.f));
    }
    if (tid == 0) atomicExch(p.counters + rank, 0u);
  }
  launch_dependents();
  cluster_wait();  // no block leaves while another may still read its partial
#else
  __trap();  // launched only where the launcher found it compiled for sm_90
#endif
}

}  // namespace mlp

template <typename T>
cudaError_t launch_mlp_sliced(const MlpSlicedParams& params, cudaStream_t stream) {
  MlpSlicedParams p = params;
  p.pdl_early = pdl_early(p.m);
  const int smem = mlp::SlicedSmem(p.d, p.n).total;
  const auto kernel = mlp::mlp_sliced_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  return launch_clustered(true, dim3(kMlpSlicedCluster, 1, 1), kernel, dim3(unsigned(p.hidden / kMlpSlice)),
                          dim3(kMlpSlicedThreads), size_t(smem), stream, p);
}

template <typename T>
int mlp_sliced_smem(int d, int n) {
  const auto kernel = mlp::mlp_sliced_kernel<T>;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.binaryVersion < 90) return -1;
  return mlp::SlicedSmem(d, n).total;
}

}  // namespace fused_attn
