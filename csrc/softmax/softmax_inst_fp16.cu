// Instantiations of softmax v0, v1 and the backward for __half (see softmax_kernel.cuh). One file per
// dtype so the build compiles the kernels in parallel.
#include "softmax_kernel.cuh"

namespace fused_attn {
template void launch_v0<__half>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<__half, 16 / sizeof(__half)>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<__half, 1>(const SoftmaxParams&, cudaStream_t);
template void launch_backward<__half, 16 / sizeof(__half)>(const SoftmaxBackwardParams&, cudaStream_t);
template void launch_backward<__half, 1>(const SoftmaxBackwardParams&, cudaStream_t);
}  // namespace fused_attn
