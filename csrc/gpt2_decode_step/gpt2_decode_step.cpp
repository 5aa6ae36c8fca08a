// Launcher of gpt2_decode_step (schema: fused_attn/_ops.py): the checks that guard memory, the tiling of each
// phase over the SMs, and the shared-memory ring's size. Host C++ (g++): the kernel is launched through
// gpt2_decode_step_launch.h. The Python wrapper (fused_attn/gpt2_decode_step.py) checks the same and more
// first, with the same messages.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/ops.h"
#include "gpt2_decode_step_launch.h"

namespace fused_attn {

namespace {

constexpr int kLayerTensors = 12;  // StepLayer's fields, in order

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

at::Tensor gpt2_decode_step(const at::Tensor& token, const at::Tensor& pos, const at::Tensor& seqlens,
                            const at::Tensor& leftpad, const at::Tensor& wte, const at::Tensor& wpe,
                            at::TensorList layers, const at::Tensor& lnf_w, const at::Tensor& lnf_b,
                            at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& workspace, double eps,
                            const std::optional<at::Tensor>& trace) {
  FA_CHECK_CUDA(wte);
  FA_CHECK_ARG(wte.scalar_type() == at::kHalf || wte.scalar_type() == at::kBFloat16, wte,
               "have dtype float16 or bfloat16", dtype_str(wte.scalar_type()));
  FA_CHECK_ARG(wte.dim() == 2 && wte.is_contiguous(), wte, "be a contiguous [vocab, n_embd] tensor",
               shape_str(wte.sizes()));
  const int64_t vocab = wte.size(0), width = wte.size(1);
  FA_CHECK_ARG(width % 256 == 0 && width <= kStepMaxWidth, wte,
               "have n_embd a multiple of 256 up to " + std::to_string(kStepMaxWidth), shape_str(wte.sizes()));
  FA_CHECK_SAME_DEVICE(wpe, wte);
  FA_CHECK_SAME_DTYPE(wpe, wte);
  FA_CHECK_ARG(wpe.dim() == 2 && wpe.size(1) == width && wpe.is_contiguous(), wpe,
               "be a contiguous [n_positions, " + std::to_string(width) + "] tensor", shape_str(wpe.sizes()));
  FA_CHECK_ARG(!layers.empty() && layers.size() % kLayerTensors == 0 &&
                   layers.size() / kLayerTensors <= size_t(kStepMaxLayers),
               layers, "hold 12 tensors a layer for 1 to " + std::to_string(kStepMaxLayers) + " layers",
               std::to_string(layers.size()) + " tensors");
  const int64_t n_layer = int64_t(layers.size()) / kLayerTensors;
  // Each layer's tensors: their shapes, [n_out] or [n_out, n_in].
  const std::vector<std::vector<int64_t>> shapes = {
      {width}, {width}, {3 * width, width}, {3 * width}, {width, width}, {width},
      {width}, {width}, {4 * width, width}, {4 * width}, {width, 4 * width}, {width}};
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor& t = layers[i];
    const auto& want = shapes[i % kLayerTensors];
    FA_CHECK_ARG(t.device() == wte.device() && t.scalar_type() == wte.scalar_type() && t.is_contiguous() &&
                     t.sizes() == at::IntArrayRef(want),
                 layers, "hold contiguous tensors of wte's dtype and device, tensor " + std::to_string(i) +
                             " of shape " + shape_str(want),
                 shape_str(t.sizes()) + " " + dtype_str(t.scalar_type()) + " " + device_str(t.device()));
  }
  for (const at::Tensor* t : {&lnf_w, &lnf_b}) {
    FA_CHECK_ARG(t->device() == wte.device() && t->scalar_type() == wte.scalar_type() && t->is_contiguous() &&
                     t->sizes() == at::IntArrayRef({width}),
                 lnf, "be contiguous [" + std::to_string(width) + "] tensors of wte's dtype and device",
                 shape_str(t->sizes()));
  }
  FA_CHECK_SAME_DEVICE(token, wte);
  FA_CHECK_ARG(token.scalar_type() == at::kLong && token.dim() == 1 && token.is_contiguous(), token,
               "be a contiguous int64 [batch] tensor", shape_str(token.sizes()) + " " + dtype_str(token.scalar_type()));
  const int64_t batch = token.size(0);
  FA_CHECK_ARG(batch >= 1 && batch <= kStepMaxRows, token, "have 1 to " + std::to_string(kStepMaxRows) + " rows",
               shape_str(token.sizes()));
  for (const at::Tensor* t : {&pos, &seqlens, &leftpad}) {
    FA_CHECK_ARG(t->device() == wte.device() && t->scalar_type() == at::kInt && t->dim() == 1 &&
                     t->size(0) == batch && t->stride(0) == 1,
                 lengths, "(pos, seqlens, leftpad) be int32 [" + std::to_string(batch) + "] tensors on wte's device",
                 shape_str(t->sizes()) + " " + dtype_str(t->scalar_type()));
  }
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    FA_CHECK_ARG(t->device() == wte.device() && t->scalar_type() == wte.scalar_type() && t->is_contiguous() &&
                     t->dim() == 5 && t->size(0) == n_layer && t->size(1) == batch &&
                     t->size(2) == width / kStepHeadDim && t->size(4) == kStepHeadDim && t->size(3) >= 1,
                 cache, "(k_cache, v_cache) be contiguous [" + std::to_string(n_layer) + ", " + std::to_string(batch) +
                            ", " + std::to_string(width / kStepHeadDim) + ", max_len, 64] tensors of wte's dtype",
                 shape_str(t->sizes()));
  }
  FA_CHECK_ARG(k_cache.sizes() == v_cache.sizes(), v_cache, "have k_cache's shape " + shape_str(k_cache.sizes()),
               shape_str(v_cache.sizes()));
  const int64_t max_len = k_cache.size(3);
  const int64_t elem = wte.element_size();
  const int64_t need = step_workspace_bytes(batch, width, n_layer);
  FA_CHECK_ARG(workspace.device() == wte.device() && workspace.scalar_type() == at::kByte &&
                   workspace.is_contiguous() && workspace.numel() >= need,
               workspace, "be a contiguous uint8 tensor of at least " + std::to_string(need) + " bytes on wte's device",
               shape_str(workspace.sizes()) + " " + dtype_str(workspace.scalar_type()));

