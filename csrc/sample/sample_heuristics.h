// Launch choices of sample: how many blocks of a thread-block cluster split a row, as a constexpr function of the
// shape and of how many clusters of each size the device runs at once. Each entry names the measurement that chose
// it (docs/lab-notes/sampling.md has the tables). Torch-free and host-compilable: read by sample.cpp and by
// tests/test_sample_heuristics.py.
#pragma once

#include <algorithm>
#include <cstdint>

#include "sample_launch.h"

namespace fused_attn {

// Columns one block reduces before the row is worth splitting over another (a cluster's blocks).
constexpr int64_t kSampleColumnsPerBlock = 4096;

// Blocks a row (on sm_90, where a row's blocks merge in a cluster): enough to spread the row, kSampleColumnsPerBlock
// columns each, up to the portable cluster limit; no more than one wave of blocks in all at two blocks an SM (the
// kernel's launch bounds); and no more than lets every row's cluster be resident at once. clusters_at_once(b) is how
// many clusters of b blocks the device holds together (cudaOccupancyMaxActiveClusters): a cluster's blocks must
// share a GPC, so that can be fewer than 2 x sms / b, and a row whose cluster does not fit runs after the others.
// At 64 rows of GPT-2's 50257 logits the second rule alone gives 4 blocks a row, 64 clusters, of which an H200 holds
// 62 (Nsight Compute, 829bec4): the launch took 21.5 us at 1.48 GHz with the SMs active 56% of it. With this rule
// (3 a row, 79 clusters held): 18.4 us, SMs active 69%; GPT-2's graph-fused fp16 step B32 / B48 / B64 369.1 / 444.8 /
// 467.7 -> 365.8 / 442.4 / 465.6 us (H200, bench.ab sample-clusters-past-one-wave, two interleaved rounds).
template <typename ClustersAtOnce>
constexpr int sample_blocks_per_row(int64_t rows, int64_t vocab, int sms, ClustersAtOnce clusters_at_once) {
  int64_t blocks = std::min<int64_t>({(vocab + kSampleColumnsPerBlock - 1) / kSampleColumnsPerBlock,
                                      int64_t(kSampleMaxBlocksPerRow),
                                      std::max<int64_t>(1, 2 * int64_t(sms) / std::max<int64_t>(rows, 1))});
  while (blocks > 1 && rows > int64_t(clusters_at_once(int(blocks)))) --blocks;
  return int(blocks);
}

}  // namespace fused_attn
