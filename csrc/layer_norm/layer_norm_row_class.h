// Launch shapes of the layer_norm kernel by row width (layer_norm_kernel.cuh). Torch-free.
//
// FA_NORM_ROW_CLASS(n, TPR, ELEMS, ...) binds the launch shape for rows of n elements: TPR threads
// own one row and each holds ELEMS elements (float32) in registers, so capacity = TPR * ELEMS >= n.
// Rows up to 1024 elements take a warp or less (shuffle reductions only, several rows per block).
// GPT-2's 768 has a class of its own, a warp of 24 elements a thread: in the 1024 class the fourth
// pack is never loaded but its registers are held (float16 add + LayerNorm: 69 registers instead of
// 59, sm_90a), which leaves 7 instead of 8 blocks of 4 rows per SM, so 4096 rows would need 1.1
// waves on an H100 (132 SMs) instead of one. Wider rows a block of 2-16 warps at 32
// elements a thread (Llama's 4096: 4 warps, one block per row, two __syncthreads per row for the
// two reductions). Every thread keeps at most 32 floats live. Widths 64..16384 (the launcher rejects
// others). The body is a lambda, so `return` inside it returns from the lambda.
#pragma once

#define FA_NORM_ROW_CLASS(N, TPR, ELEMS, ...)                                   \
  [&] {                                                                         \
    if ((N) <= 64) {                                                            \
      constexpr int TPR = 8, ELEMS = 8;                                         \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 128) {                                                    \
      constexpr int TPR = 16, ELEMS = 8;                                        \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 256) {                                                    \
      constexpr int TPR = 32, ELEMS = 8;                                        \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 512) {                                                    \
      constexpr int TPR = 32, ELEMS = 16;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 768) {                                                    \
      constexpr int TPR = 32, ELEMS = 24;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 1024) {                                                   \
      constexpr int TPR = 32, ELEMS = 32;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 2048) {                                                   \
      constexpr int TPR = 64, ELEMS = 32;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 4096) {                                                   \
      constexpr int TPR = 128, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 8192) {                                                   \
      constexpr int TPR = 256, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    } else {                                                                    \
      constexpr int TPR = 512, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    }                                                                           \
  }()
