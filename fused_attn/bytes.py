"""Bytes moved through device memory: modeled per provider, and measured with Nsight Compute.

    python -m fused_attn.bytes [--shape 8,12,1024,1024] [--dtype float16] [--backward]

Runs each provider of the softmax benchmark (``--backward``: of its backward cases) once under
``ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,
lts__t_sectors_srcunit_tex_op_write.sum`` (only the measured call is profiled:
cudaProfilerStart/Stop around it) and prints modeled vs measured bytes, summed over the
provider's kernels. This checks the "several passes -> one pass" claim with hardware counters
rather than arithmetic alone. Needs a GPU and ncu.

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
import io
import shutil
import subprocess
import sys

import torch

from fused_attn import reference

PROVIDERS = ("eager", "compiled", "compiled_iota", "fused_v0", "fused_v1")
CAUSAL_ONLY = ("compiled_iota",)  # without a mask it is the same function as `compiled`
BACKWARD_PROVIDERS = ("eager", "compiled", "fused")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def providers(causal: bool, backward: bool = False) -> tuple[str, ...]:
    """The providers measured for a case (forward: compiled_iota only with a causal mask)."""
    if backward:
        return BACKWARD_PROVIDERS
    return tuple(p for p in PROVIDERS if causal or p not in CAUSAL_ONLY)


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
    mask = sq * sk if causal else 0  # bool causal mask built once, broadcast over the leading dims: read once
    if provider == "eager":  # mul: r+w; masked_fill: r+mask+w; softmax: r+w
        k = 3 if causal else 2
        return k * n * e + mask, k * n * e
    if provider == "compiled":  # the ideal of one fused kernel: read all + the mask, write all
        return n * e + mask, n * e
    if provider == "compiled_iota":  # the mask comes from indices inside the kernel: read all, write all
        return n * e, n * e
    if provider == "fused_v0":
        # Five passes over a float32 workspace row, but a row's passes run back to back in
        # one block and hit L1/L2 (ncu: 0.97 of this): DRAM sees x read, the workspace
        # written once, out written.
        return n * e, n * e + n * 4
    if provider == "fused_v1":  # read the visible elements, write all
        return visible_elements(shape, causal) * e, n * e
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def modeled_backward_traffic(provider: str, shape, dtype: torch.dtype, causal: bool) -> tuple[int, int]:
    """(bytes read, bytes written) of dx from dy and the forward's output y, per backward provider."""
    *lead, sq, sk = shape
    n = visible_elements(shape, False)
    e = torch.empty((), dtype=dtype).element_size()
    if provider == "eager":
        # softmax backward: read y, dy, write g; masked_fill backward (causal): read g + the mask,
        # write g'; mul backward: read g', write dx.
        if causal:
            return 4 * n * e + sq * sk, 3 * n * e
        return 3 * n * e, 2 * n * e
    if provider == "compiled":  # the ideal of one fused kernel on the formula: read y and dy, write dx
        return 2 * n * e, n * e
    if provider == "fused":  # read y and dy over the visible elements, write dx everywhere
        return 2 * visible_elements(shape, causal) * e, n * e
    raise ValueError(f"provider must be one of {BACKWARD_PROVIDERS}, got {provider!r}")


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
    """One call of ``provider`` on scores ``x`` with scale headdim**-0.5 (shared with the benchmarks).
    The causal mask of ``eager`` and ``compiled`` is built once, here, as a user would; ``compiled_iota``
    builds it from indices inside the compiled function."""
    from fused_attn.softmax import scaled_masked_softmax

    scale = x.shape[-1] ** -0.5
    masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device) if causal else None
    if provider == "eager":
        return lambda: reference.eager_scaled_masked_softmax(x, scale, masked)
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
        compiled = torch.compile(reference.eager_scaled_masked_softmax, dynamic=False)
        return lambda: compiled(x, scale, masked)
    if provider == "compiled_iota":
        torch._dynamo.reset()
        compiled = torch.compile(_chain_with_causal_iota, dynamic=False)
        return lambda: compiled(x, scale)
    out = torch.empty_like(x)
    version = 0 if provider == "fused_v0" else 1
    return lambda: scaled_masked_softmax(x, scale, causal=causal, out=out, version=version)


def _chain_with_causal_iota(x: torch.Tensor, scale: float) -> torch.Tensor:
    # torch.arange inside the compiled graph: Inductor computes the mask from indices in the kernel.
    masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device)
    return reference.eager_scaled_masked_softmax(x, scale, masked)


