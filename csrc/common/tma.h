// Tensor maps for the Hopper tensor memory accelerator (TMA), host side (torch-free): a strided
// [batch][heads][rows][cols] tensor described once per launch so that one thread can copy a tile of
// it into shared memory with one instruction (cp.async.bulk.tensor; tma_load_4d in mbarrier.cuh).
//
// The driver's cuTensorMapEncodeTiled is reached through the runtime's entry-point query, so the
// library does not link libcuda itself. A map is a 128-byte value passed to the kernel as a
// __grid_constant__ parameter: captured with the launch in a CUDA graph like any other argument.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fused_attn {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's encoder, looked up once; nullptr where the driver has none (then nothing uses TMA).
inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // the failed query is not an error of a later launch
      f = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// `map` describes the tensor at `base` with extents (batch, heads, rows, cols) and element strides
// (stride_b, stride_h, stride_s; cols contiguous), 2-byte elements of `type`, for boxes of box_cols x
// box_rows of one (batch, head), written to shared memory with the 128-byte swizzle (16-byte chunk j
// of box row r at chunk j ^ (r % 8) of a 128-byte row: box_cols * 2 must be 128) and zeros where the
// box leaves the tensor (rows past `rows`, columns past `cols`). Returns false where TMA cannot
// describe it: a base not 16-byte aligned, a stride that is not a positive multiple of 16 bytes below
// 2^40 (an extent of 1 is never stepped over: its stride is replaced by a valid one), no encoder.
inline bool encode_bhsd_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, int64_t batch,
                            int64_t heads, int64_t rows, int64_t cols, int64_t stride_b, int64_t stride_h,
                            int64_t stride_s, int box_cols, int box_rows) {
  constexpr int64_t kElem = 2;
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || box_cols * kElem != 128) return false;
  const int64_t row_bytes = (cols * kElem + 15) / 16 * 16;
  const int64_t s = rows == 1 ? row_bytes : stride_s * kElem;
  const int64_t h = heads == 1 ? s * rows : stride_h * kElem;
  const int64_t b = batch == 1 ? h * heads : stride_b * kElem;
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(s), cuuint64_t(h), cuuint64_t(b)};
  for (int i = 0; i < 3; ++i) {
    const int64_t st = int64_t(strides[i]);
    if (st <= 0 || st % 16 != 0 || st >= (int64_t(1) << 40)) return false;
  }
  const cuuint32_t box[4] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t step[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fused_attn
