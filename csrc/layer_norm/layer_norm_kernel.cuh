// Device code of layer_norm and rms_norm, with the residual add fused in (torch-free; the launcher is
// layer_norm.cpp, the parameter struct and launch declaration are in layer_norm_launch.h).
//
// Computes, for every row r of x viewed as [rows, width] (statistics in float32):
//   h[r]  = x[r] + residual[r], rounded to x's type      (only with a residual; else h = x, not written)
//   LayerNorm: y[r] = (h[r] - mean(h[r])) * rsqrt(var(h[r]) + eps) * weight + bias
//   RMSNorm (RMS = true): y[r] = h[r] * rsqrt(mean(h[r]^2) + eps) * weight (+ bias if given)
// weight / bias: x's type or float32, absent = 1 / 0. y is written in x's type.
//
// One kernel, a row in registers: TPR threads own a row (launch shape by width:
// layer_norm_row_class.h), each loads its ELEMS elements once with 16-byte loads (VEC = 16 /
// sizeof(T); VEC = 1 for widths that are not a multiple of VEC or misaligned rows), adds the
// residual and stores h right away (its store overlaps the reductions), then reduces the mean and
// the variance in two passes over the registers, and writes y. Traffic: x (+ residual) read once,
// y (+ h) written once, weight / bias from L2: the same bytes as a copy of x (and residual).
//
// Numerics: the variance is sum((d - mean(d))^2) / width over d = h - h[0] (h shifted by the row's
// first element, which every thread of the row reads): no E[h^2] - E[h]^2 cancellation, and a row
// of equal values has d = 0 exactly, so var = 0 and y = bias exactly, whatever the magnitude.
//
// Test: pytest tests/test_layer_norm.py    Bench: pytest bench/bench_layer_norm.py
#pragma once

#include <cstdint>

#include "../common/pdl.cuh"
#include "../common/reduce.cuh"
#include "../common/static_switch.h"
#include "../common/vec_dtypes.cuh"
#include "layer_norm_launch.h"
#include "layer_norm_row_class.h"

