// Every schema of the fused_attn library, in one place. Each op's CUDA kernels
// are bound in its own .cu file (TORCH_LIBRARY_IMPL(fused_attn, CUDA, m)); the
// CPU path and the fake (meta) implementations are registered from Python
// (fused_attn/<op>.py), so the API works without a GPU and under torch.compile.
#include <torch/library.h>

TORCH_LIBRARY(fused_attn, m) {
  // softmax(x * scale + attn_mask) over the last dim of x [..., seqlen_q, seqlen_k];
  // causal masks key j for query i unless j <= i + seqlen_k - seqlen_q.
  // version: 0 = textbook kernel, 1 = fused kernel (default).
  // attn_mask is positional here (keyword-only in the Python API): torch.library's
  // register_autograd takes no keyword-only tensors, and an additive mask can require grad.
  m.def(
      "scaled_masked_softmax(Tensor x, float scale=1.0, Tensor? attn_mask=None, *, "
      "bool causal=False, int version=1) -> Tensor");
  // The out= variant records no gradient: it raises when an input requires grad.
  m.def(
      "scaled_masked_softmax_out(Tensor x, float scale, Tensor? attn_mask, *, bool causal, "
      "int version, Tensor(a!) out) -> ()");
  // Backward of scaled_masked_softmax: dx = scale * y * (grad - sum_j grad * y) per row, with
  // y the forward's output (its zeros carry the mask). Differentiable again (double backward).
  m.def("scaled_masked_softmax_backward(Tensor grad, Tensor y, float scale, *, bool causal=False) -> Tensor");
}
