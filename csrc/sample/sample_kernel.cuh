// sample_kernel: the next token of each row of logits [rows, vocab]: greedy (temperature 0, the
// argmax) or a sample of softmax(logits / temperature), by the Gumbel-max trick: the argmax over
// columns of logits / temperature + G, G = -log(-log U) with U uniform in (0, 1), is distributed as
// softmax(logits / temperature). U comes from Philox4x32-10 (Salmon et al., SC 2011), a counter-based
// generator: the uniform of (row, column) is a pure function of (seed, offset, row, column), so the
// kernel needs no generator state, a CUDA graph replays it with the offset it reads from device memory,
// and the CPU reference (fused_attn/reference.py, sample) draws the same numbers.
//
// The decode step's last reduction: GPT-2's 50257 logits are 100 KB in float16, read once. One block
// reading a row alone is latency-bound (~100 KB per SM in flight takes several L2 round trips), so on
// sm_90 a row is split over up to 8 blocks of a thread-block cluster, each reducing a chunk of columns
// with 16-byte loads; each block pushes its result into rank 0's shared memory (st.async onto rank 0's
// mbarrier) and rank 0 merges them: one launch, no workspace, deterministic. Elsewhere one block per row.
//
// The reduction key: each column's score (float32: the logit, or logit / temperature + G) becomes an
// order-preserving 32-bit key (NaN above +inf, -0 equal to +0), packed over the complement of the column
// index into 64 bits, so one unsigned max picks the largest score and, among equal scores, the lowest
// column: torch.argmax's rule (NaN counts as the maximum, the first of equal maxima wins).
//
// top_k (sampling only; its own instantiation): the draw is restricted to the row's top_k largest logits
// and any equal to the top_k-th. Each block first copies its columns into shared memory (cp.async, one
// read of the logits). The top_k-th is found by a radix select over order-preserving keys of the logits'
// own bits (16 for float16 / bfloat16, 32 for float32), 8 bits a pass, most significant first: each pass
// counts, in a 256-bin histogram, the columns whose key matches the digits chosen so far; the row's blocks
// add up each other's histograms through distributed shared memory behind a cluster barrier, and every
// block picks the same digit (where the count from the top first reaches top_k). Two passes for 16-bit
// logits, then the draw scores only the columns at or above the threshold (their Philox words alone). One
// launch, as before.
//
// The one thread that writes a row's token also records it in a token history at a column read from
// device memory, then advances the row's counters (SampleParams): a decode loop's per-token bookkeeping in
// the same launch.
//
// Tests: tests/test_sample.py; benchmark: bench/bench_sample.py.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

#include "../common/cluster.cuh"
#include "../common/func_attrs.h"
#include "../common/mbarrier.cuh"
#include "../common/pdl.cuh"
#include "../common/vec_dtypes.cuh"
#include "sample_launch.h"

