"""Bytes moved through device memory: modeled per provider, and measured with Nsight Compute.

    python -m fused_attn.bytes [--shape 8,12,1024,1024] [--dtype float16]

Runs each provider of the softmax benchmark once under
``ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum`` (only the
measured call is profiled: cudaProfilerStart/Stop around it) and prints modeled vs measured
DRAM bytes, summed over the provider's kernels. This checks the "several passes -> one
pass" claim with hardware counters rather than arithmetic alone. Needs a GPU and ncu.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

import torch

from fused_attn import reference

PROVIDERS = ("eager", "compiled", "fused_v0", "fused_v1")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def visible_elements(shape, causal: bool) -> int:
    *lead, sq, sk = shape
    n_lead = 1
    for d in lead:
        n_lead *= d
    if not causal:
        return n_lead * sq * sk
    return n_lead * int(reference.causal_mask(sq, sk).sum())


def modeled_traffic(provider: str, shape, dtype: torch.dtype, causal: bool) -> tuple[int, int]:
    """Fewest (bytes read, bytes written) each provider's kernels must move through device memory."""
    *lead, sq, sk = shape
    n = visible_elements(shape, False)
    e = torch.empty((), dtype=dtype).element_size()
    mask = sq * sk if causal else 0  # bool causal mask, broadcast over the leading dims: read once
    if provider == "eager":  # mul: r+w; masked_fill: r+mask+w; softmax: r+w
        k = 3 if causal else 2
        return k * n * e + mask, k * n * e
    if provider == "compiled":  # the ideal of one fused kernel: read all + write all
        return n * e + mask, n * e
    if provider == "fused_v0":
        # Five passes over a float32 workspace row, but a row's passes run back to back in
        # one block and hit L1/L2 (ncu: 0.97 of this): DRAM sees x read, the workspace
        # written once, out written.
        return n * e, n * e + n * 4
    if provider == "fused_v1":  # read the visible elements, write all
        return visible_elements(shape, causal) * e, n * e
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def modeled_bytes(provider: str, shape, dtype: torch.dtype, causal: bool) -> int:
    return sum(modeled_traffic(provider, shape, dtype, causal))


def roofline_us(read: int, write: int, ceilings: dict[str, float]) -> float:
    """Lower bound on the time to move (read, write) bytes, in us, from the device ceilings
    measured in GB/s: mixed traffic at the copy rate, and each direction at its own rate
    (a causal softmax writes twice what it reads and is bound by the write rate)."""
    return max((read + write) / ceilings["copy"], read / ceilings["read"], write / ceilings["write"]) / 1e3


def measure_ceilings(nbytes: int = 1 << 30, reps: int = 15) -> dict[str, float]:
    """Device bandwidths in GB/s (1e9 B/s), medians over reps with CUDA events: copy
    (bytes read + written by a device-to-device copy), read (a float32 sum), write (fill_)."""
    import statistics

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ops = {"copy": (lambda: dst.copy_(src), 2 * nbytes), "read": (lambda: src.sum(), nbytes),
           "write": (lambda: dst.fill_(1.0), nbytes)}
    out = {}
    for name, (fn, moved) in ops.items():
        fn()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        out[name] = moved / statistics.median(times) / 1e9
    return out


def provider_fn(provider: str, x: torch.Tensor, causal: bool):
    """One call of ``provider`` on scores ``x`` with scale headdim**-0.5 (shared with the benchmarks)."""
    from fused_attn.softmax import scaled_masked_softmax

    scale = x.shape[-1] ** -0.5
    keep = reference.causal_mask(x.shape[-2], x.shape[-1], x.device) if causal else None
    if provider == "eager":
        return lambda: reference.eager_scaled_masked_softmax(x, scale, keep)
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
        compiled = torch.compile(reference.eager_scaled_masked_softmax, dynamic=False)
        return lambda: compiled(x, scale, keep)
    out = torch.empty_like(x)
    version = 0 if provider == "fused_v0" else 1
    return lambda: scaled_masked_softmax(x, scale, causal=causal, out=out, version=version)


def _worker(provider: str, shape, dtype: torch.dtype, causal: bool) -> None:
    x = torch.randn(shape, device="cuda").to(dtype)
    fn = provider_fn(provider, x, causal)
    for _ in range(2):  # compile, build, allocate outside the profiled region
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def measure(provider: str, shape, dtype_name: str, causal: bool) -> tuple[int, int, int]:
    """(bytes read, bytes written, kernels) of one call, from ncu."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--print-units", "base",
           "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
           sys.executable, "-m", "fused_attn.bytes", "--worker", provider, "--shape", ",".join(map(str, shape)),
           "--dtype", dtype_name] + (["--causal"] if causal else [])
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = run.stdout[run.stdout.find('"ID"'):]
    read = write = 0
    kernels = set()
    for row in csv.DictReader(io.StringIO(text)):
        value = float(row["Metric Value"].replace(",", ""))
        kernels.add(row["ID"])
        if row["Metric Name"] == "dram__bytes_read.sum":
            read += value
        elif row["Metric Name"] == "dram__bytes_write.sum":
            write += value
    return int(read), int(write), len(kernels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,12,1024,1024")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES))
    ap.add_argument("--causal", action="store_true", help="(worker) causal")
    ap.add_argument("--worker", choices=PROVIDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    if args.worker:
        _worker(args.worker, shape, dtype, args.causal)
        return 0
    if not torch.cuda.is_available() or shutil.which("ncu") is None:
        print("fused_attn.bytes needs a CUDA GPU and Nsight Compute (ncu) on PATH")
        return 2
    print(f"DRAM bytes per call, {torch.cuda.get_device_name()}, x {list(shape)} {args.dtype} "
          f"(ncu dram__bytes_read.sum + dram__bytes_write.sum, --clock-control none)")
    print(f"{'causal':<7} {'provider':<9} {'kernels':>7} {'modeled MB':>11} {'read MB':>9} {'write MB':>9} "
          f"{'total MB':>9} {'meas/model':>10}")
    for causal in (True, False):
        for provider in PROVIDERS:
            read, write, kernels = measure(provider, shape, args.dtype, causal)
            model = modeled_bytes(provider, shape, dtype, causal)
            print(f"{str(causal):<7} {provider:<9} {kernels:>7} {model / 1e6:>11.1f} {read / 1e6:>9.1f} "
                  f"{write / 1e6:>9.1f} {(read + write) / 1e6:>9.1f} {(read + write) / model:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
