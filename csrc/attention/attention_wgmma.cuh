// attention_flash_wgmma_kernel: mode "flash" on Hopper (sm_90a builds, float16 / bfloat16, padded
// head dim 64 or 128): the same FlashAttention-2 forward as attention_flash_kernel
// (attention_kernel.cuh: same semantics, masks, GQA, lse, strided views) with its two GEMMs on
// the warpgroup MMA (wgmma), which mma.sync cannot reach on Hopper (FlashAttention-3's first step).
//
// One block = 2 warpgroups x 64 query rows (BR 128); keys in tiles of BC 128. Q, and the K / V
// tiles in a cp.async ring of STAGES, sit in shared memory in the 128-byte-swizzled panel layout
// wgmma reads through descriptors (csrc/common/wgmma.cuh). Per key tile and warpgroup:
// S (64 x 128) = Q·Kᵀ as HD / 16 wgmma m64n128k16 from shared memory (both K-major); the
// online softmax on S's accumulator registers (the helpers the mma.sync kernel uses: per warp,
// the accumulator of a wgmma m64nN is its 16 rows' m16n8 fragments); P rounded to T in registers
// is the A operand of O (64 x HD) += P·V, BC / 16 wgmma m64nHDk16 with V read MN-major (V is
// [keys][HD], the transpose bit). Each wgmma group is waited for before its result is used
// (no overlap of softmax and MMA inside a warpgroup; the two warpgroups of a block, and the
// scheduler, overlap each other's). Under causal, key tiles past a block's last visible key are
// never loaded and a warpgroup skips the tiles past its own last visible key.
//
// Traffic as attention_flash_kernel: Q and O once, K and V once per 128-row query tile (from L2
// after the first), so the kernel is tensor-core bound at seqlen >= ~512; the target is 4 · Sq ·
// Sk · D FLOPs (half under causal) at >= 0.8x cuDNN (~420 TFLOP/s on an H100 at D 128).
//
// Tests: tests/test_attention.py (mode "flash_wgmma" pins this kernel, "flash_mma" the other);
// quick check and timing: bench/check_flash_wgmma.py; benchmark: bench/bench_attention.py.
#pragma once

#include "../common/wgmma.cuh"
#include "attention_kernel.cuh"

namespace fused_attn {

template <typename T, int HD>
struct FlashWgmmaConfig {
  static_assert(HD == 64 || HD == 128, "the wgmma kernel is built for head dims 64 and 128");
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int BR = 64 * kWarpgroups;
  static constexpr int BC = 128;
  static constexpr int CH = HD / 8;  // 16-byte chunks per row
  // Q 32 KB + 2 stages x 64 KB at HD 128 (160 KB); Q 16 KB + 3 stages x 32 KB at HD 64.
  static constexpr int STAGES = HD == 64 ? 3 : 2;
  // +1024: the tiles start at the first 1024-byte boundary of the dynamic shared memory (the
  // 128-byte swizzle is computed from address bits 4-9).
  static constexpr int kSmemBytes = (BR * HD + STAGES * 2 * BC * HD) * int(sizeof(T)) + 1024;
};

template <typename T, int HD>
__global__ void __launch_bounds__(FlashWgmmaConfig<T, HD>::kThreads, 1)
    attention_flash_wgmma_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = FlashWgmmaConfig<T, HD>;
  constexpr int BR = C::BR, BC = C::BC, CH = C::CH, STAGES = C::STAGES, NT = C::kThreads;
  constexpr int kVec = 8;  // elements per 16-byte chunk
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  T* const sq = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // [BR][HD], SW128 panels
  T* const pipe = sq + BR * HD;  // [stage][K, V][BC][HD], SW128 panels

  // The last query tiles have the most keys under causal: they start first.
  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hkv = h / p.group;
  const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int i0 = m_block * BR;
  const int diag = p.seqlen_k - p.seqlen_q;  // key j is visible to query i iff j <= i + diag (causal)
  int n_end = p.seqlen_k;
  if (p.causal) n_end = min(n_end, min(i0 + BR, p.seqlen_q) + diag);
  const int n_tiles = n_end > 0 ? (n_end + BC - 1) / BC : 0;
  const int row_wg = i0 + wg * 64;         // this warpgroup's first query row
  const int row_w = row_wg + warp * 16;    // this warp's
  // Keys of this warpgroup's rows: under causal, the tiles from wg_end on are invisible to all of them.
  const int wg_end = p.causal ? min(p.seqlen_k, min(row_wg + 64, p.seqlen_q) + diag) : p.seqlen_k;

  const T* qg = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h;
  const T* kg = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vg = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;

