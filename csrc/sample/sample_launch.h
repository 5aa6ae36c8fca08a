// Parameters and launch declarations of sample (csrc/sample/sample_kernel.cuh), torch-free: the
// launcher (sample.cpp, g++) fills SampleParams, the instantiation units (nvcc) hold the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_attn {

constexpr int kSampleThreads = 512;
// Blocks per row when they merge in a thread-block cluster (the portable cluster size limit).
constexpr int kSampleMaxBlocksPerRow = 8;
// top_k: a block's columns are staged in shared memory (one read for the select's passes and the draw)
// where they fit in this many bytes; beyond it (a single block per row of a large vocabulary: no
// clusters) every pass reads them from global memory again.
constexpr int kSampleStageMaxBytes = 96 * 1024;

struct SampleParams {
  const void* logits;     // [rows, vocab], row stride row_stride elements, last dim contiguous
  int64_t* out;           // [rows] int64, stride out_stride
  const void* offsets;    // int32 or int64, 1 element (shared) or one per row; nullptr: none
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  int64_t out_stride;
  int64_t offsets_stride;  // 0: one offset for every row
  bool offsets64;
  uint64_t offset;         // added to offsets[row]
  // The counters that row r advances once its token is written: advance[i * adv_stride_k + r *
  // adv_stride_row] += 1 for i < adv_k (int64 where advance64, else int32); nullptr: none.
  void* advance;
  int64_t adv_stride_k, adv_stride_row;
  int adv_k;
  bool advance64;
  // The token history: row r's token also goes to history[r * history_stride + i], i =
  // history_index[r * history_index_stride] (int64 where history_index64, else int32), read by the thread
  // that writes the token, before it advances the row's counters (the index may be one of advance's rows).
  // An i outside [0, history_len) writes nothing into history and -1 into out[r]. nullptr: none.
  int64_t* history;
  const void* history_index;
  int64_t history_stride, history_len, history_index_stride;
  bool history_index64;
  uint64_t seed;
  float temperature;       // 0: greedy (argmax); > 0: a sample of softmax(logits / temperature)
  // > 0 (only with temperature > 0 and top_k < vocab): the sample is drawn from the top_k largest logits
  // of the row and any equal to the top_k-th (Hugging Face's TopKLogitsWarper; torch.topk's order: NaN
  // largest, -0 equal to +0; a NaN top_k-th keeps every column, as `logits < NaN` masks none).
  int64_t top_k;
  int64_t chunk;           // columns per block
  bool stage;              // top_k: the block's columns are staged in dynamic shared memory (launch_sample)
  int blocks_per_row;      // > 1 only with cluster
  bool cluster;            // a row's blocks merge through distributed shared memory
  bool programmatic;       // launched as a programmatic dependent (common/pdl.cuh)
  bool pdl_early;          // trigger the dependent launch before the wait (set by launch_sample: pdl.cuh)
};

template <typename T>
void launch_sample(const SampleParams& p, cudaStream_t stream);

// How many clusters of p.blocks_per_row blocks of the kernel that p would launch (top_k's or not, its shared
// memory) the current device holds at once (cudaOccupancyMaxActiveClusters, cached); 0 where the query fails (the
// caller then splits no row).
template <typename T>
int sample_clusters_at_once(const SampleParams& p);

// Whether the kernel for T was compiled for sm_90 or later: clusters and PDL are then available.
template <typename T>
bool sample_sm90_capable();

}  // namespace fused_attn
