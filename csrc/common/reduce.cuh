// Reductions over the threads that own one row (torch-free): a shuffle / shared-memory
// reduction for any associative operator, and the online-softmax merge of (max, sum) pairs
// that split-row and split-KV kernels combine partial results with.
#pragma once

#include "math.cuh"

namespace fused_attn {

// Reductions over the TPR threads that own one row. TPR <= 32: xor-shuffles
// inside the lane group (every lane of the warp executes them, so the full mask
// is valid). TPR > 32: one row per block, warp partials through shared memory.
// `op` is associative and commutative (max_nan, +).
template <int TPR, typename Op>
__device__ __forceinline__ float group_reduce(float v, float* smem, Op op) {
  constexpr int W = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int o = W / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) smem[warp] = v;
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < TPR / 32; ++w) v = op(v, smem[w]);
  }
  return v;
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return max_nan(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Online-softmax merge of two partial (max m, sum l of exp(s - m)) pairs:
// l = l_a * e^(m_a - m) + l_b * e^(m_b - m) with m = max(m_a, m_b).
__device__ __forceinline__ void merge_online(float& m, float& l, float m_o, float l_o) {
  const float mn = max_nan(m, m_o);
  l = l * exp_shifted(m, mn) + l_o * exp_shifted(m_o, mn);
  m = mn;
}

// Merges every thread's (m, l) over the TPR threads of a row (see group_reduce
// for the shuffle / shared-memory split); all of them end with the row's pair.
template <int TPR>
__device__ __forceinline__ void group_merge(float& m, float& l, float* smem_m, float* smem_l) {
  constexpr int W = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int o = W / 2; o > 0; o /= 2) {
    merge_online(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
  }
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
      smem_m[warp] = m;
      smem_l[warp] = l;
    }
    __syncthreads();
    m = smem_m[0];
    l = smem_l[0];
#pragma unroll
    for (int w = 1; w < TPR / 32; ++w) merge_online(m, l, smem_m[w], smem_l[w]);
  }
}

}  // namespace fused_attn
