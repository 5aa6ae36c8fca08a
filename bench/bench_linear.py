"""linear microbenchmarks: y = gelu_tanh(x · Wᵀ + b) + residual at transformer projection shapes.

Providers, side by side in one group per (K x N, M, dtype):
  eager     F.linear(x, w, b) -> F.gelu(approximate="tanh") -> + residual: three PyTorch kernels
            (cuBLAS, then two elementwise passes)
  compiled  torch.compile of the same function (one compile per case, dynamic=False)
  fused     fused_attn.linear(x, w, b, activation="gelu_tanh", residual=r): one launch of our
            weight-streaming kernel for M <= 16 (at N = 768 and M 4-16 the split-K tensor-core kernel),
            cuBLAS + in-place epilogue above

Shapes (K x N, nn.Linear's in x out): GPT-2 small 768 x 2304 (c_attn), 768 x 3072 (c_fc),
3072 x 768 (the MLP's c_proj), 768 x 768 (the attention's c_proj); Llama-2-7B 4096 x 11008 (gate /
up), 11008 x 4096 (down), 4096 x 4096 (q/k/v/o); M (rows of x: batch x new tokens) in 1, 4, 16 (decode: memory-bound), 128, 512, 2048,
4096 (prefill: compute-bound). Every case has the full epilogue (bias, GELU, residual).

"layer_norm + linear" cases (group "ln+linear ..."): a pre-LN block's norm and the projection after
it, y = layer_norm(x) · Wᵀ + b, at GPT-2's 768 x 2304 (ln_1 + c_attn), 768 x 3072 (ln_2 + c_fc) and
768 x 50257 (ln_f + lm_head), M 1, 4, 16 (the lm_head also at 64 and 2048 rows: cuBLAS's, with logits rows
that are not whole 16-byte pieces): eager F.layer_norm + F.linear (two kernels), compiled
(torch.compile of that chain), fused (fused_attn.linear(norm="layer_norm"): one launch, the norm in
the kernel's prologue), and folded: the same op without the norm's weight and bias, which the caller
folded into W and b at load time (W * g, b + W · beta: fused_attn.gpt2.folded_linear, layer_norm
"folded"): at one row in float16 / bfloat16 the norm folded into the dot products (kFold), at 4 and 16
rows the norm's own launch first. Modeled bytes add the norm's weight and bias, for every provider
(the group's necessary traffic; folded reads no norm weight or bias); folded is checked against the
same float64 reference as its peers, layer_norm(x) · Wᵀ + b with the unfolded weights.

"linear + layer_norm + linear" cases (group "chain ..."): a residual projection, the LayerNorm after it and
the projection after that, GPT-2's attention c_proj (K x K, + residual) -> ln_2 -> c_fc (K x N, GELU), shape
K x N, M 1, 4, 16; both outputs (the residual stream h and the next projection's y) are the group's: eager
(F.linear + add, F.layer_norm, F.linear + GELU), compiled (torch.compile of that chain) and unfolded (what
fused_attn.gpt2's graph-fused step runs: fused_attn.linear(residual=), then the folded
fused_attn.linear(norm="layer_norm"), which at 4-16 rows launches the norm first).

Each provider's output is checked once, before timing, against the float64 reference on the first
and last row of x (bench_softmax's relative bound).

extra_info: p5/p50/p95 (us, CUDA events, cold L2: bench/harness.py), the modeled bytes (W, x, bias,
residual read once, out written: the op's necessary traffic, the same for every provider), GB/s, %
of the measured copy bandwidth and of a same-bytes device copy (the floor of the memory-bound small-M
cases), FLOPs (2 M N K), TFLOP/s and % of the measured dense matmul ceiling in this dtype (the
ceiling of the large-M cases), speedups vs eager and compiled measured in this run (and vs unfolded
and fused where the group has them).

Quick default: float16. --full: float16 and bfloat16 (--bench-dtypes overrides both). On a machine
without a GPU the cases run on the CPU at a tiny shape (eager and fused: the op's CPU path), which
exercises the harness; GPU numbers need a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.bench_decode_attention import dtypes_for
from bench.bench_softmax import check_output
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn import reference
from fused_attn.generate import DTYPES
from fused_attn.gpt2 import folded_linear

GPT2_SHAPES = [(768, 2304), (768, 3072), (3072, 768), (768, 768)]
LLAMA_SHAPES = [(4096, 11008), (11008, 4096), (4096, 4096)]
ROWS = (1, 4, 16, 128, 512, 2048, 4096)
CPU_CASES = [((64, 48), 1), ((64, 48), 20)]
# layer_norm + linear (op "ln_linear"): GPT-2's ln_1 + c_attn, ln_2 + c_fc, ln_f + lm_head in decode.
LN_SHAPES = [(768, 2304), (768, 3072), (768, 50257)]
LN_ROWS = (1, 4, 16)
# GPT-2's ln_f + lm_head also at a 64-sequence decode step and a 2048-token teacher-forced pass: cuBLAS's rows
# (above 16), 50257 output columns, so rows of logits that are not whole 16-byte pieces.
LN_WIDE_SHAPE = (768, 50257)
LN_WIDE_ROWS = (64, 2048)
LN_CPU_CASES = [((64, 48), 1)]
LN_EPS = 1e-5
# linear + layer_norm + linear (op "chain"): K x K residual projection, the norm, K x N with GELU.
CHAIN_SHAPES = [(768, 3072), (768, 2304)]
CHAIN_ROWS = (1, 4, 16)
CHAIN_CPU_CASES = [((64, 48), 4)]
# Below this many rows a case is memory-bound (the weight stream); from it on, compute-bound.
MEMORY_BOUND_ROWS = 16

PROVIDERS = ("eager", "compiled", "fused")
SPEEDUP_BASES = ("eager", "compiled", "unfolded", "fused")
GPU_ONLY = ("compiled",)
NOTES = {"eager": "F.linear + F.gelu(tanh) + add", "compiled": "torch.compile(F.linear + F.gelu(tanh) + add)",
         "fused": "fused_attn.linear(activation='gelu_tanh', residual=)"}
# The ln+linear groups add "unfolded": our two ops, fused_attn.layer_norm then fused_attn.linear (two
# launches), the A/B of folding the norm into the linear's prologue; and "folded": the norm's weight and
# bias folded into W and b (fused_attn.gpt2's layer_norm "folded"), the norm without them in the linear.
LN_PROVIDERS = ("eager", "compiled", "unfolded", "fused", "folded")
LN_NOTES = {"eager": "F.layer_norm + F.linear", "compiled": "torch.compile(F.layer_norm + F.linear)",
            "unfolded": "fused_attn.layer_norm + fused_attn.linear (2 launches)",
            "fused": "fused_attn.linear(norm='layer_norm')",
            "folded": "fused_attn.linear(W * g, b + W beta, norm='layer_norm'), no norm weight / bias "
                      "(1 row, float16 / bfloat16: the fold in the dot products; else the norm's launch first)"}
# The chain groups: the peers and our chain as graph-fused runs it.
CHAIN_PROVIDERS = ("eager", "compiled", "unfolded")
CHAIN_NOTES = {"eager": "F.linear + add, F.layer_norm, F.linear + F.gelu(tanh)",
               "compiled": "torch.compile(F.linear + add, F.layer_norm, F.linear + F.gelu(tanh))",
               "unfolded": "fused_attn.linear(residual=), folded fused_attn.linear(norm='layer_norm') "
                           "(4-16 rows: the norm's launch first)"}
REPORT_LABELS = {"bench_linear": dict(title="linear (gelu_tanh(x W^T + b) + residual)", shape="K x N, M",
                                      order=LN_PROVIDERS)}


def modeled_traffic(k: int, n: int, m: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes read, bytes written): W, x, bias and residual read once, out written once."""
    e = torch.empty((), dtype=dtype).element_size()
    return (n * k + m * k + n + m * n) * e, m * n * e


