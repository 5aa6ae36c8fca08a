// Waiting on other blocks of the same grid through a counter in global memory (torch-free): the
// persistent GPT-2 step's grid barrier (csrc/gpt2_decode_step) and the single-launch MLP's wait for
// the first projection's tiles (csrc/mlp). Such a wait is correct only where every block it waits on
// is resident at the same time (a cooperative launch, or the launcher's occupancy check).
#pragma once

#include <cstdint>

namespace fused_attn {

__device__ __forceinline__ unsigned load_acquire(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// One arrival on *ptr, ordered after this thread's earlier writes (and, behind a __syncthreads, its
// block's): a reduction, nothing to wait for.
__device__ __forceinline__ void add_release(unsigned* ptr, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// A wait on other blocks that outlasts 10 s can only be a bug (a block that never arrives): trap, so
// the launch fails instead of hanging the GPU.
constexpr uint64_t kHangNs = 10000000000ull;

// Spin until *ptr >= target (acquire: the writes released before the arrivals are visible after).
__device__ __forceinline__ void wait_at_least(const unsigned* ptr, unsigned target) {
  if (load_acquire(ptr) >= target) return;
  const uint64_t t0 = global_ns();
  while (load_acquire(ptr) < target) {
    if (global_ns() - t0 > kHangNs) __trap();
  }
}

}  // namespace fused_attn
