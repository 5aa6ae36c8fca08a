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
fused_attn.sample + ``counters.add_(1)`` (two launches: our GPT-2 step before c7bf7e2), fused =
``sample(..., advance=counters)`` (one launch). Rows 1 and 16, vocab 50257, greedy.

The sample+history groups (op "history": GPT-2's fused sampler, which also records each token in the
cache's [rows, L] token history at a per-row column read from device memory): the same shapes and
counters, plus ``history[r, index[r]] = token[r]`` with ``index`` an int32 [rows] tensor of distinct
columns that no provider advances (every call writes the same columns: no call runs out of [0, L)).
eager and compiled: argmax, the index_put into history, ``counters.add_(1)``; unfused =
``sample(..., advance=counters)`` + the index_put (two launches: the copy the history replaced); fused =
``sample(..., advance=counters, history=, history_index=)`` (one launch). The check before timing
(and the history's again after it): the argmax in out and in each row's history column, nothing else in
the history written, the counters + 1.

The sample+top-k groups (op "topk": GPT-2's sampled chat setting, temperature 1 and top_k 50, the draw
among the 50 largest logits of each row): eager = torch.topk, the logits below the 50th set to -inf, then
the Gumbel-max chain above; compiled = torch.compile of it; unfused = the same topk and masked_fill, then
fused_attn.sample (3 launches: our GPT-2's sampled step before 617b8e7); fused = ``sample(...,
top_k=50)`` (one launch: a radix select of the 50th largest inside the kernel). Rows 1, 16, 64 of GPT-2's
vocabulary and 1 of Llama 3's. The check before timing: every drawn token is among its row's top 50.

extra_info: bytes (the logits read, the int64 tokens written; with the counters read and written, and
the history index read and the tokens' history elements written where the group has them), GB/s, % of
copy and of a same-bytes copy (at these sizes, ~0.1-16 MB, the same-bytes copy and the empty kernel are
the floors), speedups. Quick default float16; --full adds bfloat16. On a machine without a GPU: small
shapes on the CPU (eager and fused), exercising the harness.
"""

from __future__ import annotations

import torch

from bench.bench_decode_attention import dtypes_for
from bench.bench_linear import chain_provider
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn.generate import DTYPES
from fused_attn.sample import top_k_filter  # PyTorch ops: topk, <, masked_fill (the peers' filter)

ROWS = (1, 16, 64)
VOCABS = (50257, 128256)
TEMPERATURES = (0.0, 1.0)
CPU_SHAPES = ((1, 1000), (4, 3000))
PROVIDERS = ("eager", "compiled", "fused")
ADVANCE_PROVIDERS = ("eager", "compiled", "unfused", "fused")
ADVANCE_SHAPES = ((1, 50257), (16, 50257))
TOPK_SHAPES = ((1, 50257), (16, 50257), (64, 50257), (1, 128256))
TOP_K = 50
HISTORY_LEN = 1024  # GPT-2's context: the history's columns
HISTORY_FILL = -7  # what the history holds before a call (never a token, nor the -1 of an out-of-range index)
GPU_ONLY = ("compiled",)
SPEEDUP_BASES = ("eager", "compiled")
NOTES = {"eager": "argmax / Gumbel-max chain in PyTorch ops", "compiled": "torch.compile(same)",
         "fused": "fused_attn.sample: 1 launch"}
ADVANCE_NOTES = {"eager": "argmax + counters.add_(1)", "compiled": "torch.compile(argmax + counters.add_(1))",
                 "unfused": "fused_attn.sample + counters.add_(1): 2 launches",
                 "fused": "fused_attn.sample(advance=counters): 1 launch"}
HISTORY_NOTES = {"eager": "argmax + history index_put + counters.add_(1)",
                 "compiled": "torch.compile(argmax + history index_put + counters.add_(1))",
                 "unfused": "fused_attn.sample(advance=counters) + history index_put: 2 launches",
                 "fused": "fused_attn.sample(advance=counters, history=, history_index=): 1 launch"}
TOPK_NOTES = {"eager": f"topk({TOP_K}) + masked_fill + Gumbel-max chain in PyTorch ops",
              "compiled": f"torch.compile(topk({TOP_K}) + masked_fill + Gumbel-max chain)",
              "unfused": f"topk({TOP_K}) + masked_fill + fused_attn.sample: 3 launches",
              "fused": f"fused_attn.sample(top_k={TOP_K}): 1 launch"}
# op -> (group name, notes); the plain sample group is op None
GROUPS = {None: ("sample", NOTES), "advance": ("sample+advance", ADVANCE_NOTES),
          "history": ("sample+history", HISTORY_NOTES), "topk": (f"sample+top-{TOP_K}", TOPK_NOTES)}
REPORT_LABELS = {"bench_sample": dict(title="sample (next token: argmax, or Gumbel-max at temperature 1)",
                                      shape="rows x vocab, temperature", order=PROVIDERS)}


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes, dtypes = (([(r, v) for v in VOCABS for r in ROWS], dtypes_for(config)) if cuda
                      else (CPU_SHAPES, ["float32"]))
    advance_shapes = ADVANCE_SHAPES if cuda else CPU_SHAPES
    topk_shapes = TOPK_SHAPES if cuda else CPU_SHAPES
    return ([dict(shape=s, temperature=t, dtype=d, provider=p) for s in shapes for t in TEMPERATURES
             for d in dtypes for p in PROVIDERS]
            + [dict(shape=s, temperature=0.0, dtype=d, provider=p, op=op) for op in ("advance", "history")
               for s in advance_shapes for d in dtypes for p in ADVANCE_PROVIDERS]
            + [dict(shape=s, temperature=1.0, dtype=d, provider=p, op="topk") for s in topk_shapes for d in dtypes
               for p in ADVANCE_PROVIDERS])


def case_id(c: dict) -> str:
    rows, vocab = c["shape"]
    op = f"{c['op']}-" if c.get("op") else ""
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


def eager_sample_top_k(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return eager_sample(top_k_filter(logits, temperature, TOP_K), temperature)


def top_k_provider_fn(provider: str, logits: torch.Tensor, temperature: float):
    """The sample+top-k group's providers: a draw among each row's TOP_K largest logits."""
    from fused_attn import sample

    peer = chain_provider(provider, eager_sample_top_k, logits, temperature)
    if peer is not None:
        return peer
    offset = torch.zeros(1, dtype=torch.int64, device=logits.device)
    if provider == "unfused":
        return lambda: sample(top_k_filter(logits, temperature, TOP_K), temperature, seed=1, offset=offset)
    if provider == "fused":
        return lambda: sample(logits, temperature, top_k=TOP_K, seed=1, offset=offset)
    raise ValueError(f"provider must be one of {ADVANCE_PROVIDERS}, got {provider!r}")


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


def history_columns(rows: int, device) -> torch.Tensor:
    """The sample+history groups' history_index: int32 [rows], distinct columns in [0, HISTORY_LEN)."""
    return ((torch.arange(rows) * 61 + 5) % HISTORY_LEN).to(device=device, dtype=torch.int32)


def eager_sample_history(logits: torch.Tensor, counters: torch.Tensor, history: torch.Tensor, index: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
    token = logits.argmax(-1)
    history[rows, index] = token
    counters.add_(1)
    return token


def history_provider_fn(provider: str, logits: torch.Tensor, counters: torch.Tensor, history: torch.Tensor,
                        index: torch.Tensor):
    """The sample+history group's providers (greedy); each call advances ``counters`` once and writes row r's
    token into ``history[r, index[r]]`` (``index`` is never advanced: every call the same columns)."""
    from fused_attn import sample

    rows = torch.arange(logits.shape[0], device=logits.device)
    peer = chain_provider(provider, eager_sample_history, logits, counters, history, index, rows)
    if peer is not None:
        return peer
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if provider == "unfused":
        def unfused():
            sample(logits, out=out, advance=counters)
            history[rows, index] = out
            return out
        return unfused
    if provider == "fused":
        return lambda: sample(logits, out=out, advance=counters, history=history, history_index=index)
    raise ValueError(f"provider must be one of {ADVANCE_PROVIDERS}, got {provider!r}")


def check(provider: str, got: torch.Tensor, logits: torch.Tensor, temperature: float) -> None:
    """Greedy: torch.argmax's index. Sampling: a valid index (the draws are tested in tests/test_sample.py)."""
    if temperature == 0:
        assert torch.equal(got, logits.argmax(-1)), f"{provider}: not the argmax"
    else:
        assert got.shape == logits.shape[:-1] and bool(((got >= 0) & (got < logits.shape[-1])).all()), provider


def check_history(provider: str, history: torch.Tensor, index: torch.Tensor, logits: torch.Tensor) -> None:
    """Row r's argmax at ``history[r, index[r]]`` and HISTORY_FILL everywhere else."""
    want = torch.full_like(history, HISTORY_FILL)
    want[torch.arange(history.shape[0], device=history.device), index] = logits.argmax(-1)
    assert torch.equal(history, want), f"{provider}: the history must hold each row's token at its column, nothing else"


def bench_sample(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    (rows, vocab), temperature, provider = case["shape"], case["temperature"], case["provider"]
    dtype = DTYPES[case["dtype"]]
    op = case.get("op")
    name, notes = GROUPS[op]
    start_case(benchmark, f"{name} r{rows} v{vocab} t{temperature:g} {case['dtype']}", provider, device, GPU_ONLY)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen, device=device) * 3).to(dtype)
    read, write = logits.numel() * logits.element_size(), rows * 8
    counters = history = None
    if op is None:
        fn = provider_fn(provider, logits, temperature)
    elif op == "topk":
        fn = top_k_provider_fn(provider, logits, temperature)
    else:
        counters = torch.zeros(3, rows, dtype=torch.int32, device=device)
        read, write = read + counters.numel() * 4, write + counters.numel() * 4
        if op == "history":
            history = torch.full((rows, HISTORY_LEN), HISTORY_FILL, dtype=torch.int64, device=device)
            index = history_columns(rows, device)
            fn = history_provider_fn(provider, logits, counters, history, index)
            read, write = read + index.numel() * 4, write + rows * 8
        else:
            fn = advance_provider_fn(provider, logits, counters)
    got = fn()
    check(provider, got, logits, temperature)
    if op == "topk":
        kth = logits.topk(TOP_K, dim=-1).values[..., -1]
        inside = logits.gather(-1, got[:, None])[:, 0] >= kth
        assert bool(inside.all()), f"{provider}: a token outside the top {TOP_K}"
    if counters is not None:
        assert torch.equal(counters, torch.ones_like(counters)), f"{provider}: the counters did not advance by 1"
    if history is not None:
        check_history(provider, history, index, logits)
    times = timer.run(benchmark, fn)
    if history is not None:  # the timed calls wrote the same columns: the workload did not change
        check_history(provider, history, index, logits)
    stats = percentiles(times)
    info = dict(stats, provider=provider, shape=[rows, vocab], temperature=temperature, dtype=case["dtype"],
                note=notes[provider], device=str(device), op=name)
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)
