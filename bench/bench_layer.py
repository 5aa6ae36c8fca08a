"""One whole pre-LN transformer layer (a prompt's forward pass): LN -> attention -> LN -> MLP, residuals.

    x1 = x + out_proj(attention(qkv_proj(norm_1(x))))      causal self-attention, batch 1
    y  = x1 + mlp(norm_2(x1))

Two configurations, in one group per (model, sequence, dtype):
  gpt2    GPT-2 small: d 768, 12 heads of 64, LayerNorm (eps 1e-5) with bias, projections with bias,
          MLP 768 -> 3072 -> 768 with GELU(tanh)
  llama   Llama-2-7B: d 4096, 32 heads of 128, RMSNorm (eps 1e-6), no biases, SwiGLU MLP
          4096 -> 2 x 11008 -> 4096 (gate and up stacked in one weight). Rotary embeddings are left
          out of every provider alike (an elementwise pass on q and k).
Providers:
  eager     plain PyTorch: F.layer_norm / Hugging Face's RMSNorm chain, F.linear, SDPA (is_causal,
            PyTorch's backend choice), F.gelu / F.silu, the residual adds as their own kernels
  compiled  torch.compile of the eager layer (one compile per case)
  fused     fused_attn's ops: layer_norm / rms_norm (the second with the residual add fused in),
            linear (bias in the epilogue; above 16 rows cuBLAS through ATen, see fused_attn.linear),
            the output projection with the residual in its epilogue, mlp (activation and residual in
            the epilogues), and fused_attn.attention where it exists (else SDPA, as eager: extra_info
            ``attention`` names which ran)
Sequences 512, 1024, 2048, 4096 (batch 1). Weights ~ N(0, 0.02), activations ~ N(0, 1), fp16 (quick) or
fp16 and bf16 (--full). Every provider's output is checked once against the eager layer in float32
before timing (max |out - ref| <= CHECK_RTOL x max |ref|).

extra_info: p5/p50/p95 (us, cold L2, CUDA events: bench/harness.py), the layer's FLOPs (the six
projections, 2 * S * d_in * d_out each, and attention's two S x S products counted as half for
causal), TFLOP/s and % of the measured dense matmul peak at that dtype, the weight bytes, and speedups vs
eager and compiled in this run. GPU only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.bench_decode_attention import dtypes_for
from bench.harness import percentiles, same_run_speedups
from fused_attn.generate import DTYPES

MODELS = {
    "gpt2": dict(d=768, heads=12, ff=3072, norm="layer_norm", eps=1e-5, bias=True, act="gelu_tanh"),
    "llama": dict(d=4096, heads=32, ff=11008, norm="rms_norm", eps=1e-6, bias=False, act="swiglu"),
}
SEQLENS = (512, 1024, 2048, 4096)
PROVIDERS = ("eager", "compiled", "fused")
SPEEDUP_BASES = ("eager", "compiled")
CHECK_RTOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def make_cases(config) -> list[dict]:
    return [dict(model=m, seqlen=s, dtype=d, provider=p)
            for m in MODELS for s in SEQLENS for d in dtypes_for(config) for p in PROVIDERS]


def case_id(c: dict) -> str:
    return f"{c['provider']}-{c['model']}-s{c['seqlen']}-{c['dtype']}"


def pytest_generate_tests(metafunc):
    if "layer_case" in metafunc.fixturenames:
        cases = make_cases(metafunc.config)
        metafunc.parametrize("layer_case", cases, ids=[case_id(c) for c in cases])


def make_layer(model: str, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """The layer's weights in nn.Linear's [out, in] layout (fused_attn.linear's too)."""
    m = MODELS[model]
    d, ff = m["d"], m["ff"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=0.02, mean=0.0):
        return (mean + scale * torch.randn(size, generator=gen, device=device)).to(dtype)

    fc_rows = 2 * ff if m["act"] == "swiglu" else ff
    w = dict(w_qkv=randn(3 * d, d), w_o=randn(d, d), w_fc=randn(fc_rows, d), w_proj=randn(d, ff),
             ln1_w=randn(d, scale=0.1, mean=1.0), ln2_w=randn(d, scale=0.1, mean=1.0))
    for name, n in (("b_qkv", 3 * d), ("b_o", d), ("b_fc", fc_rows), ("b_proj", d), ("ln1_b", d), ("ln2_b", d)):
        w[name] = randn(n) if m["bias"] else None
    return w


def flops(model: str, seqlen: int) -> int:
    m = MODELS[model]
    d, ff = m["d"], m["ff"]
    fc_out = 2 * ff if m["act"] == "swiglu" else ff
    proj = 2 * seqlen * (d * 3 * d + d * d + d * fc_out + ff * d)
    attention = 2 * 2 * seqlen * seqlen * d // 2  # Q·Kᵀ and P·V, causal: half
    return proj + attention


def weight_bytes(w: dict) -> int:
    return sum(t.numel() * t.element_size() for t in w.values() if t is not None)


def _norm_eager(x, weight, bias, model: str):
    m = MODELS[model]
    if m["norm"] == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, m["eps"])
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m["eps"])).to(x.dtype)


