"""The greedy sampler's launch at 16-64 rows of GPT-2's 50257 logits, by blocks a row (H200, ~1 min):

    python -m dev.probe_sample_rows [--rows 16,32,48,64] [--blocks 1,2,3,4,8] [--reps 200]

fused_attn.sample splits a row over up to 8 blocks of a thread-block cluster (csrc/sample/sample.cpp) and caps the
blocks at two an SM in all. At 64 rows that is 4 blocks a row: 64 clusters of four 512-thread blocks, where Nsight
Compute gives the kernel 62 active clusters at most (a cluster's blocks must share a GPC), so two clusters would
run after the others. This probe launches the library's own kernel (sample_kernel.cuh through launch_sample, the
launcher's parameters set here) at each blocks-a-row count and prints, for each:

- the largest number of such clusters the device runs at once (cudaOccupancyMaxActiveClusters) and the waves the
  grid needs by that count;
- the time a launch in a CUDA graph of 20 launches (programmatic, as in the decode step; the logits rotate over 4
  buffers written before the graph, so they are mostly L2 hits, as the lm_head's are in the step), median of 5
  (dev.probe_gemm_rows.graph_us);
- each launch's own device time in those replays (torch.profiler);
- a floor: a plain kernel reading the same bytes with the same grid, no cluster and no key arithmetic.

Every configuration's tokens are checked against torch.argmax (with ties and a NaN row among the rows).
Nothing is written into the checkout (load_inline builds under torch's extension cache).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from dev.probe_gemm_rows import graph_us

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "sample/sample_kernel.cuh"

namespace fa = fused_attn;

// The library's greedy sampler on [rows, vocab] fp16 logits with `blocks` blocks a row (a cluster above 1).
void sample_rows(torch::Tensor logits, torch::Tensor out, int64_t blocks) {
  fa::SampleParams p{};
  p.logits = logits.data_ptr();
  p.out = out.data_ptr<int64_t>();
  p.rows = logits.size(0);
  p.vocab = logits.size(1);
  p.row_stride = logits.stride(0);
  p.out_stride = 1;
  p.temperature = 0.f;
  p.blocks_per_row = int(blocks);
  p.cluster = blocks > 1;
  p.programmatic = true;
  const int64_t per_block = (p.vocab + blocks - 1) / blocks;
  p.chunk = (per_block + 7) / 8 * 8;
  fa::launch_sample<__half>(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// How many clusters of `blocks` blocks of the greedy kernel the device runs at once.
int64_t max_active_clusters(int64_t blocks) {
  return fa::max_active_clusters(fa::sample::sample_kernel<__half, false, false>, dim3(unsigned(blocks), 1, 1),
                                 fa::kSampleThreads, 0);
}

// The floor: the same grid reading the same bytes (16-byte loads, two in flight a thread), no cluster.
__global__ void __launch_bounds__(512) read_rows(const __half* logits, int64_t vocab, int64_t stride, int64_t chunk,
                                                 unsigned* sink) {
  const __half* row = logits + int64_t(blockIdx.y) * stride;
  const int64_t c0 = int64_t(blockIdx.x) * chunk, c1 = c0 + chunk < vocab ? c0 + chunk : vocab;
  const int64_t a0 = (c0 + 7) / 8 * 8, pieces = c1 > a0 ? (c1 - a0) / 8 : 0;  // stride is a multiple of 8 here
  unsigned x = 0;
  for (int64_t j = threadIdx.x; j < pieces; j += 2 * blockDim.x) {
    const uint4 u = reinterpret_cast<const uint4*>(row + a0)[j];
    const uint4 v = j + blockDim.x < pieces ? reinterpret_cast<const uint4*>(row + a0)[j + blockDim.x]
                                           : make_uint4(0, 0, 0, 0);
    x ^= u.x ^ u.y ^ u.z ^ u.w ^ v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) sink[0] = x;  // never in practice: keeps the loads
}

void read_floor(torch::Tensor logits, torch::Tensor sink, int64_t blocks) {
  const int64_t vocab = logits.size(1), per = (vocab + blocks - 1) / blocks;
  read_rows<<<dim3(unsigned(blocks), unsigned(logits.size(0))), 512, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __half*>(logits.data_ptr()), vocab, logits.stride(0), (per + 7) / 8 * 8,
      reinterpret_cast<unsigned*>(sink.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def build():
    return load_inline("probe_sample_rows",
                       cpp_sources="void sample_rows(torch::Tensor logits, torch::Tensor out, int64_t blocks);\n"
                                   "int64_t max_active_clusters(int64_t blocks);\n"
                                   "void read_floor(torch::Tensor logits, torch::Tensor sink, int64_t blocks);",
                       cuda_sources=SOURCE, functions=["sample_rows", "max_active_clusters", "read_floor"],
                       extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr",
                                          "-gencode=arch=compute_90a,code=sm_90a"],
                       extra_include_paths=[str(Path(__file__).resolve().parent.parent / "csrc")], verbose=False)


def logits_rows(rows: int, vocab: int, stride: int, seed: int) -> torch.Tensor:
    """[rows, vocab] fp16 logits in a buffer of row stride `stride` (GPT-2's padded lm_head: 50304), with a tie for
    the maximum in row 0, the maximum at the last column in row 1 and a NaN in row 2."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(rows, stride, device="cuda", dtype=torch.float16, generator=g)
    x = buf[:, :vocab]
    x[0, 7] = x[0, 40000] = 20.0
    if rows > 1:
        x[1, vocab - 1] = 30.0
    if rows > 2:
        x[2, 123] = float("nan")
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,48,64", help="comma list of row counts")
    ap.add_argument("--blocks", default="1,2,3,4,8", help="comma list of blocks a row (1-8)")
    ap.add_argument("--reps", type=int, default=200, help="graph replays a timing")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    blocks_list = [int(b) for b in args.blocks.split(",")]
    if any(not 1 <= b <= 8 for b in blocks_list) or any(r < 1 for r in rows_list):
        raise SystemExit(f"--blocks must lie in 1..8 and --rows be >= 1, got {args.blocks!r}, {args.rows!r}")
    ext = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    vocab, stride = 50257, 50304
    print(f"{torch.cuda.get_device_name()}; fp16 greedy, vocab {vocab}, row stride {stride}; us a launch in a CUDA "
          f"graph of 20 (median of 5 x {args.reps} replays) [each launch's device time]")
    clusters = {b: (ext.max_active_clusters(b) if b > 1 else None) for b in blocks_list}
    for rows in rows_list:
        bufs = [logits_rows(rows, vocab, stride, seed) for seed in range(4)]
        want = [torch.argmax(x.float().nan_to_num(nan=float("inf")), dim=1) for x in bufs]
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        mb = rows * vocab * 2 / 1e6
        parts = []
        for b in blocks_list:
            for i, x in enumerate(bufs):
                ext.sample_rows(x, out, b)
                if not torch.equal(out, want[i]):
                    bad = (out != want[i]).nonzero().flatten().tolist()
                    raise SystemExit(f"rows {rows} blocks {b}: tokens differ from torch.argmax at rows {bad[:8]}")
            kernels: list[float] = []
            t = graph_us(lambda: [ext.sample_rows(bufs[i % 4], out, b) for i in range(20)], 20, args.reps, kernels)
            f = graph_us(lambda: [ext.read_floor(bufs[i % 4], sink, b) for i in range(20)], 20, args.reps)
            if b > 1:
                waves = -(-rows // max(1, clusters[b]))
                fit = f"{clusters[b]} clusters at once, {waves} wave{'s' if waves > 1 else ''}"
            else:
                waves = -(-rows // (2 * sms))
                fit = f"no cluster, {waves} wave{'s' if waves > 1 else ''}"
            parts.append(f"  {b} a row ({fit}): {t:.2f} [{kernels[0]:.2f}]  floor {f:.2f}")
        print(f"rows {rows} ({mb:.1f} MB; tokens equal torch.argmax at every count):")
        print("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