def ln_modeled_traffic(k: int, n: int, m: int, dtype: torch.dtype) -> tuple[int, int]:
    """layer_norm + linear: W, x, bias, the norm's weight and bias read once, out written once (no
    residual; the normalized x is the fused op's own, not traffic)."""
    e = torch.empty((), dtype=dtype).element_size()
    return (n * k + m * k + n + 2 * k) * e, m * n * e


def chain_modeled_traffic(k: int, n: int, m: int, dtype: torch.dtype) -> tuple[int, int]:
    """linear + norm + linear: both weights, x, both biases, the residual, the norm's weight and bias read
    once; h and y written (h read back is not counted: the group's necessary traffic)."""
    e = torch.empty((), dtype=dtype).element_size()
    return (k * k + n * k + m * k + k + n + m * k + 2 * k) * e, (m * k + m * n) * e


def flops(k: int, n: int, m: int) -> int:
    return 2 * m * n * k


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return ([dict(shape=s, m=m, dtype="float32", provider=p, op="linear") for s, m in CPU_CASES for p in PROVIDERS]
                + [dict(shape=s, m=m, dtype="float32", provider=p, op="ln_linear") for s, m in LN_CPU_CASES
                   for p in LN_PROVIDERS]
                + [dict(shape=s, m=m, dtype="float32", provider=p, op="chain") for s, m in CHAIN_CPU_CASES
                   for p in CHAIN_PROVIDERS])
    dts = dtypes_for(config)
    return ([dict(shape=s, m=m, dtype=d, provider=p, op="linear") for s in GPT2_SHAPES + LLAMA_SHAPES for m in ROWS
             for d in dts for p in PROVIDERS]
            + [dict(shape=s, m=m, dtype=d, provider=p, op="ln_linear") for s in LN_SHAPES for m in LN_ROWS
               for d in dts for p in LN_PROVIDERS]
            + [dict(shape=LN_WIDE_SHAPE, m=m, dtype=d, provider=p, op="ln_linear") for m in LN_WIDE_ROWS
               for d in dts for p in LN_PROVIDERS]
            + [dict(shape=s, m=m, dtype=d, provider=p, op="chain") for s in CHAIN_SHAPES for m in CHAIN_ROWS
               for d in dts for p in CHAIN_PROVIDERS])


