// decode_attention kernels: a few new queries per sequence attend over its KV cache, after this
// step's keys and values are appended to the cache (fused into the same launch).
//
//   out[b, h, i] = softmax_j(q[b, h, i] · k[b, h / group, j] * scale) · v[b, h / group, j]
//   over the visible slots leftpad[b] <= j < seqlens[b] + seqlen_new (appending) - seqlen_new + 1 + i
//
// decode_kernel: one block per (sequence, kv head, chunk of R query rows, key-range split).
// A decode step moves the K and V rows of the visible slots once and little else, so the kernel
// is built to stream them at the copy bandwidth: each thread loads 16-byte pieces of U key rows
// and U value rows per iteration (16 KB per 128-thread block in flight for R <= 4), the R query
// rows that share the kv head (GQA group x new tokens) are all scored against each key while it
// is in registers, and the softmax is online (running max and sum per thread, in the log2
// domain), merged over the block's key slots through shared memory at the end. Keys at slots
// >= seqlens[b] are read from k_new / v_new directly, so the append (done by one block per
// kv head) and the reads never race.
//
// Split-KV (flash-decoding): with num_splits > 1 the key range [leftpad, end) is cut into
// num_splits equal runs of whole tiles, computed from the device-side lengths, so a grid fixed
// at capture replays at any length: a split past the end exits early. Each split writes its
// normalized partial output and log2-sum-exp; decode_combine_kernel merges them
// (out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)).
//
// Lengths out of bounds (seqlens < 0, end > max_len, leftpad outside [0, seqlens]): the
// sequence's outputs are NaN and its cache is not written; nothing past max_len is touched.
//
// Tests: tests/test_decode_attention.py; benchmark: bench/bench_decode_attention.py.
#pragma once

#include <cuda_runtime.h>

#include "../common/math.cuh"
#include "../common/vec_dtypes.cuh"
#include "decode_attention_launch.h"

namespace fused_attn {

namespace decode {

// EPT elements of type T as 16-byte loads (EPT * sizeof(T) is a multiple of 16).
template <typename T, int EPT>
struct Row {
  static constexpr int kWords = EPT * int(sizeof(T)) / 16;
  uint4 w[kWords];
  __device__ __forceinline__ void load(const T* ptr) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(ptr) + i);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void to_float(float (&f)[EPT]) const {
    const T* v = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int e = 0; e < EPT; ++e) f[e] = fused_attn::to_float(v[e]);
  }
};

__device__ __forceinline__ bool lengths_ok(const DecodeParams& p, int b, int& cached, int& end, int& start) {
  cached = p.seqlens[b];
  end = cached + (p.k_new != nullptr ? p.seqlen_new : 0);
  start = p.leftpad != nullptr ? p.leftpad[b] : 0;
  return cached >= 0 && end <= p.max_len && start >= 0 && start <= cached;
}

// Writes this step's keys and values of (b, kv head) into the cache: seqlen_new x headdim each.
template <typename T>
__device__ void append(const DecodeParams& p, int b, int hkv, int cached) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int per_row = p.headdim / kVec;
  const int n = p.seqlen_new * per_row;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int i = idx / per_row, c = (idx % per_row) * kVec;
    const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_stride_b + hkv * p.kn_stride_h + i * p.kn_stride_s + c;
    const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_stride_b + hkv * p.vn_stride_h + i * p.vn_stride_s + c;
    T* kc = static_cast<T*>(p.k_cache) + b * p.k_stride_b + hkv * p.k_stride_h + int64_t(cached + i) * p.k_stride_l + c;
    T* vc = static_cast<T*>(p.v_cache) + b * p.v_stride_b + hkv * p.v_stride_h + int64_t(cached + i) * p.v_stride_l + c;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
    *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
  }
}

}  // namespace decode

