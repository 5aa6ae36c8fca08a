// Launch shapes of the softmax kernels, by row length (softmax_kernel.cuh). Torch-free.
//
// FA_SOFTMAX_ROW_CLASS(n, causal, TPR, ELEMS, ...) binds the launch shape of softmax v1 for a row of n
//   elements: TPR threads cooperate on one row and each holds ELEMS elements in registers.
//   TPR == 0 selects the streaming (online-softmax) path for rows too long for registers.
// FA_SOFTMAX_BACKWARD_ROW_CLASS(n, TPR, ELEMS, ...) the same for the softmax backward, which holds
//   two arrays (y and dy) per thread.
// The body is a lambda, so `return` inside it returns from the lambda.
#pragma once

// Row-length classes of softmax v1. Capacity = TPR * ELEMS elements. Short rows
// give a row to a few lanes (several rows per warp), rows up to 1024 a warp or
// two, longer rows a whole block; every thread keeps at most 32 floats live,
// except causal 4097..8192 (64, below).
// Measurements: bench/ab.py, docs/lab-notes/softmax.md ("Row classes of 513..2048", "Row shape by
// causality", "Causal long and short rows").
// Rows of 513..2048 take a shape by causality:
//   513..1024   full: 2 warps x 16 elements    causal: 1 warp x 32
//   1025..2048  full: 4 warps x 16 elements    causal: 2 warps x 32
// Causal rows leave part of every thread's slice unread; 32-element slices
// spread each thread's fixed cost (index math, two reductions) over more of
// the visible keys (4x32x2048x2048 causal 483 -> 394 us), while full rows at
// 16 elements keep more threads resident (1-3% faster).
// Causal rows of 4097..8192 keys: 1 block of 4 warps x 64 elements (ptxas: 93 registers,
// no spills, sm_90a) instead of 8 warps x 32: 1.4% faster alone; with the early zeros of the
// 4-warp classes (softmax_kernel.cuh) 856 us against 858 us for 8 warps x 32 with early zeros.
// Causal rows of 65..128 keys run as 8 lanes x 16 and 129..256 keys as 16 lanes x 16
// (16x12x256x256 causal 18.1 -> 15.5 us). Tried and dropped: 4 x 32 /
// 8 x 32 for those rows, and causal 2049..4096 as 2 warps x 64 (1x16x4096x4096 causal 220 vs 207 us).
// Every class in the chain is instantiated for every dtype, vector width and mask kind.
#define FA_SOFTMAX_ROW_CLASS(N, CAUSAL, TPR, ELEMS, ...)                        \
  [&] {                                                                         \
    const bool fa_causal_ = (CAUSAL);                                           \
    if ((N) <= 32) {                                                            \
      constexpr int TPR = 4, ELEMS = 8;                                         \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 64) {                                                     \
      constexpr int TPR = 8, ELEMS = 8;                                         \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 128 && fa_causal_) {                                      \
      constexpr int TPR = 8, ELEMS = 16;                                        \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 128) {                                                    \
      constexpr int TPR = 16, ELEMS = 8;                                        \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 256 && fa_causal_) {                                      \
      constexpr int TPR = 16, ELEMS = 16;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 256) {                                                    \
      constexpr int TPR = 32, ELEMS = 8;                                        \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 512) {                                                    \
      constexpr int TPR = 32, ELEMS = 16;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 1024 && fa_causal_) {                                     \
      constexpr int TPR = 32, ELEMS = 32;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 1024) {                                                   \
      constexpr int TPR = 64, ELEMS = 16;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 2048 && fa_causal_) {                                     \
      constexpr int TPR = 64, ELEMS = 32;                                       \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 2048) {                                                   \
      constexpr int TPR = 128, ELEMS = 16;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 4096) {                                                   \
      constexpr int TPR = 128, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 8192 && fa_causal_) {                                     \
      constexpr int TPR = 128, ELEMS = 64;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 8192) {                                                   \
      constexpr int TPR = 256, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 16384) {                                                  \
      constexpr int TPR = 512, ELEMS = 32;                                      \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 32768) {                                                  \
      constexpr int TPR = 1024, ELEMS = 32;                                     \
      return __VA_ARGS__();                                                     \
    } else {                                                                    \
      constexpr int TPR = 0, ELEMS = 0;                                         \
      return __VA_ARGS__();                                                     \
    }                                                                           \
  }()

// Row-length classes of the softmax backward. Each thread holds ELEMS = 16 elements of y and of dy
// (32 values: the register budget of the forward's 32-element classes), so TPR doubles with the row:
// a few lanes per row up to 256 keys, a warp at 512, a block of up to 1024 threads at 16384. Longer
// rows take the two-pass streaming kernel (TPR == 0). One shape for causal and full rows.
#define FA_SOFTMAX_BACKWARD_ROW_CLASS(N, TPR, ELEMS, ...)                       \
  [&] {                                                                         \
    constexpr int ELEMS = 16;                                                   \
    if ((N) <= 64) {                                                            \
      constexpr int TPR = 4;                                                    \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 128) {                                                    \
      constexpr int TPR = 8;                                                    \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 256) {                                                    \
      constexpr int TPR = 16;                                                   \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 512) {                                                    \
      constexpr int TPR = 32;                                                   \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 1024) {                                                   \
      constexpr int TPR = 64;                                                   \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 2048) {                                                   \
      constexpr int TPR = 128;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 4096) {                                                   \
      constexpr int TPR = 256;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 8192) {                                                   \
      constexpr int TPR = 512;                                                  \
      return __VA_ARGS__();                                                     \
    } else if ((N) <= 16384) {                                                  \
      constexpr int TPR = 1024;                                                 \
      return __VA_ARGS__();                                                     \
    } else {                                                                    \
      constexpr int TPR = 0;                                                    \
      return __VA_ARGS__();                                                     \
    }                                                                           \
  }()