namespace fused_attn {

// Rows of <= 32 threads share a block of 128 threads (several rows per block, as softmax v1).
constexpr int kNormShortRowBlock = 128;
template <int TPR>
__host__ __device__ constexpr int norm_block_threads() {
  return TPR > 32 ? TPR : kNormShortRowBlock;
}

// VEC weight or bias values at column c as float32, from a T or a float32 array (the flag is
// uniform over the grid). float32 values are read 16 bytes at a time as well.
template <typename T, int VEC>
__device__ __forceinline__ void load_affine(const void* ptr, bool fp32, int c, float (&out)[VEC]) {
  if (fp32) {
    const float* f = static_cast<const float*>(ptr) + c;
    if constexpr (VEC % 4 == 0) {
#pragma unroll
      for (int k = 0; k < VEC / 4; ++k) {
        const Pack<4, float> v = *reinterpret_cast<const Pack<4, float>*>(f + 4 * k);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[4 * k + e] = v.v[e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = f[e];
    }
  } else {
    const Pack<VEC, T> v = *reinterpret_cast<const Pack<VEC, T>*>(static_cast<const T*>(ptr) + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_float(v.v[e]);
  }
}

// x + residual rounded to T, as PyTorch stores it: the float32 sum of two T values rounded to T is
// the exact sum rounded once (float32 has more than twice T's precision bits; for T = float it is
// the float32 add itself).
template <typename T>
__device__ __forceinline__ T add_rounded(T a, T b) {
  return from_float<T>(to_float(a) + to_float(b));
}

// TPR threads own a row; each holds ITERS packs of VEC elements: pack k = it * TPR + lane covers
// columns [k * VEC, k * VEC + VEC), so consecutive lanes touch consecutive 16-byte chunks (coalesced).
// The launcher guarantees width % VEC == 0, so a pack is either wholly inside the row or past it.
template <typename T, int VEC, int ITERS, int TPR, bool RMS, bool RESIDUAL>
__global__ void __launch_bounds__(norm_block_threads<TPR>())
    layer_norm_kernel(const NormParams p) {
  constexpr int kRowsPerBlock = norm_block_threads<TPR>() / TPR;
  __shared__ float red_sum[TPR > 32 ? TPR / 32 : 1];
  __shared__ float red_sq[TPR > 32 ? TPR / 32 : 1];
  using P = Pack<VEC, T>;
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits

  const int lane = threadIdx.x % TPR;
  const int64_t row_id = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / TPR;
  // Lanes of a row past the end stay alive for the shuffles; they load and store nothing.
  const bool row_ok = row_id < p.rows;
  const int64_t row = row_ok ? row_id : 0;
  const int n = p.width;
  // The plain rows' addresses, before the wait (gathered rows replace them after it).
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* r = RESIDUAL ? static_cast<const T*>(p.residual) + row * p.r_row_stride : nullptr;

  // Rows of up to a warp (widths <= 1024) load weight and bias of x's type with x: the compiler may
  // not move their loads above the stores of h (h may alias them), so loaded after the reductions
  // they add a second DRAM round trip to every row (M 1, width 768: 6.2 us -> 5.3 us measured). Wider
  // rows load them at the end: there the extra registers cost more (width 4096, M 4096: 46.6 -> 51.3
  // us with them loaded early), and float32 ones always load at the end.
  constexpr bool kEarly = TPR <= 32;
  const bool w_early = kEarly && p.weight != nullptr && !p.w_fp32;
  const bool b_early = kEarly && p.bias != nullptr && !p.b_fp32;
  P xa[ITERS], ra[ITERS], wa[kEarly ? ITERS : 1], ba[kEarly ? ITERS : 1];
  if constexpr (kEarly) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * TPR + lane) * VEC;
      if (row_ok && c < n) {
        if (w_early) wa[it] = *reinterpret_cast<const P*>(static_cast<const T*>(p.weight) + c);
        if (b_early) ba[it] = *reinterpret_cast<const P*>(static_cast<const T*>(p.bias) + c);
      }
    }
  }
  // Launched programmatically (common/pdl.cuh): x, the residual and the indices are the previous
  // kernel's output; the weights above are already on their way.
  wait_for_primary();
  // The table rows (gathered rows: NormParams); a row whose index is out of range reads nothing and
  // takes NaN for h, the statistics and y.
  bool load_ok = row_ok;
  if (p.x_index != nullptr || (RESIDUAL && p.r_index != nullptr)) {
    int64_t xrow = row, rrow = row;
    if (p.x_index != nullptr && row_ok) {
      xrow = p.x_index64 ? static_cast<const int64_t*>(p.x_index)[row] : static_cast<const int*>(p.x_index)[row];
      load_ok = load_ok && xrow >= 0 && xrow < p.x_rows;
    }
    if (RESIDUAL && p.r_index != nullptr && row_ok) {
      rrow = p.r_index64 ? static_cast<const int64_t*>(p.r_index)[row] : static_cast<const int*>(p.r_index)[row];
      load_ok = load_ok && rrow >= 0 && rrow < p.r_rows;
    }
    x = static_cast<const T*>(p.x) + (load_ok ? xrow : 0) * p.x_row_stride;
    if constexpr (RESIDUAL) r = static_cast<const T*>(p.residual) + (load_ok ? rrow : 0) * p.r_row_stride;
  }
  // Every load of the row issued before any is used: one round trip. (A NaN written into xa in an
  // else branch here made each 16-byte load wait for itself before the next one issued, the halves
  // repacked at the branch join: 4 dependent L2 round trips, +0.55 us per launch, +13 us per GPT-2
  // step at B1 on an H100, docs/lab-notes/linear-mlp.md. The NaN of a bad index is selected in below.)
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (load_ok && c < n) {
      xa[it] = *reinterpret_cast<const P*>(x + c);
      if constexpr (RESIDUAL) ra[it] = *reinterpret_cast<const P*>(r + c);
    }
  }
  const float kNaN = __int_as_float(0x7fc00000);
  // The shift: h[0], read by every thread of the row (one broadcast line, already on its way).
  float shift = 0.f;
  if constexpr (!RMS) {
    if (load_ok) shift = to_float(RESIDUAL ? add_rounded(x[0], r[0]) : x[0]);
  }

