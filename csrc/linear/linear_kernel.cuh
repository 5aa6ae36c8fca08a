// linear_gemv_kernel: y = act(x · Wᵀ + b) + residual for few rows of x (decode: M <= 16), with
// W in nn.Linear's [N, K] layout, float32 accumulation, one rounding to T at the end.
//
// At M <= 16 the op is a weight stream: K x N x sizeof(T) bytes read once, a few KB of x,
// bias, residual and output besides. The kernel is built to read W at the copy bandwidth:
// each block owns NB weight rows (whole rows: no split-K, no partial results, no second
// launch) and its threads split K, each loading 16-byte pieces of its NB rows, U pieces per
// row issued before any is used (NB x U = 8 loads, 128 bytes, in flight per thread;
// 32-64 KB per SM with two or more blocks resident), with the L1 bypassed and L2 prefetching
// 256-byte lines. Every x row is multiplied in while a weight piece is in registers (x, a few
// KB, stays in L1). The block then reduces its NB x MT sums (shuffles, then shared memory
// over warps) and applies the epilogue: bias, GELU (tanh) or SwiGLU, residual, store.
// The launcher picks NB so that N / NB blocks cover the SMs twice (N = 768 of GPT-2's
// c_proj gets NB = 2: 384 blocks) and the block width so that each thread owns about the
// same number of 16-byte pieces of a row (K = 768 in bfloat16: 96 pieces, 96 threads).
//
// The element-wise path (p.vec false: K not a multiple of the vector width, or misaligned
// rows) loads the same pieces one element at a time, with the tail of K masked.
//
// linear_mma_kernel (float16 / bfloat16, 4 to 16 rows of x, 16-byte rows): the same stream on
// tensor cores, where the CUDA-core kernel's M FMAs per weight element (plus the conversions)
// would limit it. outᵀ = W · xᵀ: a block owns 16 weight rows (with SwiGLU 8 gate rows over their
// 8 up rows), the m16 A operand of mma.sync m16n8k16, and x's rows are the n8 B operand (one or
// two n-tiles). Both operands come straight from global memory as 16-byte loads: lane l reads 8
// consecutive k of weight rows l / 4 and l / 4 + 8 and of x row l / 4, and the 16 k slots of a
// fragment are a fixed permutation of the 32 k the lane quad read (slot 2q + {0, 1}, 8 + 2q + {0, 1}
// of the first MMA = k 8q + {0..3}, of the second = 8q + {4..7}); A and B share the permutation, so
// the dot products are exact sums over k. 8 warps split K, U = 3 or 4 chunks of 32 k in flight per warp
// (96 or 128 bytes of weight per lane: the short and long builds, kMmaShortChunks), and sum their fragments through shared memory; with SwiGLU a
// lane holds the gate and up sums of the same output, so the epilogue needs no exchange.
//
// Pre-normalization (kNorm, the CUDA-core kernel): y = act(norm(x) · Wᵀ + b) + residual with norm LayerNorm or
// RMSNorm (p.norm), what fused_attn.layer_norm / rms_norm compute: float32 statistics, two passes (the
// LayerNorm variance of the row shifted by its first element, as csrc/layer_norm does), the normalized
// row rounded to T. Before wait_for_primary(), the norm's weight and bias (constants) start on their
// way into shared memory (cp.async, where aligned: p.affine_smem); after it, the block copies x's rows
// (<= 16 rows x K, read once from L2: the bytes the plain kernels read of x per block anyway) into
// shared memory, a warp per row takes the statistics there, the block normalizes in place, and the
// main loop reads x from there: one global round trip after the wait, as in the norm's own kernel
// (which loads its weight and bias early too). It saves the norm's own launch (~2.5 us at B1 on an
// H100, for ~3 KB moved). The kernel holds its first weight pieces in registers across the wait and
// the prologue, as without the norm. Each block normalizes the rows again, so the prologue
// costs once per wave of blocks: a weight of tens of thousands of rows (an lm_head) is better served
// by the norm's own launch.
//
// kFold (the CUDA-core kernel, float16 / bfloat16, one row, a norm without weight and bias: a caller
// that folded them into W and the bias, as fused_attn.gpt2's "folded" backend does at load time) instead
// folds the norm into the dot products, so nothing waits for the statistics before the first FMA. With
// x~ = x - s (s: the row's first element for LayerNorm, 0 for RMSNorm), mean~ = mean(x~) and rstd =
// 1 / sqrt(var(x) + eps) (RMSNorm: 1 / sqrt(mean(x^2) + eps)):
//     W . norm(x) = rstd * (W . x~ - mean~ * sum(W))
// Every block reads all of x's row anyway (each computes whole dot products), so its main loop also sums
// x~, x~^2 and each weight row, and the epilogue applies the formula: a few registers, no shared memory,
// no barrier, no second pass. The normalized row is never rounded to T (the prologue's is), so results
// are within float32 arithmetic of the unrounded norm, not bit for bit the two launches'. The shift keeps
// the cancellations bounded: |mean~| <= sqrt(K) standard deviations, so the variance loses at most ~K
// float32 ulps and the dot product ~sqrt(K), far below a 16-bit rounding at the widths a GEMV takes.
//
// Tests: tests/test_linear.py, tests/test_mlp.py; benchmark: bench/bench_linear.py.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "../common/func_attrs.h"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/vec_dtypes.cuh"
#include "linear_heuristics.h"
#include "linear_launch.h"

