// Parameters and launch declarations of gpt2_decode_step (csrc/gpt2_decode_step/gpt2_decode_step_kernel.cuh),
// torch-free: the launcher (gpt2_decode_step.cpp, g++) fills StepParams, the instantiation unit (nvcc) holds
// the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector_types.h>

namespace fused_attn {

constexpr int kStepMaxLayers = 48;   // GPT-2 XL's depth: the layer table is a kernel parameter (4.6 KB)
constexpr int kStepMaxRows = 4;      // sequences a launch: dot products on CUDA cores, weights read once
constexpr int kStepMaxWidth = 1024;  // n_embd: a row of the residual stream in registers (4 a thread)
constexpr int kStepHeadDim = 64;
constexpr int kStepConsumers = 256;  // threads that compute; one more warp issues the weight copies
constexpr int kStepThreads = kStepConsumers + 32;
constexpr int kStepMaxSlots = 5;     // weight slots of the shared-memory ring (a slot holds one block's tile)
// The attention's work items, (sequence, head, split of its keys), one a block; a split's partials are o[64],
// m, l: 66 floats, 33 lines of the workspace (below).
constexpr int kStepMaxSplits = 4;     // splits of a (sequence, head)'s keys: 256 keys a block at GPT-2's 1024
constexpr int kStepPartLines = 33;
constexpr int kStepTraceStride = 2048;  // int64 stamps a block in the optional trace (1 + 30 a layer + 6 used)
constexpr int kStepMaxTileRows = 64;  // weight rows of a block's tile (its bias staged in shared memory)
// Shared memory beside the ring and the activations: the ring's mbarriers, the reductions' 2 x 4 x 8 floats,
// the new slots, a tile's bias and dot products.
constexpr int kStepSmemExtra = 2 * kStepMaxSlots * 8 + 64 * 4 + kStepMaxRows * 4 + kStepMaxTileRows * 4 +
                               kStepMaxRows * kStepMaxTileRows * 4 + 16;  // + the epoch

// The workspace: a 256-byte header (the launch's epoch at word 0, the finished blocks at word 32), then per
// layer its hand-offs between blocks as flagged lines (16 bytes: data word, flag, data word, flag; a data word
// holds two 16-bit values or one float), in lines: c_attn's q, k, v [batch, 3 C], the attention's split
// partials [batch, heads, kStepMaxSplits, 33], the residual stream after the attention [batch, C], the MLP's
// hidden [batch, 4 C] and the residual stream after the MLP [batch, C]. A block reads another's output by
// loading its lines until both flags are the launch's epoch: one memory round trip, no counter, no fence.
#if defined(__CUDACC__)
#define FA_STEP_HD __host__ __device__
#else
#define FA_STEP_HD
#endif
FA_STEP_HD inline int64_t step_layer_lines(int64_t batch, int64_t width) {
  return 9 * batch * width / 4 + batch * (width / kStepHeadDim) * kStepMaxSplits * kStepPartLines;
}
inline int64_t step_workspace_bytes(int64_t batch, int64_t width, int64_t n_layer) {
  return 256 + n_layer * step_layer_lines(batch, width) * 16;
}

// One layer's tensors, each contiguous: weights [n_out, n_in] (nn.Linear's layout), biases and norms [n_out].
struct StepLayer {
  const void* ln1_w;
  const void* ln1_b;
  const void* w_qkv;  // [3 C, C]
  const void* b_qkv;
  const void* w_o;    // [C, C]
  const void* b_o;
  const void* ln2_w;
  const void* ln2_b;
  const void* w_fc;   // [4 C, C]
  const void* b_fc;
  const void* w_p;    // [C, 4 C]
  const void* b_p;
};

struct StepParams {
  StepLayer layers[kStepMaxLayers];
  const void* lnf_w;
  const void* lnf_b;
  const void* wte;             // [vocab, C]: the token embedding and the (tied) lm_head
  const void* wpe;             // [n_positions, C]
  const int64_t* token;        // [batch]: the last token of each sequence
  const int* pos;              // [batch]: its position id
  const int* seqlens;          // [batch]: the cache slot its key and value go to (valid slots before it)
  const int* leftpad;          // [batch]: the first valid slot
  void* k_cache;               // [n_layer, batch, n_head, max_len, 64], contiguous
  void* v_cache;
  void* logits;                // [batch, vocab]
  // The workspace (step_workspace_bytes; the caller's, zeros before its first launch, one launch at a time).
  unsigned* header;
  uint4* lines;
  long long* trace;            // [grid, kStepTraceStride] %globaltimer stamps, or nullptr (the kernel's stamp())
  int att_splits;              // splits of each (sequence, head)'s keys: items = batch x n_head x att_splits
  int batch, n_layer, width, n_head, max_len, vocab, n_positions;
  float eps, scale;
  // Tiles: phase p (0 c_attn, 1 attention's c_proj, 2 c_fc, 3 the MLP's c_proj) has tiles[p] tiles of
  // tile_rows[p] weight rows, block t owning tile t; vocab_rows rows of the lm_head a block, in chunks of
  // chunk_rows; slots, slot_bytes: the weight ring.
  int tiles[4], tile_rows[4];
  int vocab_rows, chunk_rows;
  int slots, slot_bytes, act_bytes, smem_bytes;
};

// The shared memory a launch needs beyond the weight ring: the activations [batch, 4 C], or the attention's
// per-warp partials.
inline int step_act_bytes(int batch, int width, int elem_bytes) {
  const int act = batch * 4 * width * elem_bytes;
  // the attention's per-warp partials, (m, l) a warp and its q, k, v (48 lines of 4 values)
  const int attn = (kStepConsumers / 32) * kStepHeadDim * 4 + 2 * (kStepConsumers / 32) * 4 + 48 * 8;
  return ((act > attn ? act : attn) + 127) / 128 * 128;
}

template <typename T>
cudaError_t launch_gpt2_decode_step(const StepParams& p, int grid, cudaStream_t stream);

}  // namespace fused_attn
