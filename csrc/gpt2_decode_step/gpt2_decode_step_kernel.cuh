// GPT-2's whole decode step in one persistent launch: the embedding, every block (LayerNorm, c_attn with
// the key / value append, attention over the cache, c_proj + residual, LayerNorm, c_fc + GELU, c_proj +
// residual), the final LayerNorm and the lm_head's logits, for 1-4 sequences, float16 / bfloat16.
//
// The bound it is built to reach: a step reads every weight once (249 MB for GPT-2 small in float16, 60 us
// at an H200's 4.1 TB/s), and its ~50 dependent phases cost ~0.83 us each as a hand-off between SMs
// (dev/probe_megakernel_model.py, H200: an all-to-all counter phase of 132 blocks); chained launches
// cost 2-3 us a hand-off. So: one block an SM, each phase's weights cut into one tile a block, and
//   - dependencies through counters in global memory (a phase's finished tiles; a consumer's thread 0
//     spins on an acquire load until the phase it reads is complete), never a grid barrier;
//   - one warp a block streaming the block's tiles, in the order it will use them, into a ring of
//     shared-memory slots with bulk copies (cp.async.bulk + mbarrier), independent of the counters: the
//     weights of the next phases land while the block waits for the current one's input;
//   - LayerNorms recomputed by every block that needs them (a row of C elements from L2), so a norm is
//     not a phase of its own; residual adds in the epilogue of the projection that owns the rows.
// The counters are reset by the launch's last block; the launch is cooperative (every block resident).
// Test: tests/test_gpt2_decode_step.py; bench: bench/bench_gpt2.py (backend graph-fused).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/math.cuh"
#include "../common/mbarrier.cuh"
#include "../common/vec_dtypes.cuh"
#include "gpt2_decode_step_launch.h"

namespace fused_attn {
namespace gpt2_step {

constexpr int kWarps = kStepConsumers / 32;
constexpr int kCounterStride = 32;  // unsigned ints: one 128-byte line a counter
constexpr int kPhases = 5;          // counters a layer: c_attn, attention, c_proj, c_fc, the MLP's c_proj

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// The consumers' barrier (the copy warp does not take part).
__device__ __forceinline__ void consumers_sync() { named_barrier_sync(1, kStepConsumers); }

__device__ __forceinline__ unsigned* counter(const StepParams& p, int layer, int phase) {
  return p.counters + (1 + layer * kPhases + phase) * kCounterStride;
}

// Thread 0 waits until the counter reaches n (it only grows during a launch), then every consumer may read
// what the n tiles wrote (acquire by thread 0, then the barrier); reads of other blocks' data go through
// L2 (__ldcg), never a stale L1 line.
__device__ __forceinline__ void wait_for(const unsigned* c, unsigned n) {
  if (threadIdx.x == 0) {
    while (load_acquire(c) < n) {
    }
  }
  consumers_sync();
}
// The barrier, then one release by thread 0 (CUTLASS's semaphore does the same: bar.sync orders the block's
// writes before it, the release makes them visible at gpu scope with the count).
__device__ __forceinline__ void signal(unsigned* c) {
  consumers_sync();
  if (threadIdx.x == 0) add_release(c);
}

// The phase timeline (p.trace, optional): thread 0 of each block writes %globaltimer (ns) at stamp i of its row
// (gpt2_decode_step_launch.h: kStepTraceStride): 0 the start, then per (layer, phase) 6 stamps: before its
// wait, after it, after its signal, and for a GEMV phase after its input is staged, after its weights are in
// (take) and after its dot products (the last chunk's, for the lm_head); then the lm_head's.
__device__ __forceinline__ void stamp(const StepParams& p, int i) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    p.trace[int64_t(blockIdx.x) * kStepTraceStride + i] = (long long)t;
  }
}
__device__ __forceinline__ int stamp_of(int layer, int phase) { return 1 + (layer * kPhases + phase) * 6; }

// Block-wide sum of the consumers (red: kWarps floats of shared memory); every consumer gets it.
__device__ __forceinline__ float consumers_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  consumers_sync();
  if (lane == 0) red[warp] = v;
  consumers_sync();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}
