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
//
// Pushes (st.async): remote stores into another block's shared memory whose bytes complete on that
// block's mbarrier (common/mbarrier.cuh: the receiver expects the bytes, then waits on its own barrier),
// so the sender needs no barrier after them and may exit at once. The receiver's mbarrier must be
// initialized and fenced (mbarrier_init_for_pushes, common/mbarrier.cuh) before its block arrives on the
// cluster barrier's first phase, and a sender pushes only after that phase's wait. Used by
// decode_attention's cluster merge, linear's split-K reduction and sample's row maximum.
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace fused_attn {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// The shared::cluster address of `local` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_addr(const void* local, int rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_addr(local)), "r"(rank));
  return a;
}
// A 32-bit load from the shared memory of a block of the cluster (an address from cluster_addr).
__device__ __forceinline__ uint32_t load_cluster_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// Remote stores whose bytes complete on the receiving block's mbarrier (no fence, nothing to wait for here).
__device__ __forceinline__ void push_f32(uint32_t addr, float v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
               "r"(__float_as_uint(v)), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void push_f32x2(uint32_t addr, float v0, float v1, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n" ::"r"(addr),
               "r"(__float_as_uint(v0)), "r"(__float_as_uint(v1)), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void push_u64(uint32_t addr, unsigned long long v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];\n" ::"r"(addr), "l"(v),
               "r"(bar)
               : "memory");
}
__device__ __forceinline__ void push_f32x4(uint32_t addr, float4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   addr),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(bar)
               : "memory");
}
#endif

}  // namespace fused_attn
