// What the launcher (layer_norm.cpp, host C++ with ATen) and the kernels (layer_norm_kernel.cuh, built
// in the generated layer_norm_inst_*.cu units) share: the parameter struct and the launch functions.
// Torch-free and host-compilable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

struct NormParams {
  // x, residual: [rows, width] with row strides (elements; the last dim is contiguous).
  const void* x;
  const void* residual;  // nullptr: no residual add (h is not written)
  int64_t x_row_stride, r_row_stride;
  // weight, bias: [width], contiguous, x's element type or float32 (w_fp32 / b_fp32); nullptr: 1 / 0.
  const void* weight;
  const void* bias;
  bool w_fp32, b_fp32;
  void* y;  // [rows, width], contiguous
  void* h;  // [rows, width], contiguous: x + residual rounded to x's type (with a residual)
  int64_t rows;
  int width;
  float eps;
  // Gathered rows (add_layer_norm's x_index / residual_index: embeddings): row i of x is row
  // x_index[i] of the [x_rows, width] table (int64 where x_index64, else int32), likewise the residual;
  // nullptr: row i. An index outside [0, table rows) makes row i of y and h NaN and reads nothing. The
  // indices may be the previous kernel's output (a sampled token): read after the PDL wait.
  const void* x_index;
  const void* r_index;
  bool x_index64, r_index64;
  int64_t x_rows, r_rows;
  bool pdl_early;  // trigger the dependent launch before the wait (set by the launcher: common/pdl.cuh)
};

// Defined in layer_norm_kernel.cuh, instantiated in layer_norm_inst_*.cu (generate_instantiations.py).
// VEC: 16 / sizeof(T) (16-byte loads; width a multiple of VEC, every pointer and row stride aligned)
// or 1 (any width and alignment). RMS: y = h * rsqrt(mean(h^2) + eps) * w (no mean, no bias).
template <typename T, int VEC, bool RMS>
void launch_layer_norm(const NormParams& p, cudaStream_t stream);

}  // namespace fused_attn