namespace fused_attn {

namespace sample {

namespace cg = cooperative_groups;

// Philox4x32-10: 10 rounds of two 32 x 32 -> 64-bit multiplies, the key bumped by the Weyl constants.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The Gumbel noise of a 32-bit draw: U = (top 23 bits + 0.5) / 2^23, exact in float32 and inside (0, 1),
// so G is finite: at most -log(-log(1 - 2^-24)) = 16.6. (Before a6f5fbe it took the top 24 bits: 2^24 - 1 + 0.5
// rounds to 2^24 in float32, so one word in 2^24 gave U = 1 and G = +inf, and a -inf (masked) logit's score
// -inf + inf = NaN, the maximum: a masked column drawn. Found by bench_sample's check at 64 rows, H100.)
__device__ __forceinline__ float gumbel(uint32_t bits) {
  const float u = (float(bits >> 9) + 0.5f) * 1.1920928955078125e-7f;
  return -logf(-logf(u));
}

// The order-preserving key of a value's own bits (the low kKeyBits<T> bits): a larger value has a larger
// key; NaN (any payload) above +inf (kNanKey<T>), -0 equal to +0 (torch.argmax's and torch.topk's order,
// and `<`'s equalities). The scores' keys (pack) are float32's; top_k's are the logits' own dtype's.
template <typename T>
constexpr int kKeyBits = 8 * int(sizeof(T));
template <typename T>
constexpr uint32_t kNanKey = kKeyBits<T> == 32 ? 0xFFFFFFFFu : 0xFFFFu;
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return kNanKey<float>;
  const uint32_t bits = __float_as_uint(v == 0.f ? 0.f : v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ uint32_t order_key16(uint16_t bits, uint16_t inf_bits) {
  if ((bits & 0x7FFFu) > inf_bits) return kNanKey<__half>;
  if (bits == 0x8000u) bits = 0;  // -0 as +0
  return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}
__device__ __forceinline__ uint32_t order_key(__half v) { return order_key16(__half_as_ushort(v), 0x7C00u); }
__device__ __forceinline__ uint32_t order_key(__nv_bfloat16 v) {
  return order_key16(__bfloat16_as_ushort(v), 0x7F80u);
}

// The 64-bit reduction key of (score, column): larger is better (the lower column among equal scores).
__device__ __forceinline__ unsigned long long pack(float score, int64_t col) {
  return (static_cast<unsigned long long>(order_key(score)) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(col));
}

__device__ __forceinline__ int64_t unpack_col(unsigned long long best) {
  return int64_t(0xFFFFFFFFu - static_cast<uint32_t>(best & 0xFFFFFFFFu));
}

struct Rng {
  bool on;
  uint32_t k0, k1, row;
  uint64_t offset;
  // The four uniforms of columns [4 g, 4 g + 4).
  __device__ __forceinline__ uint4 draw(int64_t g) const {
    return philox4x32_10(make_uint4(uint32_t(g), row, uint32_t(offset), uint32_t(offset >> 32)), k0, k1);
  }
};

__device__ __forceinline__ uint32_t word(const uint4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// Row `row`'s history column (SampleParams::history_index), read right after the wait by the thread that
// will write the token (so the load overlaps the row's scan instead of following it), and before that
// thread advances the counters (the index may be one of them).
__device__ __forceinline__ int64_t history_column(const SampleParams& p, int64_t row) {
  if (p.history == nullptr) return 0;
  const int64_t i = row * p.history_index_stride;
  return p.history_index64 ? static_cast<const int64_t*>(p.history_index)[i]
                           : int64_t(static_cast<const int32_t*>(p.history_index)[i]);
}

// Row `row`'s token into out and, where there is a history, into history at column `at` (history_column),
// by the one thread that then advances the row's counters. A column out of range writes -1 into out
// instead, and nothing into history.
__device__ __forceinline__ void write_token(const SampleParams& p, int64_t row, int64_t token, int64_t at) {
  if (p.history != nullptr) {
    if (static_cast<uint64_t>(at) < static_cast<uint64_t>(p.history_len)) {  // 0 <= at < history_len
      p.history[row * p.history_stride + at] = token;
    } else {
      token = -1;
    }
  }
  p.out[row * p.out_stride] = token;
}

// Row `row`'s counters + 1 (SampleParams::advance), by the one thread that wrote its token. Every read
// of offsets[row] is behind it: the row's blocks used their offset before the block barrier (and, in a
// cluster, before the push that rank 0 waited for: the pushed maximum depends on it), and a row reads
// only its own offset (the launcher refuses one offset shared by rows when it is also a counter). The
// next kernel reads the counters after its PDL wait, i.e. after this grid completes. Atomic adds whose
// result is unused compile to fire-and-forget reductions (RED): no load round trip per counter at the
// kernel's end (a `+= 1` would load each counter and wait for it, one after another, as the stores may
// alias).
__device__ __forceinline__ void advance_row(const SampleParams& p, int64_t row) {
  for (int i = 0; i < p.adv_k; ++i) {
    const int64_t at = i * p.adv_stride_k + row * p.adv_stride_row;
    if (p.advance64) {
      atomicAdd(static_cast<unsigned long long*>(p.advance) + at, 1ull);
    } else {
      atomicAdd(static_cast<int*>(p.advance) + at, 1);
    }
  }
}

// Columns of T in a 16-byte piece, and a piece as its columns.
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));
template <typename T>
union Piece {
  uint4 raw;
  T v[kVec<T>];
};

// A block's columns [c0, c1) as a scalar head up to the first 16-byte boundary of the logits (rows need
// not start on one: GPT-2's 50257 columns), whole 16-byte pieces [a0, a1), a scalar tail.
struct Chunk {
  int64_t c0, c1, a0, a1, pieces, mis;  // mis: (logits + c0)'s misalignment in elements
  __device__ __forceinline__ int64_t scalars() const { return (a0 - c0) + (c1 - a1); }
  // The column of scalar i < scalars().
  __device__ __forceinline__ int64_t scalar_col(int64_t i) const { return i < a0 - c0 ? c0 + i : a1 + (i - (a0 - c0)); }
};
template <typename T>
__device__ __forceinline__ Chunk make_chunk(const T* logits, int64_t c0, int64_t c1) {
  constexpr int VEC = kVec<T>;
  Chunk k;
  k.c0 = c0;
  k.c1 = c1;
  k.mis = int64_t(reinterpret_cast<uintptr_t>(logits + c0) / sizeof(T)) % VEC;
  k.a0 = c0 + (VEC - k.mis) % VEC < c1 ? c0 + (VEC - k.mis) % VEC : c1;
  k.pieces = (c1 - k.a0) / VEC;
  k.a1 = k.a0 + k.pieces * VEC;
  return k;
}



// The row's top_k-th largest key (top_k >= 1, at most the row's columns), by radix select over the
// block's columns (column c at base[c - c0], base 16-byte aligned where logits + c0 is: shared memory
// where staged) and, in a cluster, the other blocks' (see the header). Every thread of every block of the
// row returns the same key. A pass reads the block's columns in 16-byte pieces, one piece a thread a
// trip. hist: this block's [2][256] counters (double-buffered: a pass writes one buffer while slower
// blocks may still read the other pass's). In a cluster
// the caller has arrived on the cluster barrier once (the kernel's start); this waits for that phase, and
// arrives once more after its last remote read, for the caller to wait on before it exits.
template <typename T>
__device__ uint32_t top_k_threshold(const SampleParams& p, const T* base, const Chunk& k, uint32_t (*hist)[256]) {
  constexpr int VEC = kVec<T>;
  __shared__ uint32_t pick_digit, pick_rank;
  __shared__ uint32_t warp_total[kSampleThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int nt = int(blockDim.x);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int blocks = p.cluster ? int(cg::this_cluster().num_blocks()) : 1;
#endif
  for (int i = tid; i < 2 * 256; i += nt) hist[i / 256][i % 256] = 0;  // both passes' buffers
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) cluster_wait();  // the start's phase: every block of the row is running
#endif
  __syncthreads();
  uint32_t prefix = 0, mask = 0, rank = uint32_t(p.top_k);  // the rank-th largest among the matching keys
  int pass = 0;
  for (int shift = kKeyBits<T> - 8; shift >= 0; shift -= 8, ++pass) {
    uint32_t* h = hist[pass & 1];
    if (pass >= 2) {  // float32's third and fourth passes reuse the buffers (read behind the last barrier)
      for (int i = tid; i < 256; i += nt) h[i] = 0;
      __syncthreads();
    }
    // An increment whose result is unused: one ATOMS.POPC.INC a warp, which adds the lanes that share an
    // address at once (logits crowd a few bins). Aggregating with __match_any_sync first (617b8e7):
    // its result latency was half of the select's stall samples (ncu, H100; docs/lab-notes/sampling.md).
    auto count = [&](bool in, T v) {
      const uint32_t key = order_key(v);
      if (in && (key & mask) == prefix) atomicAdd(&h[(key >> shift) & 0xFFu], 1u);
    };
    const uint4* pieces = reinterpret_cast<const uint4*>(base + (k.a0 - k.c0));
    for (int64_t j0 = 0; j0 < k.pieces; j0 += nt) {
      const int64_t j = j0 + tid;
      Piece<T> piece;
      piece.raw = j < k.pieces ? pieces[j] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) count(j < k.pieces, piece.v[e]);
    }
    for (int64_t i0 = 0; i0 < k.scalars(); i0 += nt) {
      const int64_t i = i0 + tid;
      count(i < k.scalars(), i < k.scalars() ? base[k.scalar_col(i) - k.c0] : from_float<T>(0.f));
    }
    __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p.cluster) {
      cluster_arrive_release();  // this block's histogram is complete
      cluster_wait();            // and every block's
    }
#endif
    // Thread t < 256 holds the row's count of digit 255 - t; an inclusive scan over t is the count of the
    // matching keys from the top down to that digit.
    uint32_t count_t = 0;
    if (tid < 256) {
      const int digit = 255 - tid;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (p.cluster) {
        // Every block's count in flight at once, then the sum (the loads are volatile: issued in order).
        uint32_t part[kSampleMaxBlocksPerRow];
#pragma unroll
        for (int r = 0; r < kSampleMaxBlocksPerRow; ++r) {
          part[r] = r < blocks ? load_cluster_u32(cluster_addr(&h[digit], r)) : 0u;
        }
#pragma unroll
        for (int r = 0; r < kSampleMaxBlocksPerRow; ++r) count_t += part[r];
      } else {
        count_t = h[digit];
      }
#else
      count_t = h[digit];
#endif
    }
    uint32_t incl = count_t;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const uint32_t up = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += up;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    if (tid < 256) {
      for (int w = 0; w < warp; ++w) incl += warp_total[w];
      const uint32_t excl = incl - count_t;
      if (excl < rank && rank <= incl) {  // exactly one digit: the matching keys number at least rank
        pick_digit = uint32_t(255 - tid);
        pick_rank = rank - excl;
      }
    }
    __syncthreads();
    prefix |= pick_digit << shift;
    mask |= 0xFFu << shift;
    rank = pick_rank;
    __syncthreads();  // pick_digit / pick_rank and warp_total are rewritten by the next pass
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) cluster_arrive_release();  // done reading the other blocks' histograms
#endif
  return prefix;
}

