// gpt2_decode_step_kernel: one whole GPT-2 decode step in one persistent launch (sm_90).
//
// What it computes (fused_attn.reference.gpt2_decode_step is the definition): for each sequence b,
// x = wte[token] + wpe[pos]; per layer, ln_1 -> c_attn (+ bias; q to the workspace, k and v into the
// cache at slot seqlens[b]) -> attention over slots leftpad[b] .. seqlens[b] -> c_proj (+ bias +
// residual) -> ln_2 -> c_fc (+ bias, GELU tanh) -> c_proj (+ bias + residual); then ln_f and the
// lm_head (wte) into logits [batch, vocab]. Every linear rounds once to T after bias, activation
// and residual in float32, every norm rounds its output to T: the numerics of our module-per-launch
// step (fused_attn.linear, fused_attn.layer_norm, fused_attn.decode_attention).
//
// Why one launch: at batch 1 GPT-2 small's decode step is ~95 launches of a few microseconds each
// that move 249 MB of weights in all (83 us at copy bandwidth on an H100); launch and drain gaps,
// not bytes, set the time. Here the grid is one block per SM, resident for the whole step
// (cooperative launch), and the 61 data dependencies of the step (5 per layer, then the lm_head)
// are grid barriers: one atomic per block and a spin on a generation word in global memory.
//
// The weights never wait for a barrier. A block owns a fixed slice of rows of every weight matrix
// (rows n * g / G .. n * (g + 1) / G of block g of G); its producer warp streams those slices, in
// step order, with TMA bulk copies (cp.async.bulk, one per chunk of whole rows) into a ring of
// shared-memory slots guarded by full / empty mbarriers, running as far ahead as the ring allows
// (at most `inflight` chunks in flight when the launcher limits them),
// across the barriers. The eight consumer warps, at each stage: prefetch the stage's constants
// (norm weights, bias, residual) into registers, wait at the grid barrier, stage the stage's input
// rows into shared memory (normalized in place for ln_1 / ln_2 / ln_f), then per chunk: dot
// products from shared memory (a warp per (row, part of K), float32, the partials summed in a fixed
// order: the result does not depend on timing), and the epilogue. Attention: a block per (sequence,
// head), a warp per 32 keys, online softmax, merged over warps in shared memory.
//
// Measured (H100, fp16, bench/NOTES.md session 8): correct, but 0.51-0.55 ms a step at batch 1 against
// 0.28 for the same ops as ~95 PDL-chained kernels, and 2.0 ms at batch 16: a stage costs ~7 us
// (35 us a layer), where bench/probe_grid_barrier.py puts an idle barrier plus a dependent read at
// 1.5 us; the rest was not located. The attention stage walks long caches serially (L512: +200 us) and
// the batch-16 dot products run on CUDA cores. Kept as the graph-persistent backend, not the default.
//
// Invalid lengths (seqlens[b] outside [0, max_len), leftpad[b] outside [0, seqlens[b]], pos[b]
// outside [0, n_positions), token[b] outside [0, vocab)): that sequence's logits are NaN and its
// cache is not written; nothing is read out of bounds.
//
// Tests: tests/test_gpt2_decode_step.py; benchmark: bench/bench_gpt2.py (backend graph-persistent).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/math.cuh"
#include "../common/grid_sync.cuh"
#include "../common/mbarrier.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/reduce.cuh"
#include "../common/vec_dtypes.cuh"
#include "gpt2_decode_step_launch.h"

