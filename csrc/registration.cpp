// Every schema of the fused_attn library, in one place. Each op's CUDA kernels
// are bound in its own .cu file (TORCH_LIBRARY_IMPL(fused_attn, CUDA, m)); the
// CPU path and the fake (meta) implementations are registered from Python
// (fused_attn/<op>.py), so the API works without a GPU and under torch.compile.
#include <torch/library.h>

TORCH_LIBRARY(fused_attn, m) {
  // softmax(x * scale + attn_mask) over the last dim of x [..., seqlen_q, seqlen_k];
  // causal masks key j for query i unless j <= i + seqlen_k - seqlen_q.
  // version: 0 = textbook kernel, 1 = fused kernel (default).
  m.def(
      "scaled_masked_softmax(Tensor x, float scale=1.0, *, bool causal=False, "
      "Tensor? attn_mask=None, int version=1) -> Tensor");
  m.def(
      "scaled_masked_softmax_out(Tensor x, float scale, *, bool causal, "
      "Tensor? attn_mask, int version, Tensor(a!) out) -> ()");
}
