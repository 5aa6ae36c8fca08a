"""Host overhead: what one eager call of an op costs the host, ours against the PyTorch code it replaces.

A user who calls our ops outside a CUDA graph (Hugging Face ``generate``, a training loop, a notebook)
pays the host time of every call; at small shapes that, not the kernel, is the call's time. Each case
times ``CALLS`` back-to-back calls on the host clock (pytest-benchmark's default timer,
``time.perf_counter``) with no sync inside a round: the GPU work of a call is shorter than its host time
here, so the launch queue never fills and the clock measures the host. Grad mode is on and no input requires grad (a notebook's default state).

Providers, side by side in one group per op (same process, same inputs):
  torch       the PyTorch equivalent (below, per op)
  fused_attn  our public wrapper (fused_attn.<op>)

Ops and their PyTorch equivalents (GPT-2 small's shapes, float16, batch 1):
  layer_norm            1 x 768                  F.layer_norm
  linear                1 x 768 -> 768 (+ bias)  F.linear
  mlp                   1 x 768, hidden 3072     F.linear, F.gelu(tanh), F.linear
  scaled_masked_softmax 12 x 128 x 128 causal    torch.softmax (no mask: a lower bound for the peer)
  attention             B1 H12 S128 D64 causal   F.scaled_dot_product_attention(is_causal=True)
  decode_attention      B1 H12 D64, 1024 cached keys, one new key appended in the launch
                                                 SDPA over the 1024 keys with a bool key mask (no append)
  qkv_decode_attention  B1 d768, 1024 cached keys
                                                 F.layer_norm, F.linear, the append (two slice copies), SDPA
  sample                greedy over 50257        torch.argmax

extra_info: op, host_us (p50 per call), and in the fused_attn case peer_host_us (the torch case's p50, same
run) and host_ratio = host_us / peer_host_us. On a machine without a GPU: the CPU path at the same shapes
in float32 (the smoke mode: every case runs; nothing is stored).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_attn

CALLS = 200  # calls a round (one pytest-benchmark iteration is one call)
ROUNDS = 40
CPU_CALLS, CPU_ROUNDS = 2, 1  # the CPU smoke mode: the CPU path computes (ms a call), it only has to run
PROVIDERS = ("torch", "fused_attn")
OPS = ("layer_norm", "linear", "mlp", "scaled_masked_softmax", "attention", "decode_attention",
       "qkv_decode_attention", "sample")
REPORT_LABELS = {"bench_host": dict(title="host time per eager call", shape="op", order=PROVIDERS)}


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = [dict(op=op, provider=p) for op in OPS for p in PROVIDERS]
        metafunc.parametrize("case", cases, ids=[f"{c['op']}-{c['provider']}" for c in cases])


@pytest.fixture(scope="module")
def medians() -> dict:
    return {}


def calls(op: str, provider: str, device: str):
    """The call to time, on fresh inputs of the op's shape."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    ours = provider == "fused_attn"
    if op == "layer_norm":
        x, w, b = r(1, 768), r(768), r(768)
        return (lambda: fused_attn.layer_norm(x, w, b)) if ours else (lambda: F.layer_norm(x, (768,), w, b))
    if op == "linear":
        x, w, b = r(1, 768), r(768, 768), r(768)
        return (lambda: fused_attn.linear(x, w, b)) if ours else (lambda: F.linear(x, w, b))
    if op == "mlp":
        x, w_fc, b_fc, w_proj, b_proj = r(1, 768), r(3072, 768), r(3072), r(768, 3072), r(768)
        if ours:
            return lambda: fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj)
        return lambda: F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
    if op == "scaled_masked_softmax":
        s = r(12, 128, 128)
        return (lambda: fused_attn.scaled_masked_softmax(s, 1.0, causal=True)) if ours else (
            lambda: torch.softmax(s, -1))
    if op == "attention":
        q, k, v = r(1, 12, 128, 64), r(1, 12, 128, 64), r(1, 12, 128, 64)
        return (lambda: fused_attn.attention(q, k, v, causal=True)) if ours else (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    lens = torch.tensor([1024], dtype=torch.int32, device=device)
    if op == "decode_attention":
        q, k_cache, v_cache, k_new, v_new = r(1, 12, 1, 64), r(1, 12, 1088, 64), r(1, 12, 1088, 64), \
            r(1, 12, 1, 64), r(1, 12, 1, 64)
        if ours:  # the same slot every call: the append writes the same key and value again
            return lambda: fused_attn.decode_attention(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new)
        mask = torch.ones(1, 1, 1, 1024, dtype=torch.bool, device=device)
        k, v = k_cache[:, :, :1024], v_cache[:, :, :1024]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if op == "qkv_decode_attention":
        x, w, b = r(1, 1, 768), r(2304, 768), r(2304)
        k_cache, v_cache = r(1, 12, 1088, 64), r(1, 12, 1088, 64)
        if ours:
            return lambda: fused_attn.qkv_decode_attention(x, w, b, k_cache, v_cache, lens)

        def peer():
            qkv = F.linear(F.layer_norm(x, (768,)), w, b).view(1, 3, 12, 64).transpose(0, 2)  # [12, 3, 1, 64]
            q, k, v = qkv.unbind(1)
            k_cache[0, :, 1024:1025] = k
            v_cache[0, :, 1024:1025] = v
            return F.scaled_dot_product_attention(q.unsqueeze(0), k_cache[:, :, :1025], v_cache[:, :, :1025])

        return peer
    if op == "sample":
        logits = r(1, 50257)
        return (lambda: fused_attn.sample(logits)) if ours else (lambda: torch.argmax(logits, -1))
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def bench_host(benchmark, case, medians):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    op, provider = case["op"], case["provider"]
    benchmark.group = f"host {op}"
    fn = calls(op, provider, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n, rounds = (CALLS, ROUNDS) if device == "cuda" else (CPU_CALLS, CPU_ROUNDS)
    for _ in range(n):  # warm-up: the library loaded, caches and allocator pools filled
        fn()
    sync()
    benchmark.pedantic(fn, rounds=rounds, iterations=n, warmup_rounds=1)
    sync()
    host_us = 1e6 * benchmark.stats.stats.median if benchmark.stats else float("nan")  # nan: --benchmark-disable
    medians[(op, provider)] = host_us
    info = dict(op=op, provider=provider, host_us=round(host_us, 2), calls_per_round=n,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                clock="host clock around back-to-back calls, no sync inside a round")
    peer = medians.get((op, "torch"))
    if provider == "fused_attn" and peer is not None:
        info.update(peer_host_us=round(peer, 2), host_ratio=round(host_us / peer, 3))
    benchmark.extra_info.update(info)
