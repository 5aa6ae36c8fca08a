"""attention microbenchmarks: full-attention prefill, ours against PyTorch's SDPA backends.

Providers, side by side in one group per (shape, causal, dtype):
  sdpa_math       F.scaled_dot_product_attention pinned to the MATH backend (the unfused chain:
                  materializes the [B, H, S, S] scores)
  sdpa_efficient  pinned to EFFICIENT_ATTENTION (memory-efficient, xformers-style)
  sdpa_flash      pinned to FLASH_ATTENTION (FlashAttention-2)
  sdpa_cudnn      pinned to CUDNN_ATTENTION (cuDNN's fused attention; on Hopper its wgmma kernels)
  fused_naive     fused_attn.attention(mode="naive"): GEMM, scaled_masked_softmax, GEMM (float32 scores)
  fused_tiled     fused_attn.attention(mode="tiled"): the same with register-blocked GEMMs
  fused_flash_mma fused_attn.attention(mode="flash_mma"): our FlashAttention-2 forward on mma.sync
  fused_flash     fused_attn.attention(mode="flash"): the same on wgmma where it runs (Hopper, sm_90a
                  build, D 40..128), else the mma.sync one again
A pinned backend that refuses a case is skipped; the providers that materialize the scores
(sdpa_math, fused_naive, fused_tiled) are skipped where those would exceed MAX_SCORES_FRACTION of the free memory.

Shapes, written [B, Hq, Hkv, D, S] (seqlen_q = seqlen_k = S, S last so bench.report plots time
against S): GPT-2 (B 1, 8; H 12; D 64; S 128, 512, 1024), Llama-like (B 1; H 32; D 128; S 512,
2048, 4096, 16384), GQA (B 1; Hq 32, Hkv 8; D 128; S 4096, 16384); causal and not. SDPA takes
GQA with enable_gqa=True; causal is is_causal=True (top-left = bottom-right at Sq = Sk).

Each provider's output is checked once, before timing, against the float64 reference on the first
batch element and head (max |out - ref| <= CHECK_RTOL x max |ref|).

extra_info: p5/p50/p95 (us, CUDA events, cold L2: bench/harness.py), modeled FLOPs (4 B Hq S² D,
half under causal), TFLOP/s, % of the measured dense-matmul peak at that dtype (harness.matmul_peak),
peak memory above the inputs (bytes, one call: O(S) for the flash kernels, O(S²) for math, naive
and tiled),
and speedups vs sdpa_flash, sdpa_cudnn and sdpa_math measured in this run.

Quick default: float16. --full: float16 and bfloat16 (--bench-dtypes overrides both). On a machine
without a GPU the cases run on the CPU at two tiny shapes (sdpa_math and the fused_* providers: the
op's CPU path), which exercises the harness; GPU numbers need a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_decode_attention import dtypes_for  # the same --full / --bench-dtypes rule
from bench.bench_softmax import check_output
from bench.harness import percentiles, start_case
from fused_attn import reference
from fused_attn.generate import DTYPES

GPT2_SHAPES = [(b, 12, 12, 64, s) for b in (1, 8) for s in (128, 512, 1024)]
LLAMA_SHAPES = [(1, 32, 32, 128, s) for s in (512, 2048, 4096, 16384)]
GQA_SHAPES = [(1, 32, 8, 128, s) for s in (4096, 16384)]
CPU_SHAPES = [(1, 4, 2, 16, 24), (1, 2, 2, 16, 16)]
MAX_SCORES_FRACTION = 0.3

# Baselines first (speedups are against providers already measured in the group); ours last:
# bench.report takes the last provider named fused* as ours.
PROVIDERS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fused_naive", "fused_tiled", "fused_flash_mma",
             "fused_flash")
SPEEDUP_BASES = ("sdpa_math", "sdpa_flash", "sdpa_cudnn")
GPU_ONLY = ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn")
MATERIALIZES_SCORES = ("sdpa_math", "fused_naive", "fused_tiled")
PINNED_BACKENDS = {"sdpa_math": "MATH", "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_flash": "FLASH_ATTENTION",
                   "sdpa_cudnn": "CUDNN_ATTENTION"}
NOTES = {**{p: f"F.scaled_dot_product_attention pinned to {b}" for p, b in PINNED_BACKENDS.items()},
         "fused_naive": "fused_attn.attention(mode='naive'): GEMM + scaled_masked_softmax + GEMM",
         "fused_tiled": "fused_attn.attention(mode='tiled'): register-blocked GEMMs around scaled_masked_softmax",
         "fused_flash_mma": "fused_attn.attention(mode='flash_mma'): FlashAttention-2 forward, mma.sync",
         "fused_flash": "fused_attn.attention(mode='flash'): FlashAttention-2 forward, wgmma on Hopper (sm_90a)"}

REPORT_LABELS = {"bench_attention": dict(title="attention (prefill, seqlen_q = seqlen_k = S)",
                                         shape="shape [B,Hq,Hkv,D,S]", order=PROVIDERS)}


def flops(shape, causal: bool) -> int:
    """Modeled FLOPs of one forward: two GEMMs of 2 B Hq S² D each, half of it under causal."""
    b, hq, _, d, s = shape
    total = 4 * b * hq * s * s * d
    return total // 2 if causal else total


def scores_bytes(shape) -> int:
    """The float32 [B, Hq, S, S] score matrix the materializing providers allocate (at least)."""
    b, hq, _, _, s = shape
    return 4 * b * hq * s * s


def gpu_shapes() -> list[tuple[int, int, int, int, int]]:
    return GPT2_SHAPES + LLAMA_SHAPES + GQA_SHAPES


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes, dtypes = (gpu_shapes(), dtypes_for(config)) if cuda else (CPU_SHAPES, ["float32"])
    return [dict(shape=shape, dtype=dtype, causal=causal, provider=provider)
            for shape in shapes for causal in (False, True) for dtype in dtypes for provider in PROVIDERS]


def case_id(c: dict) -> str:
    b, hq, hkv, d, s = c["shape"]
    return f"{c['provider']}-b{b}-hq{hq}-hkv{hkv}-d{d}-s{s}-{'causal' if c['causal'] else 'full'}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def make_inputs(shape, dtype: torch.dtype, device, seed: int = 0) -> dict:
    b, hq, hkv, d, s = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(size, generator=gen, device=device, dtype=dtype)

    return dict(q=randn(b, hq, s, d), k=randn(b, hkv, s, d), v=randn(b, hkv, s, d))


def provider_fn(provider: str, t: dict, causal: bool):
    """One forward of ``provider`` on the inputs of ``make_inputs``."""
    from fused_attn import attention

    q, k, v = t["q"], t["k"], t["v"]
    if provider in PINNED_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, PINNED_BACKENDS[provider])
        gqa = q.shape[1] != k.shape[1]

        def pinned():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return pinned
    if provider in ("fused_naive", "fused_tiled", "fused_flash_mma", "fused_flash"):
        mode = provider.removeprefix("fused_")
        return lambda: attention(q, k, v, causal=causal, mode=mode)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def check(provider: str, out: torch.Tensor, t: dict, causal: bool) -> None:
    """Raise unless ``out`` matches the float64 reference on batch element 0, head 0 (its float64
    scores: 2 GB at S = 16384)."""
    q, k, v = t["q"][:1, :1].double(), t["k"][:1, :1].double(), t["v"][:1, :1].double()
    ref, _ = reference.attention(q, k, v, causal=causal)
    check_output(provider, out[:1, :1], ref)


def record(benchmark, case: dict, times: list[float], peak_bytes: int | None, tflops_peak: float | None,
           medians) -> None:
    """extra_info of one case: percentiles, FLOPs, TFLOP/s, % of the matmul peak, peak memory, speedups."""
    shape, provider, causal = case["shape"], case["provider"], case["causal"]
    stats = percentiles(times)
    f = flops(shape, causal)
    tflops = f / (stats["p50_us"] * 1e-6) / 1e12
    info = dict(stats, provider=provider, shape=list(shape), dtype=case["dtype"], causal=causal,
                note=NOTES[provider], modeled_flops=f, tflops=round(tflops, 2))
    if tflops_peak:
        info["matmul_peak_tflops"] = round(tflops_peak, 1)
        info["pct_of_matmul_peak"] = round(100 * tflops / tflops_peak, 1)
    if peak_bytes is not None:
        info["peak_memory_bytes"] = int(peak_bytes)
    medians[(benchmark.group, provider)] = stats["p50_us"]
    for base in SPEEDUP_BASES:
        if (benchmark.group, base) in medians and provider != base:
            info[f"speedup_vs_{base}"] = round(medians[(benchmark.group, base)] / stats["p50_us"], 3)
    benchmark.extra_info.update(info)


def group(case: dict) -> str:
    return f"attention {'x'.join(map(str, case['shape']))} {'causal' if case['causal'] else 'full'} {case['dtype']}"


def peak_memory(fn) -> int:
    """Bytes allocated at the peak of one call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def bench_attention(benchmark, case, device, timer, matmul_peak_tflops, medians):
    provider, shape, dtype, causal = case["provider"], case["shape"], DTYPES[case["dtype"]], case["causal"]
    free = start_case(benchmark, group(case), provider, device, GPU_ONLY)
    if free is not None and provider in MATERIALIZES_SCORES and scores_bytes(shape) > MAX_SCORES_FRACTION * free:
        pytest.skip(f"{provider}: the {scores_bytes(shape) / 1e9:.1f} GB score matrix exceeds "
                    f"{MAX_SCORES_FRACTION:.0%} of the free device memory ({free / 1e9:.1f} GB)")
    t = make_inputs(shape, dtype, device)
    fn = provider_fn(provider, t, causal)
    try:
        out = fn()
    except RuntimeError as e:
        if provider not in PINNED_BACKENDS:
            raise
        pytest.skip(f"{provider}: the backend refuses this case ({str(e).splitlines()[0][:200]})")
    check(provider, out, t, causal)
    del out
    peak = tflops_peak = None
    if device.type == "cuda":
        peak = peak_memory(fn)
        tflops_peak = matmul_peak_tflops(dtype)
    times = timer.run(benchmark, fn)
    record(benchmark, case, times, peak, tflops_peak, medians)
