// attention kernels: full attention for prefill, out = softmax(q·kᵀ·scale + mask)·v per (batch,
// query head), the query head h reading kv head h / group (MHA, GQA, MQA).
//
// attention_flash_kernel (mode "flash", float16 / bfloat16): FlashAttention-2's forward in one
// kernel. One block per (tile of BR query rows, head, batch); each of its warps owns 16 rows and
// loops over the keys in tiles of BC: S = Q·Kᵀ on tensor cores (mma.sync m16n8k16, K fed by
// ldmatrix from XOR-swizzled shared memory, Q's A fragments kept in registers), the online
// softmax on the accumulator fragments (running max and sum per row, log2 domain, rows reduced
// over the lane quad), P rounded to T in registers as the A fragment of O += P·V (V through
// ldmatrix.trans). K and V tiles stream global -> shared with cp.async through a ring of STAGES
// tiles, the next ones in flight while this one is computed. Under causal the key tiles past a
// query tile's last visible key are never loaded; masking code runs only on tiles that cross the
// diagonal or the end of the keys, or when there is a mask (read per element through its
// broadcast strides). The score matrix
// never exists in memory: traffic is Q and O once, K and V once per query tile (from L2 after the
// first), so the kernel is tensor-core bound at seqlen >= ~512: 4 · Sq · Sk · D FLOPs (half under
// causal) at ~60-70% of the mma.sync peak is the target. lse (natural log) is written per row.
//
// attention_gemm_kernel (mode "naive", any dtype): the teaching baseline's GEMM, a 16 x 16
// shared-memory tile per block, one output per thread, float32 accumulation; used for Q·Kᵀ
// (float32 scores) and P·V around scaled_masked_softmax (attention.cpp), so the score matrix
// makes two round trips through memory. attention_gemm_tiled_kernel (mode "tiled"): the same
// three steps with a register-blocked GEMM (64 x 64 tiles, 4 x 4 outputs per thread).
//
// Tests: tests/test_attention.py; benchmark: bench/bench_attention.py.
#pragma once

#include <cuda_runtime.h>

#include "../common/func_attrs.h"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/vec_dtypes.cuh"
#include "attention_launch.h"

