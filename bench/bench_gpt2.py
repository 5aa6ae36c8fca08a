"""GPT-2 end to end: tokens/s, TTFT and TBT per backend (fused_attn.generate.run_backend).

Backends: fused_attn.generate.BACKENDS (hf-eager ... compile-graph, graph, graph-fused); batch
{1, 16} ({1, 4, 16, 64} with --full; --bench-gpt2-batches 2,3 for others); prompt {128, 512}; 128 new tokens, greedy (with --full also
sampled: temperature 0.8, top-k 50, cases named ``-sample``, their own groups); float16 by default,
float16, bfloat16 and float32 with --full. Model: GPT-2 small's
configuration with seeded random weights (same shapes and cost as the real checkpoint),
or FUSED_ATTN_GPT2_MODEL. Prompts: seeded random ids (tests/prompts.py), every row its own;
at batch > 1 left padded to lengths spread evenly from the prompt length down to half of it
(prompt 128, batch 16: 128, 124, ..., 64), so padding and ragged rows are exercised.

One clock (fused_attn.generate): tokens/s, TTFT and TBT of every backend come from CUDA events
on the stream at the call's start, at each token and after the call, with no sync per token;
each round checks that their total agrees with the host wall time around the call within 1%
(extra_info ``max_clock_vs_wall_pct``). extra_info: tokens/s, TTFT (ms), TBT p50/p95 (ms),
``launches_per_step`` for our GPT-2's graph backends (kernels a decode step runs, counted under torch.profiler in
one untimed generate after the rounds: launches_per_step), the
weight-bandwidth floor (every parameter read once at the measured copy bandwidth: ``weight_floor_ms``)
and ``pct_of_weight_floor`` (floor / TBT p50); the step-bytes floor, which adds the K / V cache a step must read
(``kv_bytes_per_step``: every row's own keys, padding excluded, averaged over the decode steps;
``step_floor_ms``, ``pct_of_step_floor``: at batch 16 the cache is a third of a step's bytes), speedup vs
hf-eager in the same run; hf-fused against hf-sdpa, the drop-in it replaces, from hf-sdpa rounds interleaved
with its own (--bench-gpt2-paired-rounds of each: both are host-bound and differ by less than the drift between
cases; 5 rounds left one of four cases at 0.98x on host jitter, 12 settled all four; extra_info
``interleaved`` holds the peer's figures, ``tbt_p50_vs_hf_sdpa`` the ratio of time between tokens). Each round is one whole
generate(); the first call of each case (graph capture, compilation) is a warm-up outside
the rounds. GPU only.

bench_hf_prefill: transformers' GPT2LMHeadModel's prefill (the forward over the prompt and the first token's
argmax: time to first token) with attention eager, sdpa and "fused_attn" (fused_attn.hf),
batch {1, 8}, prompt {128, 960}, and its peak memory above the model's own; ``speedup_vs_hf_sdpa`` same run.

compile-graph is the peer of our graph backends
(the plain PyTorch decode step of fused_attn.gpt2, SDPA + addmm, through torch.compile, captured in
one CUDA graph: gpt-fast's recipe); the cases after it carry ``speedup_vs_compile_graph``.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from bench.harness import positive_ints
from fused_attn.generate import BACKENDS, COMPILED, GRAPH_BACKENDS, STATIC, nearest_rank

NEW_TOKENS = 128
# The sampled cases' settings (a common chat setting): each backend's own sampler, seeded, so the tokens
# differ between backends and are not compared; the cost of top-k and the draw is what the cases add.
SAMPLING = dict(temperature=0.8, top_k=50)
# How bench.report names these cases (the columns and rows come from the saved extra_info).
REPORT_LABELS = {"bench_gpt2": dict(title="GPT-2 end to end", order=tuple(BACKENDS))}
CLOCK_VS_WALL_PCT = 1.0
# The backend timed against rounds of its peer interleaved with its own, and that peer.
PAIRED = ("hf-fused", "hf-sdpa")


def prompt_lengths(batch: int, prompt: int) -> list[int]:
    """Row lengths of a benchmark batch: the prompt length, then evenly down to half of it."""
    if batch == 1:
        return [prompt]
    return [prompt - i * (prompt // 2) // (batch - 1) for i in range(batch)]


def gpt2_batches(option: str | None, full: bool) -> tuple[int, ...]:
    """The batch sizes of the cases: --bench-gpt2-batches (a comma list of positive integers), else
    1, 4, 16, 64 with --full and 1, 16 without."""
    if option is None:
        return (1, 4, 16, 64) if full else (1, 16)
    try:
        return tuple(dict.fromkeys(positive_ints(option)))
    except ValueError as e:
        raise pytest.UsageError(f"--bench-gpt2-batches {e}") from None


def pytest_generate_tests(metafunc):
    _gpt2_cases(metafunc)
    _hf_prefill_cases(metafunc)


def _gpt2_cases(metafunc):
    if "gpt2_case" not in metafunc.fixturenames:
        return
    full = metafunc.config.getoption("--full")
    dtypes = ["float16", "bfloat16", "float32"] if full else ["float16"]
    batches = gpt2_batches(metafunc.config.getoption("--bench-gpt2-batches"), full)
    decoding = (False, True) if full else (False,)
    cases = [dict(batch=b, prompt=p, dtype=d, backend=k, sample=smp)
             for smp in decoding for d in dtypes for b in batches for p in (128, 512) for k in BACKENDS]
    metafunc.parametrize("gpt2_case", cases, ids=[f"{c['backend']}-b{c['batch']}-p{c['prompt']}-{c['dtype']}"
                                                  + ("-sample" if c["sample"] else "") for c in cases])


@pytest.fixture(scope="module")
def gpt2_models():
    if not torch.cuda.is_available():
        pytest.skip("GPT-2 end-to-end benchmarks need a CUDA GPU (none here)")
    from fused_attn.gpt2 import load_hf_model

    return load_hf_model(os.environ.get("FUSED_ATTN_GPT2_MODEL", "gpt2-random")), {}


@pytest.fixture(scope="module")
def hf_eager_tokens() -> dict:
    """hf-eager's greedy tokens per group, for the token check of the other backends."""
    return {}


