"""layer_norm / rms_norm microbenchmarks: the pre-LN transformer's residual add + norm, and the norm alone.

Providers, side by side in one group per (norm, residual, shape, dtype):
  eager     what a model runs today: ``h = x + residual`` (with a residual), then
            layer_norm: ``F.layer_norm(h, (width,), weight, bias, eps)``;
            rms_norm: Hugging Face's LlamaRMSNorm chain, ``hf = h.float(); hf * rsqrt(hf.pow(2).mean(-1) + eps)``,
            rounded to x's dtype, times weight
  compiled  torch.compile of the same function, one compile per case
  fused     fused_attn.layer_norm(x, weight, bias, eps, residual=residual) / fused_attn.rms_norm(...)
Weight and bias are [width] in x's dtype (as a float16 model holds them).

Shapes, written [width, M] (M last so that bench.report plots latency against the row count): GPT-2
small's width 768 and Llama-2-7B's 4096, M in {1, 4, 16, 128, 512, 2048, 4096, 16384} rows (M = batch x
sequence: a decode step's few rows up to a prefill's many).

Each provider's y (and h) is checked once, before timing, against the float64 reference on the first
and last rows (bench_softmax's relative bound: max |out - ref| <= CHECK_RTOL x max |ref|; h bit for bit).

extra_info: p5/p50/p95 (us, CUDA events, cold L2: bench/harness.py), the modeled bytes (x, and the
residual, read; weight and bias read; y, and h, written: the op's necessary traffic, the same for every
provider, so GB/s compares providers; eager's extra pass over h is not counted), GB/s, % of the
measured copy bandwidth, the time of a device copy of the same bytes and of an empty kernel (the
floors of cases too small to reach the copy bandwidth), and speedups vs eager and compiled measured in
this run.

bench_embedding_layer_norm: GPT-2's embedding lookup, add and first LayerNorm (wte [50257, 768], wpe
[1024, 768], M in {1, 4, 16, 128, 512, 2048} tokens), the same providers, the gathered rows' bytes modeled
as add + LayerNorm's.

Quick default: float16. --full: float16 and bfloat16 (--bench-dtypes overrides both). On a machine
without a GPU the cases run on the CPU at two tiny shapes (eager and fused: the op's CPU path), which
exercises the harness; GPU numbers need a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_decode_attention import dtypes_for  # quick: float16; --full: and bfloat16
from bench.bench_softmax import check_output
from bench.harness import bandwidth_info, percentiles, same_run_speedups
from fused_attn import reference
from fused_attn.generate import DTYPES

WIDTHS = (768, 4096)
ROWS = (1, 4, 16, 128, 512, 2048, 4096, 16384)
CPU_SHAPES = [(64, 3), (96, 5)]
NORMS = ("layer_norm", "rms_norm")
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
CHECK_ROWS = 64  # rows checked against the reference at each end of x

# Baselines first (speedups are against providers already measured in the group); `fused` last:
# bench.report takes the last provider named fused* as ours.
PROVIDERS = ("eager", "compiled", "fused")
SPEEDUP_BASES = ("eager", "compiled")
GPU_ONLY = ("compiled",)
NOTES = {"eager": "x + residual, then F.layer_norm / Hugging Face's LlamaRMSNorm chain",
         "compiled": "torch.compile(x + residual, then F.layer_norm / the LlamaRMSNorm chain)",
         "fused": "fused_attn.layer_norm / rms_norm(residual=)"}

# What `python -m bench.bytes --op layer_norm [--shape width,M]` measures under ncu: add + LayerNorm
# (bench.bytes's flag that it names causal is the residual add here), 4096 x 4096 float16: 134 MB moved.
BYTES_SHAPE = (4096, 4096)


def bytes_cases(backward: bool) -> list[tuple[bool, str]]:
    """(residual, provider) of every call bench.bytes profiles (forward only)."""
    if backward:
        raise ValueError("backward must be False for layer_norm (its backward is the unfused reference), got True")
    return [(True, p) for p in PROVIDERS]


def bytes_model(provider: str, shape, dtype: torch.dtype, residual: bool, backward: bool) -> tuple[int, int]:
    """Modeled (bytes read, bytes written) of add + LayerNorm (the same for every provider)."""
    return modeled_traffic(shape, dtype, "layer_norm", residual)


def bytes_call(provider: str, shape, dtype: torch.dtype, residual: bool, backward: bool):
    """One add + LayerNorm of ``provider`` on random CUDA inputs of ``shape`` [width, M]."""
    return provider_fn(provider, "layer_norm", make_inputs(tuple(shape), dtype, torch.device("cuda"), residual))


# How bench.report names this module's cases (columns and rows come from the saved extra_info).
REPORT_LABELS = {"bench_layer_norm": dict(title="layer_norm / rms_norm (residual: h = x + residual fused in)",
                                          shape="shape [width,M]", order=PROVIDERS),
                 "bench_embedding_layer_norm": dict(title="embedding + layer_norm (gathered rows: x_index, "
                                                          "residual_index)", shape="shape [width,M]",
                                                    order=PROVIDERS)}

# The embedding benchmark (bench_embedding_layer_norm): GPT-2 small's wte [50257, 768] and wpe [1024, 768],
# M tokens (a decode step's batch up to a prefill), h = wte[ids] + wpe[pos] and y = layer_norm(h): eager
# is the model's chain (two lookups, the add, F.layer_norm), fused one fused_attn.layer_norm with
# x_index / residual_index. On the CPU: tiny tables.
EMBED_TABLES = (50257, 1024)
EMBED_ROWS = (1, 4, 16, 128, 512, 2048)
CPU_EMBED = [(64, 4, (11, 7))]  # (width, M, table rows)
EMBED_NOTES = {"eager": "wte[ids] + wpe[pos], then F.layer_norm", "compiled": "torch.compile of the eager chain",
               "fused": "fused_attn.layer_norm(wte, w, b, residual=wpe, x_index=ids, residual_index=pos)"}


def modeled_traffic(shape, dtype: torch.dtype, norm: str, residual: bool) -> tuple[int, int]:
    """(bytes read, bytes written): x (and residual) and the parameters (weight, and bias for
    layer_norm) read, y (and h) written."""
    width, rows = shape
    e = torch.empty((), dtype=dtype).element_size()
    rows_bytes = rows * width * e
    params = (2 if norm == "layer_norm" else 1) * width * e
    streams = 2 if residual else 1
    return streams * rows_bytes + params, streams * rows_bytes


def gpu_shapes() -> list[tuple[int, int]]:
    return [(w, m) for w in WIDTHS for m in ROWS]


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes, dtypes = (gpu_shapes(), dtypes_for(config)) if cuda else (CPU_SHAPES, ["float32"])
    return [dict(shape=shape, dtype=dtype, norm=norm, residual=residual, provider=provider)
            for norm in NORMS for residual in (True, False) for shape in shapes for dtype in dtypes
            for provider in PROVIDERS]


def case_id(c: dict) -> str:
    width, rows = c["shape"]
    return f"{c['provider']}-{c['norm']}-{'add-' if c['residual'] else ''}w{width}-m{rows}-{c['dtype']}"


def make_embed_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes = [(768, m, EMBED_TABLES) for m in EMBED_ROWS] if cuda else CPU_EMBED
    dtypes = dtypes_for(config) if cuda else ["float32"]
    return [dict(shape=(w, m), tables=tables, dtype=dtype, provider=provider)
            for w, m, tables in shapes for dtype in dtypes for provider in PROVIDERS]


def embed_case_id(c: dict) -> str:
    width, rows = c["shape"]
    return f"{c['provider']}-embed-w{width}-m{rows}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])
    if "embed_case" in metafunc.fixturenames:
        cases = make_embed_cases(metafunc.config)
        metafunc.parametrize("embed_case", cases, ids=[embed_case_id(c) for c in cases])


def make_inputs(shape, dtype: torch.dtype, device, residual: bool, seed: int = 0) -> dict:
    """x and residual [M, width] ~ N(0, 1) (residual None without the add), weight ~ 1 + N(0, 0.1),
    bias ~ N(0, 0.1), all in ``dtype``."""
    width, rows = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0, mean=0.0):
        return (mean + scale * torch.randn(size, generator=gen, device=device)).to(dtype)

    return dict(x=randn(rows, width), residual=randn(rows, width) if residual else None,
                weight=randn(width, scale=0.1, mean=1.0), bias=randn(width, scale=0.1))


def eager_layer_norm(x, residual, weight, bias, eps: float):
    """The unfused chain: the add (a kernel), then PyTorch's LayerNorm (a kernel)."""
    h = x if residual is None else x + residual
    y = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, h)


