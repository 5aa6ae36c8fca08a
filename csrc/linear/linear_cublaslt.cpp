// linear's many-row GEMM through cuBLASLt (PyTorch links it; fused_attn/build.py links us to the same
// library): y = act(x · Wᵀ + b) + residual as one cublasLtMatmul. ATen's addmm reaches the BIAS and
// GELU_BIAS epilogues but takes a residual only as C == D: it first copies the residual into the output
// (a DtoD pass, 23 us at Llama-2-7B's M = 4096 down projection; torch.compile's addmm pays the same), or
// the add runs as its own pass after. Lt reads C and writes D separately, so the residual costs the GEMM's
// epilogue one more read and nothing else (docs/lab-notes/linear-mlp.md).
#include "linear_cublaslt.h"

#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace fused_attn {

namespace {

// The workspace the algorithm may use, from PyTorch's caching allocator on the current stream (no
// cudaMalloc after the first call; inside a CUDA graph capture, the graph's pool).
constexpr int64_t kWorkspaceBytes = int64_t(32) << 20;

// The largest of 16, 8, 4, 2 that divides the address and the row pitch (bytes).
uint32_t alignment(const void* ptr, int64_t ld, int64_t elem_bytes) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | uint64_t(ld * elem_bytes);
  for (uint32_t a = 16; a > 1; a /= 2)
    if (bits % a == 0) return a;
  return 1;
}

template <typename H, cublasStatus_t (*Destroy)(H)>
struct LtDeleter {
  void operator()(H h) const {
    if (h) Destroy(h);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t,
                                   LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t,
                               LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                                   LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

// One attribute of a matmul descriptor or a preference; false where Lt refuses it.
template <typename V>
bool set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}
template <typename V>
bool set_attr(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const V& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

// A column-major rows x cols layout with leading dimension ld, or null if Lt refuses it.
Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  if (cublasLtMatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), ld) != CUBLAS_STATUS_SUCCESS) return {};
  return Layout(l);
}

}  // namespace

at::Tensor cublaslt_linear(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual2, bool gelu) {
  const auto st = x2.scalar_type();
  const int64_t m = x2.size(0), k = x2.size(1), n = weight.size(0);
  const bool residual_c = residual2.has_value() && !gelu;
  const bool ok = x2.is_cuda() && (st == at::kHalf || st == at::kBFloat16) && m > 0 && n > 0 && k > 0 &&
                  x2.stride(1) == 1 && weight.stride(1) == 1 && weight.scalar_type() == st &&
                  // rows that do not overlap (an expanded x or residual, stride 0, takes ATen's path)
                  (m == 1 || x2.stride(0) >= k) && (n == 1 || weight.stride(0) >= k) &&
                  (!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == st &&
                                         reinterpret_cast<uintptr_t>(bias->data_ptr()) % 16 == 0)) &&
                  (!residual_c || (residual2->stride(1) == 1 && residual2->scalar_type() == st &&
                                   (m == 1 || residual2->stride(0) >= n)));
  if (!ok) return {};
  const cudaDataType_t type = st == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  const int64_t es = x2.element_size();
  at::Tensor out = at::empty({m, n}, x2.options());

  // Row-major out [m, n] is column-major Dᵀ [n, m]: D = op(A) · B (+ C) with A = W (column-major k x n,
  // transposed), B = x (column-major k x m). The bias runs along D's rows (n), as Lt's BIAS epilogue adds it.
  const int64_t ldw = std::max<int64_t>(weight.stride(0), k), ldx = std::max<int64_t>(x2.stride(0), k);
  const int64_t ldc = residual_c ? std::max<int64_t>(residual2->stride(0), n) : n;
  cublasLtMatmulDesc_t raw_desc = nullptr;
  if (cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return {};
  MatmulDesc desc(raw_desc);
  const cublasLtEpilogue_t epi = bias.has_value() ? (gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
                                 : gelu           ? CUBLASLT_EPILOGUE_GELU
                                                  : CUBLASLT_EPILOGUE_DEFAULT;
  bool set = set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T) &&
             set_attr(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N) &&
             set_attr(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, epi) &&
             (!bias.has_value() || set_attr(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data_ptr()));
  // C is the residual, or (beta = 0, not read) D itself.
  const Layout a = layout(type, k, n, ldw), b = layout(type, k, m, ldx), d = layout(type, n, m, n);
  const Layout c = residual_c ? layout(type, n, m, ldc) : Layout{};
  const cublasLtMatrixLayout_t c_desc = residual_c ? c.get() : d.get();
  if (!set || !a || !b || !c_desc || !d) return {};

  cublasLtMatmulPreference_t raw_pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&raw_pref) != CUBLAS_STATUS_SUCCESS) return {};
  Preference pref(raw_pref);
  const void* c_ptr = residual_c ? residual2->data_ptr() : out.data_ptr();
  set = set_attr(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kWorkspaceBytes)) &&
        set_attr(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(weight.data_ptr(), ldw, es)) &&
        set_attr(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(x2.data_ptr(), ldx, es)) &&
        set_attr(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(c_ptr, ldc, es)) &&
        set_attr(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(out.data_ptr(), n, es));
  if (!set) return {};

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), a.get(), b.get(), c_desc, d.get(),
                                     pref.get(), 1, &heuristic, &found) != CUBLAS_STATUS_SUCCESS ||
      found == 0) {
    return {};
  }
  const at::Tensor workspace = at::empty({int64_t(heuristic.workspaceSize)}, x2.options().dtype(at::kByte));
  const float alpha = 1.f, beta = residual_c ? 1.f : 0.f;
  const cublasStatus_t s =
      cublasLtMatmul(handle, desc.get(), &alpha, weight.data_ptr(), a.get(), x2.data_ptr(), b.get(), &beta, c_ptr,
                     c_desc, out.data_ptr(), d.get(), &heuristic.algo,
                     workspace.data_ptr(), heuristic.workspaceSize, at::cuda::getCurrentCUDAStream());
  if (s != CUBLAS_STATUS_SUCCESS) return {};
  return out;
}

}  // namespace fused_attn
