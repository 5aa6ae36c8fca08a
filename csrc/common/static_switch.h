// Generic runtime value -> template parameter switches, shared by every op's launcher.
//
// FA_DISPATCH_FLOAT(dtype, ARG, ...)   binds `scalar_t` to float / __half / __nv_bfloat16;
//                                      an unsupported dtype raises "<ARG> must have dtype ..."
// FA_BOOL_SWITCH(cond, NAME, ...)      binds `constexpr bool NAME`
// FA_HEADDIM_SWITCH(d, ARG, NAME, ...) binds `constexpr int NAME` to the smallest supported head
//                                      dim >= d (32, 64, 96, 128, 192, 256); larger raises
// The body is a lambda, so `return` inside it returns from the lambda. ARG is the name of the
// argument the value came from (an identifier, stringified into the message). Op-specific tables
// (a kernel's launch shapes by row length, say) live next to that op's kernel, not here.
// FA_DISPATCH_FLOAT and FA_HEADDIM_SWITCH need ATen (TORCH_CHECK_VALUE); FA_BOOL_SWITCH does not.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FA_DISPATCH_FLOAT(DTYPE, ARG, ...)                                      \
  [&] {                                                                         \
    switch (DTYPE) {                                                            \
      case at::ScalarType::Float: {                                             \
        using scalar_t = float;                                                 \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      case at::ScalarType::Half: {                                              \
        using scalar_t = __half;                                                \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      case at::ScalarType::BFloat16: {                                          \
        using scalar_t = __nv_bfloat16;                                         \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      default:                                                                  \
        TORCH_CHECK_VALUE(false, #ARG " must have dtype float32, float16 or "   \
                          "bfloat16, got ", ::fused_attn::dtype_str(DTYPE));    \
    }                                                                           \
  }()

#define FA_BOOL_SWITCH(COND, NAME, ...)                                         \
  [&] {                                                                         \
    if (COND) {                                                                 \
      constexpr bool NAME = true;                                               \
      return __VA_ARGS__();                                                     \
    } else {                                                                    \
      constexpr bool NAME = false;                                              \
      return __VA_ARGS__();                                                     \
    }                                                                           \
  }()

#define FA_HEADDIM_SWITCH(D, ARG, NAME, ...)                                    \
  [&] {                                                                         \
    if ((D) <= 32) {                                                            \
      constexpr int NAME = 32;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 64) {                                                     \
      constexpr int NAME = 64;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 96) {                                                     \
      constexpr int NAME = 96;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 128) {                                                    \
      constexpr int NAME = 128;                                                 \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 192) {                                                    \
      constexpr int NAME = 192;                                                 \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 256) {                                                    \
      constexpr int NAME = 256;                                                 \
      return __VA_ARGS__();                                                     \
    }                                                                           \
    TORCH_CHECK_VALUE(false, #ARG " must have headdim <= 256, got ", (D));      \
  }()

// decode_attention's padded head dims: a kernel for HD serves every headdim <= HD that is a
// multiple of 8 (the lanes past headdim load nothing).
#define FA_DECODE_HEADDIM_SWITCH(D, NAME, ...)                                  \
  [&] {                                                                         \
    if ((D) <= 32) {                                                            \
      constexpr int NAME = 32;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 64) {                                                     \
      constexpr int NAME = 64;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((D) <= 128) {                                                    \
      constexpr int NAME = 128;                                                 \
      return __VA_ARGS__();                                                     \
    } else {                                                                    \
      constexpr int NAME = 256;                                                 \
      return __VA_ARGS__();                                                     \
    }                                                                           \
  }()