__device__ __forceinline__ float consumers_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  consumers_sync();
  if (lane == 0) red[warp] = v;
  consumers_sync();
  float m = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);
  return m;
}

template <typename T>
__device__ __forceinline__ float ld_f(const T* p) {
  return to_float(__ldcg(p));
}

// A LayerNorm's weight and bias, this thread's elements (k = threadIdx.x + i x 256): loaded before the wait
// for the phase's input, so they are not a DRAM round trip on the dependency chain.
constexpr int kPerThread = kStepMaxWidth / kStepConsumers;
struct NormParams {
  float g[kPerThread], b[kPerThread];
};
template <typename T>
__device__ __forceinline__ NormParams load_norm(const StepParams& p, const void* g, const void* b) {
  NormParams n;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int k = threadIdx.x + i * kStepConsumers;
    n.g[i] = k < p.width ? to_float(__ldg(static_cast<const T*>(g) + k)) : 0.f;
    n.b[i] = k < p.width ? to_float(__ldg(static_cast<const T*>(b) + k)) : 0.f;
  }
  return n;
}

// The rows of x [batch, C] (global, or the embedding at layer 0), LayerNorm'd with np, into act [batch, C]
// in T, as F.layer_norm rounds its output. At layer 0 (emb) x is wte[token] + wpe[pos], rounded to T
// (transformers' add), and block 0 writes it to the residual stream. Every row's loads are issued first.
template <typename T>
__device__ __noinline__ void norm_rows(const StepParams& p, const NormParams& np, T* act, float* red, bool emb) {
  const int C = p.width;
  const T* x = static_cast<const T*>(p.x);
  float v[kStepMaxRows][kPerThread];
#pragma unroll
  for (int r = 0; r < kStepMaxRows; ++r) {
    if (r >= p.batch) break;
    // A token or position outside its table (a caller's bug: the sampler never writes one) reads nothing
    // and gives the row NaN.
    bool bad = false;
    const T* wte_row = nullptr;
    const T* wpe_row = nullptr;
    if (emb) {
      const int64_t tok = p.token[r], pos = p.pos[r];
      bad = tok < 0 || tok >= p.vocab || pos < 0 || pos >= p.n_positions;
      wte_row = static_cast<const T*>(p.wte) + (bad ? 0 : tok) * C;
      wpe_row = static_cast<const T*>(p.wpe) + (bad ? 0 : pos) * C;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int k = threadIdx.x + i * kStepConsumers;
      v[r][i] = 0.f;
      if (k < C) {
        if (emb) {
          const T e = bad ? from_float<T>(NAN)
                          : from_float<T>(to_float(__ldg(wte_row + k)) + to_float(__ldg(wpe_row + k)));
          v[r][i] = to_float(e);
          if (blockIdx.x == 0) static_cast<T*>(p.x)[r * C + k] = e;
        } else {
          v[r][i] = ld_f(x + r * C + k);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kStepMaxRows; ++r) {
    if (r >= p.batch) break;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) s += v[r][i];
    const float mean = consumers_sum(s, red) / C;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int k = threadIdx.x + i * kStepConsumers;
      if (k < C) q += (v[r][i] - mean) * (v[r][i] - mean);
    }
    const float rstd = rsqrtf(consumers_sum(q, red) / C + p.eps);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int k = threadIdx.x + i * kStepConsumers;
      if (k < C) act[r * C + k] = from_float<T>((v[r][i] - mean) * rstd * np.g[i] + np.b[i]);
    }
  }
  consumers_sync();
}

// A tile's bias (rows r0 .. r0 + rows - 1) into shared memory, before the wait.
template <typename T>
__device__ __forceinline__ void load_bias(const void* bias, int r0, int rows, float* bias_s) {
  if (int(threadIdx.x) < rows) bias_s[threadIdx.x] = to_float(__ldg(static_cast<const T*>(bias) + r0 + threadIdx.x));
}