def _attention_eager(qkv, heads: int):
    s, three_d = qkv.shape[-2:]
    q, k, v = qkv.view(1, s, 3, heads, three_d // 3 // heads).permute(2, 0, 3, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(1, s, three_d // 3)


def eager_layer(x, w: dict, model: str):
    """The layer in plain PyTorch (the eager and compiled providers, and the check's float32 reference)."""
    m = MODELS[model]
    h = _norm_eager(x, w["ln1_w"], w["ln1_b"], model)
    a = _attention_eager(F.linear(h, w["w_qkv"], w["b_qkv"]), m["heads"])
    x1 = x + F.linear(a, w["w_o"], w["b_o"])
    h = _norm_eager(x1, w["ln2_w"], w["ln2_b"], model)
    f = F.linear(h, w["w_fc"], w["b_fc"])
    if m["act"] == "swiglu":
        gate, up = f.chunk(2, dim=-1)
        f = F.silu(gate) * up
    else:
        f = F.gelu(f, approximate="tanh")
    return x1 + F.linear(f, w["w_proj"], w["b_proj"])


def fused_attention_fn():
    """fused_attn.attention (q, k, v [B, H, S, D], causal) where it exists, else SDPA; and its name."""
    try:
        from fused_attn import attention
    except ImportError:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "sdpa"
    return (lambda q, k, v: attention(q, k, v, causal=True)), "fused_attn.attention"


def fused_layer(x, w: dict, model: str, attend):
    from fused_attn import layer_norm, linear, mlp, rms_norm

    m = MODELS[model]
    if m["norm"] == "layer_norm":
        h = layer_norm(x, w["ln1_w"], w["ln1_b"], m["eps"])
    else:
        h = rms_norm(x, w["ln1_w"], m["eps"])
    qkv = linear(h, w["w_qkv"], w["b_qkv"])
    s, d = x.shape[-2], m["d"]
    q, k, v = qkv.view(1, s, 3, m["heads"], d // m["heads"]).permute(2, 0, 3, 1, 4).unbind(0)
    a = attend(q, k, v).transpose(1, 2).reshape(1, s, d)
    x1 = linear(a, w["w_o"], w["b_o"], residual=x)
    if m["norm"] == "layer_norm":
        h = layer_norm(x1, w["ln2_w"], w["ln2_b"], m["eps"])
    else:
        h = rms_norm(x1, w["ln2_w"], m["eps"])
    return mlp(h, w["w_fc"], w["b_fc"], w["w_proj"], w["b_proj"], activation=m["act"], residual=x1)


def provider_fn(provider: str, model: str, x, w: dict):
    if provider == "eager":
        return (lambda: eager_layer(x, w, model)), "sdpa"
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
        compiled = torch.compile(eager_layer, dynamic=False)
        return (lambda: compiled(x, w, model)), "sdpa"
    if provider == "fused":
        attend, name = fused_attention_fn()
        return (lambda: fused_layer(x, w, model, attend)), name
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def check_layer(provider: str, out: torch.Tensor, x, w: dict, model: str) -> None:
    ref = eager_layer(x.float(), {k: None if v is None else v.float() for k, v in w.items()}, model)
    err = (out.float() - ref).abs().max().item()
    bound = CHECK_RTOL[out.dtype] * ref.abs().max().item()
    if not err <= bound:
        raise AssertionError(f"{provider} {model} must match the float32 layer within {CHECK_RTOL[out.dtype]} x "
                             f"max|ref| = {bound:.3g} before it is timed, got max error {err:.3g}")


def bench_layer(benchmark, layer_case, device, timer, matmul_peak_tflops, medians):
    if device.type != "cuda":
        pytest.skip("the transformer-layer benchmark needs a CUDA GPU (none here)")
    c = layer_case
    dtype = DTYPES[c["dtype"]]
    benchmark.group = f"layer {c['model']} s{c['seqlen']} {c['dtype']}"
    w = make_layer(c["model"], dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, c["seqlen"], MODELS[c["model"]]["d"], generator=gen, device=device).to(dtype)
    fn, attention = provider_fn(c["provider"], c["model"], x, w)
    check_layer(c["provider"], fn(), x, w, c["model"])
    times = timer.run(benchmark, fn)
    stats = percentiles(times)
    f = flops(c["model"], c["seqlen"])
    tflops = f / (stats["p50_us"] * 1e-6) / 1e12
    info = dict(stats, provider=c["provider"], model=c["model"], seqlen=c["seqlen"], dtype=c["dtype"],
                attention=attention, flops=f, tflops=round(tflops, 1), weight_bytes=weight_bytes(w),
                shape=[MODELS[c["model"]]["d"], c["seqlen"]])
    peak = matmul_peak_tflops(dtype)
    if peak:
        info["matmul_peak_tflops"] = round(peak, 1)
        info["pct_of_matmul_peak"] = round(100 * tflops / peak, 1)
    info.update(same_run_speedups(medians, benchmark.group, c["provider"], stats["p50_us"], SPEEDUP_BASES))
    benchmark.extra_info.update(info)
