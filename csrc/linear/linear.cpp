// Launcher of linear (schema: fused_attn/_ops.py): the checks that guard memory, the choice between
// our weight-streaming kernel (rows of x <= kMaxGemvRows; 16-bit x on tensor cores to kMmaWideMaxRows) and cuBLAS
// (more rows), and the
// kernel's launch shape (rows of x per launch, weight rows per block, threads). With a pre-normalization
// (norm), our kernels normalize x in their prologue; where they do not run, or the normalized rows do
// not fit kLinearNormSmemBytes of shared memory, x is normalized first by our layer_norm op (the same
// result, one launch more). Host C++ (g++): the kernels are launched through linear_launch.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "linear_cublaslt.h"
#include "linear_launch.h"
#include "linear_params.h"

namespace fused_attn {

namespace {

// Rows of x (the product of x's leading dims) up to which our kernel runs; above it, cuBLAS.
// Below it the op streams the weight once and is memory-bound; the kernel reads each weight row
// once for all rows. The crossover is to be measured on the GPU (bench/bench_linear.py, M = 16
// against 128): our CUDA-core kernel does M FMAs per weight element, which at M = 16 in 16-bit
// types is about what the SM's FP32 units can do at the copy bandwidth.
constexpr int64_t kMaxGemvRows = kLinearMaxRows;

// 17-32 rows of float16 / bfloat16 x: the tensor-core kernels' wide build (four n-tiles, linear_heuristics.h's
// kMmaWideChunks) where it takes the shape (16-byte weight rows, K a multiple of 8, sm_90, gemv_wins), else
// cuBLAS. GPT-2's graph-fused step, where every projection and the lm_head leave cuBLAS for it (H200, fp16, prompt
// 128, bench.ab, two interleaved rounds, us a step, cuBLAS -> ours): batch 24 460.4 -> 349.3, batch 32 471.6 ->
// 368.9; batches 1 and 16 even (192.9 / 271.3 against 193.1 / 271.4). Eight n-tiles to 64 rows measured slower than
// cuBLAS: batch 48 529.7 -> 547.3, batch 64 548.8 -> 583.5.
constexpr int64_t kMmaWideMaxRows = 32;
// 33-64 rows of the split-K class (fewer 16-row weight tiles than SMs, GPT-2's 768-column projections): the same
// wide build in two row groups (linear_launch.h's kMmaGroupRows), grid layers of one launch, each group's blocks
// reading the weight tile again. Against cuBLAS, whose GEMMs at these shapes split K into a second launch: GPT-2's
// graph-fused step (H200, fp16, prompt 128, bench.ab against 5818221, two interleaved rounds, us a step) batch 48
// 499.9 -> 470.0, batch 64 527.0 -> 493.8. The whole-K kernel's shapes (c_attn, c_fc, the lm_head) stay on cuBLAS
// there: with them in row groups too the step lost to cuBLAS (batch 48 526.1 -> 532.2, batch 64 544.2 -> 569.5, the
// same call's default on the 256-thread decode build).
constexpr int64_t kSplitKGroupMaxRows = 64;
static_assert(kMmaGroupRows == kMmaWideMaxRows, "a row group is what the wide build takes in one launch");
static_assert(kSplitKGroupMaxRows == 2 * kMmaGroupRows, "the MT 64 instantiation holds two row groups");

// Rows of x from which float16 / bfloat16 run a tensor-core kernel (16-byte rows): linear_mma_kernel
// where the weight has at least one block of 16 rows per SM, else the split-K kernel (sm_90: clusters),
// else the CUDA-core kernel (one row). At 4 rows the CUDA-core kernel's FMAs and conversions per weight
// byte already cost more than the tensor-core kernels' padding to 16 rows: measured on an H100 (fp16,
// bench_linear / bench_mlp at M 4, cold L2, p50 us, CUDA-core -> tensor-core, docs/lab-notes/linear-mlp.md):
// 3072x768 9.2 -> 7.9, 768x3072 9.9 -> 7.1, 4096x11008 43.8 -> 37.7, 11008x4096 48.0 -> 40.9, GPT-2's MLP
// 14.4 -> 10.4, Llama's 118.5 -> 98.8, 768x768 6.4 -> 6.6 (the one loss); GPT-2's batch-4 decode step
// 349-350 -> 294 us. 2-3 rows, measured in GPT-2's captured decode step (H100, fp16, prompt 128, us a
// step, two rounds; docs/lab-notes/linear-mlp.md): batch 2 270.8 / 269.2 -> 227.3 / 227.5, batch 3 303.4 /
// 301.5 -> 226.3 / 226.4 (there the CUDA-core kernels did 2-3 FMAs a weight element behind a separate
// norm launch; on tensor cores the norm folds into c_attn / c_fc, self_norm_in_mma), batches 1 and 4 the
// same kernels. One row stays on the CUDA-core kernel, which folds the norm into its launch (every launch on
// tensor cores from one row: batch 1 +5..+6 us).
constexpr int kMmaMinRows = 2;
// One row of x on tensor cores too where the launch folds no norm into x, the weight has a 16-row tile per
// SM (linear_mma_kernel, not split-K) and K <= kMmaOneRowMaxK. Measured on an H100 (fp16, bench_mlp /
// bench_linear at M 1, cold L2, p50 us, CUDA-core -> tensor-core in one call; docs/lab-notes/linear-mlp.md):
// GPT-2's MLP (c_fc on it; c_proj, split-K class, unchanged) 10.05 -> 9.06, 4096x4096 18.0 -> 16.8, 768x2304 /
// 768x3072 / 4096x11008 within 0.2, 11008x4096 36.3 -> 38.1 (the CUDA-core kernel streams long rows better:
// hence the K bound; Llama-2-7B's MLP 95.1 -> 97.8 without it). On this rule, another call: GPT-2's MLP 9.04
// against compiled 19.84 (2.19x), Llama's 96.7 against 111.6. The split-K shapes lose at one row (768x768 5.3
// -> 5.8; GPT-2's B1 step +5..+7 us with its residual projections there), so they stay. GPT-2's B1 step has no
// launch of this class (c_attn / c_fc fold their norms, the lm_head its ln_f): unchanged.
constexpr int64_t kMmaOneRowMaxK = 4096;
// normed: a norm folded into x (the CUDA-core kernel's prologue or fold); split_k: fewer 16-row tiles than SMs.
bool mma_rows(int64_t m, int64_t k, bool normed, bool split_k) {
  return m >= kMmaMinRows || (m == 1 && !normed && !split_k && k <= kMmaOneRowMaxK);
}

// The widths our layer_norm op takes on CUDA (csrc/layer_norm/layer_norm.cpp): the separate
// normalization where the kernels' prologue does not run.
constexpr int64_t kNormOpMinWidth = 64;
constexpr int64_t kNormOpMaxWidth = 16384;


// Which of our kernels runs at 2-16 rows (one row: the CUDA-core kernel; float32: always it).
enum class GemvPath { kCudaCores, kTensorCores, kSplitK };

// At 5-16 rows our kernels do not always beat cuBLAS (plus its epilogue passes). Measured (H100,
// float16, bench_linear, cold L2, p50, against the compiled chain): the CUDA-core kernel wins at
// K = 768 (768x2304 M 16: 8.5 us against 10.6) and loses at K = 3072 (3072x768 M 16: 24.6 against
// 12.9: every thread's K slice meets all 16 rows of x, and the N = 768 rows give few blocks); the
// tensor-core kernel holds at K = 4096 (4096x4096: 21.4 against 21.9) and loses at 11008 (11008x4096:
// 48.9 against 40.9). Up to 4 rows ours wins at every shape measured. Predicted, not yet measured:
// the split-K kernel, which takes the tensor-core rows with fewer 16-row tiles than SMs
// (N < 2112 on an H100: GPT-2's 768-wide outputs), wins at every K: its clusters spread each tile's K
// over up to 8 blocks, so the weight stream is split over tiles x splits >= 2 x SMs blocks (3072x768
// M 16 7-8 us, 768x768 5-6 us: about the M = 1 CUDA-core kernel's time at GPT-2 shapes;
// docs/lab-notes/linear-mlp.md).
bool gemv_wins(int64_t m, int64_t k, GemvPath path) {
  if (m <= 4) return true;
  switch (path) {
    case GemvPath::kSplitK: return true;
    case GemvPath::kTensorCores: return k <= 4096;
    default: return k < 2048;
  }
}

// 16-row tiles of the weight in the tensor-core kernels (8 gate over 8 up rows with SwiGLU).
int64_t mma_tiles(int64_t n_out, int64_t activation) {
  const int64_t cols = activation == kActSwiglu ? 8 : 16;
  return (n_out + cols - 1) / cols;
}

// Blocks of the split-K kernel per tile: the most that keep the grid at <= 1.5 blocks a SM, but at least
// enough that tiles x splits covers every SM once; at most a portable cluster, and no split without a chunk
// of 32 k (the count recomputed from the chunks per split, so the last split is the short one). GPT-2's
// projections (48 tiles, 132 SMs): 4 splits, where covering the SMs twice gave 6.
// Measured in GPT-2's captured step on an H200 (docs/lab-notes/linear-mlp.md; interleaved, us a step, 6 ->
// 4 splits): B4 198.6 -> 191.9, B8 241.4 -> 227.2, B16 305.0 -> 302.8, B1 unchanged (no split-K launch);
// 7 or 8 splits cost 27-42 us more than 6. Why fewer wins was not located (the split-K blocks start ~4-6 us
// under the kernel before them, PDL, and hold its SM slots: the guess). Not measured on an H100.
int splitk_splits(int64_t tiles, int64_t k, int sms) {
  const int64_t chunks = std::max<int64_t>(1, (k + 31) / 32);
  const int64_t cover = (sms + tiles - 1) / tiles, fill = 3 * int64_t(sms) / (2 * tiles);
  const int64_t want = std::min<int64_t>({kLinearMaxSplits, std::max(cover, fill), chunks});
  const int64_t per = (chunks + want - 1) / want;
  return int((chunks + per - 1) / per);
}

// The locals are named after the arguments: the check macros stringify them into the message. x is a CUDA
// tensor, so the same-device checks make the others CUDA tensors too.
// A norm's weight or bias: [want] (the dim called `label`) on x's device, x's dtype or float32.
#define FA_CHECK_AFFINE(t, want, label)                                                                     \
  FA_CHECK_SAME_DEVICE(t, x);                                                                               \
  FA_CHECK_ARG((t).scalar_type() == x.scalar_type() || (t).scalar_type() == at::kFloat, t,                  \
               "have x's dtype (" + dtype_str(x.scalar_type()) + ") or torch.float32",                     \
               dtype_str((t).scalar_type()));                                                               \
  FA_CHECK_ARG((t).dim() == 1 && (t).size(0) == (want), t,                                                  \
               "have shape (" label ",) = (" + std::to_string(want) + ",)", shape_str((t).sizes()))
// norm_weight / norm_bias: [in_features], only with a norm.
#define FA_CHECK_NORM_AFFINE(t)                                                                             \
  FA_CHECK_ARG(norm != kNormNone, t, "be None without a norm", "a tensor");                                 \
  FA_CHECK_AFFINE(t, x.size(-1), "in_features")

void check_norm_args(const at::Tensor& x, const std::optional<at::Tensor>& norm_weight_opt,
                     const std::optional<at::Tensor>& norm_bias_opt, int64_t norm, double eps) {
  FA_CHECK_ARG(norm >= kNormNone && norm <= kNormRms, norm, "be 0 (none), 1 (layer_norm) or 2 (rms_norm)",
               num_str(norm));
  FA_CHECK_ARG(std::isfinite(eps) && eps >= 0, eps, "be a finite number >= 0", num_str(eps));
  if (norm_weight_opt.has_value()) {
    const at::Tensor& norm_weight = *norm_weight_opt;
    FA_CHECK_NORM_AFFINE(norm_weight);
  }
  if (norm_bias_opt.has_value()) {
    const at::Tensor& norm_bias = *norm_bias_opt;
    FA_CHECK_NORM_AFFINE(norm_bias);
    FA_CHECK_ARG(norm != kNormRms, norm_bias, "be None with rms_norm", "a tensor");
  }
}

void check_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias_opt,
                const std::optional<at::Tensor>& residual_opt, int64_t activation) {
  FA_CHECK_CUDA(x);
  FA_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
               x, "have dtype float32, float16 or bfloat16", dtype_str(x.scalar_type()));
  FA_CHECK_ARG(x.dim() >= 1, x, "have at least 1 dim [..., in_features]", shape_str(x.sizes()));
  FA_CHECK_DIM(weight, 2, "[out_features, in_features]");
  FA_CHECK_SAME_DEVICE(weight, x);
  FA_CHECK_SAME_DTYPE(weight, x);
  FA_CHECK_LAST_DIM_CONTIGUOUS(weight);
  FA_CHECK_ARG(weight.size(1) == x.size(-1), weight,
               "have in_features = x's last dim (" + std::to_string(x.size(-1)) + ")", shape_str(weight.sizes()));
  FA_CHECK_ARG(activation >= kActNone && activation <= kActSwiglu, activation,
               "be 0 (none), 1 (gelu_tanh) or 2 (swiglu)", num_str(activation));
  FA_CHECK_ARG(activation != kActSwiglu || weight.size(0) % 2 == 0, weight,
               "have an even out_features (gate rows over up rows) for swiglu", shape_str(weight.sizes()));
  FA_CHECK_ARG(weight.size(0) < std::numeric_limits<int>::max() && weight.size(1) < std::numeric_limits<int>::max(),
               weight, "have fewer than 2**31 rows and columns", shape_str(weight.sizes()));
  if (bias_opt.has_value()) {
    const at::Tensor& bias = *bias_opt;
    FA_CHECK_SAME_DEVICE(bias, x);
    FA_CHECK_SAME_DTYPE(bias, x);
    FA_CHECK_ARG(bias.dim() == 1 && bias.size(0) == weight.size(0), bias,
                 "have shape (" + std::to_string(weight.size(0)) + ",)", shape_str(bias.sizes()));
  }
  if (residual_opt.has_value()) {
    const at::Tensor& residual = *residual_opt;
    std::vector<int64_t> want(x.sizes().begin(), x.sizes().end());
    want.back() = activation == kActSwiglu ? weight.size(0) / 2 : weight.size(0);
    FA_CHECK_SAME_DEVICE(residual, x);
    FA_CHECK_SAME_DTYPE(residual, x);
    FA_CHECK_ARG(residual.sizes() == at::IntArrayRef(want), residual, "have shape " + shape_str(want),
                 shape_str(residual.sizes()));
  }
}