  const c10::cuda::CUDAGuard guard(wte.device());
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(wte.device().index());
  if (trace.has_value()) {
    const at::Tensor& t = *trace;
    FA_CHECK_ARG(t.device() == wte.device() && t.scalar_type() == at::kLong && t.is_contiguous() &&
                     t.numel() >= int64_t(prop->multiProcessorCount) * kStepTraceStride,
                 trace, "be a contiguous int64 tensor of at least SMs x " + std::to_string(kStepTraceStride) +
                            " = " + std::to_string(int64_t(prop->multiProcessorCount) * kStepTraceStride) +
                            " elements on wte's device",
                 shape_str(t.sizes()) + " " + dtype_str(t.scalar_type()));
  }
  FA_CHECK_ARG(prop->major >= 9, wte, "be on an sm_90 device (bulk copies into shared memory)",
               "an earlier architecture");
  const int grid = prop->multiProcessorCount;
  StepParams p{};
  for (int64_t l = 0; l < n_layer; ++l) {
    const at::Tensor* t = &layers[l * kLayerTensors];
    p.layers[l] = StepLayer{t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(),  t[3].data_ptr(),
                            t[4].data_ptr(), t[5].data_ptr(), t[6].data_ptr(),  t[7].data_ptr(),
                            t[8].data_ptr(), t[9].data_ptr(), t[10].data_ptr(), t[11].data_ptr()};
  }
  p.lnf_w = lnf_w.data_ptr();
  p.lnf_b = lnf_b.data_ptr();
  p.wte = wte.data_ptr();
  p.wpe = wpe.data_ptr();
  p.token = token.data_ptr<int64_t>();
  p.pos = pos.data_ptr<int>();
  p.seqlens = seqlens.data_ptr<int>();
  p.leftpad = leftpad.data_ptr<int>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  at::Tensor logits = at::empty({batch, vocab}, wte.options());
  p.logits = logits.data_ptr();
  p.header = static_cast<unsigned*>(workspace.data_ptr());
  p.lines = reinterpret_cast<uint4*>(static_cast<unsigned char*>(workspace.data_ptr()) + 256);
  p.trace = trace.has_value() ? reinterpret_cast<long long*>(trace->data_ptr<int64_t>()) : nullptr;
  p.batch = int(batch);
  p.n_layer = int(n_layer);
  p.width = int(width);
  p.n_head = int(width / kStepHeadDim);
  p.max_len = int(max_len);
  p.vocab = int(vocab);
  p.n_positions = int(wpe.size(0));
  p.eps = float(eps);
  p.scale = 0.125f;  // head_dim ** -0.5
  // The attention: every (sequence, head)'s keys split over as many blocks as there are, one item a block.
  // Splits: 128 keys a block where there are blocks enough (a split's keys are 4 loads a thread in flight),
  // up to kStepMaxSplits; at most one item a block.
  p.att_splits = int(std::max<int64_t>(1, std::min<int64_t>({ceil_div(max_len, 128), kStepMaxSplits,
                                                              grid / (batch * p.n_head)})));
  FA_CHECK_ARG(batch * p.n_head <= grid, token,
               "leave one (sequence, head) a block: batch x n_head at most the " + std::to_string(grid) + " SMs",
               std::to_string(batch) + " x " + std::to_string(p.n_head));
  // One tile a block in each phase: ceil(rows / SMs) weight rows a tile.
  const int64_t n_rows[4] = {3 * width, width, 4 * width, width};
  const int64_t k_cols[4] = {width, width, width, 4 * width};
  int64_t slot_bytes = 0;
  for (int ph = 0; ph < 4; ++ph) {
    p.tile_rows[ph] = int(ceil_div(n_rows[ph], 2 * grid) * 2);  // even: an epilogue task writes two rows
    p.tiles[ph] = int(ceil_div(n_rows[ph], p.tile_rows[ph]));
    slot_bytes = std::max(slot_bytes, p.tile_rows[ph] * k_cols[ph] * elem);
  }
  p.slot_bytes = int(ceil_div(slot_bytes, 128) * 128);
  p.chunk_rows = int(p.slot_bytes / (width * elem));
  p.vocab_rows = int(ceil_div(vocab, grid));
  FA_CHECK_ARG(p.tile_rows[2] <= kStepMaxTileRows, wte,
               "leave a tile of at most " + std::to_string(kStepMaxTileRows) + " weight rows a block (4 n_embd / SMs)",
               std::to_string(p.tile_rows[2]) + " on " + std::to_string(grid) + " SMs");
  p.act_bytes = step_act_bytes(int(batch), int(width), int(elem));
  const int64_t fixed = p.act_bytes + kStepSmemExtra;
  p.slots = int(std::min<int64_t>(kStepMaxSlots, (int64_t(prop->sharedMemPerBlockOptin) - fixed) / p.slot_bytes));
  FA_CHECK_ARG(p.slots >= 2, k_cache,
               "leave room for two weight slots in shared memory (max_len and batch set the rest)",
               "max_len " + std::to_string(max_len));
  p.smem_bytes = int(p.slots * p.slot_bytes + fixed);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = wte.scalar_type() == at::kHalf ? launch_gpt2_decode_step<__half>(p, grid, stream)
                                                         : launch_gpt2_decode_step<__nv_bfloat16>(p, grid, stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return logits;
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) { m.impl("gpt2_decode_step", &gpt2_decode_step); }

}  // namespace fused_attn