namespace fused_attn {
namespace step {

constexpr int kConsumerBarrier = 1;  // named barrier of the consumer warps (0 is __syncthreads)
// Stages of weights in step order: per layer c_attn, attn.c_proj, c_fc, mlp.c_proj; then the lm_head.
enum Kind { kQkv = 0, kOut = 1, kFc = 2, kProj = 3, kHead = 4 };

__device__ __forceinline__ void consumers_sync() { named_barrier_sync(kConsumerBarrier, kStepConsumers); }

// ------------------------------------------------------------------------------------------ loads
// Data written by other blocks of this launch is read through L2 only (.cg): L1 is not coherent.
__device__ __forceinline__ float raw_cg(const float* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ __half raw_cg(const __half* ptr) {
  return __ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(ptr)));
}
__device__ __forceinline__ __nv_bfloat16 raw_cg(const __nv_bfloat16* ptr) {
  return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(ptr)));
}
template <typename T>
__device__ __forceinline__ float load_cg(const T* ptr) {
  return to_float(raw_cg(ptr));
}
// Two consecutive elements (4- or 8-byte aligned) in one load.
__device__ __forceinline__ void load2_cg(const float* ptr, float& a, float& b) {
  const float2 v = __ldcg(reinterpret_cast<const float2*>(ptr));
  a = v.x;
  b = v.y;
}
__device__ __forceinline__ void load2_cg(const __half* ptr, float& a, float& b) {
  const unsigned u = __ldcg(reinterpret_cast<const unsigned*>(ptr));
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&u));
  a = v.x;
  b = v.y;
}
__device__ __forceinline__ void load2_cg(const __nv_bfloat16* ptr, float& a, float& b) {
  const unsigned u = __ldcg(reinterpret_cast<const unsigned*>(ptr));
  const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  a = v.x;
  b = v.y;
}

// 8 consecutive elements (16 bytes of a 16-bit type, 32 of float32) as floats.
template <typename T>
__device__ __forceinline__ void unpack8(const Pack<8, T>& v, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(v.v[i]);
}
template <typename T>
__device__ __forceinline__ Pack<8, T> load8_cg(const T* ptr) {
  Pack<8, T> v;
  uint4* dst = reinterpret_cast<uint4*>(&v);
  const uint4* src = reinterpret_cast<const uint4*>(ptr);
#pragma unroll
  for (int i = 0; i < int(sizeof(v) / 16); ++i) dst[i] = __ldcg(src + i);
  return v;
}
template <typename T>
__device__ __forceinline__ Pack<8, T> load8_ldg(const T* ptr) {
  Pack<8, T> v;
  uint4* dst = reinterpret_cast<uint4*>(&v);
  const uint4* src = reinterpret_cast<const uint4*>(ptr);
#pragma unroll
  for (int i = 0; i < int(sizeof(v) / 16); ++i) dst[i] = __ldg(src + i);
  return v;
}

// A warp's sum / NaN-propagating max: common/reduce.cuh's group reduction over 32 lanes.
__device__ __forceinline__ float warp_sum(float v) { return group_reduce<32>(v, nullptr, SumOp{}); }
__device__ __forceinline__ float warp_max(float v) { return group_reduce<32>(v, nullptr, MaxOp{}); }

// ------------------------------------------------------------------------------ the grid barrier
// A wait of this kernel (grid barrier, ring slot) that outlasts kHangNs (common/grid_sync.cuh) can only
// be a bug (a block that never arrives, a chunk never sent): trap, so the launch fails instead of
// hanging the GPU.
__device__ __forceinline__ void wait_slot(uint64_t* bar, int phase) {
  if (mbarrier_try_wait(bar, phase)) return;
  const uint64_t t0 = global_ns();
  while (!mbarrier_try_wait(bar, phase)) {
    if (global_ns() - t0 > kHangNs) __trap();
  }
}

// The grid barrier, in two halves, called by every consumer thread of every block: the writes of
// this block's consumers before arrive() are visible to every block's reads after wait(). In between
// a block issues the loads of the next stage's constants, which do not depend on the barrier: they
// are in flight while thread 0 spins and do not delay this block's arrival.
// One counter per launch, in the workspace header, polled by every block: the k-th barrier is passed
// when it reaches k * blocks. Arrival is one release reduction (no return value to wait for), so a
// barrier costs a store's way to L2 plus the pollers' next read. The counter is not reset between
// barriers; finish(), called once after the last wait, counts blocks out, and the last one out zeroes
// the counter and itself for the next launch (no block polls any more by then).
struct GridBarrier {
  unsigned* count;  // workspace header word 0: arrivals in this launch
  unsigned* exits;  // word 32 (another 128-byte line): blocks past their last wait
  unsigned target;  // thread 0: arrivals that complete the next barrier