int sm_count(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
}

// Launch shape: about the same number of 16-byte pieces of a row per thread (up to 256 threads), and
// as many weight rows per block (4, 2 or 1) as still leave two blocks per SM.
// The pre-normalization of a launch: norm code, its weight and bias (contiguous, or undefined), eps.
struct Norm {
  int64_t norm = kNormNone;
  at::Tensor weight, bias;
  double eps = 0;
  bool in_mma = false;  // normalized inside the tensor-core kernel (self_norm_in_mma)
};

// A norm over 2-8 rows of 16-bit x without the norm's weight and bias (the caller folded them into the
// weight, as fused_attn.gpt2's "folded" layer_norm does) normalizes inside the tensor-core kernel
// (kSelfNorm, linear_kernel.cuh: statistics from x's own pieces, applied in the epilogue) where that kernel
// runs: its short build (k <= 768) in one wave; else our layer_norm launch first, as before. Measured in
// GPT-2's captured step (H100, docs/lab-notes/linear-mlp.md, "Statistics from x itself"): B4 -11 to -15
// us a step, B8 -6 to -9; at 9-16 rows (two n-tiles) B16 +7 to +9 (alone the kernel costs 1.2 us more than
// the plain one at 16 rows, 0.8 at 8, against the ~1.4 us norm launch it saves), so from 9 rows the norm
// keeps its launch (kSelfNormMaxRows).
constexpr int64_t kSelfNormMaxRows = 8;
// One row into more than kOneRowNormMaxCols output columns (a vocabulary's lm_head): our layer_norm launch first,
// then the plain kernel. Each of the CUDA-core kernel's blocks normalizes the row again (the prologue) or folds the
// norm into its dot products, and at 50257 columns that is ~12.5k blocks, 47 waves. ln + lm_head 768 x 50257, one
// row, H200, bench.ab linear-one-row-wide-norm-first against the tree before (bench_linear, 2026-12-02), us: the
// norm's weight in the launch 75.7 -> 24.3 (fp16), 77.3 -> 25.9 (bf16); folded (no norm weight) 30.1 -> 24.5, 30.6
// -> 24.4; GPT-2's graph-fused step at batch 1 (its lm_head the folded one-row launch) 192.7 -> 188.4 us a step.
// At 768 x 2304 (GPT-2's c_attn) the launch keeps the norm (within 2% either way in the same call); widths between
// 2304 and 50257 were not measured.
constexpr int64_t kOneRowNormMaxCols = 16384;
bool self_norm_in_mma(const at::Tensor& x, const at::Tensor& weight, const Norm& norm, int64_t m, int64_t k,
                      int64_t n_out, int64_t activation) {
  if (norm.norm == kNormNone || norm.weight.defined() || norm.bias.defined()) return false;
  if (x.scalar_type() == at::kFloat || !mma_rows(m, k, true, false) || m > kSelfNormMaxRows || k % 8 != 0 ||
      !vector_ready(weight, 8))
    return false;
  const int sms = sm_count(x);
  const int64_t blocks = mma_tiles(n_out, activation);
  if (blocks < sms) return false;  // the split-K kernel's shapes
  bool fits = false;
  FA_DISPATCH_FLOAT(x.scalar_type(), x, [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) fits = linear_mma_self_norm_fits<scalar_t, 8>(k, blocks, sms);
  });
  return fits;
}

