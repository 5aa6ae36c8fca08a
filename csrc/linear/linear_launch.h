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
// A tensor-core build's activation (linear_kernel.cuh): one of the codes above, compiled in, or kActRuntime,
// read from LinearParams::activation by the one build that serves them all.
constexpr int kActRuntime = -1;
// The epilogue builds (linear_kernel.cuh's with_build_epilogue): a build's code also says at compile time whether
// the launch has a bias and a residual. Its low bits (kActCodeMask) are the activation; kEpiKnown marks
// kEpiBias / kEpiResidual as valid (without it the build reads p.bias / p.residual).
constexpr int kActCodeMask = 3, kEpiBias = 4, kEpiResidual = 8, kEpiKnown = 16;
// The build the arch queries (linear_mma_arch, linear_splitk_arch, linear_mma_self_norm_fits) read: one that
// every plain launcher instantiates (no activation, bias or residual), so no query compiles a kernel of its own.
constexpr int kArchProbeBuild = kActNone | kEpiKnown;

// The pre-normalization, as the schema's `int norm` (fused_attn/linear.py names them).
enum LinearNorm : int { kNormNone = 0, kNormLayer = 1, kNormRms = 2 };

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
  // The pre-normalization of x's rows (kernels instantiated with kNorm): LayerNorm or RMSNorm with
  // float32 statistics, the normalized rows rounded to T into shared memory (xs_pitch elements apart)
  // before the matmul. norm_weight / norm_bias: [k], T or float32 (the *_fp32 flags), or nullptr (1 / 0).
  int norm;
  const void* norm_weight;
  const void* norm_bias;
  bool nw_fp32, nb_fp32;
  float eps;
  int xs_pitch;
  // The norm's weight and bias staged in shared memory after the rows, by cp.async before the wait
  // (both absent or 16-byte aligned, each k elements a whole number of 16-byte pieces); else read from
  // global memory in the prologue's last phase.
  bool affine_smem;
  // 16-byte loads of w and x: k, both row strides multiples of the vector width and both bases
  // 16-byte aligned. Otherwise the element-wise path (any k, any alignment).
  bool vec;
  // Trigger the dependent launch before the wait (set by the launch functions from m: common/pdl.cuh).
  bool pdl_early;
};

// Rows of x one launch handles at once: the kernel's MT template (1, 2, 4, 8, 16); each weight row
// is read once for all of them. The tensor-core kernels' wide build (MT 32, 16-bit only: linear.cpp's
// kMmaWideMaxRows) goes past it.
constexpr int kLinearMaxRows = 16;
constexpr int kLinearMaxThreads = 256;
// The shared memory the normalized rows of x may take (p.m x xs_pitch x sizeof(T)); a launch that
// needs more normalizes in a separate launch first (linear.cpp). 64 KB keeps three blocks per SM.
constexpr int kLinearNormSmemBytes = 64 * 1024;

// The row pitch in elements of the normalized rows in shared memory: k rounded up to 16-byte pieces,
// and an odd multiple of 64 bytes, so that the tensor-core kernel's 8 lanes of a load phase (two x
// rows, 64 bytes each) hit distinct banks.
inline int linear_xs_pitch(int k, int elem_bytes) {
  int bytes = (k * elem_bytes + 63) / 64 * 64;
  if (bytes % 128 == 0) bytes += 64;
  return bytes / elem_bytes;
}

// The dynamic shared memory of a kNorm launch: the normalized rows (m x xs_pitch elements of
// elem_bytes), then with affine_smem the norm's weight and bias (k elements of w_bytes and b_bytes, 0
// where absent). The launcher folds the norm only where this fits kLinearNormSmemBytes.
inline size_t linear_norm_smem_bytes(int m, int k, int elem_bytes, int w_bytes, int b_bytes, bool affine_smem) {
  return size_t(m) * linear_xs_pitch(k, elem_bytes) * elem_bytes + (affine_smem ? size_t(k) * (w_bytes + b_bytes) : 0);
}

