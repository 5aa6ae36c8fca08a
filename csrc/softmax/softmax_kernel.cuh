// Device code of scaled_masked_softmax (torch-free; the launcher is softmax.cpp, the parameter
// structs and launch declarations are in softmax_launch.h).
//
// Computes, for every row r of x viewed as [rows = L * seqlen_q, seqlen_k]:
//   out[r, j] = softmax_j(x[r, j] * scale + mask[r, j])       (float32 accumulation)
// where a key j is visible to query q = r % seqlen_q iff j < kv_len(q), with
//   kv_len(q) = causal ? clamp(q + seqlen_k - seqlen_q + 1, 0, seqlen_k) : seqlen_k
// (bottom-right aligned causal mask), and `mask` is a bool (true = attend) or
// additive float mask broadcast over the leading dims. Invisible keys are never
// read and are written as 0. A row with no finite score is written as all
// zeros; a NaN in a visible element makes its row NaN.
//
// Versions (selected in softmax.cpp, both tested):
//   v0  textbook: one block per row; scale and mask are separate passes over a
//       float32 copy of the row in global memory (workspace), then max, sum and
//       normalize passes. ~5 reads + 3 writes of the row: the unfused chain's
//       traffic, inside one kernel.
//   v1  fused: the row is read once into registers (16-byte vector loads when
//       seqlen_k and the pointers allow), max and sum are reduced in registers,
//       the row is written once. Launch shape by row length and causal (softmax_row_class.h):
//       sub-warp / warp / block per row; a separate instantiation without mask
//       loads; per-class register cap and early zero stores for the causal
//       triangle (chosen by measurement: docs/lab-notes/softmax.md, "Build-time
//       A/B of four mechanisms"). Rows longer than 32768 elements use a
//       streaming online-softmax pass (2 reads + 1 write).
//   Target: one read of the visible part + one write of the row at the device
//   copy bandwidth (docs/lab-notes/softmax.md has the measured numbers).
//
// Backward (softmax_backward_kernel, selected in softmax.cpp): with y = out and
// dy the incoming gradient,
//   dx[r, j] = scale * y[r, j] * (dy[r, j] - sum_k dy[r, k] * y[r, k])
// over the visible keys; dx is 0 at every invisible key and on rows with no
// visible key (y is exactly 0 there, and the forward defines such rows as 0, a
// constant). The mask is not needed: y already carries it as exact zeros. Rows
// up to 16384 keys hold y and dy in registers (one read of each over the visible
// keys, one write of dx over the row); longer rows read them twice (dot product,
// then dx). The gradient of an additive mask is dx with scale = 1 (fused_attn/softmax.py).
//
// Test: pytest tests/test_softmax.py    Bench: pytest bench/bench_softmax.py
#pragma once

#include <cstdint>

#include "../common/fastdiv.cuh"
#include "../common/math.cuh"
#include "../common/reduce.cuh"
#include "../common/static_switch.h"
#include "../common/vec_dtypes.cuh"
#include "softmax_launch.h"
#include "softmax_row_class.h"