def case_id(c: dict) -> str:
    k, n = c["shape"]
    op = {"ln_linear": "ln-", "chain": "chain-"}.get(c.get("op"), "")
    return f"{c['provider']}-{op}k{k}-n{n}-m{c['m']}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def make_inputs(k: int, n: int, m: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    return dict(x=randn(m, k), w=randn(n, k, scale=k**-0.5), b=randn(n), r=randn(m, n),
                nw=1 + 0.1 * randn(k), nb=0.1 * randn(k))


def eager_chain(x, w, b, r):
    return reference.eager_linear(x, w, b, "gelu_tanh", r)


def chain_provider(provider: str, chain, *args):
    """The peers of a group: ``eager`` runs ``chain(*args)``, ``compiled`` its torch.compile (one compile per
    case: no recompile limit across shapes); None for any other provider (ours)."""
    if provider == "eager":
        return lambda: chain(*args)
    if provider == "compiled":
        torch._dynamo.reset()
        compiled = torch.compile(chain, dynamic=False)
        return lambda: compiled(*args)
    return None


def ln_eager_chain(x, w, b, nw, nb):
    return torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (x.shape[-1],), nw, nb, LN_EPS), w, b)


def ln_provider_fn(provider: str, t: dict):
    from fused_attn import layer_norm, linear

    peer = chain_provider(provider, ln_eager_chain, t["x"], t["w"], t["b"], t["nw"], t["nb"])
    if peer is not None:
        return peer
    if provider == "unfolded":
        return lambda: linear(layer_norm(t["x"], t["nw"], t["nb"], LN_EPS), t["w"], t["b"])
    if provider == "fused":
        return lambda: linear(t["x"], t["w"], t["b"], norm="layer_norm", norm_weight=t["nw"], norm_bias=t["nb"],
                              eps=LN_EPS)
    if provider == "folded":  # folded once, before timing, as a model does at load time
        w, b = folded_linear(t["w"], t["b"], SimpleNamespace(weight=t["nw"], bias=t["nb"]), SimpleNamespace())
        return lambda: linear(t["x"], w, b, norm="layer_norm", eps=LN_EPS)
    raise ValueError(f"provider must be one of {LN_PROVIDERS}, got {provider!r}")