template <typename T, int HD, int R>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeParams p) {
  using G = DecodeGeometry<T, HD>;
  constexpr int EPT = G::EPT, TX = G::TX, NY = G::NY;
  constexpr int U = DecodeTile<T, HD, R>::U;
  constexpr int TILE = DecodeTile<T, HD, R>::TILE;
  static_assert(TX <= 32 && 32 % TX == 0, "a key's threads sit in one warp");

  __shared__ float sm_o[R][NY][HD];
  __shared__ float sm_m[R][NY];
  __shared__ float sm_l[R][NY];

  const int split = blockIdx.y;
  const int chunk = blockIdx.x % p.row_chunks;
  const int bh = blockIdx.x / p.row_chunks;
  const int hkv = bh % p.nheads_kv, b = bh / p.nheads_kv;
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int e0 = tx * EPT;           // this thread's first element of a row
  const bool lane_on = e0 < p.headdim;  // headdim % 8 == 0: a slice is all in or all out
  const int sn = p.seqlen_new;

  int cached, end, start;
  const bool ok = decode::lengths_ok(p, b, cached, end, start);
  if (!ok) {
    if (p.num_splits == 1) {  // with splits the combine kernel writes the NaNs
      for (int idx = threadIdx.x; idx < R * p.headdim; idx += blockDim.x) {
        const int rr = chunk * R + idx / p.headdim;
        if (rr >= p.rows) continue;
        const int h = hkv * p.group + rr / sn, i = rr % sn;
        static_cast<T*>(p.out)[b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s + idx % p.headdim] =
            from_float<T>(__int_as_float(0x7fc00000));
      }
    }
    return;
  }
  if (p.k_new != nullptr && split == 0 && chunk == 0) decode::append<T>(p, b, hkv, cached);

  // This split's keys: whole tiles of [start, end).
  const int tiles = (end - start + TILE - 1) / TILE;
  const int tiles_per_split = (tiles + p.num_splits - 1) / p.num_splits;
  const int kb = start + split * tiles_per_split * TILE;
  const int ke = min(end, kb + tiles_per_split * TILE);

  // The block's query rows, pre-scaled into the log2 domain; lim[r]: first slot row r cannot see.
  float q[R][EPT];
  int lim[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int rr = chunk * R + r;
    const int i = rr % sn;
    lim[r] = rr < p.rows ? end - sn + 1 + i : 0;
    if (rr < p.rows && lane_on) {
      const int h = hkv * p.group + rr / sn;
      decode::Row<T, EPT> row;
      row.load(static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_s + e0);
      row.to_float(q[r]);
#pragma unroll
      for (int e = 0; e < EPT; ++e) q[r][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < EPT; ++e) q[r][e] = 0.f;
    }
  }

  float m[R], l[R], o[R][EPT];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) o[r][e] = 0.f;
  }

  const T* kc = static_cast<const T*>(p.k_cache) + b * p.k_stride_b + hkv * p.k_stride_h + e0;
  const T* vc = static_cast<const T*>(p.v_cache) + b * p.v_stride_b + hkv * p.v_stride_h + e0;
  const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_stride_b + hkv * p.kn_stride_h + e0;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_stride_b + hkv * p.vn_stride_h + e0;

  for (int kt = kb; kt < ke; kt += TILE) {
    decode::Row<T, EPT> krow[U], vrow[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load of the iteration is issued before any is used
      const int j = kt + u * NY + ty;
      if (j < ke && lane_on) {
        if (j < cached) {
          krow[u].load(kc + int64_t(j) * p.k_stride_l);
          vrow[u].load(vc + int64_t(j) * p.v_stride_l);
        } else {
          krow[u].load(kn + (j - cached) * p.kn_stride_s);
          vrow[u].load(vn + (j - cached) * p.vn_stride_s);
        }
      } else {
        krow[u].zero();
        vrow[u].zero();
      }
    }
    float s[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[EPT];
      krow[u].to_float(kf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < EPT; ++e) acc = fmaf(q[r][e], kf[e], acc);
        s[r][u] = acc;
      }
    }
#pragma unroll
    for (int off = TX / 2; off > 0; off /= 2) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], off);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = kt + u * NY + ty;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!(j < ke && j < lim[r])) s[r][u] = kNegInf;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = max_nan(mx, s[r][u]);
      if (mx == kNegInf) continue;  // nothing visible yet for this row
      const float corr = fast_exp2(m[r] - mx);  // m == -inf: 0 (o and l are 0 anyway)
      m[r] = mx;
      l[r] *= corr;
#pragma unroll
      for (int e = 0; e < EPT; ++e) o[r][e] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = fast_exp2(s[r][u] - mx);  // masked: exp2(-inf) = 0
        l[r] += pr;
        float vf[EPT];
        vrow[u].to_float(vf);