namespace fused_attn {

namespace linear {

template <typename T>
struct Piece {
  static constexpr int VEC = 16 / int(sizeof(T));
  union {
    uint4 raw;
    T v[VEC];
  };
};

// Piece j (elements [j * VEC, j * VEC + VEC)) of the row at `row`; elements past k are 0. `stream`: a
// weight (ld.global.nc, which the compiler may issue early: weights are constants); else x, the
// previous kernel's output under PDL: a plain load, which stays after wait_for_primary() (an __ldg is
// an invariant load the compiler may hoist above the wait's asm and read x before it is written).
template <typename T, bool kVec>
__device__ __forceinline__ uint4 load_piece(const T* row, int j, int k, bool stream) {
  constexpr int VEC = Piece<T>::VEC;
  if constexpr (kVec) {
    return stream ? load_stream(row + int64_t(j) * VEC) : reinterpret_cast<const uint4*>(row)[j];
  } else {
    Piece<T> p;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int c = j * VEC + e;
      p.v[e] = c < k ? row[c] : from_float<T>(0.f);
    }
    return p.raw;
  }
}

// The 128-byte line at ptr into L2 (a weight: readable before wait_for_primary()).
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Before wait_for_primary() in the kNorm kernels: the norm's weight, then its bias, as raw bytes into
// `dst` (after the normalized rows) by cp.async, one commit group (normalize_rows waits for it).
template <typename T>
__device__ __forceinline__ void stage_affine(const LinearParams& p, unsigned char* dst) {
  if (!p.affine_smem) return;
  const int wb = p.norm_weight != nullptr ? p.k * (p.nw_fp32 ? 4 : int(sizeof(T))) : 0;
  const int bb = p.norm_bias != nullptr ? p.k * (p.nb_fp32 ? 4 : int(sizeof(T))) : 0;
  for (int i = threadIdx.x; i < (wb + bb) / 16; i += blockDim.x) {
    const int off = i * 16;
    const void* src = off < wb ? static_cast<const unsigned char*>(p.norm_weight) + off
                               : static_cast<const unsigned char*>(p.norm_bias) + (off - wb);
    cp_async16(reinterpret_cast<uint4*>(dst + off), src, true);
  }
  cp_async_commit();
}

// Element c of the norm's weight or bias (T or float32), `absent` without one.
template <typename T>
__device__ __forceinline__ float norm_affine(const void* ptr, bool fp32, int c, float absent) {
  if (ptr == nullptr) return absent;
  return fp32 ? static_cast<const float*>(ptr)[c] : to_float(static_cast<const T*>(ptr)[c]);
}

// The prologue of kNorm: rows [0, p.m) of x normalized (LayerNorm or RMSNorm over k, float32
// statistics) and rounded to T into xs (rows xs_pitch elements apart, zeros from k to the next
// 16-byte piece). Three phases, each one short latency: every thread copies pieces of x into xs (the
// block's loads all in flight at once: one L2 round trip), one warp per row sums the row from shared
// memory, every thread normalizes pieces in place. The numerics are csrc/layer_norm's: LayerNorm
// shifts the row by its first element, sums the shifted values (mean), then the squares of their
// distances to the mean (variance), and writes fma((v - mean) * rstd, weight, bias); only the order of
// the float32 sums differs. Every thread of the block must call it (it synchronizes the block).
template <typename T>
__device__ void normalize_rows(const LinearParams& p, T* xs) {
  constexpr int VEC = Piece<T>::VEC;
  const T* x = static_cast<const T*>(p.x);
  const bool rms = p.norm == kNormRms;
  const int n = p.k, pieces = (n + VEC - 1) / VEC, total = p.m * pieces;
  // The weight and bias: staged by stage_affine after the rows, or in global memory.
  const unsigned char* staged = reinterpret_cast<const unsigned char*>(xs + p.m * p.xs_pitch);
  const void* norm_w = p.norm_weight == nullptr ? nullptr : p.affine_smem ? staged : p.norm_weight;
  const void* norm_b = p.norm_bias == nullptr  ? nullptr
                       : p.affine_smem         ? staged + (norm_w != nullptr ? n * (p.nw_fp32 ? 4 : int(sizeof(T))) : 0)
                                               : p.norm_bias;
  // Whole 16-byte pieces of x: the launcher copies x so that its rows are aligned when k allows.
  const bool vec = n % VEC == 0;
  __shared__ float4 stats[kLinearMaxRows];  // (shift, mean, rstd) per row
  for (int t = threadIdx.x; t < total; t += blockDim.x) {
    const int m = t / pieces, j = t % pieces;
    const T* row = x + m * p.x_stride;
    reinterpret_cast<uint4*>(xs + m * p.xs_pitch)[j] =
        vec ? load_piece<T, true>(row, j, n, false) : load_piece<T, false>(row, j, n, false);
  }
  if (p.affine_smem) cp_async_wait<0>();  // this thread's staged pieces; the barrier makes them everyone's
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int m = warp; m < p.m; m += warps) {
    const T* srow = xs + m * p.xs_pitch;
    const float shift = !rms && n > 0 ? to_float(srow[0]) : 0.f;
    float sum = 0.f;
    for (int j = lane; j < pieces && !rms; j += 32) {
      Piece<T> xp;
      xp.raw = reinterpret_cast<const uint4*>(srow)[j];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (j * VEC + e < n) sum += to_float(xp.v[e]) - shift;
      }
    }
    const float mean = rms ? 0.f : warp_sum(sum) / float(n);
    float sq = 0.f;
    for (int j = lane; j < pieces; j += 32) {
      Piece<T> xp;
      xp.raw = reinterpret_cast<const uint4*>(srow)[j];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float t = (to_float(xp.v[e]) - shift) - mean;
        if (j * VEC + e < n) sq += t * t;
      }
    }
    const float rstd = rsqrtf(warp_sum(sq) / float(n) + p.eps);
    if (lane == 0) stats[m] = make_float4(shift, mean, rstd, 0.f);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < total; t += blockDim.x) {
    const int m = t / pieces, j = t % pieces;
    uint4* piece = reinterpret_cast<uint4*>(xs + m * p.xs_pitch) + j;
    const float4 st = stats[m];
    const float shift = st.x, mean = st.y, rstd = st.z;
    float w[VEC], b[VEC];  // all of the piece's affine loads issued before any is used
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int c = min(j * VEC + e, n - 1);
      w[e] = norm_affine<T>(norm_w, p.nw_fp32, c, 1.f);
      b[e] = norm_affine<T>(norm_b, p.nb_fp32, c, 0.f);
    }
    Piece<T> xp;
    xp.raw = *piece;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (j * VEC + e < n) xp.v[e] = from_float<T>(fmaf(((to_float(xp.v[e]) - shift) - mean) * rstd, w[e], b[e]));
    }
    *piece = xp.raw;
  }
  __syncthreads();
}

// The operands of output (x row m, column col) that do not depend on the dot product: the bias (with
// SwiGLU the gate's and the up row's) and the residual. The kernels load them ahead, the bias before
// wait_for_primary() (a constant) and the residual right after it (the previous kernels'
// output), so that they are in registers when the sums are, not one more round trip at the end of the
// launch (kOutputAhead, linear_heuristics.h; not at one row: linear_gemv_kernel's kAhead).

struct OutputIn {
  float bias, bias_up, residual;
};

// The activation a build computes: its template's kAct, or in the kActRuntime build p.activation.
template <int kAct>
__device__ __forceinline__ int build_activation(const LinearParams& p) {
  if constexpr (kAct == kActRuntime) {
    return p.activation;
  } else {
    return kAct & kActCodeMask;
  }
}

// Whether the launch has a bias (kBit kEpiBias) / a residual (kEpiResidual): compiled in where the build's code
// has kEpiKnown, else read from p.bias / p.residual.
template <int kAct, int kBit>
__device__ __forceinline__ bool build_has(const LinearParams& p) {
  static_assert(kBit == kEpiBias || kBit == kEpiResidual, "a bias or a residual");
  if constexpr (kAct != kActRuntime && (kAct & kEpiKnown) != 0) {
    return (kAct & kBit) != 0;
  } else if constexpr (kBit == kEpiBias) {
    return p.bias != nullptr;
  } else {
    return p.residual != nullptr;
  }
}

template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void load_output_bias(const LinearParams& p, int64_t col, bool live, OutputIn& in) {
  const T* bias = static_cast<const T*>(p.bias);
  const bool b = live && build_has<kAct, kEpiBias>(p);
  // plain loads, issued where they stand (before the wait); the bias is a constant
  in.bias = b ? to_float(bias[col]) : 0.f;
  in.bias_up = b && build_activation<kAct>(p) == kActSwiglu ? to_float(bias[p.n_out + col]) : 0.f;
}

template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void load_output_residual(const LinearParams& p, int m, int64_t col, bool live,
                                                     OutputIn& in) {
  // plain: after the wait (an __ldg could be hoisted above it)
  const T* residual = static_cast<const T*>(p.residual);
  in.residual = live && build_has<kAct, kEpiResidual>(p) ? to_float(residual[m * p.r_stride + col]) : 0.f;
}

// The epilogue of output (x row m, column col): `sum` is x · w_col (the gate's with SwiGLU, `up` the
// up row's), then bias, the activation, the residual (`in`, loaded ahead), one rounding to T.
template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void store_output(const LinearParams& p, int m, int64_t col, float sum, float up,
                                              const OutputIn& in) {
  const bool biased = build_has<kAct, kEpiBias>(p);
  float y;
  if (build_activation<kAct>(p) == kActSwiglu) {
    y = silu(biased ? sum + in.bias : sum) * (biased ? up + in.bias_up : up);
  } else {
    y = biased ? sum + in.bias : sum;
    if (build_activation<kAct>(p) == kActGeluTanh) y = gelu_tanh(y);
  }
  // __fadd_rn: never contracted with the activation's last product into an FMA, which nvcc does where the
  // activation is compiled in and not where it is read at run time (kActRuntime): y is the same bits from
  // every build.
  if (build_has<kAct, kEpiResidual>(p)) y = __fadd_rn(y, in.residual);
  static_cast<T*>(p.out)[m * p.o_stride + col] = from_float<T>(y);
}

// The same with the bias and residual loaded here (an output no thread loaded ahead).
template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void store_output(const LinearParams& p, int m, int64_t col, float sum, float up) {
  OutputIn in;
  load_output_bias<T, kAct>(p, col, true, in);
  load_output_residual<T, kAct>(p, m, col, true, in);
  store_output<T, kAct>(p, m, col, sum, up, in);
}

// The early trigger (common/pdl.cuh) of a linear launch: by its rows (pdl_early), and at any row count
// for a linear with an activation epilogue unless the trigger table's kPdlEarlyRows is 0 (every trigger late).
// An activation's linear is an MLP's first projection: its consumer is the second projection, a GEMV
// whose blocks fetch their weights before their wait, so starting them under this launch's main loop
// hides that fetch. Measured at 8 and 16 rows (the late trigger's range; H100, GPT-2 fp16 captured
// step: -10 us a step, docs/lab-notes/launch-overhead-pdl.md); the same early trigger on every launch of 8-16 rows
// costs the step 15 us: the run-ahead is one kernel deep here, not the whole chain.
inline LinearParams with_linear_pdl_early(const LinearParams& params) {
  LinearParams p = with_pdl_early(params, params.m);
  p.pdl_early = p.pdl_early || (params.activation != kActNone && pdl_early_rows() > 0);
  return p;
}