def weight_floor_ms(hf_model, dtype: torch.dtype, copy_gbps: float) -> tuple[int, float]:
    """(bytes, ms): every parameter read once per decode step (the tied lm_head reads wte, the
    embeddings a row each: counted whole, a slight overestimate) at the measured copy bandwidth."""
    nbytes = sum(p.numel() for p in hf_model.parameters()) * torch.empty((), dtype=dtype).element_size()
    return nbytes, copy_ms(nbytes, copy_gbps)


def copy_ms(nbytes: int, copy_gbps: float) -> float:
    """Milliseconds to move nbytes at the measured copy bandwidth (the floors' one conversion)."""
    return nbytes / (copy_gbps * 1e9) * 1e3


def kv_bytes_per_step(config, lengths: list[int], new_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step must read, averaged over a generate's decode steps: the step that
    feeds generated token s (s = 1 .. new_tokens - 1; token 1 comes from the prefill) attends, in every
    layer, over row i's lengths[i] + s keys (its prompt without the padding, then its tokens), K and V
    each hidden_size wide. The mean of s is new_tokens / 2. The cache append (one position a row) and
    the padded positions a kernel may skip are not counted: this is what any decode step has to read."""
    if new_tokens < 2:
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    mean_keys = sum(lengths) + len(lengths) * new_tokens / 2
    return round(2 * config.num_hidden_layers * config.hidden_size * elem * mean_keys)


# The mark between two tokens in the launch count: ATen's spin kernel (torch.cuda._sleep), which no decode step
# of any backend launches.
MARK_KERNEL = "spin_kernel"


def launches_between_marks(events: list[tuple[str, float]], mark: str = MARK_KERNEL) -> list[int]:
    """Kernels the device ran between each two consecutive marks: ``events`` are the run's device
    events as (name, start time), in any order; copies and fills (``Memcpy ...``, ``Memset ...``) are
    not launches of a kernel and are not counted. One stream runs them all, so a kernel lies between
    the marks its start lies between."""
    counts, current = [], None
    for name, _ in sorted(events, key=lambda e: e[1]):
        if mark in name:
            if current is not None:
                counts.append(current)
            current = 0
        elif current is not None and not name.startswith(("Memcpy", "Memset")):
            current += 1
    return counts


def launches_per_step(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **sampling) -> int:
    """Kernels a decode step launches (so a token of each row): one untimed generate of our GPT-2 (its
    captured graphs replayed, as in the timed rounds) under torch.profiler, a mark kernel enqueued after
    every token; the median over its decode steps of the kernels between two marks."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile import _is_cpu

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, mask, max_new_tokens=new_tokens, use_graph=True,
                       on_token=lambda: torch.cuda._sleep(1), **sampling)
        torch.cuda.synchronize()
    counts = launches_between_marks([(e.name, e.time_range.start) for e in prof.events() if not _is_cpu(e)])
    if len(counts) != new_tokens - 1:
        raise RuntimeError(f"the launch count must see {new_tokens - 1} decode steps, got {len(counts)}")
    return round(statistics.median(counts))


