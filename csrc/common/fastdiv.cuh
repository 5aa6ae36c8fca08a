// FastDiv: division by a divisor fixed at launch, as one multiply-high, an add and a shift.
// Torch-free; any kernel that maps a flat row index to (lead, q) uses it. Host compilers see the
// structs and their constructors (launchers build them in .cpp files); nvcc's host pass also sees the
// divisions (tests/test_fastdiv.py runs them on the host).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

// The multiplier and shift of n / d for 1 <= d < 2^31 (FastDiv and FastDiv32 below): l = ceil(log2 d),
// mul = floor(2^32 (2^l - d) / d) + 1.
__host__ inline void fastdiv_magic(uint32_t d, uint32_t& mul, uint32_t& shift) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d) + 1);
  shift = l;
}

#if defined(__CUDACC__)
// The high 32 bits of a x b: one IMAD.HI on the device; the host build (tests/test_fastdiv.py) computes the same.
__host__ __device__ __forceinline__ uint32_t fastdiv_umulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}
#endif

// n / d for 0 <= n < 2^31 as one multiply-high, an add and a shift (the
// round-up method of Granlund & Montgomery, "Division by invariant integers using
// multiplication", 1994): with l = ceil(log2 d) and mul = floor(2^32 (2^l - d) / d) + 1,
// n / d = (umulhi(mul, n) + n) >> l. A 64-bit `row % seqlen_q` costs ~20
// instructions per thread, a visible share of a 16-element row slice (docs/lab-notes/softmax.md).
// Larger n or d (never seen with seqlen_q < 2^31 and realistic row counts) take
// the 64-bit division.
struct FastDiv {
  int64_t d = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;  // 32: no fast path for this d

  FastDiv() = default;
  __host__ explicit FastDiv(int64_t divisor) : d(divisor) {
    if (divisor < 1 || divisor >= (int64_t(1) << 31)) {
      shift = 32;
      return;
    }
    fastdiv_magic(uint32_t(divisor), mul, shift);
  }

#if defined(__CUDACC__)
  __host__ __device__ __forceinline__ int64_t div(int64_t n) const {
    if (shift < 32 && uint64_t(n) < (uint64_t(1) << 31)) {  // 0 <= n < 2^31: one unsigned compare
      const uint32_t n32 = uint32_t(n);
      return int64_t((fastdiv_umulhi(mul, n32) + n32) >> shift);
    }
    return n / d;
  }
#endif
};

// The same division for 32-bit operands, without FastDiv's 64-bit fallback: 1 <= d < 2^31 (the host
// constructor takes a smaller divisor as 1: the launchers only build it from positive counts) and
// 0 <= n < 2^31, so umulhi(mul, n) + n < 2^32 never wraps. 12 bytes: a kernel's parameter struct can hold
// several. A quotient is IMAD.HI + IADD + SHF; a runtime `n / d` is ~25 dependent instructions (I2F, MUFU.RCP,
// F2I, corrections).
struct FastDiv32 {
  int d = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;

  FastDiv32() = default;
  __host__ explicit FastDiv32(int divisor) : d(divisor < 1 ? 1 : divisor) { fastdiv_magic(uint32_t(d), mul, shift); }

#if defined(__CUDACC__)
  __host__ __device__ __forceinline__ int div(int n) const {
    const uint32_t n32 = uint32_t(n);
    return int((fastdiv_umulhi(mul, n32) + n32) >> shift);
  }
  __host__ __device__ __forceinline__ int mod(int n) const { return n - div(n) * d; }
  // q = n / d and r = n % d.
  __host__ __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * d;
  }
#endif
};

}  // namespace fused_attn