// kFold's bound (64 registers a thread) keeps it at the plain kernel's blocks per SM within one step of the
// register file's granularity: ptxas gave it 73 without, and at GPT-2's 96-thread blocks that is 8 blocks
// per SM against 12, too few for the next launch's blocks to start (and load their weights) under PDL.
template <typename T, int MT, int NB, bool kVec, bool kNorm, bool kFold = false>
__global__ void __launch_bounds__(kLinearMaxThreads, kFold ? 4 : 1) linear_gemv_kernel(const LinearParams p) {
  static_assert(!kFold || kNorm, "kFold is a way to run kNorm");
  constexpr bool kPrologue = kNorm && !kFold;  // the rows normalized first, into xs
  constexpr int VEC = Piece<T>::VEC;
  extern __shared__ uint4 xs_raw[];  // kNorm: the normalized rows of x
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits
  constexpr int U = 8 / NB;  // pieces per row in flight per thread
  const bool swiglu = p.activation == kActSwiglu;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);

  // Tile row r reads weight row rows[r]; with SwiGLU, even r are gate rows, odd r their up rows.
  const int64_t col0 = int64_t(blockIdx.x) * (swiglu ? NB / 2 : NB);  // first output column
  const T* wrow[NB];
  bool live[NB];
#pragma unroll
  for (int r = 0; r < NB; ++r) {
    const int64_t col = swiglu ? col0 + r / 2 : col0 + r;
    live[r] = col < p.n_out;
    const int64_t row = swiglu && (r % 2) ? p.n_out + col : col;
    wrow[r] = w + (live[r] ? row : 0) * p.w_stride;
  }

  float acc[NB][MT];
#pragma unroll
  for (int r = 0; r < NB; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;

  const int pieces = (p.k + VEC - 1) / VEC;
  const T* xs = reinterpret_cast<const T*>(xs_raw);
  Piece<T> wp[NB][U];
  auto load_weights = [&](int j0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < NB; ++r) {
        wp[r][u].raw = live[r] && j < pieces ? load_piece<T, kVec>(wrow[r], j, p.k, true) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Launched programmatically (common/pdl.cuh): the first weights are on their way into registers
  // while the previous kernel, which writes x (and the residual), drains; then x is readable (and with
  // kNorm the block normalizes it: every thread takes part). From two rows of x (kAhead) the epilogue's
  // first output per thread (thread t: column t / MT, x row t % MT) has its bias loaded before the
  // wait, its residual after. At one row that measured 2.5 us slower per B1 step (the registers it
  // takes: 64 -> 70), at four rows 7.5 us faster per B4 step (docs/lab-notes/linear-mlp.md).
  constexpr bool kAhead = kOutputAhead && MT > 1;
  if (int(threadIdx.x) < pieces) load_weights(threadIdx.x);
  const int out_cols = swiglu ? NB / 2 : NB;
  const int first_c = int(threadIdx.x) / MT, first_m = int(threadIdx.x) % MT;
  const bool first_live = kAhead && first_c < out_cols && first_m < p.m && col0 + first_c < p.n_out;
  OutputIn first_in;
  load_output_bias<T>(p, col0 + first_c, first_live, first_in);
  if constexpr (kPrologue) stage_affine<T>(p, reinterpret_cast<unsigned char*>(xs_raw) + p.m * p.xs_pitch * sizeof(T));
  wait_for_primary();
  load_output_residual<T>(p, first_m, col0 + first_c, first_live, first_in);
  if constexpr (kPrologue) normalize_rows<T>(p, reinterpret_cast<T*>(xs_raw));
  // kFold: per x row its shift s and the sums of x~ and x~^2; per weight row the sum of its elements.
  float shift[MT], s1[MT], s2[MT], wsum[NB];
  if constexpr (kFold) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      // x[m][0]: a plain load (after the wait), the same line as the first piece's.
      shift[m] = p.norm == kNormLayer && m < p.m ? to_float(x[m * p.x_stride]) : 0.f;
      s1[m] = s2[m] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < NB; ++r) wsum[r] = 0.f;
  }
  for (int j0 = threadIdx.x; j0 < pieces; j0 += blockDim.x * U) {
    if (j0 != int(threadIdx.x)) load_weights(j0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * blockDim.x;
      if (j >= pieces) break;
      float wf[NB][VEC];
#pragma unroll
      for (int r = 0; r < NB; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) wf[r][e] = to_float(wp[r][u].v[e]);
      if constexpr (kFold) {
#pragma unroll
        for (int r = 0; r < NB; ++r)
#pragma unroll
          for (int e = 0; e < VEC; ++e) wsum[r] += wf[r][e];  // 0 past k
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= p.m) break;
        Piece<T> xp;
        xp.raw = kPrologue ? reinterpret_cast<const uint4*>(xs + m * p.xs_pitch)[j]
                           : load_piece<T, kVec>(x + m * p.x_stride, j, p.k, false);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float xv = to_float(xp.v[e]);
          if constexpr (kFold) {
            xv = kVec || j * VEC + e < p.k ? xv - shift[m] : 0.f;
            s1[m] += xv;
            s2[m] = fmaf(xv, xv, s2[m]);
          }
#pragma unroll
          for (int r = 0; r < NB; ++r) acc[r][m] = fmaf(wf[r][e], xv, acc[r][m]);
        }
      }
    }
  }

  launch_dependents();
  // Block sums: shuffles within each warp, then the warps' partials through shared memory.
  __shared__ float partial[kLinearMaxThreads / 32][NB * MT];
  __shared__ float fold[kFold ? kLinearMaxThreads / 32 : 1][NB + 2 * MT];  // kFold: wsum, s1, s2
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
#pragma unroll
  for (int r = 0; r < NB; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float v = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) partial[warp][r * MT + m] = v;
    }
  if constexpr (kFold) {
#pragma unroll
    for (int r = 0; r < NB; ++r) {
      const float v = warp_sum(wsum[r]);
      if (lane == 0) fold[warp][r] = v;
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float a = warp_sum(s1[m]), b = warp_sum(s2[m]);
      if (lane == 0) fold[warp][NB + m] = a, fold[warp][NB + MT + m] = b;
    }
  }
  __syncthreads();

  // Epilogue: one thread per (output column, x row).
  for (int t = threadIdx.x; t < out_cols * MT; t += blockDim.x) {
    const int c = t / MT, m = t % MT;
    const int64_t col = col0 + c;
    if (m >= p.m || col >= p.n_out) continue;
    auto sum = [&](int r) {
      float s = 0.f;
      for (int i = 0; i < warps; ++i) s += partial[i][r * MT + m];
      if constexpr (kFold) {  // rstd * (W . x~ - mean~ * sum(W))
        float ws = 0.f, x1 = 0.f, x2 = 0.f;
        for (int i = 0; i < warps; ++i) ws += fold[i][r], x1 += fold[i][NB + m], x2 += fold[i][NB + MT + m];
        const float inv_k = 1.f / float(p.k);
        const float mean = p.norm == kNormLayer ? x1 * inv_k : 0.f;
        const float var = fmaxf(fmaf(x2, inv_k, -mean * mean), 0.f);  // RMSNorm: mean(x^2)
        s = (s - mean * ws) * rsqrtf(var + p.eps);
      }
      return s;
    };
    const float gate_or_sum = sum(swiglu ? 2 * c : c), up = swiglu ? sum(2 * c + 1) : 0.f;
    if (kAhead && t == int(threadIdx.x)) {
      store_output<T>(p, m, col, gate_or_sum, up, first_in);
    } else {
      store_output<T>(p, m, col, gate_or_sum, up);
    }
  }
}

constexpr int kMmaWarps = kLinearMmaThreads / 32;
// Two builds of each tensor-core kernel: chunks of 32 k per warp in flight and the blocks per SM they
// are compiled for (__launch_bounds__; linear_heuristics.h). Unbounded, ptxas gives them 110-112
// registers: two blocks per SM. For short rows that is too few: a next kernel's blocks find little room to
// start early under PDL, and the split-K kernel's 288 blocks at GPT-2's N = 768 ran as two waves. So where a
// warp's share of the block's K is at most kMmaShortChunks chunks (all of it in flight before the wait:
// K <= 768 for the whole-K kernel), the "short" build runs; longer rows stream tens of MB, where bytes in
// flight per SM matter more: the "long" build (kMmaLongChunks, unbounded).
// Whether a block whose slice of K holds `chunks` chunks of 32 k takes the short build.
__host__ __device__ inline bool mma_short(int64_t chunks) {
  return (chunks + kMmaWarps - 1) / kMmaWarps <= kMmaShortChunks;
}

// Whether a short-build launch of `blocks` blocks with NT n-tiles stages x (kStageX, below; kMmaStageX in
// linear_heuristics.h): two n-tiles, and a grid that `sms` SMs hold at once.
// Whether a short-build grid of `blocks` blocks is resident at once on `sms` SMs (one wave).
inline bool mma_one_wave(int64_t blocks, int sms) { return blocks <= int64_t(sms) * kMmaShortMinBlocks; }

