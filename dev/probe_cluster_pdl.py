"""Whether a clustered launch starts under the previous kernel's PDL trigger, by cluster size (~30 s):

    python -m dev.probe_cluster_pdl [--clusters 1,2,4,8,12,16] [--consumer-clusters 12] ...

The remaining structural route to a faster batch-16 step (docs/lab-notes/launch-overhead-pdl.md) puts c_attn and
decode attention in one launch of one 12- or 16-block cluster per head. GPT-2's step gains from PDL only
because each launch's blocks start, and fetch their weights, while the kernel before them drains; a
cluster must have all of its blocks placed at once on SMs of one GPC, so a big cluster may not fit
beside the previous kernel's resident blocks and then starts only when they leave: the sketch's saving
(one grid boundary, ~1.5-3 us a layer) would be lost to a late start. This probe measures that, nothing
else:

- `producer`: a grid of --producer-blocks blocks (--producer-threads threads, --producer-smem KB of
  shared memory each: the shape of the kernel before, default GPT-2's 16-row split-K c_proj, 288 blocks)
  that triggers its dependents at its start (griddepcontrol.launch_dependents, as our early triggers
  do), spins --spin-us microseconds and stamps its end (%globaltimer).
- `consumer`: --consumer-clusters clusters of C blocks (--consumer-threads, --consumer-smem KB), launched
  with programmatic stream serialization and cluster dimension C (C > 8: the non-portable size
  attribute). Each block stamps its entry (before griddepcontrol.wait), the wait's return and the
  return of one cluster barrier.

Per C it prints the occupancy query's active clusters (cudaOccupancyMaxActiveClusters, with the
producer absent), and, relative to the producer's last block end (negative: earlier), the median and
latest consumer entry, the share of blocks that entered before that end, and the median wait return.
A C whose blocks enter before the producer ends starts under PDL; one whose entries all trail the end
waits for the producer's blocks to leave.

What limits co-residence in the real step is registers (the split-K c_proj: 3 blocks of 256 threads at
80 registers hold 94% of an SM's register file), which a probe kernel cannot be made to hold; shared
memory stands in for it: the default --producer-smem 72 KB lets at most 3 producer blocks on an SM (216
of 228 KB), so an SM with 3 has no room for a 48 KB consumer block and one with 2 has, as with the real
registers (3 blocks: 4 K registers left; 2: 24 K, one 256-thread block at up to 96 registers). Nothing is written into the checkout (load_inline builds under
torch's extension cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from bench.harness import positive_ints

CSRC = Path(__file__).resolve().parent.parent / "csrc"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include "common/pdl.cuh"
#include "common/cluster.cuh"

using namespace fused_attn;

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Triggers its dependents at once, spins spin_ns, stamps its end (thread 0 of each block).
__global__ void producer(unsigned long long* end, long long spin_ns) {
  extern __shared__ unsigned char smem[];
  launch_dependents();
  const unsigned long long t0 = now_ns();
  while (now_ns() - t0 < (unsigned long long)spin_ns) {}
  if (threadIdx.x == 0) smem[0] = 1;  // the shared memory is requested, and touched
  __syncthreads();
  if (threadIdx.x == 0) end[blockIdx.x] = now_ns() + smem[0] - 1;
}

// Stamps entry, wait return and cluster barrier return (thread 0 of each block): stamps[3 * block + i].
__global__ void consumer(unsigned long long* stamps) {
  extern __shared__ unsigned char smem[];
  const unsigned long long entered = now_ns();
  wait_for_primary();
  const unsigned long long waited = now_ns();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster_arrive_release();
  cluster_wait();
#endif
  const unsigned long long clustered = now_ns();
  if (threadIdx.x == 0) smem[0] = 1;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long* s = stamps + 3 * size_t(blockIdx.x);
    s[0] = entered, s[1] = waited, s[2] = clustered + smem[0] - 1;
  }
}

// (producer ends, consumer stamps, max active clusters) of one producer + consumer pair, or an empty
// stamps tensor where the cluster size cannot be launched (max active clusters 0).
std::vector<torch::Tensor> run(int cluster, int consumer_clusters, int consumer_threads, int consumer_smem,
                               int producer_blocks, int producer_threads, int producer_smem, long long spin_ns) {
  auto dev = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt64);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaFuncSetAttribute(producer, cudaFuncAttributeMaxDynamicSharedMemorySize, producer_smem));
  C10_CUDA_CHECK(cudaFuncSetAttribute(consumer, cudaFuncAttributeMaxDynamicSharedMemorySize, consumer_smem));
  C10_CUDA_CHECK(cudaFuncSetAttribute(consumer, cudaFuncAttributeNonPortableClusterSizeAllowed, cluster > 8 ? 1 : 0));
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(unsigned(cluster * consumer_clusters));
  c.blockDim = dim3(unsigned(consumer_threads));
  c.dynamicSmemBytes = size_t(consumer_smem);
  c.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster), attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = attr;
  c.numAttrs = 1;  // the occupancy query takes the cluster dimension only
  int active = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&active, consumer, &c));
  auto ends = torch::zeros({producer_blocks}, dev);
  auto stamps = torch::zeros({active > 0 ? cluster * consumer_clusters : 0, 3}, dev);
  auto act = torch::full({1}, active, torch::TensorOptions().dtype(torch::kInt64));
  if (active == 0) return {ends, stamps, act};
  c.numAttrs = 2;
  producer<<<producer_blocks, producer_threads, producer_smem, stream>>>(
      reinterpret_cast<unsigned long long*>(ends.data_ptr<int64_t>()), spin_ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaLaunchKernelEx(&c, consumer, reinterpret_cast<unsigned long long*>(stamps.data_ptr<int64_t>())));
  return {ends, stamps, act};
}
"""