namespace fused_attn {

// Number of keys visible to `row` under the causal mask (all of them without it).
// Params: SoftmaxParams or SoftmaxBackwardParams (causal, div_q, seqlen_q, seqlen_k).
template <typename Params>
__device__ __forceinline__ int visible_keys(const Params& p, int64_t row) {
  if (!p.causal) return p.seqlen_k;  // no row % seqlen_q at all without a causal mask
  const int q = int(row - p.div_q.div(row) * p.seqlen_q);
  const int64_t v = int64_t(q) + p.seqlen_k - p.seqlen_q + 1;
  return v < 0 ? 0 : (v > p.seqlen_k ? p.seqlen_k : int(v));
}

// Element offset of mask[row, 0]; the mask is read through its strides so a
// [B,1,1,Sk] padding mask is never materialized at [B,H,Sq,Sk].
__device__ __forceinline__ int64_t mask_row_offset(const SoftmaxParams& p, int64_t row) {
  const int64_t lead = p.div_q.div(row);
  const int64_t q = row - lead * p.seqlen_q;
  const int64_t l0 = p.div_lead1.div(lead);
  const int64_t l1 = lead - l0 * p.mask_lead1;
  return l0 * p.mask_stride_lead0 + l1 * p.mask_stride_lead1 + q * p.mask_stride_q;
}

// The mask's contribution to one score. The kind branch is uniform over the grid.
template <typename T>
__device__ __forceinline__ float mask_term(const SoftmaxParams& p, int64_t row_off, int j) {
  const int64_t off = row_off + int64_t(j) * p.mask_stride_k;
  if (p.mask_kind == kMaskBool) {
    return static_cast<const uint8_t*>(p.mask)[off] ? 0.f : kNegInf;
  }
  if (p.mask_kind == kMaskAdditive) {
    return to_float(static_cast<const T*>(p.mask)[off]);
  }
  return 0.f;
}

// ---------------------------------------------------------------------------
// v0: textbook, one block per row, intermediates in a float32 workspace.
// ---------------------------------------------------------------------------
constexpr int kV0Threads = 256;

template <typename T>
__global__ void __launch_bounds__(kV0Threads)
    softmax_kernel_v0(const SoftmaxParams p) {
  __shared__ float red_max[32];
  __shared__ float red_sum[32];
  const int64_t row = blockIdx.x;
  const int n = p.seqlen_k;
  const T* x = static_cast<const T*>(p.x) + row * n;
  T* out = static_cast<T*>(p.out) + row * n;
  float* s = p.workspace + row * n;
  const float scale = p.scale;

  // pass 1: scale
  for (int j = threadIdx.x; j < n; j += kV0Threads) s[j] = to_float(x[j]) * scale;
  // pass 2: mask (each thread rewrites only the elements it wrote in pass 1)
  const int kv = visible_keys(p, row);
  const int64_t moff = p.mask_kind == kMaskNone ? 0 : mask_row_offset(p, row);
  for (int j = threadIdx.x; j < n; j += kV0Threads) {
    s[j] = j < kv ? s[j] + mask_term<T>(p, moff, j) : kNegInf;
  }
  // pass 3: max
  float m = kNegInf;
  for (int j = threadIdx.x; j < n; j += kV0Threads) m = max_nan(m, s[j]);
  m = group_reduce<kV0Threads>(m, red_max, MaxOp{});
  // pass 4: sum
  float l = 0.f;
  for (int j = threadIdx.x; j < n; j += kV0Threads) l += m == kNegInf ? 0.f : expf(s[j] - m);
  l = group_reduce<kV0Threads>(l, red_sum, SumOp{});
  // pass 5: normalize
  const float inv = m == kNegInf ? 0.f : 1.f / l;
  for (int j = threadIdx.x; j < n; j += kV0Threads) {
    out[j] = from_float<T>(m == kNegInf ? 0.f : expf(s[j] - m) * inv);
  }
}

template <typename T>
void launch_v0(const SoftmaxParams& p, cudaStream_t stream) {
  softmax_kernel_v0<T><<<unsigned(p.rows), kV0Threads, 0, stream>>>(p);
}

// ---------------------------------------------------------------------------
// v1: fused; the row lives in registers between its one read and one write.
// ---------------------------------------------------------------------------
// Rows of <= 32 threads share a block of 128 threads: 64, 256 and 512 measured no better
// (docs/lab-notes/softmax.md, "Block size of short rows").
constexpr int kShortRowBlock = 128;
template <int TPR>
__host__ __device__ constexpr int v1_block_threads() {
  return TPR > 32 ? TPR : kShortRowBlock;
}

// TPR threads own a row; each holds ITERS packs of VEC elements. Pack k of a
// row is column range [k * VEC, k * VEC + VEC), with k = it * TPR + lane, so
// consecutive lanes touch consecutive 16-byte chunks (coalesced).
//
// Two choices per row class, each measured against its alternative (docs/lab-notes/softmax.md:
// "Build-time A/B of four mechanisms", "Causal long and short rows"):
//  - early zeros: store the zeros of fully invisible packs right after the loads,
//    before the reductions, which overlaps the causal triangle's writes with the loads
//    in flight. It pays for rows held in <= 16 elements per thread, by <= one warp, or by
//    a 4-warp block; it costs the 2-warp x 32 class (causal 2048) and the 8-warp and
//    larger classes, which store the zeros with the row instead.
//  - residency: rows held in <= 16 elements per thread fit in 40 registers, so ask
//    __launch_bounds__ for 1536 resident threads per SM there (more blocks in flight
//    per SM hide more DRAM latency).
template <int TPR, int ELEMS>
__host__ __device__ constexpr bool v1_early_zeros() {
  return TPR <= 32 || ELEMS <= 16 || TPR == 128;
}

template <int TPR, int ELEMS>
__host__ __device__ constexpr int v1_min_blocks() {
  constexpr int target = ELEMS <= 16 ? 1536 : 0;
  return target / v1_block_threads<TPR>() > 0 ? target / v1_block_threads<TPR>() : 1;
}

// MASK: an attn_mask is present (p.mask_kind != kMaskNone). A separate
// instantiation keeps the mask's loads and registers out of the unmasked kernel.
template <typename T, int VEC, int ITERS, int TPR, bool MASK>
__global__ void __launch_bounds__(v1_block_threads<TPR>(), v1_min_blocks<TPR, ITERS * VEC>())
    softmax_kernel_v1(const SoftmaxParams p) {
  constexpr int kRowsPerBlock = v1_block_threads<TPR>() / TPR;
  __shared__ float red_m[TPR > 32 ? TPR / 32 : 1];
  __shared__ float red_l[TPR > 32 ? TPR / 32 : 1];
  using P = Pack<VEC, T>;

  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / TPR;
  // Lanes of a row past the end stay alive: the whole warp takes part in the
  // shuffles. They load nothing and store nothing.
  const bool row_ok = row < p.rows;
  const int n = p.seqlen_k;
  const int kv = row_ok ? visible_keys(p, row) : 0;
  const int64_t base = row * n;
  const T* x = static_cast<const T*>(p.x) + base;
  T* out = static_cast<T*>(p.out) + base;

  P raw[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c < kv) raw[it] = *reinterpret_cast<const P*>(x + c);  // invisible keys are not loaded
  }
  constexpr bool kEarlyZeros = v1_early_zeros<TPR, ITERS * VEC>();
  // Fully invisible packs: their zeros are known now. Storing them before the
  // reductions overlaps the causal triangle's writes with the loads in flight. A
  // separate loop: a store between the loads would keep the compiler from issuing
  // the later loads first (out may alias x).
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (kEarlyZeros && c >= kv && c < n && row_ok) {
      P z;
#pragma unroll
      for (int e = 0; e < VEC; ++e) z.v[e] = from_float<T>(0.f);
      *reinterpret_cast<P*>(out + c) = z;
    }
  }

  const int64_t moff = (MASK && row_ok) ? mask_row_offset(p, row) : 0;
  auto score = [&](const P& r, int it, int e) {
    const int j = (it * TPR + lane) * VEC + e;
    if (j >= kv) return kNegInf;
    float s = to_float(r.v[e]) * p.scale;
    if constexpr (MASK) s += mask_term<T>(p, moff, j);
    return s;
  };

  // The element loops below are most of the kernel's instructions, and at 16
  // elements per thread the kernel was close to issue-bound (docs/lab-notes/softmax.md,
  // "The lean element loop").
  // So: the visibility test is per pack (only the pack holding the causal edge
  // tests each element; invisible packs skip the exponentials), the all-masked
  // guard is folded into the shift (m_safe), and exp2 is one MUFU.EX2 (fast_exp2).
  float m = kNegInf, l = 0.f;
  float t[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c + VEC <= kv) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        t[it][e] = to_float(raw[it].v[e]) * p.scale;
        if constexpr (MASK) t[it][e] += mask_term<T>(p, moff, c + e);
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) t[it][e] = score(raw[it], it, e);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) m = max_nan(m, t[it][e]);
  }
  m = group_reduce<TPR>(m, red_m, MaxOp{});
  // A row with no visible key has m = -inf; shifting by 0 instead keeps
  // exp2(-inf - m) from becoming NaN, and every term is exp2(-inf) = 0.
  const float m_safe = m == kNegInf ? 0.f : m;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      t[it][e] = c < kv ? fast_exp2((t[it][e] - m_safe) * kLog2e) : 0.f;
      l += t[it][e];
    }
  }
  l = group_reduce<TPR>(l, red_l, SumOp{});
  if (!row_ok) return;
  const float inv = m == kNegInf ? 0.f : fast_rcp(l);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (kEarlyZeros ? c < kv : c < n) {
      P v;
#pragma unroll
      for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(t[it][e] * inv);
      *reinterpret_cast<P*>(out + c) = v;
    }
  }
}

