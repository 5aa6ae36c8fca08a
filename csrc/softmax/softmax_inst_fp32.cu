// Instantiations of softmax v0, v1 and the backward for float (see softmax_kernel.cuh). One file per
// dtype so the build compiles the kernels in parallel.
#include "softmax_kernel.cuh"

namespace fused_attn {
template void launch_v0<float>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<float, 16 / sizeof(float)>(const SoftmaxParams&, cudaStream_t);
template void launch_v1<float, 1>(const SoftmaxParams&, cudaStream_t);
template void launch_backward<float, 16 / sizeof(float)>(const SoftmaxBackwardParams&, cudaStream_t);
template void launch_backward<float, 1>(const SoftmaxBackwardParams&, cudaStream_t);
}  // namespace fused_attn
