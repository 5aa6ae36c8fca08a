// What qkv_decode_attention's launcher (qkv_decode_attention.cpp, host C++ with ATen) and its kernel
// (qkv_decode_attention_kernel.cuh, built in qkv_decode_attention_inst.cu) share. Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

constexpr int kQkvHeadDim = 64;        // the kernel's head dimension
constexpr int kQkvClusterBlocks = 8;   // blocks a (head, group of sequences): the head's 192 columns, 24 a block
constexpr int kQkvThreads = 256;
constexpr int kQkvMaxPieces = 4;       // d / 256 at most (16-byte pieces of x a lane holds)

// x: [batch, d] rows (x_stride elements apart); w_qkv: [3 d, d] (w_stride); b_qkv: [3 d] or nullptr;
// caches: [batch, heads, max_len, 64] with the strides given (last dim contiguous); lengths int32 [batch]
// (cache_leftpad may be nullptr); out: [batch, d] rows (o_stride).
struct QkvParams {
  const void* x;
  int64_t x_stride;
  const void* w_qkv;
  int64_t w_stride;
  const void* b_qkv;
  void* k_cache;
  void* v_cache;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  const int* cache_seqlens;
  const int* cache_leftpad;
  void* out;
  int64_t o_stride;
  int batch, heads, d, max_len;
  float eps, scale;
  bool pdl_early;
};

// Defined in qkv_decode_attention_kernel.cuh, instantiated for __half and __nv_bfloat16.
template <typename T>
cudaError_t launch_qkv_decode_attention(const QkvParams& p, cudaStream_t stream);
template <typename T>
bool qkv_decode_attention_compiled();

}  // namespace fused_attn