// Rows longer than the register path holds: one block per row, an online
// (running max, running sum) pass over the visible keys, then a pass that
// re-reads and writes. Each thread keeps its own (m, l) pair (merge_online).
constexpr int kV1StreamThreads = 1024;

template <typename T, int VEC>
__global__ void __launch_bounds__(kV1StreamThreads)
    softmax_kernel_v1_stream(const SoftmaxParams p) {
  __shared__ float red_m[kV1StreamThreads / 32];
  __shared__ float red_l[kV1StreamThreads / 32];
  using P = Pack<VEC, T>;
  const int64_t row = blockIdx.x;
  const int n = p.seqlen_k;
  const int kv = visible_keys(p, row);
  const T* x = static_cast<const T*>(p.x) + row * n;
  T* out = static_cast<T*>(p.out) + row * n;
  const int64_t moff = p.mask_kind == kMaskNone ? 0 : mask_row_offset(p, row);
  constexpr int kStep = kV1StreamThreads * VEC;

  // Scores of the pack at column c (-inf past the visible keys); both passes.
  auto scores = [&](int c, float (&s)[VEC]) {
    const P v = *reinterpret_cast<const P*>(x + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int j = c + e;
      s[e] = kNegInf;
      if (j < kv) {
        s[e] = to_float(v.v[e]) * p.scale;
        if (p.mask_kind != kMaskNone) s[e] += mask_term<T>(p, moff, j);
      }
    }
  };

  float m = kNegInf, l = 0.f;
  for (int c = threadIdx.x * VEC; c < kv; c += kStep) {
    float s[VEC];
    scores(c, s);
    float mc = kNegInf;
#pragma unroll
    for (int e = 0; e < VEC; ++e) mc = max_nan(mc, s[e]);
    float lc = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) lc += exp_shifted(s[e], mc);
    merge_online(m, l, mc, lc);
  }
  group_merge<kV1StreamThreads>(m, l, red_m, red_l);

  const float inv = m == kNegInf ? 0.f : 1.f / l;
  for (int c = threadIdx.x * VEC; c < n; c += kStep) {
    P v;
    if (c < kv) {
      float s[VEC];
      scores(c, s);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(exp_shifted(s[e], m) * inv);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<P*>(out + c) = v;
  }
}