def summarize(ends: torch.Tensor, stamps: torch.Tensor) -> dict:
    """Consumer stamps relative to the producer's last block end, in microseconds."""
    ends, stamps = ends.cpu(), stamps.cpu()  # one copy each, not an item() per stamp
    end = int(ends.max())
    entered = [(int(t) - end) / 1e3 for t in stamps[:, 0]]
    waited = [(int(t) - end) / 1e3 for t in stamps[:, 1]]
    return dict(entry_median=statistics.median(entered), entry_latest=max(entered),
                early_pct=100.0 * sum(e < 0 for e in entered) / len(entered), wait_median=statistics.median(waited))


def int_list(text: str) -> list[int]:
    try:
        return positive_ints(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clusters", type=int_list, default=[1, 2, 4, 8, 12, 16], help="cluster sizes C")
    ap.add_argument("--consumer-clusters", type=int, default=12, help="clusters of the consumer (GPT-2: a head each)")
    ap.add_argument("--consumer-threads", type=int, default=256)
    ap.add_argument("--consumer-smem", type=int, default=48, help="KB of shared memory a consumer block")
    ap.add_argument("--producer-blocks", type=int, default=288, help="GPT-2's 16-row split-K c_proj: 288")
    ap.add_argument("--producer-threads", type=int, default=256)
    ap.add_argument("--producer-smem", type=int, default=72,
                    help="KB of shared memory a producer block (a stand-in for its registers: see above)")
    ap.add_argument("--spin-us", type=float, default=20.0, help="how long each producer block runs")
    ap.add_argument("--repeats", type=int, default=20, help="producer + consumer pairs per C (medians over them)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90: clusters and PDL)")
    mod = load_inline("probe_cluster_pdl",
                      cpp_sources="std::vector<torch::Tensor> run(int, int, int, int, int, int, int, long long);",
                      cuda_sources=SOURCE, functions=["run"], extra_include_paths=[str(CSRC)],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    print(f"{torch.cuda.get_device_name()}; producer {args.producer_blocks} x {args.producer_threads} threads, "
          f"{args.producer_smem} KB, {args.spin_us} us; consumer {args.consumer_clusters} clusters x C blocks x "
          f"{args.consumer_threads} threads, {args.consumer_smem} KB; us relative to the producer's last block end")
    print(f"{'C':>3} {'active clusters':>15} {'entry median':>12} {'entry latest':>12} {'entered early %':>15} "
          f"{'wait return median':>18}")
    for cluster in args.clusters:
        rows = []
        for _ in range(args.repeats):
            ends, stamps, active = mod.run(cluster, args.consumer_clusters, args.consumer_threads,
                                           args.consumer_smem << 10, args.producer_blocks, args.producer_threads,
                                           args.producer_smem << 10, int(args.spin_us * 1e3))
            torch.cuda.synchronize()
            if stamps.numel() == 0:
                break
            rows.append(summarize(ends, stamps))
        if not rows:
            print(f"{cluster:>3} {int(active[0]):>15}  (not launchable with these resources)", flush=True)
            continue
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{cluster:>3} {int(active[0]):>15} {med['entry_median']:>12.2f} {med['entry_latest']:>12.2f} "
              f"{med['early_pct']:>15.0f} {med['wait_median']:>18.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
