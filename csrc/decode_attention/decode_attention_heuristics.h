// Launch choices of decode_attention, as constexpr functions of the shape: the kernel (tensor cores or
// CUDA cores), the query rows per block, the key-range splits, and the CUDA-core kernel's builds (deep
// pipeline, wide block). Each entry names the measurement that chose it (docs/lab-notes/decode-attention.md has
// the tables); bench/ab.py's VARIANTS re-measure the alternatives on a copy of the tree. Torch-free and
// host-compilable: read by decode_attention.cpp and decode_attention_kernel.cuh. The PDL trigger point
// (the batch up to which a launch triggers its dependent early) is common/pdl.cuh's, shared by the chain.
#pragma once

#include <algorithm>
#include <cstdint>

#include "decode_attention_launch.h"

namespace fused_attn {

// The tensor-core kernel serves blocks of >= kDecodeMmaMinRows query rows (GQA groups x new tokens). One
// row (MHA decoding) stays on the CUDA-core kernel: there 15 of the 16 MMA rows are padding, measured
// slower (Llama B1 H32 L8192, H100, bench_decode_attention: 80-88 us against 54); GPT-2's step with the
// tensor-core kernel at one row, H100, bench.time_decode_graph: +27 to +42 us.
constexpr int kDecodeMmaMinRows = 4;
constexpr bool decode_use_mma(int rows) { return rows >= kDecodeMmaMinRows; }

// Rows of queries per block of the CUDA-core kernel: the group x new tokens that read one kv head, up to 8
// (beyond that, more row chunks: each re-reads the kv head's keys, mostly from L2).
constexpr int decode_rows_per_block(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }

// The splits: about blocks_per_sm blocks per SM (rounded down: a batch that already fills the GPU is not split),
// and no split shorter than kDecodeMinKeysPerSplit slots of the cache's capacity. Depends only on shapes, never
// on the device-side lengths: a captured graph keeps its grid and a split past the current length exits early.
// Where the device merges the splits in a cluster, up to twice the cluster limit becomes the limit (one launch,
// no combine kernel: measured faster than more splits plus the combine). H100, bench_decode_attention and
// bench.sweep_decode_splits: more splits for small grids made GPT-2's step at batch 4 faster at long caches but
// the op alone at Llama batch 2 slower, so the CUDA-core kernel's rule stays two blocks per SM
// (kDecodeBlocksPerSm). work: the blocks before splitting (batch x nheads_kv x row chunks).
// cluster_max_len: caches of at most this many slots take the cluster's splits at any count past the limit
// (the tensor-core kernel's kDecodeMmaClusterMaxLen; 0: only up to twice the limit).
constexpr int kDecodeMinKeysPerSplit = 64;
constexpr int kDecodeBlocksPerSm = 2;
constexpr int decode_splits(int64_t work, int max_len, int sms, bool cluster_ok,
                            int blocks_per_sm = kDecodeBlocksPerSm, int cluster_max_len = 0) {
  int64_t splits = std::max<int64_t>(1, int64_t(blocks_per_sm) * sms / work);
  splits = std::min<int64_t>(splits, std::max(1, max_len / kDecodeMinKeysPerSplit));
  if (cluster_ok && splits > kMaxClusterSplits && (splits <= 2 * kMaxClusterSplits || max_len <= cluster_max_len)) {
    splits = kMaxClusterSplits;
  }
  return int(std::clamp<int64_t>(splits, 1, kMaxSplits));
}

// The CUDA-core kernel at long caches and few blocks before splitting (batch 1 MHA): the general rule's 8 splits
// in a cluster (32 heads, 16k slots a split at 128k keys) read ~4.1 TB/s; kDecodeLongBlocksPerSm blocks an SM (24
// splits of 5.5k slots, past a cluster: merged by the combine kernel) read more. H200, fp16, B1 32/32, 128k keys,
// forced num_splits (2026-11-29), against cuDNN in the same run: D128 8 splits 513.1 us, 24: 494.5 (12 / 16 in a
// cluster 565.8 / 554.6, 32 (a second wave) 528.7; cuDNN 488.4); D64 261.3 -> 253.0 (cuDNN 251.5). At 32k keys
// the general rule is at cuDNN (136.7 against 137.6 us); where six blocks an SM are at most a cluster's splits
// (batch 4 MHA: 6), the rule stays general (3 or 4 splits in a cluster at B4 D128 32k: 525.7 / 518.8 against
// 2's 487.5).
constexpr int kDecodeLongMinLen = 131072;
constexpr int kDecodeLongBlocksPerSm = 6;
// Below kDecodeLongBlocksPerSm blocks an SM every block of the grid is resident at once, and the SMs holding one block
// more than the others finish last: while they do, fewer SMs stream the cache. So the long-cache rule takes, among the
// counts past a cluster up to six blocks an SM, the one whose grid fills its last round of blocks over the SMs best
// (work x splits mod sms, 0 as full). H200, fp16, B1 32/32, 128k keys, forced num_splits (dev.sweep_decode_splits,
// 2026-11-30), 18 / 20 / 22 / 24 / 26 splits, their last round 36 / 85 / 33 / 82 / 30% full: D128 509.4 / 489.5 /
// 511.5 / 493.1 / 515.1 us, D64 261.2 / 250.3 / 261.6 / 253.5 / 267.3 (SDPA's default backend 498.7 / 261.5; 20
// against 24 in an earlier sweep: 487.5 / 492.8 at D128). A paged cache likewise: 20 splits against 24 at B1 32/32,
// pages of 16 (H200, fp16, bench.ab, two interleaved rounds, 2026-12-01), D128 32k 130.9 / 131.3 us, 128k 483.6 /
// 486.3, D64 32k 70.6 / 70.9, 128k 247.8 / 248.7 (forced num_splits in one sweep, D128 128k: 491.6 / 496.4).
constexpr int decode_long_fill_splits(int64_t work, int sms, int most) {
  int best = most;
  int64_t best_fill = -1;
  for (int s = most; s > kMaxClusterSplits; --s) {
    const int64_t rest = work * s % sms, fill = rest == 0 ? sms : rest;
    if (fill > best_fill) best = s, best_fill = fill;
  }
  return best;
}
// A paged cache takes the same rule from kDecodePagedLongMinLen slots: at 32k keys its 8 splits in a cluster stream
// slower than the contiguous cache's (a paged block reads 4 KB runs of 16-slot pages; forced one split, a paged block
// streams 8% slower than a contiguous one at B1 MHA D128 8k), and 24 splits win back most of it. H200, fp16, B1
// 32/32, 32k keys, pages of 16, forced num_splits (dev.sweep_decode_splits, 2026-11-30): D128 paged 8 splits 142.3
// us, 24: 136.3 (the rule before: 141.7; contiguous 132.7); D64 73.9 / 74.7 (contiguous 70.2), even. At 8k keys
// 24 splits lose (D128 paged 42.5 -> 45.4 us), hence the bound. The count among them: decode_long_fill_splits.
constexpr int kDecodePagedLongMinLen = 32768;
// The CUDA-core kernel where the blocks before splitting fill the GPU at least once and the cache is long (batch 16
// MHA): the general rule's one split leaves a grid of 1.94 waves (512 blocks, 264 at a time) whose second wave runs
// short; kDecodeWaveSplits splits a block, merged in a cluster, cut the tail fine. H200, fp16, 32 heads, batch 16,
// contiguous cache, forced num_splits against the general rule's 1 (dev.sweep_decode_splits, 2026-11-30): D128
// 32k keys 1883.0 -> 1855.9 us (24 splits 1863.1, 2: 1971.2), D128 128k 7500.1 -> 7371.3 (24: 7358.7), D64 128k
// 3740.7 -> 3678.0; SDPA in the same run 1873.9 / 7501.5 / 3707.8. Only where measured: with the cluster merge
// (cluster_ok; the combine kernel's 16 splits were not measured) and an unsplit grid of one to two waves (larger
// grids' tails are a smaller share of their time, and 16x the blocks' merges were not measured there).
constexpr int kDecodeWaveMinLen = 32768;
constexpr int kDecodeWaveSplits = 16;
static_assert(kDecodeWaveSplits <= kMaxClusterSplits, "the wave rule's splits merge in one cluster");
// The CUDA-core kernel's splits at long caches: kDecodeWaveSplits where the unsplit grid is one to two waves (above);
// at a cache of at least kDecodeLongMinLen slots (kDecodePagedLongMinLen paged), where kDecodeLongBlocksPerSm blocks an
// SM are more splits than a cluster holds, the count up to that with the fullest last round (decode_long_fill_splits);
// 0 elsewhere (decode_splits decides).
constexpr int decode_long_splits(int64_t work, int max_len, int sms, bool cluster_ok, bool paged) {
  const int64_t wave = int64_t(kDecodeBlocksPerSm) * sms;
  if (cluster_ok && max_len >= kDecodeWaveMinLen && work >= wave && work <= 2 * wave) {
    return kDecodeWaveSplits;
  }
  if (max_len < (paged ? kDecodePagedLongMinLen : kDecodeLongMinLen)) return 0;
  const int splits = decode_splits(work, max_len, sms, /*cluster_ok=*/false, kDecodeLongBlocksPerSm);
  if (splits <= kMaxClusterSplits) return 0;
  return decode_long_fill_splits(work, sms, splits);
}

// The tensor-core kernel at short caches and few blocks before splitting (batch 1 GQA: 8 kv heads): its
// 33-49 splits of an 8k cache run 3-4 tiles each, where the pipeline's fill, the partials and the combine's
// launch cost more than the extra blocks bring; the cluster's 16 splits (8 tiles each, merged in the launch)
// are faster. H200, fp16, batch 1, forced num_splits (2026-11-29), 8k keys: 32/8 D128 33 splits 28.9 us ->
// 16 in a cluster 25.5 (cuDNN 26.6), 64/8 D128 30.9 -> 27.6 (27.1), 32/8 D64 49 splits 24.3 -> 19.4 (21.0);
// at 32k keys the more splits win (D128 33: 50.5 us, 16: 64.9; D64 49: 36.3, 16: 44.3).
constexpr int kDecodeMmaClusterMaxLen = 8192;

// The tensor-core kernel's blocks per SM for the splits: as many as the SM holds at once (fit: its occupancy,
// cudaOccupancyMaxActiveBlocksPerMultiprocessor with the cluster merge's shared memory), at least two. Its warps wait
// on dependent ldmatrix / mma / exp2 chains (Nsight Compute, B4 GQA 32/8 D64 128k at two blocks an SM: 0.37
// instructions issued a scheduler a cycle, 2.1 warps a scheduler, 5.6 cycles between two of a warp's instructions), so
// a third block an SM (half as many warps again) issues more. D64 holds 3 (shared memory: 4 stages of 16 KB), H200,
// fp16, contiguous cache, two blocks an SM -> three: B4 128k 314.7 -> 259.5 us, B4 32k 88.2 -> 77.4, B16 32k 289.6 ->
// 259.2, B1 128k 87.5 -> 82.8 (four, a second wave: 338.1 / 102.8 / 335.8 / 114.4). D128 holds 2: unchanged. (bench.ab,
// forced num_splits, 2026-11-29; docs/lab-notes/decode-attention.md.)
constexpr int decode_mma_blocks_per_sm(int fit) { return std::max(kDecodeBlocksPerSm, fit); }

// A split launch merges its splits in one cluster (kMaxClusterSplits) only when every cluster of the grid is
// resident at once (max_active: cudaOccupancyMaxActiveClusters for the kernel and cluster size); otherwise the
// splits write partials and the combine kernel merges them. A cluster waits for all its blocks, so a grid of
// more clusters than fit runs the rest as a second wave. The tensor-core kernel at head dim 128 holds two
// blocks an SM (shared memory), and the H200 fits 30 clusters of 8 of it: GQA 32/8 D128 at batch 4 is 32
// clusters of 8 splits: in clusters 72.9 / 226.9 us at 8k / 32k keys, the same 8 splits without a cluster
// 50.4 / 145.1 us (fp16, H200, dev.sweep_decode_splits; 17 splits without a cluster: 59.7 / 159.6 us).
constexpr bool decode_cluster_fits(int64_t clusters, int max_active) { return clusters <= max_active; }

// The L2 prefetch a block issues before its PDL wait (decode_attention_kernel.cuh, prefetch_cache): at most
// the first kDecodePrefetchMaxSlots cached slots of its split. The prefetch overlaps the first loads' DRAM
// round trip with the previous kernel; a whole split of a long cache (Llama B1 MHA 32k: 256 blocks of 4096
// slots, 512 MB of K and V against a 50 MB L2) is evicted before the block reads it and then read twice.
// 128 slots: 64 KB of K and V a block at head dim 128 in fp16, ~17 MB for two blocks an SM. GPT-2's steps
// (splits of at most ~200 slots) are unchanged by the bound.
constexpr int kDecodePrefetchMaxSlots = 128;

// The block_table loads a thread has in flight when a block checks the entries of its sequence's pages
// (decode_attention_kernel.cuh, pages_ok, PageCheck): ceil(L / page_size) entries, 8192 at 128k keys in pages of 16.
// The tensor-core kernel's first split alone checks, four entries a 16-byte load (16 loads a thread of 128 at 128k);
// the CUDA-core kernel's every block its own split's, after its first tiles are issued and before its loop, one entry
// a load (its loop's code is the cheaper for it), and its first split the rest after its loop. When every
// tensor-core block checked before its first tile, one entry a load, the check cost paged B1 GQA 32/8 D64 128k keys
// 17.6 us of 99.1 and B16 32k 29 us of 290 (the bound without any check, H200, fp16, pages of 16, bench.ab
// decode-paged-no-check, 2026-11-29); one entry at a time (8 -> 1): bench.ab's decode-paged-check-one-entry-at-a-time.
constexpr int kDecodePagesInFlight = 8;
// The tensor-core kernel's first split copies its check's first kDecodePagesEarly 16-byte loads a thread into shared
// memory before its main loop and compares them after it (PageCheck): 1 covers 512 entries, an 8k-slot sequence in
// pages of 16, so up to there no check's round trip is left between the loop and the merge the other splits wait in.
// Each is 2 KB a block: one fits beside three blocks an SM at D64 and two at D128, two do not (decode_mma_kernel's
// geometry). Staged against checked after the first tiles were issued, before the loop, with the tensor-core
// kernel's paged prefetch dropped in the same change: paged B1 GQA 64/8 D64 8k 18.3 -> 16.9 us, 32/8 D128 8k 23.1
// -> 21.7, B4 32/8 D128 32k 137.9 -> 133.8 (contiguous 15.8 / 21.5 / 134.3; H200, fp16, pages of 16, bench.ab
// against the tree before, 2026-11-30). No check at all, in another call: 17.7 / 22.0 / 134.7 against the tree's
// 18.8 / 22.6 / 137.9 there (decode-paged-no-check, the bound).
constexpr int kDecodePagesEarly = 1;

// The deep build of the CUDA-core kernel (48 KB of K and V a block in flight instead of 32: DecodeTile's
// kDeep), for one query row per block at batch <= kDecodeDeepMaxBatch where the launch triggers its
// dependent early (pdl.cuh) and a split's share of the cache's slots fits in the deep pipeline (STAGES x
// TILE keys). 48 KB against 32 KB, H100: GPT-2's fp16 captured step (bench.time_decode_graph) at batch 4
// -20 us (-7%), batch 1 -1 us, batches 8 and 16 (late trigger) +0..+5 us; the op alone at Llama-2-7B's MHA
// shape, batch 1 (bench_decode_attention), +13% at 8k keys and +9% at 32k (8 splits of 1024 / 4096 slots:
// fewer blocks an SM to hide the longer runs), hence the split condition. At GPT-2's batch 4 a split holds
// two tiles, so the depth is not what moves there: 16 KB also gains and 24 KB loses; what the shared
// memory a block holds changes is how many blocks of the launches behind it (the early trigger's run-ahead)
// fit beside it.
constexpr bool kDecodeDeep = true;
constexpr int64_t kDecodeDeepMaxBatch = 4;
// split_slots: ceil(max_len / num_splits); deep_slots: the deep pipeline's STAGES x TILE.
constexpr bool decode_deep(int64_t batch, bool pdl_early, int64_t split_slots, int64_t deep_slots) {
  return kDecodeDeep && batch <= kDecodeDeepMaxBatch && pdl_early && split_slots <= deep_slots;
}

// The wide build of the CUDA-core kernel (kDecodeWideThreads, one query row per block) from batch
// kDecodeWideMinBatch to kDecodeWideMaxBatch, where the deep build is not taken. For batches whose grid leaves each
// scheduler 1-2 warps (GPT-2 at batch 16, ncu): the four warps of the 128-thread build each run a ~1.4 k-instruction
// chain at ~8 cycles an instruction. GPT-2's fp16 step, bench.time_decode_graph, wide against 128 threads:
// H100 batch 16 -4..-7 us, batch 8 +2..+3, batch 16 at a 512-token prompt even; H200 in a settled process
// batch 16 -3.3 us at a 128-token prompt, -4.0 at 512. Batch 8 keeps the 128-thread build.
// Caches longer than kDecodeWideMaxLen slots keep it too: at Llama's MHA shape, batch 16, D128, fp16 (H200,
// bench_decode_attention, one run), the wide build read 84.9% / 93.5% of copy bandwidth at 8k / 32k keys,
// the 128-thread build (the paged provider, which only has that build) 102.6% / 104.6%, cuDNN 103.1% / 105.6%.
// Larger batches keep the 128-thread build: their grids give each scheduler enough warps, and the wide build's
// 256-thread blocks leave GPT-2's batch-48 / 64 grids (576 / 768 blocks) more than one round of resident blocks.
// GPT-2's fp16 graph-fused step (H200, prompt 128, bench.ab decode-wide-off, two interleaved rounds, 2026-12-02),
// wide -> 128 threads: batch 32 374.0 -> 368.6 us, batch 48 526.1 -> 497.2, batch 64 544.2 -> 516.2.
constexpr int64_t kDecodeWideMinBatch = 16;
constexpr int64_t kDecodeWideMaxBatch = 16;
constexpr int64_t kDecodeWideMaxLen = 2048;
constexpr bool decode_wide(int64_t batch, int64_t max_len) {
  return batch >= kDecodeWideMinBatch && batch <= kDecodeWideMaxBatch && max_len <= kDecodeWideMaxLen;
}

}  // namespace fused_attn
