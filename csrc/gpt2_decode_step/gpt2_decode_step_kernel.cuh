// GPT-2's whole decode step in one persistent launch: the embedding, every block (LayerNorm, c_attn with
// the key / value append, attention over the cache, c_proj + residual, LayerNorm, c_fc + GELU, c_proj +
// residual), the final LayerNorm and the lm_head's logits, for 1-4 sequences, float16 / bfloat16.
//
// The bound it is built to reach: a step reads every weight once (249 MB for GPT-2 small in float16, 60 us
// at an H200's 4.1 TB/s) and runs ~60 dependent phases, each a hand-off between SMs. So: one block an SM,
// each phase's weights cut into one tile a block, and
//   - hand-offs as flagged lines (gpt2_decode_step_launch.h): a producer stores its outputs with the launch's
//     epoch beside every 8 bytes, a consumer loads them until every flag is the epoch. One memory round trip
//     a hand-off: no counter, no release fence, no acquire before the data's own load. A phase-ordered design
//     with counters (an acquire spin, then the input's load, then the outputs, a barrier and a release) spent
//     1.5-2.8 us a phase in those round trips (H200, dev/trace_gpt2_decode_step.py, ea77e14);
//   - one warp a block streaming the block's tiles, in the order it will use them, into a ring of
//     shared-memory slots with bulk copies (cp.async.bulk + mbarrier), independent of the hand-offs: the
//     weights of the next phases land while the block waits for the current one's input;
//   - LayerNorms recomputed by every block that needs them (a row of C elements from L2), so a norm is
//     not a phase of its own; residual adds in the epilogue of the projection that owns the rows.
// Every hand-off buffer is written once a launch (one per layer and kind), so a consumer never meets an
// older value of this launch; the launch's last block advances the epoch. The launch is cooperative (every
// block resident: a block spins on others' outputs).
// Test: tests/test_gpt2_decode_step.py; bench: bench/bench_gpt2.py (backend graph-fused).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../common/math.cuh"
#include "../common/mbarrier.cuh"
#include "../common/vec_dtypes.cuh"
#include "gpt2_decode_step_launch.h"

namespace fused_attn {
namespace gpt2_step {

constexpr int kWarps = kStepConsumers / 32;
constexpr int kPhases = 5;  // stamps a layer: c_attn, attention, c_proj, c_fc, the MLP's c_proj

// Flagged lines: 16 bytes, (data word, flag, data word, flag). Loads and stores bypass L1 (volatile); an
// 8-byte half is written whole, so a half whose flag is the epoch holds this launch's data word.
__device__ __forceinline__ uint4 ld_line(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_unit(const uint2* p) {
  uint2 v;
  asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_unit(uint2* p, unsigned word, unsigned flag) {
  asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(word), "r"(flag) : "memory");
}
__device__ __forceinline__ void st_line(uint4* p, unsigned w0, unsigned w1, unsigned flag) {
  asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w0), "r"(flag), "r"(w1), "r"(flag)
               : "memory");
}
// v (loaded from p) once both its flags are the epoch: loaded again until they are.
__device__ __forceinline__ void backoff() {
#ifdef FA_STEP_BACKOFF_NS
  __nanosleep(FA_STEP_BACKOFF_NS);
#endif
}
__device__ __forceinline__ uint4 settle(const uint4* p, uint4 v, unsigned flag) {
  while (v.y != flag || v.w != flag) {
    backoff();
    v = ld_line(p);
  }
  return v;
}
__device__ __forceinline__ uint2 settle_unit(const uint2* p, uint2 v, unsigned flag) {
  while (v.y != flag) {
    backoff();
    v = ld_unit(p);
  }
  return v;
}

// lines v[u] (loaded from p[u], u < n) once every flag is the epoch: each round re-issues the loads of every
// line still stale, then checks them, so a thread with n lines pays one round trip a round, not one a stale
// line (dev/probe_megakernel_model.py, H200: 768 lines over 256 threads 3365 -> 1122 ns a phase).
template <int N>
__device__ __forceinline__ void settle_all(const uint4* const (&p)[N], uint4 (&v)[N], const bool (&use)[N],
                                           unsigned flag) {
  bool stale[N];
  bool any = false;
#pragma unroll
  for (int u = 0; u < N; ++u) {
    stale[u] = use[u] && (v[u].y != flag || v[u].w != flag);
    any |= stale[u];
  }
  while (any) {
#pragma unroll
    for (int u = 0; u < N; ++u)
      if (stale[u]) v[u] = ld_line(p[u]);
    any = false;
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (stale[u]) {
        stale[u] = v[u].y != flag || v[u].w != flag;
        any |= stale[u];
      }
    }
  }
}