// top_k's part of a block: its columns staged in shared memory (where p.stage: one read of the logits
// for the select's passes and the draw), the threshold (top_k_threshold), then the Gumbel-max over the
// kept columns alone (the Philox draws only for those: ~top_k a row instead of every column). Returns
// the block's best packed key (0 where it keeps none).
template <typename T>
__device__ unsigned long long top_k_block_best(const SampleParams& p, const T* logits, const Chunk& k, const Rng& rng) {
  constexpr int VEC = kVec<T>;
  extern __shared__ __align__(16) unsigned char sample_stage[];
  __shared__ uint32_t hist[2][256];
  const int tid = threadIdx.x, nt = int(blockDim.x);
  const T* base = logits + k.c0;  // column c at base[c - c0]
  if (p.stage) {
    // The same 16-byte phase as logits + c0, so the pieces land on 16-byte boundaries.
    T* s = reinterpret_cast<T*>(sample_stage) + k.mis;
    uint4* dst = reinterpret_cast<uint4*>(s + (k.a0 - k.c0));
    const uint4* src = reinterpret_cast<const uint4*>(logits + k.a0);
    for (int64_t j = tid; j < k.pieces; j += nt) cp_async16(dst + j, src + j, true);
    cp_async_commit();
    for (int64_t i = tid; i < k.scalars(); i += nt) s[k.scalar_col(i) - k.c0] = logits[k.scalar_col(i)];
    cp_async_wait<0>();
    __syncthreads();
    base = s;
  }
  const uint32_t tau = top_k_threshold<T>(p, base, k, hist);
  const bool filter = tau != kNanKey<T>;  // a NaN top_k-th keeps every column
  unsigned long long best = 0;  // below every packed key
  int64_t group = -1;
  uint4 w = make_uint4(0, 0, 0, 0);
  auto consider = [&](T v, int64_t c) {
    if (filter && order_key(v) < tau) return;
    if (c / 4 != group) {  // a new Philox group (columns in order within a thread)
      group = c / 4;
      w = rng.draw(group);
    }
    const unsigned long long key = pack(to_float(v) / p.temperature + gumbel(word(w, int(c % 4))), c);
    best = key > best ? key : best;
  };
  const uint4* pieces = reinterpret_cast<const uint4*>(base + (k.a0 - k.c0));
  for (int64_t j = tid; j < k.pieces; j += nt) {
    Piece<T> piece;
    piece.raw = pieces[j];
#pragma unroll
    for (int e = 0; e < VEC; ++e) consider(piece.v[e], k.a0 + j * VEC + e);
  }
  for (int64_t i = tid; i < k.scalars(); i += nt) consider(base[k.scalar_col(i) - k.c0], k.scalar_col(i));
  return best;
}

