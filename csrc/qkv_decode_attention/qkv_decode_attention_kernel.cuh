// qkv_decode_attention_kernel: a pre-LN block's QKV projection and its decode attention in one launch, one
// thread-block cluster of 8 blocks per (head, group of G sequences), for one new token per sequence.
//
//     xn  = (x - mean(x)) * rsqrt(var(x) + eps)          (LayerNorm without affine: folded into w_qkv, b_qkv)
//     qkv = xn · w_qkvᵀ + b_qkv, rounded to T             (the head's 3 x 64 columns only)
//     k, v appended to the cache at slot cache_seqlens[b]; o = softmax(q · Kᵀ · scale) · V over slots
//     cache_leftpad[b] .. cache_seqlens[b], rounded to T into out[b, 0, head * 64 ..]
//
// Why: the QKV GEMV and decode attention are two launches a layer on GPT-2's critical path (bench/profile),
// joined by a programmatic-dependent-launch hop although the attention of head h needs only head h's 192
// columns. Here each of a cluster's 8 blocks holds 24 of the head's rows (36 KB for GPT-2 small, loaded into
// registers before griddepcontrol.wait), the columns go through distributed shared memory behind one cluster
// barrier, and each sequence's keys are split over S = 8 / G blocks (S > 1: merged in the sequence's lead).
//
// G = 1 (batch 1): every warp normalizes the row itself (3 16-byte pieces a lane, two warp reductions, float32)
// and computes 3 columns on CUDA cores; no block barrier stands between x and the dot products.
// G = 2 / 4 / 8 (2 / 3-4 / 5+ rows): warp g normalizes row g into shared memory, rounded to T (as
// the two-launch chain's norm rounds it), the warps split d and run mma.sync with the block's rows as M and the
// G rows as N.
// Every G attends 16 keys a warp a pass: their scores reduced by one transposed butterfly, one rescale a pass,
// the next pass requested before this one's arithmetic, the lengths read and the first pass requested right
// after the wait (under the projection). Against a G = 1 loop of 8 keys a pass, requested after the cluster
// exchange, with a warp reduction and a rescale a key: H200, GPT-2's step at a 512-token prompt, batch 1,
// 223.1 -> 192.9 us (at a 128-token prompt 190.8 / 191.4, even).
//
// Measured in GPT-2's step (bench.time_decode_graph; docs/lab-notes/decode-attention.md), us against the two
// launches: H200 batch 1 206 -> 191, and at a 512-token prompt 212.5 -> 192.9; H100 batch 1 214 -> 205,
// batch 4 233 -> 215, batch 8 even, batch 16 320 -> 340 (two clusters a head read the rows twice, two blocks
// a SM); H200 batch 16 with the late trigger after the wait: 295.6 against 292.6. GPT-2 uses it at up to 8
// rows (fused_attn/gpt2.py).
//
// (The mean is float32 with no cancellation redo, unlike linear's kSelfNorm: at 16-bit inputs its error stays
// far below the inputs' own rounding; the drawn tests include rows of |mean| / std = 500.) float32
// throughout otherwise; q / k / v rounded to T once (as the chain stores them), o rounded once.
//
// Loads after the wait go to L2 (ld.cg, a relaxed load for the lengths): L1 is not coherent.
// Lengths out of bounds (cache_seqlens[b] outside [0, max_len - 1], cache_leftpad[b] outside [0,
// cache_seqlens[b]]): that sequence's output is NaN and its cache is not written. A cluster's slots past the
// batch compute nothing that is stored and only join the cluster barriers.
//
// Shapes: head_dim 64, d = heads x 64 with d / 256 in [1, kQkvMaxPieces] (16-byte pieces a lane a row).
//
// Tests: tests/test_qkv_decode_attention.py, tests/sanitizer_cases.py (group qkv); measured in GPT-2's step:
// bench/bench_gpt2.py, python -m bench.time_decode_graph (bench/ab.py runs it against a copy of the tree
// with GPT-2's rule changed, for the A/B).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>
#include <cstdint>

#include "../common/cluster.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/reduce.cuh"
#include "../common/vec_dtypes.cuh"
#include "qkv_decode_attention_launch.h"