  float v[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    const bool ok = row_ok && c < n;
    if constexpr (RESIDUAL) {
      P hp;
#pragma unroll
      for (int e = 0; e < VEC; ++e) hp.v[e] = load_ok ? add_rounded(xa[it].v[e], ra[it].v[e]) : from_float<T>(kNaN);
      if (ok) *reinterpret_cast<P*>(static_cast<T*>(p.h) + row * n + c) = hp;
      xa[it] = hp;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[it][e] = !ok ? 0.f : load_ok ? to_float(xa[it].v[e]) - shift : kNaN;
  }

  float mean = 0.f;  // of the shifted values (LayerNorm); RMSNorm centers nothing
  if constexpr (!RMS) {
    float sum = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum += v[it][e];
    }
    mean = group_reduce<TPR>(sum, red_sum, SumOp{}) / float(n);
  }
  float sq = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c < n) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float t = v[it][e] - mean;
        sq += t * t;
      }
    }
  }
  sq = group_reduce<TPR>(sq, red_sq, SumOp{});
  launch_dependents();
  const float rstd = rsqrtf(sq / float(n) + p.eps);
  if (!row_ok) return;

  T* y = static_cast<T*>(p.y) + row * n;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * TPR + lane) * VEC;
    if (c < n) {
      float w[VEC], b[VEC];
      if (w_early) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) w[e] = to_float(wa[kEarly ? it : 0].v[e]);
      } else if (p.weight != nullptr) {
        load_affine<T, VEC>(p.weight, p.w_fp32, c, w);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) w[e] = 1.f;
      }
      if (b_early) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) b[e] = to_float(ba[kEarly ? it : 0].v[e]);
      } else if (p.bias != nullptr) {
        load_affine<T, VEC>(p.bias, p.b_fp32, c, b);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) b[e] = 0.f;
      }
      P out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.v[e] = from_float<T>(fmaf((v[it][e] - mean) * rstd, w[e], b[e]));
      *reinterpret_cast<P*>(y + c) = out;
    }
  }
}

// A template of its own so that only the row classes in the table are instantiated.
template <typename T, int VEC, bool RMS, int TPR, int ELEMS>
void launch_layer_norm_class(const NormParams& p, cudaStream_t stream) {
  constexpr int kThreads = norm_block_threads<TPR>();
  constexpr int kRowsPerBlock = kThreads / TPR;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  NormParams q = p;
  q.pdl_early = p.rows <= pdl_early_norm_rows();  // common/pdl.cuh: the norms' own limit (16 rows)
  FA_BOOL_SWITCH(p.residual != nullptr, kResidual, [&] {
    // Programmatic where the kernel has the sm_90 code (common/pdl.cuh); checked once per kernel.
    static const bool pdl = programmatic_capable(layer_norm_kernel<T, VEC, ELEMS / VEC, TPR, RMS, kResidual>);
    launch_programmatic(pdl, layer_norm_kernel<T, VEC, ELEMS / VEC, TPR, RMS, kResidual>, dim3(unsigned(blocks)),
                        dim3(kThreads), 0, stream, q);
  });
}

template <typename T, int VEC, bool RMS>
void launch_layer_norm(const NormParams& p, cudaStream_t stream) {
  FA_NORM_ROW_CLASS(p.width, TPR, ELEMS, [&] { launch_layer_norm_class<T, VEC, RMS, TPR, ELEMS>(p, stream); });
}

}  // namespace fused_attn