def softmax_backward_formula(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """dx = scale * y * (grad - sum_j grad * y), in float32, cast to y's dtype (the `compiled`
    backward baseline: the same inputs and output as the fused backward)."""
    g, p = grad.float(), y.float()
    return (scale * p * (g - (g * p).sum(-1, keepdim=True))).to(y.dtype)


def backward_provider_fn(provider: str, x: torch.Tensor, dy: torch.Tensor, causal: bool):
    """One backward call of ``provider``: dx for scores ``x`` and output gradient ``dy`` (scale
    headdim**-0.5). ``eager`` runs autograd through the eager chain, its graph built once here
    (retain_graph); ``compiled`` and ``fused`` take the forward's output y, computed once here."""
    from fused_attn import softmax

    scale = x.shape[-1] ** -0.5
    if provider == "eager":
        masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device) if causal else None
        xg = x.detach().requires_grad_()
        y = reference.eager_scaled_masked_softmax(xg, scale, masked)
        return lambda: torch.autograd.grad(y, xg, dy, retain_graph=True)[0]
    y = softmax.scaled_masked_softmax(x, scale, causal=causal)  # masked elements are exact zeros
    if provider == "compiled":
        torch._dynamo.reset()
        compiled = torch.compile(softmax_backward_formula, dynamic=False)
        return lambda: compiled(dy, y, scale)
    if provider == "fused":
        return lambda: softmax.scaled_masked_softmax_backward(dy, y, scale, causal=causal)
    raise ValueError(f"provider must be one of {BACKWARD_PROVIDERS}, got {provider!r}")


def _worker(provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool) -> None:
    x = torch.randn(shape, device="cuda").to(dtype)
    if backward:
        fn = backward_provider_fn(provider, x, torch.randn(shape, device="cuda").to(dtype), causal)
    else:
        fn = provider_fn(provider, x, causal)
    for _ in range(2):  # compile, build, allocate outside the profiled region
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
L2_WRITE_METRIC = "lts__t_sectors_srcunit_tex_op_write.sum"  # 32-byte sectors stored by the SMs into L2


def measure(provider: str, shape, dtype_name: str, causal: bool, backward: bool = False) -> dict:
    """Bytes of one call from ncu, summed over its kernels: dram_read, dram_write, l2_write (None
    where this ncu lacks the L2 metric) and kernels."""
    worker = [sys.executable, "-m", "fused_attn.bytes", "--worker", provider, "--shape", ",".join(map(str, shape)),
              "--dtype", dtype_name] + (["--causal"] if causal else []) + (["--backward"] if backward else [])
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,12,1024,1024")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES))
    ap.add_argument("--backward", action="store_true", help="the backward providers (dx from dy and y)")
    ap.add_argument("--causal", action="store_true", help="(worker) causal")
    ap.add_argument("--worker", choices=sorted(set(PROVIDERS + BACKWARD_PROVIDERS)), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    if args.worker:
        _worker(args.worker, shape, dtype, args.causal, args.backward)
        return 0
    if not torch.cuda.is_available() or shutil.which("ncu") is None:
        print("fused_attn.bytes needs a CUDA GPU and Nsight Compute (ncu) on PATH")
        return 2
    model = modeled_backward_traffic if args.backward else modeled_traffic
    print(f"{'Backward (dx from dy, y)' if args.backward else 'Forward'}: bytes per call, "
          f"{torch.cuda.get_device_name()}, x {list(shape)} {args.dtype} (ncu dram__bytes_read/write.sum and "
          f"{L2_WRITE_METRIC} x 32, --clock-control none; caches flushed before each kernel)")
    print("in L2 MB: written by the kernels, still in L2 when each ended (written back after it; DRAM write "
          "misses it); total = DRAM read + L2 write")
    print(f"{'causal':<7} {'provider':<13} {'kernels':>7} {'modeled MB':>11} {'read MB':>9} {'write MB':>9} "
          f"{'L2 write MB':>11} {'in L2 MB':>9} {'total MB':>9} {'meas/model':>10}")
    for causal in (True, False):
        for provider in providers(causal, args.backward):
            m = measure(provider, shape, args.dtype, causal, args.backward)
            modeled = sum(model(provider, shape, dtype, causal))
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