  __device__ void arrive() {
    consumers_sync();
    if (threadIdx.x == 0) {
      target += gridDim.x;
      add_release(count, 1u);
    }
  }
  __device__ void wait() {
    cp_async_wait<0>();  // this thread's prefetches into shared memory (the norm's weights)
    if (threadIdx.x == 0) {
      wait_at_least(count, target);
    }
    consumers_sync();
  }
  __device__ void finish() {
    if (threadIdx.x == 0 && atomicAdd(exits, 1u) == gridDim.x - 1) {
      atomicExch(count, 0u);
      atomicExch(exits, 0u);
    }
  }
};

// --------------------------------------------------------------------------- the weight stream
template <typename T>
struct Stage {
  const T* w;     // [rows, k]
  const T* bias;  // [rows] or nullptr
  int rows, k, layer, kind;
};
template <typename T>
__device__ __forceinline__ Stage<T> stage_of(const Gpt2StepParams& p, int s) {
  const int64_t C = p.n_embd, I = p.n_inner;
  const int l = s / 4;
  switch (s == 4 * p.n_layer ? int(kHead) : s % 4) {
    case kQkv:
      return {static_cast<const T*>(p.w_qkv) + l * 3 * C * C, static_cast<const T*>(p.b_qkv) + l * 3 * C,
              int(3 * C), int(C), l, kQkv};
    case kOut:
      return {static_cast<const T*>(p.w_o) + l * C * C, static_cast<const T*>(p.b_o) + l * C, int(C), int(C), l,
              kOut};
    case kFc:
      return {static_cast<const T*>(p.w_fc) + l * I * C, static_cast<const T*>(p.b_fc) + l * I, int(I), int(C), l,
              kFc};
    case kProj:
      return {static_cast<const T*>(p.w_proj) + l * C * I, static_cast<const T*>(p.b_proj) + l * C, int(C), int(I),
              l, kProj};
    default:
      return {static_cast<const T*>(p.wte), nullptr, p.vocab, int(C), p.n_layer, kHead};
  }
}
// This block's rows of a stage's weight: [n0, n1).
__device__ __forceinline__ void block_rows(int rows, int& n0, int& n1) {
  n0 = int(int64_t(rows) * blockIdx.x / gridDim.x);
  n1 = int(int64_t(rows) * (blockIdx.x + 1) / gridDim.x);
}
template <typename T>
__device__ __forceinline__ int chunk_rows(const Gpt2StepParams& p, int k) {
  return p.slot_bytes / (k * int(sizeof(T)));
}

// The producer (one thread): every chunk of this block's rows, in step order, into the ring.
template <typename T>
__device__ void produce(const Gpt2StepParams& p, unsigned char* ring, uint64_t* full, uint64_t* empty) {
  int c = 0;
  for (int s = 0; s <= 4 * p.n_layer; ++s) {
    const Stage<T> st = stage_of<T>(p, s);
    int n0, n1;
    block_rows(st.rows, n0, n1);
    const int rmax = chunk_rows<T>(p, st.k);
    for (int r = n0; r < n1; r += rmax, ++c) {
      const int slot = c % p.ring, use = c / p.ring;
      if (use > 0) wait_slot(empty + slot, (use - 1) & 1);
      // A limit on chunks in flight: wait until chunk c - inflight has landed (its slot is refilled
      // only by chunk c - inflight + ring, after this one, so the parity is unambiguous).
      if (c >= p.inflight && p.inflight < p.ring) {
        const int old = c - p.inflight;
        wait_slot(full + old % p.ring, (old / p.ring) & 1);
      }
      const uint32_t bytes = uint32_t(min(rmax, n1 - r)) * st.k * uint32_t(sizeof(T));
      mbarrier_arrive_expect_tx(full + slot, bytes);
      bulk_copy_to_shared(ring + size_t(slot) * p.slot_bytes, st.w + int64_t(r) * st.k, bytes, full + slot);
    }
  }
}

