"""GPT-2 small's layers in one persistent launch, three phases a layer: the prototype the megakernel is judged by.

    python -m dev.probe_megakernel_layers [--layers 12] [--cache 192] [--repeats 20]

`dev.probe_megakernel_model` measured each term of a persistent decode step apart (hand-offs, weight stream, dot
products) and bounded the design of three phases a layer at >= 0.091 ms/token before attention, the norms and the
lm_head. Earlier persistent steps ran at ~2x their probes' figures. This prototype runs the layers themselves at
batch 1 (fp16 weights, fp32 residual; random weights at GPT-2 small's shapes) so that the design's real phase
times are measured before a full kernel is written:

- A: LayerNorm 1 (every block, from the layer's input), its 18 rows of c_attn (2304 over 128 blocks), q to global,
  k and v appended to the cache at slot T;
- B: attention of one head (12 heads x 11 blocks, each block the whole head over T + 1 keys) and the block's
  70 rows of the head's slice of the attention projection, added into the layer's attention sum (red.add, fp32);
- C: LayerNorm 2 (input + attention sum), 24 rows of c_fc + GELU (3072 over 128 blocks), and the MLP
  projection's partial sums over those 24 hidden units for all 768 outputs, added into the layer's MLP sum.

Each phase waits for every block's previous phase through one counter (barrier, fence, atomic add; one thread
spinning on an acquire load). A block's weights of a layer (108 KB: its c_attn rows, its projection slice, its
c_fc rows and their MLP projection columns) are copied into shared memory two layers ahead with cp.async, so the
weights stream under the chain. Every block stamps %globaltimer after each wait and before each signal.

Switches (each a list: every combination runs, in one process): --vec (C's adds four outputs an instruction),
--copies (the attention and MLP sums in N copies, block b adding into copy b % N, the LayerNorms summing them),
--early (B's cached K and V rows loaded before its wait), --ln-first (A's LayerNorm before its wait for the layer's
weights), --evict-first (the weights' copies marked evict-first in L2).

Prints: the kernel's time for the layers (CUDA events, median), a layer's share, and per phase kind the median
over layers of the slowest block's work (wait passed -> signal; split at the end of its first part) and of the
hop (last signal of the phase before -> first block past its wait); the output's error against a float32
PyTorch reference of the same layers. Nothing is written into the checkout (load_inline builds under torch's
extension cache).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>
#include <vector>

constexpr int C = 768, H = 12, D = 64, F = 3072, QKV = 3 * C;
constexpr int NT = 256, NW = NT / 32;
constexpr int RA = 18;   // c_attn rows a block: 2304 over 128 blocks
constexpr int BH = 11;   // blocks a head in phase B: 12 x 11 = 132
constexpr int RO = 70;   // attention-projection rows a block of a head: 768 over 11
constexpr int RF = 24;   // c_fc rows a block: 3072 over 128 blocks
constexpr int XS = 6;    // elements of the layer's input a block writes: 768 over 128 blocks
constexpr int TA = RA * C, TB = RO * D, TC1 = RF * C, TC2 = C * RF;  // halves of each tile
constexpr int LAYER_HALVES = TA + TB + TC1 + TC2;                   // 110336 bytes
constexpr int MAX_KEYS = NT;
constexpr int MAX_COPIES = 8;  // copies of the attention and MLP sums at most
constexpr int SMEM_BYTES = 2 * LAYER_HALVES * 2 + C * 2 + (MAX_KEYS + NW * D + D + 64 + 32) * 4;

struct Layer {
  const __half *wqkv, *bqkv, *wo, *bo, *wfc, *bfc, *wpr, *bpr, *g1, *b1, *g2, *b2;
  __half *kc, *vc;  // [H][t_max][D]
};
struct Params {
  const Layer* layers;
  int L, T, t_max;
  float *xs, *q;                // [L][C] each: layer inputs (xs[0] given), queries
  float *aacc, *macc;           // [L][copies][C] each: attention sums, MLP sums (block b adds into copy b % copies)
  int* cnt;                     // [L][3] counters, 32 ints apart
  int vec;                      // C's partial sums: four outputs a thread, one red.global.add.v4.f32 (else four adds)
  int copies;                   // copies of each sum: the adds spread over as many lines, the readers sum them
  int early;                    // B's cached K and V rows loaded before its wait (else after it, behind q)
  int ln_first;                 // A's LayerNorm before the wait for the layer's weights (else after it)
  int evict_first;              // the weights' copies marked evict-first in L2
  unsigned long long* trace;    // [grid][L][3][3]: wait passed, the phase's first part done, signal
};

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A 16-byte copy into shared memory; with `hint`, under the L2 cache policy `policy` (createpolicy).
__device__ __forceinline__ void cp16(void* dst, const void* src, bool on, bool hint, uint64_t policy) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (hint) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(d), "l"(src),
                 "r"(on ? 16 : 0), "l"(policy));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(on ? 16 : 0));
  }
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  const __half2* x = reinterpret_cast<const __half2*>(&a);
  const __half2* y = reinterpret_cast<const __half2*>(&b);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 fx = __half22float2(x[k]), fy = __half22float2(y[k]);
    s = fmaf(fx.x, fy.x, fmaf(fx.y, fy.y, s));
  }
  return s;
}

// rows x cols halves (cols a multiple of 8) of a row-major matrix whose rows are ld halves apart, from src into
// dst packed; rows from `valid` on are zero-filled (src is then never read).
__device__ __forceinline__ void copy_tile(__half* dst, const __half* src, int rows, int cols, size_t ld, int valid,
                                          bool hint, uint64_t policy) {
  const int chunks = cols / 8;
  for (int i = threadIdx.x; i < rows * chunks; i += NT) {
    const int r = i / chunks, c = i % chunks;
    const bool on = r < valid;
    cp16(dst + r * cols + c * 8, on ? src + r * ld + c * 8 : src, on, hint, policy);
  }
}

// Block blk's tiles of layer w into buf: c_attn rows, the attention projection's slice, c_fc rows, and the MLP
// projection's columns for those c_fc rows (rows past a matrix: zero fills). hint: the copies marked evict-first
// in L2, so that the 248 MB a launch streams past L2 does not push out the K / V caches B reads.
__device__ void load_layer(const Layer& w, int blk, __half* buf, bool hint) {
  const int a0 = blk * RA, h = blk / BH, o0 = (blk % BH) * RO, f0 = blk * RF;
  const uint64_t pol = hint ? evict_first_policy() : 0;
  copy_tile(buf, a0 < QKV ? w.wqkv + size_t(a0) * C : w.wqkv, RA, C, C, QKV - a0, hint, pol);
  copy_tile(buf + TA, w.wo + size_t(o0) * C + h * D, RO, D, C, C - o0, hint, pol);
  copy_tile(buf + TA + TB, f0 < F ? w.wfc + size_t(f0) * C : w.wfc, RF, C, C, F - f0, hint, pol);
  copy_tile(buf + TA + TB + TC1, f0 < F ? w.wpr + f0 : w.wpr, C, RF, F, f0 < F ? C : 0, hint, pol);
}

// Block-wide sum of (a, b) through red[0 .. 2 NW).
__device__ __forceinline__ float2 block_sum2(float a, float b, float* red) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    red[warp] = a;
    red[NW + warp] = b;
  }
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    s.x += red[w];
    s.y += red[NW + w];
  }
  return s;
}

// LayerNorm of x = a + b + c (b, c optional, each `copies` vectors C apart summed; read past L1: written by other
// SMs in this launch) into xn (half, shared); xs_out (optional): this block's XS elements of x written there.
__device__ void layer_norm(const float* a, const float* b, const float* c, int copies, const __half* g,
                           const __half* bb, __half* xn, float* red, float* xs_out, int blk) {
  float v[C / NT], s = 0.f, ss = 0.f;
#pragma unroll
  for (int k = 0; k < C / NT; ++k) {
    const int i = threadIdx.x + k * NT;
    float x = __ldcg(a + i);
#pragma unroll
    for (int j = 0; j < MAX_COPIES; ++j) {  // unrolled: every load issued before the first add waits
      if (b != nullptr && j < copies) x += __ldcg(b + j * C + i);
      if (c != nullptr && j < copies) x += __ldcg(c + j * C + i);
    }
    v[k] = x;
    s += x;
    ss += x * x;
    if (xs_out != nullptr && i / XS == blk) xs_out[i] = x;
  }
  const float2 t = block_sum2(s, ss, red);
  const float mean = t.x / C, rstd = rsqrtf(fmaxf(t.y / C - mean * mean, 0.f) + 1e-5f);
#pragma unroll
  for (int k = 0; k < C / NT; ++k) {
    const int i = threadIdx.x + k * NT;
    xn[i] = __float2half((v[k] - mean) * rstd * __half2float(g[i]) + __half2float(bb[i]));
  }
  __syncthreads();
}

// Row r's dot product with xn, r = warp, warp + NW, ... < rows (C columns a row), summed over the warp: f(r, dot).
template <typename Fn>
__device__ __forceinline__ void rows_dot(const __half* w, int rows, const __half* xn, Fn f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint4 x[C / 8 / 32];
#pragma unroll
  for (int j = 0; j < C / 8 / 32; ++j) x[j] = reinterpret_cast<const uint4*>(xn)[lane + 32 * j];
  for (int r = warp; r < rows; r += NW) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < C / 8 / 32; ++j) s += dot8(reinterpret_cast<const uint4*>(w + r * C)[lane + 32 * j], x[j]);
    s = warp_sum(s);
    if (lane == 0) f(r, s);
  }
}

// One exchange of a warp's column sums: the lane keeps the upper or lower half of its N columns (as bit o of its
// lane), adding its partner's; base: the lane's first column.
template <int N>
__device__ __forceinline__ void halve(float* acc, int o, int lane, int& base) {
  const bool upper = (lane & o) != 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float send = upper ? acc[i] : acc[i + N / 2], keep = upper ? acc[i + N / 2] : acc[i];
    acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
  }
  if (upper) base += N / 2;
}

__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

__global__ void __launch_bounds__(NT, 1) layers_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __half* wbuf = reinterpret_cast<__half*>(smem);  // [2][LAYER_HALVES]
  __half* xn = wbuf + 2 * LAYER_HALVES;            // [C]
  float* sp = reinterpret_cast<float*>(xn + C);    // [MAX_KEYS] attention weights
  float* so = sp + MAX_KEYS;                       // [NW][D] the warps' sums of p V
  float* sq = so + NW * D;                         // [D] query, then the head's output
  float* red = sq + D;                             // [64] reductions, then c_fc's hidden units
  const int blk = blockIdx.x, grid = gridDim.x, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  unsigned long long* tr = p.trace + size_t(blk) * p.L * 9;
  load_layer(p.layers[0], blk, wbuf, p.evict_first);
  commit();
  if (p.L > 1) load_layer(p.layers[1], blk, wbuf + LAYER_HALVES, p.evict_first);
  commit();
  auto wait_for = [&](int l, int ph) {
    if (tid == 0) while (load_acquire(p.cnt + (l * 3 + ph) * 32) < grid) {}
    __syncthreads();
  };
  // This layer's weights landed in shared memory (their copy group, issued two layers ahead), for every thread.
  auto weights_landed = [&]() {
    wait_groups<1>();
    __syncthreads();
  };
  auto signal = [&](int l, int ph) {
    __syncthreads();
    if (tid == 0) {
      tr[(l * 3 + ph) * 3 + 2] = now_ns();
      __threadfence();
      atomicAdd(p.cnt + (l * 3 + ph) * 32, 1);
    }
  };
  for (int l = 0; l < p.L; ++l) {
    const Layer& w = p.layers[l];
    const __half* buf = wbuf + (l % 2) * LAYER_HALVES;
    float* xs = p.xs + l * C;
    const int copy = blk % p.copies;
    float* aacc = p.aacc + l * p.copies * C;  // the layer's copies; this block adds into copy `copy`
    float* macc = p.macc + l * p.copies * C;
    float* q = p.q + l * C;
    // ---- A: LayerNorm 1, c_attn rows, k / v appended
    if (l > 0) wait_for(l - 1, 2);
    if (tid == 0) tr[(l * 3 + 0) * 3] = now_ns();
    // The layer's weights (copied two layers ahead) are first read by A's c_attn rows, not by its LayerNorm.
    if (!p.ln_first) weights_landed();
    if (l == 0) {
      layer_norm(xs, nullptr, nullptr, 1, w.g1, w.b1, xn, red, nullptr, blk);
    } else {
      layer_norm(xs - C, aacc - p.copies * C, macc - p.copies * C, p.copies, w.g1, w.b1, xn, red, xs, blk);
    }
    if (tid == 0) tr[(l * 3 + 0) * 3 + 1] = now_ns();
    if (p.ln_first) weights_landed();
    const int a0 = blk * RA;
    rows_dot(buf, min(RA, max(0, QKV - a0)), xn, [&](int r, float s) {
      const int o = a0 + r;
      const float v = s + __half2float(w.bqkv[o]);
      if (o < C) {
        q[o] = v;
      } else {
        const int e = o % C, hh = e / D, d = e % D;
        __half* cache = o < 2 * C ? w.kc : w.vc;
        cache[(size_t(hh) * p.t_max + p.T) * D + d] = __float2half(v);
      }
    });
    signal(l, 0);
    // ---- B: one head's attention, its projection slice's partial sums
    // Thread j holds key j's K and V rows (16 loads in flight, one round trip); o = sum_j p_j V_j is summed over a
    // warp's keys by halving exchanges (each lane ends with two of the 64 columns), then over warps. The cached
    // keys' rows (j < T) are not written in this launch: with p.early they are loaded before the wait, under the
    // hop, and only key T's (A's append) after it.
    const int hb = blk / BH, keys = p.T + 1;
    const bool live = tid < keys;
    const size_t row = (size_t(hb < H ? hb : 0) * p.t_max + (live ? tid : 0)) * D;
    uint4 kr[D / 8], vr[D / 8];
    auto load_kv = [&]() {
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        kr[c] = live ? __ldcg(reinterpret_cast<const uint4*>(w.kc + row) + c) : make_uint4(0, 0, 0, 0);
        vr[c] = live ? __ldcg(reinterpret_cast<const uint4*>(w.vc + row) + c) : make_uint4(0, 0, 0, 0);
      }
    };
    if (p.early && tid < p.T) load_kv();  // the rest (key T, the zeros of threads past it) after the wait
    wait_for(l, 0);
    if (tid == 0) tr[(l * 3 + 1) * 3] = now_ns();
    {
      const int h = hb, o0 = (blk % BH) * RO;
      if (h < H) {
        if (tid < D) sq[tid] = __ldcg(q + h * D + tid) * 0.125f;
        if (p.early && tid >= p.T) load_kv();
        __syncthreads();
        if (!p.early) load_kv();
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          const __half2* k2 = reinterpret_cast<const __half2*>(&kr[c]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __half22float2(k2[e]);
            s = fmaf(f.x, sq[c * 8 + 2 * e], fmaf(f.y, sq[c * 8 + 2 * e + 1], s));
          }
        }
        if (!live) s = -INFINITY;
        float m = warp_max(s);
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = red[0];
#pragma unroll
        for (int i = 1; i < NW; ++i) m = fmaxf(m, red[i]);
        const float e = live ? __expf(s - m) : 0.f;
        const float2 tot = block_sum2(e, 0.f, red + 2 * NW);
        if (tid == 0) tr[(l * 3 + 1) * 3 + 1] = now_ns();
        float acc[D];
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          const __half2* v2 = reinterpret_cast<const __half2*>(&vr[c]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float2 f = __half22float2(v2[k]);
            acc[c * 8 + 2 * k] = e * f.x;
            acc[c * 8 + 2 * k + 1] = e * f.y;
          }
        }
        // After the exchange at offset o the lane keeps the upper or lower half of its columns, as bit o of lane.
        int base = 0;
        halve<64>(acc, 16, lane, base);
        halve<32>(acc, 8, lane, base);
        halve<16>(acc, 4, lane, base);
        halve<8>(acc, 2, lane, base);
        halve<4>(acc, 1, lane, base);
        so[warp * D + base] = acc[0];
        so[warp * D + base + 1] = acc[1];
        __syncthreads();
        if (tid < D) {
          float o = 0.f;
#pragma unroll
          for (int w8 = 0; w8 < NW; ++w8) o += so[w8 * D + tid];
          sq[tid] = o / tot.x;
        }
        __syncthreads();
        const __half* tb = buf + TA;
        for (int r = warp; r < RO && o0 + r < C; r += NW) {
          const float2 wv = __half22float2(reinterpret_cast<const __half2*>(tb + r * D)[lane]);
          float v = warp_sum(wv.x * sq[2 * lane] + wv.y * sq[2 * lane + 1]);
          if (lane == 0) atomicAdd(aacc + copy * C + o0 + r, v + (h == 0 ? __half2float(w.bo[o0 + r]) : 0.f));
        }
      }
    }
    signal(l, 1);
    // ---- C: LayerNorm 2, c_fc rows + GELU, the MLP projection's partial sums
    wait_for(l, 1);
    if (tid == 0) tr[(l * 3 + 2) * 3] = now_ns();
    layer_norm(xs, aacc, nullptr, p.copies, w.g2, w.b2, xn, red, nullptr, blk);
    if (tid == 0) tr[(l * 3 + 2) * 3 + 1] = now_ns();
    const int f0 = blk * RF;
    if (f0 < F) {
      float* hid = red;
      rows_dot(buf + TA + TB, RF, xn, [&](int r, float s) { hid[r] = gelu_tanh(s + __half2float(w.bfc[f0 + r])); });
      __syncthreads();
      const __half* td = buf + TA + TB + TC1;
      auto out = [&](int o) {
        float v = blk == 0 ? __half2float(w.bpr[o]) : 0.f;
#pragma unroll
        for (int c = 0; c < RF / 8; ++c) {
          const uint4 wv = reinterpret_cast<const uint4*>(td + o * RF)[c];
          const __half2* w2 = reinterpret_cast<const __half2*>(&wv);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __half22float2(w2[e]);
            v = fmaf(f.x, hid[c * 8 + 2 * e], fmaf(f.y, hid[c * 8 + 2 * e + 1], v));
          }
        }
        return v;
      };
      if (p.vec) {
        if (tid < C / 4) {
          const int o = 4 * tid;
          const float v0 = out(o), v1 = out(o + 1), v2 = out(o + 2), v3 = out(o + 3);
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(macc + copy * C + o), "f"(v0),
                       "f"(v1), "f"(v2), "f"(v3) : "memory");
        }
      } else {
        for (int o = tid; o < C; o += NT) atomicAdd(macc + copy * C + o, out(o));
      }
    }
    signal(l, 2);
    if (l + 2 < p.L) load_layer(p.layers[l + 2], blk, wbuf + (l % 2) * LAYER_HALVES, p.evict_first);  // read
    commit();
  }
}

// Runs the layers `repeats` times (counters, sums and what a launch hands between blocks zeroed before each),
// returns each launch's ms (CUDA events around the kernel alone); trace holds the last launch's stamps.
std::vector<double> run(std::vector<torch::Tensor> w, torch::Tensor xs, torch::Tensor aacc, torch::Tensor macc,
                        torch::Tensor q, torch::Tensor cnt, torch::Tensor trace, int64_t T, int64_t t_max,
                        int64_t vec, int64_t copies, int64_t early, int64_t ln_first, int64_t evict_first,
                        double warmup_ms, int64_t repeats) {
  const int L = int(w.size() / 14);
  TORCH_CHECK(T + 1 <= MAX_KEYS, "cache must hold at most ", MAX_KEYS - 1, " tokens, got ", T);
  TORCH_CHECK(copies >= 1 && copies <= MAX_COPIES && aacc.numel() == int64_t(L) * copies * C &&
                  macc.numel() == aacc.numel(),
              "aacc and macc must hold [layers][copies][768] floats with copies in [1, ", MAX_COPIES,
              "], got copies ", copies);
  std::vector<Layer> layers(L);
  for (int l = 0; l < L; ++l) {
    auto h = [&](int i) { return reinterpret_cast<__half*>(w[l * 14 + i].data_ptr<at::Half>()); };
    layers[l] = Layer{h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7), h(8), h(9), h(10), h(11), h(12), h(13)};
  }
  auto dev = torch::empty({int64_t(L * sizeof(Layer))}, torch::dtype(torch::kUInt8).device(torch::kCUDA));
  auto stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemcpyAsync(dev.data_ptr(), layers.data(), L * sizeof(Layer), cudaMemcpyHostToDevice, stream));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  TORCH_CHECK(sms >= 132, "the prototype's tiling needs 132 SMs, got ", sms);
  C10_CUDA_CHECK(cudaFuncSetAttribute(layers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
  Params p{reinterpret_cast<const Layer*>(dev.data_ptr()), L, int(T), int(t_max), xs.data_ptr<float>(),
           q.data_ptr<float>(), aacc.data_ptr<float>(), macc.data_ptr<float>(), cnt.data_ptr<int>(), int(vec),
           int(copies), int(early), int(ln_first), int(evict_first),
           reinterpret_cast<unsigned long long*>(trace.data_ptr<int64_t>())};
  cudaEvent_t a, b;
  C10_CUDA_CHECK(cudaEventCreate(&a));
  C10_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  // Launches back to back for warmup_ms first, so that the SM clock has left its idle level.
  C10_CUDA_CHECK(cudaEventRecord(a, stream));
  for (float spent = 0.f; spent < warmup_ms;) {
    for (int i = 0; i < 50; ++i) {
      cnt.zero_();
      layers_kernel<<<132, NT, SMEM_BYTES, stream>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    C10_CUDA_CHECK(cudaEventRecord(b, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(b));
    C10_CUDA_CHECK(cudaEventElapsedTime(&spent, a, b));
  }
  for (int64_t r = 0; r < repeats; ++r) {
    aacc.zero_();
    macc.zero_();
    cnt.zero_();
    // What a launch writes before another block reads it (the layers' inputs past the first, q, the caches' slot
    // T) zeroed too: a launch recomputes the same values, so a read that passed its wait too early would otherwise
    // find the last launch's equal values and the output check could not see it.
    q.zero_();
    if (L > 1) xs.narrow(0, 1, L - 1).zero_();
    for (int l = 0; l < L; ++l) {
      w[l * 14 + 12].select(1, T).zero_();
      w[l * 14 + 13].select(1, T).zero_();
    }
    C10_CUDA_CHECK(cudaEventRecord(a, stream));
    layers_kernel<<<132, NT, SMEM_BYTES, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    C10_CUDA_CHECK(cudaEventRecord(b, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  C10_CUDA_CHECK(cudaEventDestroy(a));
  C10_CUDA_CHECK(cudaEventDestroy(b));
  return ms;
}
"""