namespace fused_attn {

namespace qkv {

constexpr int kWarps = kQkvThreads / 32;
constexpr int kRowsPerBlock = 3 * kQkvHeadDim / kQkvClusterBlocks;  // 24
constexpr int kRowsPerWarp = kRowsPerBlock / kWarps;                // 3
constexpr int kRowsKeys = 16;  // keys a warp loads at once: the transposed butterfly's 16
static_assert(kRowsPerWarp * kWarps * kQkvClusterBlocks == 3 * kQkvHeadDim, "the head's rows over the cluster");

// The G > 1 builds' blocks a SM for ptxas (__launch_bounds__): 2 gives them 121-127 registers, no spills. 3 (80
// registers, to fit beside the split-K projection's blocks) spilled in the attention loop: GPT-2's batch-8 step
// +84 us on an H200 (bench.time_decode_graph).
constexpr int kQkvRowsMinBlocks = 2;

// S: the ranks that attend one sequence (kQkvClusterBlocks / G: 8 at one row, 1 from 5 rows).
template <int G>
constexpr int ranks_a_sequence() { return kQkvClusterBlocks / G; }

template <int S>
struct Shared {
  float qkv[3 * kQkvHeadDim];  // q, k, v of the sequence this rank attends (as rounded to T), from the ranks
  float m[kWarps], l[kWarps];
  float o[kWarps][kQkvHeadDim];
  float pm[S], pl[S];  // a sequence's lead rank (split 0): the S ranks' partials
  float po[S][kQkvHeadDim];
};

// G > 1 rows a cluster: x's G rows normalized (rounded to T, as 16-byte pieces; each row kXnPad elements longer
// than d so that the B fragments' 16-byte reads of rows n and n + 1 fall in different bank halves), and the
// warps' partial products (24 rows x 8 columns a warp, columns >= G unused).
constexpr int kXnPad = 32;
template <typename T, int G, int P>
struct RowsScratch {
  alignas(16) T xn[G][P * 256 + kXnPad];  // read as 16-byte pieces
  float red[kWarps][kRowsPerBlock][8];
};
template <typename T, int G, int P>
struct SharedRows : Shared<ranks_a_sequence<G>()> {
  RowsScratch<T, G, P> rows;
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
}

__device__ __forceinline__ float warp_sum(float v) { return group_reduce<32>(v, nullptr, SumOp()); }

// Lane `lane`'s two output columns of N softmax partials (m, l, o: the log-sum-exp merge, in index order;
// a partial with l = 0 had no keys and counts for nothing).
template <int N>
__device__ __forceinline__ void merge_partials(const float* m, const float* l, const float (*o)[kQkvHeadDim], int lane,
                                               float& mm, float& ll, float& o0, float& o1) {
  mm = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i) mm = fmaxf(mm, m[i]);
  ll = o0 = o1 = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float f = l[i] > 0.f ? __expf(m[i] - mm) : 0.f;
    ll += l[i] * f;
    o0 += o[i][2 * lane] * f;
    o1 += o[i][2 * lane + 1] * f;
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void store_cluster_f32(uint32_t addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
#endif

// x's row for sequence row `bx`: P pieces of 8 a lane, minus the row's mean; rstd its 1 / sqrt(var + eps)
// (two warp reductions: mean, then variance).
template <typename T, int P>
__device__ __forceinline__ void centered_row(const QkvParams& p, int bx, int lane, float (&xv)[P][8], float& rstd) {
  const T* xrow = static_cast<const T*>(p.x) + int64_t(bx) * p.x_stride;
  const int d = P * 256;
#pragma unroll
  for (int c = 0; c < P; ++c) unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(xrow) + lane + 32 * c), xv[c]);
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < P; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) s += xv[c][e];
  const float mean = warp_sum(s) / float(d);
  float s2 = 0.f;
#pragma unroll
  for (int c = 0; c < P; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      xv[c][e] -= mean;
      s2 += xv[c][e] * xv[c][e];
    }
  rstd = rsqrtf(warp_sum(s2) / float(d) + p.eps);
}

