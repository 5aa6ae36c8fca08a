// Element types and 16-byte vector packs shared by every kernel (torch-free).
// to_float / from_float convert float32 / float16 / bfloat16 to and from the float32 the
// kernels compute in; Pack<N, T> is N elements loaded or stored as one aligned access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fused_attn {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <int N, typename T>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

}  // namespace fused_attn
