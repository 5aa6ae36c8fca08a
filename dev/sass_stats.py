"""Registers, spills and static SASS counts of the tensor-core linear kernels, build by build (no GPU needed).

    python -m dev.sass_stats                                           # fp16 m8 and m16, the default build
    python -m dev.sass_stats --nvcc-flag=-DMY_SWITCH=1                # an experiment switch's builds
    python -m dev.sass_stats --units linear_inst_bf16_m16.cu linear_inst_fp16_m8_norm.cu

For each linear_mma_kernel / linear_splitk_kernel of the units (compiled for sm_90a with the library's flags,
as dev.sass_load_order does): ptxas's registers and spill bytes (stores / loads), and counts of its SASS:
every instruction, those before griddepcontrol.wait (ACQBULK: what runs under the previous kernel when the
launch is programmatic), from the wait to the first MMA (x's loads, the first fragments; negative where an MMA
comes before the wait, as kSelfNorm's weight sums do), after the last MMA (the block sum and the epilogue), and
the local-memory ones (LDL / STL: spills on some path).
They are static counts: both sides of a branch count, so a build that branches around code it never runs
counts that code too. A difference here is a prediction to measure (docs/lab-notes/linear-mlp.md,
"Compile-time epilogues"), never a speed. A build's last template argument is its code
(linear_launch.h): -1 reads the activation, bias and residual at run time (the statistics builds); otherwise
the activation (0 none, 1 GELU, 2 SwiGLU) + 16 (kEpiKnown) + 4 with a bias + 8 with a residual, e.g. 20 is
GPT-2's c_attn, 21 its c_fc, 28 its projections, 16 its lm_head.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from dev import sass_load_order as order

UNITS = ("linear_inst_fp16_m8.cu", "linear_inst_fp16_m16.cu")


def ptxas_usage(log: str) -> dict[str, tuple[int, int, int]]:
    """(registers, spill store bytes, spill load bytes) per mangled kernel name, from ptxas -v's messages."""
    usage = {}
    pattern = (r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores, "
               r"(\d+) bytes spill loads\n[^\n]*Used (\d+) registers")
    for m in re.finditer(pattern, log):
        usage[m.group(1)] = (int(m.group(4)), int(m.group(2)), int(m.group(3)))
    return usage


def counts(lines: list[str]) -> tuple[int, int, int, int, int]:
    """(all, before the wait, wait to the first MMA, last MMA to the end, LDL / STL) of one function's
    instructions (dev.sass_load_order.functions' lines; NOPs not counted). -1 where there is no wait or
    no MMA."""
    ins = [line for line in lines if line != "NOP"]
    wait = next((i for i, line in enumerate(ins) if line.startswith("ACQBULK")), -1)
    mmas = [i for i, line in enumerate(ins) if "HMMA" in line]
    local = sum(1 for line in ins if re.search(r"\b(LDL|STL)\b", line))
    to_mma = mmas[0] - wait if mmas and wait >= 0 else -1
    after = len(ins) - mmas[-1] - 1 if mmas else -1
    return len(ins), wait, to_mma, after, local


def report(cubins: list[Path], log: dict[Path, str], cuobjdump: str) -> list[tuple]:
    """One row per tensor-core linear kernel: (kernel, registers, spill stores, spill loads, *counts)."""
    usage = {cubin: ptxas_usage(text) for cubin, text in log.items()}
    rows = []
    for cubin, name, lines in order.tensor_core_kernels(cubins, cuobjdump):
        regs, stores, loads = usage.get(cubin, {}).get(name, (-1, -1, -1))
        rows.append((order.demangle(name), regs, stores, loads, *counts(lines)))
    return sorted(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", nargs="+", default=list(UNITS), help="csrc/linear units to compile")
    ap.add_argument("--nvcc-flag", action="append", default=[],
                    help="an extra nvcc flag (an experiment switch), e.g. -DMY_SWITCH=1")
    args = ap.parse_args(argv)
    cuobjdump = order.find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump must be installed (CUDA toolkit, PATH or Triton's copy), got none", file=sys.stderr)
        return 2
    log: dict[Path, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cubins = order.compile_units(Path(tmp), [*args.nvcc_flag, "-Xptxas", "-v"], tuple(args.units), log)
        rows = report(cubins, log, cuobjdump)
    print(f"{'kernel':72s} {'regs':>4s} {'spill st/ld':>11s} {'all':>5s} {'pre-wait':>8s} "
          f"{'wait->MMA':>9s} {'MMA->end':>8s} {'LDL/STL':>7s}")
    for kernel, regs, stores, loads, total, wait, to_mma, after, local in rows:
        print(f"{kernel:72s} {regs:4d} {f'{stores}/{loads}':>11s} {total:5d} {wait:8d} {to_mma:9d} {after:8d} {local:7d}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