template <int NT>
inline bool mma_stage_x(int64_t blocks, int sms) {
  return kMmaStageX && NT == 2 && mma_one_wave(blocks, sms);
}

// One lane's operands in the tensor-core kernels (linear_mma_kernel, linear_splitk.cuh) for the tile
// of weight rows from output column col0: its two weight rows (tile rows g and g + 8) and its x row
// of each of the NT n-tiles, each pointer at the lane's 8 k of a chunk of 32.
template <typename T, int NT>
struct MmaLane {
  const T* wrow[2];
  bool wlive[2];
  const T* xrow[NT];
  bool xlive[NT];
};

template <typename T, int NT, int kAct = kActRuntime>
__device__ __forceinline__ MmaLane<T, NT> mma_lane(const LinearParams& p, int64_t col0, int lane) {
  const bool swiglu = build_activation<kAct>(p) == kActSwiglu;
  const int g = lane / 4, q = lane % 4;
  MmaLane<T, NT> L;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t col = swiglu ? col0 + g : col0 + g + 8 * h;
    L.wlive[h] = col < p.n_out;
    const int64_t row = swiglu && h ? p.n_out + col : col;
    L.wrow[h] = static_cast<const T*>(p.w) + (L.wlive[h] ? row : 0) * p.w_stride + q * 8;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    L.xlive[t] = 8 * t + g < p.m;
    const int m = L.xlive[t] ? 8 * t + g : 0;
    L.xrow[t] = static_cast<const T*>(p.x) + m * p.x_stride + q * 8;
  }
  return L;
}

// Where x's pieces go on their way to the MMAs (kStageX): through shared memory, by cp.async (a slot per
// lane, read back only by the lane that copied it: no barrier), all CH x NT of a group in flight at once,
// or straight into registers. The staged path is for the short build with two n-tiles (9-16 rows) in a
// grid that is resident at once (one wave; the launchers decide): there ptxas, under the build's 80
// registers, issues the register path's six pieces one at a time, each behind the MMA of the one before,
// six L2 round trips after griddepcontrol.wait where the 8-row build waits one (GPT-2's 16-row GEMVs:
// 1.2 us of 8.2; H200, docs/lab-notes/linear-mlp.md). In grids of many waves (an lm_head's 3142 blocks) the
// register path is the faster one (27.7 against 31.7 us at 16 rows: later waves find x in L1 and their
// loads' order does not matter), and the long build (unbounded registers) issues its loads together.
// A warp's bytes: its lanes' staging slots in the main loop (mma_accumulate), then its fragments for the
// block sum (mma_block_sum). 24 KB a block for 16 rows in the short build.
template <int NT, int CH, bool kStageX>
union MmaWarpShared {
  uint4 x_stage[kStageX ? CH : 1][NT][32];
  float partial[NT][4][32];
};

template <int NT, int CH, bool kStageX>
__device__ __forceinline__ MmaWarpShared<NT, CH, kStageX>* mma_shared() {
  __shared__ MmaWarpShared<NT, CH, kStageX> warps[kMmaWarps];
  return warps;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // mma.sync
// The lane's weight pieces of the CH chunks of 32 k from c0 on, `stride` apart (zeros past end
// and past k): constants, so a caller issues the first group before wait_for_primary().
template <typename T, int NT, int CH>
__device__ __forceinline__ void mma_load_weights(const LinearParams& p, const MmaLane<T, NT>& L, int c0, int end,
                                                 int stride, uint4 (&wa)[CH][2]) {
  const int q = (threadIdx.x % 32) % 4;
#pragma unroll
  for (int u = 0; u < CH; ++u) {
    const int c = c0 + u * stride;
    const bool in = c < end && c * 32 + q * 8 < p.k;  // k is a multiple of 8: whole pieces
#pragma unroll
    for (int h = 0; h < 2; ++h) wa[u][h] = in && L.wlive[h] ? load_stream(L.wrow[h] + c * 32) : make_uint4(0, 0, 0, 0);
  }
}

// The x pieces of the group of CH chunks from c0 (`stride` apart, zeros past end and past k) on their way:
// into the lane's staging slots (kStageX, cp.async, committed by the caller) or into xb.
template <typename T, int NT, int CH, bool kStageX>
__device__ __forceinline__ void mma_issue_x(const LinearParams& p, const MmaLane<T, NT>& L, int c0, int end,
                                            int stride, uint4 (&xs)[kStageX ? CH : 1][NT][32],
                                            uint4 (&xb)[kStageX ? 1 : CH][NT]) {
  const int lane = threadIdx.x % 32, q = lane % 4;
#pragma unroll
  for (int u = 0; u < CH; ++u) {
    const int c = c0 + u * stride;
    const bool in = c < end && c * 32 + q * 8 < p.k;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if constexpr (kStageX) {
        cp_async16<true>(&xs[u][t][lane], in ? L.xrow[t] + c * 32 : L.xrow[t], in && L.xlive[t]);
      } else {
        const uint4* xp = reinterpret_cast<const uint4*>(L.xrow[t] + c * 32);
        xb[u][t] = in && L.xlive[t] ? *xp : make_uint4(0, 0, 0, 0);  // plain: not hoisted above the wait
      }
    }
  }
}

// The A fragments of a chunk's weight pieces (tile rows g and g + 8) for its two MMAs: the
// k-slot permutation the x pieces share (linear_mma_kernel's header).
__device__ __forceinline__ void mma_a_fragments(const uint4 (&w)[2], uint32_t (&lo)[4], uint32_t (&hi)[4]) {
  lo[0] = w[0].x, lo[1] = w[1].x, lo[2] = w[0].y, lo[3] = w[1].y;
  hi[0] = w[0].z, hi[1] = w[1].z, hi[2] = w[0].w, hi[3] = w[1].w;
}

// A staged group's x pieces landed in the lane's slots (kStageX; nothing to wait for otherwise).
template <bool kStageX>
__device__ __forceinline__ void mma_x_landed() {
  if constexpr (kStageX) {
    cp_async_commit();
    cp_async_wait<0>();
  }
}

// The chunk walk of the tensor-core kernels (mma_accumulate, kSelfNorm's two passes): the groups of CH
// chunks of 32 k from `first`, `stride` apart, each group's weights loaded (the first group's by the caller
// where first_loaded: before the wait) and its x pieces issued, then body(t, a_lo, a_hi, piece, live) for
// every n-tile t of every chunk (live: the piece is inside k and its x row inside m). after_issue() runs
// once, right after the first group's x pieces are on their way.
template <typename T, int NT, int CH, bool kStageX, typename AfterIssue, typename Body>
__device__ __forceinline__ void mma_walk_pieces(const LinearParams& p, const MmaLane<T, NT>& L, int first, int end,
                                                int stride, bool first_loaded, uint4 (&wa)[CH][2],
                                                AfterIssue after_issue, Body body) {
  const int lane = threadIdx.x % 32, q = lane % 4;
  auto& xs = mma_shared<NT, CH, kStageX>()[threadIdx.x / 32].x_stage;
  for (int c0 = first; c0 < end; c0 += stride * CH) {
    if (c0 != first || !first_loaded) mma_load_weights<T, NT, CH>(p, L, c0, end, stride, wa);
    uint4 xb[kStageX ? 1 : CH][NT];
    mma_issue_x<T, NT, CH, kStageX>(p, L, c0, end, stride, xs, xb);
    // Every staged piece issued before anything reads the weight registers: without this fence ptxas
    // interleaved the A-fragment moves with the copies, and the moves' wait for the weights (in-order
    // issue) held back the group's last pieces, a second round trip before the first MMA (16 rows:
    // 3 of 6 pieces behind it; docs/lab-notes/linear-mlp.md). __syncwarp is the fence ptxas keeps.
    if constexpr (kStageX && kMmaXFence) __syncwarp();
    if (c0 == first) after_issue();
    mma_x_landed<kStageX>();
#pragma unroll
    for (int u = 0; u < CH; ++u) {
      uint32_t a_lo[4], a_hi[4];
      mma_a_fragments(wa[u], a_lo, a_hi);
      const int c = c0 + u * stride;
      const bool in = c < end && c * 32 + q * 8 < p.k;
#pragma unroll
      for (int t = 0; t < NT; ++t)
        body(t, a_lo, a_hi, kStageX ? xs[u][t][lane] : xb[kStageX ? 0 : u][t], in && L.xlive[t]);
    }
  }
}

