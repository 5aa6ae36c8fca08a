"""scaled_masked_softmax microbenchmarks: synthetic [B, H, N, N] scores.

Providers, side by side in one group per (shape, dtype, causal):
  eager      x * scale -> masked_fill(~causal, -inf) -> softmax: three PyTorch kernels
  compiled   torch.compile of the same function (one compile per case)
  fused_v0   our textbook kernel (intermediates in a float32 workspace)
  fused_v1   our fused kernel
extra_info: p5/p50/p95 (us, CUDA events, cold L2), modeled bytes, GB/s, % of the measured
copy bandwidth, speedups vs eager and compiled measured in this run; on a GPU also the time of
a device copy of the same bytes and of an empty kernel, both timed the same way (the floors of
cases too small to reach the copy bandwidth).

Quick default: float16, every shape. --full: float32, float16, bfloat16.
On a machine without a GPU the cases run on the CPU at a small shape (eager and the
CPU path of fused_v1), which exercises the harness; GPU numbers need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import percentiles
from fused_attn.bytes import PROVIDERS, modeled_traffic, provider_fn, roofline_us


GPT2_BATCHES = (1, 8, 16)
GPT2_SEQLENS = (128, 512, 1024, 2048)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_SHAPES = [(1, 2, 64, 64)]


def gpu_shapes(config) -> list[tuple[int, int, int, int]]:
    batches = [int(b) for b in config.getoption("--bench-batches").split(",")] if config.getoption(
        "--bench-batches") else GPT2_BATCHES
    seqlens = [int(n) for n in config.getoption("--bench-seqlens").split(",")] if config.getoption(
        "--bench-seqlens") else GPT2_SEQLENS
    shapes = [(b, 12, n, n) for b in batches for n in seqlens]  # GPT-2
    shapes += [(1, 16, n, n) for n in (4096, 8192)]  # long rows
    shapes += [(4, 32, 2048, 2048)]  # Llama-like
    return shapes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    if torch.cuda.is_available():
        shapes = gpu_shapes(config)
        names = config.getoption("--bench-dtypes")
        dtypes = names.split(",") if names else (list(DTYPES) if config.getoption("--full") else ["float16"])
    else:
        shapes, dtypes = CPU_SHAPES, ["float32"]
    cases = []
    for shape in shapes:
        for dtype in dtypes:
            for causal in (True, False):
                for provider in PROVIDERS:
                    cases.append(dict(shape=shape, dtype=dtype, causal=causal, provider=provider))
    ids = [f"{c['provider']}-{'x'.join(map(str, c['shape']))}-{c['dtype']}-{'causal' if c['causal'] else 'full'}"
           for c in cases]
    metafunc.parametrize("case", cases, ids=ids)


def bench_scaled_masked_softmax(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    shape, dtype, causal, provider = case["shape"], DTYPES[case["dtype"]], case["causal"], case["provider"]
    if device.type == "cpu" and provider in ("compiled", "fused_v0"):
        pytest.skip(f"{provider} is measured on a GPU only (no CUDA device here)")
    benchmark.group = f"softmax {'x'.join(map(str, shape))} {case['dtype']} {'causal' if causal else 'full'}"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device).to(dtype)
    fn = provider_fn(provider, x, causal)
    times = timer.run(benchmark, fn)

    stats = percentiles(times)
    read, write = modeled_traffic(provider, shape, dtype, causal)
    gbps = (read + write) / (stats["p50_us"] * 1e-6) / 1e9
    info = dict(stats, provider=provider, shape=list(shape), dtype=case["dtype"], causal=causal,
                device=str(device), modeled_read_bytes=read, modeled_write_bytes=write,
                modeled_bytes=read + write, gbps=round(gbps, 1))
    if ceilings_gbps:
        info.update({f"{k}_gbps": round(v, 1) for k, v in ceilings_gbps.items()})
        info["pct_of_copy_bw"] = round(100 * gbps / ceilings_gbps["copy"], 1)
        info["roofline_us"] = round(roofline_us(read, write, ceilings_gbps), 2)
        info["pct_of_roofline"] = round(100 * info["roofline_us"] / stats["p50_us"], 1)
        # Small cases are bound by ramp-up, tail and DRAM latency, not bandwidth: a copy of the
        # same bytes, timed the same way, is what they can be held to.
        copy_us = timer.same_bytes_copy_us(read + write)
        info["same_bytes_copy_us"] = round(copy_us, 2)
        info["pct_of_same_bytes_copy"] = round(100 * copy_us / stats["p50_us"], 1)
        info["launch_floor_us"] = round(launch_floor_us, 2)
    medians[(benchmark.group, provider)] = stats["p50_us"]
    for base in ("eager", "compiled"):
        if (benchmark.group, base) in medians and provider != base:
            info[f"speedup_vs_{base}"] = round(medians[(benchmark.group, base)] / stats["p50_us"], 3)
    benchmark.extra_info.update(info)
