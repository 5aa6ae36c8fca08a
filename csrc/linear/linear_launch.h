// What the launcher (linear.cpp, host C++ with ATen) and the kernels (linear_kernel.cuh and
// linear_splitk.cuh, built in the generated linear_inst_*.cu units) share: the parameter struct, the
// activation codes and the launch functions. Torch-free and host-compilable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

// The epilogue's activation, as the schema's `int activation` (fused_attn/linear.py names them).
// kActSwiglu: the weight holds gate rows [0, n_out) over up rows [n_out, 2 n_out) and the output is
// silu(gate) * up.
enum LinearActivation : int { kActNone = 0, kActGeluTanh = 1, kActSwiglu = 2 };

struct LinearParams {
  // Strides in elements; every last dim is contiguous. x: [m, k]; w: [n, k] (nn.Linear's layout);
  // bias: [n] contiguous or nullptr; residual, out: [m, n_out].
  const void* x;
  int64_t x_stride;
  const void* w;
  int64_t w_stride;
  const void* bias;
  const void* residual;  // nullptr: none
  int64_t r_stride;
  void* out;
  int64_t o_stride;
  int m, k, n, n_out;  // n_out = n, or n / 2 with kActSwiglu
  int activation;
  // 16-byte loads of w and x: k, both row strides multiples of the vector width and both bases
  // 16-byte aligned. Otherwise the element-wise path (any k, any alignment).
  bool vec;
};

// Rows of x one launch handles at once: the kernel's MT template (1, 2, 4, 8, 16); each weight row
// is read once for all of them.
constexpr int kLinearMaxRows = 16;
constexpr int kLinearMaxThreads = 256;

// Defined in linear_kernel.cuh, instantiated in linear_inst_*.cu (generate_instantiations.py).
// MT: x rows per launch (p.m <= MT); rows_per_block: weight rows per block (1, 2 or 4; 2 or 4 with
// kActSwiglu, a gate row and its up row each); threads: a multiple of 32 up to kLinearMaxThreads.
template <typename T, int MT>
void launch_linear_gemv(const LinearParams& p, int rows_per_block, int threads, cudaStream_t stream);
// The tensor-core kernel: float16 / bfloat16, MT 8 or 16, p.vec (16-byte rows, k a multiple of 8);
// 16 output columns per block (8 with kActSwiglu). linear_mma_arch: the SM version it was compiled
// for (0 if none: mma.sync needs sm_80).
constexpr int kLinearMmaThreads = 256;
template <typename T, int MT>
void launch_linear_mma(const LinearParams& p, cudaStream_t stream);
template <typename T, int MT>
int linear_mma_arch();
// The split-K tensor-core kernel (linear_splitk.cuh), for fewer 16-row tiles of W than SMs: the same
// conditions as launch_linear_mma; `splits` blocks (1 to kLinearMaxSplits, none without a chunk of 32
// k) per tile form a cluster along K. linear_splitk_arch: the SM version it was compiled for (0 if
// none; clusters need sm_90).
constexpr int kLinearMaxSplits = 8;
template <typename T, int MT>
void launch_linear_splitk(const LinearParams& p, int splits, cudaStream_t stream);
template <typename T, int MT>
int linear_splitk_arch();

}  // namespace fused_attn
