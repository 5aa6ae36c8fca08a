"""decode_attention microbenchmarks: one decode step (append 1 new key/value, attend over the cache).

Providers, side by side in one group per (shape, dtype); every call appends k_new/v_new into the
cache, then attends with the one new query per sequence over its L valid keys:
  sdpa            what a gpt-fast user does today: the append as our GPT-2's KVCache.update and
                  gpt-fast write it, two ``index_copy_`` (k_cache and v_cache at ``input_pos``, the
                  batch being of uniform length), then F.scaled_dot_product_attention(q, k_cache,
                  v_cache, attn_mask=<bool [B,1,1,max_len] length mask, built once outside the timed
                  call>, enable_gqa=Hq != Hkv), PyTorch's default backend choice
  sdpa_flash      the same append, SDPA pinned to one backend with torch.nn.attention.sdpa_kernel
  sdpa_efficient  and attn_mask=None (exact here: max_len = L and every sequence has L valid keys,
  sdpa_cudnn      and the flash backend takes no mask); skipped where the backend refuses the case
  compiled        torch.compile of the ``sdpa`` function (append + masked SDPA), one compile per case
  gpt2_step       the decode attention our GPT-2's "fused" backend ran before decode_attention
                  (fused_attn.gpt2 up to commit 6c99809): the same append, q @ k_cache^T,
                  fused_attn.scaled_masked_softmax(attn_mask=<the length mask>), @ v_cache: five
                  launches; MHA only (our GPT-2 has no GQA)
  fused_nosplit   fused_attn.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new=, v_new=,
                  num_splits=1): the append fused into the attention launch, no split-KV
  paged           the same over a paged cache (block_table=): the caches as page pools of PAGE_SIZE
                  slots, the pages of every sequence handed out in a shuffled order, as a serving
                  engine's allocator leaves them; the long-context cases (L >= PAGED_MIN_L) only
  fused           the same with the split count chosen by the op's heuristic (num_splits=None)
  sdpa_flash_graph, sdpa_cudnn_graph, paged_graph, fused_graph
                  the provider without the suffix captured once in a CUDA graph (after an eager call, which
                  makes the backends' choices and lazy set-up), the replay timed: what a serving engine that
                  captures its decode step pays; the long-context cases (L >= PAGED_MIN_L) only
cache_seqlens is an int32 device tensor (no host-to-device copy per call, CUDA-graph safe).

Shapes, written [B, Hq, Hkv, D, L] (L last so that bench.report plots latency against L):
GPT-2 small (B 1, 16; H 12; D 64; L 128, 256, 1024), Llama-like (B 1, 16; H 32; D 128; L 1k, 8k,
32k) and GQA (B 1, 16; Hq 32, Hkv 8; D 128; L 8k, 32k); seqlen_new = 1. --full adds the serving shapes
(SERVING_SHAPES): Hq/Hkv 32/32, 32/8 and 64/8, D 64 and 128, B 1, 4 and 16, L 8k, 32k and 128k (54 shapes,
46 of them new), each with SERVING_PROVIDERS only (sdpa, sdpa_flash, sdpa_cudnn, paged, fused and the last four
captured in a CUDA graph: no compile a case). L is the number of valid keys after the append; the cache holds
exactly max_len = L slots (cache_seqlens = L - 1 before the append), so SDPA, which reads the whole cache under
its mask, reads no slot beyond the valid ones (a longer cache would only cost SDPA more).

Memory: a provider that cannot hold a shape is skipped with the reason, never run into an out-of-memory
error: a case runs when its modeled peak (peak_bytes: the caches, the paged pools beside them, the peer's
own copies, the check's float64 copies of one sequence) is at most MAX_FRACTION_OF_FREE of the free device
memory. The peers' copies are what drop them: sdpa and compiled (PyTorch's math backend under the length
mask: K and V repeated to Hq heads and upcast to float32, 172 GB at B16 32/32 D128 L128k) and sdpa_cudnn on
GQA (the repeated K and V) are modeled as holding them. On an H200 (~140 GB free) every case of the
serving selection below fits (the largest, paged at B16 32/32 D128 L128k: 103 GB, K + V 34 GB); sdpa is
skipped at B16 D128 L128k (32/32 and 64/8). MHA 64/64 is not a serving shape: its cache alone is 69 GB
at B16 D128 L128k, with the check's copies as much again.

The serving selection, every serving shape with the providers the bar compares (ours and paged against
the better of sdpa_flash and sdpa_cudnn), float16 and bfloat16, in one run (SERVING_K):
    python -m pytest bench/bench_decode_attention.py --full \
        -k "(sdpa_flash- or sdpa_cudnn- or paged- or fused-) and (l8192- or l32768- or l131072-)"
    BENCH_K="<the same expression>" DECODE_ARGS=--full DECODE_TIMEOUT=570 bash bench/run_gpu.sh decode
432 cases (54 shapes x 2 dtypes x 4 providers). Time on an H200, estimated conservatively: the data moved
(60 rounds + 5 warm-up of K + V, ours at 80% and the SDPA backends at 25% of 3.5 TB/s, a 0.6 ms flush and
spin a round, the same-bytes copy floor once per size) takes ~80 s, and each case's fixed cost (gc and
empty_cache, the inputs, the float64 check, the clock warm-up) ~0.3-1 s: 3.5-8.5 minutes, plus the
library's build on a fresh machine. Measured on an H200 (2026-11-30): 80-90 s a dtype.

The bar holds in a CUDA graph too: the same cases with the *_graph providers (SERVING_GRAPH_K), a run of their own:
    python -m pytest bench/bench_decode_attention.py --full -k "(sdpa_flash_graph- or sdpa_cudnn_graph- or \
        paged_graph- or fused_graph-) and (l8192- or l32768- or l131072-)"
Each case calls its base provider once eagerly (lazy set-up, the backend's choice, the check of refusals), captures
one call in a CUDA graph, replays it once for the output check, then times replays (cold L2, as every case).

The append is in place and idempotent: every call (warm-up, check, timed rounds) writes the same
k_new/v_new at the same slot L - 1 (cache_seqlens never advances), so each round sees the same
cache and computes the same output.

Each provider's output is checked once, before timing, against the float64 reference
(``fused_attn.reference.decode_attention``, on the first and last sequence of the batch) with
bench_softmax's relative bound (max |out - ref| <= CHECK_RTOL x max |ref|), and the appended slot
is checked to hold k_new/v_new.

extra_info: p5/p50/p95 (us, CUDA events, cold L2: bench/harness.py), the modeled bytes (K and V
over the L valid keys, 2 x B x Hkv x L x D x elsize, plus q, k_new, v_new read and out, the
appended k/v written; the same for every provider, plus the block_table read once for paged: the op's
necessary traffic, so GB/s compares providers; SDPA's mask and the math backend's K/V repeat are not
counted), GB/s, % of the measured
copy bandwidth, the time of a device copy of the same bytes and of an empty kernel (the floors of
cases too small to reach the copy bandwidth), and speedups vs sdpa, compiled and gpt2_step
measured in this run.

Quick default: float16. --full: float16 and bfloat16 (--bench-dtypes overrides both). On a machine
without a GPU the cases run on the CPU at one tiny GQA shape (sdpa, fused_nosplit and fused: the
op's CPU path; paged too) and one tiny MHA shape (gpt2_step too), which exercises the harness; GPU numbers
need a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_softmax import check_output
from bench.harness import bandwidth_info, percentiles, same_run_speedups, start_case
from fused_attn import reference
from fused_attn.generate import DTYPES

SEQLEN_NEW = 1
GPT2_SHAPES = [(b, 12, 12, 64, n) for b in (1, 16) for n in (128, 256, 1024)]
LLAMA_SHAPES = [(b, 32, 32, 128, n) for b in (1, 16) for n in (1024, 8192, 32768)]
GQA_SHAPES = [(b, 32, 8, 128, n) for b in (1, 16) for n in (8192, 32768)]
# The serving bar (H200, float16 and bfloat16, one run): ours at least the better of sdpa_flash and sdpa_cudnn,
# paged within 3% of contiguous, at these shapes. MHA 64/64 is left out: at batch 16, 128k keys, D128 its cache is
# 69 GB, and the float64 check's copies of one sequence as much again.
SERVING_HEADS = ((32, 32), (32, 8), (64, 8))
SERVING_SHAPES = [(b, hq, hkv, d, n) for hq, hkv in SERVING_HEADS for d in (64, 128) for b in (1, 4, 16)
                  for n in (8192, 32768, 131072)]
# The providers the bar compares (and the default sdpa, the gpt-fast user's step) on the serving shapes that the
# Llama-like and GQA lists above do not hold: no compiled (one compile a case, ~10 s each), no fused_nosplit,
# no sdpa_efficient (it refuses GQA), no gpt2_step (MHA at GPT-2's shapes).
# The same providers captured in a CUDA graph (GRAPHED below) beside them.
SERVING_PROVIDERS = ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_flash_graph", "sdpa_cudnn_graph", "paged_graph",
                     "fused_graph", "paged", "fused")
# The serving bar's cases alone (every serving shape, the bar's providers), with --full for bfloat16:
#   python -m pytest bench/bench_decode_attention.py --full -k "$SERVING_K"
SERVING_K = "(sdpa_flash- or sdpa_cudnn- or paged- or fused-) and (l8192- or l32768- or l131072-)"
# The same in a CUDA graph (the bar holds "in and out of a CUDA graph"): a run of its own, as long as SERVING_K's.
SERVING_GRAPH_K = ("(sdpa_flash_graph- or sdpa_cudnn_graph- or paged_graph- or fused_graph-) and "
                   "(l8192- or l32768- or l131072-)")
CPU_SHAPES = [(2, 4, 2, 16, 32), (1, 2, 2, 16, 32)]
QUICK_DTYPES = ("float16",)
FULL_DTYPES = ("float16", "bfloat16")
# A case runs when its modeled peak device memory (peak_bytes) is at most this fraction of the free memory; the
# rest covers the timer's 512 MiB of flush buffers and the allocator's rounding.
MAX_FRACTION_OF_FREE = 0.85

# Baselines first (speedups are against providers already measured in the group); `fused` last:
# bench.report takes the last provider named fused* as ours (fused_graph comes before it).
PROVIDERS = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "compiled", "gpt2_step", "fused_nosplit",
             "sdpa_flash_graph", "sdpa_cudnn_graph", "paged_graph", "fused_graph", "paged", "fused")
# A provider captured in a CUDA graph: the provider it replays.
GRAPHED = {"sdpa_flash_graph": "sdpa_flash", "sdpa_cudnn_graph": "sdpa_cudnn", "paged_graph": "paged",
           "fused_graph": "fused"}


def base(provider: str) -> str:
    """The provider whose call ``provider`` times (itself, or the one a *_graph provider replays)."""
    return GRAPHED.get(provider, provider)


SPEEDUP_BASES = ("sdpa", "compiled", "gpt2_step")
MHA_ONLY = ("gpt2_step",)
# The paged provider: vLLM's default block size (16 slots: the most page lookups a key), at the long caches
# where a serving engine pages (and on the CPU shapes, which exercise the harness).
PAGE_SIZE = 16
PAGED_MIN_L = 8192
GPU_ONLY = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "compiled", *GRAPHED)
PINNED_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
                   "sdpa_cudnn": "CUDNN_ATTENTION"}
NOTES = {"sdpa": "index_copy_ x2 + SDPA(bool length mask, default backend)",
         "compiled": "torch.compile(index_copy_ x2 + SDPA(bool length mask))",
         "gpt2_step": "index_copy_ x2 + q @ k^T + fused_attn.scaled_masked_softmax(length mask) + @ v",
         "fused_nosplit": "fused_attn.decode_attention(k_new=, v_new=, num_splits=1)",
         "paged": f"fused_attn.decode_attention(k_new=, v_new=, block_table=): pages of {PAGE_SIZE} slots, "
                  "shuffled, num_splits by heuristic",
         "fused": "fused_attn.decode_attention(k_new=, v_new=), num_splits by heuristic",
         **{p: f"index_copy_ x2 + SDPA pinned to {b}, attn_mask=None (max_len = L)"
            for p, b in PINNED_BACKENDS.items()}}
NOTES.update({g: f"{NOTES[p]}; captured in a CUDA graph, the replay timed" for g, p in GRAPHED.items()})

# What `python -m bench.bytes --op decode_attention [--shape B,Hq,Hkv,D,L]` measures under ncu (one call
# per provider; K + V of 134 MB, well above the L2). The pinned SDPA backends may refuse a shape and
# gpt2_step is MHA only: these run at any shape.
BYTES_SHAPE = (1, 32, 32, 128, 8192)
BYTES_PROVIDERS = ("sdpa", "compiled", "fused_nosplit", "paged", "fused")


def bytes_cases(backward: bool) -> list[tuple[bool, str]]:
    """(causal, provider) of every call bench.bytes profiles (decode has no causal flag and no backward)."""
    if backward:
        raise ValueError("backward must be False for decode_attention (the op has no gradient), got True")
    return [(False, p) for p in BYTES_PROVIDERS]


def bytes_model(provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool) -> tuple[int, int]:
    """Modeled (bytes read, bytes written) of one decode step (the same for every provider; paged adds its
    block_table)."""
    return modeled_traffic(shape, dtype, PAGE_SIZE if base(provider) == "paged" else None)


def bytes_call(provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool):
    """One decode step of ``provider`` on random CUDA inputs of ``shape`` [B, Hq, Hkv, D, L]."""
    t = make_inputs(tuple(shape), dtype, torch.device("cuda"))
    if base(provider) == "paged":
        page_inputs(t, PAGE_SIZE)
    return provider_fn(provider, t)


# How bench.report names this module's cases (columns and rows come from the saved extra_info).
REPORT_LABELS = {"bench_decode_attention": dict(title="decode_attention (append 1 + attend, seqlen_new 1)",
                                                shape="shape [B,Hq,Hkv,D,L]", order=PROVIDERS)}


def kv_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of K and V over the L valid keys: 2 x B x Hkv x L x D x elsize (= the cache: max_len = L)."""
    b, _, hkv, d, n = shape
    return 2 * b * hkv * n * d * torch.empty((), dtype=dtype).element_size()


