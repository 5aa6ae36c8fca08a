"""fused_attn.gpt2_decode_step (GPT-2's decode step in one launch) against our GPT-2's module-by-module step.

The definition it is held to is fused_attn.gpt2's eager modules (F.layer_norm, addmm, the reference attention,
F.gelu) in float64: not the op's CPU path. On the GPU: logits error against that float64 step at most twice
the launch chain's error at the same dtype (the rule the chain's own ops meet), the caches' new slot, tokens
of generate() equal to the chain's, bad lengths giving NaN without a write, and each bad argument's message.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fused_attn.gpt2 as gpt2_mod  # noqa: E402
from fused_attn.gpt2 import GPT2  # noqa: E402
from fused_attn.gpt2_decode_step import gpt2_decode_step, workspace_bytes  # noqa: E402
from tests.prompts import left_padded  # noqa: E402
from tests.tolerances import assert_error_at_most_twice  # noqa: E402

# The op's shapes: n_embd a multiple of 256, heads of 64; a vocabulary that leaves some blocks without rows
# of the lm_head at 132 SMs (ceil(1000 / 132) = 8 rows a block: 125 blocks).
CONFIG = dict(n_layer=3, n_embd=256, n_head=4, vocab_size=1000, n_positions=128, initializer_range=0.2)
CONFIG_768 = dict(n_layer=2, n_embd=768, n_head=12, vocab_size=2053, n_positions=256, initializer_range=0.2)


def hf_model(config, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(**config)).eval()


def step_args(model: GPT2, cache, dtype=None):
    """The op's arguments for the model's next decode step over ``cache`` (weights contiguous, in dtype)."""
    dt = dtype or model.dtype
    cast = lambda t: t.detach().to(dt).contiguous()  # noqa: E731
    c = model.config
    ws = torch.zeros(workspace_bytes(cache.batch, c.n_embd, c.n_layer), dtype=torch.uint8,
                     device=model.device)
    return dict(token=cache.token.clone(), pos=cache.pos.clone(), seqlens=cache.seqlens.clone(),
                leftpad=cache.leftpad.clone(), wte=cast(model.wte.weight), wpe=cast(model.wpe.weight),
                layers=[cast(t) for t in model.step_layers()], lnf_w=cast(model.ln_f.weight),
                lnf_b=cast(model.ln_f.bias), k_cache=cache.k.to(dt).clone(), v_cache=cache.v.to(dt).clone(),
                workspace=ws, eps=c.eps)


def module_step(model: GPT2, cache) -> torch.Tensor:
    """The model's own decode step (its modules, one by one), returning its logits; advances ``cache``."""
    seen = []
    real = cache.next_token
    cache.next_token = lambda logits: (seen.append(logits.clone()), real(logits))[1]
    try:
        model._decode_step(cache)
    finally:
        cache.next_token = real
    return seen[0]


def prefilled(model: GPT2, lengths, max_len, seed=0):
    """A DecodeCache of ``model`` after the prefill of left-padded prompts of ``lengths``."""
    ids, mask = left_padded(model.config.vocab_size, lengths, model.device, seed=seed)
    from fused_attn.gpt2 import DecodeCache

    cache = DecodeCache(model.config, len(lengths), max_len, 0.0, 0, model.dtype, model.device)
    model.prefill(cache, ids, mask)
    return cache


@pytest.mark.parametrize("lengths", [(9,), (9, 5, 2)])
def test_matches_the_module_step_cpu(lengths):
    """The CPU path's logits and appended keys / values against the model's modules, both in float64."""
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float64)
    cache = prefilled(model, lengths, 16)
    args = step_args(model, cache)
    logits = gpt2_decode_step(**args)
    want = module_step(model, cache)
    torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9)
    slot = args["seqlens"].long()
    for b in range(len(lengths)):
        torch.testing.assert_close(args["k_cache"][:, b, :, slot[b]], cache.k[:, b, :, slot[b]], rtol=1e-9, atol=0)
        torch.testing.assert_close(args["v_cache"][:, b, :, slot[b]], cache.v[:, b, :, slot[b]], rtol=1e-9, atol=0)


