// Launcher of qkv_decode_attention (schema: fused_attn/_ops.py; the Python checks and the CPU path:
// fused_attn/qkv_decode_attention.py, with the same messages). Host C++ (g++): the kernel is launched
// through qkv_decode_attention_launch.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <optional>
#include <string>

#include "../common/checks.h"
#include "../common/ops.h"
#include "qkv_decode_attention_launch.h"

namespace fused_attn {

// A cache: [batch, heads, max_len >= 1, 64] on x's device in x's dtype, 16-byte aligned rows (macros, so that
// the message names the argument).
#define FA_CHECK_QKV_CACHE(c)                                                                                      \
  FA_CHECK_SAME_DEVICE(c, x);                                                                                      \
  FA_CHECK_SAME_DTYPE(c, x);                                                                                       \
  FA_CHECK_DIM(c, 4, "[batch, heads, max_len, 64]");                                                               \
  FA_CHECK_ARG((c).size(0) == batch && (c).size(1) == heads && (c).size(3) == kQkvHeadDim && (c).size(2) >= 1, c,  \
               "have shape [" + std::to_string(batch) + ", " + std::to_string(heads) + ", max_len >= 1, 64]",       \
               shape_str((c).sizes()));                                                                            \
  FA_CHECK_ARG((c).stride(3) == 1 && (c).stride(2) % 8 == 0 && (c).stride(1) % 8 == 0 && (c).stride(0) % 8 == 0 && \
                   aligned16(c),                                                                                   \
               c, "have a contiguous last dim, 16-byte aligned rows and base", "strides " + shape_str((c).strides()))
// Lengths: int32 [batch], contiguous, on x's device.
#define FA_CHECK_QKV_LENGTHS(t)                                                                            \
  FA_CHECK_SAME_DEVICE(t, x);                                                                              \
  FA_CHECK_ARG((t).scalar_type() == at::kInt, t, "have dtype torch.int32", dtype_str((t).scalar_type())); \
  FA_CHECK_ARG((t).dim() == 1 && (t).size(0) == batch && (t).stride(0) == 1, t,                            \
               "be a contiguous [" + std::to_string(batch) + "] tensor", shape_str((t).sizes()))

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

at::Tensor qkv_decode_attention(const at::Tensor& x, const at::Tensor& w_qkv, const std::optional<at::Tensor>& b_qkv_opt,
                                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                const std::optional<at::Tensor>& cache_leftpad_opt, double eps, double scale) {
  FA_CHECK_CUDA(x);
  FA_CHECK_ARG(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, x,
               "have dtype float16 or bfloat16 on CUDA", dtype_str(x.scalar_type()));
  FA_CHECK_ARG(x.dim() == 3 && x.size(1) == 1, x, "have shape [batch, 1, d]", shape_str(x.sizes()));
  const int64_t batch = x.size(0), d = x.size(2);
  FA_CHECK_ARG(d % 256 == 0 && d / 256 >= 1 && d / 256 <= kQkvMaxPieces, x,
               "have d a multiple of 256 up to " + std::to_string(256 * kQkvMaxPieces), shape_str(x.sizes()));
  FA_CHECK_ARG(x.stride(2) == 1 && x.stride(0) % 8 == 0 && aligned16(x), x,
               "have a contiguous last dim and 16-byte aligned rows", "strides " + shape_str(x.strides()));
  FA_CHECK_SAME_DEVICE(w_qkv, x);
  FA_CHECK_SAME_DTYPE(w_qkv, x);
  FA_CHECK_ARG(w_qkv.dim() == 2 && w_qkv.size(0) == 3 * d && w_qkv.size(1) == d, w_qkv,
               "have shape [" + std::to_string(3 * d) + ", " + std::to_string(d) + "]", shape_str(w_qkv.sizes()));
  FA_CHECK_ARG(w_qkv.stride(1) == 1 && w_qkv.stride(0) % 8 == 0 && aligned16(w_qkv), w_qkv,
               "have a contiguous last dim and 16-byte aligned rows", "strides " + shape_str(w_qkv.strides()));
  std::optional<at::Tensor> bias;
  if (b_qkv_opt.has_value()) {
    const at::Tensor& b_qkv = *b_qkv_opt;
    FA_CHECK_SAME_DEVICE(b_qkv, x);
    FA_CHECK_SAME_DTYPE(b_qkv, x);
    FA_CHECK_ARG(b_qkv.dim() == 1 && b_qkv.size(0) == 3 * d, b_qkv, "have shape (" + std::to_string(3 * d) + ",)",
                 shape_str(b_qkv.sizes()));
    bias = b_qkv.contiguous();
  }
  const int64_t heads = d / kQkvHeadDim;
  FA_CHECK_QKV_CACHE(k_cache);
  FA_CHECK_QKV_CACHE(v_cache);
  FA_CHECK_ARG(k_cache.size(2) == v_cache.size(2), v_cache, "have k_cache's max_len " + std::to_string(k_cache.size(2)),
               shape_str(v_cache.sizes()));
  FA_CHECK_QKV_LENGTHS(cache_seqlens);
  if (cache_leftpad_opt.has_value()) {
    const at::Tensor& cache_leftpad = *cache_leftpad_opt;
    FA_CHECK_QKV_LENGTHS(cache_leftpad);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  FA_CHECK_ARG(at::cuda::getDeviceProperties(x.device().index())->major >= 9 &&
                   (x.scalar_type() == at::kHalf ? qkv_decode_attention_compiled<__half>()
                                                 : qkv_decode_attention_compiled<__nv_bfloat16>()),
               x, "be on an sm_90 device (the kernel uses thread-block clusters)", "an earlier architecture");
  at::Tensor out = at::empty({batch, 1, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (batch == 0) return out;
  QkvParams p{};
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.w_qkv = w_qkv.data_ptr();
  p.w_stride = w_qkv.stride(0);
  p.b_qkv = bias.has_value() ? bias->data_ptr() : nullptr;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_stride_b = k_cache.stride(0);
  p.k_stride_h = k_cache.stride(1);
  p.k_stride_s = k_cache.stride(2);
  p.v_stride_b = v_cache.stride(0);
  p.v_stride_h = v_cache.stride(1);
  p.v_stride_s = v_cache.stride(2);
  p.cache_seqlens = cache_seqlens.data_ptr<int>();
  p.cache_leftpad = cache_leftpad_opt.has_value() ? cache_leftpad_opt->data_ptr<int>() : nullptr;
  p.out = out.data_ptr();
  p.o_stride = out.stride(0);
  p.batch = int(batch);
  p.heads = int(heads);
  p.d = int(d);
  p.max_len = int(k_cache.size(2));
  p.eps = float(eps);
  p.scale = float(scale);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = x.scalar_type() == at::kHalf ? launch_qkv_decode_attention<__half>(p, stream)
                                                       : launch_qkv_decode_attention<__nv_bfloat16>(p, stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) { m.impl("qkv_decode_attention", &qkv_decode_attention); }

}  // namespace fused_attn