namespace fused_attn {

// Tile geometry of attention_flash_kernel<T, HD>. 16 query rows per warp; 8 warps (BR = 128)
// share each K/V tile up to HD 128, 4 (BR = 64) at HD 256, where the O accumulator alone is
// 128 registers per thread and Q's fragments are read from shared memory per tile instead.
template <typename T, int HD>
struct FlashConfig {
  static constexpr int kWarps = HD <= 128 ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int BR = 16 * kWarps;
  static constexpr int BC = HD <= 128 ? 64 : 32;
  static constexpr int CH = HD / 8;  // 16-byte chunks per row
  // K/V tiles in shared memory: STAGES - 1 in flight while one is computed (three stages: 128 KB
  // at HD 128 for one block per SM, 64 KB per block at HD 64 for two; HD 256 keeps two).
  static constexpr int STAGES = HD <= 128 ? 3 : 2;
  static constexpr bool kQInRegisters = HD <= 128;
  // Blocks per SM the registers are budgeted for (ptxas otherwise takes up to 255 per thread, one
  // 8-warp block per SM); at HD <= 64 two fit in 128 registers without spills.
  static constexpr int kMinBlocks = HD <= 64 ? 2 : 1;
  static constexpr int kSmemBytes = (BR * HD + STAGES * 2 * BC * HD) * int(sizeof(T));
};

// A finite score below which an additive mask's value is clamped before the log2 scaling, so that
// finfo(float32).min (Hugging Face's mask value) does not overflow to -inf: a row masked that way
// stays uniform, as in PyTorch. -inf itself stays -inf (masked).
constexpr float kMinScore = -1e38f;

// The flash kernels' shared steps, on one thread's share of a score tile: an m16n8 accumulator
// fragment per 8 keys (mma.sync's tiles, and each warp's 16-row slice of a wgmma m64nN tile):
// s[n][e] holds row g + 8 (e / 2), key 8 n + 2 t4 + (e % 2) of the warp's rows (g = lane / 4,
// t4 = lane % 4); rows are reduced over the lane quad. O's fragments have the same shape over
// head-dim columns.

// A block's place: its tile of BR query rows from row i0, head, batch, the key tiles of BC it reads,
// and its q / k / v (kv head h / group). From the grid (query tiles, nheads_q, batch): the last tiles,
// with the most keys under causal, take the lowest blockIdx.x, so each (head, batch) starts its longest
// first (the wgmma kernel also orders them across heads: attention_wgmma.cuh's flash_wgmma_block).
template <typename T>
struct FlashBlock {
  int h, b, i0, n_tiles;
  const T* q;
  const T* k;
  const T* v;
  __device__ FlashBlock(const AttentionParams& p, int br, int bc)
      : FlashBlock(p, br, bc, (int(gridDim.x) - 1 - int(blockIdx.x)) * br, int(blockIdx.y), int(blockIdx.z)) {}
  __device__ FlashBlock(const AttentionParams& p, int br, int bc, int first_row, int head, int batch)
      : h(head), b(batch), i0(first_row) {
    int n_end = p.seqlen_k;  // key j is visible to query i iff j <= i + seqlen_k - seqlen_q (causal)
    if (p.causal) n_end = min(n_end, min(i0 + br, p.seqlen_q) + p.seqlen_k - p.seqlen_q);
    n_tiles = n_end > 0 ? (n_end + bc - 1) / bc : 0;
    const int hkv = h / p.group;
    q = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h;
    k = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
    v = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;
  }
};

// Rows first .. first + ROWS - 1 of a [seqlen][headdim] matrix (row stride `stride`) into a tile of
// shared memory, 16-byte chunk c of tile row r at element offset(r, c), by NT threads with
// cp.async; rows past `limit` and columns past headdim land as zeros (cp.async reads nothing).
// Each thread keeps one chunk column and walks rows NT / CH apart. UNROLL: copies unrolled per
// loop step (a loader warpgroup with few registers keeps it small).
template <int ROWS, int HD, int NT, int UNROLL = ROWS * HD / 8 / NT, typename T, typename Offset>
__device__ __forceinline__ void flash_load_rows(T* dst, Offset offset, const T* src, int64_t stride, int first,
                                                int limit, int headdim) {
  constexpr int CH = HD / 8, kVec = 8, kStep = NT / CH;  // rows apart
  static_assert(NT % CH == 0 && ROWS % kStep == 0, "whole copy rounds per thread");
  const int c = threadIdx.x % CH, r0 = threadIdx.x % NT / CH;
  const bool col_on = c * kVec < headdim;
#pragma unroll UNROLL
  for (int r = r0; r < ROWS; r += kStep) {
    const bool on = col_on && first + r < limit;
    cp_async16(reinterpret_cast<uint4*>(dst + offset(r, c)), on ? src + int64_t(first + r) * stride + c * kVec : src,
               on);
  }
}

// attn_mask through its broadcast strides, from (batch b, head h): bool or additive in T.
template <typename T>
struct FlashMask {
  const unsigned char* b = nullptr;
  const T* t = nullptr;
  __device__ FlashMask(const AttentionParams& p, int batch, int head) {
    if (p.mask == nullptr) return;
    const int64_t base = batch * p.m_stride_b + head * p.m_stride_h;
    if (p.mask_is_bool) b = static_cast<const unsigned char*>(p.mask) + base;
    else t = static_cast<const T*>(p.mask) + base;
  }
};

// Scores into the log2 domain; -inf where a key is past seqlen_k, causally hidden or masked.
// row: the thread's row g, col: its first key 2 t4 (absolute indices). Only a tile that crosses
// the end of the keys or the diagonal (`edge`), or a masked call, pays for a per-element path.
// Without a mask that path is one compare and select per score: each of the thread's two rows has
// a last visible key, and the score's offset from col (8 n + e % 2) is a compile-time constant. The
// masked path branches per score around the mask's load (rows past seqlen_q read nothing): as one
// path it had been ~25 KB of cold code on the causal diagonal of every unmasked call (ncu: 19% of
// the warps' samples stalled on instruction fetch; H100, docs/lab-notes/attention.md).
// kMayMask false: the caller's launch has no mask (the wgmma kernel is built both ways), and the
// masked path is not compiled in.
template <typename T, bool kMayMask = true, int NS>
__device__ __forceinline__ void flash_scale_mask(float (&s)[NS][4], const AttentionParams& p, const FlashMask<T>& mask,
                                                 int row, int col, bool edge) {
  if constexpr (kMayMask) {
    if (p.mask != nullptr) {
      const int diag = p.seqlen_k - p.seqlen_q;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row + 8 * (e / 2), j = col + n * 8 + (e & 1);
          bool on = j < p.seqlen_k && (!p.causal || j <= i + diag);
          float x = s[n][e] * p.scale_log2;
          if (on && i < p.seqlen_q) {
            const int64_t at = int64_t(i) * p.m_stride_q + int64_t(j) * p.m_stride_k;
            if (mask.b != nullptr) {
              on = mask.b[at] != 0;
            } else if (mask.t != nullptr) {
              float y = s[n][e] * p.scale + to_float(mask.t[at]);  // the mask adds after the scale
              if (y != kNegInf) y = max_nan(y, kMinScore);
              x = y * kLog2e;
            }
          }
          s[n][e] = on ? x : kNegInf;
        }
      }
      return;
    }
  }
  if (!edge) {
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= p.scale_log2;
    }
    return;
  }
  // Keys col + d with d <= lim[hh] are visible to row + 8 hh.
  int lim[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    int last = p.seqlen_k - 1;
    if (p.causal) last = min(last, row + 8 * hh + p.seqlen_k - p.seqlen_q);
    lim[hh] = last - col;
  }