def test_fake_gives_the_logits_shape():
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float32)
    cache = prefilled(model, (4, 3), 8)
    args = step_args(model, cache, torch.float16)  # meta tensors stand in for CUDA ones: a 16-bit dtype
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else [t.to("meta") for t in v] if isinstance(v, list)
                else v) for k, v in args.items()}
    out = torch.ops.fused_attn.gpt2_decode_step(**meta)
    assert out.shape == (2, CONFIG["vocab_size"]) and out.device.type == "meta"


def _bad(args, **change):
    return {**args, **change}


BAD = [
    ("eps", lambda a: _bad(a, eps=-1.0), r"eps must be a float >= 0, got -1.0"),
    ("wte dtype", lambda a: _bad(a, wte=a["wte"].long()), r"wte must have dtype float32, float16, bfloat16 or float64 "
                                                          r"\(CPU\), got torch.int64"),
    ("width", lambda a: _bad(a, wte=a["wte"][:, :128].contiguous()),
     r"wte must have n_embd a multiple of 256 up to 1024, got \(1000, 128\)"),
    ("wpe", lambda a: _bad(a, wpe=a["wpe"][:, :128].contiguous()),
     r"wpe must be a contiguous \[n_positions, 256\] tensor of wte's dtype and device, got \(128, 128\)"),
    ("layers count", lambda a: _bad(a, layers=a["layers"][:11]),
     r"layers must hold 12 tensors a layer for 1 to 48 layers, got 11 tensors"),
    ("layer shape", lambda a: _bad(a, layers=[a["layers"][0], a["layers"][1], a["layers"][2].t().contiguous(),
                                             *a["layers"][3:]]),
     r"layers must hold contiguous tensors of wte's dtype and device, tensor 2 of shape \(768, 256\), "
     r"got \(256, 768\)"),
    ("lnf_b", lambda a: _bad(a, lnf_b=a["lnf_b"][:8]), r"lnf_b must be a contiguous \[256\] tensor"),
    ("token dtype", lambda a: _bad(a, token=a["token"].int()),
     r"token must be a contiguous int64 \[batch\] tensor on wte's device, got \(2,\) torch.int32"),
    ("pos shape", lambda a: _bad(a, pos=a["pos"][:1]), r"pos must be an int32 \[2\] tensor on wte's device, got \(1,\)"),
    ("seqlens dtype", lambda a: _bad(a, seqlens=a["seqlens"].long()),
     r"seqlens must be an int32 \[2\] tensor on wte's device, got \(2,\) torch.int64"),
    ("k_cache", lambda a: _bad(a, k_cache=a["k_cache"][:1].contiguous()),
     r"k_cache must be a contiguous \[3, 2, 4, max_len, 64\] tensor of wte's dtype and device, got \(1, 2, 4, 8, 64\)"),
    ("v_cache", lambda a: _bad(a, v_cache=a["v_cache"][..., :4, :].contiguous()),
     r"v_cache must have k_cache's shape \(3, 2, 4, 8, 64\), got \(3, 2, 4, 4, 64\)"),
    ("workspace", lambda a: _bad(a, workspace=a["workspace"][:16]),
     r"workspace must be a contiguous uint8 tensor of at least \d+ bytes on wte's device, got \(16,\)"),
    ("token type", lambda a: _bad(a, token=[1, 2]), r"token must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("make,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise(make, match):
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float32)
    cache = prefilled(model, (4, 3), 8)
    with pytest.raises((ValueError, TypeError), match=match):
        gpt2_decode_step(**make(step_args(model, cache)))


def test_lengths_out_of_range_raise_cpu():
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float32)
    cache = prefilled(model, (4, 3), 8)
    args = step_args(model, cache)
    args["seqlens"][1] = 8
    with pytest.raises(ValueError, match=r"seqlens must be in \[leftpad, max_len - 1\] = \[1, 7\] for the new slot, "
                                         r"got seqlens\[1\] = 8"):
        gpt2_decode_step(**args)


