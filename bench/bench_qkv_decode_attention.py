"""qkv_decode_attention microbenchmarks: a pre-LN block's QKV projection + decode attention (append 1 new
key/value, attend over the cache), one new token per sequence.

Providers, side by side in one group per (shape, dtype); every call normalizes x (LayerNorm without affine:
the norm's weight and bias are folded into w_qkv / b_qkv), projects it to q, k, v, appends k / v at slot
L - 1 and attends with q over the L valid slots:
  eager     F.layer_norm + torch.addmm + two index_copy_ + F.scaled_dot_product_attention (attn_mask=None:
            exact, max_len = L), what a gpt-fast-style PyTorch step runs
  compiled  torch.compile of ``eager`` (one compile per case)
  unfused   fused_attn.linear(norm="layer_norm") + fused_attn.decode_attention(k_new=, v_new=): our two
            launches (GPT-2's step at batch > 8, or at 2-8 over caches of more than 256 slots)
  fused     fused_attn.qkv_decode_attention: one launch (GPT-2's step at batch 1 over any cache, 2-8 over up
            to 256 slots)

Shapes [B, H, L] with head_dim 64, d = 64 H: GPT-2 small (H 12) and medium (H 16) at B 1, 4, 8 and 16 (clusters
of 1, 4 and 8 sequences; 16: two clusters a head), L 128 / 1024. The append is idempotent (the same k / v at the
same slot every call). Each provider's output is checked once before timing against the float64 computation of
the op (its CPU path in float64).
extra_info: p5/p50/p95 (cold L2, bench/harness.py), modeled bytes (w_qkv, b_qkv, K and V over L slots,
x, out, the appended k / v), GB/s, % of copy bandwidth, the same-bytes copy and empty-kernel floors, and
speedups vs eager, compiled and unfused in this run. Quick default float16; --full adds bfloat16. Without
a GPU: one tiny float32 shape, eager / unfused / fused on the CPU (the harness only).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_softmax import check_output
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn import decode_attention, linear, qkv_decode_attention
from fused_attn.generate import DTYPES
from fused_attn.qkv_decode_attention import HEAD_DIM, _cpu

GPU_SHAPES = [(b, h, n) for h in (12, 16) for b in (1, 4, 8, 16) for n in (128, 1024)]
CPU_SHAPES = [(2, 4, 16)]
QUICK_DTYPES = ("float16",)
FULL_DTYPES = ("float16", "bfloat16")
EPS = 1e-5
# Baselines first; `fused` last (bench.report takes the last provider named fused* as ours).
PROVIDERS = ("eager", "compiled", "unfused", "fused")
SPEEDUP_BASES = ("eager", "compiled", "unfused")
GPU_ONLY = ("compiled",)
NOTES = {"eager": "F.layer_norm + addmm + index_copy_ x2 + SDPA",
         "compiled": "torch.compile(F.layer_norm + addmm + index_copy_ x2 + SDPA)",
         "unfused": "fused_attn.linear(norm=) + fused_attn.decode_attention(k_new=, v_new=)",
         "fused": "fused_attn.qkv_decode_attention"}


def dtypes_for(config) -> list[str]:
    names = config.getoption("--bench-dtypes")
    if names:
        return names.split(",")
    return list(FULL_DTYPES if config.getoption("--full") else QUICK_DTYPES)


def make_cases(config) -> list[dict]:
    cuda = torch.cuda.is_available()
    shapes, dtypes = (GPU_SHAPES, dtypes_for(config)) if cuda else (CPU_SHAPES, ["float32"])
    return [dict(shape=s, dtype=dt, provider=p) for s in shapes for dt in dtypes for p in PROVIDERS
            if cuda or p not in GPU_ONLY]


def case_id(c: dict) -> str:
    b, h, n = c["shape"]
    return f"{c['provider']}-b{b}-h{h}-l{n}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def make_inputs(shape, dtype: torch.dtype, device, seed: int = 0) -> dict:
    b, h, n = shape
    d = h * HEAD_DIM
    g = torch.Generator().manual_seed(seed)
    t = dict(x=torch.randn(b, 1, d, generator=g), w=torch.randn(3 * d, d, generator=g) * d ** -0.5,
             bias=torch.randn(3 * d, generator=g) * 0.1, k_cache=torch.randn(b, h, n, HEAD_DIM, generator=g),
             v_cache=torch.randn(b, h, n, HEAD_DIM, generator=g))
    t = {k: v.to(device=device, dtype=dtype) for k, v in t.items()}
    t["cache_seqlens"] = torch.full((b,), n - 1, dtype=torch.int32, device=device)
    t["input_pos"] = torch.tensor([n - 1], device=device)
    return t


def eager_step(x, w, bias, k_cache, v_cache, input_pos):
    b, _, d = x.shape
    xn = F.layer_norm(x, (d,), eps=EPS)
    qkv = torch.addmm(bias, xn.view(b, d), w.t()).view(b, 1, 3, d // HEAD_DIM, HEAD_DIM).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    k_cache.index_copy_(2, input_pos, k)
    v_cache.index_copy_(2, input_pos, v)
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, scale=HEAD_DIM ** -0.5)
    return o.transpose(1, 2).reshape(b, 1, d)


def unfused_step(x, w, bias, k_cache, v_cache, cache_seqlens):
    b, _, d = x.shape
    qkv = linear(x, w, bias, norm="layer_norm", eps=EPS)
    q, k, v = qkv.view(b, 1, 3, d // HEAD_DIM, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
    o = decode_attention(q, k_cache, v_cache, cache_seqlens, k_new=k, v_new=v, scale=HEAD_DIM ** -0.5)
    return o.transpose(1, 2).reshape(b, 1, d)


def provider_fn(provider: str, t: dict):
    if provider == "eager":
        return lambda: eager_step(t["x"], t["w"], t["bias"], t["k_cache"], t["v_cache"], t["input_pos"])
    if provider == "compiled":
        step = torch.compile(eager_step)
        return lambda: step(t["x"], t["w"], t["bias"], t["k_cache"], t["v_cache"], t["input_pos"])
    if provider == "unfused":
        return lambda: unfused_step(t["x"], t["w"], t["bias"], t["k_cache"], t["v_cache"], t["cache_seqlens"])
    return lambda: qkv_decode_attention(t["x"], t["w"], t["bias"], t["k_cache"], t["v_cache"], t["cache_seqlens"],
                                        eps=EPS)


def modeled_traffic(shape, dtype: torch.dtype) -> tuple[int, int]:
    """(read, write) bytes: w_qkv and b_qkv, x, K and V over the L - 1 cached slots; out and the appended k / v."""
    b, h, n = shape
    d, es = h * HEAD_DIM, torch.empty((), dtype=dtype).element_size()
    read = (3 * d * d + 3 * d + b * d + 2 * b * h * (n - 1) * HEAD_DIM) * es
    write = (b * d + 2 * b * d) * es
    return read, write


def group(case: dict) -> str:
    return f"qkv decode {'x'.join(map(str, case['shape']))} {case['dtype']}"


def bench_qkv_decode_attention(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    provider, shape, dtype = case["provider"], case["shape"], DTYPES[case["dtype"]]
    start_case(benchmark, group(case), provider, device, GPU_ONLY)
    t = make_inputs(shape, dtype, device)
    fn = provider_fn(provider, t)
    out = fn()  # appends; every later call appends the same values at the same slot
    ref = _cpu(*(t[k].double().cpu() for k in ("x", "w", "bias", "k_cache", "v_cache")),
               t["cache_seqlens"].cpu(), None, EPS, HEAD_DIM ** -0.5)
    check_output(provider, out.cpu(), ref)
    del out, ref
    times = timer.run(benchmark, fn)
    read, write = modeled_traffic(shape, dtype)
    stats = percentiles(times)
    info = dict(stats, provider=provider, shape=list(shape), dtype=case["dtype"], note=NOTES[provider],
                device=str(device))
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)