def bench_gpt2(benchmark, gpt2_case, gpt2_models, medians, hf_eager_tokens, request, ceilings_gbps):
    from fused_attn.generate import DTYPES, run_backend
    from tests.prompts import left_padded

    hf_model, cache = gpt2_models
    c = gpt2_case
    benchmark.group = f"gpt2 b{c['batch']} p{c['prompt']} {c['dtype']}" + (" sample" if c["sample"] else "")
    sampling = SAMPLING if c["sample"] else dict(temperature=0.0, top_k=0)
    dtype, device = DTYPES[c["dtype"]], torch.device("cuda")
    lengths = prompt_lengths(c["batch"], c["prompt"])
    ids, mask = left_padded(hf_model.config.vocab_size, lengths, seed=0)
    if c["backend"] in STATIC + COMPILED:
        # a compiled decode step: one compile per case (every backend and shape), so no case runs
        # into dynamo's recompile limit and falls back to eager unseen.
        torch._dynamo.reset()
    run_backend(c["backend"], hf_model, ids, mask, NEW_TOKENS, dtype, device, cache=cache, **sampling)  # warm-up
    results, paired = [], []
    paired_case = c["backend"] == PAIRED[0]
    rounds = request.config.getoption("--bench-gpt2-paired-rounds" if paired_case else "--bench-gpt2-rounds")
    run = lambda backend: run_backend(backend, hf_model, ids, mask, NEW_TOKENS, dtype, device, cache=cache,  # noqa: E731
                                      **sampling)
    # hf-fused and hf-sdpa are both host-bound (transformers' Python a token) and drift between
    # cases by more than their difference, so hf-fused's comparison interleaves them: an
    # untimed hf-sdpa generate (pedantic's setup) before every timed hf-fused one.
    setup = (lambda: paired.append(run(PAIRED[1]))) if paired_case else None
    benchmark.pedantic(lambda: results.append(run(c["backend"])), setup=setup, rounds=rounds, iterations=1)
    if not results:
        return
    # One clock: the event totals must agree with the host wall time around each call.
    clock_vs_wall = max(100 * abs(r.total_s - r.wall_s) / r.wall_s for r in results + paired)
    assert clock_vs_wall <= CLOCK_VS_WALL_PCT, (
        f"event time must agree with wall time within {CLOCK_VS_WALL_PCT}%, got {clock_vs_wall:.2f}%")

    def stats(rs):
        steps = sorted(s for r in rs for s in r.step_s)
        return dict(tokens_per_s=round(statistics.median(r.tokens_per_s(c["batch"]) for r in rs), 1),
                    ttft_ms=round(1e3 * statistics.median(r.ttft_s for r in rs), 3),
                    tbt_p50_ms=round(1e3 * statistics.median(steps), 4),
                    tbt_p95_ms=round(1e3 * nearest_rank(steps, 0.95), 4))

    info = dict(backend=c["backend"], batch=c["batch"], prompt=c["prompt"], prompt_lengths=lengths,
                new_tokens=NEW_TOKENS, dtype=c["dtype"], **sampling, **stats(results), gpu=torch.cuda.get_device_name(),
                clock="cuda events at each token (no per-token sync); totals checked against host wall time",
                max_clock_vs_wall_pct=round(clock_vs_wall, 3))
    if ceilings_gbps:  # % of the weight-bandwidth floor: what a decode step at copy speed would take
        nbytes, floor_ms = weight_floor_ms(hf_model, dtype, ceilings_gbps["copy"])
        kv = kv_bytes_per_step(hf_model.config, lengths, NEW_TOKENS, dtype)
        step_ms = copy_ms(nbytes + kv, ceilings_gbps["copy"])
        info.update(weight_bytes=nbytes, weight_floor_ms=round(floor_ms, 4),
                    pct_of_weight_floor=round(100 * floor_ms / info["tbt_p50_ms"], 1),
                    kv_bytes_per_step=kv, step_floor_ms=round(step_ms, 4),
                    pct_of_step_floor=round(100 * step_ms / info["tbt_p50_ms"], 1))
    if c["backend"] in GRAPH_BACKENDS:
        info["launches_per_step"] = launches_per_step(cache[(c["backend"], dtype)], ids.to(device), mask.to(device),
                                                      NEW_TOKENS, **sampling)
    tps = info["tokens_per_s"]
    medians[(benchmark.group, c["backend"])] = tps
    if c["backend"] == "hf-eager" and not c["sample"]:
        hf_eager_tokens[benchmark.group] = results[0].tokens
    if paired:
        peer, key = stats(paired), PAIRED[1].replace("-", "_")
        info["interleaved_peer"], info["interleaved"] = PAIRED[1], peer
        info[f"speedup_vs_{key}"] = round(tps / peer["tokens_per_s"], 3)
        info[f"tbt_p50_vs_{key}"] = round(peer["tbt_p50_ms"] / info["tbt_p50_ms"], 3)
    if (benchmark.group, "hf-eager") in medians:
        info["speedup_vs_hf_eager"] = round(tps / medians[(benchmark.group, "hf-eager")], 3)
    if (benchmark.group, "compile-graph") in medians and c["backend"] != "compile-graph":
        info["speedup_vs_compile_graph"] = round(tps / medians[(benchmark.group, "compile-graph")], 3)
    if benchmark.group in hf_eager_tokens:
        # Same greedy tokens as transformers' eager attention, in this run (fp16 can differ in
        # rare near-ties; the float32 equality is a test, this is what a reader of the JSON sees).
        info["tokens_match_hf_eager"] = bool(torch.equal(results[0].tokens,
                                                         hf_eager_tokens[benchmark.group]))
    benchmark.extra_info.update(info)


