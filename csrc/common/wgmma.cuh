// Hopper warpgroup MMA building blocks (torch-free, sm_90a): shared-memory matrix descriptors for
// 128-byte-swizzled tiles, the wgmma fence / commit / wait instructions, and
// wgmma.mma_async m64nNk16 (N = 64, 128) with float32 accumulators, A from shared memory (SS) or
// from registers (RS), float16 / bfloat16 inputs. Used by attention's attention_flash_wgmma_kernel
// (csrc/attention/attention_wgmma.cuh). Every instruction here exists only in an sm_90a device
// pass (__CUDA_ARCH_FEAT_SM90_ALL); callers guard their kernels the same way.
//
// The shared-memory layout every operand uses ("SW128 panels"): a [rows][cols] tile of 16-bit
// elements is stored as cols / 64 panels of [rows][64] (128 bytes a row), panel after panel; in a
// panel, the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row: the 128-byte swizzle
// the tensor cores undo from the address bits, so every tile must start 1024-byte aligned.
// wgmma reads such a tile either K-major (rows = M or N, the 64 columns of a panel = K: Q and K
// in S = Q·Kᵀ) or MN-major (rows = K, columns = N: V in O = P·V, the instruction's transpose bit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mbarrier.cuh"
#include "mma.cuh"

namespace fused_attn {

// Element offset of 16-byte chunk c (8 elements) of row r in a SW128-panel tile of `rows` rows.
template <int ROWS>
__device__ __forceinline__ int sw128_offset(int r, int c) {
  return (c >> 3) * (ROWS * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// The 64-bit matrix descriptor (PTX ISA, "matrix descriptor format"): bits 0-13 start address
// >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51
// base offset (0: the tile is 1024-byte aligned), 62-63 swizzle (1 = 128 bytes).
//  K-major: SBO = 1024 bytes between 8-row groups; LBO unused with a swizzle (one wgmma's K = 16
//    elements stays inside a 128-byte row): 1 by convention.
//  MN-major: LBO = the byte distance between 64-element panels along N, SBO = 1024 bytes between
//    groups of 8 K-rows.
// The instruction's K step of 16 moves the start address: +32 bytes K-major (inside the row, the
// hardware applies the swizzle to the final address), +16 rows = 2048 bytes MN-major.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes) {
  constexpr uint64_t kSbo = 1024 >> 4;
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) | (kSbo << 32) |
         (uint64_t(1) << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Orders this thread's register writes (accumulators, the A fragment) before the wgmma that reads
// them; required before the first wgmma of a group whenever other code touched those registers.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the
// async proxy the tensor cores read through; then a barrier publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Register budget of this warpgroup's warps from here on (sm_90a; the kernel needs a register cap
// at entry, __launch_bounds__(threads, 1)): the producer gives registers back, the consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Keeps the compiler from moving reads or writes of an accumulator register across an async
// wgmma: the asm "defines" the value where it stands (no instruction is emitted).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x N, the m64nN accumulator fragment) = A·B + (scale_d ? d : 0) for one K step of 16.
template <typename T, int N>
struct Wgmma;

#define FA_WG_ACC8(i)                                                                                 \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),          \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FA_WG_ACC32 FA_WG_ACC8(0), FA_WG_ACC8(8), FA_WG_ACC8(16), FA_WG_ACC8(24)
#define FA_WG_ACC64 FA_WG_ACC32, FA_WG_ACC8(32), FA_WG_ACC8(40), FA_WG_ACC8(48), FA_WG_ACC8(56)
#define FA_WG_D32                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "    \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FA_WG_D64                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "    \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "     \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "     \
  "%59, %60, %61, %62, %63}"
// SS: A and B from descriptors (both K-major). RS: A = 4 registers of the m64k16 A fragment (the
// mma.sync m16n8k16 A layout per warp, warp w of the warpgroup holding rows 16w .. 16w + 15),
// B from a descriptor, MN-major (imm-trans-b = 1).
#define FA_WGMMA_DEFINE(TYPE, PTX_TYPE, N, D_REGS, ACC, A_SS, B_SS, SCALE_SS, A_RS, B_RS, SCALE_RS)      \
  template <>                                                                                          \
  struct Wgmma<TYPE, N> {                                                                              \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {  \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_SS ", 0;\n"                               \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " D_REGS    \
                   ", " A_SS ", " B_SS ", p, 1, 1, 0, 0;\n}\n"                                         \
                   : ACC                                                                               \
                   : "l"(a), "l"(b), "r"(scale_d));                                                    \
    }                                                                                                  \
    static __device__ __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,     \
                                              int scale_d) {                                           \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_RS ", 0;\n"                               \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " D_REGS    \
                   ", " A_RS ", " B_RS ", p, 1, 1, 1;\n}\n"                                             \
                   : ACC                                                                               \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));                \
    }                                                                                                  \
  };
FA_WGMMA_DEFINE(__half, "f16", 64, FA_WG_D32, FA_WG_ACC32, "%32", "%33", "%34", "{%32, %33, %34, %35}", "%36",
                "%37")
FA_WGMMA_DEFINE(__nv_bfloat16, "bf16", 64, FA_WG_D32, FA_WG_ACC32, "%32", "%33", "%34", "{%32, %33, %34, %35}",
                "%36", "%37")
FA_WGMMA_DEFINE(__half, "f16", 128, FA_WG_D64, FA_WG_ACC64, "%64", "%65", "%66", "{%64, %65, %66, %67}", "%68",
                "%69")
FA_WGMMA_DEFINE(__nv_bfloat16, "bf16", 128, FA_WG_D64, FA_WG_ACC64, "%64", "%65", "%66", "{%64, %65, %66, %67}",
                "%68", "%69")
#undef FA_WGMMA_DEFINE
#undef FA_WG_D64
#undef FA_WG_D32
#undef FA_WG_ACC64
#undef FA_WG_ACC32
#undef FA_WG_ACC8
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fused_attn