def modeled_traffic(shape, dtype: torch.dtype, page_size: int | None = None) -> tuple[int, int]:
    """(bytes read, bytes written) of one decode step, any provider: read K and V over the L valid keys,
    q, k_new and v_new (and, paged, the block_table's B x ceil(L / page_size) int32 entries once);
    write out and the appended k/v."""
    b, hq, hkv, d, n = shape
    e = torch.empty((), dtype=dtype).element_size()
    q = b * hq * SEQLEN_NEW * d * e
    new = 2 * b * hkv * SEQLEN_NEW * d * e
    table = 0 if page_size is None else b * -(-n // page_size) * 4
    return kv_bytes(shape, dtype) + q + new + table, q + new


def peak_bytes(provider: str, shape, dtype: torch.dtype) -> int:
    """Modeled peak device memory of one case, conservative: the caches; for paged the pools beside them (the
    check's contiguous caches); then the larger of what the provider's call or the inputs' set-up holds for a
    while (sdpa and compiled: the math backend's K and V repeated to Hq heads and upcast to float32;
    sdpa_cudnn: K and V repeated for GQA; paged: one pool gathered in logical order and reshaped, the check's
    two copies of it; the others: nothing of the cache's size) and the check's float64 copies of one sequence (K and V, the
    reference's scatter, where and repeat to Hq heads). The caching allocator reuses the one's blocks for
    the other."""
    b, hq, hkv, d, n = shape
    kv = kv_bytes(shape, dtype)
    repeated = 2 * kv * hq // hkv + 2 * kv
    transient = {"sdpa": repeated, "compiled": repeated, "paged": kv,
                 "sdpa_cudnn": kv * hq // hkv if hq != hkv else 0}.get(base(provider), 0)
    check = 2 * (3 * hkv + hq) * n * d * 8
    # A captured call keeps what it allocates in the graph's pool for the case (the eager call before the capture
    # has released its own); a paged call's transient is its check's, outside the graph.
    held = transient if provider in GRAPHED and base(provider) != "paged" else 0
    return kv + (kv if base(provider) == "paged" else 0) + max(transient, held + check)


def providers(shape) -> tuple[str, ...]:
    """The providers measured for a shape (gpt2_step only where Hq == Hkv, paged at L >= PAGED_MIN_L and on
    the CPU shapes, SERVING_PROVIDERS only on the serving shapes beyond the Llama-like and GQA lists)."""
    long = shape[-1] >= PAGED_MIN_L
    paged = long or tuple(shape) in CPU_SHAPES
    serving_only = tuple(shape) in SERVING_SHAPES and tuple(shape) not in LLAMA_SHAPES + GQA_SHAPES
    return tuple(p for p in PROVIDERS if (shape[1] == shape[2] or p not in MHA_ONLY) and (paged or p != "paged")
                 and (long or p not in GRAPHED) and (not serving_only or p in SERVING_PROVIDERS))


def gpu_shapes() -> list[tuple[int, int, int, int, int]]:
    listed = GPT2_SHAPES + LLAMA_SHAPES + GQA_SHAPES
    return listed + [s for s in SERVING_SHAPES if s not in listed]


def dtypes_for(config) -> list[str]:
    names = config.getoption("--bench-dtypes")
    if names:
        return names.split(",")
    return list(FULL_DTYPES if config.getoption("--full") else QUICK_DTYPES)


def make_cases(config, cuda: bool | None = None) -> list[dict]:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    shapes, dtypes = (gpu_shapes(), dtypes_for(config)) if cuda else (CPU_SHAPES, ["float32"])
    return [dict(shape=shape, dtype=dtype, provider=provider)
            for shape in shapes for dtype in dtypes for provider in providers(shape)]


def case_id(c: dict) -> str:
    b, hq, hkv, d, n = c["shape"]
    return f"{c['provider']}-b{b}-hq{hq}-hkv{hkv}-d{d}-l{n}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])


def make_inputs(shape, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """q, the caches (max_len = L, random everywhere), k_new/v_new, cache_seqlens = L - 1 (int32, on
    the device), input_pos = [L - 1] (int64) and the bool length mask [B, 1, 1, L] (True: attend)."""
    b, hq, hkv, d, n = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(size, generator=gen, device=device, dtype=dtype)

    t = dict(q=randn(b, hq, SEQLEN_NEW, d), k_cache=randn(b, hkv, n, d), v_cache=randn(b, hkv, n, d),
             k_new=randn(b, hkv, SEQLEN_NEW, d), v_new=randn(b, hkv, SEQLEN_NEW, d))
    before = n - SEQLEN_NEW
    t["cache_seqlens"] = torch.full((b,), before, dtype=torch.int32, device=device)
    t["input_pos"] = torch.arange(before, n, device=device)
    after = t["cache_seqlens"].to(torch.int64) + SEQLEN_NEW
    t["mask"] = (torch.arange(n, device=device).view(1, n) < after.view(b, 1)).view(b, 1, 1, n)
    return t


def page_inputs(t: dict, page_size: int, shuffled: bool = True) -> None:
    """Adds the caches as page pools t["k_pool"], t["v_pool"] [B x L / page_size, Hkv, page_size, D] (the
    same values; the contiguous caches stay for the check) and t["block_table"] int32 [B, L / page_size]:
    the pages handed out in a shuffled order (``shuffled=False``: in order, sequence by sequence)."""
    b, hkv, n, d = t["k_cache"].shape
    blocks = n // page_size
    order = (torch.randperm(b * blocks, generator=torch.Generator().manual_seed(0)) if shuffled
             else torch.arange(b * blocks)).to(t["k_cache"].device)
    for name in ("k", "v"):
        cache = t[f"{name}_cache"]
        pool = torch.empty(b * blocks, hkv, page_size, d, dtype=cache.dtype, device=cache.device)
        pool[order] = cache.view(b, hkv, blocks, page_size, d).transpose(1, 2).reshape(b * blocks, hkv, page_size, d)
        t[f"{name}_pool"] = pool
    t["block_table"] = order.view(b, blocks).to(torch.int32)


def sdpa_step(q, k_cache, v_cache, k_new, v_new, input_pos, mask, enable_gqa: bool):
    """The decode step as a gpt-fast user writes it: append at input_pos (as our GPT-2's KVCache.update
    does too), then SDPA over the whole cache under the length mask."""
    k_cache.index_copy_(2, input_pos, k_new)
    v_cache.index_copy_(2, input_pos, v_new)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=enable_gqa)


def gpt2_step(q, k_cache, v_cache, k_new, v_new, input_pos, keys_ok):
    """The decode attention of fused_attn.gpt2's "fused" backend before decode_attention
    (KVCache.update, then Attention.attend) on one layer's cache."""
    from fused_attn.softmax import scaled_masked_softmax

    k_cache.index_copy_(2, input_pos, k_new)
    v_cache.index_copy_(2, input_pos, v_new)
    scores = q @ k_cache.transpose(-1, -2)
    return scaled_masked_softmax(scores, q.shape[-1] ** -0.5, attn_mask=keys_ok) @ v_cache


def provider_fn(provider: str, t: dict):
    """One decode step of ``provider`` on the inputs of ``make_inputs`` (mask and lengths built there); a *_graph
    provider's is its base's, captured by ``captured`` after a first eager call."""
    from fused_attn import decode_attention

    provider = base(provider)

    gqa = t["q"].shape[1] != t["k_cache"].shape[1]
    args = (t["q"], t["k_cache"], t["v_cache"], t["k_new"], t["v_new"], t["input_pos"])
    if provider == "sdpa":
        return lambda: sdpa_step(*args, t["mask"], gqa)
    if provider in PINNED_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, PINNED_BACKENDS[provider])

        def pinned():
            with sdpa_kernel(backend):
                return sdpa_step(*args, None, gqa)
        return pinned
    if provider == "gpt2_step":
        return lambda: gpt2_step(*args, t["mask"])
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
        compiled = torch.compile(sdpa_step, dynamic=False)
        return lambda: compiled(*args, t["mask"], gqa)
    if provider == "paged":
        return lambda: decode_attention(t["q"], t["k_pool"], t["v_pool"], t["cache_seqlens"], k_new=t["k_new"],
                                        v_new=t["v_new"], block_table=t["block_table"])
    if provider in ("fused", "fused_nosplit"):
        splits = 1 if provider == "fused_nosplit" else None
        return lambda: decode_attention(t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], k_new=t["k_new"],
                                        v_new=t["v_new"], num_splits=splits)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def captured(fn):
    """``fn`` captured once in a CUDA graph and replayed once: (the replay, the graph's output). Called after an
    eager ``fn()``, which made the lazy set-up and the backends' choices outside the capture; the append is
    idempotent, so every replay sees the same cache and writes the same output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    return graph.replay, out


def check_step(provider: str, out: torch.Tensor, t: dict) -> None:
    """Raise unless the appended slot holds k_new/v_new and ``out`` matches the float64 reference on
    the first and last sequence. The cache already holds the append; the reference appends the same
    values at the same slot again (idempotent). paged: the pools are gathered into the contiguous caches
    first (the logical cache they hold)."""
    if base(provider) == "paged":
        table = t["block_table"].to(torch.int64)
        for name in ("k", "v"):
            cache = t[f"{name}_cache"]
            cache.copy_(t[f"{name}_pool"][table].transpose(1, 2).reshape(cache.shape))
    slots = t["input_pos"]
    for name in ("k", "v"):
        if not torch.equal(t[f"{name}_cache"].index_select(2, slots), t[f"{name}_new"]):
            raise AssertionError(f"{provider} must write {name}_new at slots {slots.tolist()} of {name}_cache")
    b = t["q"].shape[0]
    for i in sorted({0, b - 1}):  # the first and the last sequence
        s = slice(i, i + 1)
        ref, _, _ = reference.decode_attention(t["q"][s].double(), t["k_cache"][s].double(), t["v_cache"][s].double(),
                                               t["cache_seqlens"][s], t["k_new"][s].double(), t["v_new"][s].double())
        check_output(f"{provider} (sequence {i})", out[s], ref)
        del ref


def record(benchmark, case: dict, times: list[float], device, ceilings_gbps, timer, launch_floor_us,
           medians) -> None:
    """extra_info of one case: percentiles, modeled bytes, bandwidth, floors, speedups in this run."""
    shape, provider, dtype = case["shape"], case["provider"], DTYPES[case["dtype"]]
    read, write = modeled_traffic(shape, dtype, PAGE_SIZE if base(provider) == "paged" else None)
    stats = percentiles(times)
    info = dict(stats, provider=provider, shape=list(shape), dtype=case["dtype"], note=NOTES[provider],
                seqlen_new=SEQLEN_NEW, max_len=shape[-1], device=str(device), kv_bytes=kv_bytes(shape, dtype))
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)


def group(case: dict) -> str:
    return f"decode {'x'.join(map(str, case['shape']))} {case['dtype']}"


def bench_decode_attention(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    provider, shape, dtype = case["provider"], case["shape"], DTYPES[case["dtype"]]
    free = start_case(benchmark, group(case), provider, device, GPU_ONLY)
    peak = peak_bytes(provider, shape, dtype)
    if free is not None and peak > MAX_FRACTION_OF_FREE * free:
        pytest.skip(f"{provider}: its modeled peak of {peak / 1e9:.1f} GB (K + V {kv_bytes(shape, dtype) / 1e9:.1f} "
                    f"GB) exceeds {MAX_FRACTION_OF_FREE:.0%} of the free device memory ({free / 1e9:.1f} GB)")
    t = make_inputs(shape, dtype, device)
    if base(provider) == "paged":
        page_inputs(t, PAGE_SIZE)
    fn = provider_fn(provider, t)
    try:
        out = fn()
    except RuntimeError as e:
        if base(provider) not in PINNED_BACKENDS:
            raise
        pytest.skip(f"{provider}: the backend refuses this case ({str(e).splitlines()[0][:200]})")
    if provider in GRAPHED:
        del out
        fn, out = captured(fn)
    check_step(provider, out, t)
    del out
    times = timer.run(benchmark, fn)
    record(benchmark, case, times, device, ceilings_gbps, timer, launch_floor_us, medians)
