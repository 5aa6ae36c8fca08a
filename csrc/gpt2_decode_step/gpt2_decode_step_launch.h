// What the launcher (gpt2_decode_step.cpp, host C++ with ATen) and the kernel
// (gpt2_decode_step_kernel.cuh, built in the generated gpt2_decode_step_inst_*.cu units) share: the
// parameter struct, the shared-memory layout both compute from it, and the launch declarations.
// Torch-free and host-compilable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fused_attn {

// Eight consumer warps compute; one producer warp streams the weights into the shared-memory ring.
constexpr int kStepConsumerWarps = 8;
constexpr int kStepConsumers = kStepConsumerWarps * 32;
constexpr int kStepThreads = kStepConsumers + 32;
constexpr int kStepHeadDim = 64;
constexpr int kStepMaxBatch = 16;
// n_embd: a thread keeps the norm's weight and bias of n_embd / 256 columns in registers.
constexpr int kStepMaxWidth = 2048;
constexpr int kStepMaxRing = 32;

// workspace: this header (a grid barrier's two counters, words 0 and 32: zero before the first launch,
// and each launch leaves them zero), then x, q, a ([batch, n_embd] each) and f ([batch, n_inner]) in
// the weights' dtype.
constexpr int kStepWorkspaceHeader = 256;
// Output (row, sequence) pairs a thread prefetches the bias and residual of into registers: 2 per
// thread covers 512 pairs (GPT-2 small's widest per-block stage at batch 16 on 132 SMs is 24 x 16).
constexpr int kStepPrefetch = 2;

struct Gpt2StepParams {
  const int64_t* token;  // [batch]
  const int* pos;        // [batch] position ids
  const int* seqlens;    // [batch] cache slots filled before this step (this token's slot)
  const int* leftpad;    // [batch] first real slot
  void* k_cache;         // [n_layer, batch, nheads, max_len, 64]
  void* v_cache;
  const void* wte;       // [vocab, n_embd]
  const void* wpe;       // [n_positions, n_embd]
  const void* norms;     // [2 n_layer + 1, 2, n_embd]: ln_1, ln_2 per layer, ln_f; weight, bias
  const void* w_qkv;     // [n_layer, 3 n_embd, n_embd] (out, in)
  const void* b_qkv;     // [n_layer, 3 n_embd]
  const void* w_o;       // [n_layer, n_embd, n_embd]
  const void* b_o;
  const void* w_fc;      // [n_layer, n_inner, n_embd]
  const void* b_fc;
  const void* w_proj;    // [n_layer, n_embd, n_inner]
  const void* b_proj;
  unsigned* barrier;     // workspace header
  void* x;               // workspace: residual stream [batch, n_embd]
  void* q;               // queries [batch, n_embd]
  void* a;               // attention output [batch, n_embd]
  void* f;               // GELU(c_fc) [batch, n_inner]
  void* logits;          // [batch, vocab]
  int batch, n_layer, nheads, n_embd, n_inner, vocab, n_positions, max_len;
  float eps;
  float scale_log2;      // headdim ** -0.5 * log2(e)
  int slot_bytes;        // one ring slot: a chunk of whole weight rows
  int ring;              // slots
  int inflight;          // slots the producer lets be in flight at once (ring: no limit)
  int act_bytes;         // the stage's input rows [batch, width] in shared memory
  int red_floats;        // partial dot products [k parts][rows][batch]
  int norm_bytes;        // a norm's weight and bias [2, n_embd]
};

// Byte offsets of the dynamic shared memory regions (the ring first: 1024-byte aligned base).
struct StepSmem {
  size_t ring, act, red, norm, seq, bars, total;
};
__host__ __device__ inline StepSmem step_smem(const Gpt2StepParams& p) {
  StepSmem s{};
  s.ring = 0;
  s.act = s.ring + size_t(p.ring) * p.slot_bytes;
  s.red = s.act + size_t(p.act_bytes);
  s.norm = s.red + size_t(p.red_floats) * 4;
  s.seq = s.norm + size_t(p.norm_bytes);
  s.bars = s.seq + size_t(kStepMaxBatch) * 4 * 4;  // valid, start (leftpad), slot (seqlens) per sequence
  s.total = s.bars + size_t(2 * kStepMaxRing) * 8;
  return s;
}

// BB: the batch rounded up to 1, 2, 4, 8 or 16 (accumulators per thread). `grid` blocks, one per
// SM, launched cooperatively (all resident: the grid barriers need it).
template <typename T, int BB>
cudaError_t launch_gpt2_decode_step(const Gpt2StepParams& p, int grid, cudaStream_t stream);
// Blocks of the kernel for (T, BB) that fit on one SM with `smem` bytes of dynamic shared memory
// (after raising the kernel's limit to it); 0 if the kernel was not compiled for sm_90.
template <typename T, int BB>
int gpt2_decode_step_blocks_per_sm(size_t smem);

}  // namespace fused_attn