// ---------------------------------------------------------------------------------- consumers
template <typename T, int BB>
struct Consumer {
  const Gpt2StepParams& p;
  unsigned char* ring;
  T* act;         // [batch, width] the stage's input rows
  float* red;     // partial sums; the attention's scratch
  T* norm;        // [2, n_embd] the next norm's weight and bias
  int* valid;     // [kStepMaxBatch] each: per sequence
  int* start;     // leftpad
  int* slot;      // seqlens: this token's cache slot
  uint64_t* full;
  uint64_t* empty;
  int tid, warp, lane;
  int chunk = 0;  // chunks consumed (the ring position)
  GridBarrier grid{nullptr, nullptr, 0};
  // Registers loaded between grid.arrive() and grid.wait(), converted after it: a conversion before
  // the wait would stall the thread on the load there.
  T bias_r[kStepPrefetch], res_r[kStepPrefetch];
  // The stage trace (bench/trace_gpt2_step.py; built only with -DFUSED_ATTN_STEP_TRACE=<marks per block>,
  // compiled out otherwise): at each mark() thread 0 of every block stores (%globaltimer, clock64) into
  // [blocks, marks, 2] uint64 past f in the workspace, at f's end rounded up to 16 bytes (workspace_bytes;
  // the caller allocates the room). The summary reads %globaltimer (comparable across blocks); clock64 is
  // there for cycle-resolution intervals within a block. The marks, in order: the start; per layer 27
  // (run()'s numbered comments, gemv's two per stage); ln_f + lm_head 6.
#ifdef FUSED_ATTN_STEP_TRACE
  unsigned long long* trace = nullptr;
  int nmark = 0;
  __device__ void mark() {
    if (tid == 0 && nmark < FUSED_ATTN_STEP_TRACE) {
      unsigned long long* t = trace + (size_t(blockIdx.x) * FUSED_ATTN_STEP_TRACE + nmark) * 2;
      t[0] = global_ns();
      t[1] = clock64();
    }
    ++nmark;
  }
#else
  __device__ void mark() {}
#endif

  __device__ T* x() const { return static_cast<T*>(p.x); }

  // The norm's weight and bias into shared memory (cp.async: nothing waits until grid.wait()).
  __device__ void prefetch_norm(int index) {
    const T* src = static_cast<const T*>(p.norms) + int64_t(index) * 2 * p.n_embd;
    const int chunks = 2 * p.n_embd * int(sizeof(T)) / 16;
    for (int i = tid; i < chunks; i += kStepConsumers) {
      cp_async16(reinterpret_cast<uint4*>(norm) + i, reinterpret_cast<const uint4*>(src) + i, true);
    }
    cp_async_commit();
  }
  // Output pairs e = (row - n0) * batch + b this thread owns (e = tid + 256 j): bias, and the
  // residual x[b, row] where the stage adds one (x is final two barriers before its use).
  __device__ void prefetch_pairs(const Stage<T>& st, bool residual) {
    int n0, n1;
    block_rows(st.rows, n0, n1);
#pragma unroll
    for (int j = 0; j < kStepPrefetch; ++j) {
      const int e = tid + j * kStepConsumers;
      if (e < (n1 - n0) * p.batch) {
        const int n = n0 + e / p.batch, b = e % p.batch;
        bias_r[j] = st.bias[n];
        if (residual) res_r[j] = raw_cg(x() + int64_t(b) * p.n_embd + n);
      }
    }
  }