#pragma unroll
  for (int n = 0; n < NS; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = n * 8 + (e & 1) <= lim[e / 2] ? s[n][e] * p.scale_log2 : kNegInf;
  }
}

// Online softmax per row: new running max m, P = 2^(S - max) in place of S, the running sum l
// (summed per lane, reduced at the end) rescaled and grown; corr: the factor O must be rescaled by
// (flash_rescale) before this tile's P·V is added.
template <int NS>
__device__ __forceinline__ void flash_online_softmax(float (&s)[NS][4], float (&m)[2], float (&l)[2],
                                                     float (&corr)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {  // rows g (hh = 0) and g + 8 (hh = 1)
    float mx = kNegInf;
#pragma unroll
    for (int n = 0; n < NS; ++n) mx = max_nan(mx, max_nan(s[n][2 * hh], s[n][2 * hh + 1]));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = max_nan(m[hh], mx);
    const float base = mn == kNegInf ? 0.f : mn;  // nothing visible yet: every p is 0
    corr[hh] = fast_exp2(m[hh] - base);           // 1 when the max stays, 0 from -inf
    m[hh] = mn;
    l[hh] *= corr[hh];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      s[n][2 * hh] = fast_exp2(s[n][2 * hh] - base);
      s[n][2 * hh + 1] = fast_exp2(s[n][2 * hh + 1] - base);
      l[hh] += s[n][2 * hh] + s[n][2 * hh + 1];
    }
  }
}

template <int NO>
__device__ __forceinline__ void flash_rescale(float (&o)[NO][4], const float (&corr)[2]) {
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    o[n][0] *= corr[0];
    o[n][1] *= corr[0];
    o[n][2] *= corr[1];
    o[n][3] *= corr[1];
  }
}

// P's tiles 2 kb and 2 kb + 1 (keys 16 kb .. 16 kb + 15) as the A fragment of a k16 MMA step.
template <typename T, int NS>
__device__ __forceinline__ void flash_p_fragment(uint32_t (&a)[4], const float (&s)[NS][4], int kb) {
  a[0] = pack2<T>(s[2 * kb][0], s[2 * kb][1]);
  a[1] = pack2<T>(s[2 * kb][2], s[2 * kb][3]);
  a[2] = pack2<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]);
  a[3] = pack2<T>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
}