// acc += the lane's share of the products over the chunks of 32 k first, first + stride, ... below
// end, CH of them in flight; `wa` holds the first group's weights (mma_load_weights, issued
// before the caller's wait_for_primary(): x, read here, is the previous kernel's output).
template <typename T, int NT, int CH, bool kStageX>
__device__ __forceinline__ void mma_accumulate(const LinearParams& p, const MmaLane<T, NT>& L, int first, int end,
                                               int stride, uint4 (&wa)[CH][2], float (&acc)[NT][4]) {
  mma_walk_pieces<T, NT, CH, kStageX>(
      p, L, first, end, stride, true, wa, [] {},
      [&](int t, const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4], const uint4& b, bool) {
        mma16816<T>(acc[t], a_lo, b.x, b.y);
        mma16816<T>(acc[t], a_hi, b.z, b.w);
      });
}
#endif

// The block's warps' fragments summed through shared memory: warp t < NT returns true with the sum
// of n-tile t in s (s[i]: tile row g + 8 (i / 2), x row 8 t + 2 q + i % 2); the other warps false.
// In the shared memory of mma_accumulate's x staging (MmaWarpShared): a caller that runs mma_accumulate
// again after it first waits at a block barrier for the owning warps' reads.
// In two halves: every warp's fragments into shared memory and the barrier (mma_block_partials), then the
// owning warp's sum (mma_block_owner_sum).
template <int NT, int CH, bool kStageX>
__device__ __forceinline__ void mma_block_partials(const float (&acc)[NT][4]) {
  MmaWarpShared<NT, CH, kStageX>* sh = mma_shared<NT, CH, kStageX>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kStageX) __syncwarp();  // every lane of the warp has read its x pieces from these bytes
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) sh[warp].partial[t][i][lane] = acc[t][i];
  __syncthreads();
}

template <int NT, int CH, bool kStageX>
__device__ __forceinline__ void mma_block_owner_sum(float (&s)[4]) {
  const MmaWarpShared<NT, CH, kStageX>* sh = mma_shared<NT, CH, kStageX>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i] = 0.f;
    for (int v = 0; v < kMmaWarps; ++v) s[i] += sh[v].partial[warp][i][lane];
  }
}

template <int NT, int CH, bool kStageX>
__device__ __forceinline__ bool mma_block_sum(const float (&acc)[NT][4], float (&s)[4]) {
  mma_block_partials<NT, CH, kStageX>(acc);
  if (int(threadIdx.x / 32) >= NT) return false;
  mma_block_owner_sum<NT, CH, kStageX>(s);
  return true;
}

// The outputs of n-tile t a lane of the owning warp stores (mma_block_sum's s[i]: x row 8 t + 2 q + i % 2,
// column col0 + g + 8 (i / 2); with SwiGLU only i < 2, column col0 + g), their bias loaded before
// wait_for_primary() and residual after it (mma_load_output; OutputIn), by the NT owning warps only.
struct MmaOutputIn {
  OutputIn in[4];
};

// Output i of the lane in n-tile t: its x row, its column, whether it is stored.
struct MmaOutput {
  int m;
  int64_t col;
  bool live;
};

template <int kAct = kActRuntime>
__device__ __forceinline__ MmaOutput mma_output_at(const LinearParams& p, int64_t col0, int t, int i) {
  const bool swiglu = build_activation<kAct>(p) == kActSwiglu;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int m = 8 * t + 2 * q + i % 2;
  const int64_t col = swiglu ? col0 + g : col0 + g + 8 * (i / 2);
  return {m, col, !(swiglu && i >= 2) && m < p.m && col < p.n_out};
}

template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void mma_load_output_bias(const LinearParams& p, int64_t col0, int t, MmaOutputIn& o) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const MmaOutput at = mma_output_at<kAct>(p, col0, t, i);
    load_output_bias<T, kAct>(p, at.col, at.live, o.in[i]);
  }
}

template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void mma_load_output_residual(const LinearParams& p, int64_t col0, int t,
                                                         MmaOutputIn& o) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const MmaOutput at = mma_output_at<kAct>(p, col0, t, i);
    load_output_residual<T, kAct>(p, at.m, at.col, at.live, o.in[i]);
  }
}

// The epilogue of n-tile t from its summed fragment s (as mma_block_sum leaves it); with SwiGLU s[0..1]
// are gate sums and s[2..3] the up sums of the same outputs.
template <typename T, int kAct = kActRuntime>
__device__ __forceinline__ void mma_store(const LinearParams& p, int64_t col0, int t, const float (&s)[4],
                                          const MmaOutputIn& o) {
  const bool swiglu = build_activation<kAct>(p) == kActSwiglu;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const MmaOutput at = mma_output_at<kAct>(p, col0, t, i);
    if (!at.live) continue;
    if constexpr (kOutputAhead) {
      store_output<T, kAct>(p, at.m, at.col, s[i], swiglu ? s[i + 2] : 0.f, o.in[i]);
    } else {
      store_output<T, kAct>(p, at.m, at.col, s[i], swiglu ? s[i + 2] : 0.f);
    }
  }
}

// kSelfNorm: x's rows normalized inside the launch from x's own pieces (p.norm kNormLayer / kNormRms with no
// norm weight or bias: the caller folded them into w and the bias, as for the CUDA-core kernel's kFold at one
// row). With the row's mean mu (0 for RMSNorm) and rstd:
//     w . norm(x) = rstd (w . x - mu sum(w))
// so nothing waits for the statistics but the epilogue: the MMAs multiply x as it is (16-bit products are
// exact, the sums float32), and the statistics are MMAs too: per piece one more pair whose A rows are ones
// and this lane's x row sums x and x^2 of the tile's rows (uncentered; SelfNormLane), and before the wait a
// pair against a B operand of ones sums the weight rows over exactly the 16-bit values the products use.
// (Summing x - x[0] and its square on CUDA cores, the first build, doubled the kernel's instructions: ncu,
// 7.1 against 5.9 us alone at 8 rows; docs/lab-notes/linear-mlp.md.) The statistics ride the block sum's
// barrier (every warp combines all rows: the decision below is block-uniform without another barrier); the
// owning warps apply rstd and the correction.
// The correction cancels mu sum(w) out of float32 sums of terms up to (|mu| + |x - mu|) |w|, so its error,
// relative to the 16-bit rounding of the normalized row that two launches make, grows with |mu| rstd
// (the row's mean in standard deviations): about (|mu| rstd + 1) 2^-24 k against 2^-12 at worst; the
// uncentered variance loses about (|mu| rstd)^2 float32 ulps. Where a live row has |mu| rstd >
// kSelfNormMaxMean (or a non-finite sum), the block takes the row statistics again, shifted by each row's
// first element on CUDA cores (self_norm_exact_stats), and redoes every row on normalized x split into two
// 16-bit pieces ((x - mu) rstd = hi + lo, the MMAs twice): correct to float32 arithmetic, one more pass
// over x and the weights (from L2). GPT-2's residual stream never takes it; an all-equal row (variance 0)
// always does.
constexpr float kSelfNormMaxMean = 8.f;

// The 16-bit pair of ones: the B operand that sums the A rows.
template <typename T>
__device__ __forceinline__ uint32_t ones_pair() {
  return std::is_same<T, __half>::value ? 0x3C003C00u : 0x3F803F80u;
}

// A 32-bit word of two T values as floats (the low half first).
template <typename T>
__device__ __forceinline__ float2 pair_to_float2(uint32_t w) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  } else {
    __nv_bfloat162 h;
    memcpy(&h, &w, 4);
    return __bfloat1622float2(h);
  }
}

// The lane's statistics accumulators, per n-tile t an MMA accumulator of A = (ones over this lane's x row)
// times B = the tile's x rows (mma_accumulate_self): c[t][0..1] the sums of x rows 8 t + 2 q (+1), c[t][2..3]
// the products of x row 8 t + g with rows 8 t + 2 q (+1), the sum of squares of row 8 t + g where g = 2 q (+1).
template <int NT>
struct SelfNormLane {
  float c[NT][4];
};

// The per-warp statistics the block combines (kSelfNorm): each x row's (sum x~, sum x~^2) and each tile
// row's weight sum over the warp's chunks. Apart from MmaWarpShared: the redo pass stages x again.
struct SelfNormShared {
  float sum[kMmaWarps][kLinearMaxRows], sq[kMmaWarps][kLinearMaxRows];
  float wsum[kMmaWarps][16];
};

