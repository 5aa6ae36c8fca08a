// Scalar math shared by the kernels (torch-free): NaN-propagating max, the all-masked-safe shifted
// exponential, single-instruction exp2 / reciprocal, the tanh GELU and SiLU.
#pragma once

namespace fused_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// max that propagates NaN (fmaxf drops it), so a NaN score poisons its row
// exactly as torch.softmax does.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? (a + b) : fmaxf(a, b);
#endif
}

// exp(t - m) that treats an all-masked row (m == -inf) as contributing 0
// instead of exp(-inf + inf) = NaN. Scores stay in the natural-log domain and
// only the difference is scaled by log2(e): a score of finfo(float32).min (the
// additive mask Hugging Face uses) would overflow to -inf if scaled first, and
// a row masked that way must come out uniform, as in PyTorch.
__device__ __forceinline__ float exp_shifted(float t, float m) {
  return m == kNegInf ? 0.f : exp2f((t - m) * kLog2e);
}

// 2^x as one MUFU.EX2 (exp2f adds range fix-ups for denormal results). Results
// below 2^-126 flush to 0: such a probability is below 1.2e-38 of the row's max.
__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 1/x as one MUFU.RCP (max 1 ulp; 1.f / x adds a Newton step and a slow-path
// call). Used for 1 / (sum of exps), which lies in [1, seqlen_k].
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// PyTorch's F.gelu(approximate="tanh"): 0.5 y (1 + tanh(sqrt(2 / pi) (y + 0.044715 y^3))).
__device__ __forceinline__ float gelu_tanh(float y) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  return 0.5f * y * (1.f + tanhf(kBeta * (y + kKappa * y * y * y)));
}

// F.silu as PyTorch computes it, y / (1 + e^-y): -0 once e^-y overflows, NaN at y = -inf (as F.silu).
__device__ __forceinline__ float silu(float y) { return y / (1.f + expf(-y)); }

}  // namespace fused_attn