// out = O / l (0 on a row with no visible key), lse = (max + log2 l) · ln 2, for the thread's
// rows `row` (its g) and row + 8 of (batch b, head h); t4 = lane % 4.
template <typename T, int NO>
__device__ __forceinline__ void flash_store(const AttentionParams& p, const float (&o)[NO][4], const float (&m)[2],
                                            float (&l)[2], int b, int h, int row, int t4) {
  T* const og = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    const int i = row + 8 * hh;
    if (i >= p.seqlen_q) continue;
    const float inv = l[hh] > 0.f ? 1.f / l[hh] : (l[hh] == 0.f ? 0.f : l[hh]);  // NaN stays NaN
    T* orow = og + int64_t(i) * p.o_stride_s;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      if (n * 8 < p.headdim) {
        *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t4) = pack2<T>(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      const float lse = l[hh] > 0.f ? (m[hh] + __log2f(l[hh])) * 0.6931471805599453f
                                    : (l[hh] == 0.f ? kNegInf : l[hh]);
      p.lse[(int64_t(b) * p.nheads_q + h) * p.seqlen_q + i] = lse;
    }
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(FlashConfig<T, HD>::kThreads, FlashConfig<T, HD>::kMinBlocks)
    attention_flash_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using C = FlashConfig<T, HD>;
  constexpr int BR = C::BR, BC = C::BC, STAGES = C::STAGES, NT = C::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  T* const sq = reinterpret_cast<T*>(smem);  // [BR][HD], swizzled
  T* const pipe = sq + BR * HD;              // [stage][K, V][BC][HD], swizzled

  const FlashBlock<T> blk(p, BR, BC);
  const int h = blk.h, b = blk.b, i0 = blk.i0, n_tiles = blk.n_tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int diag = p.seqlen_k - p.seqlen_q;  // key j is visible to query i iff j <= i + diag (causal)

  const auto offset = [](int r, int c) { return swizzled<HD>(r, c); };
  flash_load_rows<BR, HD, NT>(sq, offset, blk.q, p.q_stride_s, i0, p.seqlen_q, p.headdim);
  auto issue = [&](int t) {
    T* ks = pipe + (t % STAGES) * 2 * BC * HD;
    flash_load_rows<BC, HD, NT>(ks, offset, blk.k, p.k_stride_s, t * BC, p.seqlen_k, p.headdim);
    flash_load_rows<BC, HD, NT>(ks + BC * HD, offset, blk.v, p.v_stride_s, t * BC, p.seqlen_k, p.headdim);
  };
  if (n_tiles > 0) issue(0);
  cp_async_commit();  // group 0: Q and the first K/V tile
#pragma unroll
  for (int t = 1; t < STAGES - 1; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();
  }

  const int row_w = i0 + warp * 16;  // this warp's first query row
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};  // rows g and g + 8; l summed per lane
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  uint32_t qa[C::kQInRegisters ? HD / 16 : 1][4];
  auto q_fragment = [&](uint32_t(&a)[4], int kk) {
    const int row = warp * 16 + (lane / 8 % 2) * 8 + lane % 8, c = kk * 2 + lane / 16;
    ldmatrix_x4(a, smem_addr(sq + swizzled<HD>(row, c)));
  };
  const FlashMask<T> mask(p, b, h);

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t (and Q) landed for every thread; the stage tile t - 1 used is free
    if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1);
    cp_async_commit();
    if constexpr (C::kQInRegisters) {
      if (t == 0) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) q_fragment(qa[kk], kk);
      }
    }
    const T* ks = pipe + (t % STAGES) * 2 * BC * HD;
    const T* vs = ks + BC * HD;
    const int j0 = t * BC;

    // S = Q·Kᵀ for this warp's 16 rows and the tile's BC keys: BC / 8 accumulator tiles.
    float s[BC / 8][4];
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t qf[4];
      if constexpr (C::kQInRegisters) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qf[e] = qa[kk][e];
      } else {
        q_fragment(qf, kk);
      }
