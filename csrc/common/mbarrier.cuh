// Shared-memory mbarriers, named barriers and TMA copies (torch-free, sm_90): the producer /
// consumer ring of attention_flash_wgmma_kernel (csrc/attention/attention_wgmma.cuh), and the
// mbarriers of the split-K, decode-attention and sample kernels.
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace fused_attn {

// Shared-memory mbarriers (CTA scope) for a producer / consumer ring: init by one thread (then a
// block barrier), arrive (release), and wait for the phase of parity `phase` to complete (acquire).
// A fresh barrier is in phase 0: waiting on parity 1 returns at once (a stage starts empty).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int phase) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}
// Makes this thread's earlier mbarrier_init calls visible to the other blocks of the cluster (and to the
// async proxy) before the block arrives on a cluster barrier: what a barrier that TMA copies or other
// blocks' st.async pushes complete on needs.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The mbarrier that other blocks of the cluster push bytes onto (common/cluster.cuh: st.async): one
// arrival (the receiver's expect_tx), initialized and fenced by one thread before its block's arrive.
__device__ __forceinline__ void mbarrier_init_for_pushes(uint64_t* bar) {
  mbarrier_init(bar, 1);
  fence_mbarrier_init();
}
// Named barriers (ids 1..15; 0 is __syncthreads) between some warps of the block: arrive does not
// wait, sync waits until `threads` threads arrived or synced on the id.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The arrival of a producer that will make `bytes` land on `bar` through the async proxy (TMA): the
// phase completes when the arrival count and those bytes are both in.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// One TMA tensor copy global -> shared memory: the box of the 4-D tensor map `map` (a __grid_constant__
// kernel parameter: common/tma.h) at coordinates (c0 innermost .. c3) into dst (1024-byte aligned for
// the 128-byte swizzle), its bytes counted on `bar`. The whole box counts, also where it leaves the
// tensor (those elements land as zeros).
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace fused_attn