#pragma unroll
        for (int e = 0; e < EPT; ++e) o[r][e] = fmaf(pr, vf[e], o[r][e]);
      }
    }
  }

  // Merge the NY key slots' (m, l, o) of each row.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (tx == 0) {
      sm_m[r][ty] = m[r];
      sm_l[r][ty] = l[r];
    }
#pragma unroll
    for (int e = 0; e < EPT; ++e) sm_o[r][ty][e0 + e] = o[r][e];
  }
  __syncthreads();
  __shared__ float sm_rowm[R], sm_rowl[R];
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    float mx = kNegInf;
    for (int y = 0; y < NY; ++y) mx = max_nan(mx, sm_m[r][y]);
    float sum = 0.f;
    for (int y = 0; y < NY; ++y) {
      const float w = mx == kNegInf ? 0.f : fast_exp2(sm_m[r][y] - mx);
      sm_m[r][y] = w;  // now the slot's weight
      sum += w * sm_l[r][y];
    }
    sm_rowm[r] = mx;
    sm_rowl[r] = sum;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * p.headdim; idx += blockDim.x) {
    const int r = idx / p.headdim, e = idx % p.headdim;
    const int rr = chunk * R + r;
    if (rr >= p.rows) continue;
    float acc = 0.f;
#pragma unroll
    for (int y = 0; y < NY; ++y) acc = fmaf(sm_m[r][y], sm_o[r][y][e], acc);
    const float sum = sm_rowl[r];
    const float val = sum > 0.f ? acc / sum : (sum == 0.f ? 0.f : acc / sum);  // NaN stays NaN
    const int h = hkv * p.group + rr / sn, i = rr % sn;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s + e] = from_float<T>(val);
    } else {
      const int64_t row = ((int64_t(split) * p.batch + b) * p.nheads_q + h) * sn + i;
      p.partial_o[row * p.headdim + e] = val;
      if (e == 0) p.partial_lse[row] = sum > 0.f ? sm_rowm[r] + __log2f(sum) : (sum == 0.f ? kNegInf : sum);
    }
  }
}

// One warp per output row (b, h, i): merges the num_splits partial rows.
template <typename T>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeParams p) {
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int64_t n_rows = int64_t(p.batch) * p.nheads_q * p.seqlen_new;
  if (row >= n_rows) return;
  const int lane = threadIdx.x % 32;
  const int i = int(row % p.seqlen_new);
  const int h = int(row / p.seqlen_new % p.nheads_q);
  const int b = int(row / (int64_t(p.seqlen_new) * p.nheads_q));
  T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s;
  int cached, end, start;
  if (!decode::lengths_ok(p, b, cached, end, start)) {
    for (int e = lane; e < p.headdim; e += 32) out[e] = from_float<T>(__int_as_float(0x7fc00000));
    return;
  }
  float mx = kNegInf;
  for (int s = lane; s < p.num_splits; s += 32) mx = max_nan(mx, p.partial_lse[s * n_rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float sum = 0.f;
  for (int s = lane; s < p.num_splits; s += 32) {
    const float lse = p.partial_lse[s * n_rows + row];
    sum += mx == kNegInf ? 0.f : fast_exp2(lse - mx);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  for (int e = lane; e < p.headdim; e += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse = p.partial_lse[s * n_rows + row];
      if (lse == kNegInf) continue;  // an empty split (its partial output is 0)
      acc = fmaf(fast_exp2(lse - mx), p.partial_o[(s * n_rows + row) * p.headdim + e], acc);
    }
    out[e] = from_float<T>(sum > 0.f ? acc / sum : (sum == 0.f ? 0.f : sum));
  }
}

template <typename T, int HD, int R>
void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.batch) * p.nheads_kv * p.row_chunks, p.num_splits);
  decode_kernel<T, HD, R><<<grid, kDecodeThreads, 0, stream>>>(p);
}

template <typename T>
void launch_decode_combine(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.nheads_q * p.seqlen_new;
  decode_combine_kernel<T><<<unsigned((rows + 3) / 4), 128, 0, stream>>>(p);
}

}  // namespace fused_attn
