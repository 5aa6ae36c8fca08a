"""The measured model a GPT-2 decode megakernel is predicted from (~1 min on an H200):

    python -m dev.probe_megakernel_model [--iters 20000] [--slab-mb 2]

A persistent kernel whose blocks run streams of instructions (one instruction = one tile of one op), with
dependencies through per-tile counters in global memory, is bounded by three things this probe measures:

- hop: the one-way latency of a counter hand-off between two SMs (producer st.release.gpu, consumer spinning
  on ld.acquire.gpu), from a ping-pong of two blocks (their SM ids printed);
- stream: the global -> shared bandwidth of every SM copying its slab with cp.async (the weight prefetch),
  alone and with one warp a block spinning on an acquire load meanwhile (the consumer waiting on a counter);
- phase: an all-to-all dependency through one counter (every block waits for all blocks' previous phase: a
  GEMV needs its whole input vector), the hop a phase of a megakernel pays when its work is nothing;
- data phase: the same all-to-all phases carrying a vector every block reads whole (as a GEMV phase reads its
  input), handed off as flagged lines that readers poll (no counter, no fence) or as plain data behind a
  counter (barrier + release, acquire spin, then the loads);
- streamed phases: the flagged phases again with the weight stream beside them (each block's copy warp filling
  a 4-slot shared ring with bulk copies, a tile a phase) and ~1 us of work a phase: how much the stream slows a
  hand-off, and whether pacing the copies away from the polls wins it back;
- dot phases: a GEMV phase's dot products at batch 1 alone (weights already in shared memory, or copied in
  each phase), the megakernel's loop against one that issues every row's loads at once;
- reduce phases: all-to-all phases whose hand-off is a sum (every block adds its partial of a 768-float vector
  into L2 with vector atomics, then a counter): the hand-off a split-K projection pays instead of a phase of its
  own, as a design of three phases a layer would use it;
- loop: the cost an instruction of an empty persistent loop (one block an SM, fetch the next instruction
  index, publish its counter), independent instructions and a fully serial chain (each waits for the one
  before, on another SM: the hop inside a persistent kernel).

Then the model: a token's step at batch B is at least max(weights + K/V at the stream bandwidth, dependent
hops x (hop + the shortest phase)), with GPT-2 small's 124 M fp16 parameters (249 MB), K/V of a 192-token
cache and ~60 dependent phases a token (12 layers x 5: LayerNorm+QKV, attention, projection, LayerNorm+FC,
projection; plus embedding, final norm, lm_head, sample). Nothing is written into the checkout (load_inline
builds under torch's extension cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int smid() {
  int s;
  asm volatile("mov.u32 %0, %smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Two blocks of one thread: block 0 publishes i, block 1 answers i; out: [total ns, smid 0, smid 1].
__global__ void pingpong(int* flags, int iters, long long* out) {
  int* ping = flags;
  int* pong = flags + 32;  // another 128-byte line
  if (blockIdx.x == 0) {
    const unsigned long long t0 = now_ns();
    for (int i = 1; i <= iters; ++i) {
      store_release(ping, i);
      while (load_acquire(pong) != i) {}
    }
    out[0] = (long long)(now_ns() - t0);
    out[1] = smid();
  } else {
    for (int i = 1; i <= iters; ++i) {
      while (load_acquire(ping) != i) {}
      store_release(pong, i);
    }
    out[2] = smid();
  }
}

// Every block copies its slab (slab_bytes) into a 2 x 16 KB shared ring with cp.async, 256 threads;
// with spin, warp 0 instead spins on an acquire load of flag until the other warps are done.
__global__ void __launch_bounds__(256) stream(const uint4* src, long long slab_bytes, int spin, int* flag) {
  __shared__ __align__(16) uint4 ring[2][1024];
  const long long n = slab_bytes / 16;
  const uint4* s = src + blockIdx.x * n;
  const int warp = threadIdx.x / 32;
  const int first = spin ? 32 : 0, threads = 256 - first;
  if (spin && warp == 0) {
    while (load_acquire(flag + blockIdx.x * 32) == 0) {}
    return;
  }
  const int t = threadIdx.x - first;
  int stage = 0;
  for (long long base = 0; base < n; base += 1024, stage ^= 1) {
    for (int k = t; k < 1024 && base + k < n; k += threads) {
      const unsigned dst = (unsigned)__cvta_generic_to_shared(&ring[stage][k]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(s + base + k) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (spin) {
    asm volatile("bar.sync 1, %0;" ::"r"(threads));
    if (t == 0) store_release(flag + blockIdx.x * 32, 1);
  }
}

// One block an SM runs instructions blockIdx.x, blockIdx.x + grid, ...; with chain, instruction i first waits
// for done[i - 1] (published by another block), then publishes done[i].
__global__ void loop(int* done, int n_instr, int chain) {
  for (int i = blockIdx.x; i < n_instr; i += gridDim.x) {
    if (threadIdx.x == 0 && chain && i > 0) {
      while (load_acquire(done + i - 1) == 0) {}
    }
    __syncthreads();
    if (threadIdx.x == 0) store_release(done + i, 1);
  }
}

// Every block runs phases 0, 1, ...: phase p waits until all blocks have finished phase p - 1 (count[p - 1]
// == gridDim.x: a GEMV needs its whole input vector), then adds itself to count[p]. Time a phase: the hop of
// an all-to-all dependency through one counter, what a megakernel's phase costs when its work is nothing.
__global__ void phases(int* count, int n_phases) {
  for (int p = 0; p < n_phases; ++p) {
    if (threadIdx.x == 0) {
      if (p > 0) {
        while (load_acquire(count + (p - 1) * 32) < (int)gridDim.x) {}
      }
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(count + p * 32) : "memory");
    }
    __syncthreads();
  }
}

// The same all-to-all phases carrying data: a vector of V 16-byte lines a phase, each block writing its share
// (line i is block i % grid's) and every block reading all of it before its next phase, as a megakernel's
// GEMV phase reads its whole input. Two hand-offs:
//   - flagged (flagged = 1): a line is (data word, flag, data word, flag), the flag the phase + 1; a reader
//     polls each of its lines until both flags are its phase's, no counter, no fence (NCCL's LL protocol);
//   - counter (flagged = 0): plain stores, the block's barrier and one red.release on the phase's counter; a
//     reader's thread 0 spins on it with ld.acquire, the barrier, then every thread loads its lines.
// sink keeps the loads' values live. Time a phase: what a hand-off of V lines costs with no work around it.
__global__ void data_phases(uint4* buf, int* count, int n_phases, int V, int flagged, int* sink) {
  unsigned acc = 0;
  for (int p = 0; p < n_phases; ++p) {
    if (p > 0) {
      const uint4* prev = buf + int64_t(p - 1) * V;
      if (flagged) {
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
          uint4 v;
          do {
            asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(prev + i) : "memory");
          } while (v.y != unsigned(p) || v.w != unsigned(p));
          acc += v.x + v.z;
        }
      } else {
        if (threadIdx.x == 0) {
          while (load_acquire(count + (p - 1) * 32) < (int)gridDim.x) {}
        }
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
          const uint4 v = __ldcg(prev + i);
          acc += v.x + v.z;
        }
      }
      __syncthreads();
    }
    uint4* cur = buf + int64_t(p) * V;
    for (int i = blockIdx.x + threadIdx.x * gridDim.x; i < V; i += blockDim.x * gridDim.x) {
      if (flagged) {
        asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};"
                     ::"l"(cur + i), "r"(unsigned(i)), "r"(unsigned(p + 1)), "r"(acc), "r"(unsigned(p + 1)) : "memory");
      } else {
        cur[i] = make_uint4(unsigned(i), 0u, acc, 0u);
      }
    }
    if (!flagged) {
      __syncthreads();
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(count + p * 32) : "memory");
    }
  }
  if (acc == 0xffffffffu) sink[0] = int(acc);
}

// All-to-all phases whose hand-off is a sum: every block adds its partial of a V-float vector (GPT-2 small's
// residual row: 768) into the phase's fp32 buffer with red.global.add.v4.f32 (sm_90), its barrier and one
// red.release on the phase's counter; a reader's thread 0 spins on the counter with ld.acquire, the barrier, then
// every thread loads the sums at L2. The hand-off of a split-K projection whose partials meet in L2 instead of in a
// second all-to-all phase (the projection's), with no work around it. partial = 0: every block adds all V (the MLP
// projection of its FC rows); otherwise its share of V / gridDim (an attention head's slice). Time a phase.
__global__ void reduce_phases(float* buf, int* count, int n_phases, int V, int partial, int* sink) {
  float acc = 0.f;
  for (int p = 0; p < n_phases; ++p) {
    if (p > 0) {
      if (threadIdx.x == 0) {
        while (load_acquire(count + (p - 1) * 32) < (int)gridDim.x) {}
      }
      __syncthreads();
      const float4* prev = reinterpret_cast<const float4*>(buf + int64_t(p - 1) * V);
      for (int i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 v = __ldcg(prev + i);
        acc += v.x + v.y + v.z + v.w;
      }
    }
    float* cur = buf + int64_t(p) * V;
    const int lines = V / 4, first = partial ? blockIdx.x * lines / gridDim.x : 0;
    const int last = partial ? (blockIdx.x + 1) * lines / gridDim.x : lines;
    for (int i = first + threadIdx.x; i < last; i += blockDim.x) {
      asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                   ::"l"(cur + 4 * i), "f"(acc), "f"(1.f), "f"(2.f), "f"(3.f) : "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(count + p * 32) : "memory");
  }
  if (acc == 12345.f) sink[0] = 1;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile("{\n.reg .pred done;\nwait:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra wait;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ uint4 ld_line(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

constexpr int kRingSlots = 4;  // the probes' weight ring: slots of a block's shared memory

// The copy warp's thread of the probes below: `copies` bulk copies of slot_bytes from the block's slab (from
// its start again at its end) into the ring, each into a slot its consumers gave back (empty); with polled, a
// refill also waits until the consumers have the input of the phase after the slot's (the paced stream).
__device__ __forceinline__ void fill_ring(unsigned char* smem, uint64_t* full, uint64_t* empty, int slot_bytes,
                                          const char* slab, long long slab_bytes, int copies, volatile int* polled) {
  long long off = 0;
  for (int i = 0; i < copies; ++i) {
    const int k = i % kRingSlots;
    if (i >= kRingSlots) {
      mbar_wait(empty + k, ((i / kRingSlots) - 1) & 1);
      if (polled != nullptr) while (*polled < i - kRingSlots + 1) {}
    }
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + k)),
                 "r"(slot_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(smem + k * slot_bytes)), "l"(slab + off), "r"(slot_bytes),
                 "r"(smem_u32(full + k)) : "memory");
    off += slot_bytes;
    if (off + slot_bytes > slab_bytes) off = 0;
  }
}

// The flagged data phases again, with a megakernel's weight stream and work beside them: 288 threads a block,
// the last warp copying slot_bytes a phase (the block's tile of the next weights, from a slab of its own, all
// slabs together past L2's size) into a 4-slot shared ring with bulk copies. The 256 others, a phase: poll the
// previous phase's V flagged lines (every thread its share; or warp 0 alone while the others wait at a named
// barrier: one_poller), take the phase's slot, spin work_cycles (the dot products), give the slot back and
// write their share of this phase's lines. A poll round issues the loads of every line still stale at once and
// then checks them (a stale line found one at a time costs a round trip each). The refill of a slot goes out
// when the slot is given back, or, paced, only once the block has its next input (so the copies do not queue
// beside the polls). slot_bytes = 0: no stream; V = 0: no hand-off. Time a phase.
template <int kLines>
__device__ __forceinline__ unsigned poll_lines(const uint4* prev, int first, int stride, int V, unsigned flag,
                                               uint4* stage) {
  uint4 v[kLines];
  bool stale[kLines];
#pragma unroll
  for (int u = 0; u < kLines; ++u) stale[u] = first + u * stride < V;
  bool any = true;
  while (any) {
#pragma unroll
    for (int u = 0; u < kLines; ++u)
      if (stale[u]) v[u] = ld_line(prev + first + u * stride);
    any = false;
#pragma unroll
    for (int u = 0; u < kLines; ++u) {
      if (stale[u]) {
        stale[u] = v[u].y != flag || v[u].w != flag;
        any |= stale[u];
      }
    }
  }
  unsigned acc = 0;
#pragma unroll
  for (int u = 0; u < kLines; ++u) {
    if (first + u * stride < V) {
      if (stage != nullptr) stage[first + u * stride] = v[u];
      acc += v[u].x + v[u].z;
    }
  }
  return acc;
}

__global__ void __launch_bounds__(288, 1) streamed_phases(uint4* buf, int n_phases, int V, const char* src,
                                                         long long slab_bytes, int slot_bytes, int one_poller,
                                                         long long work_cycles, int paced, int* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kRingSlots * slot_bytes);
  uint64_t* empty = full + kRingSlots;
  volatile int* polled = reinterpret_cast<volatile int*>(empty + kRingSlots);  // the last phase whose input is in
  uint4* stage = reinterpret_cast<uint4*>(empty + kRingSlots + 2);  // the polled lines, for the one_poller mode
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2 * kRingSlots; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    *polled = 0;
  }
  __syncthreads();
  if (threadIdx.x >= 256) {
    if (threadIdx.x == 256 && slot_bytes > 0)
      fill_ring(smem, full, empty, slot_bytes, src + blockIdx.x * slab_bytes, slab_bytes, n_phases,
                paced ? polled : nullptr);
    return;
  }
  unsigned acc = 0;
  for (int p = 0; p < n_phases; ++p) {
    if (p > 0 && V > 0) {
      const uint4* prev = buf + int64_t(p - 1) * V;
      if (one_poller) {
        if (threadIdx.x < 32)
          for (int i0 = threadIdx.x; i0 < V; i0 += 8 * 32) poll_lines<8>(prev, i0, 32, V, unsigned(p), stage);
      } else {
        for (int i0 = threadIdx.x; i0 < V; i0 += 4 * 256) acc += poll_lines<4>(prev, i0, 256, V, unsigned(p), nullptr);
      }
      asm volatile("bar.sync 1, 256;" ::: "memory");
      if (one_poller)
        for (int i = threadIdx.x; i < V; i += 256) acc += stage[i].x + stage[i].z;
    }
    if (threadIdx.x == 0) *polled = p;
    if (slot_bytes > 0) {
      const int k = p % kRingSlots;
      mbar_wait(full + k, (p / kRingSlots) & 1);
      acc += reinterpret_cast<const unsigned*>(smem + k * slot_bytes)[threadIdx.x];
    }
    if (work_cycles > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < work_cycles) {}
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");  // the slot and the staged lines are free again
    if (slot_bytes > 0 && threadIdx.x == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + p % kRingSlots)) : "memory");
    uint4* cur = buf + int64_t(p) * V;
    for (int i = blockIdx.x + threadIdx.x * gridDim.x; i < V; i += 256 * gridDim.x)
      asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};"
                   ::"l"(cur + i), "r"(unsigned(i)), "r"(unsigned(p + 1)), "r"(acc), "r"(unsigned(p + 1)) : "memory");
  }
  if (acc == 0xffffffffu) sink[0] = int(acc);
}

// A GEMV phase's dot products alone (batch 1): rows x K fp16 weights in a shared slot (the copy warp's bulk
// copy: each phase's own with refill, else the first 4 slots' loaded once and reused), the activation (K fp16)
// in shared memory, 256 threads; a phase ends at the barrier after every row's sum is in shared memory. ilp = 0:
// the megakernel's loop (a warp two rows at a time, r and r + 8, its lanes over K in 16-byte chunks, unrolled by
// 2, then the two sums' shuffles); ilp = 1: a warp's rows all at once (every row's loads issued before the first
// FMA, the shuffles of all rows interleaved). Time a phase: what the work between two hand-offs costs.
template <int kMaxRowsAWarp>
__device__ __forceinline__ void dots_ilp(const __half* w, int rows, int K, const __half* act, float* dot) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = K / 8;
  float acc[kMaxRowsAWarp];
#pragma unroll
  for (int i = 0; i < kMaxRowsAWarp; ++i) acc[i] = 0.f;
  for (int c = lane; c < chunks; c += 32) {
    const uint4 a = *reinterpret_cast<const uint4*>(act + c * 8);
    uint4 wv[kMaxRowsAWarp];
#pragma unroll
    for (int i = 0; i < kMaxRowsAWarp; ++i) {
      const int r = warp + 8 * i;
      if (r < rows) wv[i] = *reinterpret_cast<const uint4*>(w + int64_t(r) * K + c * 8);
    }
    const __half2* ah = reinterpret_cast<const __half2*>(&a);
#pragma unroll
    for (int i = 0; i < kMaxRowsAWarp; ++i) {
      if (warp + 8 * i < rows) {
        const __half2* wh = reinterpret_cast<const __half2*>(&wv[i]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 x = __half22float2(wh[e]), y = __half22float2(ah[e]);
          acc[i] = fmaf(x.x, y.x, fmaf(x.y, y.y, acc[i]));
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < kMaxRowsAWarp; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kMaxRowsAWarp; ++i)
      if (warp + 8 * i < rows) dot[warp + 8 * i] = acc[i];
  }
}

__device__ __forceinline__ void dots_pairs(const __half* w, int rows, int K, const __half* act, float* dot) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = K / 8;
  for (int r = warp; r < rows; r += 16) {
    const int r2 = r + 8;
    const bool two = r2 < rows;
    float a0 = 0.f, a1 = 0.f;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + int64_t(r) * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + int64_t(two ? r2 : r) * K);
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
      const uint4 x0 = w0[c], x1 = w1[c], a = reinterpret_cast<const uint4*>(act)[c];
      const __half2 *h0 = reinterpret_cast<const __half2*>(&x0), *h1 = reinterpret_cast<const __half2*>(&x1),
                    *ha = reinterpret_cast<const __half2*>(&a);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f0 = __half22float2(h0[e]), f1 = __half22float2(h1[e]), fa = __half22float2(ha[e]);
        a0 = fmaf(f0.x, fa.x, fmaf(f0.y, fa.y, a0));
        a1 = fmaf(f1.x, fa.x, fmaf(f1.y, fa.y, a1));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a0 += __shfl_xor_sync(0xffffffffu, a0, o);
      a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
    if (lane == 0) {
      dot[r] = a0;
      if (two) dot[r2] = a1;
    }
  }
}

__global__ void __launch_bounds__(288, 1) dot_phases(int n_phases, const char* src, long long slab_bytes, int rows,
                                                    int K, int refill, int ilp, int* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int slot_bytes = rows * K * 2;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kRingSlots * slot_bytes);
  uint64_t* empty = full + kRingSlots;
  __half* act = reinterpret_cast<__half*>(empty + kRingSlots);
  float* dot = reinterpret_cast<float*>(act + K);
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2 * kRingSlots; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < K; i += blockDim.x) act[i] = __float2half(0.001f * (i % 7));
  __syncthreads();
  const int copies = refill ? n_phases : kRingSlots;
  if (threadIdx.x >= 256) {
    if (threadIdx.x == 256)
      fill_ring(smem, full, empty, slot_bytes, src + blockIdx.x * slab_bytes, slab_bytes, copies, nullptr);
    return;
  }
  float acc = 0.f;
  for (int p = 0; p < n_phases; ++p) {
    const int k = p % kRingSlots;
    if (p < copies) mbar_wait(full + k, (p / kRingSlots) & 1);
    const __half* w = reinterpret_cast<const __half*>(smem + k * slot_bytes);
    if (ilp) dots_ilp<4>(w, rows, K, act, dot);
    else dots_pairs(w, rows, K, act, dot);
    asm volatile("bar.sync 1, 256;" ::: "memory");
    acc += dot[threadIdx.x % rows];
    if (refill && threadIdx.x == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + k)) : "memory");
    asm volatile("bar.sync 1, 256;" ::: "memory");  // dot is free again
  }
  if (acc == 12345.f) sink[0] = 1;
}

// Milliseconds between events around launch() on stream s (launch checked).
template <typename F>
float time_ms(cudaEvent_t a, cudaEvent_t b, cudaStream_t s, F launch) {
  C10_CUDA_CHECK(cudaEventRecord(a, s));
  launch();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaEventRecord(b, s));
  C10_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

std::vector<double> run(int iters, long long slab_bytes, int n_instr) {
  const cudaStream_t stream_ = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto i32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt32);
  std::vector<double> r;
  // hop
  auto flags = torch::zeros({64}, i32);
  auto out = torch::zeros({3}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt64));
  pingpong<<<2, 1, 0, stream_>>>(flags.data_ptr<int>(), iters, reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto o = out.cpu();
  r.push_back(double(o[0].item<int64_t>()) / (2.0 * iters));
  r.push_back(double(o[1].item<int64_t>()));
  r.push_back(double(o[2].item<int64_t>()));
  // stream, without and with a spinning warp
  auto src = torch::empty({(long long)sms * slab_bytes / 4}, i32);
  cudaEvent_t a, b;
  C10_CUDA_CHECK(cudaEventCreate(&a));
  C10_CUDA_CHECK(cudaEventCreate(&b));
  for (int spin = 0; spin < 2; ++spin) {
    auto flag = torch::zeros({sms * 32}, i32);
    stream<<<sms, 256, 0, stream_>>>(reinterpret_cast<const uint4*>(src.data_ptr<int>()), slab_bytes, spin,
                                    flag.data_ptr<int>());  // warm-up
    flag.zero_();
    const float ms = time_ms(a, b, stream_, [&] {
      stream<<<sms, 256, 0, stream_>>>(reinterpret_cast<const uint4*>(src.data_ptr<int>()), slab_bytes, spin,
                                      flag.data_ptr<int>());
    });
    r.push_back(double(sms) * slab_bytes / (ms * 1e-3) / 1e9);  // GB/s, all SMs
  }
  // loop, independent and chained
  for (int chain = 0; chain < 2; ++chain) {
    auto done = torch::zeros({n_instr}, i32);
    const float ms =
        time_ms(a, b, stream_, [&] { loop<<<sms, 128, 0, stream_>>>(done.data_ptr<int>(), n_instr, chain); });
    r.push_back(double(ms) * 1e6 / n_instr);  // ns an instruction
  }
  // all-to-all phases through one counter each
  {
    const int n_phases = 2000;
    auto count = torch::zeros({n_phases * 32}, i32);
    const float ms =
        time_ms(a, b, stream_, [&] { phases<<<sms, 128, 0, stream_>>>(count.data_ptr<int>(), n_phases); });
    r.push_back(double(ms) * 1e6 / n_phases);  // ns a phase
  }
  // all-to-all phases carrying V lines: flagged lines, then counter + plain data; V = 192 (GPT-2 small's
  // residual stream, 768 fp16 values) and 768 (its MLP's hidden), 256 threads a block (the megakernel's)
  for (int V : {192, 768}) {
    for (int flagged = 1; flagged >= 0; --flagged) {
      const int n_phases = 2000;
      auto buf = torch::zeros({(long long)n_phases * V * 4}, i32);
      auto count = torch::zeros({n_phases * 32}, i32);
      auto sink = torch::zeros({1}, i32);
      const float ms = time_ms(a, b, stream_, [&] {
        data_phases<<<sms, 256, 0, stream_>>>(reinterpret_cast<uint4*>(buf.data_ptr<int>()), count.data_ptr<int>(),
                                             n_phases, V, flagged, sink.data_ptr<int>());
      });
      r.push_back(double(ms) * 1e6 / n_phases);  // ns a phase
    }
  }
  // the flagged phases beside the weight stream and work: V = 192 lines with c_attn's tile (18 rows x 768 fp16
  // = 27 KB a block) and V = 768 with the MLP projection's (6 rows x 3072); configurations
  // (V, slot bytes, one poller, work cycles, paced)
  {
    const int n_phases = 2000;
    const long long slab = 2LL << 20;
    auto wsrc = torch::empty({(long long)sms * slab / 4}, i32);
    const long long W = 2000;  // ~1 us at the H200's 1.98 GHz
    const long long cfg[][5] = {
        {0, 27648, 0, 0, 0},  {192, 0, 0, 0, 0},  {192, 27648, 0, 0, 0}, {192, 0, 1, 0, 0}, {192, 27648, 1, 0, 0},
        {192, 0, 0, W, 0},    {192, 27648, 0, W, 0}, {192, 27648, 0, W, 1},
        {0, 36864, 0, 0, 0},  {768, 0, 0, 0, 0},  {768, 36864, 0, 0, 0}, {768, 0, 1, 0, 0}, {768, 36864, 1, 0, 0},
        {768, 0, 0, W, 0},    {768, 36864, 0, W, 0}, {768, 36864, 0, W, 1}};
    for (const auto& c : cfg) {
      const int V = int(c[0]), slot = int(c[1]), one = int(c[2]), paced = int(c[4]);
      auto buf = torch::zeros({(long long)n_phases * (V > 0 ? V : 1) * 4}, i32);
      auto sink = torch::zeros({1}, i32);
      const int smem_bytes = 4 * slot + 128 + 768 * 16;
      C10_CUDA_CHECK(cudaFuncSetAttribute(streamed_phases, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
      const float ms = time_ms(a, b, stream_, [&] {
        streamed_phases<<<sms, 288, smem_bytes, stream_>>>(reinterpret_cast<uint4*>(buf.data_ptr<int>()), n_phases,
            V, reinterpret_cast<const char*>(wsrc.data_ptr<int>()), slab, slot, one, c[3], paced, sink.data_ptr<int>());
      });
      r.push_back(double(ms) * 1e6 / n_phases);  // ns a phase
    }
  }
  // a GEMV phase's dot products alone: (rows, K, refill, ilp) for c_attn's tile (18 x 768), c_fc's (24 x 768)
  // and the MLP projection's (6 x 3072)
  {
    const int n_phases = 2000;
    const long long slab = 2LL << 20;
    auto wsrc = torch::zeros({(long long)sms * slab / 4}, i32);
    auto sink = torch::zeros({1}, i32);
    const int cfg[][4] = {{18, 768, 0, 0}, {18, 768, 0, 1}, {18, 768, 1, 0}, {18, 768, 1, 1},
                          {24, 768, 0, 0}, {24, 768, 0, 1}, {6, 3072, 0, 0}, {6, 3072, 0, 1}};
    for (const auto& c : cfg) {
      const int smem_bytes = 4 * c[0] * c[1] * 2 + 64 + c[1] * 2 + 64 * 4;
      C10_CUDA_CHECK(cudaFuncSetAttribute(dot_phases, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
      const float ms = time_ms(a, b, stream_, [&] {
        dot_phases<<<sms, 288, smem_bytes, stream_>>>(n_phases, reinterpret_cast<const char*>(wsrc.data_ptr<int>()),
                                                     slab, c[0], c[1], c[2], c[3], sink.data_ptr<int>());
      });
      r.push_back(double(ms) * 1e6 / n_phases);  // ns a phase
    }
  }
  // all-to-all phases handing off a sum of 768 floats: every block adding all of it, then each its slice
  for (int partial = 0; partial < 2; ++partial) {
    const int n_phases = 2000, V = 768;
    auto buf = torch::zeros({(long long)n_phases * V}, torch::dtype(torch::kFloat32).device(torch::kCUDA));
    auto count = torch::zeros({n_phases * 32}, i32);
    auto sink = torch::zeros({1}, i32);
    const float ms = time_ms(a, b, stream_, [&] {
      reduce_phases<<<sms, 256, 0, stream_>>>(buf.data_ptr<float>(), count.data_ptr<int>(), n_phases, V, partial,
                                             sink.data_ptr<int>());
    });
    r.push_back(double(ms) * 1e6 / n_phases);  // ns a phase
  }
  C10_CUDA_CHECK(cudaEventDestroy(a));
  C10_CUDA_CHECK(cudaEventDestroy(b));
  return r;
}
"""