// G: sequences a cluster (1, 2, 4 or 8; the launcher picks it from the batch). P: 16-byte pieces of x a lane
// holds (d = P x 256).
//   G = 1: every warp normalizes the row itself and computes 3 columns on CUDA cores; the 8 ranks split the
//     sequence's keys.
//   G > 1: warp g < G normalizes row g into shared memory (rounded to T), the 8 warps split d and multiply
//     the block's 24 rows by the G rows with mma.sync (the rows as M, padded to 32; the sequences as N,
//     padded to 8), the warps' partials are summed in shared memory, and each sequence's 192 columns go to
//     the S = 8 / G ranks that attend it (rank r: sequence r / S, a 1 / S share of its keys).
// (A G = 16 build at 9-16 rows, two groups of 8 warps a block each attending a whole sequence, measured
// +20 us a step at batch 16 on an H100, bench.time_decode_graph; docs/lab-notes/decode-attention.md.)
template <typename T, int G, int P>
__global__ void __launch_bounds__(kQkvThreads, G == 1 ? 1 : kQkvRowsMinBlocks)
    qkv_decode_attention_kernel(const QkvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(G == 1 || G == 2 || G == 4 || G == 8, "sequences a cluster");
  constexpr int S = ranks_a_sequence<G>();
  using Sh = std::conditional_t<G == 1, Shared<S>, SharedRows<T, G, P>>;
  __shared__ Sh sh;
  const int rank = int(blockIdx.x), head = int(blockIdx.y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int d = P * 256;
  // This block's sequence (row of x) and its rank's share of that sequence's keys.
  const int g_mine = G == 1 ? 0 : rank / S, split = G == 1 ? rank : rank % S;
  const int lead = rank - split;
  const int b_raw = int(blockIdx.z) * G + g_mine;
  const bool live = G == 1 || b_raw < p.batch;  // the last cluster's slots past the batch only join the barriers
  const int b = G == 1 ? b_raw : min(b_raw, p.batch - 1);
  cluster_arrive_relaxed();  // phase 1: this block has started (remote stores into it wait for that)

  // 1. The block's 24 weight rows (head-local rows rank * 24 .. + 23 of [q; k; v]) and biases, before the
  //    wait: they are constants.
  const T* w = static_cast<const T*>(p.w_qkv);
  auto w_row = [&](int i) {  // head-local row i -> its index in w_qkv
    const int hr = rank * kRowsPerBlock + i;
    return int64_t(hr / kQkvHeadDim) * d + head * kQkvHeadDim + hr % kQkvHeadDim;
  };
  // G = 1: this warp's 3 rows, whole.  G > 1: rows lane / 4, 8 + lane / 4 and 16 + lane / 4, the d / 8 columns
  // of the warp: 16 bytes at column warp * d / 8 + 32 c + 8 (lane % 4) for c < P (an A fragment's k pairs
  // relabelled: the B fragments read x's columns the same way).
  uint4 wr[kRowsPerWarp][P];
  float bias[kRowsPerWarp];
  float bias_t = 0.f;  // G > 1: thread t < 24 G's row t % 24
  if constexpr (G == 1) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t grow = w_row(warp * kRowsPerWarp + i);
#pragma unroll
      for (int c = 0; c < P; ++c)
        wr[i][c] = load_stream(reinterpret_cast<const uint4*>(w + grow * p.w_stride) + lane + 32 * c);
      bias[i] = p.b_qkv != nullptr ? to_float(static_cast<const T*>(p.b_qkv)[grow]) : 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t grow = w_row(8 * i + lane / 4);
#pragma unroll
      for (int c = 0; c < P; ++c)
        wr[i][c] = load_stream(w + grow * p.w_stride + warp * (d / 8) + 32 * c + 8 * (lane % 4));
    }
    if (p.b_qkv != nullptr && threadIdx.x < kRowsPerBlock * G)
      bias_t = to_float(static_cast<const T*>(p.b_qkv)[w_row(threadIdx.x % kRowsPerBlock)]);
  }
  T* kc = static_cast<T*>(p.k_cache) + int64_t(b) * p.k_stride_b + int64_t(head) * p.k_stride_h;
  T* vc = static_cast<T*>(p.v_cache) + int64_t(b) * p.v_stride_b + int64_t(head) * p.v_stride_h;
  launch_dependents_early(p.pdl_early);
  if (p.pdl_early && live) {  // this rank's cached K / V rows into L2 (a hint from lengths read before the wait,
                              // as decode_attention's prefetch_cache: a stale length only makes a wrong hint)
    const int len0 = p.cache_seqlens[b], left0 = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
    if (len0 >= 0 && len0 < p.max_len && left0 >= 0 && left0 <= len0) {
      const int per0 = (len0 - left0 + 1 + S - 1) / S;
      const int kb = left0 + split * per0, ke = min(len0, kb + per0);  // slot len0 is this step's
      for (int j = kb + int(threadIdx.x); j < ke; j += kQkvThreads) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + int64_t(j) * p.k_stride_s));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + int64_t(j) * p.v_stride_s));
      }
    }
  }
  wait_for_primary();  // x and the cache's lengths are earlier kernels' outputs
  // The late trigger (a no-op after the early one): the next launch (c_proj, a split-K GEMV) may start and
  // fetch its weights under this launch's projection and attention, as decode_attention lets it. Without it
  // a late launch lets its dependent start only when the whole grid has exited: GPT-2's step at 16 rows
  // through this op, H200, bench.time_decode_graph, 311.4 -> 295.6 us with it; 1-8 rows even.
  launch_dependents();

  // The lengths and this rank's keys: slots [left, len] split over the sequence's S ranks; warp w takes every
  // kWarps-th. Slot len (the new key) is read from shared memory, not from the cache the lead rank writes.
  int len = 0, left = 0, k_begin = 0, k_end = 0;
  bool valid = false;
  auto read_lengths = [&] {
    len = live ? load_after_wait(p.cache_seqlens + b) : 0;
    left = live && p.cache_leftpad != nullptr ? load_after_wait(p.cache_leftpad + b) : 0;
    valid = live && len >= 0 && len < p.max_len && left >= 0 && left <= len;
    const int n_keys = valid ? len - left + 1 : 0;
    const int per = (n_keys + S - 1) / S;
    k_begin = left + split * per;
    k_end = min(left + n_keys, k_begin + per);
  };
  read_lengths();
  // A warp's keys go kRowsKeys a pass (slot k_begin + warp + kWarps (pass kRowsKeys + j)), this lane's two
  // columns of K and V as packed pairs; the first pass is requested here, under the projection below.
  auto pass_slot = [&](int pass, int j) { return k_begin + warp + kWarps * (pass * kRowsKeys + j); };
  uint32_t kbuf[kRowsKeys], vbuf[kRowsKeys];
  auto request = [&](uint32_t(&kr)[kRowsKeys], uint32_t(&vr)[kRowsKeys], int pass) {
#pragma unroll
    for (int j = 0; j < kRowsKeys; ++j) {
      const int slot = pass_slot(pass, j);
      const bool cached = slot < k_end && slot != len;
      kr[j] = cached ? __ldcg(reinterpret_cast<const unsigned*>(kc + int64_t(slot) * p.k_stride_s + 2 * lane)) : 0u;
      vr[j] = cached ? __ldcg(reinterpret_cast<const unsigned*>(vc + int64_t(slot) * p.v_stride_s + 2 * lane)) : 0u;
    }
  };
  request(kbuf, vbuf, 0);

  if constexpr (G == 1) {
    // 2. The row of x, normalized by every warp on its own.
    float xv[P][8], rstd;
    centered_row<T, P>(p, b, lane, xv, rstd);

    // 3. The warp's 3 columns: dot products, bias, one rounding to T; sent to every rank of the cluster.
    float col[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < P; ++c) {
        float wf[8];
        unpack8<T>(wr[i][c], wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xv[c][e], acc);
      }
      col[i] = to_float(from_float<T>(warp_sum(acc) * rstd + bias[i]));
    }
    cluster_wait();  // phase 1: every block has started
    if (lane < kQkvClusterBlocks) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i)
        store_cluster_f32(cluster_addr(&sh.qkv[rank * kRowsPerBlock + warp * kRowsPerWarp + i], lane), col[i]);
    }
  } else {
    // 2. Warp g < G: row g of the cluster's rows, normalized and rounded to T into shared memory (zeros past
    //    the batch).
    const int b0 = int(blockIdx.z) * G;
    if (warp < G) {
      uint4* dst = reinterpret_cast<uint4*>(sh.rows.xn[warp]);
      if (b0 + warp < p.batch) {
        float xv[P][8], rstd;
        centered_row<T, P>(p, b0 + warp, lane, xv, rstd);
#pragma unroll
        for (int c = 0; c < P; ++c) {
          uint4 u;
          u.x = pack2<T>(xv[c][0] * rstd, xv[c][1] * rstd);
          u.y = pack2<T>(xv[c][2] * rstd, xv[c][3] * rstd);
          u.z = pack2<T>(xv[c][4] * rstd, xv[c][5] * rstd);
          u.w = pack2<T>(xv[c][6] * rstd, xv[c][7] * rstd);
          dst[lane + 32 * c] = u;
        }
      } else {
#pragma unroll
        for (int c = 0; c < P; ++c) dst[lane + 32 * c] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncthreads();

    // 3. The warp's share of d: rows 0-15 (m-tile 0) and 16-23 (m-tile 1, its rows 24-31 zero) times 8 of
    //    the G rows (n = lane / 4; n >= G reads zeros), two k16 steps a piece.
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    const int n = lane / 4;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      const uint4 xu = n < G ? *reinterpret_cast<const uint4*>(&sh.rows.xn[n < G ? n : 0][warp * (d / 8) + 32 * c +
                                                                                        8 * (lane % 4)])
                             : make_uint4(0u, 0u, 0u, 0u);
      const uint32_t a0[4] = {wr[0][c].x, wr[1][c].x, wr[0][c].y, wr[1][c].y};
      const uint32_t a1[4] = {wr[0][c].z, wr[1][c].z, wr[0][c].w, wr[1][c].w};
      const uint32_t c0[4] = {wr[2][c].x, 0u, wr[2][c].y, 0u};
      const uint32_t c1[4] = {wr[2][c].z, 0u, wr[2][c].w, 0u};
      mma16816<T>(acc0, a0, xu.x, xu.y);
      mma16816<T>(acc0, a1, xu.z, xu.w);
      mma16816<T>(acc1, c0, xu.x, xu.y);
      mma16816<T>(acc1, c1, xu.z, xu.w);
    }
    // D fragments: acc0[0 / 1] row lane / 4, columns 2 (lane % 4) + 0 / 1; acc0[2 / 3] row 8 + lane / 4;
    // acc1[0 / 1] row 16 + lane / 4 (acc1[2 / 3]: the zero rows).
    {
      const int r = lane / 4, col = 2 * (lane % 4);
      sh.rows.red[warp][r][col] = acc0[0];
      sh.rows.red[warp][r][col + 1] = acc0[1];
      sh.rows.red[warp][8 + r][col] = acc0[2];
      sh.rows.red[warp][8 + r][col + 1] = acc0[3];
      sh.rows.red[warp][16 + r][col] = acc1[0];
      sh.rows.red[warp][16 + r][col + 1] = acc1[1];
    }
    __syncthreads();
    cluster_wait();  // phase 1: every block has started
    if (threadIdx.x < kRowsPerBlock * G) {  // column (row i of the block, sequence row t / 24): to the ranks of t
      const int i = threadIdx.x % kRowsPerBlock, t = threadIdx.x / kRowsPerBlock;
      float v = 0.f;
#pragma unroll
      for (int w8 = 0; w8 < kWarps; ++w8) v += sh.rows.red[w8][i][t];
      v = to_float(from_float<T>(v + bias_t));
#pragma unroll
      for (int s = 0; s < S; ++s) store_cluster_f32(cluster_addr(&sh.qkv[rank * kRowsPerBlock + i], t * S + s), v);
    }
  }
  cluster_arrive_release();
  cluster_wait();  // phase 2: q, k, v of this rank's sequence are in its shared memory

  // 4. The sequence's lead rank appends k and v.
  const float* qkv_s = sh.qkv;  // the sequence's q, k, v
  if (valid && split == 0 && threadIdx.x < 2 * kQkvHeadDim) {
    const int t = threadIdx.x % kQkvHeadDim;
    if (threadIdx.x < kQkvHeadDim)
      kc[int64_t(len) * p.k_stride_s + t] = from_float<T>(qkv_s[kQkvHeadDim + t]);
    else
      vc[int64_t(len) * p.v_stride_s + t] = from_float<T>(qkv_s[2 * kQkvHeadDim + t]);
  }

  // 5. Attention over this rank's keys.
  const float q0 = qkv_s[2 * lane] * p.scale, q1 = qkv_s[2 * lane + 1] * p.scale;
  float m = -INFINITY, l = 0.f, o0 = 0.f, o1 = 0.f;
  // kRowsKeys keys a pass: their scores reduced together (transposed butterfly), one rescale a pass, the next
  // pass's loads in flight during this one's arithmetic.
  for (int pass = 0; pass_slot(pass, 0) < k_end; ++pass) {
    uint32_t knext[kRowsKeys], vnext[kRowsKeys];
    const bool more = pass_slot(pass + 1, 0) < k_end;
    if (more) request(knext, vnext, pass + 1);
    auto is_new = [&](int j) { return pass_slot(pass, j) == len; };
    float sc[kRowsKeys];
#pragma unroll
    for (int j = 0; j < kRowsKeys; ++j) {
      const T* ke = reinterpret_cast<const T*>(&kbuf[j]);
      const float kx = is_new(j) ? qkv_s[kQkvHeadDim + 2 * lane] : to_float(ke[0]);
      const float ky = is_new(j) ? qkv_s[kQkvHeadDim + 2 * lane + 1] : to_float(ke[1]);
      sc[j] = q0 * kx + q1 * ky;
    }
    // Transposed butterfly: after the stages over lane bits 0-3, lane l holds key (l's low 4 bits reversed)'s
    // sum over 16 lanes; the xor-16 step adds the other half-warp's.
#pragma unroll
    for (int half = kRowsKeys / 2, bit = 1; half >= 1; half /= 2, bit *= 2) {
      const bool upper = (lane & bit) != 0;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = upper ? sc[i] : sc[i + half], keep = upper ? sc[i + half] : sc[i];
        sc[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
      }
    }
    const int mine = __brev(unsigned(lane) & 15u) >> 28;  // the key this lane's sum belongs to
    float s_mine = sc[0] + __shfl_xor_sync(0xffffffffu, sc[0], 16);
    if (pass_slot(pass, mine) >= k_end) s_mine = -INFINITY;
    float pm = s_mine;
#pragma unroll
    for (int bit = 1; bit < 16; bit *= 2) pm = fmaxf(pm, __shfl_xor_sync(0xffffffffu, pm, bit));
    const float m_new = fmaxf(m, pm);  // finite: the pass's first key is in range
    const float corr = __expf(m - m_new), p_mine = __expf(s_mine - m_new);
    float lp = 0.f, op0 = 0.f, op1 = 0.f;
#pragma unroll
    for (int j = 0; j < kRowsKeys; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p_mine, int(__brev(unsigned(j)) >> 28));
      const T* ve = reinterpret_cast<const T*>(&vbuf[j]);
      lp += pj;
      op0 = fmaf(pj, is_new(j) ? qkv_s[2 * kQkvHeadDim + 2 * lane] : to_float(ve[0]), op0);
      op1 = fmaf(pj, is_new(j) ? qkv_s[2 * kQkvHeadDim + 2 * lane + 1] : to_float(ve[1]), op1);
    }
    l = l * corr + lp;
    o0 = o0 * corr + op0;
    o1 = o1 * corr + op1;
    m = m_new;
    if (more) {
#pragma unroll
      for (int j = 0; j < kRowsKeys; ++j) {
        kbuf[j] = knext[j];
        vbuf[j] = vnext[j];
      }
    }
  }
  // 6. The warps' partials, then the block's: S = 1 writes it; else it is pushed into the lead rank.
  if (lane == 0) {
    sh.m[warp] = m;
    sh.l[warp] = l;
  }
  sh.o[warp][2 * lane] = o0;
  sh.o[warp][2 * lane + 1] = o1;
  __syncthreads();
  T* out = static_cast<T*>(p.out) + int64_t(b) * p.o_stride + head * kQkvHeadDim + 2 * lane;
  auto write_out = [&](float sum0, float sum1, float sum_p) {  // lane's two columns, NaN for bad lengths
    out[0] = from_float<T>(valid ? sum0 / sum_p : NAN);
    out[1] = from_float<T>(valid ? sum1 / sum_p : NAN);
  };
  if (warp == 0 && (S > 1 || live)) {  // the block's partial
    float bm, bl, b0v, b1v;
    merge_partials<kWarps>(sh.m, sh.l, sh.o, lane, bm, bl, b0v, b1v);
    if constexpr (S == 1) {  // no remote stores into this block after phase 2: it may exit on its own
      write_out(b0v, b1v, bl);
    } else {
      if (lane == 0) {
        store_cluster_f32(cluster_addr(&sh.pm[split], lead), bm);
        store_cluster_f32(cluster_addr(&sh.pl[split], lead), bl);
      }
      store_cluster_f32(cluster_addr(&sh.po[split][2 * lane], lead), b0v);
      store_cluster_f32(cluster_addr(&sh.po[split][2 * lane + 1], lead), b1v);
    }
  }
  if constexpr (S > 1) {
    cluster_arrive_release();
    if (split != 0) return;  // a lead reads only its own shared memory from here
    cluster_wait();  // phase 3: every rank's partial is in its lead
    if (warp == 0 && live) {
      float gm, gl, g0, g1;
      merge_partials<S>(sh.pm, sh.pl, sh.po, lane, gm, gl, g0, g1);
      write_out(g0, g1, gl);
    }
  }