__device__ __forceinline__ SelfNormShared& self_norm_shared() {
  __shared__ SelfNormShared sh;
  return sh;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // mma.sync
// The warp's weight-row sums from the weights in registers (one group: the short build's whole K), by MMA
// pairs against ones, into shared memory (SelfNormShared, read after the block sum's barrier): constants,
// so before wait_for_primary(), off the critical path, and no registers held across the main loop.
template <typename T, int CH>
__device__ __forceinline__ void mma_weight_sums(const uint4 (&wa)[CH][2]) {
  const uint32_t one = ones_pair<T>();
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int u = 0; u < CH; ++u) {
    uint32_t a_lo[4], a_hi[4];
    mma_a_fragments(wa[u], a_lo, a_hi);
    mma16816<T>(c, a_lo, one, one);
    mma16816<T>(c, a_hi, one, one);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane % 4 == 0) {
    self_norm_shared().wsum[warp][lane / 4] = c[0];
    self_norm_shared().wsum[warp][lane / 4 + 8] = c[2];
  }
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // mma.sync
// mma_accumulate plus the statistics (above): the same loads and products, and an MMA pair per piece that
// sums x and x^2 (SelfNormLane; the weight rows' sums were taken before the wait: mma_weight_sums).
// The owning warps' residuals (mma_load_output_residual) are issued here, behind the first group's x pieces:
// issued right after the wait (as the plain kernel does), the 16-row build, whose registers are full, spills
// them at once and so waited a whole round trip for them before its first x load.
template <typename T, int NT, int CH, bool kStageX, int kAct = kActRuntime>
__device__ __forceinline__ void mma_accumulate_self(const LinearParams& p, const MmaLane<T, NT>& L, int first,
                                                    int end, int stride, uint4 (&wa)[CH][2], float (&acc)[NT][4],
                                                    SelfNormLane<NT>& st, int64_t col0, MmaOutputIn& out_in) {
  const int warp = threadIdx.x / 32;
  const auto residuals = [&] {
    if (kOutputAhead && warp < NT) mma_load_output_residual<T, kAct>(p, col0, warp, out_in);
  };
  const uint32_t one = ones_pair<T>();
  const auto body = [&](int t, const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4], const uint4& b, bool) {
    mma16816<T>(acc[t], a_lo, b.x, b.y);
    mma16816<T>(acc[t], a_hi, b.z, b.w);
    // The statistics on the tensor cores too (pieces past k or m are zeros: nothing to mask): A's rows g are
    // ones, its rows g + 8 this lane's x row, in the weights' k-slot order (SelfNormLane).
    const uint32_t s_lo[4] = {one, b.x, one, b.y}, s_hi[4] = {one, b.z, one, b.w};
    mma16816<T>(st.c[t], s_lo, b.x, b.y);
    mma16816<T>(st.c[t], s_hi, b.z, b.w);
  };
  mma_walk_pieces<T, NT, CH, kStageX>(p, L, first, end, stride, true, wa, residuals, body);
}