// Two 16-bit values in a data word, and back.
template <typename T>
__device__ __forceinline__ unsigned pack2(float a, float b) {
  const T v[2] = {from_float<T>(a), from_float<T>(b)};
  unsigned w;
  memcpy(&w, v, 4);
  return w;
}
template <typename T>
__device__ __forceinline__ float2 unpack2(unsigned w) {
  T v[2];
  memcpy(v, &w, 4);
  return make_float2(to_float(v[0]), to_float(v[1]));
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// The consumers' barrier (the copy warp does not take part).
__device__ __forceinline__ void consumers_sync() { named_barrier_sync(1, kStepConsumers); }

// One layer's hand-off buffers (gpt2_decode_step_launch.h: step_layer_lines), in lines.
struct Hand {
  uint4* qkv;   // [batch, 3 C] 16-bit values
  uint4* part;  // [batch, heads, kStepMaxSplits, kStepPartLines]
  uint4* xa;    // [batch, C]: the residual stream after the attention
  uint4* hid;   // [batch, 4 C]
  uint4* xm;    // [batch, C]: the residual stream after the MLP
};
__device__ __forceinline__ Hand hand(const StepParams& p, int layer) {
  const int64_t B = p.batch, C = p.width;
  Hand h;
  h.qkv = p.lines + layer * step_layer_lines(B, C);
  h.part = h.qkv + B * 3 * C / 4;
  h.xa = h.part + B * p.n_head * kStepMaxSplits * kStepPartLines;
  h.hid = h.xa + B * C / 4;
  h.xm = h.hid + B * C;
  return h;
}
// The unit (8 bytes: a data word and its flag) holding values i, i + 1 (i even) of a buffer.
__device__ __forceinline__ uint2* unit(uint4* buf, int64_t i) { return reinterpret_cast<uint2*>(buf) + i / 2; }

// The phase timeline (p.trace, optional): thread 0 of each block writes %globaltimer (ns) at stamp i of its row
// (gpt2_decode_step_launch.h: kStepTraceStride): 0 the start, then per (layer, phase) 6 stamps: its start, its
// input in shared memory (twice: 1 and 3), the end (2), and for a GEMV phase its weights in (4) and its dot
// products done (5; the last chunk's, for the lm_head); then the lm_head's.
__device__ __forceinline__ void stamp(const StepParams& p, int i) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    p.trace[int64_t(blockIdx.x) * kStepTraceStride + i] = (long long)t;
  }
}
__device__ __forceinline__ int stamp_of(int layer, int phase) { return 1 + (layer * kPhases + phase) * 6; }

// Per-row sums over the consumers (v[b] for b < kStepMaxRows), every consumer gets them; red: kWarps x
// kStepMaxRows floats, not reused before the next barrier of the caller.
__device__ __forceinline__ void consumers_sums(float (&v)[kStepMaxRows], float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int b = 0; b < kStepMaxRows; ++b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[b] += __shfl_xor_sync(0xffffffffu, v[b], o);
    if (lane == 0) red[warp * kStepMaxRows + b] = v[b];
  }
  consumers_sync();
#pragma unroll
  for (int b = 0; b < kStepMaxRows; ++b) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w * kStepMaxRows + b];
    v[b] = s;
  }
}

// Four consecutive T of global memory (8 bytes) as floats.
template <typename T>
__device__ __forceinline__ void load4(const T* src, float (&f)[4]) {
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(src));
  const float2 a = unpack2<T>(w.x), b = unpack2<T>(w.y);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// The embedding of sequence b, elements k .. k + n - 1: wte[token] + wpe[pos] rounded to T (transformers'
// add); a token or position outside its table (a caller's bug: the sampler never writes one) reads nothing
// and gives NaN.
template <typename T>
__device__ __forceinline__ void embed(const StepParams& p, int b, int k, float (&f)[4]) {
  const int64_t tok = p.token[b], pos = p.pos[b];
  if (tok < 0 || tok >= p.vocab || pos < 0 || pos >= p.n_positions) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = NAN;
    return;
  }
  float w[4], q[4];
  load4(static_cast<const T*>(p.wte) + tok * p.width + k, w);
  load4(static_cast<const T*>(p.wpe) + pos * p.width + k, q);
#pragma unroll
  for (int e = 0; e < 4; ++e) f[e] = to_float(from_float<T>(w[e] + q[e]));
}

// act [batch, C] (shared, T) = LayerNorm(x) with weight g and bias bb, as F.layer_norm rounds its output; x is
// the flagged buffer xl, or the embedding (xl null). Thread t holds elements 4 t .. 4 t + 3 of every row; the
// norm's weights and every row's loads are issued before the first wait.
template <typename T>
__device__ __noinline__ void norm_rows(const StepParams& p, const uint4* xl, unsigned flag, const void* g,
                                       const void* bb, T* act, float* red) {
  const int C = p.width, B = p.batch, t = threadIdx.x;
  const bool mine = t < C / 4;
  float v[kStepMaxRows][4], gw[4], bw[4];
  if (mine) {
    load4(static_cast<const T*>(g) + 4 * t, gw);
    load4(static_cast<const T*>(bb) + 4 * t, bw);
  }
  if (xl == nullptr) {
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) {
      if (b < B && mine) embed<T>(p, b, 4 * t, v[b]);
    }
  } else {
    uint4 raw[kStepMaxRows];
    const uint4* src[kStepMaxRows];
    bool use[kStepMaxRows];
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) {
      use[b] = b < B && mine;
      src[b] = xl + b * C / 4 + t;
      if (use[b]) raw[b] = ld_line(src[b]);
    }
    settle_all(src, raw, use, flag);
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) {
      if (b < B && mine) {
        const float2 lo = unpack2<T>(raw[b].x), hi = unpack2<T>(raw[b].z);
        v[b][0] = lo.x;
        v[b][1] = lo.y;
        v[b][2] = hi.x;
        v[b][3] = hi.y;
      }
    }
  }
  float s[kStepMaxRows], q[kStepMaxRows];