GPT2_WEIGHT_BYTES = 124_439_808 * 2  # GPT-2 small, fp16 (lm_head tied to wte: read once)
GPT2_LAYERS, GPT2_WIDTH = 12, 768
PHASES_A_TOKEN = GPT2_LAYERS * 5 + 4
SPLIT_K_PHASES_A_TOKEN = GPT2_LAYERS * 3 + 4  # the projections' partials summed in L2 (reduce_phases)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000, help="ping-pong round trips")
    ap.add_argument("--slab-mb", type=float, default=2.0, help="MB each SM copies in the stream measurement")
    ap.add_argument("--instructions", type=int, default=132 * 400, help="instructions of the persistent loop")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", type=int, default=192, help="cached tokens of the modeled step (prompt 128 + 64)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90)")
    mod = load_inline("probe_megakernel_model", cpp_sources="std::vector<double> run(int, long long, int);",
                      cuda_sources=SOURCE, functions=["run"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    rows = [mod.run(args.iters, int(args.slab_mb * 2**20) // 4096 * 4096, args.instructions)
            for _ in range(args.repeats)]
    med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    hop_ns, sm0, sm1, bw, bw_spin, loop_ns, chain_ns, phase_ns, ll192, ct192, ll768, ct768 = med[:12]
    streamed, dots, (reduce_all, reduce_slice) = med[12:28], med[28:36], med[36:38]
    print(f"{torch.cuda.get_device_name()}, median of {args.repeats}")
    print(f"hop (one way, SM {int(sm0)} <-> SM {int(sm1)}): {hop_ns:.0f} ns")
    print(f"stream global -> shared, every SM: {bw:.0f} GB/s; with a warp a block spinning: {bw_spin:.0f} GB/s")
    print(f"persistent loop: {loop_ns:.1f} ns an independent instruction, {chain_ns:.0f} ns a chained one")
    print(f"all-to-all phase through one counter ({torch.cuda.get_device_properties(0).multi_processor_count} "
          f"blocks): {phase_ns:.0f} ns a phase")
    print(f"all-to-all phase carrying a vector, every block reading all of it: 192 lines (3 KB) flagged "
          f"{ll192:.0f} ns, counter + data {ct192:.0f} ns; 768 lines (12 KB) flagged {ll768:.0f} ns, counter + "
          f"data {ct768:.0f} ns")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for at, (lines, slot) in enumerate(((192, 27648), (768, 36864))):
        stream_only, alone, beside, one_alone, one_beside, work, work_beside, work_paced = streamed[8 * at:8 * at + 8]
        print(f"flagged phase of {lines} lines, a weight stream of {slot // 1024} KB a block a phase "
              f"(alone {stream_only:.0f} ns a phase, {sms * slot / stream_only:.0f} GB/s):")
        print(f"  every thread polling: {alone:.0f} ns without the stream, {beside:.0f} ns with it; one warp polling "
              f"{one_alone:.0f} / {one_beside:.0f} ns")
        print(f"  with ~1 us of work a phase: {work:.0f} ns without the stream, {work_beside:.0f} ns with it, "
              f"{work_paced:.0f} ns with it paced (a refill goes out once the block has its next input)")
    print("a GEMV phase's dot products alone, batch 1 (ns a phase; the megakernel's loop / every row's loads at "
          "once):")
    for at, (what, rows, k) in enumerate((("c_attn", 18, 768), ("c_fc", 24, 768), ("MLP c_proj", 6, 3072))):
        if at == 0:
            print(f"  {what} {rows} x {k}: weights in shared memory {dots[0]:.0f} / {dots[1]:.0f}; each phase's "
                  f"copied in {dots[2]:.0f} / {dots[3]:.0f}")
        else:
            print(f"  {what} {rows} x {k}: weights in shared memory {dots[2 + 2 * at]:.0f} / {dots[3 + 2 * at]:.0f}")
    print(f"all-to-all phase handing off a sum of 768 floats (red.global.add.v4.f32, then a counter): every block "
          f"adding all of it {reduce_all:.0f} ns, each its slice {reduce_slice:.0f} ns")
    # Three phases a layer: LayerNorm + QKV; attention + its projection's partials added in L2; LayerNorm + FC +
    # GELU + the MLP projection's partials added in L2. The two sums are the layer's inputs to its next phases.
    hand_offs = GPT2_LAYERS * (reduce_slice + ll192 + reduce_all) + 4 * phase_ns
    work = GPT2_LAYERS * (dots[1] + 2 * dots[5])
    print(f"split-K design ({SPLIT_K_PHASES_A_TOKEN} dependent phases a token): hand-offs {hand_offs / 1e3:.1f} us, "
          f"QKV + FC + MLP projection dot products {work / 1e3:.1f} us (attention, norms and the lm_head not "
          f"included): at least {(hand_offs + work) / 1e6:.3f} ms/token at batch 1")
    print(f"model (GPT-2 small fp16, {PHASES_A_TOKEN} dependent phases a token, a {args.cache}-token cache):")
    for batch in (1, 16, 64):
        kv = GPT2_LAYERS * 2 * batch * args.cache * GPT2_WIDTH * 2
        bytes_us = (GPT2_WEIGHT_BYTES + kv) / (bw_spin * 1e3)
        hops_us = PHASES_A_TOKEN * max(chain_ns, phase_ns) / 1e3
        print(f"  batch {batch:>2}: bytes {bytes_us:.1f} us, hops {hops_us:.1f} us -> at least "
              f"{max(bytes_us, hops_us) / 1e3:.3f} ms/token (overlapped), {(bytes_us + hops_us) / 1e3:.3f} if not")
    return 0


if __name__ == "__main__":
    sys.exit(main())
