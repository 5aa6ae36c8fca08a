"""attention: every argument at a non-default value, checked against PyTorch's own
``F.scaled_dot_product_attention`` (an implementation independent of ``fused_attn.reference``, which
the CPU path runs): a custom scale and the causal rule under autograd, grouped-query heads, masks,
``return_lse=False`` through opcheck and torch.compile, and ``out=``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_attn import Attention, attention

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 3, 5, 8
SCALE = 0.37  # not D ** -0.5 = 0.354: a kernel that ignores it is 4% off in the exponent


def _qkv(seed=0, dtype=torch.float64, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, SQ, D, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(B, HKV, SK, D, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(B, HKV, SK, D, generator=gen, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]


def _bottom_right(sq, sk):
    """Query i sees key j iff j <= i + sk - sq, written out pair by pair."""
    return torch.tensor([[j <= i + sk - sq for j in range(sk)] for i in range(sq)])


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _key_mask(seed=1):
    keep = torch.rand(B, 1, 1, SK, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[..., 0] = True  # every row keeps a key (SDPA gives NaN on an empty row)
    return keep


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_scale_causal_gqa_mask_forward_and_grad_match_sdpa(causal, with_mask):
    q, k, v = _qkv(grad=True)
    mask = _key_mask() if with_mask else None
    want_mask = mask
    if causal:
        want_mask = _bottom_right(SQ, SK) if mask is None else mask & _bottom_right(SQ, SK)
    got = attention(q, k, v, causal=causal, attn_mask=mask, scale=SCALE)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v), g)
    want = _sdpa(q, k, v, want_mask, SCALE)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    torch.testing.assert_close(got, want)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"d{n}: {m}")


def test_additive_mask_gradient_matches_sdpa():
    q, k, v = _qkv()
    bias = torch.randn(SQ, SK, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_(True)
    got = attention(q, k, v, attn_mask=bias, scale=SCALE)
    (got_db,) = torch.autograd.grad(got.square().sum(), bias)
    want = _sdpa(q, k, v, bias, SCALE)
    (want_db,) = torch.autograd.grad(want.square().sum(), bias)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_db, want_db)


def test_lse_with_scale_is_the_log_sum_exp_of_the_scaled_scores():
    q, k, v = _qkv()
    _, lse = attention(q, k, v, scale=SCALE, return_lse=True)
    s = q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) * SCALE
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


@pytest.mark.parametrize("mode", ["auto", "naive", "tiled", "flash"])
def test_every_mode_on_the_cpu_matches_sdpa(mode):
    q, k, v = _qkv(dtype=torch.float32)
    got = attention(q, k, v, causal=True, scale=SCALE, mode=mode)
    torch.testing.assert_close(got, _sdpa(q, k, v, _bottom_right(SQ, SK), SCALE), atol=2e-6, rtol=2e-5)


def test_return_lse_false_through_opcheck_and_compile():
    q, k, v = _qkv(dtype=torch.float32)
    mask = _key_mask()
    torch.library.opcheck(torch.ops.fused_attn.attention.default, (q, k, v, mask, SCALE),
                          {"causal": True, "algo": "auto", "return_lse": False})
    out, lse = torch.ops.fused_attn.attention(q, k, v, mask, SCALE, causal=True, return_lse=False)
    assert lse.numel() == 0
    f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, attn_mask=mask, scale=SCALE), fullgraph=True)
    want = _sdpa(q, k, v, mask & _bottom_right(SQ, SK), SCALE)
    torch.testing.assert_close(f(q, k, v), want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


def test_out_with_scale_and_mask_matches_sdpa():
    q, k, v = _qkv(dtype=torch.float32)
    mask = _key_mask()
    out = torch.full_like(q, float("nan"))
    res, lse = attention(q, k, v, attn_mask=mask, scale=SCALE, out=out, return_lse=True)
    assert res is out
    torch.testing.assert_close(out, _sdpa(q, k, v, mask, SCALE), atol=2e-6, rtol=2e-5)
    s = (q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_attention_module_passes_its_arguments():
    q, k, v = _qkv(dtype=torch.float32)
    got = Attention(causal=True, scale=SCALE)(q, k, v)
    torch.testing.assert_close(got, _sdpa(q, k, v, _bottom_right(SQ, SK), SCALE), atol=2e-6, rtol=2e-5)