  // Rows past seqlen_q or seqlen_k and columns past headdim land as zeros (cp.async reads nothing).
  static_assert((BR * CH) % NT == 0 && (BC * CH) % NT == 0, "whole copy rounds per thread");
#pragma unroll
  for (int n = 0; n < BR * CH / NT; ++n) {
    const int i = threadIdx.x + n * NT, r = i / CH, c = i % CH, row = i0 + r;
    const bool on = row < p.seqlen_q && c * kVec < p.headdim;
    cp_async16(reinterpret_cast<uint4*>(sq + sw128_offset<BR>(r, c)),
               on ? qg + int64_t(row) * p.q_stride_s + c * kVec : qg, on);
  }
  auto issue = [&](int t) {
    T* ks = pipe + (t % STAGES) * 2 * BC * HD;
    T* vs = ks + BC * HD;
#pragma unroll
    for (int n = 0; n < BC * CH / NT; ++n) {
      const int i = threadIdx.x + n * NT, r = i / CH, c = i % CH, j = t * BC + r;
      const bool on = j < p.seqlen_k && c * kVec < p.headdim;
      cp_async16(reinterpret_cast<uint4*>(ks + sw128_offset<BC>(r, c)),
                 on ? kg + int64_t(j) * p.k_stride_s + c * kVec : kg, on);
      cp_async16(reinterpret_cast<uint4*>(vs + sw128_offset<BC>(r, c)),
                 on ? vg + int64_t(j) * p.v_stride_s + c * kVec : vg, on);
    }
  };
  if (n_tiles > 0) issue(0);
  cp_async_commit();  // group 0: Q and the first K/V tile
#pragma unroll
  for (int t = 1; t < STAGES - 1; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();
  }

  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};  // rows g and g + 8; l summed per lane
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float s[BC / 8][4];
  // wgmma takes the accumulators as one flat array: m16n8 fragment n is elements 4n .. 4n + 3.
  float(&s_flat)[BC / 2] = reinterpret_cast<float(&)[BC / 2]>(s);
  float(&o_flat)[HD / 2] = reinterpret_cast<float(&)[HD / 2]>(o);
  const FlashMask<T> mask(p, b, h);
  // Q: this warpgroup's 64 rows; K-major, a K step of 16 is +32 bytes, a panel of 64 is BR rows.
  const uint32_t q_base = smem_addr(sq) + wg * 64 * 128;

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<STAGES - 2>();
    fence_proxy_async_shared();  // this thread's cp.async writes, visible to the tensor cores
    __syncthreads();  // tile t (and Q) landed for every thread; the stage tile t - 1 used is free
    if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1);
    cp_async_commit();
    const int j0 = t * BC;
    if (j0 >= wg_end) continue;  // warpgroup-uniform: every key of the tile is hidden from its rows
    const uint32_t k_base = smem_addr(pipe + (t % STAGES) * 2 * BC * HD);
    const uint32_t v_base = k_base + BC * HD * int(sizeof(T));

    // S = Q·Kᵀ: 64 rows x BC keys, HD / 16 steps of K = 16.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t koff = (kk % 4) * 32;  // bytes inside the panel's 128-byte rows
      const uint64_t da = sw128_desc(q_base + (kk / 4) * (BR * 128) + koff, 16);
      const uint64_t db = sw128_desc(k_base + (kk / 4) * (BC * 128) + koff, 16);
      Wgmma<T, BC>::ss(s_flat, da, db, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s_flat);

    const bool edge = j0 + BC > p.seqlen_k || (p.causal && j0 + BC - 1 > row_w + diag);
    flash_scale_mask<T>(s, p, mask, row_w + g, j0 + 2 * t4, edge);
    wgmma_fence_operands(o_flat);
    flash_online_softmax(s, o, m, l);

    // O += P·V: P from registers (keys 16 kb .. +15 per step), V MN-major: 16 key rows = 2048
    // bytes, the HD / 64 panels BC rows apart (the LBO).
    uint32_t pa[BC / 16][4];
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) flash_p_fragment<T>(pa[kb], s, kb);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) {
      Wgmma<T, HD>::rs(o_flat, pa[kb], sw128_desc(v_base + kb * 16 * 128, BC * 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o_flat);
  }
  cp_async_wait<0>();

  flash_store<T>(p, o, m, l, b, h, row_w + g, t4);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the launcher never selects this kernel (attention_flash_wgmma_arch)
#endif
}

template <typename T, int HD>
void launch_attention_flash_wgmma(const AttentionParams& p, cudaStream_t stream) {
  using C = FlashWgmmaConfig<T, HD>;
  cudaFuncSetAttribute(attention_flash_wgmma_kernel<T, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       C::kSmemBytes);
  const dim3 grid(unsigned((p.seqlen_q + C::BR - 1) / C::BR), unsigned(p.nheads_q), unsigned(p.batch));
  attention_flash_wgmma_kernel<T, HD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
}

// 90 when the library was built for sm_90a only among the 9.x targets (FUSED_ATTN_SM90A, set by
// fused_attn/build.py) and the current device runs that build's kernel; else 0.
template <typename T, int HD>
int attention_flash_wgmma_arch() {
#if defined(FUSED_ATTN_SM90A)
  cudaFuncAttributes attr{};
  const bool ok = cudaFuncGetAttributes(&attr, attention_flash_wgmma_kernel<T, HD>) == cudaSuccess;
  return ok && attr.binaryVersion == 90 ? 90 : 0;
#else
  return 0;
#endif
}

}  // namespace fused_attn