// kDraw: p.temperature > 0 (a draw; greedy without). kTopK: p.top_k > 0 (a draw restricted to the top_k; the
// launcher sets it only at temperature > 0). Each its own instantiation (sample_kernel_for), so greedy's loop holds
// no generator code and the plain draw's none of top_k's.
template <typename T, bool kTopK, bool kDraw>
__global__ void __launch_bounds__(kSampleThreads, 2) sample_kernel(const SampleParams p) {
  static_assert(kDraw || !kTopK, "top_k filters a draw");
  constexpr int VEC = kVec<T>;
  const int64_t row = blockIdx.y;
  const int part = blockIdx.x;
  const T* logits = static_cast<const T*>(p.logits) + row * p.row_stride;
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits

  __shared__ unsigned long long cluster_best[kSampleMaxBlocksPerRow];  // rank 0's: one slot per block
  __shared__ uint64_t cluster_bar;  // rank 0's: the other blocks' maxima land on it
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) {  // rank 0 initializes its mbarrier; every block has started (waited for before the merge)
    if (threadIdx.x == 0 && cooperative_groups::this_cluster().block_rank() == 0) {
      mbarrier_init_for_pushes(&cluster_bar);
    }
    cluster_arrive_relaxed();
  }
#endif
  wait_for_primary();  // the logits are the previous kernel's output
  launch_dependents();
  const int64_t history_at = threadIdx.x == 0 && part == 0 ? history_column(p, row) : 0;  // the writer's

  Rng rng{};
  rng.on = kDraw;
  if constexpr (kDraw) {
    uint64_t off = p.offset;
    if (p.offsets != nullptr) {
      const int64_t i = row * p.offsets_stride;
      off += p.offsets64 ? static_cast<uint64_t>(static_cast<const int64_t*>(p.offsets)[i])
                         : static_cast<uint64_t>(static_cast<int64_t>(static_cast<const int32_t*>(p.offsets)[i]));
    }
    rng.k0 = uint32_t(p.seed);
    rng.k1 = uint32_t(p.seed >> 32);
    rng.row = uint32_t(row);
    rng.offset = off;
  }
  auto score = [&](float v, uint32_t bits) {
    if constexpr (kDraw) {
      return v / p.temperature + gumbel(bits);
    } else {
      return v;
    }
  };

  // This block's columns [c0, c1) (Chunk: a scalar head, 16-byte pieces, a scalar tail).
  const int64_t c0 = int64_t(part) * p.chunk;
  const Chunk k = make_chunk(logits, c0, c0 + p.chunk < p.vocab ? c0 + p.chunk : p.vocab);
  unsigned long long best = 0;  // below every packed key
  if constexpr (kTopK) {
    best = top_k_block_best<T>(p, logits, k, rng);
  } else {
    const int64_t a0 = k.a0, pieces = k.pieces;
    constexpr int U = 2;  // pieces in flight per thread before any is used
    for (int64_t j0 = threadIdx.x; j0 < pieces; j0 += int64_t(blockDim.x) * U) {
      Piece<T> piece[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + int64_t(u) * blockDim.x;
        // A plain load: the logits are the previous kernel's output under PDL (an __ldg may be hoisted
        // above wait_for_primary()).
        if (j < pieces) piece[u].raw = reinterpret_cast<const uint4*>(logits + a0)[j];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + int64_t(u) * blockDim.x;
        if (j >= pieces) break;
        const int64_t col = a0 + j * VEC;
        uint4 w = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int64_t c = col + e;
          if (kDraw && (e == 0 || c % 4 == 0)) w = rng.draw(c / 4);  // a new Philox group
          const unsigned long long key = pack(score(to_float(piece[u].v[e]), word(w, int(c % 4))), c);
          best = key > best ? key : best;
        }
      }
    }
    for (int64_t i = threadIdx.x; i < k.scalars(); i += blockDim.x) {
      const int64_t c = k.scalar_col(i);
      const uint32_t bits = kDraw ? word(rng.draw(c / 4), int(c % 4)) : 0u;
      const unsigned long long key = pack(score(to_float(logits[c]), bits), c);
      best = key > best ? key : best;
    }
  }

  // Block maximum: shuffles, then the warps' maxima through shared memory.
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  __shared__ unsigned long long warp_best[kSampleThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp != 0) return;
  best = lane < int(blockDim.x / 32) ? warp_best[lane] : 0ull;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) {
    // Every other block pushes its maximum into rank 0's shared memory (st.async, the bytes counted on
    // rank 0's mbarrier: common/cluster.cuh) once the whole cluster has started (the barrier phase
    // arrived at the kernel's start) and exits; rank 0 waits on its own mbarrier and merges. Warp 0
    // alone waits for its block: the other warps have returned, and a returned thread counts as arrived.
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned rank = cluster.block_rank();
    cluster_wait();
    if (lane != 0) return;
    if (rank != 0) {
      push_u64(cluster_addr(&cluster_best[rank], 0), best, cluster_addr(&cluster_bar, 0));
      return;
    }
    mbarrier_arrive_expect_tx(&cluster_bar, uint32_t((cluster.num_blocks() - 1) * sizeof(unsigned long long)));
    mbarrier_wait(&cluster_bar, 0);
    unsigned long long m = best;
    for (unsigned r = 1; r < cluster.num_blocks(); ++r) m = cluster_best[r] > m ? cluster_best[r] : m;
    write_token(p, row, unpack_col(m), history_at);
    advance_row(p, row);
    return;
  }
