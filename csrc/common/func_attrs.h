// Kernel attributes a launch needs (more than 48 KB of dynamic shared memory, clusters of more than 8 blocks),
// set once per kernel and device instead of before every launch: cudaFuncSetAttribute is a driver call, and an
// eager tensor-core decode call read 12.0 us of host time with it on every launch against 8.6 us set once (H200,
// GQA 32/8, head dim 128, 1024 keys, two rounds with a spread as large; docs/lab-notes/host-overhead.md).
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

namespace fused_attn {

// The allowances set so far, kernel x device x attribute (tens of entries), and the rule: set(kernel, attr, value)
// unless this device's kernel already has attr >= value (both attributes used here are "at most": a larger
// allowance serves a smaller launch). A failed set is returned and not remembered, so the launch that follows fails
// as it would have. Thread-safe. `set` is cudaFuncSetAttribute in the library (allow_func_attribute below); a
// stand-in in tests/test_func_attrs.py.
class FuncAttrTable {
 public:
  template <typename Set>
  cudaError_t allow(int device, const void* kernel, cudaFuncAttribute attr, int value, Set set) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* found = nullptr;
    for (Entry& e : entries_) {
      if (e.kernel == kernel && e.device == device && e.attr == attr) found = &e;
    }
    if (found != nullptr && found->value >= value) return cudaSuccess;
    const cudaError_t err = set(kernel, attr, value);
    if (err == cudaSuccess) {
      if (found != nullptr) {
        found->value = value;
      } else {
        entries_.push_back({kernel, device, attr, value});
      }
    }
    return err;
  }

 private:
  struct Entry {
    const void* kernel;
    int device;
    cudaFuncAttribute attr;
    int value;
  };
  std::mutex mu_;
  std::vector<Entry> entries_;
};

// cudaFuncSetAttribute(kernel, attr, value) where the current device's kernel does not have it yet (FuncAttrTable);
// on every call where the current device cannot be told.
inline cudaError_t allow_func_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  static FuncAttrTable table;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return cudaFuncSetAttribute(kernel, attr, value);
  return table.allow(device, kernel, attr, value, [](const void* k, cudaFuncAttribute a, int v) {
    return cudaFuncSetAttribute(k, a, v);
  });
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

// How many clusters of `cluster` blocks of kernel (`threads` a block, `smem` bytes of dynamic shared memory) the
// current device holds at once (cudaOccupancyMaxActiveClusters, asked of a grid of one cluster); 0 where the query
// fails (its error cleared: the launch reports its own). The kernel's allowances (allow_dynamic_smem,
// allow_large_clusters) are the caller's to set first.
template <typename Kernel>
int max_active_clusters(Kernel* kernel, dim3 cluster, int threads, size_t smem) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x;
  attr.val.clusterDim.y = cluster.y;
  attr.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = cluster;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(kernel), &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace fused_attn