#pragma unroll
  for (int b = 0; b < kStepMaxRows; ++b) s[b] = b < B && mine ? (v[b][0] + v[b][1]) + (v[b][2] + v[b][3]) : 0.f;
  consumers_sums(s, red);
#pragma unroll
  for (int b = 0; b < kStepMaxRows; ++b) {
    q[b] = 0.f;
    if (b < B && mine) {
#pragma unroll
      for (int e = 0; e < 4; ++e) q[b] += (v[b][e] - s[b] / C) * (v[b][e] - s[b] / C);
    }
  }
  consumers_sums(q, red + kWarps * kStepMaxRows);
#pragma unroll
  for (int b = 0; b < kStepMaxRows; ++b) {
    if (b < B && mine) {
      const float mean = s[b] / C, rstd = rsqrtf(q[b] / C + p.eps);
      float y[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = (v[b][e] - mean) * rstd * gw[e] + bw[e];
      *reinterpret_cast<uint2*>(act + b * C + 4 * t) = make_uint2(pack2<T>(y[0], y[1]), pack2<T>(y[2], y[3]));
    }
  }
  consumers_sync();
}

// A tile's bias (rows r0 .. r0 + rows - 1) into shared memory.
template <typename T>
__device__ __forceinline__ void load_bias(const void* bias, int r0, int rows, float* bias_s) {
  if (int(threadIdx.x) < rows) bias_s[threadIdx.x] = to_float(__ldg(static_cast<const T*>(bias) + r0 + threadIdx.x));
}

// act (shared, n lines of 4 T) = the flagged buffer src; four lines a thread in flight.
template <typename T>
__device__ __noinline__ void stage_lines(const uint4* src, int n, unsigned flag, T* act) {
  constexpr int kDepth = 4;
  for (int i0 = threadIdx.x; i0 < n; i0 += kDepth * kStepConsumers) {
    uint4 v[kDepth];
    const uint4* at[kDepth];
    bool use[kDepth];
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const int i = i0 + u * kStepConsumers;
      use[u] = i < n;
      at[u] = src + i;
      if (use[u]) v[u] = ld_line(at[u]);
    }
    settle_all(at, v, use, flag);
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const int i = i0 + u * kStepConsumers;
      if (i < n) {
        reinterpret_cast<uint2*>(act)[i] = make_uint2(v[u].x, v[u].z);
      }
    }
  }
  consumers_sync();
}

// 16 bytes of shared memory in one load (the words' unpacking would otherwise split it into four 4-byte loads,
// each a 4-way bank conflict across a warp reading consecutive 16-byte chunks: ncu, H200).
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p)));
  return v;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8]) {
  const float2 a = unpack2<T>(w.x), b = unpack2<T>(w.y), c = unpack2<T>(w.z), d = unpack2<T>(w.w);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
}

// The tile's dot products: w [rows, K] and act [batch, K] in shared memory; a warp two weight rows at a time
// (r and r + 8: independent sums to hide the shared-memory loads), its lanes over K in 16-byte chunks; dot
// [r][b] (kStepMaxRows a row) into shared memory, then the consumers' barrier. Not inlined: one copy of the
// loop for every phase.
template <typename T>
__device__ __noinline__ void tile_dots(const T* w, int rows, int K, const T* act, int batch, float* dot) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = K / 8;
  for (int r = warp; r < rows; r += 2 * kWarps) {
    const int r2 = r + kWarps;
    const bool two = r2 < rows;
    float a0[kStepMaxRows], a1[kStepMaxRows];
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) a0[b] = a1[b] = 0.f;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + int64_t(r) * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + int64_t(two ? r2 : r) * K);
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
      float f0[8], f1[8];
      unpack8<T>(lds128(w0 + c), f0);
      unpack8<T>(lds128(w1 + c), f1);
#pragma unroll
      for (int b = 0; b < kStepMaxRows; ++b) {
        if (b < batch) {
          float fa[8];
          unpack8<T>(lds128(reinterpret_cast<const uint4*>(act + b * K) + c), fa);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            a0[b] = fmaf(f0[e], fa[e], a0[b]);
            a1[b] = fmaf(f1[e], fa[e], a1[b]);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) {
      if (b < batch) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          a0[b] += __shfl_xor_sync(0xffffffffu, a0[b], o);
          a1[b] += __shfl_xor_sync(0xffffffffu, a1[b], o);
        }
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < kStepMaxRows; ++b) {
        dot[r * kStepMaxRows + b] = a0[b];
        if (two) dot[r2 * kStepMaxRows + b] = a1[b];
      }
    }
  }
  consumers_sync();
}