// A piece of x row (mean mu, rstd rs) normalized and split: (x - mu) rs = hi + lo, each a 16-bit word pair
// (normalized first: |x - mu| alone may pass float16's range, (x - mu) rs is within sqrt(k)); zeros where
// the piece is not live.
template <typename T>
__device__ __forceinline__ void center_split(const uint4& b, float mu, float rs, bool live, uint4& hi, uint4& lo) {
  const uint32_t words[4] = {b.x, b.y, b.z, b.w};
  uint32_t h[4], l[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = pair_to_float2<T>(words[j]);
    const float d0 = live ? (f.x - mu) * rs : 0.f, d1 = live ? (f.y - mu) * rs : 0.f;
    h[j] = pack2<T>(d0, d1);
    const float2 hf = pair_to_float2<T>(h[j]);
    l[j] = pack2<T>(d0 - hf.x, d1 - hf.y);
  }
  hi = make_uint4(h[0], h[1], h[2], h[3]);
  lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// The redo pass of kSelfNorm: acc = norm(x) . w over every chunk, the weights loaded again (from L2) and x's
// rows normalized and split (center_split); mu[t], rs[t]: the mean and rstd of the lane's x row of n-tile t.
template <typename T, int NT, int CH, bool kStageX>
__device__ __forceinline__ void mma_accumulate_centered(const LinearParams& p, const MmaLane<T, NT>& L, int first,
                                                        int end, int stride, const float (&mu)[NT],
                                                        const float (&rs)[NT], float (&acc)[NT][4]) {
  uint4 wa[CH][2];
  const auto body = [&](int t, const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4], const uint4& b, bool live) {
    uint4 hi, lo;
    center_split<T>(b, mu[t], rs[t], live, hi, lo);
    mma16816<T>(acc[t], a_lo, hi.x, hi.y);
    mma16816<T>(acc[t], a_hi, hi.z, hi.w);
    mma16816<T>(acc[t], a_lo, lo.x, lo.y);
    mma16816<T>(acc[t], a_hi, lo.z, lo.w);
  };
  mma_walk_pieces<T, NT, CH, kStageX>(p, L, first, end, stride, false, wa, [] {}, body);
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // mma.sync
// The redo pass's statistics, every thread of the block once (after a barrier that ends every read of
// SelfNormShared): each lane sums x - x[row][0] and its square over its own pieces (plain loads from L2,
// float32, as kFold and csrc/layer_norm shift), the quads and warps combine them through SelfNormShared, and
// lane m % 16 of every warp returns row m's mean and rstd.
template <typename T, int NT>
__device__ __forceinline__ void self_norm_exact_stats(const LinearParams& p, const MmaLane<T, NT>& L, int chunks,
                                                      float& mean, float& rstd) {
  SelfNormShared& ns = self_norm_shared();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  float shift[NT], sum[NT], sq[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    shift[t] = L.xlive[t] ? to_float(*(L.xrow[t] - q * 8)) : 0.f;
    sum[t] = sq[t] = 0.f;
  }
  for (int c = warp; c < chunks; c += kMmaWarps) {
    if (c * 32 + q * 8 >= p.k) continue;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (!L.xlive[t]) continue;
      const uint4 b = *reinterpret_cast<const uint4*>(L.xrow[t] + c * 32);
      const uint32_t words[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = pair_to_float2<T>(words[j]);
        const float d0 = f.x - shift[t], d1 = f.y - shift[t];
        sum[t] += d0 + d1;
        sq[t] = fmaf(d0, d0, fmaf(d1, d1, sq[t]));
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
      sum[t] += __shfl_xor_sync(0xffffffffu, sum[t], off);
      sq[t] += __shfl_xor_sync(0xffffffffu, sq[t], off);
    }
    if (q == 0) ns.sum[warp][8 * t + g] = sum[t], ns.sq[warp][8 * t + g] = sq[t];
  }
  __syncthreads();
  const int m = lane % 16;
  float s1 = 0.f, s2 = 0.f;
  for (int v = 0; v < kMmaWarps; ++v) s1 += ns.sum[v][m], s2 += ns.sq[v][m];
  float x0 = __shfl_sync(0xffffffffu, shift[0], 4 * (m % 8));
  if constexpr (NT == 2) {
    const float x0_hi = __shfl_sync(0xffffffffu, shift[1], 4 * (m % 8));
    if (m >= 8) x0 = x0_hi;
  }
  const float inv_k = 1.f / float(p.k), dmean = s1 * inv_k;
  mean = x0 + dmean;
  rstd = rsqrtf(fmaxf(fmaf(s2, inv_k, -dmean * dmean), 0.f) + p.eps);
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // mma.sync
// kSelfNorm's block phase, every thread of the block once (after mma_accumulate_self): the lanes' statistics
// summed over each quad (the lanes of one x row), then with the fragments through shared memory (one
// barrier); every warp combines the 16 rows (lane m % 16: row m) into mean and rstd, identically, so the
// redo decision is block-uniform. Then either the owning warps' epilogue, rstd (s - mean sum(w)), or every
// warp's redo pass on normalized x and the plain epilogue.
template <typename T, int NT, int CH, bool kStageX, int kAct = kActRuntime>
__device__ __forceinline__ void mma_self_norm_finish(const LinearParams& p, int64_t col0, const MmaLane<T, NT>& L,
                                                     int chunks, const float (&acc)[NT][4], SelfNormLane<NT>& st,
                                                     const MmaOutputIn& out_in) {
  SelfNormShared& ns = self_norm_shared();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int t = 0; t < NT; ++t) {  // SelfNormLane's layout: row sums in lanes g = 0, squares on the diagonal
    if (g == 0) ns.sum[warp][8 * t + 2 * q] = st.c[t][0], ns.sum[warp][8 * t + 2 * q + 1] = st.c[t][1];
    if (g / 2 == q) ns.sq[warp][8 * t + g] = st.c[t][2 + g % 2];
  }
  mma_block_partials<NT, CH, kStageX>(acc);

  // Row m = lane % 16 (rows of n-tiles this build does not have: dead, never stored). Uncentered sums: the
  // variance E[x^2] - mean^2 loses ~(|mean| rstd)^2 float32 ulps, within kSelfNormMaxMean^2 on this path.
  const int m = lane % 16;
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int v = 0; v < kMmaWarps; ++v) s1 += ns.sum[v][m], s2 += ns.sq[v][m];
  const bool layer = p.norm == kNormLayer;
  const float inv_k = 1.f / float(p.k);
  float mean = layer ? s1 * inv_k : 0.f;
  const float var = fmaxf(fmaf(s2, inv_k, -mean * mean), 0.f);  // RMSNorm: mean(x^2)
  float rstd = rsqrtf(var + p.eps);
  const bool redo = layer && m < p.m && !(isfinite(s2) && fabsf(mean) * rstd <= kSelfNormMaxMean);
  if (!__any_sync(0xffffffffu, redo)) {
    if (warp >= NT) return;
    float s[4];
    mma_block_owner_sum<NT, CH, kStageX>(s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 8 * warp + 2 * q + i % 2;
      const float mean_i = __shfl_sync(0xffffffffu, mean, row), rstd_i = __shfl_sync(0xffffffffu, rstd, row);
      float ws = 0.f;
      for (int v = 0; v < kMmaWarps; ++v) ws += ns.wsum[v][g + 8 * (i / 2)];
      s[i] = rstd_i * fmaf(-mean_i, ws, s[i]);
    }
    mma_store<T, kAct>(p, col0, warp, s, out_in);
    return;
  }
  // The redo pass (every warp): the rows' statistics again, exactly (self_norm_exact_stats), then the block's
  // products again on normalized x. The staging slots it writes alias this warp's own partials, which no
  // warp reads on this path.
  __syncthreads();  // every warp has read SelfNormShared's sums above
  self_norm_exact_stats<T, NT>(p, L, chunks, mean, rstd);
  float mu[NT], rs[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    mu[t] = __shfl_sync(0xffffffffu, mean, 8 * t + g);
    rs[t] = __shfl_sync(0xffffffffu, rstd, 8 * t + g);
  }
  float acc2[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc2[t][i] = 0.f;
  __syncwarp();
  mma_accumulate_centered<T, NT, CH, kStageX>(p, L, warp, chunks, kMmaWarps, mu, rs, acc2);
  float s[4];
  if (mma_block_sum<NT, CH, kStageX>(acc2, s)) mma_store<T, kAct>(p, col0, warp, s, out_in);
}
#endif

// NT n-tiles of 8 rows of x (NT = 1: up to 8 rows, 2: up to 16, 4: up to 32); kShort: the short build (CH chunks
// in flight, kMmaShortMinBlocks blocks per SM), else the long one (kMmaLongChunks, unbounded); four n-tiles have one
// build (kMmaWideChunks, kMmaWideMinBlocks) whatever kShort. No norm in
// the plain build: linear.cpp normalizes 2-16 16-bit rows in a launch of their own (the prologue measured
// slower in GPT-2's step, and a fold into the products slower still: docs/lab-notes/linear-mlp.md), except
// 2-8 rows with the norm folded into the weight (kSelfNorm, below).
// kSelfNorm: x's rows normalized from their own pieces (p.norm kNormLayer / kNormRms; mma_accumulate_self).
// kAct: the activation compiled in, or kActRuntime (p.activation; launch_mma_builds says which runs).
// The wide build's row group g of a launch (kMmaGroupRows rows of x, residual and out from row g x 32); the other
// builds take every row (groups 1).
template <typename T, int NT>
__device__ __forceinline__ LinearParams mma_row_group(const LinearParams& p, int g) {
  if constexpr (NT < 4) return p;
  LinearParams q = p;
  const int first = g * kMmaGroupRows;
  q.m = min(kMmaGroupRows, p.m - first);
  q.x = static_cast<const T*>(p.x) + int64_t(first) * p.x_stride;
  if (p.residual != nullptr) q.residual = static_cast<const T*>(p.residual) + int64_t(first) * p.r_stride;
  q.out = static_cast<T*>(p.out) + int64_t(first) * p.o_stride;
  return q;
}

template <typename T, int NT, bool kShort, bool kStageX, bool kSelfNorm = false, int kAct = kActRuntime>
__global__ void __launch_bounds__(kLinearMmaThreads, NT >= 4 ? kMmaWideMinBlocks : kShort ? kMmaShortMinBlocks : 1)
    linear_mma_kernel(const LinearParams params) {
  constexpr int CH = NT >= 4 ? kMmaWideChunks : kShort ? kMmaShortChunks : kMmaLongChunks;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int groups = NT >= 4 ? linear_row_groups(params.m) : 1;
  const LinearParams p = mma_row_group<T, NT>(params, int(blockIdx.x) % groups);
  const int tile = int(blockIdx.x) / groups;
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits
  const int warp = threadIdx.x / 32;
  // Spelled out here, not through build_activation: that form moved ptxas's schedule of the kActRuntime builds
  // (docs/lab-notes/linear-mlp.md).
  const bool swiglu = kAct == kActRuntime ? p.activation == kActSwiglu : (kAct & kActCodeMask) == kActSwiglu;
  const int64_t col0 = int64_t(tile) * (swiglu ? 8 : 16);
  const MmaLane<T, NT> L = mma_lane<T, NT, kAct>(p, col0, threadIdx.x % 32);
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  const int chunks = (p.k + 31) / 32;
  // As in linear_gemv_kernel: the first weights on their way into registers while the previous kernel
  // drains; then x.
  uint4 wa[CH][2];
  mma_load_weights<T, NT, CH>(p, L, warp, chunks, kMmaWarps, wa);
  MmaOutputIn out_in;  // the owning warps' (warp < NT) epilogue operands, loaded ahead
  if (kOutputAhead && warp < NT) mma_load_output_bias<T, kAct>(p, col0, warp, out_in);
  if constexpr (kSelfNorm) mma_weight_sums<T, CH>(wa);
  wait_for_primary();
  if (kOutputAhead && !kSelfNorm && warp < NT) mma_load_output_residual<T, kAct>(p, col0, warp, out_in);
  if constexpr (kSelfNorm) {
    SelfNormLane<NT> st;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.c[t][i] = 0.f;
    mma_accumulate_self<T, NT, CH, kStageX, kAct>(p, L, warp, chunks, kMmaWarps, wa, acc, st, col0, out_in);
    launch_dependents();
    mma_self_norm_finish<T, NT, CH, kStageX, kAct>(p, col0, L, chunks, acc, st, out_in);
    return;
  }
  mma_accumulate<T, NT, CH, kStageX>(p, L, warp, chunks, kMmaWarps, wa, acc);
  launch_dependents();

  float s[4];
  if (mma_block_sum<NT, CH, kStageX>(acc, s)) mma_store<T, kAct>(p, col0, warp, s, out_in);
#else
  __trap();  // launched only where linear_mma_arch says it was compiled (sm_80 and later)
#endif
}

// The dynamic shared memory of a kNorm launch (0 without): p.m rows of xs_pitch elements, then the
// staged weight and bias (linear_norm_smem_bytes).
template <typename T, bool kNorm>
size_t norm_smem(const LinearParams& p) {
  const int w_bytes = p.norm_weight != nullptr ? (p.nw_fp32 ? 4 : int(sizeof(T))) : 0;
  const int b_bytes = p.norm_bias != nullptr ? (p.nb_fp32 ? 4 : int(sizeof(T))) : 0;
  return kNorm ? linear_norm_smem_bytes(p.m, p.k, int(sizeof(T)), w_bytes, b_bytes, p.affine_smem) : 0;
}

// A kNorm kernel may take up to kLinearNormSmemBytes of dynamic shared memory (the launcher never asks
// for more): allowed on each device before its first launch there (common/func_attrs.h).
template <bool kNorm, typename Kernel>
void allow_norm_smem(Kernel kernel) {
  if constexpr (kNorm) allow_dynamic_smem(kernel, kLinearNormSmemBytes);
}

template <typename T, int MT, int NB, bool kNorm>
void launch_nb(const LinearParams& params, int threads, cudaStream_t stream) {
  const LinearParams p = with_linear_pdl_early(params);
  const int64_t cols_per_block = p.activation == kActSwiglu ? NB / 2 : NB;
  const dim3 grid(unsigned((p.n_out + cols_per_block - 1) / cols_per_block));
  // Programmatic where the kernel has the sm_90 code (common/pdl.cuh); checked once per kernel.
  // kFold where it applies (the header): no shared memory, so not allow_norm_smem's attribute.
  // One row only: at two, ptxas needs ~120 registers for it (or spills under the 64-register bound).
  constexpr bool kFoldable = kNorm && !std::is_same_v<T, float> && MT == 1;
  if constexpr (kFoldable) {
    if (p.norm_weight == nullptr && p.norm_bias == nullptr) {
      if (p.vec) {
        constexpr auto kernel = linear_gemv_kernel<T, MT, NB, true, true, true>;
        static const bool pdl = programmatic_capable(kernel);
        launch_programmatic(pdl, kernel, grid, dim3(threads), 0, stream, p);
      } else {
        constexpr auto kernel = linear_gemv_kernel<T, MT, NB, false, true, true>;
        static const bool pdl = programmatic_capable(kernel);
        launch_programmatic(pdl, kernel, grid, dim3(threads), 0, stream, p);
      }
      return;
    }
  }
  if (p.vec) {
    constexpr auto kernel = linear_gemv_kernel<T, MT, NB, true, kNorm>;
    allow_norm_smem<kNorm>(kernel);
    static const bool pdl = programmatic_capable(kernel);
    launch_programmatic(pdl, kernel, grid, dim3(threads), norm_smem<T, kNorm>(p), stream, p);
  } else {
    constexpr auto kernel = linear_gemv_kernel<T, MT, NB, false, kNorm>;
    allow_norm_smem<kNorm>(kernel);
    static const bool pdl = programmatic_capable(kernel);
    launch_programmatic(pdl, kernel, grid, dim3(threads), norm_smem<T, kNorm>(p), stream, p);
  }
}

}  // namespace linear

