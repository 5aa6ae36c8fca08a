"""What one grid barrier of gpt2_decode_step costs on this GPU, alone and under a weight stream (~1 min):

    python -m bench.probe_grid_barrier

One block per SM (256 consumer threads + one producer warp, as the decode step), `--barriers` grid
barriers back to back (csrc/gpt2_decode_step's GridBarrier, the same code), timed with CUDA events:
- `barrier`: arrive + wait only.
- `barrier+load`: after each barrier every block reads `--row-bytes` written by another block before
  it (the step's staging of its input rows), so each round is a dependent chain through L2.
- `barrier+load` with each block's producer warp streaming HBM (a `--stream-mb` buffer) into shared
  memory with TMA bulk copies the whole time, N copies of KB bytes in flight per SM (`--streams`): the
  decode step's weight stream. Its rate is printed beside.
Prints microseconds per round: the decode step's 60 rounds a token cost at least 60 x this, and how
many bytes in flight the stream needs for its bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

CSRC = Path(__file__).resolve().parent.parent / "csrc"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "gpt2_decode_step/gpt2_decode_step_kernel.cuh"

using namespace fused_attn;

__global__ void __launch_bounds__(kStepThreads, 1)
probe_kernel(unsigned* bar, int rounds, int row_words, unsigned* rows, const uint4* stream, long long stream_chunks,
             int chunk_bytes, int slots, unsigned long long* streamed) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(slots) * chunk_bytes);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) mbarrier_init(full + s, 1);
    *reinterpret_cast<int*>(full + slots) = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  volatile int* stop = reinterpret_cast<volatile int*>(full + slots);
  if (warp == kStepConsumerWarps) {
    if (threadIdx.x % 32 != 0 || stream == nullptr) return;
    // Stream this block's share of `stream` round robin through `slots` slots (all of them in flight)
    // until the consumers stop.
    for (long long c = 0;; ++c) {
      const int slot = int(c % slots);
      if (c >= slots) {
        while (!mbarrier_try_wait(full + slot, int((c / slots - 1) & 1))) {}
      }
      if (*stop) {  // let the copies still in flight land before the block exits
        for (long long k = c - slots + 1; k < c; ++k) {
          if (k >= 0) {
            while (!mbarrier_try_wait(full + k % slots, int((k / slots) & 1))) {}
          }
        }
        atomicAdd(streamed, (unsigned long long)c);
        return;
      }
      const long long chunk = (blockIdx.x + c * gridDim.x) % stream_chunks;
      mbarrier_arrive_expect_tx(full + slot, chunk_bytes);
      bulk_copy_to_shared(smem + slot * chunk_bytes, reinterpret_cast<const char*>(stream) + chunk * chunk_bytes,
                          chunk_bytes, full + slot);
    }
  }
  step::GridBarrier grid{bar, bar + 32, 0};
  unsigned acc = 0;
  for (int r = 0; r < rounds; ++r) {
    if (row_words > 0) {  // write my row, then (after the barrier) read my neighbour's
      for (int i = threadIdx.x; i < row_words; i += kStepConsumers) rows[blockIdx.x * row_words + i] = r + i;
    }
    grid.arrive();
    grid.wait();
    if (row_words > 0) {
      const unsigned* src = rows + ((blockIdx.x + 1) % gridDim.x) * row_words;
      for (int i = threadIdx.x; i < row_words; i += kStepConsumers) acc += __ldcg(src + i);
      step::consumers_sync();
    }
  }
  grid.finish();
  if (threadIdx.x == 0) *stop = 1;
  if (acc == 0xffffffffu) streamed[1] = 1;  // keeps the reads
}

std::vector<double> run(int rounds, int row_bytes, torch::Tensor stream, int chunk_bytes, int slots) {
  auto dev = torch::TensorOptions().device(torch::kCUDA);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto bar = torch::zeros({64}, dev.dtype(torch::kInt32));
  auto rows = torch::zeros({sms * std::max(row_bytes / 4, 1)}, dev.dtype(torch::kInt32));
  auto streamed = torch::zeros({2}, dev.dtype(torch::kInt64));
  const size_t smem = size_t(slots) * chunk_bytes + 8 * slots + 16;
  auto kernel = probe_kernel;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const bool streaming = stream.numel() > 0;
  const long long chunks = streaming ? stream.numel() * stream.element_size() / chunk_bytes : 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(sms);
  config.blockDim = dim3(kStepThreads);
  config.dynamicSmemBytes = smem;
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  double gbps = 0;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(e0, config.stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, reinterpret_cast<unsigned*>(bar.data_ptr<int>()), rounds,
                                      row_bytes / 4, reinterpret_cast<unsigned*>(rows.data_ptr<int>()),
                                      streaming ? reinterpret_cast<const uint4*>(stream.data_ptr()) : nullptr, chunks,
                                      chunk_bytes, slots,
                                      reinterpret_cast<unsigned long long*>(streamed.data_ptr<int64_t>())));
    cudaEventRecord(e1, config.stream);
    C10_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) {
      best = ms;
      gbps = double(streamed.select(0, 0).item<int64_t>()) * chunk_bytes / (ms * 1e6);
    }
    streamed.zero_();
  }
  return {best * 1000.0 / rounds, gbps};
}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--barriers", type=int, default=2000)
    ap.add_argument("--row-bytes", type=int, default=1536, help="bytes each block reads after a barrier")
    ap.add_argument("--stream-mb", type=int, default=1024)
    ap.add_argument("--streams", default="32x4,16x4,16x2,8x4,8x2,4x4",
                    help="comma list of KBxN: N TMA copies of KB each in flight per SM")
    args = ap.parse_args(argv)
    mod = load_inline("probe_grid_barrier",
                      cpp_sources="std::vector<double> run(int, int, torch::Tensor, int, int);",
                      cuda_sources=SOURCE, functions=["run"], extra_include_paths=[str(CSRC)],
                      extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-std=c++17"], verbose=False)
    stream = torch.empty(args.stream_mb << 20, dtype=torch.uint8, device="cuda").random_()
    none = torch.empty(0, dtype=torch.uint8, device="cuda")
    print(torch.cuda.get_device_name())
    for name, row in (("barrier", 0), ("barrier+load", args.row_bytes)):
        us, _ = mod.run(args.barriers, row, none, 16384, 2)
        print(f"{name:14s} no stream                         {us:7.2f} us per round", flush=True)
    for kb, slots in [tuple(int(v) for v in c.split("x")) for c in args.streams.split(",")]:
        us, gbps = mod.run(args.barriers, args.row_bytes, stream, kb << 10, slots)
        print(f"barrier+load   stream {slots:2d} x {kb:3d} KB in flight/SM  {us:7.2f} us per round, stream "
              f"{gbps:6.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