def ln_check(provider: str, out: torch.Tensor, t: dict) -> None:
    """As ``check``, against the float64 layer_norm + linear with the unfolded weights (every provider,
    folded too: the fold is the same function up to the folded weights' rounding)."""
    m = t["x"].shape[0]
    for i in sorted({0, m - 1}):
        s = slice(i, i + 1)
        xn = reference.layer_norm(t["x"][s], t["nw"], t["nb"], LN_EPS, compute_dtype=torch.float64)
        ref = reference._linear_compute(xn, t["w"], t["b"], None, None, torch.float64)
        check_output(f"{provider} (row {i})", out[s], ref)


def chain_inputs(t: dict) -> dict:
    """The chain's first projection (K x K, bias, residual [m, K]), drawn from its own seeded generator, and
    the second's weights with the norm's weight and bias folded in (once, as a model does at load time)."""
    m, k = t["x"].shape
    gen = torch.Generator(device=t["x"].device).manual_seed(1)

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=gen, device=t["x"].device) * scale).to(t["x"].dtype)

    wf, bf = folded_linear(t["w"], t["b"], SimpleNamespace(weight=t["nw"], bias=t["nb"]), SimpleNamespace())
    return dict(w0=randn(k, k, scale=k**-0.5), b0=randn(k), r0=randn(m, k), wf=wf, bf=bf)


def chain_eager(x, w0, b0, r0, nw, nb, w, b):
    h = torch.nn.functional.linear(x, w0, b0) + r0
    y = torch.nn.functional.linear(torch.nn.functional.layer_norm(h, (h.shape[-1],), nw, nb, LN_EPS), w, b)
    return h, torch.nn.functional.gelu(y, approximate="tanh")


def chain_provider_fn(provider: str, t: dict):
    from fused_attn import linear

    c = t.setdefault("chain", chain_inputs(t))
    peer = chain_provider(provider, chain_eager, t["x"], c["w0"], c["b0"], c["r0"], t["nw"], t["nb"], t["w"], t["b"])
    if peer is not None:
        return peer
    if provider == "unfolded":
        def unfolded():
            h = linear(t["x"], c["w0"], c["b0"], residual=c["r0"])
            return h, linear(h, c["wf"], c["bf"], activation="gelu_tanh", norm="layer_norm", eps=LN_EPS)
        return unfolded
    raise ValueError(f"provider must be one of {CHAIN_PROVIDERS}, got {provider!r}")


def chain_check(provider: str, out: tuple[torch.Tensor, torch.Tensor], t: dict) -> None:
    """As ``check``, for both outputs: h against the float64 projection, y against the float64 norm of the
    h returned and the projection with the unfolded weights."""
    h, y = out
    c = t["chain"]
    m = t["x"].shape[0]
    for i in sorted({0, m - 1}):
        s = slice(i, i + 1)
        ref = reference._linear_compute(t["x"][s], c["w0"], c["b0"], None, c["r0"][s], torch.float64)
        check_output(f"{provider} h (row {i})", h[s], ref)
        hn = reference.layer_norm(h[s].double(), t["nw"], t["nb"], LN_EPS, compute_dtype=torch.float64)
        ref = reference._linear_compute(hn, t["w"], t["b"], "gelu_tanh", None, torch.float64)
        check_output(f"{provider} y (row {i})", y[s], ref)