namespace linear {
// The activation builds: the plain and self-normalizing tensor-core launches (linear_mma_kernel,
// linear_splitk_kernel) run a build with p.activation compiled in (kAct kActNone, kActGeluTanh or kActSwiglu)
// instead of one kActRuntime build that reads it: no SwiGLU column and row arithmetic before the wait, no
// activation switch in the epilogue. Measured against the kActRuntime build in one call (H100, GPT-2's captured
// decode step, fp16, prompt 128, two rounds; docs/lab-notes/linear-mlp.md): batch 1 unchanged (its GEMVs are the
// one-row kernels), batch 4 -9..-12 us a step, batch 8 -7..-9, batch 16 -5. The 16-row register-path build (the
// lm_head at 9-16 rows) spills 8 bytes under it; keeping that one build at kActRuntime measured the same
// (within 1 us), so every tensor-core build is an activation build.

template <int kAct>
using ActBuild = std::integral_constant<int, kAct>;
// The epilogue builds: each activation build comes in four, with the bias's and the residual's presence
// compiled in (kEpiKnown) instead of read from p.bias / p.residual (GPT-2's c_attn and c_fc have a bias and no
// residual, its projections both, its lm_head neither): no residual address arithmetic after the wait where
// there is none, no null checks in the epilogue. Measured against the activation builds alone in one call
// (H100, GPT-2's captured decode step, fp16, prompt 128, two rounds; docs/lab-notes/linear-mlp.md): batch 1
// unchanged, batch 4 -11..-12 us a step, batch 8 -8..-11, batch 16 -2..-4.
template <int kActCode, typename Launch>
void with_build_epilogue(const LinearParams& p, const Launch& launch) {
  const bool bias = p.bias != nullptr, residual = p.residual != nullptr;
  if (bias && residual) return launch(ActBuild<kActCode | kEpiKnown | kEpiBias | kEpiResidual>{});
  if (bias) return launch(ActBuild<kActCode | kEpiKnown | kEpiBias>{});
  if (residual) return launch(ActBuild<kActCode | kEpiKnown | kEpiResidual>{});
  return launch(ActBuild<kActCode | kEpiKnown>{});
}

// Calls launch(std::integral_constant<int, kAct>) with p's build: p.activation's own, with its bias and residual
// (with_build_epilogue).
template <typename Launch>
void with_build_activation(const LinearParams& p, const Launch& launch) {
  // linear.cpp admits no other code
  if (p.activation == kActGeluTanh) return with_build_epilogue<kActGeluTanh>(p, launch);
  if (p.activation == kActSwiglu) return with_build_epilogue<kActSwiglu>(p, launch);
  return with_build_epilogue<kActNone>(p, launch);
}

// One or two n-tiles (up to 16 rows): the short build, x staged (mma_stage_x) where the grid allows it, or the long
// build for longer rows. kSelfNorm has the short build only: its launches come through linear_mma_self_norm_fits,
// which admits no other.
template <typename T, int MT, bool kSelfNorm, int kAct>
void launch_mma_tiles(const LinearParams& p, const dim3 grid, int sms, cudaStream_t stream) {
  static_assert(MT == 8 || MT == 16, "the short and long builds take one or two n-tiles of 8 rows of x");
  constexpr auto short_build = linear_mma_kernel<T, MT / 8, true, false, kSelfNorm, kAct>;
  constexpr auto staged_build = linear_mma_kernel<T, MT / 8, true, MT == 16, kSelfNorm, kAct>;
  static const bool pdl_short = programmatic_capable(short_build), pdl_staged = programmatic_capable(staged_build);
  const bool is_short = mma_short((p.k + 31) / 32);
  if constexpr (!kSelfNorm) {
    constexpr auto long_build = linear_mma_kernel<T, MT / 8, false, false, false, kAct>;
    static const bool pdl_long = programmatic_capable(long_build);
    if (!is_short) {
      launch_programmatic(pdl_long, long_build, grid, dim3(kLinearMmaThreads), 0, stream, p);
      return;
    }
  }
  const bool staged = mma_stage_x<MT / 8>(grid.x, sms);
  launch_programmatic(staged ? pdl_staged : pdl_short, staged ? staged_build : short_build, grid,
                      dim3(kLinearMmaThreads), 0, stream, p);
}

// Four n-tiles (17-32 rows, linear.cpp's kMmaWideMaxRows): the wide build; fewer: launch_mma_tiles.
template <typename T, int MT, bool kSelfNorm, int kAct>
void launch_mma_act(const LinearParams& p, int sms, cudaStream_t stream) {
  const int64_t cols_per_block = p.activation == kActSwiglu ? 8 : 16;
  const dim3 grid(unsigned((p.n_out + cols_per_block - 1) / cols_per_block * (MT == 32 ? linear_row_groups(p.m) : 1)));
  if constexpr (MT == 32) {  // the wide build (kMmaWideChunks): one build for every K, x in registers
    static_assert(!kSelfNorm, "the wide build takes no norm");
    constexpr auto wide_build = linear_mma_kernel<T, MT / 8, false, false, false, kAct>;
    static const bool pdl_wide = programmatic_capable(wide_build);
    launch_programmatic(pdl_wide, wide_build, grid, dim3(kLinearMmaThreads), 0, stream, p);
  } else {
    launch_mma_tiles<T, MT, kSelfNorm, kAct>(p, grid, sms, stream);
  }
}

template <typename T, int MT, bool kSelfNorm>
void launch_mma_builds(const LinearParams& params, int sms, cudaStream_t stream) {
  const LinearParams p = with_linear_pdl_early(params);
  with_build_activation(p, [&](auto act) { launch_mma_act<T, MT, kSelfNorm, decltype(act)::value>(p, sms, stream); });
}
}  // namespace linear

template <typename T, int MT>
void launch_linear_mma(const LinearParams& p, int sms, cudaStream_t stream) {
  linear::launch_mma_builds<T, MT, false>(p, sms, stream);
}

template <typename T, int MT>
bool linear_mma_self_norm_fits(int64_t k, int64_t blocks, int sms) {
  cudaFuncAttributes attr{};
  static const bool built =
      cudaFuncGetAttributes(&attr, linear::linear_mma_kernel<T, MT / 8, true, false, true, kArchProbeBuild>) ==
          cudaSuccess &&
      attr.binaryVersion >= 80;
  return built && linear::mma_short((k + 31) / 32) && linear::mma_one_wave(blocks, sms);
}

template <typename T, int MT>
void launch_linear_mma_self_norm(const LinearParams& p, int sms, cudaStream_t stream) {
  linear::launch_mma_builds<T, MT, true>(p, sms, stream);
}

template <typename T, int MT>
int linear_mma_arch() {
  cudaFuncAttributes attr{};
  // MT 32: the wide build's own instantiation (kShort false), not one more kernel.
  return cudaFuncGetAttributes(&attr, linear::linear_mma_kernel<T, MT / 8, MT < 32, false, false, kArchProbeBuild>) ==
                 cudaSuccess
             ? attr.binaryVersion
             : 0;
}

template <typename T, int MT, bool kNorm>
void launch_linear_gemv(const LinearParams& p, int rows_per_block, int threads, cudaStream_t stream) {
  switch (rows_per_block) {
    case 1: linear::launch_nb<T, MT, 1, kNorm>(p, threads, stream); break;
    case 2: linear::launch_nb<T, MT, 2, kNorm>(p, threads, stream); break;
    default: linear::launch_nb<T, MT, 4, kNorm>(p, threads, stream); break;
  }
}

}  // namespace fused_attn
