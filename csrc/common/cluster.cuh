// Thread-block cluster barriers (sm_90) as their two halves, for kernels whose blocks exchange data
// through distributed shared memory (torch-free).
//
// cooperative_groups' cluster.sync() is arrive + wait back to back. Split, a kernel can arrive early
// and wait late: a block may touch another block's shared memory only once that block has started,
// which the first completed phase of the barrier guarantees, so a kernel arrives (relaxed: nothing to
// publish yet) at its start and waits right before its first remote access, with its own work in
// between. The release / acquire pair orders shared-memory writes before the reads of other blocks
// after their wait. Threads that exit count as arrived; every instruction here is .aligned: all threads
// of a warp execute it together.
#pragma once

namespace fused_attn {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
#endif

}  // namespace fused_attn