  // act = x (layer 0: wte[token] + wpe[pos], which block 0 also writes to the workspace), each row
  // normalized with the prefetched norm: float32 statistics, rounded to T. A warp per row, the row's
  // vectors loaded into registers all at once (one L2 round trip), no block barrier until done.
  __device__ void stage_norm(bool embed) {
    constexpr int kVecs = kStepMaxWidth / 256;  // 8-element vectors per lane at most
    const int C = p.n_embd;
    for (int b = warp; b < p.batch; b += kStepConsumerWarps) {
      Pack<8, T> xr[kVecs];
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int k = (lane + 32 * i) * 8;
        if (k >= C) continue;
        if (!embed) {
          xr[i] = load8_cg(x() + int64_t(b) * C + k);
        } else {
          float e[8], w[8];
          if (valid[b]) {
            unpack8(load8_ldg(static_cast<const T*>(p.wte) + p.token[b] * C + k), e);
            unpack8(load8_ldg(static_cast<const T*>(p.wpe) + int64_t(p.pos[b]) * C + k), w);
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) e[j] = w[j] = __int_as_float(0x7fc00000);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) xr[i].v[j] = from_float<T>(e[j] + w[j]);
        }
      }
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if ((lane + 32 * i) * 8 >= C) continue;
        if (embed && blockIdx.x == 0) *reinterpret_cast<Pack<8, T>*>(x() + int64_t(b) * C + (lane + 32 * i) * 8) = xr[i];
        float f[8];
        unpack8(xr[i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += f[j];
      }
      const float mu = warp_sum(s) / C;
      float q = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if ((lane + 32 * i) * 8 >= C) continue;
        float f[8];
        unpack8(xr[i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) q += (f[j] - mu) * (f[j] - mu);
      }
      const float rs = rsqrtf(warp_sum(q) / C + p.eps);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int k = (lane + 32 * i) * 8;
        if (k >= C) continue;
        float f[8], w[8], bb[8];
        unpack8(xr[i], f);
        unpack8(*reinterpret_cast<const Pack<8, T>*>(norm + k), w);
        unpack8(*reinterpret_cast<const Pack<8, T>*>(norm + C + k), bb);
        Pack<8, T> y;
#pragma unroll
        for (int j = 0; j < 8; ++j) y.v[j] = from_float<T>((f[j] - mu) * rs * w[j] + bb[j]);
        *reinterpret_cast<Pack<8, T>*>(act + b * C + k) = y;
      }
    }
    consumers_sync();
  }

  // act = src [batch, width] (written by other blocks in the stage before): cp.async through L2, every
  // thread's copies in flight at once.
  __device__ void stage_copy(const T* src, int width) {
    const int chunks = p.batch * width * int(sizeof(T)) / 16;
    for (int i = tid; i < chunks; i += kStepConsumers) {
      cp_async16(reinterpret_cast<uint4*>(act) + i, reinterpret_cast<const uint4*>(src) + i, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    consumers_sync();
  }

  // The epilogue of output (row n, sequence b), y = x_b · w_n; e its pair index (see prefetch_pairs).
  __device__ void epilogue(const Stage<T>& st, int n, int b, int e, float y) {
    const int j = e / kStepConsumers;
    if (st.kind != kHead) y += to_float(j == 0 ? bias_r[0] : j == 1 ? bias_r[1] : st.bias[n]);
    const int64_t C = p.n_embd;
    switch (st.kind) {
      case kQkv:
        if (n < C) {
          static_cast<T*>(p.q)[b * C + n] = from_float<T>(y);
        } else if (valid[b]) {
          const int c = (n - int(C)) % int(C), h = c / kStepHeadDim, d = c % kStepHeadDim;
          T* cache = static_cast<T*>(n < 2 * C ? p.k_cache : p.v_cache);
          const int64_t row = (int64_t(st.layer) * p.batch + b) * p.nheads + h;
          cache[(row * p.max_len + slot[b]) * kStepHeadDim + d] = from_float<T>(y);
        }
        break;
      case kOut:
      case kProj: {
        const float r = to_float(j == 0 ? res_r[0] : j == 1 ? res_r[1] : raw_cg(x() + b * C + n));
        x()[b * C + n] = from_float<T>(y + r);
        break;
      }
      case kFc:
        static_cast<T*>(p.f)[int64_t(b) * p.n_inner + n] = from_float<T>(gelu_tanh(y));
        break;
      default:
        static_cast<T*>(p.logits)[int64_t(b) * p.vocab + n] = from_float<T>(y);
    }
  }

  // This block's rows of stage s, chunk by chunk from the ring: y = act_b · w_n for each row n and
  // sequence b, then the epilogue.
  __device__ void gemv(const Stage<T>& st) {
    int n0, n1;
    block_rows(st.rows, n0, n1);
    const int rmax = chunk_rows<T>(p, st.k), K = st.k, nv = K / 8, nseg = (nv + 31) / 32, B = p.batch;
    for (int r0 = n0; r0 < n1; r0 += rmax, ++chunk) {
      const int R = min(rmax, n1 - r0), s = chunk % p.ring;
      // Parts of K per row, so that the rows of a small chunk still spread over all warps.
      const int P = min(nseg, max(1, (2 * kStepConsumerWarps + R - 1) / R));
      wait_slot(full + s, (chunk / p.ring) & 1);
      if (r0 == n0) mark();  // the stage's first chunk has landed
      const T* w = reinterpret_cast<const T*>(ring + size_t(s) * p.slot_bytes);
      // Partial sums in alternate halves of red: the next chunk's writes never meet this one's reads.
      float* part = red + (chunk & 1) * (p.red_floats / 2);
      for (int it = warp; it < R * P; it += kStepConsumerWarps) {
        const int r = it / P, kp = it % P;
        float acc[BB];
#pragma unroll
        for (int b = 0; b < BB; ++b) acc[b] = 0.f;
        for (int sg = kp; sg < nseg; sg += P) {
          const int v = sg * 32 + lane;
          if (v < nv) {
            float wv[8];
            unpack8(*reinterpret_cast<const Pack<8, T>*>(w + r * K + 8 * v), wv);
#pragma unroll
            for (int b = 0; b < BB; ++b) {
              if (b < B) {
                float xv[8];
                unpack8(*reinterpret_cast<const Pack<8, T>*>(act + b * K + 8 * v), xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[b] = fmaf(wv[i], xv[i], acc[b]);
              }
            }
          }
        }
#pragma unroll
        for (int b = 0; b < BB; ++b) {
          if (b < B) {
            const float t = warp_sum(acc[b]);
            if (lane == 0) part[(kp * R + r) * B + b] = t;
          }
        }
      }
      consumers_sync();
      if (r0 == n0) mark();  // its dot products are done
      if (tid == 0) mbarrier_arrive(empty + s);  // every consumer is done reading the slot
      const int e0 = (r0 - n0) * B, e1 = e0 + R * B;
      for (int e = e0 + ((tid - e0) % kStepConsumers + kStepConsumers) % kStepConsumers; e < e1;
           e += kStepConsumers) {
        const int r = e / B - (r0 - n0), b = e % B;
        float y = 0.f;
        for (int kp = 0; kp < P; ++kp) y += part[(kp * R + r) * B + b];
        epilogue(st, r0 + r, b, e, y);
      }
    }
  }

  // softmax(q k^T / sqrt(64)) v of each (sequence, head) over its slots start .. slot: a block per
  // pair, a warp per 32 keys (a lane per key for the scores, a lane per 2 dims for P V), merged over
  // the warps in shared memory.
  __device__ void attention(int layer) {
    float* qs = red;               // [64] q * scale * log2(e)
    float* wm = red + 64;          // [8] per warp: running max
    float* wl = wm + 8;            // [8] sum of exps
    float* wo = wl + 8;            // [8][64] unnormalized output
    const int H = p.nheads, C = p.n_embd;
    for (int task = blockIdx.x; task < p.batch * H; task += gridDim.x) {
      const int b = task / H, h = task % H;
      const bool ok = valid[b];
      if (tid < kStepHeadDim) qs[tid] = ok ? load_cg(static_cast<const T*>(p.q) + b * C + h * kStepHeadDim + tid) *
                                                 p.scale_log2
                                           : 0.f;
      consumers_sync();
      if (ok) {
        const int first = start[b], last = slot[b], n = last - first + 1;
        const int64_t base = ((int64_t(layer) * p.batch + b) * H + h) * p.max_len * kStepHeadDim;
        const T* kc = static_cast<const T*>(p.k_cache) + base;
        const T* vc = static_cast<const T*>(p.v_cache) + base;
        float m = kNegInf, l = 0.f, o0 = 0.f, o1 = 0.f;
        for (int t0 = warp * 32; t0 < n; t0 += 32 * kStepConsumerWarps) {
          const int j = first + t0 + lane;
          const bool live = t0 + lane < n;
          float sc = kNegInf;
          if (live) {
            float acc = 0.f;
#pragma unroll
            for (int d = 0; d < kStepHeadDim; d += 8) {
              float kv[8];
              unpack8(load8_cg(kc + int64_t(j) * kStepHeadDim + d), kv);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc = fmaf(qs[d + i], kv[i], acc);
            }
            sc = acc;
          }
          float v0[32], v1[32];
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            v0[i] = v1[i] = 0.f;
            if (t0 + i < n) load2_cg(vc + int64_t(first + t0 + i) * kStepHeadDim + 2 * lane, v0[i], v1[i]);
          }
          const float mn = max_nan(m, warp_max(sc));
          const float pr = live ? fast_exp2(sc - mn) : 0.f;
          const float alpha = m == kNegInf ? 0.f : fast_exp2(m - mn);
          l = l * alpha + warp_sum(pr);
          o0 *= alpha;
          o1 *= alpha;
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            const float pi = __shfl_sync(0xffffffffu, pr, i);
            o0 = fmaf(pi, v0[i], o0);
            o1 = fmaf(pi, v1[i], o1);
          }
          m = mn;
        }
        // Every warp writes, those with no key too (m -inf, l 0): nothing stale from the last pair.
        if (lane == 0) {
          wm[warp] = m;
          wl[warp] = l;
        }
        wo[warp * kStepHeadDim + 2 * lane] = o0;
        wo[warp * kStepHeadDim + 2 * lane + 1] = o1;
      }
      consumers_sync();
      if (tid < kStepHeadDim) {
        float out = __int_as_float(0x7fc00000);
        if (ok) {
          float mx = kNegInf;
          for (int w = 0; w < kStepConsumerWarps; ++w) mx = max_nan(mx, wm[w]);
          float den = 0.f, num = 0.f;
          for (int w = 0; w < kStepConsumerWarps; ++w) {
            if (wm[w] == kNegInf) continue;  // a warp with no key
            const float sc = fast_exp2(wm[w] - mx);
            den += wl[w] * sc;
            num += wo[w * kStepHeadDim + tid] * sc;
          }
          out = num / den;
        }
        static_cast<T*>(p.a)[b * C + h * kStepHeadDim + tid] = from_float<T>(out);
      }
      consumers_sync();
    }
  }

  __device__ void run() {
#ifdef FUSED_ATTN_STEP_TRACE
    trace = reinterpret_cast<unsigned long long*>(
        (reinterpret_cast<uintptr_t>(static_cast<T*>(p.f) + int64_t(p.batch) * p.n_inner) + 15) & ~uintptr_t(15));
#endif
    mark();  // start
    if (tid < p.batch) {
      const int b = tid, s = p.seqlens[b], lp = p.leftpad[b], ps = p.pos[b];
      const int64_t tk = p.token[b];
      valid[b] = s >= 0 && s < p.max_len && lp >= 0 && lp <= s && ps >= 0 && ps < p.n_positions && tk >= 0 &&
                 tk < p.vocab;
      start[b] = lp;
      slot[b] = s;
    }
    grid.count = p.barrier;
    grid.exits = p.barrier + 32;
    const int L = p.n_layer;
    for (int l = 0; l < L; ++l) {
      // ln_1 -> c_attn: q to the workspace, k and v into the cache.
      Stage<T> st = stage_of<T>(p, 4 * l + kQkv);
      if (l > 0) grid.arrive();
      mark();  // 0 arrive (qkv)
      prefetch_norm(2 * l);
      prefetch_pairs(st, false);
      if (l > 0) {
        grid.wait();
      } else {
        cp_async_wait<0>();
        consumers_sync();  // the norm's weights, valid[] and the other per-sequence values
      }
      mark();  // 1 waited
      stage_norm(l == 0);
      mark();  // 2 normed
      gemv(st);  // 3 slot ready, 4 dots
      mark();  // 5 epilogue done
      grid.arrive();
      mark();  // 6 arrive (attention)
      grid.wait();
      mark();  // 7 waited
      // Attention of each (sequence, head) over its cache.
      attention(l);
      mark();  // 8 attention done
      // attn.c_proj + residual.
      st = stage_of<T>(p, 4 * l + kOut);
      grid.arrive();
      mark();  // 9 arrive (out)
      prefetch_pairs(st, true);
      grid.wait();
      mark();  // 10 waited
      stage_copy(static_cast<const T*>(p.a), p.n_embd);
      mark();  // 11 staged
      gemv(st);  // 12 slot ready, 13 dots
      mark();  // 14 epilogue done
      // ln_2 -> c_fc -> GELU.
      st = stage_of<T>(p, 4 * l + kFc);
      grid.arrive();
      mark();  // 15 arrive (fc)
      prefetch_norm(2 * l + 1);
      prefetch_pairs(st, false);
      grid.wait();
      mark();  // 16 waited
      stage_norm(false);
      mark();  // 17 normed
      gemv(st);  // 18 slot ready, 19 dots
      mark();  // 20 epilogue done
      // mlp.c_proj + residual.
      st = stage_of<T>(p, 4 * l + kProj);
      grid.arrive();
      mark();  // 21 arrive (proj)
      prefetch_pairs(st, true);
      grid.wait();
      mark();  // 22 waited
      stage_copy(static_cast<const T*>(p.f), p.n_inner);
      mark();  // 23 staged
      gemv(st);  // 24 slot ready, 25 dots
      mark();  // 26 epilogue done
    }
    // ln_f -> lm_head.
    grid.arrive();
    mark();  // arrive (head)
    prefetch_norm(2 * L);
    grid.wait();
    mark();  // waited
    grid.finish();
    launch_dependents();  // the sampler's launch may start under the lm_head
    stage_norm(false);
    mark();  // normed
    gemv(stage_of<T>(p, 4 * L));  // slot ready, dots (the first chunk's)
    mark();  // every chunk done
  }
};

}  // namespace step

