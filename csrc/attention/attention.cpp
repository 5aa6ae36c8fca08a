// Launcher of attention (schema: fused_attn/_ops.py): the checks that guard memory, the mode
// choice (auto: flash for float16 / bfloat16 when its kernel was built for this device, else
// naive; flash: the wgmma kernel where it was built for this device, else the mma.sync one;
// flash_mma / flash_wgmma pin one of the two), dtype / head-dim dispatch of the flash kernels
// (and the wgmma one's head dim 64 tile and block order: attention_heuristics.h), and the naive and
// tiled modes' three steps (GEMM, scaled_masked_softmax through the dispatcher, GEMM). Host C++ (g++): the
// kernels are launched through attention_launch.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "attention_heuristics.h"
#include "attention_launch.h"

namespace fused_attn {

namespace {

constexpr int64_t kMaxHeaddim = 256;

#define FA_CHECK_ROWS_ALIGNED(t)                                                                        \
  FA_CHECK_ARG(rows_aligned(t), t,                                                                      \
               "have a contiguous last dim and 16-byte aligned rows (other strides multiples of " +     \
                   std::to_string(16 / (t).element_size()) + ") for mode='flash'",                      \
               "strides " + shape_str((t).strides()))

bool is_flash_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

int flash_arch(at::ScalarType dtype, int64_t headdim) {
  if (!is_flash_dtype(dtype) || headdim % 8 != 0 || headdim > kMaxHeaddim) return 0;
  int arch = 0;
  FA_DISPATCH_FLOAT(dtype, q, [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      FA_DECODE_HEADDIM_SWITCH(headdim, HD, [&] { arch = attention_flash_arch<scalar_t, HD>(); });
    }
  });
  return arch;
}

// 90 where the Hopper (wgmma) version of the flash kernel runs on the current device for this
// dtype and head dim (padded to 64 or 128), else 0.
int flash_wgmma_arch(at::ScalarType dtype, int64_t headdim) {
  if (!is_flash_dtype(dtype) || headdim % 8 != 0 || headdim <= 32 || headdim > 128) return 0;
  int arch = 0;
  FA_DISPATCH_FLOAT(dtype, q, [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      FA_DECODE_HEADDIM_SWITCH(headdim, HD, [&] {
        if constexpr (HD == 64 || HD == 128) arch = attention_flash_wgmma_arch<scalar_t, HD>();
      });
    }
  });
  return arch;
}

bool is_flash(const std::string& mode) { return mode == "flash" || mode == "flash_mma" || mode == "flash_wgmma"; }

// The kernel `mode` runs on q: "flash_wgmma", "flash_mma", "tiled" or "naive".
std::string resolve_mode(const std::string& mode, const at::Tensor& q) {
  FA_CHECK_ARG(mode == "auto" || mode == "naive" || mode == "tiled" || is_flash(mode), mode,
               "be 'auto', 'naive', 'tiled', 'flash', 'flash_mma' or 'flash_wgmma'", "'" + mode + "'");
  if (mode == "auto" && flash_arch(q.scalar_type(), q.size(3)) < 80) return "naive";
  if (mode == "auto" || mode == "flash") {
    return flash_wgmma_arch(q.scalar_type(), q.size(3)) == 90 ? "flash_wgmma" : "flash_mma";
  }
  return mode;
}