#else
  __trap();  // launched only where the launcher found it compiled for sm_90
#endif
}

}  // namespace qkv

namespace qkv {

// Sequences a cluster for a batch: 1 at one row (8 ranks split the keys), else the smallest of 2 / 4 / 8 that
// holds the batch (8 from 5 rows: a cluster per 8 sequences of a head, one rank per sequence).
inline int rows_per_cluster(int batch) {
  return batch <= 1 ? 1 : batch <= 2 ? 2 : batch <= 4 ? 4 : 8;
}

template <typename T, int G>
cudaError_t launch_rows(const QkvParams& p, cudaStream_t stream) {
  const dim3 grid(kQkvClusterBlocks, unsigned(p.heads), unsigned((p.batch + G - 1) / G));
  const dim3 cluster(kQkvClusterBlocks, 1, 1), block(kQkvThreads);
  switch (p.d / 256) {
    case 1:
      return launch_clustered(true, cluster, qkv_decode_attention_kernel<T, G, 1>, grid, block, 0, stream, p);
    case 2:
      return launch_clustered(true, cluster, qkv_decode_attention_kernel<T, G, 2>, grid, block, 0, stream, p);
    case 3:
      return launch_clustered(true, cluster, qkv_decode_attention_kernel<T, G, 3>, grid, block, 0, stream, p);
    case 4:
      return launch_clustered(true, cluster, qkv_decode_attention_kernel<T, G, 4>, grid, block, 0, stream, p);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace qkv

template <typename T>
cudaError_t launch_qkv_decode_attention(const QkvParams& params, cudaStream_t stream) {
  QkvParams p = params;
  p.pdl_early = pdl_early(p.batch);
  switch (qkv::rows_per_cluster(p.batch)) {
    case 1:
      return qkv::launch_rows<T, 1>(p, stream);
    case 2:
      return qkv::launch_rows<T, 2>(p, stream);
    case 4:
      return qkv::launch_rows<T, 4>(p, stream);
    default:
      return qkv::launch_rows<T, 8>(p, stream);
  }
}

template <typename T>
bool qkv_decode_attention_compiled() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, qkv::qkv_decode_attention_kernel<T, 1, 3>) == cudaSuccess &&
         attr.binaryVersion >= 90;
}

}  // namespace fused_attn
