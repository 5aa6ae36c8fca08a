// What the launcher (decode_attention.cpp, host C++ with ATen) and the kernels
// (decode_attention_kernel.cuh, built in the generated decode_attention_inst_*.cu units) share:
// the parameter struct, the kernels' tile geometry (the launcher's split heuristic needs it) and
// the launch functions. Torch-free and host-compilable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/fastdiv.cuh"

namespace fused_attn {

struct DecodeParams {
  // Strides are in elements; every last dim is contiguous. q, k_new, v_new, out:
  // [batch, heads, seqlen_new, headdim], or packed [total_q, heads, headdim] with cu_seqlens_q (stride_b 0,
  // stride_s the row stride); caches: [batch, nheads_kv, max_len, headdim], or page pools
  // [num_pages, nheads_kv, page_size, headdim] with block_table (k_stride_b / v_stride_b: the page stride).
  const void* q;
  int64_t q_stride_b, q_stride_h, q_stride_s;
  void* k_cache;
  void* v_cache;
  int64_t k_stride_b, k_stride_h, k_stride_l;
  int64_t v_stride_b, v_stride_h, v_stride_l;
  const void* k_new;  // nullptr: no append
  const void* v_new;
  int64_t kn_stride_b, kn_stride_h, kn_stride_s;
  int64_t vn_stride_b, vn_stride_h, vn_stride_s;
  void* out;
  int64_t o_stride_b, o_stride_h, o_stride_s;
  const int* seqlens;  // [batch], valid slots before this call, or nullptr (max_len: all of them)
  const int* leftpad;  // [batch] first valid slot, or nullptr (0)
  const bool* key_mask;  // [batch or 1, max_len], True = attend, or nullptr
  int64_t key_mask_stride_b;  // 0 when broadcast over the batch
  // Paged cache, or nullptr (contiguous): [batch, table_stride_b] pages; slot s of sequence b is row
  // s & (2^page_shift - 1) of page block_table[b * table_stride_b + (s >> page_shift)], in [0, num_pages).
  const int* block_table;
  int64_t table_stride_b;
  int page_shift, num_pages;
  // The page pools' page and row strides in bytes (each below 2**32: decode_attention.cpp checks), and
  // page_size - 1: a row's address is two 32 x 32 -> 64-bit multiply-adds (decode::TileRows).
  uint32_t k_page_bytes, k_row_bytes, v_page_bytes, v_row_bytes, page_mask;
  // Ragged batch, or nullptr: [batch + 1] offsets, sequence b's n_b = cu[b + 1] - cu[b] new tokens at rows
  // cu[b] .. cu[b + 1] - 1 of the packed tensors ([total_q, ...]); seqlen_new is then max_seqlen_q (the
  // grid's rows per sequence), rows i >= n_b idle (decode::NewRows).
  const int* cu_seqlens_q;
  int total_q;
  int batch, nheads_q, nheads_kv, seqlen_new, headdim, max_len;
  int group;       // nheads_q / nheads_kv
  int rows;        // group * seqlen_new: the query rows that read one kv head
  int row_chunks;  // blocks per kv head along the rows: ceil(rows / R)
  int num_splits;  // key-range splits per (sequence, kv head, row chunk)
  // The splits of one (sequence, kv head, row chunk) form a thread-block cluster and merge in
  // distributed shared memory (sm_90, num_splits <= kMaxClusterSplits): no partials, no combine.
  bool cluster;
  // Launched as a programmatic dependent of the previous kernel (common/pdl.cuh; sm_90 with the
  // kernels compiled for it): the next op's kernel can start its prologue under this one's tail.
  bool programmatic;
  // Trigger the dependent launch before the wait, and prefetch the cached rows into L2 before it (set
  // by the launch functions from the batch: pdl.cuh's pdl_early).
  bool pdl_early;
  float scale_log2;  // scale * log2(e): scores live in the log2 domain
  // The kernels' divisions by launch-time counts, as multiply-highs (decode_divisors): the block index by
  // row_chunks and nheads_kv, a query row by seqlen_new, an output index by headdim, the tiles by num_splits, the
  // combine's rows by nheads_q, the cluster merge's outputs by their slice (decode_cluster_slice). A runtime
  // division is ~25 dependent instructions: the tensor-core kernel's path to its first K/V load held ten, its
  // merge one or two an output element (nvcc 13.0, sm_90a SASS, 2026-11-30).
  FastDiv32 div_row_chunks, div_nheads_kv, div_seqlen_new, div_headdim, div_splits, div_nheads_q, div_slice;
  // num_splits > 1: per split, the normalized partial output and its log2-sum-exp, merged by
  // the combine kernel. [num_splits, batch, nheads_q, seqlen_new, headdim] / [..., seqlen_new].
  float* partial_o;
  float* partial_lse;
};

// The outputs each block of a cluster of `splits` owns in the cluster merge (decode::finish): a ceil share of the
// block's rows_per_block x headdim outputs.
constexpr int decode_cluster_slice(int rows_per_block, int headdim, int splits) {
  return (rows_per_block * headdim + splits - 1) / (splits > 0 ? splits : 1);
}

// Fills p's divisors from its counts, once they are final (num_splits, row_chunks, cluster).
inline void decode_divisors(DecodeParams& p, int rows_per_block) {
  p.div_row_chunks = FastDiv32(p.row_chunks);
  p.div_nheads_kv = FastDiv32(p.nheads_kv);
  p.div_seqlen_new = FastDiv32(p.seqlen_new);
  p.div_headdim = FastDiv32(p.headdim);
  p.div_splits = FastDiv32(p.num_splits);
  p.div_nheads_q = FastDiv32(p.nheads_q);
  p.div_slice = FastDiv32(decode_cluster_slice(rows_per_block, p.headdim, p.num_splits));
}

// Tile geometry of decode_kernel<T, HD, R, kDeep, NT, kPaged>: each thread owns EPT consecutive elements of a
// key row (16-byte loads, at least HD / 32 so a key's row fits one warp), TX threads share a key,
// NY keys are in flight per step per block of NT threads, U steps unrolled per loop iteration.
constexpr int kDecodeThreads = 128;
// The wide build of decode_kernel (one query row per block): twice the warps per (sequence, head), one
// key per thread per stage, the same keys and bytes per stage; launched where decode_attention_heuristics.h's
// decode_wide says.
constexpr int kDecodeWideThreads = 256;
constexpr int kMaxClusterSplits = 16;  // Hopper's largest (non-portable) cluster
constexpr int kMaxSplits = 256;        // the num_splits argument's bound
template <typename T, int HD, int NT = kDecodeThreads>
struct DecodeGeometry {
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int EPT = kVec > HD / 32 ? kVec : HD / 32;
  static constexpr int TX = HD / EPT;
  static constexpr int NY = NT / TX;
};
// U: keys per thread per pipeline stage. STAGES: tiles a block has in shared memory (STAGES - 1
// of them in flight while it computes one), about 32 KB of K and V per block, 48 KB in the kDeep build.
// TILE: keys per stage. kDeep: the deep pipeline, launched where decode_attention_heuristics.h's
// decode_deep says.
template <typename T, int HD, int R, bool kDeep = false, int NT = kDecodeThreads>
struct DecodeTile {
  static constexpr int U = NT >= 256 ? 1 : 2;
  static constexpr int TILE = DecodeGeometry<T, HD, NT>::NY * U;
  static constexpr int kStageBytes = NT * U * DecodeGeometry<T, HD, NT>::EPT * int(sizeof(T)) * 2;
  static constexpr int kPipe = (kDeep ? 48 : 32) * 1024;
  static constexpr int STAGES = kPipe / kStageBytes < 2 ? 2 : kPipe / kStageBytes > 8 ? 8 : kPipe / kStageBytes;
  // The kernel's dynamic shared memory: the pipeline, reused after the loop for the merge of the NT / 32
  // warps' o [R][NT / 32][HD], m and l [R][NT / 32] (the cluster merge adds its pushes past it).
  static constexpr int kMergeBytes = (R * (NT / 32) * HD + 2 * R * (NT / 32)) * 4;
  static constexpr int kSmemBytes = STAGES * kStageBytes > kMergeBytes ? STAGES * kStageBytes : kMergeBytes;
};

// Defined in decode_attention_kernel.cuh, instantiated in decode_attention_inst_*.cu
// (generate_instantiations.py). HD: padded head dim (32, 64, 128, 256); R: query rows per block;
// kPaged: the page-pool cache (p.block_table), instantiated in the *_paged units.
template <typename T, int HD, int R, bool kPaged>
void launch_decode(const DecodeParams& p, cudaStream_t stream);
// programmatic: launch it as a programmatic dependent of the attention kernel (sm_90: its launch
// overlaps the attention's tail; it waits for the partials in the kernel). Only where
// decode_combine_arch<T>() >= 90, the combine's wait being compiled in.
template <typename T>
void launch_decode_combine(const DecodeParams& p, bool programmatic, cudaStream_t stream);
template <typename T>
int decode_combine_arch();
// The tensor-core kernel: float16 / bfloat16, HD 64 or 128, 16 query rows per block (row_chunks
// counted in 16s). decode_mma_arch: the SM version it was compiled for (0 if none: mma.sync
// needs sm_80; the cluster merge, sm_90).
template <typename T, int HD, bool kPaged>
void launch_decode_mma(const DecodeParams& p, cudaStream_t stream);
template <typename T, int HD>
int decode_mma_arch();
// How many clusters of `splits` blocks of decode_mma_kernel the current device holds at once (its
// cudaOccupancyMaxActiveClusters with the cluster merge's shared memory), read once per device and size.
template <typename T, int HD, bool kPaged>
int decode_mma_max_active_clusters(int splits);
// How many blocks of decode_mma_kernel an SM of the current device holds at once (its
// cudaOccupancyMaxActiveBlocksPerMultiprocessor with the cluster merge's shared memory), read once per device.
template <typename T, int HD, bool kPaged>
int decode_mma_max_blocks_per_sm();
// Whether decode_kernel<T, HD, R, false, kDecodeThreads, false> was compiled for sm_90 or later (the cluster
// merge's code is there).
template <typename T, int HD, int R>
bool decode_cluster_capable();

}  // namespace fused_attn
