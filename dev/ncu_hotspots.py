"""Where a kernel's warps wait, by source line, from an Nsight Compute report (run on the GPU machine):

    ncu --kernel-name regex:linear_mma_kernel --launch-count 1 --set full --import-source yes -o /tmp/r \\
        python -m bench.time_decode_graph --batches 16 --reps 1 --replays 2
    python -m dev.ncu_hotspots /tmp/r.ncu-rep --top 30

Reads `ncu --page source --print-source cuda,sass --csv` (warp-state samples per SASS instruction,
with the CUDA line each came from: the library is built with -lineinfo), sums the samples per CUDA
source line and prints the lines with the most, their share of all samples and the SASS opcodes
sampled there. The stall reasons per line are the columns `ncu --page source` prints beside these.
Written against the header ncu 2025 printed on the device; the row parsing has not yet met a real
report.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from collections import Counter, defaultdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    text = subprocess.run(["ncu", "--import", args.report, "--page", "source", "--print-source", "cuda,sass", "--csv"],
                          capture_output=True, text=True, check=True).stdout
    # Sections per source file: a "File Path" row, a "Function Name" row, a header row ("Line No",
    # "Source", "Address", "Source", metrics...), then one row per SASS instruction with its CUDA line.
    per_line: Counter = Counter()
    ops: dict[str, Counter] = defaultdict(Counter)
    path, header = "?", None
    for r in csv.reader(io.StringIO(text)):
        if not r:
            continue
        if r[0] == "File Path":
            path = r[1].rsplit("/", 1)[-1]
        elif r[0] == "Line No":
            header = r
            samples = next(i for i, c in enumerate(r) if c.startswith("Warp Stall Sampling (All"))
        elif header is not None and len(r) == len(header):
            try:
                n = float(r[samples] or 0)
            except ValueError:
                continue
            if n == 0:
                continue
            where = f"{path}:{r[0]}  {r[1].strip()[:90]}"
            per_line[where] += n
            sass = r[3].split()
            ops[where][sass[0] if sass and not sass[0].startswith("@") else " ".join(sass[:2])] += n
    total = sum(per_line.values()) or 1.0
    print(f"{int(total)} samples; top {args.top} source lines:")
    for line, n in per_line.most_common(args.top):
        top_ops = ", ".join(f"{o} {int(c)}" for o, c in ops[line].most_common(3))
        print(f"{100 * n / total:5.1f}%  {line}   [{top_ops}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