#pragma unroll
      for (int nb = 0; nb < BC / 16; ++nb) {
        uint32_t kf[4];
        const int key = nb * 16 + (lane / 16) * 8 + lane % 8, c = kk * 2 + lane / 8 % 2;
        ldmatrix_x4(kf, smem_addr(ks + swizzled<HD>(key, c)));
        mma16816<T>(s[2 * nb], qf, kf[0], kf[1]);
        mma16816<T>(s[2 * nb + 1], qf, kf[2], kf[3]);
      }
    }

    const bool edge = j0 + BC > p.seqlen_k || (p.causal && j0 + BC - 1 > row_w + diag);
    flash_scale_mask<T>(s, p, mask, row_w + g, j0 + 2 * t4, edge);
    float corr[2];
    flash_online_softmax(s, m, l, corr);
    flash_rescale(o, corr);

    // O += P·V: P's accumulator tiles 2 kb, 2 kb + 1 are the A fragment of keys kb·16 .. +15.
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) {
      uint32_t pa[4];
      flash_p_fragment<T>(pa, s, kb);
#pragma unroll
      for (int nc = 0; nc < HD / 16; ++nc) {
        uint32_t vf[4];
        const int key = kb * 16 + (lane / 8 % 2) * 8 + lane % 8, c = nc * 2 + lane / 16;
        ldmatrix_x4_trans(vf, smem_addr(vs + swizzled<HD>(key, c)));
        mma16816<T>(o[2 * nc], pa, vf[0], vf[1]);
        mma16816<T>(o[2 * nc + 1], pa, vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();

  flash_store<T>(p, o, m, l, b, h, row_w + g, t4);
#endif
}

template <typename T, int HD>
void launch_attention_flash(const AttentionParams& p, cudaStream_t stream) {
  using C = FlashConfig<T, HD>;
  allow_dynamic_smem(attention_flash_kernel<T, HD>, C::kSmemBytes);
  const dim3 grid(unsigned((p.seqlen_q + C::BR - 1) / C::BR), unsigned(p.nheads_q), unsigned(p.batch));
  attention_flash_kernel<T, HD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
}

template <typename T, int HD>
int attention_flash_arch() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, attention_flash_kernel<T, HD>) == cudaSuccess ? attr.binaryVersion : 0;
}

// ---------------------------------------------------------------------------------------------
// The naive mode's GEMM: C = A · B per (batch, head), a 16 x 16 output tile per block, K in steps
// of 16 through shared memory (the textbook tiled GEMM: each element loaded from global memory
// once per tile instead of once per product).
constexpr int kGemmTile = 16;

template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kGemmTile * kGemmTile) attention_gemm_kernel(const GemmParams p) {
  __shared__ float sa[kGemmTile][kGemmTile + 1];  // +1: the column reads of sa are conflict-free
  __shared__ float sb[kGemmTile][kGemmTile + 1];
  const int z = blockIdx.z, bb = z / p.nheads, h = z % p.nheads;
  const TA* a = static_cast<const TA*>(p.a) + bb * p.a_stride_b + h * p.a_stride_h;
  const TB* bm = static_cast<const TB*>(p.b) + bb * p.b_stride_b + (h / p.group) * p.b_stride_h;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * kGemmTile + ty, col = blockIdx.x * kGemmTile + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < p.k; k0 += kGemmTile) {
    sa[ty][tx] = row < p.m && k0 + tx < p.k ? to_float(a[row * p.a_stride_r + (k0 + tx) * p.a_stride_c]) : 0.f;
    sb[ty][tx] = k0 + ty < p.k && col < p.n ? to_float(bm[(k0 + ty) * p.b_stride_r + col * p.b_stride_c]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmTile; ++kk) acc = fmaf(sa[ty][kk], sb[kk][tx], acc);
    __syncthreads();
  }
  if (row < p.m && col < p.n) {
    static_cast<TC*>(p.c)[bb * p.c_stride_b + h * p.c_stride_h + row * p.c_stride_r + col * p.c_stride_c] =
        from_float<TC>(acc);
  }
}

