// The SwiGLU product for linear's many-row path (linear.cpp, linear_cublas): cuBLAS writes
// y = x · [gate; up]ᵀ as [m, 2 n], and this pass reads both halves of each row once and writes
// silu(gate) * up, [m, n]. It replaces ATen's silu and mul (two passes, the second over a strided view
// that ATen's elementwise kernel does not vectorize: 277 us at Llama-2-7B's M = 4096 against a
// torch.compile'd fused pass's 85, docs/lab-notes/linear-mlp.md). Memory-bound: a 16-byte piece of gate
// and of up per thread, one 16-byte store; plain loads and stores (the whole pass is a stream).
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/math.cuh"
#include "../common/vec_dtypes.cuh"
#include "linear_launch.h"

namespace fused_attn {

namespace {

constexpr int kSwigluThreads = 256;

// VEC elements per thread: 16 / sizeof(T) where every row start is 16-byte aligned, else 1. A 2D grid:
// x over a row's pieces, y over the rows (a stride loop past 65535 rows); no 64-bit division.
template <typename T, int VEC>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(const T* __restrict__ y, int64_t y_stride,
                                                                T* __restrict__ out, int64_t o_stride, int64_t m,
                                                                int64_t n) {
  using P = Pack<VEC, T>;
  const int64_t j = (int64_t(blockIdx.x) * kSwigluThreads + threadIdx.x) * VEC;
  if (j >= n) return;
  for (int64_t row = blockIdx.y; row < m; row += gridDim.y) {
    const T* yr = y + row * y_stride + j;
    const P g = *reinterpret_cast<const P*>(yr);
    const P u = *reinterpret_cast<const P*>(yr + n);
    P o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(silu(to_float(g.v[e])) * to_float(u.v[e]));
    *reinterpret_cast<P*>(out + row * o_stride + j) = o;
  }
}

template <typename T, int VEC>
void launch(const T* y, int64_t y_stride, T* out, int64_t o_stride, int64_t m, int64_t n, cudaStream_t stream) {
  constexpr int64_t kMaxGridY = 65535;
  const dim3 grid(unsigned((n / VEC + kSwigluThreads - 1) / kSwigluThreads), unsigned(m < kMaxGridY ? m : kMaxGridY));
  swiglu_kernel<T, VEC><<<grid, kSwigluThreads, 0, stream>>>(y, y_stride, out, o_stride, m, n);
}

}  // namespace

template <typename T>
void launch_swiglu(const void* y_, int64_t y_stride, void* out_, int64_t o_stride, int64_t m, int64_t n,
                   cudaStream_t stream) {
  if (m <= 0 || n <= 0) return;
  const T* y = static_cast<const T*>(y_);
  T* out = static_cast<T*>(out_);
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int64_t kBytes = 16;
  // 16-byte pieces: the gate half, the up half (n elements further) and every output row all start
  // on 16-byte boundaries.
  const bool vec = n % VEC == 0 && y_stride % VEC == 0 && o_stride % VEC == 0 &&
                   reinterpret_cast<uintptr_t>(y) % kBytes == 0 && reinterpret_cast<uintptr_t>(out) % kBytes == 0;
  if (vec)
    launch<T, VEC>(y, y_stride, out, o_stride, m, n, stream);
  else
    launch<T, 1>(y, y_stride, out, o_stride, m, n, stream);
}

template void launch_swiglu<float>(const void*, int64_t, void*, int64_t, int64_t, int64_t, cudaStream_t);
template void launch_swiglu<__half>(const void*, int64_t, void*, int64_t, int64_t, int64_t, cudaStream_t);
template void launch_swiglu<__nv_bfloat16>(const void*, int64_t, void*, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace fused_attn
