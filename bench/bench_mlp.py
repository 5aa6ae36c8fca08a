"""mlp microbenchmarks: a transformer feed-forward block, x -> act(x W_fcᵀ + b_fc) -> · W_projᵀ + b_proj + x.

Providers, side by side in one group per (model, M, dtype):
  eager     F.linear -> activation -> F.linear -> + residual (GPT-2: gelu_tanh with biases; Llama:
            silu(gate) * up from one stacked gate/up weight, no biases)
  compiled  torch.compile of the same function (one compile per case, dynamic=False)
  fused     fused_attn.mlp(..., residual=x): two epilogue-fused fused_attn.linear launches

Models (d_model, hidden, activation): GPT-2 small (768, 3072, gelu_tanh), Llama-2-7B (4096, 11008,
swiglu); M (rows of x) as bench_linear. extra_info as bench_linear's: bytes (both weights, x, the
biases and the residual read, out written; the hidden activations are not counted: the floor is a
fused single pass), GB/s, % of copy and of a same-bytes copy, TFLOP/s (2 M (d_model·w_fc rows +
hidden·d_model)) and % of the matmul ceiling, speedups. Quick default float16; --full adds bfloat16.
On a machine without a GPU: a tiny model on the CPU (eager and fused), exercising the harness.
"""

from __future__ import annotations

import torch

from bench.bench_decode_attention import dtypes_for
from bench.bench_linear import GPU_ONLY, ROWS, chain_provider, record
from bench.bench_softmax import check_output
from bench.harness import start_case
from fused_attn import reference
from fused_attn.generate import DTYPES

MODELS = {"gpt2": (768, 3072, "gelu_tanh"), "llama2_7b": (4096, 11008, "swiglu")}
CPU_MODELS = {"tiny_gelu": (32, 64, "gelu_tanh"), "tiny_swiglu": (32, 48, "swiglu")}
PROVIDERS = ("eager", "compiled", "fused")  # ours (bench.report's last fused*) last
NOTES = {"eager": "F.linear + act + F.linear + add", "compiled": "torch.compile(F.linear + act + F.linear + add)",
         "fused": "fused_attn.mlp(residual=x): 2 launches"}
REPORT_LABELS = {"bench_mlp": dict(title="mlp (fc -> act -> proj + residual)", shape="d_model x hidden x M",
                                   order=PROVIDERS)}


def models(cuda: bool) -> dict:
    return MODELS if cuda else CPU_MODELS


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    rows, dtypes = (ROWS, dtypes_for(config)) if cuda else ((1, 20), ["float32"])
    return [dict(shape=model[:2], m=m, dtype=d, provider=p) for model in models(cuda).values() for m in rows
            for d in dtypes for p in PROVIDERS]


def model_of(shape) -> tuple[str, str]:
    """(model name, activation) of a case's (d_model, hidden)."""
    return next((name, act) for name, (d, h, act) in {**MODELS, **CPU_MODELS}.items() if (d, h) == tuple(shape))


def case_id(c: dict) -> str:
    return f"{c['provider']}-{model_of(c['shape'])[0]}-m{c['m']}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def make_inputs(d: int, hidden: int, activation: str, m: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    fc_rows = 2 * hidden if activation == "swiglu" else hidden
    biases = activation == "gelu_tanh"  # GPT-2 has biases, Llama none

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    return dict(x=randn(m, d), w_fc=randn(fc_rows, d, scale=d**-0.5), b_fc=randn(fc_rows) if biases else None,
                w_proj=randn(d, hidden, scale=hidden**-0.5), b_proj=randn(d) if biases else None,
                activation=activation)


def eager_mlp(x, w_fc, b_fc, w_proj, b_proj, activation: str):
    return reference.eager_linear(reference.eager_linear(x, w_fc, b_fc, activation), w_proj, b_proj, None, x)


def provider_fn(provider: str, t: dict):
    from fused_attn import mlp

    args = (t["x"], t["w_fc"], t["b_fc"], t["w_proj"], t["b_proj"])
    peer = chain_provider(provider, eager_mlp, *args, t["activation"])
    if peer is not None:
        return peer
    if provider == "fused":
        return lambda: mlp(*args, activation=t["activation"], residual=t["x"])
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def modeled_traffic(t: dict) -> tuple[int, int]:
    """(bytes read, bytes written): both weights, biases, x (also the residual: read twice) read; out written."""
    tensors = [t[name] for name in ("x", "w_fc", "b_fc", "w_proj", "b_proj") if t[name] is not None]
    read = sum(x.numel() * x.element_size() for x in tensors) + t["x"].numel() * t["x"].element_size()
    return read, t["x"].numel() * t["x"].element_size()


def check(provider: str, out: torch.Tensor, t: dict) -> None:
    m = t["x"].shape[0]
    for i in sorted({0, m - 1}):
        s = slice(i, i + 1)
        ref = reference.mlp(t["x"][s], t["w_fc"], t["b_fc"], t["w_proj"], t["b_proj"], activation=t["activation"],
                            residual=t["x"][s]).double()
        check_output(f"{provider} (row {i})", out[s], ref)


def bench_mlp(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, matmul_peak_tflops, medians):
    provider, m, dtype = case["provider"], case["m"], DTYPES[case["dtype"]]
    (d, hidden), (name, activation) = case["shape"], model_of(case["shape"])
    start_case(benchmark, f"mlp {name} m{m} {case['dtype']}", provider, device, GPU_ONLY)
    t = make_inputs(d, hidden, activation, m, dtype, device)
    fn = provider_fn(provider, t)
    check(provider, fn(), t)
    times = timer.run(benchmark, fn)
    read, write = modeled_traffic(t)
    fc_rows = t["w_fc"].shape[0]
    record(benchmark, case, times, device, ceilings_gbps, timer, launch_floor_us,
           matmul_peak_tflops(dtype), medians, traffic=(read, write), flop=2 * m * (d * fc_rows + hidden * d),
           note=f"{name}: {NOTES[provider]}")
