// What the launcher (softmax.cpp, host C++ with ATen) and the kernels (softmax_kernel.cuh, built
// in the generated softmax_inst_*.cu units) share: the parameter structs and the launch functions.
// Torch-free and host-compilable, so the ATen-heavy launcher does not go through nvcc: an edit to
// it rebuilds one g++ unit, an edit to a kernel the nvcc units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/fastdiv.cuh"

namespace fused_attn {

enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskAdditive = 2 };

struct SoftmaxParams {
  const void* x;  // [rows, seqlen_k], contiguous
  void* out;      // [rows, seqlen_k], contiguous
  int64_t rows;
  int seqlen_q;
  int seqlen_k;
  FastDiv div_q;      // by seqlen_q
  FastDiv div_lead1;  // by mask_lead1
  float scale;
  bool causal;
  // attn_mask as a strided view over [lead0, lead1, seqlen_q, seqlen_k]
  // (lead0 * lead1 = L); broadcast dims have stride 0.
  const void* mask;
  int mask_kind;
  int64_t mask_lead1;
  int64_t mask_stride_lead0;
  int64_t mask_stride_lead1;
  int64_t mask_stride_q;
  int64_t mask_stride_k;
  float* workspace;  // v0 only: [rows, seqlen_k] float32
};

struct SoftmaxBackwardParams {
  const void* grad;  // dy [rows, seqlen_k], contiguous
  const void* y;     // the forward's output [rows, seqlen_k], contiguous
  void* dx;          // [rows, seqlen_k], contiguous
  int64_t rows;
  int seqlen_q;
  int seqlen_k;
  FastDiv div_q;  // by seqlen_q
  float scale;
  bool causal;
};

// Defined in softmax_kernel.cuh, instantiated in softmax_inst_*.cu (generate_instantiations.py; VEC: 16 / sizeof(T)
// for 16-byte vector loads, or 1 for the scalar path).
template <typename T>
void launch_v0(const SoftmaxParams& p, cudaStream_t stream);
template <typename T, int VEC>
void launch_v1(const SoftmaxParams& p, cudaStream_t stream);
template <typename T, int VEC>
void launch_backward(const SoftmaxBackwardParams& p, cudaStream_t stream);

}  // namespace fused_attn
