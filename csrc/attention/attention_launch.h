// What the launcher (attention.cpp, host C++ with ATen) and the kernels (attention_kernel.cuh,
// built in the generated attention_inst_*.cu units) share: the parameter structs and the launch
// functions. Torch-free and host-compilable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

// The flash kernel's arguments. Strides are in elements; q, k, v, out have a contiguous last dim.
struct AttentionParams {
  const void* q;  // [batch, nheads_q, seqlen_q, headdim]
  const void* k;  // [batch, nheads_kv, seqlen_k, headdim]
  const void* v;
  void* out;      // [batch, nheads_q, seqlen_q, headdim]
  float* lse;     // [batch, nheads_q, seqlen_q] contiguous, natural log; nullptr: not written
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t o_stride_b, o_stride_h, o_stride_s;
  // attn_mask read through its strides as broadcast to [batch, nheads_q, seqlen_q, seqlen_k]
  // (stride 0 along a broadcast dim); bool (True = attend) or additive in the inputs' dtype.
  const void* mask;  // nullptr: no mask
  bool mask_is_bool;
  int64_t m_stride_b, m_stride_h, m_stride_q, m_stride_k;
  int batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, headdim;
  int group;  // nheads_q / nheads_kv: query head h reads kv head h / group
  bool causal;  // key j visible to query i iff j <= i + seqlen_k - seqlen_q
  // The wgmma kernel's block order (attention_wgmma.cuh's flash_wgmma_block): query tiles longest-first
  // across every (head, batch); set under causal only (attention_heuristics.h's flash_longest_first),
  // cleared by the launch past 65535 query tiles (the grid's z). false: the natural order, the mma.sync
  // kernel's.
  bool longest_first;
  float scale;       // the score multiplier (natural domain: the additive mask is added after it)
  float scale_log2;  // scale * log2(e): scores without a mask live in the log2 domain
};

// One strided batched GEMM of the naive mode: for z = b * nheads + h,
//   C[z][i][j] = sum_k A[z][i][k] * B[z'][k][j],  z' = b * nheads_b + h / group
// with every operand addressed through (batch, head, row, column) strides (so Bᵀ is a stride
// swap), float32 accumulation.
struct GemmParams {
  const void* a;
  const void* b;
  void* c;
  int64_t a_stride_b, a_stride_h, a_stride_r, a_stride_c;
  int64_t b_stride_b, b_stride_h, b_stride_r, b_stride_c;
  int64_t c_stride_b, c_stride_h, c_stride_r, c_stride_c;
  int batch, nheads, group, m, n, k;
};

// Defined in attention_kernel.cuh, instantiated in attention_inst_*.cu (generate_instantiations.py).
// HD: padded head dim (32, 64, 128, 256): a kernel serves every headdim <= HD that is a multiple of 8.
template <typename T, int HD>
void launch_attention_flash(const AttentionParams& p, cudaStream_t stream);
// The SM version launch_attention_flash<T, HD>'s kernel was compiled for (0 if none: it needs sm_80).
template <typename T, int HD>
int attention_flash_arch();
// The Hopper version (attention_wgmma.cuh, instantiated at HD 64 with kTile 1 and 2 and at HD 128 with
// kTile 0): the same semantics on wgmma; runs only where attention_flash_wgmma_arch<T, HD>() is 90 (an
// sm_90a build on an sm_90 device), else 0. kTile: the block's query and key tile and blocks per SM
// (attention_wgmma.cuh's FlashWgmmaConfig); the tile, the block order and the loader are chosen by
// attention_heuristics.h.
template <typename T, int HD, int kTile>
void launch_attention_flash_wgmma(const AttentionParams& p, cudaStream_t stream);
template <typename T, int HD>
int attention_flash_wgmma_arch();
// tiled false: the naive mode's 16 x 16 tile GEMM; true: the tiled mode's register-blocked one.
template <typename TA, typename TB, typename TC>
void launch_attention_gemm(const GemmParams& p, bool tiled, cudaStream_t stream);

}  // namespace fused_attn