// act [batch, K] = src [batch, K] from global (another phase's output).
template <typename T>
__device__ void stage_rows(const T* src, int rows, int K, T* act) {
  const int n = rows * K / 8;
  for (int i0 = 0; i0 < n; i0 += 4 * kStepConsumers) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kStepConsumers + threadIdx.x;
      if (i < n) v[u] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kStepConsumers + threadIdx.x;
      if (i < n) reinterpret_cast<uint4*>(act)[i] = v[u];
    }
  }
  consumers_sync();
}

// The tile's dot products: w [rows, K] and act [batch, K] in shared memory; a warp a weight row (rows warp,
// warp + 8, ...), its lanes over K in 16-byte chunks; dot [r][b] (kStepMaxRows a row) into shared memory, then
// the consumers' barrier. Not inlined: one copy of the loop for every phase. The kernel's code once held five
// inlined copies with their epilogues (176 KB of SASS, past the instruction cache: every phase refetched its
// code), and a phase's dot products took 1.5-2.6 us (H200, dev/trace_gpt2_decode_step.py).
template <typename T>
__device__ __noinline__ void tile_dots(const T* w, int rows, int K, const T* act, int batch, float* dot) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = K / 8;
  for (int r = warp; r < rows; r += kWarps) {
    float acc[kStepMaxRows];
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) acc[b] = 0.f;
    const uint4* wr = reinterpret_cast<const uint4*>(w + int64_t(r) * K);
    for (int c = lane; c < chunks; c += 32) {
      const uint4 wv = wr[c];
      const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
      for (int b = 0; b < kStepMaxRows; ++b) {
        if (b < batch) {
          const uint4 av = reinterpret_cast<const uint4*>(act + b * K)[c];
          const T* ae = reinterpret_cast<const T*>(&av);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[b] = fmaf(to_float(we[e]), to_float(ae[e]), acc[b]);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kStepMaxRows; ++b) {
      if (b < batch) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], o);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < kStepMaxRows; ++b) dot[r * kStepMaxRows + b] = acc[b];
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

// Before the c_attn phase is done: the split's cached rows into L2 (the new slot's row too, which that phase then
// writes), so the loads after the wait do not pay a DRAM round trip each.
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
// exp(score - m) and o = sum of exp(score - m) v, unnormalized, into the item's partial (o[64], m, l), which the
// c_proj phase merges. 8 lanes a key (16 bytes each), 32 keys a pass, kAttBatch passes' K and V rows loaded at
// once; each thread keeps a running (m, l, o[8]) (online softmax), merged over the groups, then the warps.
constexpr int kAttBatch = 4;
template <typename T>
__device__ void attend_split(const StepParams& p, int layer, int item, float* part, float* qs) {
  const int C = p.width, D = kStepHeadDim;
  const int pair = item / p.att_splits, b = pair / p.n_head, h = pair % p.n_head;
  int lo, hi;
  bool bad;
  split_keys(p, b, item % p.att_splits, lo, hi, bad);
  const int n = hi - lo;
  const int64_t head = ((int64_t(layer) * p.batch + b) * p.n_head + h) * p.max_len * D;
  const T* kc = static_cast<const T*>(p.k_cache) + head + int64_t(lo) * D;
  const T* vc = static_cast<const T*>(p.v_cache) + head + int64_t(lo) * D;
  const int group = threadIdx.x / 8, sub = threadIdx.x % 8;
  constexpr int kGroups = kStepConsumers / 8;
  float qr[8];
  {
    const uint4 qv = __ldcg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.qkv) + int64_t(b) * 3 * C + h * D) + sub);
    const T* qe = reinterpret_cast<const T*>(&qv);
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[e] = to_float(qe[e]) * p.scale;
  }
  float m = -INFINITY, l = 0.f, o[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = 0.f;
  for (int j0 = 0; j0 < n; j0 += kGroups * kAttBatch) {
    uint4 kv[kAttBatch], vv[kAttBatch];
#pragma unroll
    for (int u = 0; u < kAttBatch; ++u) {
      const int j = j0 + u * kGroups + group;
      kv[u] = j < n ? __ldcg(reinterpret_cast<const uint4*>(kc + int64_t(j) * D) + sub) : make_uint4(0, 0, 0, 0);
      vv[u] = j < n ? __ldcg(reinterpret_cast<const uint4*>(vc + int64_t(j) * D) + sub) : make_uint4(0, 0, 0, 0);
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
  float* out = p.att_part + int64_t(item) * kStepPartFloats;
  if (threadIdx.x < D) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += mx == -INFINITY ? 0.f : part[w * D + threadIdx.x] * __expf(qs[w] - mx);
    out[threadIdx.x] = v;
  }
  if (threadIdx.x == D) {
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) L += mx == -INFINITY ? 0.f : qs[kWarps + w] * __expf(qs[w] - mx);
    out[D] = mx;
    out[D + 1] = bad ? NAN : L;
  }
}

