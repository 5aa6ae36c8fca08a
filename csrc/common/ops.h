// The CUDA implementations of the ops (schemas: fused_attn/_ops.py), as the dispatcher's CUDA kernels
// (TORCH_LIBRARY_IMPL in csrc/<op>/<op>.cpp) and the direct path (csrc/direct/direct.cpp) both call
// them. Each op's launcher includes this header, so a definition that drifts from its declaration
// fails to compile instead of leaving the direct path an undefined symbol.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace fused_attn {

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps, bool rms);
std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, double eps,
                                                  const std::optional<at::Tensor>& x_index,
                                                  const std::optional<at::Tensor>& residual_index, bool rms);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
                  const std::optional<at::Tensor>& norm_bias, int64_t activation, int64_t norm_code, double eps);
at::Tensor mlp(const at::Tensor& x, const at::Tensor& w_fc, const std::optional<at::Tensor>& b_fc,
               const at::Tensor& w_proj, const std::optional<at::Tensor>& b_proj,
               const std::optional<at::Tensor>& residual, int64_t activation);
at::Tensor scaled_masked_softmax(const at::Tensor& x, double scale, const std::optional<at::Tensor>& attn_mask,
                                 bool causal, int64_t version);
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const std::optional<at::Tensor>& attn_mask, std::optional<double> scale,
                                             bool causal, c10::string_view mode, bool return_lse);
void attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, bool causal,
                   c10::string_view mode, const at::Tensor& out, const at::Tensor& lse);
at::Tensor sample(const at::Tensor& logits, double temperature, int64_t seed, int64_t offset,
                  const std::optional<at::Tensor>& offsets, int64_t top_k);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                            const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_leftpad,
                            const std::optional<at::Tensor>& key_mask, std::optional<double> scale, int64_t num_splits,
                            const std::optional<at::Tensor>& block_table,
                            const std::optional<at::Tensor>& cu_seqlens_q, int64_t max_seqlen_q);
at::Tensor qkv_decode_attention(const at::Tensor& x, const at::Tensor& w_qkv, const std::optional<at::Tensor>& b_qkv,
                                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                const std::optional<at::Tensor>& cache_leftpad, double eps, double scale);

}  // namespace fused_attn
