// Launcher of mlp (schema: fused_attn/_ops.py): y = act(x · W_fcᵀ + b_fc) · W_projᵀ + b_proj + residual,
// as the two launches of fused_attn.linear (the first with the activation, the second with the residual)
// from one dispatcher call: what fused_attn.mlp runs. The checks are here; fused_attn/mlp.py repeats them
// with the same messages for the CPU and meta paths. Host C++ (g++).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../linear/linear_launch.h"

namespace fused_attn {

namespace {

// A projection's weight: [out, in] with in = `in` (named `in_name`), on x's device in x's dtype.
#define FA_CHECK_MLP_WEIGHT(w, in, in_name)                                                                      \
  FA_CHECK_DIM(w, 2, "[out_features, in_features]");                                                          \
  FA_CHECK_SAME_DEVICE(w, x);                                                                                 \
  FA_CHECK_SAME_DTYPE(w, x);                                                                                  \
  FA_CHECK_LAST_DIM_CONTIGUOUS(w);                                                                            \
  FA_CHECK_ARG((w).size(1) == (in), w, "have in_features = " in_name " (" + std::to_string(in) + ")",         \
               shape_str((w).sizes()));                                                                       \
  FA_CHECK_ARG((w).size(0) < std::numeric_limits<int>::max() && (w).size(1) < std::numeric_limits<int>::max(), \
               w, "have fewer than 2**31 rows and columns", shape_str((w).sizes()))
// A bias: [n] on x's device in x's dtype.
#define FA_CHECK_MLP_BIAS(b, n)                                                                    \
  FA_CHECK_SAME_DEVICE(b, x);                                                                      \
  FA_CHECK_SAME_DTYPE(b, x);                                                                       \
  FA_CHECK_ARG((b).dim() == 1 && (b).size(0) == (n), b, "have shape (" + std::to_string(n) + ",)", \
               shape_str((b).sizes()))

// Checks every argument; returns (hidden, d_out).
std::pair<int64_t, int64_t> check_mlp_args(const at::Tensor& x, const at::Tensor& w_fc,
                                           const std::optional<at::Tensor>& b_fc_opt, const at::Tensor& w_proj,
                                           const std::optional<at::Tensor>& b_proj_opt,
                                           const std::optional<at::Tensor>& residual_opt, int64_t activation) {
  FA_CHECK_CUDA(x);
  FA_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
               x, "have dtype float32, float16 or bfloat16", dtype_str(x.scalar_type()));
  FA_CHECK_ARG(x.dim() >= 1, x, "have at least 1 dim [..., in_features]", shape_str(x.sizes()));
  FA_CHECK_ARG(activation == kActGeluTanh || activation == kActSwiglu, activation,
               "be 1 (gelu_tanh) or 2 (swiglu)", num_str(activation));
  FA_CHECK_MLP_WEIGHT(w_fc, x.size(-1), "x's last dim");
  FA_CHECK_ARG(activation != kActSwiglu || w_fc.size(0) % 2 == 0, w_fc,
               "have an even out_features (gate rows over up rows) for swiglu", shape_str(w_fc.sizes()));
  if (b_fc_opt.has_value()) {
    const at::Tensor& b_fc = *b_fc_opt;
    FA_CHECK_MLP_BIAS(b_fc, w_fc.size(0));
  }
  const int64_t hidden = activation == kActSwiglu ? w_fc.size(0) / 2 : w_fc.size(0);
  FA_CHECK_ARG(w_proj.dim() == 2 && w_proj.size(1) == hidden, w_proj,
               "have shape [d_out, hidden] with hidden = " + std::to_string(hidden) + " (from w_fc)",
               shape_str(w_proj.sizes()));
  FA_CHECK_MLP_WEIGHT(w_proj, hidden, "hidden (from w_fc)");
  const int64_t d_out = w_proj.size(0);
  if (b_proj_opt.has_value()) {
    const at::Tensor& b_proj = *b_proj_opt;
    FA_CHECK_MLP_BIAS(b_proj, d_out);
  }
  if (residual_opt.has_value()) {
    const at::Tensor& residual = *residual_opt;
    std::vector<int64_t> want(x.sizes().begin(), x.sizes().end());
    want.back() = d_out;
    FA_CHECK_SAME_DEVICE(residual, x);
    FA_CHECK_SAME_DTYPE(residual, x);
    FA_CHECK_ARG(residual.sizes() == at::IntArrayRef(want), residual, "have shape " + shape_str(want),
                 shape_str(residual.sizes()));
  }
  return {hidden, d_out};
}

// linear's CUDA implementation called directly, not through the dispatcher: the dispatcher would run its
// Autograd kernel (Python, ~10 us a call on an H200 host, dev/probe_host_paths.py) for nothing, as mlp
// records no gradient.
at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, int64_t activation) {
  return linear(x, weight, bias, residual, std::nullopt, std::nullopt, activation, 0, 1e-5);
}

}  // namespace

// Argument order follows the schema in fused_attn/_ops.py.
at::Tensor mlp(const at::Tensor& x, const at::Tensor& w_fc, const std::optional<at::Tensor>& b_fc,
               const at::Tensor& w_proj, const std::optional<at::Tensor>& b_proj,
               const std::optional<at::Tensor>& residual, int64_t activation) {
  const int64_t d_out = check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, activation).second;
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = d_out;
  return call_linear(call_linear(x, w_fc, b_fc, std::nullopt, activation), w_proj, b_proj, residual, 0)
      .view(out_shape);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) { m.impl("mlp", &mlp); }

}  // namespace fused_attn