// A norm's weight or bias for the kernels: its data (nullptr if absent), and whether it is float32.
const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
bool is_fp32(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kFloat; }

void launch_gemv(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 const std::optional<at::Tensor>& residual2, int64_t activation, const Norm& norm,
                 const at::Tensor& out2) {
  LinearParams p = linear_params(x2, weight, bias, residual2, out2, activation);
  const int64_t vec = 16 / x2.element_size();
  p.vec = p.k % vec == 0 && vector_ready(x2, vec) && vector_ready(weight, vec);
  p.norm = int(norm.norm);
  p.norm_weight = data_or_null(norm.weight);
  p.norm_bias = data_or_null(norm.bias);
  p.nw_fp32 = is_fp32(norm.weight);
  p.nb_fp32 = is_fp32(norm.bias);
  p.eps = float(norm.eps);
  p.xs_pitch = linear_xs_pitch(p.k, int(x2.element_size()));
  const bool normed = p.norm != kNormNone;
  if (normed) {  // the weight and bias staged before the wait where cp.async can copy them and they fit
    const int w_bytes = norm.weight.defined() ? int(norm.weight.element_size()) : 0;
    const int b_bytes = norm.bias.defined() ? int(norm.bias.element_size()) : 0;
    const auto aligned = [&](const at::Tensor& t) {
      return !t.defined() || (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && p.k * t.element_size() % 16 == 0);
    };
    p.affine_smem = aligned(norm.weight) && aligned(norm.bias) &&
                    linear_norm_smem_bytes(p.m, p.k, int(x2.element_size()), w_bytes, b_bytes, true) <=
                        size_t(kLinearNormSmemBytes);
  }

  const int64_t pieces = std::max<int64_t>(1, (p.k + vec - 1) / vec);
  const int64_t per_thread = (pieces + kLinearMaxThreads - 1) / kLinearMaxThreads;
  const int threads = int(std::min<int64_t>(kLinearMaxThreads, ((pieces + per_thread - 1) / per_thread + 31) / 32 * 32));
  const bool swiglu = activation == kActSwiglu;
  const int sms = sm_count(x2);
  const int64_t min_blocks = 2 * int64_t(sms);
  int rows = 4;
  while (rows > (swiglu ? 2 : 1) && (p.n_out + (swiglu ? rows / 2 : rows) - 1) / (swiglu ? rows / 2 : rows) < min_blocks)
    rows /= 2;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t mma_blocks = mma_tiles(p.n_out, activation);
  const bool on_mma = mma_rows(p.m, p.k, normed, mma_blocks < sms) && p.vec && !normed;
  FA_DISPATCH_FLOAT(x2.scalar_type(), x, [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      const bool wide = p.m > 8;
      if (norm.in_mma && p.vec) {  // linear_impl's self_norm_in_mma held (2-8 rows)
        launch_linear_mma_self_norm<scalar_t, 8>(p, sms, stream);
        return;
      }
      // Otherwise the tensor-core kernels take no norm (linear_impl normalized 2-16 rows of 16-bit x first).
      if (on_mma && mma_blocks >= sms) {
        // More than kMmaWideMaxRows rows are not this kernel's (linear_impl sends none): the check below refuses them.
        if (p.m > kMaxGemvRows && p.m <= kMmaWideMaxRows) {
          if (linear_mma_arch<scalar_t, 32>() >= 80) {
            launch_linear_mma<scalar_t, 32>(p, sms, stream);
            return;
          }
        } else if (p.m <= kMaxGemvRows &&
                   (wide ? linear_mma_arch<scalar_t, 16>() : linear_mma_arch<scalar_t, 8>()) >= 80) {
          wide ? launch_linear_mma<scalar_t, 16>(p, sms, stream) : launch_linear_mma<scalar_t, 8>(p, sms, stream);
          return;
        }
      } else if (on_mma) {
        // The splits cover the SMs with every row group's tiles (33-64 rows: two groups).
        const int splits = splitk_splits(mma_blocks * linear_row_groups(p.m), p.k, sms);
        if (p.m > kMmaWideMaxRows) {  // linear_impl's wide_rows: 33-64 rows in row groups
          if (linear_splitk_arch<scalar_t, 64>() >= 90) {
            launch_linear_splitk<scalar_t, 64>(p, splits, sms, stream);
            return;
          }
        } else if (p.m > kMaxGemvRows) {
          if (linear_splitk_arch<scalar_t, 32>() >= 90) {
            launch_linear_splitk<scalar_t, 32>(p, splits, sms, stream);
            return;
          }
        } else if ((wide ? linear_splitk_arch<scalar_t, 16>() : linear_splitk_arch<scalar_t, 8>()) >= 90) {
          wide ? launch_linear_splitk<scalar_t, 16>(p, splits, sms, stream)
               : launch_linear_splitk<scalar_t, 8>(p, splits, sms, stream);
          return;
        }
      }
    }
    // The CUDA-core kernels take up to kLinearMaxRows rows: linear_impl sends more here only for the wide build,
    // which a build without sm_90 code (the arch probes above) cannot run.
    TORCH_CHECK(p.m <= kLinearMaxRows, "fused_attn.linear: the tensor-core kernels for ", p.m,
                " rows of x were not compiled for this GPU (sm_90 and later; rebuild with its arch)");
    FA_BOOL_SWITCH(normed, kNorm, [&] {
      if (p.m <= 1) launch_linear_gemv<scalar_t, 1, kNorm>(p, rows, threads, stream);
      else if (p.m <= 2) launch_linear_gemv<scalar_t, 2, kNorm>(p, rows, threads, stream);
      else if (p.m <= 4) launch_linear_gemv<scalar_t, 4, kNorm>(p, rows, threads, stream);
      else if (p.m <= 8) launch_linear_gemv<scalar_t, 8, kNorm>(p, rows, threads, stream);
      else launch_linear_gemv<scalar_t, 16, kNorm>(p, rows, threads, stream);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// More rows: cuBLAS. In float16 / bfloat16 one cuBLASLt call (linear_cublaslt.cpp) with the bias, GELU
// and (without GELU) the residual in its epilogue; Lt's GELU is the tanh approximation applied to the
// float32 accumulator before the one rounding, not F.gelu(approximate="tanh") bit for bit, which rounds
// the GEMM's output first. Elsewhere (float32: the epilogue's tanh is ~1e-6 relative off, more than our
// float32 tolerance; k = 0: with an empty reduction Lt returned GELU(0) = 0, not GELU(bias), both found by
// the GPU suite; layouts Lt does not take) ATen: addmm with the bias, or with a bias-free residual as its
// C operand (ATen copies it into the output first), then the rest of the epilogue in place. SwiGLU is one
// pass of our own over the GEMM's gate and up columns (linear_swiglu.cu), the residual added after it.
//
// A wide output whose rows are not whole 16-byte pieces (a vocabulary's lm_head: GPT-2's 50257 columns) keeps
// cuBLAS on its align-1 kernels: at [64, 768] x [768, 50257] fp16, cutlass_75_..._align1, 106.6 us (H200,
// bench.profile), against 24.2 for nvjet with 50304 columns; writing padded output rows did not help (0164d1c:
// the odd N itself keeps Lt there). So from kLtSplitMinCols columns, 16-bit: the first n8 = n - n % 8 columns are
// a GEMM of their own (a view of the weight's first rows, 16-byte aligned, into [m, n8]), the last n % 8 another,
// and one copy joins them (then the residual, in a pass of its own). ln + lm_head [m, 768] x [768, 50257] against
// one call (H200, bench.ab linear-lt-split-odd-wide against the tree before, bench_linear, 2026-12-02), us:
// fp16 64 rows 111.8 -> 40.8, 2048 rows 1934 -> 457 (torch.compile 292.7, eager 1567); bf16 161.0 -> 40.9 and
// 1732 -> 452. Only that width was measured; kLtSplitMinCols keeps narrower outputs, where the second GEMM and the
// copy weigh more, on one call.
constexpr int64_t kLtSplitMinCols = 4096;

at::Tensor linear_cublas(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual2, int64_t activation) {
  const int64_t n = weight.size(0);
  if (activation != kActSwiglu && x2.scalar_type() != at::kFloat && x2.is_cuda() && n % 8 != 0 &&
      n >= kLtSplitMinCols) {
    const int64_t n8 = n / 8 * 8;
    const auto part = [&](int64_t from, int64_t cols) {
      const std::optional<at::Tensor> b =
          bias.has_value() ? std::optional<at::Tensor>(bias->narrow(0, from, cols)) : std::nullopt;
      return linear_cublas(x2, weight.narrow(0, from, cols), b, std::nullopt, activation);
    };
    at::Tensor y = at::cat({part(0, n8), part(n8, n - n8)}, 1);
    if (residual2.has_value()) y.add_(*residual2);
    return y;
  }
  const bool gelu = activation == kActGeluTanh;
  at::Tensor y = cublaslt_linear(x2, weight, bias, activation == kActNone ? residual2 : std::nullopt, gelu);
  const bool lt = y.defined();
  const bool residual_c = residual2.has_value() && activation == kActNone && (lt || !bias.has_value());
  if (!lt) {
    y = bias.has_value() ? at::addmm(*bias, x2, weight.t())
        : residual_c     ? at::addmm(*residual2, x2, weight.t())
                         : at::mm(x2, weight.t());
    if (gelu) at::gelu_(y, "tanh");
  }
  if (activation == kActSwiglu) {
    // Our one pass (linear_swiglu.cu) on CUDA; ATen's silu and mul on the CPU.
    const int64_t n_out = weight.size(0) / 2;
    if (y.is_cuda()) {
      at::Tensor h = at::empty({y.size(0), n_out}, y.options());
      FA_DISPATCH_FLOAT(y.scalar_type(), t, [&] {
        launch_swiglu<scalar_t>(y.data_ptr(), y.stride(0), h.data_ptr(), h.stride(0), y.size(0), n_out,
                                at::cuda::getCurrentCUDAStream());
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      y = h;
    } else {
      y = at::silu(y.narrow(1, 0, n_out)).mul_(y.narrow(1, n_out, n_out));
    }
  }
  if (residual2.has_value() && !residual_c) y.add_(*residual2);
  return y;
}

// x2 [m, k] normalized in a launch of its own (where the kernels' prologue does not run): our layer_norm
// op for the widths it takes, else the same float32 arithmetic in ATen (a handful of launches).
at::Tensor normalized(const at::Tensor& x2, const Norm& norm) {
  const int64_t k = x2.size(1);
  const bool rms = norm.norm == kNormRms;
  const std::optional<at::Tensor> w = norm.weight.defined() ? std::optional<at::Tensor>(norm.weight) : std::nullopt;
  const std::optional<at::Tensor> b = norm.bias.defined() ? std::optional<at::Tensor>(norm.bias) : std::nullopt;
  if (k >= kNormOpMinWidth && k <= kNormOpMaxWidth) {
    return layer_norm(x2, w, b, norm.eps, rms);  // the CUDA implementation: no dispatcher hop
  }
  if (k == 0 || x2.size(0) == 0) return x2;
  const at::Tensor xf = x2.to(at::kFloat);
  // LayerNorm: the row shifted by its first element, as the kernels do (exact zeros for equal values).
  const at::Tensor d = rms ? xf : xf - xf.narrow(1, 0, 1);
  const at::Tensor c = rms ? d : d - d.mean(1, true);
  at::Tensor y = c * (c.square().mean(1, true) + norm.eps).rsqrt();
  if (w.has_value()) y = y * w->to(at::kFloat);
  if (b.has_value()) y = y + b->to(at::kFloat);
  return y.to(x2.scalar_type());
}

at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
                       const std::optional<at::Tensor>& norm_bias, int64_t activation, int64_t norm_code, double eps) {
  Norm norm;
  norm.norm = norm_code;
  norm.eps = eps;
  if (norm_weight.has_value()) norm.weight = norm_weight->contiguous();
  if (norm_bias.has_value()) norm.bias = norm_bias->contiguous();
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = weight.size(1);
  const int64_t n_out = activation == kActSwiglu ? weight.size(0) / 2 : weight.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n_out;
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  at::Tensor x2 = x.reshape({m, k});
  std::optional<at::Tensor> residual2;
  if (residual.has_value()) residual2 = residual->reshape({m, n_out});
  // A norm over 2-32 rows of float16 / bfloat16: our layer_norm launch first, then the plain kernels.
  // The kernels' prologue (normalize in shared memory, then multiply) measured slower than the two
  // launches in GPT-2's chained step at every batch (docs/lab-notes/linear-mlp.md). One row (into at most
  // kOneRowNormMaxCols columns) keeps it in the launch: the prologue, or without the norm's weight and bias the
  // fold into the dot products (linear_kernel.cuh, kFold); 2-8 rows without them, where the tensor-core kernel
  // runs in one wave, the same fold on tensor cores (self_norm_in_mma, kSelfNorm).
  if (norm.norm != kNormNone && x.scalar_type() != at::kFloat && m == 1 && n_out > kOneRowNormMaxCols) {
    x2 = normalized(x2, norm);
    norm = Norm{};
  }
  if (norm.norm != kNormNone && x.scalar_type() != at::kFloat && m >= 2 && m <= kMmaWideMaxRows) {
    if (self_norm_in_mma(x, weight, norm, m, k, n_out, activation)) {
      norm.in_mma = true;
    } else {
      x2 = normalized(x2, norm);
      norm = Norm{};
    }
  }
  // The path launch_gemv will take (the split-K kernel: no norm, 16-byte weight rows and an sm_90
  // device; x is made 16-byte ready below).
  GemvPath path = GemvPath::kCudaCores;
  const bool split_k_class = mma_tiles(n_out, activation) < sm_count(x);
  if (x.scalar_type() != at::kFloat && mma_rows(m, k, norm.norm != kNormNone, split_k_class)) {
    if (!split_k_class) {
      path = GemvPath::kTensorCores;
    } else if (norm.norm == kNormNone && k % 8 == 0 && vector_ready(weight, 8) &&
               at::cuda::getDeviceProperties(x.device().index())->major >= 9) {
      path = GemvPath::kSplitK;
    }
  }
  // 17-32 rows: the wide build of the tensor-core kernels (split-K included), which need what path says; 33-64 rows
  // the split-K kernel's wide build in row groups.
  const bool wide_rows = m > kMaxGemvRows && k % 8 == 0 && vector_ready(weight, 8) &&
                         at::cuda::getDeviceProperties(x.device().index())->major >= 9 &&
                         ((m <= kMmaWideMaxRows && path == GemvPath::kTensorCores) ||
                          (m <= kSplitKGroupMaxRows && path == GemvPath::kSplitK));
  if ((m > kMaxGemvRows && !wide_rows) || !gemv_wins(m, k, path)) {
    if (norm.norm != kNormNone) x2 = normalized(x2, norm);
    return linear_cublas(x2, weight, bias, residual2, activation).view(out_shape);
  }
  // Few rows: small copies make every row's last dim contiguous (and x's rows 16-byte aligned).
  const int64_t vec = 16 / x.element_size();
  if (m > 0 && (x2.stride(1) != 1 || !vector_ready(x2, vec))) x2 = x2.clone(at::MemoryFormat::Contiguous);
  if (norm.norm != kNormNone &&
      linear_norm_smem_bytes(int(m), int(k), int(x.element_size()), 0, 0, false) > size_t(kLinearNormSmemBytes)) {
    x2 = normalized(x2, norm);  // the rows do not fit the prologue's shared memory
    norm = Norm{};
  }
  if (residual2.has_value() && residual2->stride(1) != 1) residual2 = residual2->contiguous();
  std::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();
  at::Tensor out = at::empty(out_shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() > 0) launch_gemv(x2, weight, bias_c, residual2, activation, norm, out.view({-1, n_out}));
  return out;
}

}  // namespace

// Argument order follows the schema in fused_attn/_ops.py.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
                  const std::optional<at::Tensor>& norm_bias, int64_t activation, int64_t norm_code, double eps) {
  check_args(x, weight, bias, residual, activation);
  check_norm_args(x, norm_weight, norm_bias, norm_code, eps);
  return linear_impl(x, weight, bias, residual, norm_weight, norm_bias, activation, norm_code, eps);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("linear", &linear);
}

}  // namespace fused_attn