// ---------------------------------------------------------------------------
// Backward: dx = scale * y * (dy - <dy, y>) per row.
// ---------------------------------------------------------------------------
// TPR threads own a row and hold ITERS packs of VEC elements of both y and dy,
// laid out as in softmax_kernel_v1 (pack k = it * TPR + lane, coalesced). Only
// packs that start below the visible length are loaded; inside the pack at the
// causal edge, elements past it are excluded from the dot product and written
// as 0, so nothing beyond the visible keys is ever read or trusted.
template <typename T, int VEC, int ITERS, int TPR>
__global__ void __launch_bounds__(v1_block_threads<TPR>())
    softmax_backward_kernel(const SoftmaxBackwardParams p) {
  constexpr int kRowsPerBlock = v1_block_threads<TPR>() / TPR;
  __shared__ float red[TPR > 32 ? TPR / 32 : 1];
  using P = Pack<VEC, T>;

  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / TPR;
  const bool row_ok = row < p.rows;  // lanes past the end still join the reductions
  const int n = p.seqlen_k;
  const int kv = row_ok ? visible_keys(p, row) : 0;
  const int64_t base = row * n;
  const T* gp = static_cast<const T*>(p.grad) + base;
  const T* yp = static_cast<const T*>(p.y) + base;
  T* dxp = static_cast<T*>(p.dx) + base;

  P g[ITERS], y[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c < kv) {
      g[it] = *reinterpret_cast<const P*>(gp + c);
      y[it] = *reinterpret_cast<const P*>(yp + c);
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (c + e < kv) dot += to_float(g[it].v[e]) * to_float(y[it].v[e]);
    }
  }
  dot = group_reduce<TPR>(dot, red, SumOp{});
  if (!row_ok) return;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c < n) {
      P d;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float yv = to_float(y[it].v[e]), gv = to_float(g[it].v[e]);
        d.v[e] = from_float<T>(c + e < kv ? p.scale * yv * (gv - dot) : 0.f);
      }
      *reinterpret_cast<P*>(dxp + c) = d;
    }
  }
}

