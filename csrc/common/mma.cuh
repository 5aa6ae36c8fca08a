// Tensor-core and async-copy building blocks shared by the kernels (torch-free):
// cp.async 16-byte copies global -> shared, ldmatrix (plain and .trans) from XOR-swizzled
// shared-memory tiles, mma.sync m16n8k16 with float32 accumulation, and packing two floats
// into a 16-bit pair for an A fragment. Used by decode_attention's decode_mma_kernel, attention's
// flash kernel and linear's tensor-core kernel; sm_80+ (cp.async degrades to a plain copy below).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fused_attn {

// 16 bytes global -> shared without passing through registers; pred false writes zeros and
// reads nothing. Completion is per thread (commit / wait groups): a thread that only reads
// what it copied needs no block barrier. Past L1 (cp.async.cg), or with kL1 through it (.ca: for
// data several blocks of an SM read, as the rows of x every block of linear's tensor-core kernels reads).
template <bool kL1 = false>
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (kL1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(pred ? 16 : 0));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(pred ? 16 : 0));
  }
#else
  *dst = pred ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// 16 bytes of a weight: read once, so past L1, with a 256-byte L2 prefetch (the next pieces of the row).
// Non-coherent: only for data no kernel of the PDL chain writes (a GEMV's weights), so it may be issued
// before wait_for_primary().
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr));
  return r;
}

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Element offset of 16-byte chunk c of row `row` in a row-major [rows][HD] tile of 16-bit
// elements, chunks XOR-swizzled so that the 8 rows one ldmatrix phase reads at the same chunk
// land in 8 different 16-byte bank groups: by row % 8 when a row is at least 128 bytes, by
// (row / 2) % 4 for 64-byte rows (HD 32: two rows share a 128-byte line).
template <int HD>
__device__ __forceinline__ int swizzled(int row, int c) {
  static_assert(HD % 64 == 0 || HD == 32, "rows of 64 bytes or a multiple of 128");
  if constexpr (HD == 32) {
    return row * HD + ((c ^ ((row >> 1) & 3)) << 3);
  } else {
    return row * HD + ((c ^ (row & 7)) << 3);
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// d += a · b for one m16n8k16 tile: a the 16x16 A fragment (row-major), b0 / b1 the 16x8 B
// fragment (column-major), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Two floats as one 32-bit pair of T (lo in the low half), for an A fragment.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace fused_attn