// The weight ring: load i goes to slot i % slots; full[s] completes when its bytes land, empty[s] when
// the consumers are done with it.
struct Ring {
  unsigned char* base;
  uint64_t* full;
  uint64_t* empty;
  int slots, slot_bytes;
};

// Calls f(src, bytes) for every weight copy block t makes, in the order its consumers use them.
template <typename T, typename F>
__device__ __forceinline__ void for_each_load(const StepParams& p, int t, F f) {
  const int C = p.width;
  const int K[4] = {C, C, C, 4 * C};
  for (int l = 0; l < p.n_layer; ++l) {
    const StepLayer& L = p.layers[l];
    const void* w[4] = {L.w_qkv, L.w_o, L.w_fc, L.w_p};
    const int N[4] = {3 * C, C, 4 * C, C};
#pragma unroll
    for (int ph = 0; ph < 4; ++ph) {
      if (t < p.tiles[ph]) {
        const int r0 = t * p.tile_rows[ph];
        const int rows = min(p.tile_rows[ph], N[ph] - r0);
        f(static_cast<const T*>(w[ph]) + int64_t(r0) * K[ph], uint32_t(rows) * K[ph] * sizeof(T));
      }
    }
  }
  const int v0 = t * p.vocab_rows, v1 = min(p.vocab, v0 + p.vocab_rows);
  for (int r0 = v0; r0 < v1; r0 += p.chunk_rows) {
    const int rows = min(p.chunk_rows, v1 - r0);
    f(static_cast<const T*>(p.wte) + int64_t(r0) * C, uint32_t(rows) * C * sizeof(T));
  }
}

// The keys of split c (of p.att_splits) of sequence b's slots leftpad .. seqlens: [lo, hi).
__device__ __forceinline__ void split_keys(const StepParams& p, int b, int c, int& lo, int& hi, bool& bad) {
  const int slot = p.seqlens[b], start = p.leftpad[b];
  // Lengths outside the cache (a caller's bug) read nothing and give NaN, as decode_attention does.
  bad = slot < 0 || slot >= p.max_len || start < 0 || start > slot;
  const int n = bad ? 0 : slot + 1 - start;
  const int chunk = (n + p.att_splits - 1) / p.att_splits;
  lo = start + min(n, c * chunk);
  hi = start + min(n, (c + 1) * chunk);
}

// Before the phase's input lands: the split's cached rows into L2, so the loads after it do not pay a DRAM
// round trip each.
template <typename T>
__device__ void prefetch_split(const StepParams& p, int layer, int item) {
  const int pair = item / p.att_splits, b = pair / p.n_head, h = pair % p.n_head;
  int lo, hi;
  bool bad;
  split_keys(p, b, item % p.att_splits, lo, hi, bad);
  const int64_t head = ((int64_t(layer) * p.batch + b) * p.n_head + h) * p.max_len * kStepHeadDim;
  for (int r = lo + int(threadIdx.x) / 2; r < hi; r += kStepConsumers / 2) {
    const T* base = static_cast<const T*>(threadIdx.x % 2 ? p.v_cache : p.k_cache) + head + int64_t(r) * kStepHeadDim;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(base));
  }
}

