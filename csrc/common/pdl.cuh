// Programmatic dependent launch (Hopper, sm_90) for the kernels of a decode step (torch-free).
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the
// kernel before it on the stream is still running: from the moment every block of that one has
// executed launch_dependents() (or exited). Until it calls wait_for_primary() it must neither read
// what earlier kernels wrote nor write anything; what it may do is fetch its own constants (a
// GEMV's weights, a norm's weight and bias), which is the overlap PDL buys. wait_for_primary()
// returns once the earlier kernels have completed and their writes are visible. Both are no-ops in a
// launch without the attribute, and below sm_90 (where the attribute is not set).
#pragma once

#include <cuda_runtime.h>

namespace fused_attn {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launch `kernel` with the programmatic-serialization attribute where `programmatic` (the kernel
// compiled for sm_90 or later: its wait_for_primary() is real), else as a plain launch.
template <typename... Args>
cudaError_t launch_programmatic(bool programmatic, void (*kernel)(Args...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Whether `kernel` was compiled for sm_90 or later (its griddepcontrol instructions are there).
template <typename... Args>
bool programmatic_capable(void (*kernel)(Args...)) {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90;
}

}  // namespace fused_attn