// The locals are named after the arguments: the check macros stringify them into the message.
double check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& attn_mask_opt, std::optional<double> scale,
                  const std::string& mode) {
  FA_CHECK_CUDA(q);
  FA_CHECK_ARG(q.scalar_type() == at::kFloat || is_flash_dtype(q.scalar_type()), q,
               "have dtype float32, float16 or bfloat16", dtype_str(q.scalar_type()));
  FA_CHECK_DIM(q, 4, "[batch, nheads_q, seqlen_q, headdim]");
  FA_CHECK_DIM(k, 4, "[batch, nheads_kv, seqlen_k, headdim]");
  FA_CHECK_DIM(v, 4, "[batch, nheads_kv, seqlen_k, headdim]");
  for (const at::Tensor* t : {&k, &v}) {
    const at::Tensor& kv = *t;
    FA_CHECK_CUDA(kv);
    FA_CHECK_SAME_DEVICE(kv, q);
    FA_CHECK_SAME_DTYPE(kv, q);
  }
  FA_CHECK_ARG(v.sizes() == k.sizes(), v, "have k's shape " + shape_str(k.sizes()), shape_str(v.sizes()));
  FA_CHECK_ARG(k.size(0) == q.size(0), k, "have q's batch size (" + std::to_string(q.size(0)) + ")",
               shape_str(k.sizes()));
  FA_CHECK_ARG(k.size(3) == q.size(3), k, "have q's headdim (" + std::to_string(q.size(3)) + ")",
               shape_str(k.sizes()));
  const int64_t nheads_kv = k.size(1);
  FA_CHECK_ARG(nheads_kv > 0 && q.size(1) % nheads_kv == 0, q,
               "have nheads_q a multiple of k's nheads_kv (" + std::to_string(nheads_kv) + ")",
               std::to_string(q.size(1)));
  FA_CHECK_ARG(q.size(2) < (1 << 30) && k.size(2) < (1 << 30) && q.size(0) * q.size(1) < 65536 &&
                   q.size(1) < 65536,
               q, "have seqlens below 2**30 and batch x nheads_q below 65536", shape_str(q.sizes()));
  const std::vector<int64_t> full{q.size(0), q.size(1), q.size(2), k.size(2)};
  if (attn_mask_opt.has_value()) {
    const at::Tensor& attn_mask = *attn_mask_opt;
    FA_CHECK_CUDA(attn_mask);
    FA_CHECK_SAME_DEVICE(attn_mask, q);
    FA_CHECK_ARG(attn_mask.scalar_type() == at::kBool || attn_mask.scalar_type() == q.scalar_type(), attn_mask,
                 "have dtype bool or q's dtype (" + dtype_str(q.scalar_type()) + ")",
                 dtype_str(attn_mask.scalar_type()));
    bool ok = attn_mask.dim() <= 4;
    for (int64_t d = 1; ok && d <= attn_mask.dim(); ++d) {
      const int64_t m = attn_mask.size(-d);
      ok = m == 1 || m == full[4 - d];
    }
    FA_CHECK_ARG(ok, attn_mask, "be broadcastable to " + shape_str(full), shape_str(attn_mask.sizes()));
  }
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(double(q.size(3)));
  FA_CHECK_ARG(std::isfinite(s), scale, "be a finite number", num_str(s));
  if (is_flash(resolve_mode(mode, q))) {
    FA_CHECK_ARG(is_flash_dtype(q.scalar_type()), q, "have dtype float16 or bfloat16 for mode='flash'",
                 dtype_str(q.scalar_type()));
    const int64_t headdim = q.size(3);
    FA_CHECK_ARG(headdim % 8 == 0 && headdim >= 8 && headdim <= kMaxHeaddim, q,
                 "have a headdim that is a multiple of 8 in [8, 256] for mode='flash'", std::to_string(headdim));
    FA_CHECK_ARG(flash_arch(q.scalar_type(), headdim) >= 80, q,
                 "be on a device the flash kernel was built for (sm_80 or later) for mode='flash'",
                 device_str(q.device()));
    if (mode == "flash_wgmma") {
      FA_CHECK_ARG(headdim > 32 && headdim <= 128, q,
                   "have a headdim that is a multiple of 8 in [40, 128] for mode='flash_wgmma'",
                   std::to_string(headdim));
      FA_CHECK_ARG(flash_wgmma_arch(q.scalar_type(), headdim) == 90, q,
                   "be on an sm_90 device with the library built for sm_90a (TORCH_CUDA_ARCH_LIST=9.0a) for "
                   "mode='flash_wgmma'",
                   device_str(q.device()));
    }
    FA_CHECK_ROWS_ALIGNED(q);
    FA_CHECK_ROWS_ALIGNED(k);
    FA_CHECK_ROWS_ALIGNED(v);
  }
  return s;
}