CPP = ("std::vector<double> run(std::vector<torch::Tensor> w, torch::Tensor xs, torch::Tensor aacc, "
       "torch::Tensor macc, torch::Tensor q, torch::Tensor cnt, torch::Tensor trace, int64_t T, int64_t t_max, "
       "int64_t vec, int64_t copies, int64_t early, int64_t ln_first, int64_t evict_first, double warmup_ms, "
       "int64_t repeats);")
C, H, D, F = 768, 12, 64, 3072
BLOCKS = 132
MAX_COPIES = 8  # the kernel's MAX_COPIES


def make_layers(n: int, t_max: int, seed: int, device: str = "cuda") -> list[list[torch.Tensor]]:
    """Each layer's 14 tensors (fp16, on device): wqkv [2304, 768], bqkv, wo [768, 768], bo, wfc [3072, 768], bfc,
    wpr [768, 3072], bpr, ln1 g / b, ln2 g / b, the K and V caches [12, t_max, 64] (random rows)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=0.02, mean=0.0):
        return (torch.randn(*shape, generator=g) * scale + mean).half().to(device)

    return [[rnd(3 * C, C), rnd(3 * C), rnd(C, C), rnd(C), rnd(F, C), rnd(F), rnd(C, F), rnd(C),
             rnd(C, scale=0.1, mean=1.0), rnd(C), rnd(C, scale=0.1, mean=1.0), rnd(C),
             rnd(H, t_max, D, scale=1.0), rnd(H, t_max, D, scale=1.0)] for _ in range(n)]


def reference(layers: list[list[torch.Tensor]], x0: torch.Tensor, T: int) -> torch.Tensor:
    """The same layers in float32 (weights as stored; k / v rounded to fp16 as the cache holds them; the
    normalized input rounded to fp16 as the kernel's dot products read it)."""
    x = x0.float()
    for wqkv, bqkv, wo, bo, wfc, bfc, wpr, bpr, g1, b1, g2, b2, kc, vc in layers:
        f = lambda t: t.float()  # noqa: E731
        h = torch.nn.functional.layer_norm(x, (C,), f(g1), f(b1), 1e-5).half().float()
        qkv = f(wqkv) @ h + f(bqkv)
        q, k, v = qkv.split(C)
        keys = torch.cat([f(kc[:, :T]), k.half().float().view(H, 1, D)], 1)
        vals = torch.cat([f(vc[:, :T]), v.half().float().view(H, 1, D)], 1)
        att = torch.softmax((keys @ q.view(H, D, 1)).squeeze(-1) / math.sqrt(D), -1)
        o = (att.unsqueeze(1) @ vals).reshape(C)
        x = x + f(wo) @ o + f(bo)
        h2 = torch.nn.functional.layer_norm(x, (C,), f(g2), f(b2), 1e-5).half().float()
        m = torch.nn.functional.gelu(f(wfc) @ h2 + f(bfc), approximate="tanh")
        x = x + f(wpr) @ m + f(bpr)
    return x


def summarize(trace: torch.Tensor, n_layers: int) -> dict[str, tuple[float, float, float, float]]:
    """Per phase kind (A, B, C), medians over layers (us): the slowest block's work (its wait passed -> its
    signal), of it the first part's (A and C: the LayerNorm; B: K and V loaded, the softmax's sums) and the rest's
    (each the slowest block's), and the hop (the previous phase's last signal -> the first block past this wait).
    Layer 0's A has no wait, so no hop."""
    t = trace.view(BLOCKS, n_layers, 3, 3).double()
    out = {}
    for ph, name in enumerate("ABC"):
        work, first, rest, hops = [], [], [], []
        for l in range(n_layers):
            start, mid, done = t[:, l, ph, 0], t[:, l, ph, 1], t[:, l, ph, 2]
            live = mid > 0  # blocks that stamp the first part (B: the 132 blocks of the 12 heads)
            work.append(float((done - start).max()) / 1e3)
            first.append(float((mid - start)[live].max()) / 1e3)
            rest.append(float((done - mid)[live].max()) / 1e3)
            prev = (l, ph - 1) if ph > 0 else (l - 1, 2)
            if prev[0] >= 0:
                hops.append(float(start.min() - t[:, prev[0], prev[1], 2].max()) / 1e3)
        out[name] = (statistics.median(work), statistics.median(first), statistics.median(rest),
                     statistics.median(hops) if hops else float("nan"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cache", type=int, default=192, help="cached tokens (prompt 128 + 64 decoded)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-ms", type=float, default=300.0, help="back-to-back launches before the timed ones")
    ap.add_argument("--vec", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                    help="C's partial sums: 1 = red.global.add.v4.f32 four outputs a thread, 0 = an atomicAdd each")
    ap.add_argument("--copies", type=int, nargs="+", default=[1],
                    help="copies of the attention and MLP sums (block b adds into copy b %% copies)")
    ap.add_argument("--early", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="1: phase B's cached K and V rows loaded before its wait")
    ap.add_argument("--ln-first", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="1: phase A's LayerNorm before its wait for the layer's weights")
    ap.add_argument("--evict-first", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="1: the weights' copies marked evict-first in L2 (the K / V caches stay)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90, 132 SMs)")
    if not 0 <= args.cache < 256:
        ap.error(f"--cache must be in [0, 255], got {args.cache}")
    if not all(1 <= c <= MAX_COPIES for c in args.copies):
        ap.error(f"--copies must be in [1, {MAX_COPIES}], got {args.copies}")
    mod = load_inline("probe_megakernel_layers", cpp_sources=CPP, cuda_sources=SOURCE, functions=["run"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    n, T = args.layers, args.cache
    layers = make_layers(n, T + 1, args.seed)
    x0 = torch.randn(C, generator=torch.Generator().manual_seed(args.seed + 1)).cuda()
    ref = reference(layers, x0, T)
    print(f"{torch.cuda.get_device_name()}: {n} layers, a {T}-token cache, batch 1, fp16 weights")
    worst = 0.0
    for vec, copies, early, ln_first, evict_first in itertools.product(args.vec, args.copies, args.early,
                                                                       args.ln_first, args.evict_first):
        xs = torch.zeros(n, C, device="cuda")
        xs[0] = x0
        q = torch.zeros(n, C, device="cuda")
        aacc, macc = (torch.zeros(n, copies, C, device="cuda") for _ in range(2))
        cnt = torch.zeros(n * 3 * 32, dtype=torch.int32, device="cuda")
        trace = torch.zeros(BLOCKS * n * 9, dtype=torch.int64, device="cuda")
        ms = mod.run([t for layer in layers for t in layer], xs, aacc, macc, q, cnt, trace, T, T + 1, vec, copies,
                     early, ln_first, evict_first, args.warmup_ms, args.repeats)
        out = xs[n - 1] + aacc[n - 1].sum(0) + macc[n - 1].sum(0)
        err = float((out - ref).abs().max() / ref.abs().max())
        worst = max(worst, err)
        med = statistics.median(ms)
        how = "red.global.add.v4.f32, four outputs a thread" if vec else "one atomicAdd an output"
        kv = "before B's wait" if early else "after B's wait, behind q"
        ln = "before" if ln_first else "after"
        hint = "; the weights evict-first in L2" if evict_first else ""
        print(f"the MLP projection's partial sums by {how}; {copies} copies of each sum; cached K, V {kv}; "
              f"LayerNorm 1 {ln} the weights' wait{hint}:")
        print(f"  kernel: {med * 1e3:.1f} us (median of {len(ms)}, after {args.warmup_ms:.0f} ms of launches), "
              f"{med * 1e3 / n:.2f} us a layer; output against float32 PyTorch: max |error| / max |ref| = {err:.2e}")
        parts = {"A": "LayerNorm 1", "B": "K, V and the softmax", "C": "LayerNorm 2"}
        for name, (work, first, rest, hop) in summarize(trace.cpu(), n).items():
            print(f"  phase {name}: slowest block's work {work:.2f} us ({parts[name]} {first:.2f}, the rest "
                  f"{rest:.2f}), hop {hop:.2f} us (medians over layers)")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
