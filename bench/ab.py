"""A/B timing of build-time kernel variants in one GPU session.

    python -m bench.ab [--rounds 50] [--repeat 3]

Builds every variant in VARIANTS in parallel (each its own cache entry, through
FUSED_ATTN_NVCC_FLAGS), then times fused_v1 for each in a separate process on the same
inputs (CUDA events, cold L2, median) and prints one table: variant x shape, p50, % of the
measured copy bandwidth and of the read/write roofline, beside the time of a device copy of the
same bytes; the empty kernel's time per variant heads it. Versions that win here become the default in
csrc/softmax/softmax_kernel.cuh; the table goes into bench/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# name -> extra nvcc flags. The production headers carry no experiment switches: an experiment
# adds its `#ifdef` to the kernel on a branch, lists its -D flags here, runs this A/B, and then
# either becomes the default (the switch removed) or is dropped; the outcome goes into
# bench/NOTES.md (v1d-v1k list the switches measured so far and their numbers).
VARIANTS = {
    "default": "",
}
SHAPES = [((1, 12, 128, 128), True), ((1, 12, 128, 128), False), ((8, 12, 128, 128), True),
          ((8, 12, 128, 128), False), ((16, 12, 128, 128), True), ((16, 12, 128, 128), False),
          ((16, 12, 256, 256), True), ((1, 12, 512, 512), True), ((8, 12, 512, 512), True),
          ((8, 12, 512, 512), False), ((16, 12, 512, 512), True), ((16, 12, 512, 512), False),
          ((8, 12, 1024, 1024), True)]


def worker(rounds: int) -> None:
    import torch

    import fused_attn
    from bench.bench_softmax import modeled_traffic
    from bench.harness import DeviceTimer, measure_ceilings, roofline_us
    from fused_attn.softmax import scaled_masked_softmax

    fused_attn.load()
    timer = DeviceTimer(torch.device("cuda"), rounds, 5)
    ceilings = measure_ceilings()
    rows = []
    for shape, causal in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.float16)
        out = torch.empty_like(x)
        fn = lambda: scaled_masked_softmax(x, 0.125, causal=causal, out=out)  # noqa: E731
        times = timer.sample(fn)
        read, write = modeled_traffic("fused_v1", shape, torch.float16, causal)
        p50 = statistics.median(times)
        rows.append(dict(shape="x".join(map(str, shape)), causal=causal, p50_us=round(p50, 1),
                         pct_copy=round(100 * (read + write) / (p50 * 1e-6) / 1e9 / ceilings["copy"], 1),
                         pct_roof=round(100 * roofline_us(read, write, ceilings) / p50, 1),
                         copy_us=round(timer.same_bytes_copy_us(read + write), 1)))
    print(json.dumps(dict(ceilings={k: round(v, 1) for k, v in ceilings.items()}, rows=rows,
                          floor_us=round(timer.launch_floor_us(), 2))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=50, help="timed rounds per case")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of bench/ab.py's VARIANTS")
    ap.add_argument("--repeat", type=int, default=1, help="run the variant sequence this many times, interleaved")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.rounds)
        return 0
    names = args.variants.split(",")
    envs = {k: dict(os.environ, FUSED_ATTN_NVCC_FLAGS=VARIANTS[k]) for k in names}
    builds = {k: subprocess.Popen([sys.executable, "-m", "fused_attn.build"], env=envs[k],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in names}
    for k, proc in builds.items():
        out, _ = proc.communicate()
        if proc.returncode:
            print(f"build of {k} failed:\n{out[-3000:]}")
            return 1
    # The variants run one after another, each in its own process; --repeat R runs the whole
    # sequence R times (ABCD ABCD), so a drift during the session shows as a spread between
    # repeats of the same variant instead of as a difference between variants.
    results: dict[str, list[dict]] = {k: [] for k in names}
    for _ in range(args.repeat):
        for k in names:
            r = subprocess.run([sys.executable, "-m", "bench.ab", "--worker", "--rounds", str(args.rounds)],
                               env=envs[k], capture_output=True, text=True)
            if r.returncode:
                print(f"{k} failed:\n{r.stderr[-3000:]}")
                return 1
            results[k].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print("fused_v1 float16 p50 us (% of copy bandwidth / % of read-write roofline), one session"
          + (f"; median of {args.repeat} interleaved repeats, each repeat's p50 in brackets" if args.repeat > 1 else "")
          + "; ceilings GB/s: " + "; ".join(f"{k}: {v[0]['ceilings']}" for k, v in results.items()))
    print("empty kernel us: " + "; ".join(f"{k}: {'/'.join(str(r['floor_us']) for r in v)}" for k, v in results.items()))
    width = 22 + 8 * (args.repeat if args.repeat > 1 else 0)
    print(f"{'shape':<22}{'same-bytes copy us':>19}" + "".join(f"{k:>{width}}" for k in names))
    for i, (shape, causal) in enumerate(SHAPES):
        label = "x".join(map(str, shape)) + (" c" if causal else "")
        cells = []
        for k in names:
            reps = [rep["rows"][i] for rep in results[k]]
            mid = sorted(reps, key=lambda r: r["p50_us"])[len(reps) // 2]
            each = " [" + "/".join(f"{r['p50_us']:.1f}" for r in reps) + "]" if args.repeat > 1 else ""
            cells.append(f"{mid['p50_us']:>8.1f} ({mid['pct_copy']:>4.1f}/{mid['pct_roof']:>4.1f}%){each}")
        print(f"{label:<22}{results[names[0]][0]['rows'][i]['copy_us']:>19.1f}" + "".join(f"{c:>{width}}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
