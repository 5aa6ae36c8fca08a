// attention_flash_wgmma_kernel: mode "flash" on Hopper (sm_90a builds, float16 / bfloat16, padded
// head dim 64 or 128): the same FlashAttention-2 forward as attention_flash_kernel
// (attention_kernel.cuh: same semantics, masks, GQA, lse, strided views) with its two GEMMs on
// the warpgroup MMA (wgmma), which mma.sync cannot reach on Hopper (FlashAttention-3's first step).
//
// One block = 2 warpgroups x 64 query rows (BR 128); keys in tiles of BC 128. Q, and two K and two
// V tiles filled by cp.async, sit in shared memory in the 128-byte-swizzled panel layout wgmma
// reads through descriptors (csrc/common/wgmma.cuh). Per key tile t and warpgroup: S_t (64 x 128)
// = Q·K_tᵀ as HD / 16 wgmma m64n128k16 from shared memory (both K-major), and behind it on the
// tensor cores the previous tile's O += P_{t-1}·V_{t-1} (BC / 16 wgmma m64nHDk16, P from
// registers as the A operand, V [keys][HD] read MN-major: the transpose bit); the online softmax
// of S_t (the helpers the mma.sync kernel uses: per warp, a wgmma m64nN accumulator is its 16
// rows' m16n8 fragments) runs while that P·V does, and O is rescaled once it is done
// (FlashAttention-3's intra-warpgroup overlap of softmax and MMA; not its producer warp, TMA or
// warpgroup ping-pong: one barrier per tile keeps both warpgroups in step). V_t is loaded one tile
// later than K_t, so each tile's copies have one tile of compute to land. Under causal, key tiles
// past a block's last visible key are never loaded and a warpgroup skips the tiles past its own.
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
  // Q, then two K tiles and two V tiles (HD 128: 32 + 64 + 64 KB). +1024: the tiles start at the
  // first 1024-byte boundary of the dynamic shared memory (the 128-byte swizzle is computed from
  // address bits 4-9).
  static constexpr int kSmemBytes = (BR * HD + 4 * BC * HD) * int(sizeof(T)) + 1024;
};

template <typename T, int HD>
__global__ void __launch_bounds__(FlashWgmmaConfig<T, HD>::kThreads, 1)
    attention_flash_wgmma_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = FlashWgmmaConfig<T, HD>;
  constexpr int BR = C::BR, BC = C::BC, NT = C::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  T* const sq = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // [BR][HD], SW128 panels
  T* const sk = sq + BR * HD;      // [2][BC][HD]: K of tile t in sk[t % 2]
  T* const sv = sk + 2 * BC * HD;  // [2][BC][HD]: V of tile t in sv[t % 2]

  const FlashBlock<T> blk(p, BR, BC);
  const int h = blk.h, b = blk.b, i0 = blk.i0, n_tiles = blk.n_tiles;
  const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int diag = p.seqlen_k - p.seqlen_q;  // key j is visible to query i iff j <= i + diag (causal)
  const int row_wg = i0 + wg * 64;       // this warpgroup's first query row
  const int row_w = row_wg + warp * 16;  // this warp's
  // Under causal, the key tiles from wg_end on are hidden from every row of this warpgroup.
  const int wg_end = p.causal ? min(p.seqlen_k, min(row_wg + 64, p.seqlen_q) + diag) : p.seqlen_k;

  flash_load_rows<BR, HD, NT>(sq, [](int r, int c) { return sw128_offset<BR>(r, c); }, blk.q, p.q_stride_s, i0,
                              p.seqlen_q, p.headdim);
  auto load_tile = [&](T* dst, const T* src, int64_t stride, int t) {
    flash_load_rows<BC, HD, NT>(dst, [](int r, int c) { return sw128_offset<BC>(r, c); }, src, stride, t * BC,
                                p.seqlen_k, p.headdim);
  };
  if (n_tiles > 0) load_tile(sk, blk.k, p.k_stride_s, 0);
  cp_async_commit();  // Q and K of tile 0

  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};  // rows g and g + 8; l summed per lane
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float s[BC / 8][4];
  // wgmma takes the accumulators as one flat array: m16n8 fragment n is elements 4n .. 4n + 3.
  float(&s_flat)[BC / 2] = reinterpret_cast<float(&)[BC / 2]>(s);
  float(&o_flat)[HD / 2] = reinterpret_cast<float(&)[HD / 2]>(o);
  uint32_t pa[BC / 16][4];  // P of the previous tile (A fragments), while its P·V is pending
  bool pending = false;
  const FlashMask<T> mask(p, b, h);
  // Q: this warpgroup's 64 rows; K-major, a K step of 16 is +32 bytes, a panel of 64 is BR rows.
  const uint32_t q_base = smem_addr(sq) + wg * 64 * 128;

  // O += P·V of tile t (issued, not waited for): P from registers, keys 16 kb .. +15 per step; V
  // MN-major: 16 key rows = 2048 bytes, the HD / 64 panels BC rows apart (the LBO).
  auto issue_pv = [&](int t) {
    const uint32_t v_base = smem_addr(sv + (t % 2) * BC * HD);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) {
      Wgmma<T, HD>::rs(o_flat, pa[kb], sw128_desc(v_base + kb * 16 * 128, BC * 128), 1);
    }
    wgmma_commit();
  };

  // Per tile t: S_t = Q·K_tᵀ, then P_{t-1}·V_{t-1} queued behind it on the tensor cores; the
  // softmax of S_t runs while that P·V does; O is rescaled once it is done.
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's cp.async writes, visible to the tensor cores
    // K_t and V_{t-1} landed for every thread; S_{t-1} and P_{t-2}·V_{t-2} of both warpgroups are
    // done, so sk[(t + 1) % 2] and sv[t % 2] are free.
    __syncthreads();
    if (t + 1 < n_tiles) load_tile(sk + ((t + 1) % 2) * BC * HD, blk.k, p.k_stride_s, t + 1);
    load_tile(sv + (t % 2) * BC * HD, blk.v, p.v_stride_s, t);
    cp_async_commit();
    const int j0 = t * BC;
    if (j0 >= wg_end) {  // warpgroup-uniform: this tile and every later one are hidden from its rows
      if (pending) {
        issue_pv(t - 1);
        wgmma_wait<0>();
        wgmma_fence_operands(o_flat);
        pending = false;
      }
      continue;
    }
    const uint32_t k_base = smem_addr(sk + (t % 2) * BC * HD);

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
    if (pending) {
      issue_pv(t - 1);
      wgmma_wait<1>();  // S_t done; P_{t-1}·V_{t-1} may still run
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operands(s_flat);

    const bool edge = j0 + BC > p.seqlen_k || (p.causal && j0 + BC - 1 > row_w + diag);
    flash_scale_mask<T>(s, p, mask, row_w + g, j0 + 2 * t4, edge);
    float corr[2];
    flash_online_softmax(s, m, l, corr);
    wgmma_wait<0>();  // P_{t-1}·V_{t-1} added: O and pa are free
    wgmma_fence_operands(o_flat);
    flash_rescale(o, corr);
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) flash_p_fragment<T>(pa[kb], s, kb);
    pending = true;
  }
  cp_async_wait<0>();
  fence_proxy_async_shared();
  __syncthreads();  // V of the last tile landed for every thread
  if (pending) {
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();
    wgmma_fence_operands(o_flat);
  }

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
