// Launcher of gpt2_decode_step (schema: fused_attn/_ops.py): the checks that guard memory, the
// shared-memory plan (ring slot size and depth for the batch, width and dtype) and the cooperative
// launch of one block per SM. Host C++ (g++); the kernel is in gpt2_decode_step_kernel.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../common/checks.h"
#include "../common/static_switch.h"
#include "gpt2_decode_step_launch.h"

namespace fused_attn {

namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The locals are named after the arguments: the check macros stringify them into the message. The
// order and the messages are fused_attn/gpt2_decode_step.py's check_args (tests pin both); then what
// only the kernel needs (n_embd <= kStepMaxWidth; float tensors and the workspace 16-byte aligned for
// TMA and 16-byte loads: the integer [batch] tensors may be views at any offset).
#define FA_STEP_FOR_EACH_TENSOR(X)                                                                       \
  X(token) X(pos) X(seqlens) X(leftpad) X(k_cache) X(v_cache) X(wte) X(wpe) X(norms) X(w_qkv) X(b_qkv) \
  X(w_o) X(b_o) X(w_fc) X(b_fc) X(w_proj) X(b_proj) X(workspace)
#define FA_STEP_FOR_EACH_FLOAT(X) \
  X(k_cache) X(v_cache) X(wpe) X(norms) X(w_qkv) X(b_qkv) X(w_o) X(b_o) X(w_fc) X(b_fc) X(w_proj) X(b_proj)
void check_args(const at::Tensor& token, const at::Tensor& pos, const at::Tensor& seqlens, const at::Tensor& leftpad,
                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& wte, const at::Tensor& wpe,
                const at::Tensor& norms, const at::Tensor& w_qkv, const at::Tensor& b_qkv, const at::Tensor& w_o,
                const at::Tensor& b_o, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                const at::Tensor& b_proj, const at::Tensor& workspace, double eps) {
  FA_CHECK_ARG(token.dim() == 1, token, "have 1 dim [batch]", shape_str(token.sizes()));
  FA_CHECK_ARG(token.scalar_type() == at::kLong, token, "have dtype torch.int64", dtype_str(token.scalar_type()));
  const int64_t B = token.size(0);
  FA_CHECK_ARG(B >= 1, token, "have at least 1 element (batch)", shape_str(token.sizes()));
#define FA_STEP_SAME_DEVICE(arg) FA_CHECK_SAME_DEVICE(arg, token);
  FA_STEP_FOR_EACH_TENSOR(FA_STEP_SAME_DEVICE)
#undef FA_STEP_SAME_DEVICE
  FA_CHECK_CUDA(token);
#define FA_STEP_LENGTHS(arg)                                                                              \
  FA_CHECK_ARG(arg.scalar_type() == at::kInt, arg, "have dtype torch.int32", dtype_str(arg.scalar_type())); \
  FA_CHECK_SHAPE(arg, (at::IntArrayRef{B}));
  FA_STEP_LENGTHS(pos) FA_STEP_LENGTHS(seqlens) FA_STEP_LENGTHS(leftpad)
#undef FA_STEP_LENGTHS
  FA_CHECK_ARG(wte.scalar_type() == at::kFloat || wte.scalar_type() == at::kHalf ||
                   wte.scalar_type() == at::kBFloat16,
               wte, "have dtype float32, float16 or bfloat16", dtype_str(wte.scalar_type()));
#define FA_STEP_SAME_DTYPE(arg) FA_CHECK_SAME_DTYPE(arg, wte);
  FA_STEP_FOR_EACH_FLOAT(FA_STEP_SAME_DTYPE)
#undef FA_STEP_SAME_DTYPE
  FA_CHECK_DIM(k_cache, 5, "[n_layer, batch, nheads, max_len, headdim]");
  const int64_t L = k_cache.size(0), H = k_cache.size(2);
  FA_CHECK_ARG(k_cache.size(4) == kStepHeadDim, k_cache, "have headdim (last dim) 64", shape_str(k_cache.sizes()));
  FA_CHECK_ARG(k_cache.size(1) == B, k_cache, "have token's batch size (" + std::to_string(B) + ") in dim 1",
               shape_str(k_cache.sizes()));
  FA_CHECK_SHAPE(v_cache, k_cache.sizes());
  const int64_t C = H * kStepHeadDim;
  FA_CHECK_DIM(wte, 2, "[vocab, n_embd]");
  FA_CHECK_SHAPE(wte, (at::IntArrayRef{wte.size(0), C}));
  FA_CHECK_DIM(wpe, 2, "[n_positions, n_embd]");
  FA_CHECK_SHAPE(wpe, (at::IntArrayRef{wpe.size(0), C}));
  FA_CHECK_DIM(w_fc, 3, "[n_layer, n_inner, n_embd]");
  const int64_t I = w_fc.size(1);
  FA_CHECK_ARG(I % 8 == 0, w_fc, "have n_inner (dim 1) a multiple of 8", shape_str(w_fc.sizes()));
  FA_CHECK_SHAPE(norms, (at::IntArrayRef{2 * L + 1, 2, C}));
  FA_CHECK_SHAPE(w_qkv, (at::IntArrayRef{L, 3 * C, C}));
  FA_CHECK_SHAPE(b_qkv, (at::IntArrayRef{L, 3 * C}));
  FA_CHECK_SHAPE(w_o, (at::IntArrayRef{L, C, C}));
  FA_CHECK_SHAPE(b_o, (at::IntArrayRef{L, C}));
  FA_CHECK_SHAPE(w_fc, (at::IntArrayRef{L, I, C}));
  FA_CHECK_SHAPE(b_fc, (at::IntArrayRef{L, I}));
  FA_CHECK_SHAPE(w_proj, (at::IntArrayRef{L, C, I}));
  FA_CHECK_SHAPE(b_proj, (at::IntArrayRef{L, C}));
#define FA_STEP_CONTIGUOUS(arg) FA_CHECK_CONTIGUOUS(arg);
  FA_STEP_FOR_EACH_TENSOR(FA_STEP_CONTIGUOUS)
#undef FA_STEP_CONTIGUOUS
  FA_CHECK_ARG(workspace.scalar_type() == at::kByte, workspace, "have dtype torch.uint8",
               dtype_str(workspace.scalar_type()));
  FA_CHECK_ARG(workspace.dim() == 1, workspace, "have 1 dim [bytes]", shape_str(workspace.sizes()));
  const int64_t need = round_up(kStepWorkspaceHeader + B * (3 * C + I) * int64_t(wte.element_size()), 16);
  FA_CHECK_ARG(workspace.numel() >= need, workspace,
               "have at least " + std::to_string(need) + " bytes (workspace_bytes(batch=" + std::to_string(B) +
                   ", n_embd=" + std::to_string(C) + ", n_inner=" + std::to_string(I) +
                   ", dtype=" + dtype_str(wte.scalar_type()) + "))",
               std::to_string(workspace.numel()));
  FA_CHECK_ARG(std::isfinite(eps) && eps >= 0, eps, "be a finite number >= 0", num_str(eps));
  // The kernel's own limits.
  FA_CHECK_ARG(L >= 1 && k_cache.size(3) >= 1 && wte.size(0) >= 1 && wpe.size(0) >= 1 && I >= 8, k_cache,
               "have n_layer, max_len >= 1 (and the model a vocab, positions and n_inner >= 8)",
               shape_str(k_cache.sizes()));
  FA_CHECK_ARG(C <= kStepMaxWidth, k_cache,
               "have nheads * 64 (n_embd) at most " + std::to_string(kStepMaxWidth) + " for the CUDA kernel",
               shape_str(k_cache.sizes()));
#define FA_STEP_ALIGNED(arg)                                                                            \
  FA_CHECK_ARG(aligned16(arg), arg, "start 16-byte aligned",                                           \
               "a data pointer offset by " + std::to_string(reinterpret_cast<uintptr_t>(arg.data_ptr()) % 16) + \
                   " bytes");
  FA_STEP_ALIGNED(wte)
  FA_STEP_FOR_EACH_FLOAT(FA_STEP_ALIGNED)
  FA_STEP_ALIGNED(workspace)
#undef FA_STEP_ALIGNED
}
#undef FA_STEP_FOR_EACH_FLOAT
#undef FA_STEP_FOR_EACH_TENSOR

// Shared memory for `batch` sequences. By default a ring slot holds a block's slice of the widest
// layer weight (one chunk per stage: a chunk costs the consumers a wait, a barrier and an epilogue,
// ~1 us at batch 1), as many slots as fit up to kStepMaxRing, all allowed in flight; the slot is halved
// (down to one row of the widest weight) until 3 fit. FUSED_ATTN_STEP_STREAM="slot_kb,inflight_kb"
// sets the slot and the bytes in flight instead (bench/NOTES.md, session 8: smaller slots and fewer
// bytes in flight measured slower, 0.55 -> 0.62-0.76 ms at batch 1). Ring 0: the batch does not fit.
void plan(Gpt2StepParams& p, int64_t batch, int64_t elem, int64_t blocks, int64_t budget) {
  const int64_t C = p.n_embd, I = p.n_inner;
  auto slice = [&](int64_t rows, int64_t k) { return (rows + blocks - 1) / blocks * k * elem; };
  const int64_t min_slot = round_up(std::max(C, I) * elem, 128);
  int64_t slot = round_up(std::max({slice(3 * C, C), slice(C, C), slice(I, C), slice(C, I)}), 128);
  int64_t inflight = 0;  // bytes; 0: the whole ring
  bool fixed_slot = false;
  if (const char* env = std::getenv("FUSED_ATTN_STEP_STREAM")) {
    long a = 0, b = 0;
    if (std::sscanf(env, "%ld,%ld", &a, &b) == 2 && a > 0 && b > 0) {
      slot = std::max(min_slot, round_up(int64_t(a) * 1024, 128));
      inflight = int64_t(b) * 1024;
      fixed_slot = true;
    }
  }
  p.act_bytes = int(round_up(batch * std::max(C, I) * elem, 128));
  p.norm_bytes = int(round_up(2 * C * elem, 128));
  for (;;) {
    const int64_t rmax = slot / (C * elem);  // the most rows a chunk has (at the narrowest K)
    p.slot_bytes = int(slot);
    // Two halves of (k parts x rows x batch) partial sums; the attention's scratch fits too.
    p.red_floats = int(2 * round_up(std::max<int64_t>(640, (rmax + 2 * kStepConsumerWarps) * batch), 32));
    p.ring = 0;
    const int64_t ring = std::min<int64_t>(kStepMaxRing, (budget - int64_t(step_smem(p).total)) / slot);
    if (ring >= 3 || (ring >= 2 && (slot == min_slot || fixed_slot))) {
      p.ring = int(ring);
      p.inflight = inflight > 0 ? int(std::max<int64_t>(1, std::min<int64_t>(ring - 1, inflight / slot))) : int(ring);
      return;
    }
    if (slot == min_slot || fixed_slot) return;
    slot = std::max(min_slot, round_up(slot / 2, 128));
  }
}

// f(std::integral_constant<int, BB>) for the batch's bucket BB (1, 2, 4, 8, 16: the kernel's accumulators
// per thread), the one place a batch becomes a template argument.
template <typename F>
auto with_bucket(int batch, F&& f) {
  if (batch <= 1) return f(std::integral_constant<int, 1>{});
  if (batch <= 2) return f(std::integral_constant<int, 2>{});
  if (batch <= 4) return f(std::integral_constant<int, 4>{});
  if (batch <= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

}  // namespace

// Argument order follows the schema in fused_attn/_ops.py (the only place schemas are defined).
at::Tensor gpt2_decode_step(const at::Tensor& token, const at::Tensor& pos, const at::Tensor& seqlens,
                            const at::Tensor& leftpad, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& wte, const at::Tensor& wpe, const at::Tensor& norms,
                            const at::Tensor& w_qkv, const at::Tensor& b_qkv, const at::Tensor& w_o,
                            const at::Tensor& b_o, const at::Tensor& w_fc, const at::Tensor& b_fc,
                            const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& workspace,
                            double eps) {
  check_args(token, pos, seqlens, leftpad, k_cache, v_cache, wte, wpe, norms, w_qkv, b_qkv, w_o, b_o, w_fc, b_fc,
             w_proj, b_proj, workspace, eps);
  const c10::cuda::CUDAGuard guard(wte.device());
  const int64_t L = k_cache.size(0), B = k_cache.size(1), C = wte.size(1), I = w_fc.size(1);
  FA_CHECK_ARG(B <= kStepMaxBatch, token, "have at most " + std::to_string(kStepMaxBatch) + " elements (batch)",
               std::to_string(B));
  at::Tensor logits = at::empty({B, wte.size(0)}, wte.options());
  const auto* prop = at::cuda::getDeviceProperties(wte.device().index());
  const std::string arch = "sm_" + std::to_string(prop->major) + std::to_string(prop->minor);
  FA_CHECK_ARG(prop->major == 9, wte, "be on an sm_90 (Hopper) GPU for gpt2_decode_step", arch);

  Gpt2StepParams p{};
  p.token = token.data_ptr<int64_t>();
  p.pos = pos.data_ptr<int>();
  p.seqlens = seqlens.data_ptr<int>();
  p.leftpad = leftpad.data_ptr<int>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.wte = wte.data_ptr();
  p.wpe = wpe.data_ptr();
  p.norms = norms.data_ptr();
  p.w_qkv = w_qkv.data_ptr();
  p.b_qkv = b_qkv.data_ptr();
  p.w_o = w_o.data_ptr();
  p.b_o = b_o.data_ptr();
  p.w_fc = w_fc.data_ptr();
  p.b_fc = b_fc.data_ptr();
  p.w_proj = w_proj.data_ptr();
  p.b_proj = b_proj.data_ptr();
  const int64_t elem = wte.element_size();
  auto* ws = static_cast<unsigned char*>(workspace.data_ptr());
  p.barrier = reinterpret_cast<unsigned*>(ws);
  p.x = ws + kStepWorkspaceHeader;
  p.q = ws + kStepWorkspaceHeader + B * C * elem;
  p.a = ws + kStepWorkspaceHeader + 2 * B * C * elem;
  p.f = ws + kStepWorkspaceHeader + 3 * B * C * elem;
  p.logits = logits.data_ptr();
  p.batch = int(B);
  p.n_layer = int(L);
  p.nheads = int(k_cache.size(2));
  p.n_embd = int(C);
  p.n_inner = int(I);
  p.vocab = int(wte.size(0));
  p.n_positions = int(wpe.size(0));
  p.max_len = int(k_cache.size(3));
  p.eps = float(eps);
  p.scale_log2 = float(1.4426950408889634 / 8.0);  // headdim 64: 64 ** -0.5 = 1 / 8

  const int blocks = prop->multiProcessorCount;
  const int64_t budget = int64_t(prop->sharedMemPerBlockOptin);
  plan(p, B, elem, blocks, budget);
  if (p.ring == 0) {
    int64_t fits = 0;  // the largest batch that would fit, for the message
    for (int64_t b = B - 1; b >= 1 && fits == 0; --b) {
      Gpt2StepParams q = p;
      plan(q, b, elem, blocks, budget);
      if (q.ring > 0) fits = b;
    }
    FA_CHECK_ARG(false, token,
                 "have at most " + std::to_string(fits) + " elements (batch) for this model's width and dtype",
                 std::to_string(B));
  }
  const size_t smem = step_smem(p).total;
  cudaError_t err = cudaSuccess;
  FA_DISPATCH_FLOAT(wte.scalar_type(), wte, [&] {
    with_bucket(p.batch, [&](auto bucket) {
      constexpr int BB = decltype(bucket)::value;
      FA_CHECK_ARG((gpt2_decode_step_blocks_per_sm<scalar_t, BB>(smem) >= 1), wte,
                   "be on a GPU the library was compiled for (sm_90 code of gpt2_decode_step)", arch);
      err = launch_gpt2_decode_step<scalar_t, BB>(p, blocks, at::cuda::getCurrentCUDAStream());
    });
  });
  C10_CUDA_CHECK(err);
  return logits;
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) { m.impl("gpt2_decode_step", &gpt2_decode_step); }

}  // namespace fused_attn