#endif
  if (lane == 0) {
    write_token(p, row, unpack_col(best), history_at);
    advance_row(p, row);
  }
}

// The instantiation that serves the launch p describes.
template <typename T>
auto sample_kernel_for(const SampleParams& p) -> void (*)(SampleParams) {
  if (p.top_k > 0) return sample_kernel<T, true, true>;
  return p.temperature > 0.f ? sample_kernel<T, false, true> : sample_kernel<T, false, false>;
}

}  // namespace sample

// The dynamic shared memory of the launch p describes: top_k's staged columns where they fit
// (top_k_block_best), else 0.
template <typename T>
size_t sample_stage_bytes(const SampleParams& p) {
  if (p.top_k <= 0) return 0;
  const size_t bytes = (size_t(p.chunk) + sample::kVec<T>) * sizeof(T);  // chunk + the misalignment pad
  return bytes <= size_t(kSampleStageMaxBytes) ? (bytes + 15) / 16 * 16 : 0;
}

template <typename T>
void launch_sample(const SampleParams& params, cudaStream_t stream) {
  SampleParams p = with_pdl_early(params, params.rows);
  const size_t smem = sample_stage_bytes<T>(p);
  p.stage = smem > 0;
  if (p.stage) allow_dynamic_smem(sample::sample_kernel<T, true, true>, int(smem));
  // A row's blocks form one cluster where p.cluster (launch_clustered adds the attribute above 1 block).
  launch_clustered(p.programmatic, dim3(unsigned(p.cluster ? p.blocks_per_row : 1), 1, 1),
                   sample::sample_kernel_for<T>(p),
                   dim3(unsigned(p.blocks_per_row), unsigned(p.rows)), dim3(kSampleThreads), smem, stream, p);
}

template <typename T>
int sample_clusters_at_once(const SampleParams& p) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const auto kernel = sample::sample_kernel_for<T>(p);
  const size_t smem = sample_stage_bytes<T>(p);
  // Read once per (device, kernel, shared memory, cluster size): the query is a driver call. Keyed by the shared
  // memory too (top_k's staging follows the vocabulary), so a map rather than decode's table by cluster size.
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, size_t, int>, int> known;
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), smem, p.blocks_per_row);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = known.find(key); it != known.end()) return it->second;
  }
  if (smem > 0) allow_dynamic_smem(kernel, int(smem));
  const int clusters = max_active_clusters(kernel, dim3(unsigned(p.blocks_per_row), 1, 1), kSampleThreads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  known.emplace(key, clusters);
  return clusters;
}

template <typename T>
bool sample_sm90_capable() {
  static const bool capable = programmatic_capable(sample::sample_kernel<T, false, false>);
  return capable;
}

}  // namespace fused_attn
