"""sample microbenchmarks: the next token of each row of logits, the last reduction of a decode step.

Providers, side by side in one group per (rows, vocab, temperature, dtype):
  eager     PyTorch: logits.argmax(-1) (greedy); at temperature > 0 the Gumbel-max chain GPT-2's
            eager decode step uses (float, / T, rand, -log(-log U), +, argmax)
  compiled  torch.compile of the same function (one compile per case, dynamic=False)
  fused     fused_attn.sample: one launch, a row split over a cluster of blocks (sm_90)

Shapes: rows 1, 16, 64 (decode batches) x vocab 50257 (GPT-2) and 128256 (Llama 3), greedy and
temperature 1.

The sample+advance groups (op "advance": a graph decode loop's last launch, the token and the loop's
[3, rows] int32 counters + 1): eager and compiled as above followed by ``counters.add_(1)``, unfused =
fused_attn.sample + ``counters.add_(1)`` (two launches: our GPT-2 step before session 12), fused =
``sample(..., advance=counters)`` (one launch). Rows 1 and 16, vocab 50257, greedy. extra_info: bytes (the logits read, the int64 tokens written), GB/s, % of copy and of
a same-bytes copy (at these sizes, ~0.1-16 MB, the same-bytes copy and the empty kernel are the
floors), speedups. Quick default float16; --full adds bfloat16. On a machine without a GPU: small
shapes on the CPU (eager and fused), exercising the harness.
"""

from __future__ import annotations

import torch

from bench.bench_decode_attention import dtypes_for
from bench.bench_linear import chain_provider
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn.generate import DTYPES

ROWS = (1, 16, 64)
VOCABS = (50257, 128256)
TEMPERATURES = (0.0, 1.0)
CPU_SHAPES = ((1, 1000), (4, 3000))
PROVIDERS = ("eager", "compiled", "fused")
ADVANCE_PROVIDERS = ("eager", "compiled", "unfused", "fused")
ADVANCE_SHAPES = ((1, 50257), (16, 50257))
GPU_ONLY = ("compiled",)
SPEEDUP_BASES = ("eager", "compiled")
NOTES = {"eager": "argmax / Gumbel-max chain in PyTorch ops", "compiled": "torch.compile(same)",
         "fused": "fused_attn.sample: 1 launch"}
ADVANCE_NOTES = {"eager": "argmax + counters.add_(1)", "compiled": "torch.compile(argmax + counters.add_(1))",
                 "unfused": "fused_attn.sample + counters.add_(1): 2 launches",
                 "fused": "fused_attn.sample(advance=counters): 1 launch"}
REPORT_LABELS = {"bench_sample": dict(title="sample (next token: argmax, or Gumbel-max at temperature 1)",
                                      shape="rows x vocab, temperature", order=PROVIDERS)}


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes, dtypes = (([(r, v) for v in VOCABS for r in ROWS], dtypes_for(config)) if cuda
                      else (CPU_SHAPES, ["float32"]))
    advance_shapes = ADVANCE_SHAPES if cuda else CPU_SHAPES
    return ([dict(shape=s, temperature=t, dtype=d, provider=p) for s in shapes for t in TEMPERATURES
             for d in dtypes for p in PROVIDERS]
            + [dict(shape=s, temperature=0.0, dtype=d, provider=p, op="advance") for s in advance_shapes
               for d in dtypes for p in ADVANCE_PROVIDERS])


def case_id(c: dict) -> str:
    rows, vocab = c["shape"]
    op = "advance-" if c.get("op") == "advance" else ""
    return f"{op}{c['provider']}-r{rows}-v{vocab}-t{c['temperature']:g}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def eager_sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, device=logits.device).clamp_(1e-20, 1.0)
    return (logits.float() / temperature - torch.log(-torch.log(u))).argmax(-1)


def provider_fn(provider: str, logits: torch.Tensor, temperature: float):
    from fused_attn import sample

    peer = chain_provider(provider, eager_sample, logits, temperature)
    if peer is not None:
        return peer
    if provider == "fused":
        offset = torch.zeros(1, dtype=torch.int64, device=logits.device)
        return lambda: sample(logits, temperature, seed=1, offset=offset)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def eager_sample_advance(logits: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    token = logits.argmax(-1)
    counters.add_(1)
    return token


def advance_provider_fn(provider: str, logits: torch.Tensor, counters: torch.Tensor):
    """The sample+advance group's providers (greedy); each call advances ``counters`` once."""
    from fused_attn import sample

    peer = chain_provider(provider, eager_sample_advance, logits, counters)
    if peer is not None:
        return peer
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if provider == "unfused":
        def unfused():
            sample(logits, out=out)
            counters.add_(1)
            return out
        return unfused
    if provider == "fused":
        return lambda: sample(logits, out=out, advance=counters)
    raise ValueError(f"provider must be one of {ADVANCE_PROVIDERS}, got {provider!r}")


def check(provider: str, got: torch.Tensor, logits: torch.Tensor, temperature: float) -> None:
    """Greedy: torch.argmax's index. Sampling: a valid index (the draws are tested in tests/test_sample.py)."""
    if temperature == 0:
        assert torch.equal(got, logits.argmax(-1)), f"{provider}: not the argmax"
    else:
        assert got.shape == logits.shape[:-1] and bool(((got >= 0) & (got < logits.shape[-1])).all()), provider


def bench_sample(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    (rows, vocab), temperature, provider = case["shape"], case["temperature"], case["provider"]
    dtype = DTYPES[case["dtype"]]
    advance = case.get("op") == "advance"
    name = "sample+advance" if advance else "sample"
    start_case(benchmark, f"{name} r{rows} v{vocab} t{temperature:g} {case['dtype']}", provider, device, GPU_ONLY)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen, device=device) * 3).to(dtype)
    read, write = logits.numel() * logits.element_size(), rows * 8
    if advance:
        counters = torch.zeros(3, rows, dtype=torch.int32, device=device)
        fn = advance_provider_fn(provider, logits, counters)
        check(provider, fn(), logits, temperature)
        assert torch.equal(counters, torch.ones_like(counters)), f"{provider}: the counters did not advance by 1"
        read, write = read + counters.numel() * 4, write + counters.numel() * 4
    else:
        fn = provider_fn(provider, logits, temperature)
        check(provider, fn(), logits, temperature)
    times = timer.run(benchmark, fn)
    stats = percentiles(times)
    info = dict(stats, provider=provider, shape=[rows, vocab], temperature=temperature, dtype=case["dtype"],
                note=(ADVANCE_NOTES if advance else NOTES)[provider], device=str(device), op=name)
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)