def test_requires_grad_raises():
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float32)
    cache = prefilled(model, (4,), 8)
    args = step_args(model, cache)
    args["lnf_w"].requires_grad_(True)
    with pytest.raises(ValueError, match=r"lnf_w must not require grad"):
        gpt2_decode_step(**args)


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [CONFIG, CONFIG_768], ids=["c256", "c768"])
@pytest.mark.parametrize("lengths", [(9,), (9, 5), (30, 21, 2, 17)])
def test_logits_and_cache_match_the_float64_step_gpu(dtype, config, lengths):
    """Logits against the float64 module step, error at most twice the launch chain's at the same dtype; the
    appended keys / values against the chain's, and nothing else in the caches written."""
    ref = GPT2.from_hf(hf_model(config), dtype=torch.float64, device="cuda", backends={"attention": "eager"})
    model = GPT2.from_hf(hf_model(config), dtype=dtype, device="cuda", backends=gpt2_mod_graph_fused())
    cache64 = prefilled(ref, lengths, 40)
    cache = prefilled(model, lengths, 40)
    args = step_args(model, cache)
    before_k = args["k_cache"].clone()
    logits = gpt2_decode_step(**args)
    want = module_step(ref, cache64)
    chain = module_step(model, cache)  # the launch chain (this cache has no step workspace)
    assert_error_at_most_twice(logits, chain, want, 2e-3, f"{dtype} {lengths}")
    slot = args["seqlens"].long()
    for b in range(len(lengths)):
        assert_error_at_most_twice(args["k_cache"][:, b, :, slot[b]], cache.k[:, b, :, slot[b]],
                                   cache64.k[:, b, :, slot[b]], 2e-3, f"keys of row {b}")
        before_k[:, b, :, slot[b]] = args["k_cache"][:, b, :, slot[b]]
    assert torch.equal(args["k_cache"], before_k)  # nothing but the new slots


def gpt2_mod_graph_fused():
    from fused_attn.generate import GRAPH_BACKENDS

    return GRAPH_BACKENDS["graph-fused"]


@pytest.mark.gpu
def test_bad_device_lengths_give_nan_and_write_nothing_gpu():
    model = GPT2.from_hf(hf_model(CONFIG), dtype=torch.float16, device="cuda", backends=gpt2_mod_graph_fused())
    cache = prefilled(model, (9, 5, 3), 16)
    args = step_args(model, cache)
    args["seqlens"][1] = 16    # past the cache
    args["token"][2] = 5000    # past the vocabulary
    k, v = args["k_cache"].clone(), args["v_cache"].clone()
    logits = gpt2_decode_step(**args)
    assert torch.isnan(logits[1]).all() and torch.isnan(logits[2]).all() and not torch.isnan(logits[0]).any()
    assert torch.equal(args["k_cache"][:, 1], k[:, 1]) and torch.equal(args["v_cache"][:, 1], v[:, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(40,), (40, 29, 13)])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_generate_tokens_equal_the_launch_chain_gpu(dtype, lengths, sampling, monkeypatch):
    """generate() with the step in one launch: graph-captured and eager give the same tokens for 96 new tokens,
    greedy and sampled with the same seed; float16 greedy tokens equal the launch chain's. (Elsewhere the two
    paths' logits differ by their roundings, e.g. the chain folds ln_1 into c_attn unrounded at one row, and a
    sampled or bfloat16 sequence parts at the first near tie: the logits' error is what the test above holds
    to twice the chain's.)"""
    model = GPT2.from_hf(hf_model(CONFIG_768), dtype=dtype, device="cuda", backends=gpt2_mod_graph_fused())
    ids, mask = left_padded(CONFIG_768["vocab_size"], lengths, "cuda")
    assert model.megakernel_applies(len(lengths))
    one = model.generate(ids, mask, max_new_tokens=96, seed=3, **sampling)
    assert model._caches and all(c.step_workspace is not None for c in model._caches.values())
    eager = model.generate(ids, mask, max_new_tokens=96, seed=3, use_graph=False, **sampling)
    monkeypatch.setattr(gpt2_mod, "MEGAKERNEL_MAX_ROWS", 0)
    chain_model = GPT2.from_hf(hf_model(CONFIG_768), dtype=dtype, device="cuda", backends=gpt2_mod_graph_fused())
    chain = chain_model.generate(ids, mask, max_new_tokens=96, seed=3, **sampling)
    assert all(c.step_workspace is None for c in chain_model._caches.values())
    assert torch.equal(one, eager)
    if dtype == torch.float16 and not sampling:
        assert torch.equal(one, chain)