// act [batch, C] = the attention's output: each (sequence, head)'s splits merged (softmax's rescaling) and
// rounded to T, as the attention's output is stored. Every split's (m, l, o) is loaded before any is used.
template <typename T>
__device__ void merge_splits(const StepParams& p, T* act) {
  const int C = p.width, S = p.att_splits;
  for (int idx = threadIdx.x; idx < p.batch * C; idx += kStepConsumers) {
    const int b = idx / C, within = idx % C, h = within / kStepHeadDim, d = within % kStepHeadDim;
    const float* part = p.att_part + int64_t((b * p.n_head + h) * S) * kStepPartFloats;
    float ms[kStepMaxSplits], ls[kStepMaxSplits], os[kStepMaxSplits];
#pragma unroll
    for (int c = 0; c < kStepMaxSplits; ++c) {
      const float* q = part + c * kStepPartFloats;
      ms[c] = c < S ? __ldcg(q + kStepHeadDim) : -INFINITY;
      ls[c] = c < S ? __ldcg(q + kStepHeadDim + 1) : 0.f;
      os[c] = c < S ? __ldcg(q + d) : 0.f;
    }
    float mx = -INFINITY;
    bool bad = false;
#pragma unroll
    for (int c = 0; c < kStepMaxSplits; ++c) {
      bad |= isnan(ls[c]);
      if (ls[c] > 0.f) mx = fmaxf(mx, ms[c]);
    }
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int c = 0; c < kStepMaxSplits; ++c) {
      if (ls[c] > 0.f) {
        const float w = __expf(ms[c] - mx);
        L += ls[c] * w;
        O += os[c] * w;
      }
    }
    act[idx] = from_float<T>(bad ? NAN : L > 0.f ? O / L : 0.f);
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
  float* red = reinterpret_cast<float*>(ring.empty + kStepMaxSlots);
  const int t = blockIdx.x;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.slots; ++s) {
      mbarrier_init(&ring.full[s], 1);
      mbarrier_init(&ring.empty[s], 1);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (threadIdx.x >= kStepConsumers) {  // the copy warp: one thread issues every copy, slots permitting
    if (threadIdx.x == kStepConsumers) {
      int i = 0;
      for_each_load<T>(p, t, [&](const T* src, uint32_t bytes) {
        const int s = i % ring.slots;
        if (i >= ring.slots) mbarrier_wait(&ring.empty[s], ((i / ring.slots) - 1) & 1);
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
    mbarrier_wait(&ring.full[s], (i / ring.slots) & 1);
    return reinterpret_cast<const T*>(ring.base + s * ring.slot_bytes);
  };
  auto give_back = [&]() {
    consumers_sync();
    if (threadIdx.x == 0) mbarrier_arrive(&ring.empty[i % ring.slots]);
    ++i;
  };

  const int C = p.width, B = p.batch;
  T* x = static_cast<T*>(p.x);
  const int items = B * p.n_head * p.att_splits;
  const int item = int(gridDim.x) - 1 - t;  // attention on the last blocks, which own the fewest tiles
  float* part = reinterpret_cast<float*>(act);
  float* qs = part + kWarps * kStepHeadDim;
  // Constants of the launch and of each tile's epilogue, in shared memory: the new slots, a tile's bias, and
  // the residual rows its projection adds (read right after the wait, beside the phase's input).
  int* slots = reinterpret_cast<int*>(red + 16);
  float* bias_s = reinterpret_cast<float*>(slots + kStepMaxRows);
  float* res_s = bias_s + kStepMaxTileRows;
  float* dot = res_s + kStepMaxRows * kStepMaxTileRows;  // [kStepMaxTileRows][kStepMaxRows]: a tile's dot products
  if (threadIdx.x < B) slots[threadIdx.x] = p.seqlens[threadIdx.x];
  stamp(p, 0);
  // Residual rows r0 .. r0 + rows - 1 of x into res_s [batch][kStepMaxTileRows].
  auto load_residual = [&](int r0, int rows) {
    for (int i = threadIdx.x; i < B * rows; i += kStepConsumers) {
      res_s[(i / rows) * kStepMaxTileRows + i % rows] = ld_f(x + (i / rows) * C + r0 + i % rows);
    }
  };

  for (int l = 0; l < p.n_layer; ++l) {
    const StepLayer& L = p.layers[l];
    // c_attn over ln_1(x): queries to qkv, keys and values into the cache at slot seqlens[b].
    if (t < p.tiles[0]) {
      const int r0 = t * p.tile_rows[0];
      const int rows = min(p.tile_rows[0], 3 * C - r0);
      const NormParams np = load_norm<T>(p, L.ln1_w, L.ln1_b);
      load_bias<T>(L.b_qkv, r0, rows, bias_s);
      stamp(p, stamp_of(l, 0));
      if (l > 0) {
        wait_for(counter(p, l - 1, 4), p.tiles[3]);
      } else {
        consumers_sync();
      }
      stamp(p, stamp_of(l, 0) + 1);
      norm_rows<T>(p, np, act, red, l == 0);
      stamp(p, stamp_of(l, 0) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 0) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      for (int i = threadIdx.x; i < rows * B; i += kStepConsumers) {
        const int r = i / B, b = i % B, n = r0 + r;
        const int part_of = n / C, within = n % C, hh = within / kStepHeadDim, d = within % kStepHeadDim;
        const T y = from_float<T>(dot[r * kStepMaxRows + b] + bias_s[r]);
        if (part_of == 0) {
          static_cast<T*>(p.qkv)[int64_t(b) * 3 * C + n] = y;
        } else if (slots[b] >= 0 && slots[b] < p.max_len) {
          T* cache = static_cast<T*>(part_of == 1 ? p.k_cache : p.v_cache);
          cache[(((int64_t(l) * B + b) * p.n_head + hh) * p.max_len + slots[b]) * kStepHeadDim + d] = y;
        }
      }
      stamp(p, stamp_of(l, 0) + 5);
      give_back();
      signal(counter(p, l, 0));
      stamp(p, stamp_of(l, 0) + 2);
    }
    // attention: one split of one (sequence, head) a block, its cached rows prefetched before the wait.
    if (item >= 0 && item < items) {
      prefetch_split<T>(p, l, item);
      stamp(p, stamp_of(l, 1));
      wait_for(counter(p, l, 0), p.tiles[0]);
      stamp(p, stamp_of(l, 1) + 1);
      attend_split<T>(p, l, item, part, qs);
      signal(counter(p, l, 1));
      stamp(p, stamp_of(l, 1) + 2);
    }
    // attention's c_proj (its input: the splits merged), + residual.
    if (t < p.tiles[1]) {
      const int r0 = t * p.tile_rows[1];
      const int rows = min(p.tile_rows[1], C - r0);
      load_bias<T>(L.b_o, r0, rows, bias_s);
      stamp(p, stamp_of(l, 2));
      wait_for(counter(p, l, 1), items);
      stamp(p, stamp_of(l, 2) + 1);
      load_residual(r0, rows);
      merge_splits<T>(p, act);
      stamp(p, stamp_of(l, 2) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 2) + 4);
      tile_dots<T>(w, rows, C, act, B, dot);
      for (int i = threadIdx.x; i < rows * B; i += kStepConsumers) {
        const int r = i / B, b = i % B;
        x[b * C + r0 + r] = from_float<T>(dot[r * kStepMaxRows + b] + bias_s[r] + res_s[b * kStepMaxTileRows + r]);
      }
      stamp(p, stamp_of(l, 2) + 5);
      give_back();
      signal(counter(p, l, 2));
      stamp(p, stamp_of(l, 2) + 2);
    }
    // c_fc over ln_2(x), GELU.
    if (t < p.tiles[2]) {
      const int r0 = t * p.tile_rows[2];
      const int rows = min(p.tile_rows[2], 4 * C - r0);
      const NormParams np = load_norm<T>(p, L.ln2_w, L.ln2_b);
      load_bias<T>(L.b_fc, r0, rows, bias_s);
      stamp(p, stamp_of(l, 3));
      wait_for(counter(p, l, 2), p.tiles[1]);
      stamp(p, stamp_of(l, 3) + 1);
      norm_rows<T>(p, np, act, red, false);
      stamp(p, stamp_of(l, 3) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 3) + 4);
      T* hidden = static_cast<T*>(p.hidden);
      tile_dots<T>(w, rows, C, act, B, dot);
      for (int i = threadIdx.x; i < rows * B; i += kStepConsumers) {
        const int r = i / B, b = i % B;
        hidden[b * 4 * C + r0 + r] = from_float<T>(gelu_tanh(dot[r * kStepMaxRows + b] + bias_s[r]));
      }
      stamp(p, stamp_of(l, 3) + 5);
      give_back();
      signal(counter(p, l, 3));
      stamp(p, stamp_of(l, 3) + 2);
    }
    // the MLP's c_proj, + residual.
    if (t < p.tiles[3]) {
      const int r0 = t * p.tile_rows[3];
      const int rows = min(p.tile_rows[3], C - r0);
      load_bias<T>(L.b_p, r0, rows, bias_s);
      stamp(p, stamp_of(l, 4));
      wait_for(counter(p, l, 3), p.tiles[2]);
      stamp(p, stamp_of(l, 4) + 1);
      load_residual(r0, rows);
      stage_rows<T>(static_cast<const T*>(p.hidden), B, 4 * C, act);
      stamp(p, stamp_of(l, 4) + 3);
      const T* w = take();
      stamp(p, stamp_of(l, 4) + 4);
      tile_dots<T>(w, rows, 4 * C, act, B, dot);
      for (int i = threadIdx.x; i < rows * B; i += kStepConsumers) {
        const int r = i / B, b = i % B;
        x[b * C + r0 + r] = from_float<T>(dot[r * kStepMaxRows + b] + bias_s[r] + res_s[b * kStepMaxTileRows + r]);
      }
      stamp(p, stamp_of(l, 4) + 5);
      give_back();
      signal(counter(p, l, 4));
      stamp(p, stamp_of(l, 4) + 2);
    }
  }
  // ln_f, then this block's rows of the lm_head (tied to wte), chunk by chunk through the ring.
  const int v0 = t * p.vocab_rows, v1 = min(p.vocab, v0 + p.vocab_rows);
  if (v0 < v1) {
    const NormParams np = load_norm<T>(p, p.lnf_w, p.lnf_b);
    stamp(p, stamp_of(p.n_layer, 0));
    wait_for(counter(p, p.n_layer - 1, 4), p.tiles[3]);
    stamp(p, stamp_of(p.n_layer, 0) + 1);
    norm_rows<T>(p, np, act, red, false);
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
  // The last block to finish resets the counters for the next launch (every other block is past its waits).
  consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned done = atomicAdd(p.counters, 1u);
    reinterpret_cast<volatile int*>(red)[kWarps] = done == gridDim.x - 1;
  }
  consumers_sync();
  if (reinterpret_cast<volatile int*>(red)[kWarps]) {
    const int n = 1 + p.n_layer * kPhases;
    for (int c = threadIdx.x; c < n; c += kStepConsumers) p.counters[c * kCounterStride] = 0u;
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
