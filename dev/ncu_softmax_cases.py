"""Instruction and issue counters of fused_v1 under Nsight Compute, per build variant.

    ncu --clock-control none --kernel-name regex:softmax_kernel_v1 \\
        --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\\
dram__throughput.avg.pct_of_peak_sustained_elapsed python3 -m dev.ncu_softmax_cases

Runs one fused_v1 call per shape below (float16), nothing else, so each profiled kernel
is one of these cases in order. Used to tell whether a kernel version is limited by
instruction issue or by DRAM (docs/lab-notes/softmax.md: the merged reduction, the lean element loop).
"""

from __future__ import annotations

import torch

import fused_attn
from fused_attn.softmax import scaled_masked_softmax

SHAPES = [((8, 12, 1024, 1024), False), ((8, 12, 1024, 1024), True), ((4, 32, 2048, 2048), False),
          ((4, 32, 2048, 2048), True)]


def main() -> None:
    fused_attn.load()
    for shape, causal in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.float16)
        scaled_masked_softmax(x, 0.125, causal=causal)
        torch.cuda.synchronize()
        print(f"case {'x'.join(map(str, shape))} {'causal' if causal else 'full'}", flush=True)


if __name__ == "__main__":
    main()