template <typename T, int BB>
__global__ void __launch_bounds__(kStepThreads, 1) gpt2_decode_step_kernel(const __grid_constant__ Gpt2StepParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) unsigned char smem[];
  const StepSmem lay = step_smem(p);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.bars);
  uint64_t* empty = full + kStepMaxRing;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.ring; ++s) {
      mbarrier_init(full + s, 1);
      mbarrier_init(empty + s, 1);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == kStepConsumerWarps) {
    if (threadIdx.x % 32 == 0) step::produce<T>(p, smem + lay.ring, full, empty);
    return;
  }
  int* seq = reinterpret_cast<int*>(smem + lay.seq);
  step::Consumer<T, BB> c{p,
                          smem + lay.ring,
                          reinterpret_cast<T*>(smem + lay.act),
                          reinterpret_cast<float*>(smem + lay.red),
                          reinterpret_cast<T*>(smem + lay.norm),
                          seq,
                          seq + kStepMaxBatch,
                          seq + 2 * kStepMaxBatch,
                          full,
                          empty,
                          int(threadIdx.x),
                          warp,
                          int(threadIdx.x % 32)};
  c.run();
#endif
}

template <typename T, int BB>
cudaError_t launch_gpt2_decode_step(const Gpt2StepParams& p, int grid, cudaStream_t stream) {
  const size_t smem = step_smem(p).total;
  auto kernel = gpt2_decode_step_kernel<T, BB>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kStepThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // all blocks resident, or the launch fails
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

template <typename T, int BB>
int gpt2_decode_step_blocks_per_sm(size_t smem) {
  auto kernel = gpt2_decode_step_kernel<T, BB>;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.binaryVersion < 90) return 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kStepThreads, smem) != cudaSuccess) return 0;
  return blocks;
}

}  // namespace fused_attn