// Rows longer than the register path holds: one block per row; pass 1 reduces
// <dy, y> over the visible keys, pass 2 re-reads both and writes dx.
template <typename T, int VEC>
__global__ void __launch_bounds__(kV1StreamThreads)
    softmax_backward_kernel_stream(const SoftmaxBackwardParams p) {
  __shared__ float red[kV1StreamThreads / 32];
  using P = Pack<VEC, T>;
  const int64_t row = blockIdx.x;
  const int n = p.seqlen_k;
  const int kv = visible_keys(p, row);
  const T* gp = static_cast<const T*>(p.grad) + row * n;
  const T* yp = static_cast<const T*>(p.y) + row * n;
  T* dxp = static_cast<T*>(p.dx) + row * n;
  constexpr int kStep = kV1StreamThreads * VEC;

  float dot = 0.f;
  for (int c = threadIdx.x * VEC; c < kv; c += kStep) {
    const P g = *reinterpret_cast<const P*>(gp + c);
    const P y = *reinterpret_cast<const P*>(yp + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (c + e < kv) dot += to_float(g.v[e]) * to_float(y.v[e]);
    }
  }
  dot = group_reduce<kV1StreamThreads>(dot, red, SumOp{});
  for (int c = threadIdx.x * VEC; c < n; c += kStep) {
    P d;
    if (c < kv) {
      const P g = *reinterpret_cast<const P*>(gp + c);
      const P y = *reinterpret_cast<const P*>(yp + c);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        d.v[e] = from_float<T>(c + e < kv ? p.scale * to_float(y.v[e]) * (to_float(g.v[e]) - dot) : 0.f);
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) d.v[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<P*>(dxp + c) = d;
  }
}

// A template of its own so that the class not taken (TPR == 0 or not) is never instantiated.
template <typename T, int VEC, int TPR, int ELEMS>
void launch_backward_class(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  if constexpr (TPR == 0) {
    softmax_backward_kernel_stream<T, VEC><<<unsigned(p.rows), kV1StreamThreads, 0, stream>>>(p);
  } else {
    constexpr int kThreads = v1_block_threads<TPR>();
    constexpr int kRowsPerBlock = kThreads / TPR;
    const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    softmax_backward_kernel<T, VEC, ELEMS / VEC, TPR><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  }
}

template <typename T, int VEC>
void launch_backward(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  FA_SOFTMAX_BACKWARD_ROW_CLASS(p.seqlen_k, TPR, ELEMS,
                                [&] { launch_backward_class<T, VEC, TPR, ELEMS>(p, stream); });
}

// ---------------------------------------------------------------------------
// v1 launch: row-length class -> launch shape (softmax_row_class.h).
// ---------------------------------------------------------------------------
template <typename T, int VEC, int TPR, int ELEMS>
void launch_v1_class(const SoftmaxParams& p, cudaStream_t stream) {
  if constexpr (TPR == 0) {
    softmax_kernel_v1_stream<T, VEC><<<unsigned(p.rows), kV1StreamThreads, 0, stream>>>(p);
  } else {
    constexpr int kThreads = v1_block_threads<TPR>();
    constexpr int kRowsPerBlock = kThreads / TPR;
    const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    FA_BOOL_SWITCH(p.mask_kind != kMaskNone, kMask, [&] {
      softmax_kernel_v1<T, VEC, ELEMS / VEC, TPR, kMask><<<unsigned(blocks), kThreads, 0, stream>>>(p);
    });
  }
}

template <typename T, int VEC>
void launch_v1(const SoftmaxParams& p, cudaStream_t stream) {
  FA_SOFTMAX_ROW_CLASS(p.seqlen_k, p.causal, TPR, ELEMS,
                       [&] { launch_v1_class<T, VEC, TPR, ELEMS>(p, stream); });
}

}  // namespace fused_attn