// Split c of the attention of sequence b's query at head h: m (its keys' largest score), l = sum of
// exp(score - m) and o = sum of exp(score - m) v, unnormalized, into the item's flagged partial lines (o in
// lines 0-31, (m, l) in line 32), which the c_proj phase merges. The query and the new slot's key and value
// come from c_attn's flagged output (48 lines into shared memory, qkv_s); the other keys from the cache
// (written by earlier launches). 8 lanes a key (16 bytes each), 32 keys a pass, kAttBatch passes' K and V rows
// loaded at once; each thread keeps a running (m, l, o[8]) (online softmax), merged over the groups, then the
// warps.
constexpr int kAttBatch = 4;
template <typename T>
__device__ __noinline__ void attend_split(const StepParams& p, int layer, const Hand& hd, unsigned flag, int item, float* part,
                             float* qs, T* qkv_s) {
  const int C = p.width, D = kStepHeadDim;
  const int pair = item / p.att_splits, b = pair / p.n_head, h = pair % p.n_head, split = item % p.att_splits;
  int lo, hi;
  bool bad;
  split_keys(p, b, split, lo, hi, bad);
  const int n = hi - lo, slot = p.seqlens[b];
  if (threadIdx.x < 48) {  // q, k, v of (b, h): 16 lines each
    const int which = threadIdx.x / 16, j = threadIdx.x % 16;
    const uint4* src = hd.qkv + (int64_t(b) * 3 * C + which * C + h * D) / 4 + j;
    const uint4 v = settle(src, ld_line(src), flag);
    reinterpret_cast<uint2*>(qkv_s)[threadIdx.x] = make_uint2(v.x, v.z);
  }
  consumers_sync();
  const int64_t head = ((int64_t(layer) * p.batch + b) * p.n_head + h) * p.max_len * D;
  const T* kc = static_cast<const T*>(p.k_cache) + head + int64_t(lo) * D;
  const T* vc = static_cast<const T*>(p.v_cache) + head + int64_t(lo) * D;
  const int group = threadIdx.x / 8, sub = threadIdx.x % 8;
  constexpr int kGroups = kStepConsumers / 8;
  float qr[8];
  {
    const uint4 qv = reinterpret_cast<const uint4*>(qkv_s)[sub];
    const T* qe = reinterpret_cast<const T*>(&qv);
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[e] = to_float(qe[e]) * p.scale;
  }
  const uint4 k_new = reinterpret_cast<const uint4*>(qkv_s)[8 + sub];
  const uint4 v_new = reinterpret_cast<const uint4*>(qkv_s)[16 + sub];
  float m = -INFINITY, l = 0.f, o[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = 0.f;
  for (int j0 = 0; j0 < n; j0 += kGroups * kAttBatch) {
    uint4 kv[kAttBatch], vv[kAttBatch];
#pragma unroll
    for (int u = 0; u < kAttBatch; ++u) {
      const int j = j0 + u * kGroups + group;
      const bool fresh = lo + j == slot;  // this launch's key and value: c_attn's output, not the cache
      kv[u] = j < n && !fresh ? __ldcg(reinterpret_cast<const uint4*>(kc + int64_t(j) * D) + sub) : k_new;
      vv[u] = j < n && !fresh ? __ldcg(reinterpret_cast<const uint4*>(vc + int64_t(j) * D) + sub) : v_new;
    }
#pragma unroll
    for (int u = 0; u < kAttBatch; ++u) {
      const int j = j0 + u * kGroups + group;
      const T* ke = reinterpret_cast<const T*>(&kv[u]);
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) sc = fmaf(qr[e], to_float(ke[e]), sc);
      sc += __shfl_xor_sync(0xffffffffu, sc, 4);
      sc += __shfl_xor_sync(0xffffffffu, sc, 2);
      sc += __shfl_xor_sync(0xffffffffu, sc, 1);
      if (j < n) {
        const float mn = fmaxf(m, sc);
        const float keep = __expf(m - mn), w = __expf(sc - mn);
        const T* ve = reinterpret_cast<const T*>(&vv[u]);
        l = l * keep + w;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = fmaf(w, to_float(ve[e]), o[e] * keep);
        m = mn;
      }
    }
  }
  // Merge the 4 groups of a warp (lanes 8 apart), then the 8 warps through shared memory.
#pragma unroll
  for (int off = 8; off < 32; off <<= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, off), lo_ = __shfl_xor_sync(0xffffffffu, l, off);
    const float mn = fmaxf(m, mo);
    const float a = mn == -INFINITY ? 0.f : __expf(m - mn), c = mn == -INFINITY ? 0.f : __expf(mo - mn);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = o[e] * a + __shfl_xor_sync(0xffffffffu, o[e], off) * c;
    l = l * a + lo_ * c;
    m = mn;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < 8) {
#pragma unroll
    for (int e = 0; e < 8; ++e) part[warp * D + lane * 8 + e] = o[e];
  }
  if (lane == 0) {
    qs[warp] = m;
    qs[kWarps + warp] = l;
  }
  consumers_sync();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, qs[w]);
  uint4* out = hd.part + ((int64_t(b) * p.n_head + h) * kStepMaxSplits + split) * kStepPartLines;
  if (threadIdx.x < D / 2) {
    float v0 = 0.f, v1 = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float s = mx == -INFINITY ? 0.f : __expf(qs[w] - mx);
      v0 += part[w * D + 2 * threadIdx.x] * s;
      v1 += part[w * D + 2 * threadIdx.x + 1] * s;
    }
    st_line(out + threadIdx.x, __float_as_uint(v0), __float_as_uint(v1), flag);
  }
  if (threadIdx.x == D / 2) {
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) L += mx == -INFINITY ? 0.f : qs[kWarps + w] * __expf(qs[w] - mx);
    st_line(out + D / 2, __float_as_uint(mx), __float_as_uint(bad ? NAN : L), flag);
  }
}

