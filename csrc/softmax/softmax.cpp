// Launchers of scaled_masked_softmax and its backward: argument checks, mask-view
// canonicalization, version / dtype / vector-width dispatch. Host C++ (g++): the kernels are
// launched through the functions declared in softmax_launch.h, whose definitions
// (softmax_kernel.cuh) are instantiated in the generated softmax_inst_*.cu units. Autograd is
// registered from Python (fused_attn/softmax.py) on top of these ops.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "softmax_launch.h"

namespace fused_attn {


namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Views attn_mask (already checked broadcastable) as [lead0, lead1, seqlen_q,
// seqlen_k] strides over x's leading dims, merging leading dims whose strides
// allow it. A mask whose leading strides do not fold into two dims is copied
// over the leading dims only (never over seqlen_q x seqlen_k unless it has them).
void set_mask_view(SoftmaxParams& p, const at::Tensor& x, at::Tensor& mask) {
  const int64_t nd = x.dim();
  auto lead_sizes = x.sizes().slice(0, nd - 2).vec();
  at::Tensor m = mask.expand(x.sizes());
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 0; d < nd - 2; ++d) {
    const int64_t sz = m.size(d), st = m.stride(d);
    if (sz == 1) continue;
    if (!sizes.empty() && strides.back() == st * sz) {
      sizes.back() *= sz;
      strides.back() = st;
    } else {
      sizes.push_back(sz);
      strides.push_back(st);
    }
  }
  if (sizes.size() > 2) {
    const int64_t L = x.numel() / (x.size(-2) * x.size(-1));
    at::Tensor m2 = mask;
    while (m2.dim() < 2) m2 = m2.unsqueeze(0);
    const int64_t mq = m2.size(-2), mk = m2.size(-1);
    auto target = lead_sizes;
    target.push_back(mq);
    target.push_back(mk);
    mask = m2.expand(target).reshape({L, mq, mk}).contiguous();
    m = mask.expand({L, x.size(-2), x.size(-1)});
    sizes = {L};
    strides = {m.stride(0)};
  }
  while (sizes.size() < 2) {
    sizes.insert(sizes.begin(), 1);
    strides.insert(strides.begin(), 0);
  }
  p.mask = m.data_ptr();
  p.mask_lead1 = sizes[1];
  p.div_lead1 = FastDiv(p.mask_lead1);
  p.mask_stride_lead0 = strides[0];
  p.mask_stride_lead1 = strides[1];
  p.mask_stride_q = m.stride(-2);
  p.mask_stride_k = m.stride(-1);
}

// The checks on the scores tensor (x, or y in the backward) that guard the launch.
#define FA_CHECK_SCORES(x)                                                                   \
  FA_CHECK_CUDA(x);                                                                          \
  FA_CHECK_ARG((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kHalf ||          \
                   (x).scalar_type() == at::kBFloat16,                                       \
               x, "have dtype float32, float16 or bfloat16", dtype_str((x).scalar_type()));  \
  FA_CHECK_ARG((x).dim() >= 2, x, "have at least 2 dims [..., seqlen_q, seqlen_k]",          \
               shape_str((x).sizes()));                                                      \
  FA_CHECK_ARG((x).size(-1) <= std::numeric_limits<int>::max() &&                            \
                   (x).size(-2) <= std::numeric_limits<int>::max(),                          \
               x, "have seqlen_q and seqlen_k below 2**31", shape_str((x).sizes()));         \
  FA_CHECK_ARG((x).numel() / std::max<int64_t>((x).size(-1), 1) < (int64_t(1) << 31), x,     \
               "have fewer than 2**31 rows (product of all dims but the last)",             \
               shape_str((x).sizes()))

// The locals are named after the arguments: the check macros stringify them into the message.
void check_args(const at::Tensor& x, double scale, const std::optional<at::Tensor>& attn_mask_opt,
                int64_t version, const at::Tensor* out_ptr) {
  FA_CHECK_SCORES(x);
  FA_CHECK_ARG(std::isfinite(scale), scale, "be a finite number", num_str(scale));
  FA_CHECK_ARG(version == 0 || version == 1, version, "be 0 or 1", num_str(version));
  if (attn_mask_opt.has_value()) {
    const at::Tensor& attn_mask = *attn_mask_opt;
    FA_CHECK_SAME_DEVICE(attn_mask, x);
    FA_CHECK_ARG(attn_mask.scalar_type() == at::kBool || attn_mask.scalar_type() == x.scalar_type(),
                 attn_mask, "have dtype bool or x's dtype (" + dtype_str(x.scalar_type()) + ")",
                 dtype_str(attn_mask.scalar_type()));
    bool broadcastable = attn_mask.dim() <= x.dim();
    for (int64_t i = 1; broadcastable && i <= attn_mask.dim(); ++i) {
      const int64_t ms = attn_mask.size(-i);
      broadcastable = ms == 1 || ms == x.size(-i);
    }
    FA_CHECK_ARG(broadcastable, attn_mask, "be broadcastable to " + shape_str(x.sizes()),
                 shape_str(attn_mask.sizes()));
  }
  if (out_ptr == nullptr) return;
  const at::Tensor& out = *out_ptr;
  FA_CHECK_SAME_DEVICE(out, x);
  FA_CHECK_SAME_DTYPE(out, x);
  FA_CHECK_ARG(out.sizes() == x.sizes(), out, "have x's shape " + shape_str(x.sizes()), shape_str(out.sizes()));
  FA_CHECK_CONTIGUOUS(out);
}

}  // namespace

void launch(const at::Tensor& x, double scale, bool causal,
            const std::optional<at::Tensor>& attn_mask, int64_t version, const at::Tensor& out) {
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  // One documented copy for a strided x; the kernels read rows contiguously.
  const at::Tensor xc = x.contiguous();

  SoftmaxParams p{};
  p.x = xc.data_ptr();
  p.out = out.data_ptr();
  p.seqlen_q = int(x.size(-2));
  p.seqlen_k = int(x.size(-1));
  p.div_q = FastDiv(p.seqlen_q);
  p.rows = x.numel() / p.seqlen_k;
  p.scale = float(scale);
  p.causal = causal;
  p.mask_kind = kMaskNone;
  p.mask_lead1 = 1;
  at::Tensor mask;
  if (attn_mask.has_value()) {
    mask = *attn_mask;
    p.mask_kind = mask.scalar_type() == at::kBool ? kMaskBool : kMaskAdditive;
    set_mask_view(p, x, mask);
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(x.scalar_type(), x, [&] {
    if (version == 0) {
      at::Tensor ws = at::empty({p.rows, p.seqlen_k}, x.options().dtype(at::kFloat));
      p.workspace = ws.data_ptr<float>();
      launch_v0<scalar_t>(p, stream);
      return;
    }
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec_ok = p.seqlen_k % kVec == 0 && aligned16(p.x) && aligned16(p.out);
    FA_BOOL_SWITCH(vec_ok, kVectorized, [&] {
      launch_v1<scalar_t, kVectorized ? kVec : 1>(p, stream);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Argument order follows the schemas in fused_attn/_ops.py (the only place schemas are defined).
void scaled_masked_softmax_out(const at::Tensor& x, double scale,
                               const std::optional<at::Tensor>& attn_mask, bool causal,
                               int64_t version, const at::Tensor& out) {
  check_args(x, scale, attn_mask, version, &out);
  launch(x, scale, causal, attn_mask, version, out);
}

at::Tensor scaled_masked_softmax(const at::Tensor& x, double scale,
                                 const std::optional<at::Tensor>& attn_mask, bool causal,
                                 int64_t version) {
  check_args(x, scale, attn_mask, version, nullptr);
  // The CUDA allocator directly, not at::empty's dispatcher hop: at 12 x 128 x 128 the op is launch-bound
  // and its host time is what a caller pays (bench_host).
  at::Tensor out = at::detail::empty_cuda(x.sizes(), x.scalar_type(), x.device(), at::MemoryFormat::Contiguous);
  launch(x, scale, causal, attn_mask, version, out);
  return out;
}

// dx = scale * y * (grad - <grad, y>) per row (softmax_kernel.cuh). y is the forward's output,
// which already holds the mask as exact zeros; `causal` only lets the kernel skip the invisible keys.
at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad, const at::Tensor& y, double scale,
                                          bool causal) {
  FA_CHECK_SCORES(y);
  FA_CHECK_CUDA(grad);
  FA_CHECK_SAME_DEVICE(grad, y);
  FA_CHECK_SAME_DTYPE(grad, y);
  FA_CHECK_ARG(grad.sizes() == y.sizes(), grad, "have y's shape " + shape_str(y.sizes()),
               shape_str(grad.sizes()));
  FA_CHECK_ARG(std::isfinite(scale), scale, "be a finite number", num_str(scale));
  at::Tensor dx = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return dx;
  const c10::cuda::CUDAGuard guard(y.device());
  // Autograd hands over expanded or transposed gradients at times: one copy, then rows are contiguous.
  const at::Tensor gc = grad.contiguous();
  const at::Tensor yc = y.contiguous();

  SoftmaxBackwardParams p{};
  p.grad = gc.data_ptr();
  p.y = yc.data_ptr();
  p.dx = dx.data_ptr();
  p.seqlen_q = int(y.size(-2));
  p.seqlen_k = int(y.size(-1));
  p.div_q = FastDiv(p.seqlen_q);
  p.rows = y.numel() / p.seqlen_k;
  p.scale = float(scale);
  p.causal = causal;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(y.scalar_type(), y, [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec_ok = p.seqlen_k % kVec == 0 && aligned16(p.grad) && aligned16(p.y) && aligned16(p.dx);
    FA_BOOL_SWITCH(vec_ok, kVectorized, [&] {
      launch_backward<scalar_t, kVectorized ? kVec : 1>(p, stream);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("scaled_masked_softmax", &scaled_masked_softmax);
  m.impl("scaled_masked_softmax_out", &scaled_masked_softmax_out);
  m.impl("scaled_masked_softmax_backward", &scaled_masked_softmax_backward);
}

}  // namespace fused_attn
