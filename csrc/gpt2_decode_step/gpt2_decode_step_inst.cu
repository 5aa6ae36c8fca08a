// The kernel's instantiations (float16, bfloat16).
#include "gpt2_decode_step_kernel.cuh"

namespace fused_attn {
template cudaError_t launch_gpt2_decode_step<__half>(const StepParams&, int, cudaStream_t);
template cudaError_t launch_gpt2_decode_step<__nv_bfloat16>(const StepParams&, int, cudaStream_t);
}  // namespace fused_attn
