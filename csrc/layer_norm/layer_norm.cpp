// Launcher of layer_norm and add_layer_norm (schemas: fused_attn/_ops.py; rms = true selects RMSNorm):
// the checks that guard memory, the [rows, width] view, and the dtype / vector width / RMS dispatch.
// Host C++ (g++): the kernels are launched through layer_norm_launch.h. Autograd is registered from
// Python (fused_attn/layer_norm.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "layer_norm_launch.h"

namespace fused_attn {

namespace {

constexpr int64_t kMinWidth = 64;
constexpr int64_t kMaxWidth = 16384;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// weight / bias: [width] on x's device, x's dtype or float32.
#define FA_CHECK_AFFINE(t)                                                                                 \
  FA_CHECK_SAME_DEVICE(t, x);                                                                              \
  FA_CHECK_ARG((t).scalar_type() == x.scalar_type() || (t).scalar_type() == at::kFloat, t,                 \
               "have x's dtype (" + dtype_str(x.scalar_type()) + ") or torch.float32",                    \
               dtype_str((t).scalar_type()));                                                              \
  FA_CHECK_ARG((t).dim() == 1 && (t).size(0) == width, t,                                                  \
               "have shape (width,) = (" + std::to_string(width) + ",)", shape_str((t).sizes()))

// An index of gathered rows (x_index / residual_index): 1-D int32 / int64 on x's device, and its table
// ([table rows, width]) 2-D. The locals are named after the arguments (the macros stringify them).
#define FA_CHECK_INDEX(index, table)                                                              \
  FA_CHECK_SAME_DEVICE(index, x);                                                                             \
  FA_CHECK_ARG((index).scalar_type() == at::kInt || (index).scalar_type() == at::kLong, index,                \
               "have dtype torch.int32 or torch.int64", dtype_str((index).scalar_type()));                   \
  FA_CHECK_ARG((index).dim() == 1, index, "have 1 dim [rows]", shape_str((index).sizes()));                  \
  FA_CHECK_ARG((table).dim() == 2, table, "have 2 dims [table rows, width] with " #index,                     \
               shape_str((table).sizes()))

// The rows of y (and h): x_index's length, else those of x ([..., width]: every dim but the last).
std::vector<int64_t> out_shape(const at::Tensor& x, const std::optional<at::Tensor>& x_index) {
  if (x_index.has_value()) return {x_index->size(0), x.size(-1)};
  return x.sizes().vec();
}

// The locals are named after the arguments: the check macros stringify them into the message.
void check_args(const at::Tensor& x, const std::optional<at::Tensor>& residual_opt,
                const std::optional<at::Tensor>& weight_opt, const std::optional<at::Tensor>& bias_opt, double eps,
                const std::optional<at::Tensor>& x_index_opt = std::nullopt,
                const std::optional<at::Tensor>& residual_index_opt = std::nullopt) {
  FA_CHECK_CUDA(x);
  FA_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
               x, "have dtype float32, float16 or bfloat16", dtype_str(x.scalar_type()));
  FA_CHECK_ARG(x.dim() >= 1, x, "have at least 1 dim [..., width]", shape_str(x.sizes()));
  const int64_t width = x.size(-1);
  FA_CHECK_ARG(width >= kMinWidth && width <= kMaxWidth, x, "have a width (last dim) in [64, 16384] on CUDA",
               std::to_string(width));
  FA_CHECK_ARG(x.numel() / width < (int64_t(1) << 31), x,
               "have fewer than 2**31 rows (product of all dims but the last)", shape_str(x.sizes()));
  FA_CHECK_ARG(std::isfinite(eps) && eps >= 0, eps, "be a finite number >= 0", num_str(eps));
  if (x_index_opt.has_value()) {
    const at::Tensor& x_index = *x_index_opt;
    FA_CHECK_INDEX(x_index, x);
  }
  if (residual_index_opt.has_value() && !x_index_opt.has_value()) {
    FA_CHECK_ARG(x.dim() == 2, x, "have 2 dims [rows, width] with residual_index", shape_str(x.sizes()));
  }
  if (residual_opt.has_value()) {
    const at::Tensor& residual = *residual_opt;
    FA_CHECK_SAME_DEVICE(residual, x);
    FA_CHECK_SAME_DTYPE(residual, x);
    if (residual_index_opt.has_value()) {
      const at::Tensor& residual_index = *residual_index_opt;
      FA_CHECK_INDEX(residual_index, residual);
      FA_CHECK_ARG(residual.size(1) == width, residual, "have x's width (" + std::to_string(width) + ")",
                   std::to_string(residual.size(1)));
      const int64_t rows = x_index_opt.has_value() ? x_index_opt->size(0) : x.size(0);
      FA_CHECK_ARG(residual_index.size(0) == rows, residual_index,
                   "have length " + std::to_string(rows) + " (the rows of y)", std::to_string(residual_index.size(0)));
    } else {
      const std::vector<int64_t> want = out_shape(x, x_index_opt);
      FA_CHECK_ARG(residual.sizes() == at::IntArrayRef(want), residual,
                   std::string(x_index_opt.has_value() ? "have shape (len(x_index), width) " : "have x's shape ") +
                       shape_str(want),
                   shape_str(residual.sizes()));
    }
  }
  if (weight_opt.has_value()) {
    const at::Tensor& weight = *weight_opt;
    FA_CHECK_AFFINE(weight);
  }
  if (bias_opt.has_value()) {
    const at::Tensor& bias = *bias_opt;
    FA_CHECK_AFFINE(bias);
  }
}

// [rows, width] with a contiguous last dim: a view where the layout allows, else one copy.
at::Tensor rows_view(const at::Tensor& t) {
  at::Tensor v = t.reshape({-1, t.size(-1)});
  return v.stride(1) == 1 || v.size(1) == 1 ? v : v.contiguous();
}

void launch(const at::Tensor& x, const std::optional<at::Tensor>& residual,
            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps, bool rms,
            const at::Tensor& y, const at::Tensor* h, const std::optional<at::Tensor>& x_index = std::nullopt,
            const std::optional<at::Tensor>& residual_index = std::nullopt) {
  if (y.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = rows_view(x);
  const at::Tensor r2 = residual.has_value() ? rows_view(*residual) : at::Tensor();
  // Indices: [rows], a strided one copied (rows elements).
  const at::Tensor xi = x_index.has_value() ? x_index->contiguous() : at::Tensor();
  const at::Tensor ri = residual_index.has_value() ? residual_index->contiguous() : at::Tensor();
  // Parameters are [width]: a strided one is copied (width elements).
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();

  NormParams p{};
  p.x = x2.data_ptr();
  p.x_row_stride = x2.stride(0);
  p.residual = r2.defined() ? r2.data_ptr() : nullptr;
  p.r_row_stride = r2.defined() ? r2.stride(0) : 0;
  p.weight = w.defined() ? w.data_ptr() : nullptr;
  p.bias = b.defined() ? b.data_ptr() : nullptr;
  p.w_fp32 = w.defined() && w.scalar_type() == at::kFloat;
  p.b_fp32 = b.defined() && b.scalar_type() == at::kFloat;
  p.y = y.data_ptr();
  p.h = h != nullptr ? h->data_ptr() : nullptr;
  p.rows = y.numel() / y.size(-1);
  p.width = int(x2.size(1));
  p.x_index = xi.defined() ? xi.data_ptr() : nullptr;
  p.r_index = ri.defined() ? ri.data_ptr() : nullptr;
  p.x_index64 = xi.defined() && xi.scalar_type() == at::kLong;
  p.r_index64 = ri.defined() && ri.scalar_type() == at::kLong;
  p.x_rows = x2.size(0);
  p.r_rows = r2.defined() ? r2.size(0) : 0;
  p.eps = float(eps);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(x.scalar_type(), x, [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    // 16-byte loads and stores need every row start aligned: width, row strides and bases.
    bool vec_ok = p.width % kVec == 0 && p.x_row_stride % kVec == 0 && aligned16(p.x) && aligned16(p.y);
    if (p.residual != nullptr) vec_ok = vec_ok && p.r_row_stride % kVec == 0 && aligned16(p.residual) && aligned16(p.h);
    if (p.weight != nullptr) vec_ok = vec_ok && aligned16(p.weight);
    if (p.bias != nullptr) vec_ok = vec_ok && aligned16(p.bias);
    FA_BOOL_SWITCH(vec_ok, kVectorized, [&] {
      FA_BOOL_SWITCH(rms, kRms, [&] { launch_layer_norm<scalar_t, kVectorized ? kVec : 1, kRms>(p, stream); });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor new_rows(const at::Tensor& x, const std::vector<int64_t>& shape) {
  return at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

// Argument order follows the schemas in fused_attn/_ops.py (the only place schemas are defined).
at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, bool rms) {
  check_args(x, std::nullopt, weight, bias, eps);
  at::Tensor y = new_rows(x, x.sizes().vec());
  launch(x, std::nullopt, weight, bias, eps, rms, y, nullptr);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, double eps,
                                                  const std::optional<at::Tensor>& x_index,
                                                  const std::optional<at::Tensor>& residual_index, bool rms) {
  check_args(x, residual, weight, bias, eps, x_index, residual_index);
  const std::vector<int64_t> shape = out_shape(x, x_index);
  at::Tensor y = new_rows(x, shape);
  at::Tensor h = new_rows(x, shape);
  launch(x, residual, weight, bias, eps, rms, y, &h, x_index, residual_index);
  return {y, h};
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("layer_norm", &layer_norm);
  m.impl("add_layer_norm", &add_layer_norm);
}

}  // namespace fused_attn
