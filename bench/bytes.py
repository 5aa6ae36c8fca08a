"""Bytes moved through device memory by each provider of an op's benchmark: modeled, and measured with ncu.

    python -m bench.bytes [--op softmax] [--shape 8,12,1024,1024] [--dtype float16] [--backward]

Runs each provider that ``bench/bench_<op>.py`` lists for this tool (``bytes_cases``; with
``--backward``: its backward cases) once under ``ncu --clock-control none --metrics
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum`` (only the
measured call is profiled: cudaProfilerStart/Stop around it) and prints the op's modeled bytes
(``bytes_model``) beside the measured ones, summed over the provider's kernels. This checks the
"several passes -> one pass" claim with hardware counters rather than arithmetic alone. Needs a
GPU and ncu. An op's module provides ``BYTES_SHAPE``, ``bytes_cases(backward)``,
``bytes_model(provider, shape, dtype, causal, backward)`` and ``bytes_call(...)`` (the call).

Writes a kernel leaves in L2: ncu flushes the caches before each profiled kernel, so a kernel
starts on an empty L2, but the lines it writes and that are still resident (dirty) when it ends
are written back by the next flush, outside every measurement: ``dram__bytes_write`` misses up to
one L2 (50 MiB on an H100, 60 MiB on an H200) of each kernel's writes (e.g. fused_v1 at 8x12x1024x1024 causal:
201 MB written, 176 MB seen by DRAM). The L2 counts every store that arrives from the SMs
(``lts__t_sectors_srcunit_tex_op_write`` x 32 B), and all of them reach DRAM in the end (these
kernels write each byte once), so the table prints the DRAM writes, the L2 writes, their
difference ("in L2 MB": written back after the kernel) and totals DRAM read + L2 write, which
is what meas/model compares with the model.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import shutil
import subprocess
import sys

import torch

from fused_attn.generate import DTYPES


def op_module(op: str):
    """bench/bench_<op>.py, which must provide this tool's interface."""
    try:
        mod = importlib.import_module(f"bench.bench_{op}")
    except ModuleNotFoundError:
        raise ValueError(f"--op must name a bench/bench_<op>.py, got {op!r}") from None
    missing = [a for a in ("BYTES_SHAPE", "bytes_cases", "bytes_model", "bytes_call") if not hasattr(mod, a)]
    if missing:
        raise ValueError(f"bench/bench_{op}.py must define {', '.join(missing)} for bench.bytes, got none")
    return mod


def _worker(mod, provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool) -> None:
    fn = mod.bytes_call(provider, shape, dtype, causal, backward)
    for _ in range(2):  # compile, build, allocate outside the profiled region
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
L2_WRITE_METRIC = "lts__t_sectors_srcunit_tex_op_write.sum"  # 32-byte sectors stored by the SMs into L2


def measure(provider: str, shape, dtype_name: str, causal: bool, backward: bool = False, op: str = "softmax") -> dict:
    """Bytes of one call from ncu, summed over its kernels: dram_read, dram_write, l2_write (None
    where this ncu lacks the L2 metric) and kernels."""
    worker = [sys.executable, "-m", "bench.bytes", "--op", op, "--worker", provider, "--shape",
              ",".join(map(str, shape)), "--dtype", dtype_name] + (["--causal"] if causal else []) + (
        ["--backward"] if backward else [])
    for metrics in ((*DRAM_METRICS, L2_WRITE_METRIC), DRAM_METRICS):
        cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--print-units", "base",
               "--metrics", ",".join(metrics), *worker]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode == 0 and '"ID"' in run.stdout:
            break
    else:
        raise RuntimeError(f"ncu must profile {provider}, got rc {run.returncode}: {run.stderr[-500:]}")
    text = run.stdout[run.stdout.find('"ID"'):]
    sums = dict.fromkeys(metrics, 0.0)
    kernels = set()
    for row in csv.DictReader(io.StringIO(text)):
        kernels.add(row["ID"])
        if row["Metric Name"] in sums:
            sums[row["Metric Name"]] += float(row["Metric Value"].replace(",", ""))
    l2 = sums.get(L2_WRITE_METRIC)
    return dict(dram_read=int(sums[DRAM_METRICS[0]]), dram_write=int(sums[DRAM_METRICS[1]]),
                l2_write=None if l2 is None else int(32 * l2), kernels=len(kernels))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bytes", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--op", default="softmax", help="the op whose bench/bench_<op>.py lists the providers")
    ap.add_argument("--shape", help="comma list of sizes (default: the op's BYTES_SHAPE)")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES), help="the inputs' dtype")
    ap.add_argument("--backward", action="store_true", help="the backward providers")
    ap.add_argument("--causal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", metavar="PROVIDER", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        mod = op_module(args.op)
        shape = tuple(int(s) for s in args.shape.split(",")) if args.shape else tuple(mod.BYTES_SHAPE)
    except ValueError as e:
        if args.shape and "--op" not in str(e):
            e = f"--shape must be a comma list of sizes, e.g. 8,12,1024,1024, got {args.shape!r}"
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    if min(shape, default=0) < 1:
        ap.exit(2, f"{ap.prog}: error: --shape must be a comma list of positive sizes, got {args.shape!r}\n")
    dtype = DTYPES[args.dtype]
    if args.worker:
        _worker(mod, args.worker, shape, dtype, args.causal, args.backward)
        return 0
    if not torch.cuda.is_available() or shutil.which("ncu") is None:
        missing = "a CUDA GPU" if not torch.cuda.is_available() else "Nsight Compute (ncu) on PATH"
        ap.exit(2, f"{ap.prog}: error: bench.bytes needs a CUDA GPU and Nsight Compute (ncu) on PATH, "
                   f"found no {missing.removeprefix('a ')}\n")
    print(f"{args.op} {'backward' if args.backward else 'forward'}: bytes per call, "
          f"{torch.cuda.get_device_name()}, shape {list(shape)} {args.dtype} (ncu dram__bytes_read/write.sum and "
          f"{L2_WRITE_METRIC} x 32, --clock-control none; caches flushed before each kernel)")
    print("in L2 MB: written by the kernels, still in L2 when each ended (written back after it; DRAM write "
          "misses it); total = DRAM read + L2 write")
    print(f"{'causal':<7} {'provider':<13} {'kernels':>7} {'modeled MB':>11} {'read MB':>9} {'write MB':>9} "
          f"{'L2 write MB':>11} {'in L2 MB':>9} {'total MB':>9} {'meas/model':>10}")
    for causal, provider in mod.bytes_cases(args.backward):
        m = measure(provider, shape, args.dtype, causal, args.backward, args.op)
        modeled = sum(mod.bytes_model(provider, shape, dtype, causal, args.backward))
        write = m["dram_write"] if m["l2_write"] is None else max(m["dram_write"], m["l2_write"])
        l2 = "-" if m["l2_write"] is None else f"{m['l2_write'] / 1e6:.1f}"
        resident = "-" if m["l2_write"] is None else f"{max(0, m['l2_write'] - m['dram_write']) / 1e6:.1f}"
        total = m["dram_read"] + write
        print(f"{str(causal):<7} {provider:<13} {m['kernels']:>7} {modeled / 1e6:>11.1f} "
              f"{m['dram_read'] / 1e6:>9.1f} {m['dram_write'] / 1e6:>9.1f} {l2:>11} {resident:>9} "
              f"{total / 1e6:>9.1f} {total / modeled:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
