// The linear kernels' compile-time tuning (linear_kernel.cuh, linear_splitk.cuh): each constant with the
// measurement that chose it. The launch-time choices (rows per path, split-K splits, the norm's placement)
// are in linear.cpp. bench/ab.py A/Bs another value on a temporary copy of this file. Torch-free.
#pragma once

namespace fused_attn {
namespace linear {

// The epilogue's bias loaded before wait_for_primary() and its residual right after it, so that they are in
// registers when the sums are (the CUDA-core kernel from two rows: its kAhead; the tensor-core kernels'
// owning warps). GPT-2's captured step, H100, fp16: batch 4 -7.5 us, batch 16 even, batch 1 +2.5 us (hence
// not at one row); docs/lab-notes/linear-mlp.md.
constexpr bool kOutputAhead = true;

// The tensor-core kernels' short build: chunks of 32 k per warp in flight and the blocks per SM it is compiled
// for (__launch_bounds__), where a warp's share of K fits them (K <= 768 for the whole-K kernel). Unbounded,
// ptxas gives 110-112 registers (two blocks per SM); 3 chunks at 3 blocks take 80. GPT-2's decode step, H100,
// fp16: batch 16 483 -> 415 us, batch 8 453 -> 382 (2 chunks at 4 blocks, 64 registers: 433 at batch 16).
constexpr int kMmaShortChunks = 3;
constexpr int kMmaShortMinBlocks = 3;
// The long build (longer rows, tens of MB streamed: bytes in flight per SM matter more), unbounded: Llama's
// 4096 x 4096 at M = 16 21.4 us against 26.1 under the short build (H100, bench_linear).
constexpr int kMmaLongChunks = 4;

// x staged in shared memory by cp.async (kStageX) in the short build with two n-tiles (9-16 rows) in a grid the
// SMs hold at once, and in the split-K grids. H200, fp16, cold L2, p50, staged / not: linear 768x2304 M 16
// 6.94 / 8.10 us, 768x3072 7.04 / 8.29, 3072x768 (split-K) 7.86 / 8.45; GPT-2's step batch 16 333.9 / 347.0
// us (H100: 352.1 / 374.7), batches 1-8 even. Many-wave grids (the lm_head, Llama's long build) measured
// slower staged, so they keep the register path.
constexpr bool kMmaStageX = true;
// A __syncwarp() right after a staged group's copies, so that ptxas issues all of them before the first
// weight read (without it 3 of 6 pieces waited a second round trip at 16 rows). GPT-2's step, H100, fp16,
// batch 16: 334.6 / 334.4 us against 336.5 / 337.7 without; prompt 512 398.9 against 402.3; the other kernels
// byte-identical.
constexpr bool kMmaXFence = true;

// The wide build (17-32 rows of x: four n-tiles; linear.cpp's kMmaWideMaxRows): one chunk of 32 k a warp in flight,
// every n-tile's x piece in registers, two blocks per SM (ptxas, sm_90a: 94-104 registers, no spills). GPT-2's
// graph-fused step against cuBLAS at those rows (H200, fp16, prompt 128, bench.ab, two interleaved rounds): batch 24
// 460.4 -> 349.3 us, batch 32 471.6 -> 368.9. Eight n-tiles (33-64 rows, 128 registers) measured slower than cuBLAS
// in the same call: batch 48 529.7 -> 547.3, batch 64 548.8 -> 583.5.
constexpr int kMmaWideChunks = 1;
constexpr int kMmaWideMinBlocks = 2;

}  // namespace linear
}  // namespace fused_attn
