// Launcher of mlp (schema: fused_attn/_ops.py): y = act(x · W_fcᵀ + b_fc) · W_projᵀ + b_proj + residual.
// Where it applies (float16 / bfloat16, 1 to 16 rows of x, in_features and hidden multiples of 8 with
// 16-byte aligned rows, an sm_90 device that holds the whole grid at once) one launch of mlp_kernel
// (mlp_kernel.cuh); elsewhere the two launches of fused_attn.linear (the first with the activation, the
// second with the residual), which is also what fused_attn.mlp runs by default where the single launch
// did not measure faster. The checks that guard memory are here; fused_attn/mlp.py repeats them with
// the same messages for the CPU and meta paths. Host C++ (g++): the kernel is launched through
// mlp_launch.h.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../linear/linear_params.h"
#include "mlp_launch.h"

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
                                           const std::optional<at::Tensor>& residual_opt, const at::Tensor& workspace,
                                           int64_t activation) {
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
  FA_CHECK_SAME_DEVICE(workspace, x);
  FA_CHECK_ARG(workspace.scalar_type() == at::kInt, workspace, "have dtype torch.int32",
               dtype_str(workspace.scalar_type()));
  FA_CHECK_ARG(workspace.dim() == 1 && workspace.numel() >= kMlpWorkspaceWords, workspace,
               "have 1 dim and at least " + std::to_string(kMlpWorkspaceWords) + " elements",
               shape_str(workspace.sizes()));
  return {hidden, d_out};
}

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, int64_t activation) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fused_attn::linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                               const std::optional<at::Tensor>&, int64_t, int64_t, double)>();
  return op.call(x, weight, bias, residual, std::nullopt, std::nullopt, activation, 0, 1e-5);
}

// How many clusters of `splits` blocks of the kernel for (dtype, MT) the device holds at once, asked once
// per (device, dtype, MT, splits): an occupancy query, not a launch.
template <typename T, int MT>
int max_clusters(int device, int splits) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(device, splits);
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(key, mlp_max_clusters<T, MT>(splits)).first;
  return it->second;
}

// Blocks per W_proj tile (a cluster along K): about as many blocks as W_fc has tiles (so a block
// computes one h tile and one split), at most a portable cluster, no split without a chunk of 32 k,
// and fewer where the device would not hold every cluster at once (0: the single launch does not fit).
template <typename T, int MT>
int mlp_splits(int device, int64_t fc_tiles, int64_t proj_tiles, int64_t hidden) {
  const int64_t chunks = (hidden + 31) / 32;
  int64_t want = std::clamp<int64_t>(fc_tiles / proj_tiles, 1, std::min<int64_t>(kLinearMaxSplits, chunks));
  for (; want >= 1; --want) {
    const int64_t per = (chunks + want - 1) / want;
    const int splits = int((chunks + per - 1) / per);
    if (max_clusters<T, MT>(device, splits) >= proj_tiles) return splits;
  }
  return 0;
}

}  // namespace

// Argument order follows the schema in fused_attn/_ops.py.
at::Tensor mlp(const at::Tensor& x, const at::Tensor& w_fc, const std::optional<at::Tensor>& b_fc,
               const at::Tensor& w_proj, const std::optional<at::Tensor>& b_proj,
               const std::optional<at::Tensor>& residual, const at::Tensor& workspace, int64_t activation) {
  const auto [hidden, d_out] = check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, activation);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(-1);
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = d_out;
  const bool sixteen_bit = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  const int device = x.device().index();
  const bool candidate = sixteen_bit && m >= 1 && m <= kLinearMaxRows && d > 0 && d % 8 == 0 && hidden > 0 &&
                         hidden % 8 == 0 && d_out > 0 && vector_ready(w_fc, 8) && vector_ready(w_proj, 8) &&
                         at::cuda::getDeviceProperties(device)->major >= 9;
  int splits = 0;
  const int64_t fc_tiles = (hidden + (activation == kActSwiglu ? 7 : 15)) / (activation == kActSwiglu ? 8 : 16);
  const int64_t proj_tiles = (d_out + 15) / 16;
  if (candidate) {
    splits = x.scalar_type() == at::kHalf
                 ? (m > 8 ? mlp_splits<__half, 16>(device, fc_tiles, proj_tiles, hidden)
                          : mlp_splits<__half, 8>(device, fc_tiles, proj_tiles, hidden))
                 : (m > 8 ? mlp_splits<__nv_bfloat16, 16>(device, fc_tiles, proj_tiles, hidden)
                          : mlp_splits<__nv_bfloat16, 8>(device, fc_tiles, proj_tiles, hidden));
  }
  if (splits == 0) {  // the two launches
    return call_linear(call_linear(x, w_fc, b_fc, std::nullopt, activation), w_proj, b_proj, residual, 0)
        .view(out_shape);
  }
  at::Tensor x2 = x.reshape({m, d});
  if (x2.stride(1) != 1 || !vector_ready(x2, 8)) x2 = x2.clone(at::MemoryFormat::Contiguous);
  std::optional<at::Tensor> residual2;
  if (residual.has_value()) {
    residual2 = residual->reshape({m, d_out});
    if (residual2->stride(1) != 1) residual2 = residual2->contiguous();
  }
  std::optional<at::Tensor> b_fc_c, b_proj_c;
  if (b_fc.has_value()) b_fc_c = b_fc->contiguous();
  if (b_proj.has_value()) b_proj_c = b_proj->contiguous();
  at::Tensor h = at::empty({m, hidden}, x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty({m, d_out}, x.options().memory_format(at::MemoryFormat::Contiguous));
  MlpParams p{};
  p.fc = linear_params(x2, w_fc, b_fc_c, std::nullopt, h, activation);
  p.proj = linear_params(h, w_proj, b_proj_c, residual2, out, kActNone);
  p.fc.vec = p.proj.vec = true;  // 16-bit rows with k a multiple of 8 and 16-byte aligned (checked above)
  p.arrived = reinterpret_cast<unsigned*>(workspace.data_ptr<int>());
  p.left = p.arrived + workspace.stride(0);  // its second element (any stride)
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kHalf) {
    err = m > 8 ? launch_mlp<__half, 16>(p, splits, stream) : launch_mlp<__half, 8>(p, splits, stream);
  } else {
    err = m > 8 ? launch_mlp<__nv_bfloat16, 16>(p, splits, stream) : launch_mlp<__nv_bfloat16, 8>(p, splits, stream);
  }
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.view(out_shape);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) { m.impl("mlp", &mlp); }

}  // namespace fused_attn