void check_out(const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse, const std::string& mode) {
  FA_CHECK_CUDA(out);
  FA_CHECK_SAME_DEVICE(out, q);
  FA_CHECK_SAME_DTYPE(out, q);
  FA_CHECK_ARG(out.sizes() == q.sizes(), out, "have q's shape " + shape_str(q.sizes()), shape_str(out.sizes()));
  if (is_flash(resolve_mode(mode, q))) FA_CHECK_ROWS_ALIGNED(out);
  if (lse.numel() > 0) {
    FA_CHECK_CUDA(lse);
    FA_CHECK_SAME_DEVICE(lse, q);
    FA_CHECK_ARG(lse.scalar_type() == at::kFloat, lse, "have dtype torch.float32", dtype_str(lse.scalar_type()));
    const std::vector<int64_t> rows{q.size(0), q.size(1), q.size(2)};
    FA_CHECK_ARG(lse.sizes() == at::IntArrayRef(rows), lse, "have shape " + shape_str(rows), shape_str(lse.sizes()));
    FA_CHECK_CONTIGUOUS(lse);
  }
}

// The SMs of the current device (ATen queries each device's properties once).
int64_t sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// wgmma: the Hopper version (resolve_mode chose it only where it runs, at head dims <= 128).
void launch_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& attn_mask, double scale, bool causal, bool wgmma,
                  const at::Tensor& out, const at::Tensor& lse) {
  AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.numel() > 0 ? lse.data_ptr<float>() : nullptr;
  p.q_stride_b = q.stride(0), p.q_stride_h = q.stride(1), p.q_stride_s = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_h = k.stride(1), p.k_stride_s = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_h = v.stride(1), p.v_stride_s = v.stride(2);
  p.o_stride_b = out.stride(0), p.o_stride_h = out.stride(1), p.o_stride_s = out.stride(2);
  p.batch = int(q.size(0)), p.nheads_q = int(q.size(1)), p.nheads_kv = int(k.size(1));
  p.seqlen_q = int(q.size(2)), p.seqlen_k = int(k.size(2)), p.headdim = int(q.size(3));
  p.group = p.nheads_q / p.nheads_kv;
  p.causal = causal;
  p.scale = float(scale);
  p.scale_log2 = float(scale * 1.4426950408889634);
  at::Tensor mask;  // the broadcast view (stride 0 along broadcast dims): no copy
  if (attn_mask.has_value()) {
    mask = attn_mask->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
    p.mask = mask.data_ptr();
    p.mask_is_bool = mask.scalar_type() == at::kBool;
    p.m_stride_b = mask.stride(0), p.m_stride_h = mask.stride(1);
    p.m_stride_q = mask.stride(2), p.m_stride_k = mask.stride(3);
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The Hopper kernel's tile and block order (attention_heuristics.h), from the shape and the device's SMs.
  int d64_tile = 2;
  if (wgmma) {
    const int64_t sms = sm_count();
    const int64_t heads = int64_t(p.nheads_q) * p.batch;
    d64_tile = flash_d64_tile(causal, (int64_t(p.seqlen_q) + 127) / 128 * heads, sms);
    const int64_t br = flash_block_rows(p.headdim, d64_tile);
    p.longest_first =
        flash_longest_first(causal, (int64_t(p.seqlen_q) + br - 1) / br * heads, flash_blocks_per_sm(p.headdim), sms);
  }
  FA_DISPATCH_FLOAT(q.scalar_type(), q, [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      FA_DECODE_HEADDIM_SWITCH(p.headdim, HD, [&] {
        if constexpr (HD == 64) {
          if (wgmma) {
            if (d64_tile == 1) launch_attention_flash_wgmma<scalar_t, 64, 1>(p, stream);
            else launch_attention_flash_wgmma<scalar_t, 64, 2>(p, stream);
            return;
          }
        }
        if constexpr (HD == 128) {
          if (wgmma) {
            launch_attention_flash_wgmma<scalar_t, 128, 0>(p, stream);
            return;
          }
        }
        launch_attention_flash<scalar_t, HD>(p, stream);
      });
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

GemmParams gemm_params(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool b_transposed, int group) {
  GemmParams g{};
  g.a = a.data_ptr(), g.b = b.data_ptr(), g.c = c.data_ptr();
  g.a_stride_b = a.stride(0), g.a_stride_h = a.stride(1), g.a_stride_r = a.stride(2), g.a_stride_c = a.stride(3);
  g.b_stride_b = b.stride(0), g.b_stride_h = b.stride(1);
  // B as [k][n]: Kᵀ reads K [n][k] with the two strides swapped
  g.b_stride_r = b_transposed ? b.stride(3) : b.stride(2);
  g.b_stride_c = b_transposed ? b.stride(2) : b.stride(3);
  g.c_stride_b = c.stride(0), g.c_stride_h = c.stride(1), g.c_stride_r = c.stride(2), g.c_stride_c = c.stride(3);
  g.batch = int(c.size(0)), g.nheads = int(c.size(1)), g.group = group;
  g.m = int(c.size(2)), g.n = int(c.size(3)), g.k = int(a.size(3));
  return g;
}

// The teaching baselines: float32 scores S = Q·Kᵀ (our GEMM), P = scaled_masked_softmax(S) (the
// project's softmax op: scale, causal and the mask happen there), out = P·V (our GEMM); `tiled`
// picks the register-blocked GEMM over the 16 x 16 tile one.
void launch_unfused(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& attn_mask, double scale, bool causal, bool tiled,
                    const at::Tensor& out, const at::Tensor& lse) {
  const int group = int(q.size(1) / k.size(1));
  at::Tensor s = at::empty({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options().dtype(at::kFloat));
  std::optional<at::Tensor> mask_f;
  if (attn_mask.has_value()) {
    mask_f = attn_mask->scalar_type() == at::kBool ? *attn_mask : attn_mask->to(at::kFloat);
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(q.scalar_type(), q, [&] {
    launch_attention_gemm<scalar_t, scalar_t, float>(gemm_params(q, k, s, true, group), tiled, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The softmax's CUDA implementation itself, not a dispatcher call (no autograd hop).
  const at::Tensor pr = scaled_masked_softmax(s, scale, mask_f, causal, 1);
  FA_DISPATCH_FLOAT(q.scalar_type(), q, [&] {
    launch_attention_gemm<float, scalar_t, scalar_t>(gemm_params(pr, v, out, false, group), tiled, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (lse.numel() > 0) {  // logsumexp of the scores the softmax saw (a baseline: plain ATen)
    at::Tensor sc = s.mul(scale);
    if (mask_f.has_value()) {
      if (mask_f->scalar_type() == at::kBool) sc.masked_fill_(mask_f->logical_not(), -INFINITY);
      else sc.add_(*mask_f);
    }
    if (causal) {
      const auto opts = q.options().dtype(at::kLong);
      const at::Tensor i = at::arange(q.size(2), opts).unsqueeze(1);
      const at::Tensor j = at::arange(k.size(2), opts).unsqueeze(0);
      sc.masked_fill_(j > i + (k.size(2) - q.size(2)), -INFINITY);
    }
    lse.copy_(at::logsumexp(sc, {-1}));
  }
}

void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
         double scale, bool causal, const std::string& mode, const at::Tensor& out, const at::Tensor& lse) {
  if (out.numel() == 0 && lse.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const std::string m = resolve_mode(mode, q);
  if (is_flash(m)) {
    launch_flash(q, k, v, attn_mask, scale, causal, m == "flash_wgmma", out, lse);
  } else {
    launch_unfused(q, k, v, attn_mask, scale, causal, m == "tiled", out, lse);
  }
}

}  // namespace

// Argument order follows the schemas in fused_attn/_ops.py.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const std::optional<at::Tensor>& attn_mask, std::optional<double> scale,
                                             bool causal, c10::string_view mode, bool return_lse) {
  const std::string m(mode);
  const double s = check_args(q, k, v, attn_mask, scale, m);
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = return_lse ? at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  run(q, k, v, attn_mask, s, causal, m, out, lse);
  return {out, lse};
}

void attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool causal,
                   c10::string_view mode, const at::Tensor& out, const at::Tensor& lse) {
  const std::string m(mode);
  const double s = check_args(q, k, v, attn_mask, scale, m);
  check_out(q, out, lse, m);
  run(q, k, v, attn_mask, s, causal, m, out, lse);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_out", &attention_out);
}

}  // namespace fused_attn