// act [batch, C] = the attention's output: each (sequence, head)'s splits merged (softmax's rescaling) and
// rounded to T, as the attention's output is stored. A thread merges two values of two (sequence, head)
// pairs at a time, every split's lines of both loaded before the first wait.
template <typename T>
__device__ __noinline__ void merge_splits(const StepParams& p, const uint4* part, unsigned flag, T* act) {
  const int C = p.width, S = p.att_splits, tasks = p.batch * C / 2;
  constexpr int kLines = 2 * 2 * kStepMaxSplits;  // two tasks, each split's o line and (m, l) line
  for (int i0 = threadIdx.x; i0 < tasks; i0 += 2 * kStepConsumers) {
    uint4 v[kLines];
    const uint4* at[kLines];
    bool use[kLines];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = i0 + u * kStepConsumers;
      const int b = i / (C / 2), within = i % (C / 2), h = within / 32;
      const uint4* q = part + ((int64_t(b) * p.n_head + h) * kStepMaxSplits) * kStepPartLines;
#pragma unroll
      for (int c = 0; c < kStepMaxSplits; ++c) {
        const int k = (u * kStepMaxSplits + c) * 2;
        use[k] = use[k + 1] = i < tasks && c < S;
        at[k] = q + c * kStepPartLines + within % 32;
        at[k + 1] = q + c * kStepPartLines + 32;
        if (use[k]) {
          v[k] = ld_line(at[k]);
          v[k + 1] = ld_line(at[k + 1]);
        }
      }
    }
    settle_all(at, v, use, flag);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = i0 + u * kStepConsumers;
      if (i >= tasks) break;
      const uint4* o = v + u * 2 * kStepMaxSplits;  // o line of split c at 2 c, its (m, l) at 2 c + 1
      float mx = -INFINITY;
      bool bad = false;
#pragma unroll
      for (int c = 0; c < kStepMaxSplits; ++c) {
        if (c < S) {
          const float lc = __uint_as_float(o[2 * c + 1].z);
          bad |= isnan(lc);
          if (lc > 0.f) mx = fmaxf(mx, __uint_as_float(o[2 * c + 1].x));
        }
      }
      float L = 0.f, O0 = 0.f, O1 = 0.f;
#pragma unroll
      for (int c = 0; c < kStepMaxSplits; ++c) {
        const float lc = c < S ? __uint_as_float(o[2 * c + 1].z) : 0.f;
        if (lc > 0.f) {
          const float w = __expf(__uint_as_float(o[2 * c + 1].x) - mx);
          L += lc * w;
          O0 += __uint_as_float(o[2 * c].x) * w;
          O1 += __uint_as_float(o[2 * c].z) * w;
        }
      }
      const float y0 = bad ? NAN : L > 0.f ? O0 / L : 0.f, y1 = bad ? NAN : L > 0.f ? O1 / L : 0.f;
      reinterpret_cast<unsigned*>(act)[i] = pack2<T>(y0, y1);
    }
  }
  consumers_sync();
}