// Defined in linear_kernel.cuh, instantiated in linear_inst_*.cu (generate_instantiations.py).
// MT: x rows per launch (p.m <= MT); rows_per_block: weight rows per block (1, 2 or 4; 2 or 4 with
// kActSwiglu, a gate row and its up row each); threads: a multiple of 32 up to kLinearMaxThreads.
// kNorm: x's rows normalized first (p.norm, the shared memory of linear_xs_pitch).
template <typename T, int MT, bool kNorm>
void launch_linear_gemv(const LinearParams& p, int rows_per_block, int threads, cudaStream_t stream);
// The tensor-core kernel: float16 / bfloat16, MT 8 or 16, p.vec (16-byte rows, k a multiple of 8), no
// norm; 16 output columns per block (8 with kActSwiglu). linear_mma_arch: the SM version it was
// compiled for (0 if none: mma.sync needs sm_80).
constexpr int kLinearMmaThreads = 256;
// `sms`: the device's SM count (the launcher stages x where the grid is resident at once: kStageX in
// linear_kernel.cuh).
template <typename T, int MT>
void launch_linear_mma(const LinearParams& p, int sms, cudaStream_t stream);
template <typename T, int MT>
int linear_mma_arch();
// The same kernel normalizing x's rows itself (p.norm kNormLayer / kNormRms, no norm weight or bias: folded
// into the weight by the caller; kSelfNorm in linear_kernel.cuh): the short build only (a warp's share of K
// within kMmaShortChunks chunks of 32: K <= 768), in a grid the SMs hold at once; linear.cpp checks both.
// Instantiated at MT 8 (2-8 rows: linear.cpp's kMmaMinRows .. kSelfNormMaxRows).
template <typename T, int MT>
void launch_linear_mma_self_norm(const LinearParams& p, int sms, cudaStream_t stream);
// Whether it takes k and a grid of `blocks` (16-column tiles) on `sms` SMs, and was compiled (sm_80+).
template <typename T, int MT>
bool linear_mma_self_norm_fits(int64_t k, int64_t blocks, int sms);
// The split-K tensor-core kernel (linear_splitk.cuh), for fewer 16-row tiles of W than SMs: the same
// conditions as launch_linear_mma; `splits` blocks (1 to kLinearMaxSplits, none without a chunk of 32
// k) per tile form a cluster along K; sms as for launch_linear_mma. linear_splitk_arch: the SM version it was compiled for (0 if
// none; clusters need sm_90).
constexpr int kLinearMaxSplits = 8;
// MT 64 (33-64 rows, linear.cpp's kSplitKGroupMaxRows): the wide build in row groups of kMmaGroupRows rows of x, one
// grid layer (blockIdx.z) a group, each reading the whole weight tile again (from L2 when the other group's blocks
// of the tile are resident beside it).
constexpr int kMmaGroupRows = 32;
// The row groups of a launch of m rows (1 up to kMmaGroupRows rows).
constexpr int64_t linear_row_groups(int64_t m) {
  return m > kMmaGroupRows ? (m + kMmaGroupRows - 1) / kMmaGroupRows : 1;
}
template <typename T, int MT>
void launch_linear_splitk(const LinearParams& p, int splits, int sms, cudaStream_t stream);
template <typename T, int MT>
int linear_splitk_arch();

// The SwiGLU product of the many-row path (linear_swiglu.cu), after cuBLAS wrote the gate and up
// columns side by side: out[i][j] = silu(y[i][j]) * y[i][n + j] for i < m, j < n, in float32 and rounded
// once to T. y: [m, 2 n] with row stride y_stride, out: [m, n] with o_stride (elements; last dims
// contiguous). One pass, 16-byte pieces where n and both layouts allow.
template <typename T>
void launch_swiglu(const void* y, int64_t y_stride, void* out, int64_t o_stride, int64_t m, int64_t n,
                   cudaStream_t stream);

}  // namespace fused_attn