# Hugging Face prefill (time to first token): transformers' GPT2LMHeadModel on one padded prompt batch with
# the attention implementation eager, sdpa and "fused_attn" (fused_attn.hf).
HF_PREFILL_IMPLS = {"hf-eager": "eager", "hf-sdpa": "sdpa", "hf-fused": "fused_attn"}
HF_PREFILL_ROUNDS = 30


def _hf_prefill_cases(metafunc):
    if "hf_prefill_case" not in metafunc.fixturenames:
        return
    full = metafunc.config.getoption("--full")
    dtypes = ["float16", "bfloat16"] if full else ["float16"]
    cases = [dict(provider=p, batch=b, prompt=s, dtype=d) for d in dtypes for b in (1, 8) for s in (128, 960)
             for p in HF_PREFILL_IMPLS]
    metafunc.parametrize("hf_prefill_case", cases,
                         ids=[f"{c['provider']}-b{c['batch']}-p{c['prompt']}-{c['dtype']}" for c in cases])


@pytest.fixture(scope="module")
def hf_prefill_models(gpt2_models):
    """One transformers model per (attention implementation, dtype), built on first use."""
    import copy

    import fused_attn.hf

    fused_attn.hf.register()
    hf_model, _ = gpt2_models
    built = {}

    def get(provider: str, dtype: torch.dtype):
        if (provider, dtype) not in built:
            m = copy.deepcopy(hf_model).to("cuda", dtype).eval()
            m.set_attn_implementation(HF_PREFILL_IMPLS[provider])
            built[(provider, dtype)] = m
        return built[(provider, dtype)]

    return get