template <typename T>
__global__ void __launch_bounds__(kStepThreads, 1) gpt2_decode_step_kernel(const __grid_constant__ StepParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  Ring ring;
  ring.base = smem;
  ring.slots = p.slots;
  ring.slot_bytes = p.slot_bytes;
  unsigned char* after_ring = smem + p.slots * p.slot_bytes;
  T* act = reinterpret_cast<T*>(after_ring);
  ring.full = reinterpret_cast<uint64_t*>(after_ring + p.act_bytes);
  ring.empty = ring.full + kStepMaxSlots;
  float* red = reinterpret_cast<float*>(ring.empty + kStepMaxSlots);  // 2 x kWarps x kStepMaxRows floats
  int* slots = reinterpret_cast<int*>(red + 2 * kWarps * kStepMaxRows);
  float* bias_s = reinterpret_cast<float*>(slots + kStepMaxRows);
  float* dot = bias_s + kStepMaxTileRows;  // [kStepMaxTileRows][kStepMaxRows]: a tile's dot products
  const int t = blockIdx.x;
  unsigned* epoch = reinterpret_cast<unsigned*>(dot + kStepMaxTileRows * kStepMaxRows);
  // Loads the consumers have started to take (each take comes once the phase's input is in shared memory).
  volatile int* taking = reinterpret_cast<volatile int*>(epoch + 1);

  if (threadIdx.x == 0) {
    // This launch's epoch: the flag of every line it writes (never 0, the zeroed workspace's). Read by one
    // thread before the block's first barrier, so it is read before the block can count itself finished.
    const unsigned prev = __ldcg(p.header);
    *epoch = prev + 1 == 0u ? 1u : prev + 1;
    *taking = 0;
    for (int s = 0; s < p.slots; ++s) {
      mbarrier_init(&ring.full[s], 1);
      mbarrier_init(&ring.empty[s], 1);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  // The copy warp: one thread issues every copy, slots permitting. Paced: the copy into a slot given back at
  // the end of a phase goes out only once the consumers have the next phase's input, so it does not queue
  // beside that input's polls (dev/probe_megakernel_model.py, H200, 192 flagged lines and 27 KB a block a phase
  // with ~1 us of work: 3239 ns a phase with the copy at once, 2239 paced, 1995 without a stream).
  if (threadIdx.x >= kStepConsumers) {
    if (threadIdx.x == kStepConsumers) {
      int i = 0;
      for_each_load<T>(p, t, [&](const T* src, uint32_t bytes) {
        const int s = i % ring.slots;
        if (i >= ring.slots) {
          mbarrier_wait(&ring.empty[s], ((i / ring.slots) - 1) & 1);
          while (*taking < i - ring.slots + 2) {}
        }
        mbarrier_arrive_expect_tx(&ring.full[s], bytes);
        bulk_load(ring.base + s * ring.slot_bytes, src, bytes, &ring.full[s]);
        ++i;
      });
    }
    return;
  }

  int i = 0;  // the next load this block's consumers take
  auto take = [&]() -> const T* {
    const int s = i % ring.slots;
    if (threadIdx.x == 0) *taking = i + 1;
    mbarrier_wait(&ring.full[s], (i / ring.slots) & 1);
    return reinterpret_cast<const T*>(ring.base + s * ring.slot_bytes);
  };
  auto give_back = [&]() {
    consumers_sync();
    if (threadIdx.x == 0) mbarrier_arrive(&ring.empty[i % ring.slots]);
    ++i;
  };

  const int C = p.width, B = p.batch;
  const unsigned flag = *epoch;
  const int items = B * p.n_head * p.att_splits;
  const int item = int(gridDim.x) - 1 - t;  // attention on the last blocks, which own the fewest tiles
  float* part = reinterpret_cast<float*>(act);
  float* qs = part + kWarps * kStepHeadDim;
  T* qkv_s = reinterpret_cast<T*>(qs + 2 * kWarps);
  if (threadIdx.x < B) slots[threadIdx.x] = p.seqlens[threadIdx.x];
  stamp(p, 0);
  // The epilogue's task i (a pair of rows r, r + 1 of sequence b) is thread i's (rows <= kStepMaxTileRows).
  const int task = threadIdx.x;
  // The residual rows of a projection's task, from the flagged stream res (the embedding where null),
  // loaded before the phase's input so the two round trips overlap; settled after it.
  auto residual_load = [&](const uint4* res, int r0, int rows, uint2& raw, float2& value) {
    if (task >= (rows / 2) * B) return;
    const int r = 2 * (task / B), b = task % B;
    if (res == nullptr) {
      float f[4];
      embed<T>(p, b, r0 + r - (r0 + r) % 4, f);
      const int k = (r0 + r) % 4;
      value = make_float2(f[k], f[k + 1]);
    } else {
      raw = ld_unit(unit(const_cast<uint4*>(res), int64_t(b) * C + r0 + r));
    }
  };
  auto residual_settle = [&](const uint4* res, int r0, int rows, uint2& raw, float2& value) {
    if (task >= (rows / 2) * B || res == nullptr) return;
    const int r = 2 * (task / B), b = task % B;
    raw = settle_unit(unit(const_cast<uint4*>(res), int64_t(b) * C + r0 + r), raw, flag);
    value = unpack2<T>(raw.x);
  };

  for (int l = 0; l < p.n_layer; ++l) {
    const StepLayer& L = p.layers[l];
    const Hand hd = hand(p, l);
    const uint4* x_in = l == 0 ? nullptr : hand(p, l - 1).xm;  // the layer's input stream (null: the embedding)
    // c_attn over ln_1(x): q, k, v to the flagged qkv, k and v also into the cache at slot seqlens[b].
    if (t < p.tiles[0]) {
      const int r0 = t * p.tile_rows[0];
      const int rows = min(p.tile_rows[0], 3 * C - r0);
      load_bias<T>(L.b_qkv, r0, rows, bias_s);
      stamp(p, stamp_of(l, 0));
      norm_rows<T>(p, x_in, flag, L.ln1_w, L.ln1_b, act, red);
      stamp(p, stamp_of(l, 0) + 1);
      stamp(p, stamp_of(l, 0) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 0) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      if (task < (rows / 2) * B) {
        const int r = 2 * (task / B), b = task % B, n = r0 + r;
        const float y0 = dot[r * kStepMaxRows + b] + bias_s[r], y1 = dot[(r + 1) * kStepMaxRows + b] + bias_s[r + 1];
        const unsigned word = pack2<T>(y0, y1);
        st_unit(unit(hd.qkv, int64_t(b) * 3 * C + n), word, flag);
        const int part_of = n / C, within = n % C, hh = within / kStepHeadDim, d = within % kStepHeadDim;
        if (part_of > 0 && slots[b] >= 0 && slots[b] < p.max_len) {
          T* cache = static_cast<T*>(part_of == 1 ? p.k_cache : p.v_cache);
          *reinterpret_cast<unsigned*>(
              cache + (((int64_t(l) * B + b) * p.n_head + hh) * p.max_len + slots[b]) * kStepHeadDim + d) = word;
        }
      }
      stamp(p, stamp_of(l, 0) + 5);
      give_back();
      stamp(p, stamp_of(l, 0) + 2);
    }
    // attention: one split of one (sequence, head) a block, its cached rows prefetched before its input.
    if (item >= 0 && item < items) {
      prefetch_split<T>(p, l, item);
      stamp(p, stamp_of(l, 1));
      attend_split<T>(p, l, hd, flag, item, part, qs, qkv_s);
      stamp(p, stamp_of(l, 1) + 1);
      consumers_sync();  // part / qs are the next phase's act
      stamp(p, stamp_of(l, 1) + 2);
    }
    // attention's c_proj (its input: the splits merged), + residual.
    if (t < p.tiles[1]) {
      const int r0 = t * p.tile_rows[1];
      const int rows = min(p.tile_rows[1], C - r0);
      load_bias<T>(L.b_o, r0, rows, bias_s);
      uint2 raw;
      float2 res;
      residual_load(x_in, r0, rows, raw, res);
      stamp(p, stamp_of(l, 2));
      merge_splits<T>(p, hd.part, flag, act);
      residual_settle(x_in, r0, rows, raw, res);
      stamp(p, stamp_of(l, 2) + 1);
      stamp(p, stamp_of(l, 2) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 2) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      if (task < (rows / 2) * B) {
        const int r = 2 * (task / B), b = task % B;
        const float y0 = dot[r * kStepMaxRows + b] + bias_s[r] + res.x;
        const float y1 = dot[(r + 1) * kStepMaxRows + b] + bias_s[r + 1] + res.y;
        st_unit(unit(hd.xa, int64_t(b) * C + r0 + r), pack2<T>(y0, y1), flag);
      }
      stamp(p, stamp_of(l, 2) + 5);
      give_back();
      stamp(p, stamp_of(l, 2) + 2);
    }
    // c_fc over ln_2(x), GELU.
    if (t < p.tiles[2]) {
      const int r0 = t * p.tile_rows[2];
      const int rows = min(p.tile_rows[2], 4 * C - r0);
      load_bias<T>(L.b_fc, r0, rows, bias_s);
      stamp(p, stamp_of(l, 3));
      norm_rows<T>(p, hd.xa, flag, L.ln2_w, L.ln2_b, act, red);
      stamp(p, stamp_of(l, 3) + 1);
      stamp(p, stamp_of(l, 3) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 3) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      if (task < (rows / 2) * B) {
        const int r = 2 * (task / B), b = task % B;
        const float y0 = gelu_tanh(dot[r * kStepMaxRows + b] + bias_s[r]);
        const float y1 = gelu_tanh(dot[(r + 1) * kStepMaxRows + b] + bias_s[r + 1]);
        st_unit(unit(hd.hid, int64_t(b) * 4 * C + r0 + r), pack2<T>(y0, y1), flag);
      }
      stamp(p, stamp_of(l, 3) + 5);
      give_back();
      stamp(p, stamp_of(l, 3) + 2);
    }
    // the MLP's c_proj, + residual.
    if (t < p.tiles[3]) {
      const int r0 = t * p.tile_rows[3];
      const int rows = min(p.tile_rows[3], C - r0);
      load_bias<T>(L.b_p, r0, rows, bias_s);
      uint2 raw;
      float2 res;
      residual_load(hd.xa, r0, rows, raw, res);
      stamp(p, stamp_of(l, 4));
      stage_lines<T>(hd.hid, B * C, flag, act);
      residual_settle(hd.xa, r0, rows, raw, res);
      stamp(p, stamp_of(l, 4) + 1);
      stamp(p, stamp_of(l, 4) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 4) + 4);
      tile_dots<T>(w, rows, 4 * C, act, B, dot);
      if (task < (rows / 2) * B) {
        const int r = 2 * (task / B), b = task % B;
        const float y0 = dot[r * kStepMaxRows + b] + bias_s[r] + res.x;
        const float y1 = dot[(r + 1) * kStepMaxRows + b] + bias_s[r + 1] + res.y;
        st_unit(unit(hd.xm, int64_t(b) * C + r0 + r), pack2<T>(y0, y1), flag);
      }
      stamp(p, stamp_of(l, 4) + 5);
      give_back();
      stamp(p, stamp_of(l, 4) + 2);
    }
  }
  // ln_f, then this block's rows of the lm_head (tied to wte), chunk by chunk through the ring.
  const int v0 = t * p.vocab_rows, v1 = min(p.vocab, v0 + p.vocab_rows);
  if (v0 < v1) {
    stamp(p, stamp_of(p.n_layer, 0));
    norm_rows<T>(p, hand(p, p.n_layer - 1).xm, flag, p.lnf_w, p.lnf_b, act, red);
    stamp(p, stamp_of(p.n_layer, 0) + 1);
    T* logits = static_cast<T*>(p.logits);
    for (int r0 = v0; r0 < v1; r0 += p.chunk_rows) {
      const int rows = min(p.chunk_rows, v1 - r0);
      stamp(p, stamp_of(p.n_layer, 0) + 3);
      const T* w = take();
      stamp(p, stamp_of(p.n_layer, 0) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      for (int i = threadIdx.x; i < rows * B; i += kStepConsumers) {
        const int r = i / B, b = i % B;
        logits[int64_t(b) * p.vocab + r0 + r] = from_float<T>(dot[r * kStepMaxRows + b]);
      }
      stamp(p, stamp_of(p.n_layer, 0) + 5);
      give_back();
    }
  }
  stamp(p, stamp_of(p.n_layer, 0) + 2);
  // The last block to finish advances the epoch for the next launch (every block read it at its start).
  if (threadIdx.x == 0) {
    const unsigned done = atomicAdd(p.header + 32, 1u);
    if (done == gridDim.x - 1) {
      p.header[32] = 0u;
      p.header[0] = flag;
    }
  }
}

}  // namespace gpt2_step

template <typename T>
cudaError_t launch_gpt2_decode_step(const StepParams& p, int grid, cudaStream_t stream) {
  auto kernel = gpt2_step::gpt2_decode_step_kernel<T>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem_bytes);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kStepThreads);
  cfg.dynamicSmemBytes = p.smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace fused_attn
