"""One GPT-2 small decode step (embedding, 12 layers, ln_f, lm_head, next token) as a replayed CUDA graph.

Providers, side by side in one group per (batch, cache length, dtype): fused_attn.gpt2's decode step of
one backend each, captured once in a CUDA graph after a prefill (as generate() does) and replayed per
timed round (each replay advances the state by one token, as in generate(): the rounds run at cache
lengths L + 1, L + 2, ...):
  eager          the plain PyTorch step (attention "sdpa": F.layer_norm, addmm, GELU, SDPA over the
                 cache under the key mask, argmax), in a CUDA graph
  compiled       the same step through torch.compile, in a CUDA graph (compile-graph, gpt-fast's recipe:
                 the peer issue 13's 2x is measured against)
  fused_modules  every module on our ops (graph-fused: layer_norm, linear / mlp with their epilogues,
                 decode_attention, sample; ~99 launches per token)
  fused          the whole step as one gpt2_decode_step launch (graph-persistent), then sample
Batch 1 and 16; L (the prompt's length: valid cache slots before the first timed step) 128 and 512;
GPT-2 small's shapes with seeded random weights (gpt2-random); float16 (quick), float16 and bfloat16
(--full). Before timing, each provider's first step's logits are checked against the float64 definition
(fused_attn.reference.gpt2_decode_step) within bench_softmax's relative bound.

extra_info: p5/p50/p95 (us, CUDA events, cold L2: bench/harness.py), the modeled bytes of a step (every
weight read once, the lm_head's wte included, the embeddings' rows not; K and V of the valid slots read;
this step's keys and values and the logits written), GB/s, % of the measured copy bandwidth, the time of
a device copy of the same bytes (the floor), and speedups vs eager, compiled and fused_modules measured in
this run. GPU only (bench_gpt2 has the end-to-end generate()).
"""

from __future__ import annotations

import functools

import pytest
import torch

from bench.bench_decode_attention import dtypes_for
from bench.bench_softmax import check_output
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn.generate import DTYPES, GRAPH_BACKENDS

# Baselines first (speedups are against providers already measured in the group); `fused` last:
# bench.report takes the last provider named fused* as ours.
PROVIDERS = ("eager", "compiled", "fused_modules", "fused")
SPEEDUP_BASES = ("eager", "compiled", "fused_modules")
BACKEND_OF = {"eager": "compile-graph", "compiled": "compile-graph", "fused_modules": "graph-fused",
              "fused": "graph-persistent"}  # eager is compile-graph's model, not compiled
BATCHES = (1, 16)
LENGTHS = (128, 512)
REPORT_LABELS = {"bench_gpt2_decode_step": dict(title="GPT-2 small decode step (one CUDA graph replay)",
                                                shape="shape [B,L]", order=PROVIDERS)}


def make_cases(config) -> list[dict]:
    return [dict(batch=b, length=n, dtype=d, provider=p)
            for b in BATCHES for n in LENGTHS for d in dtypes_for(config) for p in PROVIDERS]


def case_id(c: dict) -> str:
    return f"{c['provider']}-b{c['batch']}-l{c['length']}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "step_case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("step_case", cases, ids=[case_id(c) for c in cases])


@functools.lru_cache(maxsize=1)
def hf_small():
    from fused_attn.gpt2 import load_hf_model

    return load_hf_model("gpt2-random")


@functools.lru_cache(maxsize=1)
def float64_weights():
    """GPT-2 small's weights in gpt2_decode_step's layout, float64 on the GPU (the check's definition)."""
    from fused_attn.gpt2 import GPT2

    return GPT2.from_hf(hf_small(), torch.float64, "cuda", backends=GRAPH_BACKENDS["graph-persistent"]).step_weights


def modeled_traffic(model, batch: int, length: int) -> tuple[int, int]:
    """(bytes read, bytes written) of one step at ``length`` valid slots: every parameter once (wte as the
    lm_head; the embeddings' rows are counted in it), K and V of the length + 1 slots attended."""
    c = model.config
    e = model.dtype.itemsize
    weights = sum(p.numel() for p in model.parameters()) * e
    kv = 2 * c.n_layer * batch * (length + 1) * c.n_embd * e
    return weights + kv, 2 * c.n_layer * batch * c.n_embd * e + batch * c.vocab_size * e


def make_step(provider: str, batch: int, length: int, dtype: torch.dtype, rounds: int):
    """(replay, logits buffer, model, cache, state before the first replay): the provider's decode step
    captured after a prefill of ``batch`` prompts of ``length`` tokens, in a cache with room for the
    warm-up, the check and the timed rounds (each replay, a re-timed one included, adds a token)."""
    from fused_attn.gpt2 import GPT2, _DecodeGraph
    from tests.prompts import left_padded

    hf = hf_small()
    model = GPT2.from_hf(hf, dtype, "cuda", backends=GRAPH_BACKENDS[BACKEND_OF[provider]])
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case: no recompile limit across cases
        model.compile_decode_step(dynamic=False)
    ids, mask = left_padded(hf.config.vocab_size, [length] * batch, "cuda", seed=0)
    cache = model.decode_cache(batch, min(hf.config.n_positions, length + 4 * rounds + 64))
    seen = []
    real = cache.set_next_token

    def recording(logits):
        seen.append(logits)  # under capture: the graph's own output buffer
        real(logits)

    cache.set_next_token = recording
    model.prefill(cache, ids, mask)
    graph = _DecodeGraph(model, cache)
    state = dict(token=cache.token.clone(), pos=cache.pos.clone(), seqlens=cache.seqlens.clone(),
                 leftpad=cache.leftpad.clone(), k=cache.k.double(), v=cache.v.double())
    return graph.replay, seen[-1], model, state


def check_step(provider: str, logits: torch.Tensor, model, state: dict) -> None:
    """The first replay's logits against the float64 definition on the state before it."""
    from fused_attn import reference

    ref = reference.gpt2_decode_step(state["token"], state["pos"], state["seqlens"], state["leftpad"], state["k"],
                                     state["v"], *float64_weights().tensors(), model.config.eps)
    check_output(f"{provider} decode step", logits, ref)


def bench_gpt2_decode_step(benchmark, step_case, device, timer, ceilings_gbps, launch_floor_us, medians):
    from fused_attn.gpt2_decode_step import is_batch_too_large

    if device.type != "cuda":
        pytest.skip("the GPT-2 decode-step benchmark needs a CUDA GPU (none here)")
    c = step_case
    dtype = DTYPES[c["dtype"]]
    start_case(benchmark, f"gpt2 step b{c['batch']} l{c['length']} {c['dtype']}", c["provider"], device, ())
    try:
        replay, logits, model, state = make_step(c["provider"], c["batch"], c["length"], dtype,
                                                 timer.warmup + timer.rounds)
    except ValueError as e:  # gpt2_decode_step keeps the batch's activations in shared memory
        if not is_batch_too_large(e):
            raise
        pytest.skip(f"{c['provider']}: {e}")
    replay()
    check_step(c["provider"], logits, model, state)
    del state
    times = timer.run(benchmark, replay)
    stats = percentiles(times)
    read, write = modeled_traffic(model, c["batch"], c["length"])
    info = dict(stats, provider=c["provider"], backend=BACKEND_OF[c["provider"]], batch=c["batch"],
                length=c["length"], dtype=c["dtype"], shape=[c["batch"], c["length"]])
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, c["provider"], stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)