// The tiled mode's GEMM: register blocking. A 64 x 64 output tile per block of 256 threads, each
// thread accumulating a 4 x 4 sub-tile (rows ty + 16 i, columns tx + 16 j: a warp's shared-memory
// reads are broadcasts along A and consecutive along B, its stores consecutive along C's rows), so
// every value read from shared memory feeds 4 FMAs instead of 1. The global loads walk whichever of
// an operand's two dims is contiguous (Kᵀ's k, Q's k, V's n), so the stride swap costs nothing.
constexpr int kTiledM = 64, kTiledN = 64, kTiledK = 16, kTiledThreads = 256;

template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kTiledThreads) attention_gemm_tiled_kernel(const GemmParams p) {
  __shared__ float sa[kTiledK][kTiledM + 4];  // A tile, k-major; +4 keeps rows 16-byte aligned
  __shared__ float sb[kTiledK][kTiledN + 4];
  const int z = blockIdx.z, bb = z / p.nheads, h = z % p.nheads;
  const TA* a = static_cast<const TA*>(p.a) + bb * p.a_stride_b + h * p.a_stride_h;
  const TB* bm = static_cast<const TB*>(p.b) + bb * p.b_stride_b + (h / p.group) * p.b_stride_h;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int m0 = blockIdx.y * kTiledM, n0 = blockIdx.x * kTiledN;
  const bool a_k_inner = p.a_stride_c == 1, b_k_inner = p.b_stride_r == 1;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < p.k; k0 += kTiledK) {
#pragma unroll
    for (int i = 0; i < kTiledM * kTiledK / kTiledThreads; ++i) {
      const int e = tid + i * kTiledThreads;
      const int kk = a_k_inner ? e % kTiledK : e / kTiledM, r = a_k_inner ? e / kTiledK : e % kTiledM;
      const int row = m0 + r, col = k0 + kk;
      sa[kk][r] = row < p.m && col < p.k ? to_float(a[row * p.a_stride_r + col * p.a_stride_c]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kTiledN * kTiledK / kTiledThreads; ++i) {
      const int e = tid + i * kTiledThreads;
      const int kk = b_k_inner ? e % kTiledK : e / kTiledN, c = b_k_inner ? e / kTiledK : e % kTiledN;
      const int row = k0 + kk, col = n0 + c;
      sb[kk][c] = row < p.k && col < p.n ? to_float(bm[row * p.b_stride_r + col * p.b_stride_c]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTiledK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sa[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = sb[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
  TC* c = static_cast<TC*>(p.c) + bb * p.c_stride_b + h * p.c_stride_h;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = m0 + ty + 16 * i, col = n0 + tx + 16 * j;
      if (row < p.m && col < p.n) c[row * p.c_stride_r + col * p.c_stride_c] = from_float<TC>(acc[i][j]);
    }
  }
}

template <typename TA, typename TB, typename TC>
void launch_attention_gemm(const GemmParams& p, bool tiled, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0 || p.batch * p.nheads == 0) return;
  if (tiled) {
    const dim3 grid(unsigned((p.n + kTiledN - 1) / kTiledN), unsigned((p.m + kTiledM - 1) / kTiledM),
                    unsigned(p.batch * p.nheads));
    attention_gemm_tiled_kernel<TA, TB, TC><<<grid, kTiledThreads, 0, stream>>>(p);
    return;
  }
  const dim3 grid(unsigned((p.n + kGemmTile - 1) / kGemmTile), unsigned((p.m + kGemmTile - 1) / kGemmTile),
                  unsigned(p.batch * p.nheads));
  attention_gemm_kernel<TA, TB, TC><<<grid, dim3(kGemmTile, kGemmTile), 0, stream>>>(p);
}

}  // namespace fused_attn
