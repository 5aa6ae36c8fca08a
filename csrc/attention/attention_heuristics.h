// Launch choices of the Hopper flash kernel (attention_wgmma.cuh), as constexpr functions of the shape:
// its loader, its head dim 64 tile and its block order. Each entry names the measurement that chose it
// (docs/lab-notes/attention.md has the tables); bench/ab.py's VARIANTS re-measure the alternatives on a copy of the
// tree. Torch-free and host-compilable: read by attention.cpp and attention_wgmma.cuh.
#pragma once

#include <cstdint>

namespace fused_attn {

// The loader: TMA (one thread issues each tile as tensor copies) wherever q, k and v can be described as
// tensor maps (common/tma.h: 16-byte aligned, strides positive multiples of 16 bytes), else cp.async by
// the loader warpgroup. TMA measured 1.5-1.7x faster than cp.async at D128 S4096 (fp16, H100,
// bench_attention).
constexpr bool kFlashTma = true;

// Head dim 64's tile (attention_wgmma.cuh's FlashWgmmaConfig): 1 (BR 128, BC 64, two blocks per SM) under
// causal where the grid has more 128-row query blocks than the device has SMs, else 2 (BR 64, one
// consumer, two blocks per SM). fp16, H12, H100, bench_attention: tile 1 is the fastest at B8 causal S512 /
// S1024 (35.3 / 76.8 us against tile 2's 39.1 / 83.9 and tile 0's 40.6 / 86.0), tile 2 at every other
// GPT-2 shape (B1 S512 causal 14.1 against 16.1 and 18.3; B8 S1024 full 78.5 against 83.2 and 85.4); tile
// 0 (BR 128, BC 128, one block per SM) won at none, so head dim 64 is not built with it.
// blocks_128: ceil(seqlen_q / 128) x nheads_q x batch.
constexpr int flash_d64_tile(bool causal, int64_t blocks_128, int64_t sms) {
  return causal && blocks_128 > sms ? 1 : 2;
}

// The launch's query rows per block and blocks per SM (FlashWgmmaConfig): head dim 64's tile 2 has 64 rows,
// its tiles run two blocks per SM; head dim 128 has tile 0 (128 rows, one block per SM).
constexpr int64_t flash_block_rows(int headdim, int d64_tile) { return headdim <= 64 && d64_tile == 2 ? 64 : 128; }
constexpr int64_t flash_blocks_per_sm(int headdim) { return headdim <= 64 ? 2 : 1; }

// The block order under causal (without it every query tile reads every key and the natural order stays:
// consecutive blocks share a head's K and V in L2): query tiles longest-first across every (head, batch)
// where the grid is at most kFlashLongestFirstMaxWaves waves of blocks, else each (head, batch)'s tiles in
// turn. Longest-first against natural, H100, bench_attention: B8 H12 S512 D64 causal 30.7 against 35.2 us
// (2-3 waves: the long tiles no longer start in the last one), H32 D128 S2048 / S4096 -8% / -2..-6% (4-8
// waves), but S16384 +4..+7% (31 waves: the blocks in flight span every head, so each head's K and V
// leave L2 between its tiles).
constexpr int64_t kFlashLongestFirstMaxWaves = 8;
constexpr bool flash_longest_first(bool causal, int64_t blocks, int64_t blocks_per_sm, int64_t sms) {
  return causal && blocks <= kFlashLongestFirstMaxWaves * blocks_per_sm * sms;
}

}  // namespace fused_attn
