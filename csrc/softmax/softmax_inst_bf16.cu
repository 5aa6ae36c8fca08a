// Instantiations of softmax v0, v1 and the backward for __nv_bfloat16 (see softmax_kernel.cuh). One file per
// dtype so the build compiles the kernels in parallel.
#include "softmax_kernel.cuh"

namespace fused_attn {
template void launch_v0<__nv_bfloat16>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<__nv_bfloat16, 16 / sizeof(__nv_bfloat16)>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<__nv_bfloat16, 1>(const SoftmaxParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 16 / sizeof(__nv_bfloat16)>(const SoftmaxBackwardParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 1>(const SoftmaxBackwardParams&, cudaStream_t);
}  // namespace fused_attn
