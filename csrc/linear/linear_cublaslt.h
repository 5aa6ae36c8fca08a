// linear's many-row GEMM as one cuBLASLt call with the epilogue in it (linear_cublaslt.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fused_attn {

// out [m, n] = act(x2 [m, k] · weightᵀ + bias) + residual2, in one cublasLtMatmul on the current stream:
// the bias (and GELU) in its epilogue, the residual as its C operand (beta = 1; only without GELU, which
// would apply to it). float16 / bfloat16 on CUDA, k > 0, every last dim contiguous, bias contiguous.
// Returns an undefined tensor, having launched nothing, where the case does not qualify or cuBLASLt has
// no algorithm for it (the caller's ATen path runs instead).
at::Tensor cublaslt_linear(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual2, bool gelu);

}  // namespace fused_attn