def provider_fn(provider: str, t: dict):
    from fused_attn import linear

    peer = chain_provider(provider, eager_chain, t["x"], t["w"], t["b"], t["r"])
    if peer is not None:
        return peer
    if provider == "fused":
        return lambda: linear(t["x"], t["w"], t["b"], activation="gelu_tanh", residual=t["r"])
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def check(provider: str, out: torch.Tensor, t: dict) -> None:
    """Raise unless ``out`` matches the float64 reference on the first and last row of x."""
    m = t["x"].shape[0]
    for i in sorted({0, m - 1}):
        s = slice(i, i + 1)
        ref = reference._linear_compute(t["x"][s], t["w"], t["b"], "gelu_tanh", t["r"][s], torch.float64)
        check_output(f"{provider} (row {i})", out[s], ref)


def record(benchmark, case: dict, times: list[float], device, ceilings_gbps, timer, launch_floor_us, peak_tflops,
           medians, traffic: tuple[int, int] | None = None, flop: int | None = None, note: str | None = None) -> None:
    """extra_info of one case: percentiles, modeled bytes and FLOPs (this module's model unless given:
    bench_mlp passes its own), bandwidth, the copy and matmul floors, speedups in this run."""
    (k, n), m, provider, dtype = case["shape"], case["m"], case["provider"], DTYPES[case["dtype"]]
    read, write = traffic or modeled_traffic(k, n, m, dtype)
    flop = flop or flops(k, n, m)
    stats = percentiles(times)
    tflops = flop / (stats["p50_us"] * 1e-6) / 1e12
    info = dict(stats, provider=provider, shape=[k, n, m], dtype=case["dtype"], note=note or NOTES[provider],
                device=str(device), flops=flop, tflops=round(tflops, 2),
                bound="memory" if m <= MEMORY_BOUND_ROWS else "compute")
    if "op" in case:  # which group (linear, ln_linear, chain): a column of bench.report's tables
        info["op"] = case["op"]
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    if peak_tflops:
        info["matmul_peak_tflops"] = round(peak_tflops, 1)
        info["pct_of_matmul_peak"] = round(100 * tflops / peak_tflops, 1)
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)


def group(case: dict) -> str:
    k, n = case["shape"]
    op = {"ln_linear": "ln+linear", "chain": "chain"}.get(case.get("op"), "linear")
    return f"{op} {k}x{n} m{case['m']} {case['dtype']}"


def bench_linear(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, matmul_peak_tflops, medians):
    (k, n), m, provider, dtype = case["shape"], case["m"], case["provider"], DTYPES[case["dtype"]]
    start_case(benchmark, group(case), provider, device, GPU_ONLY)
    t = make_inputs(k, n, m, dtype, device)
    make_fn, check_fn, traffic, notes = OPS[case.get("op", "linear")]
    fn = make_fn(provider, t)
    check_fn(provider, fn(), t)
    times = timer.run(benchmark, fn)
    record(benchmark, case, times, device, ceilings_gbps, timer, launch_floor_us, matmul_peak_tflops(dtype), medians,
           traffic=traffic(k, n, m, dtype), note=notes[provider],
           flop=flops(k, n, m) + (flops(k, k, m) if case.get("op") == "chain" else 0))


# op -> (provider functions, check, modeled traffic, notes)
OPS = {"linear": (provider_fn, check, modeled_traffic, NOTES),
       "ln_linear": (ln_provider_fn, ln_check, ln_modeled_traffic, LN_NOTES),
       "chain": (chain_provider_fn, chain_check, chain_modeled_traffic, CHAIN_NOTES)}