def bench_hf_prefill(benchmark, hf_prefill_case, hf_prefill_models, medians):
    """One prefill forward and its first token on the host (the time to first token a user waits: transformers'
    Python and the kernels both, host clock around the call and a sync), and its peak memory above the model's
    own; same inputs for every provider; ``speedup_vs_hf_sdpa`` in the same run. Not the cold-L2 device timer
    of the kernel cases: eager's forward is ~16 ms of host work, which no queued spin outlasts."""
    from fused_attn.generate import DTYPES
    from tests.prompts import left_padded

    c = hf_prefill_case
    dtype = DTYPES[c["dtype"]]
    benchmark.group = f"hf prefill b{c['batch']} p{c['prompt']} {c['dtype']}"
    model = hf_prefill_models(c["provider"], dtype)
    lengths = prompt_lengths(c["batch"], c["prompt"])
    ids, mask = (t.cuda() for t in left_padded(model.config.vocab_size, lengths, seed=0))

    def first_token(m=model):
        with torch.no_grad():
            return m(ids, attention_mask=mask, use_cache=True).logits[:, -1].argmax(-1).tolist()

    first = first_token()
    torch.cuda.synchronize()
    # From an allocator with no cached free blocks: a cached block reused whole counts its unsplit remainder
    # (up to 1 MB) as allocated, so without this the peak depends on which providers ran before. The tensors
    # alive at the peak are the same for sdpa, eager and fused_attn (dev/probe_hf_peak_memory.py, H200, B8 p960:
    # 1017.4 MB each, logits 736 MB and the cache 270 MB), while max_memory_allocated differed by 1-2 MB.
    # Both peaks: the allocator's blocks (max_memory_allocated, what the device must hold) and the bytes the
    # tensors asked for (requested_bytes: the live tensors alone, without the blocks' rounding).
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_requested = torch.cuda.memory_allocated(), torch.cuda.memory_stats()["requested_bytes.all.current"]
    first_token()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    peak_requested_mb = (torch.cuda.memory_stats()["requested_bytes.all.peak"] - base_requested) / 2**20
    # hf-fused against hf-sdpa rounds interleaved with its own (an untimed-by-pytest sdpa prefill, timed here,
    # before each): a host-clock figure of a few ms drifts between cases by more than the two differ (B1 p960
    # read 0.64x in one H200 run and 1.04x in the next, each against sdpa's separate rounds).
    paired = []
    setup = None
    if c["provider"] == PAIRED[0]:
        peer = hf_prefill_models(PAIRED[1], dtype)
        first_token(peer)

        def setup():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            first_token(peer)
            paired.append(time.perf_counter() - t0)
    benchmark.pedantic(first_token, setup=setup, rounds=HF_PREFILL_ROUNDS, warmup_rounds=3,
                       iterations=1)
    p50 = 1e6 * benchmark.stats.stats.median if benchmark.stats else float("nan")
    medians[(benchmark.group, c["provider"])] = p50
    info = dict(provider=c["provider"], batch=c["batch"], prompt=c["prompt"], prompt_lengths=lengths,
                dtype=c["dtype"], p50_us=round(p50, 2), ttft_ms=round(p50 / 1e3, 4),
                peak_mb_above_model=round(peak_mb, 1), peak_requested_mb_above_model=round(peak_requested_mb, 1),
                gpu=torch.cuda.get_device_name(), first_tokens=first,
                clock="host clock around the forward and the first token's read-back")
    if paired:
        peer_p50 = 1e6 * statistics.median(paired)
        info["interleaved_peer"] = PAIRED[1]
        info["interleaved"] = dict(p50_us=round(peer_p50, 2), ttft_ms=round(peer_p50 / 1e3, 4))
        info["speedup_vs_hf_sdpa"] = round(peer_p50 / p50, 3)
    elif (benchmark.group, "hf-sdpa") in medians:
        info["speedup_vs_hf_sdpa"] = round(medians[(benchmark.group, "hf-sdpa")] / p50, 3)
    benchmark.extra_info.update(info)
