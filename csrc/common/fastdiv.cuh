// FastDiv: division by a divisor fixed at launch, as one multiply-high, an add and a shift.
// Torch-free; any kernel that maps a flat row index to (lead, q) uses it. Host compilers see the
// struct and its constructor (launchers build it in .cpp files); the division is device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

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
    uint32_t l = 0;
    while ((int64_t(1) << l) < divisor) ++l;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(divisor))) / uint64_t(divisor) + 1);
    shift = l;
  }

#if defined(__CUDACC__)
  __device__ __forceinline__ int64_t div(int64_t n) const {
    if (shift < 32 && n < (int64_t(1) << 31)) {
      const uint32_t n32 = uint32_t(n);
      return int64_t((__umulhi(mul, n32) + n32) >> shift);
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
  __host__ explicit FastDiv32(int divisor) : d(divisor < 1 ? 1 : divisor) {
    uint32_t l = 0;
    while ((int64_t(1) << l) < d) ++l;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d) + 1);
    shift = l;
  }

#if defined(__CUDACC__)
  __host__ __device__ __forceinline__ int div(int n) const {
    const uint32_t n32 = uint32_t(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(mul, n32);
#else
    const uint32_t hi = uint32_t((uint64_t(mul) * n32) >> 32);
#endif
    return int((hi + n32) >> shift);
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
