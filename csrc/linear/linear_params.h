// LinearParams from ATen tensors: what linear.cpp fills in for a projection launched through
// linear_launch.h. Host C++ with ATen.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "linear_launch.h"

namespace fused_attn {

// Rows of t can be read as 16-byte vectors of `vec` elements: a row stride that is a multiple of vec and a
// 16-byte aligned base.
inline bool vector_ready(const at::Tensor& t, int64_t vec) {
  return t.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// out2 = act(x2 · weightᵀ + bias) + residual2 with x2 [m, k], weight [n, k], out2 and residual2 [m, n_out]
// (every last dim contiguous): the pointers, strides and sizes. The rest (vec, the norm's fields, pdl_early)
// is the caller's.
inline LinearParams linear_params(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual2, const at::Tensor& out2,
                                  int64_t activation) {
  LinearParams p{};
  p.m = int(x2.size(0));
  p.k = int(x2.size(1));
  p.n = int(weight.size(0));
  p.n_out = int(out2.size(1));
  p.activation = int(activation);
  p.x = x2.data_ptr();
  p.x_stride = x2.stride(0);
  p.w = weight.data_ptr();
  p.w_stride = weight.stride(0);
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.residual = residual2.has_value() ? residual2->data_ptr() : nullptr;
  p.r_stride = residual2.has_value() ? residual2->stride(0) : 0;
  p.out = out2.data_ptr();
  p.o_stride = out2.stride(0);
  return p;
}

}  // namespace fused_attn
