// Kernel attributes a launch needs (more than 48 KB of dynamic shared memory, clusters of more than 8 blocks),
// set once per kernel and device instead of before every launch. cudaFuncSetAttribute is a driver call: set on
// every launch it cost the tensor-core decode kernel's eager call 12.0 us of host time against 8.6 us set once
// (H200, GQA 32/8, head dim 128, 1024 keys, `decode_attention` in a loop; 2026-11-30).
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

namespace fused_attn {

// cudaFuncSetAttribute(kernel, attr, value) unless this device's kernel already has attr >= value (both attributes
// used here are "at most": a larger allowance serves a smaller launch). A failed call is returned and not
// remembered, so the launch that follows fails as it would have. Thread-safe; kernels x devices x attributes
// entries (tens).
inline cudaError_t allow_func_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  struct Entry {
    const void* kernel;
    int device;
    cudaFuncAttribute attr;
    int value;
  };
  static std::mutex mu;
  static std::vector<Entry> set;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return cudaFuncSetAttribute(kernel, attr, value);
  std::lock_guard<std::mutex> lock(mu);
  Entry* found = nullptr;
  for (Entry& e : set) {
    if (e.kernel == kernel && e.device == device && e.attr == attr) found = &e;
  }
  if (found != nullptr && found->value >= value) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, attr, value);
  if (err == cudaSuccess) {
    if (found != nullptr) {
      found->value = value;
    } else {
      set.push_back({kernel, device, attr, value});
    }
  }
  return err;
}

// The dynamic shared memory a launch of kernel takes, allowed where it is past the default 48 KB.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return allow_func_attribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              bytes);
}

// Clusters of more than 8 blocks (the portable limit) allowed for kernel.
template <typename Kernel>
cudaError_t allow_large_clusters(Kernel* kernel) {
  return allow_func_attribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeNonPortableClusterSizeAllowed,
                              1);
}

}  // namespace fused_attn
