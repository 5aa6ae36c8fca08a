"""qkv_decode_attention at non-default values (eps, scale, b_qkv, cache_leftpad, several sequences of
different lengths) against the chain written here with PyTorch's functionals: ``F.layer_norm``,
``F.linear`` and ``F.scaled_dot_product_attention`` over each sequence's visible slots, independent of
``fused_attn.reference``; the caches after the append included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_attn import qkv_decode_attention

B, HEADS, HD, MAX_LEN = 2, 2, 64, 8
D = HEADS * HD


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * s

    x = r(B, 1, D) * 3 + 1
    return x, r(3 * D, D, s=0.2), r(3 * D), r(B, HEADS, MAX_LEN, HD), r(B, HEADS, MAX_LEN, HD)


def _chain(x, w, b, k_cache, v_cache, seqlens, leftpad, eps, scale):
    qkv = F.linear(F.layer_norm(x, (D,), eps=eps), w, b)[:, 0]  # [B, 3 D]: q rows, k rows, v rows
    q, k, v = (t.reshape(B, HEADS, HD) for t in qkv.split(D, -1))
    k_all, v_all = k_cache.clone(), v_cache.clone()
    out = torch.empty(B, 1, D, dtype=x.dtype)
    for i in range(B):
        k_all[i, :, seqlens[i]] = k[i]
        v_all[i, :, seqlens[i]] = v[i]
        keys = slice(leftpad[i], seqlens[i] + 1)
        o = F.scaled_dot_product_attention(q[i][:, None], k_all[i, :, keys], v_all[i, :, keys], scale=scale)
        out[i, 0] = o.reshape(D)
    return out, k_all, v_all


@pytest.mark.parametrize("eps, scale, bias", [(0.5, 0.2, True), (1e-5, None, False), (2.0, 0.05, True)])
def test_matches_layer_norm_linear_and_sdpa(eps, scale, bias):
    x, w, b, k_cache, v_cache = _inputs()
    seqlens, leftpad = [5, 2], [1, 0]
    want, k_want, v_want = _chain(x, w, b if bias else None, k_cache, v_cache, seqlens, leftpad, eps,
                                  HD ** -0.5 if scale is None else scale)
    got = qkv_decode_attention(x, w, b if bias else None, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32),
                               torch.tensor(leftpad, dtype=torch.int32), eps=eps, scale=scale)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(k_cache, k_want)
    torch.testing.assert_close(v_cache, v_want)


def test_default_eps_is_1e_5():
    """x of magnitude 1e-3: eps 1e-5 and 1e-6 normalize it very differently."""
    x, w, b, k_cache, v_cache = _inputs()
    x = (x - x.mean(-1, keepdim=True)) * 1e-3
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    got = qkv_decode_attention(x, w, b, k_cache.clone(), v_cache.clone(), seqlens)
    want, _, _ = _chain(x, w, b, k_cache, v_cache, [3, 4], [0, 0], 1e-5, HD ** -0.5)
    other, _, _ = _chain(x, w, b, k_cache, v_cache, [3, 4], [0, 0], 1e-6, HD ** -0.5)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, other, rtol=1e-2)