def eager_rms_norm(x, residual, weight, eps: float):
    """The add, then Hugging Face's LlamaRMSNorm: float32 mean of squares, rsqrt, rounded to x's dtype,
    times weight (four to five kernels)."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


def provider_fn(provider: str, norm: str, t: dict):
    """One call of ``provider`` on the inputs of ``make_inputs``."""
    from fused_attn import layer_norm, rms_norm

    x, r, w, b, eps = t["x"], t["residual"], t["weight"], t["bias"], EPS[norm]
    if provider in ("eager", "compiled"):
        fn = eager_layer_norm if norm == "layer_norm" else eager_rms_norm
        if provider == "compiled":
            torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
            fn = torch.compile(fn, dynamic=False)
        if norm == "layer_norm":
            return lambda: fn(x, r, w, b, eps)
        return lambda: fn(x, r, w, eps)
    if provider == "fused":
        if norm == "layer_norm":
            return lambda: layer_norm(x, w, b, eps, residual=r)
        return lambda: rms_norm(x, w, eps, residual=r)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def check_call(provider: str, norm: str, out, t: dict) -> None:
    """Raise unless h is x + residual bit for bit and y matches the float64 reference on the first and
    last CHECK_ROWS rows."""
    x, r = t["x"], t["residual"]
    y, h = out if r is not None else (out, None)
    if h is not None and not torch.equal(h, x + r):
        raise AssertionError(f"{provider} must return h = x + residual bit for bit")
    rows = x.shape[0]
    for part in sorted({(0, min(CHECK_ROWS, rows)), (max(0, rows - CHECK_ROWS), rows)}):
        s = slice(*part)
        hh = x[s] if r is None else x[s] + r[s]
        ref = reference.layer_norm(hh.double(), t["weight"].double(),
                                   t["bias"].double() if norm == "layer_norm" else None, EPS[norm],
                                   rms=norm == "rms_norm")
        check_output(f"{provider} {norm} (rows {part[0]}..{part[1]})", y[s], ref)


def record(benchmark, case: dict, times: list[float], device, ceilings_gbps, timer, launch_floor_us,
           medians, notes: dict = NOTES) -> None:
    """extra_info of one case: percentiles, modeled bytes, bandwidth, floors, speedups in this run."""
    shape, provider, dtype = case["shape"], case["provider"], DTYPES[case["dtype"]]
    read, write = modeled_traffic(shape, dtype, case["norm"], case["residual"])
    stats = percentiles(times)
    info = dict(stats, provider=provider, shape=list(shape), dtype=case["dtype"], norm=case["norm"],
                residual=case["residual"], note=notes[provider], width=shape[0], rows=shape[1], device=str(device))
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)


def group(case: dict) -> str:
    width, rows = case["shape"]
    return f"{'add+' if case['residual'] else ''}{case['norm']} w{width} m{rows} {case['dtype']}"


def bench_layer_norm(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    provider, norm = case["provider"], case["norm"]
    if device.type == "cpu" and provider in GPU_ONLY:
        pytest.skip(f"{provider} is measured on a GPU only (no CUDA device here)")
    benchmark.group = group(case)
    t = make_inputs(case["shape"], DTYPES[case["dtype"]], device, case["residual"])
    fn = provider_fn(provider, norm, t)
    check_call(provider, norm, fn(), t)
    times = timer.run(benchmark, fn)
    record(benchmark, case, times, device, ceilings_gbps, timer, launch_floor_us, medians)


def make_embed_inputs(case: dict, device) -> dict:
    """wte, wpe (N(0, 1)), ids and pos (uniform over the tables; pos int32 as our GPT-2's counters),
    LayerNorm weight and bias, in the case's dtype."""
    (width, rows), (vocab, positions) = case["shape"], case["tables"]
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    t = make_inputs((width, 1), dtype, device, False)
    return dict(wte=torch.randn(vocab, width, generator=gen, device=device).to(dtype),
                wpe=torch.randn(positions, width, generator=gen, device=device).to(dtype),
                ids=torch.randint(0, vocab, (rows,), generator=gen, device=device),
                pos=torch.randint(0, positions, (rows,), generator=gen, device=device, dtype=torch.int32),
                weight=t["weight"], bias=t["bias"])


def eager_embedding_layer_norm(wte, wpe, ids, pos, weight, bias, eps: float):
    """The model's chain: two lookups, the add, then PyTorch's LayerNorm."""
    h = wte[ids] + wpe[pos]
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def bench_embedding_layer_norm(benchmark, embed_case, device, timer, ceilings_gbps, launch_floor_us, medians):
    from fused_attn import layer_norm

    case, provider = embed_case, embed_case["provider"]
    if device.type == "cpu" and provider in GPU_ONLY:
        pytest.skip(f"{provider} is measured on a GPU only (no CUDA device here)")
    width, rows = case["shape"]
    benchmark.group = f"embedding+layer_norm w{width} m{rows} {case['dtype']}"
    t = make_embed_inputs(case, device)
    args = (t["wte"], t["wpe"], t["ids"], t["pos"], t["weight"], t["bias"], EPS["layer_norm"])
    if provider == "fused":
        fn = lambda: layer_norm(t["wte"], t["weight"], t["bias"], EPS["layer_norm"], residual=t["wpe"],  # noqa: E731
                                x_index=t["ids"], residual_index=t["pos"])
    else:
        chain = eager_embedding_layer_norm
        if provider == "compiled":
            torch._dynamo.reset()
            chain = torch.compile(chain, dynamic=False)
        fn = lambda: chain(*args)  # noqa: E731
    # The gathered rows as bench_layer_norm's inputs: the same check (h bit for bit, y against float64).
    gathered = dict(x=t["wte"][t["ids"]], residual=t["wpe"][t["pos"]], weight=t["weight"], bias=t["bias"])
    check_call(provider, "layer_norm", fn(), gathered)
    times = timer.run(benchmark, fn)
    record(benchmark, dict(case, norm="layer_norm", residual=True), times, device, ceilings_gbps, timer,
           launch_floor_us, medians, EMBED_NOTES)
