"""The "fused_attn" attention implementation inside Hugging Face GPT-2: same logits, same tokens."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fused_attn.hf as fhf  # noqa: E402
from tests.prompts import left_padded  # noqa: E402

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=1)
SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)  # GPT-2 small's shape


def models(config: dict, device, dtype=torch.float32, impls=("eager", "fused_attn")):
    fhf.register()
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(**config)).eval().to(device, dtype)
    out = {}
    for impl in impls:
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        out[impl] = m
    return out


def test_register_is_idempotent_and_named():
    fhf.register()
    fhf.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["fused_attn"] is fhf.fused_attention_forward
    assert "fused_attn" in AttentionMaskInterface._global_mapping


def test_the_fused_op_is_what_runs(monkeypatch):
    calls = []
    real = fhf.scaled_masked_softmax

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fhf, "scaled_masked_softmax", counting)
    m = models(TINY, "cpu", impls=("fused_attn",))["fused_attn"]
    ids, mask = left_padded(TINY["vocab_size"], (24, 17, 9), "cpu")
    m(ids, attention_mask=mask)
    assert len(calls) == TINY["n_layer"]
    assert calls[0]["attn_mask"] is not None and calls[0]["attn_mask"].dtype == torch.bool  # padding reached us
    calls.clear()
    m(ids[:1])
    assert calls[0]["attn_mask"] is None and calls[0]["causal"] is True


@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_logits_match_eager_cpu(lengths):
    ms = models(TINY, "cpu")
    ids, mask = left_padded(TINY["vocab_size"], lengths, "cpu")
    want = ms["eager"](ids, attention_mask=mask).logits
    got = ms["fused_attn"](ids, attention_mask=mask).logits
    keep = mask.bool()  # logits of pad positions are not defined the same way
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_greedy_tokens_identical_cpu(lengths, cache):
    ms = models(TINY, "cpu")
    ids, mask = left_padded(TINY["vocab_size"], lengths, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ms["eager"].generate(ids, **kw)
    got = ms["fused_attn"].generate(ids, **kw)
    assert got.shape[1] == ids.shape[1] + 64
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(40,), (40, 29, 13)])
def test_greedy_tokens_identical_gpt2_small_gpu(lengths):
    ms = models(SMALL, "cuda")
    ids, mask = left_padded(SMALL["vocab_size"], lengths, "cuda")
    kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = ms["eager"].generate(ids, **kw)
    got = ms["fused_attn"].generate(ids, **kw)
    assert torch.equal(got, want)
    logits_e = ms["eager"](want, attention_mask=torch.ones_like(want)).logits
    logits_f = ms["fused_attn"](want, attention_mask=torch.ones_like(want)).logits
    torch.testing.assert_close(logits_f, logits_e, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_error_at_most_twice_sdpa_gpu(dtype):
    ref = models(SMALL, "cuda", torch.float32, impls=("eager",))["eager"]
    low = models(SMALL, "cuda", dtype, impls=("sdpa", "fused_attn"))
    ids, mask = left_padded(SMALL["vocab_size"], (24, 17, 9), "cuda")
    keep = mask.bool()
    want = ref(ids, attention_mask=mask).logits[keep].double()
    err = {k: (m(ids, attention_mask=mask).logits[keep].double() - want).abs().max().item() for k, m in low.items()}
    assert err["fused_attn"] <= 2 * err["sdpa"] + 1e-3, err
