// The kernel's instantiations (float16, bfloat16).
#include "qkv_decode_attention_kernel.cuh"

namespace fused_attn {
template cudaError_t launch_qkv_decode_attention<__half>(const QkvParams&, cudaStream_t);
template cudaError_t launch_qkv_decode_attention<__nv_bfloat16>(const QkvParams&, cudaStream_t);
template bool qkv_decode_attention_compiled<__half>();
template bool qkv_decode_attention_compiled<__nv_bfloat16>();
}  // namespace fused_attn
