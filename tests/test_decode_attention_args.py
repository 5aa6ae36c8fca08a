"""decode_attention: every argument at a non-default value (k_new / v_new appending several new
tokens, cache_seqlens, cache_leftpad, key_mask, scale, num_splits, validate, out, grouped heads)
checked against a definition written here query by query with ``F.scaled_dot_product_attention``
(independent of ``fused_attn.reference``, which the CPU path runs), and a bad-input row for each of
key_mask's requirements on the CPU and meta paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_attn import decode_attention

B, HQ, HKV, SN, MAX_LEN, D = 2, 4, 2, 3, 12, 8
SCALE = 0.41  # not D ** -0.5 = 0.354


def _inputs(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    return r(B, HQ, SN, D) * 2, r(B, HKV, MAX_LEN, D) * 2, r(B, HKV, MAX_LEN, D), r(B, HKV, SN, D) * 2, r(B, HKV, SN, D)


def _plain(q, k_cache, v_cache, seqlens, k_new, v_new, leftpad, key_mask, scale):
    """Query i of sequence b (of the SN new ones) attends to slots leftpad[b] .. seqlens[b] + i of the
    cache after the new keys are written at seqlens[b] ...: the causal rule among the new tokens,
    one query at a time."""
    k_all, v_all = k_cache.clone(), v_cache.clone()
    if k_new is not None:
        for b in range(B):
            for t in range(SN):
                k_all[b, :, seqlens[b] + t] = k_new[b, :, t]
                v_all[b, :, seqlens[b] + t] = v_new[b, :, t]
    out = torch.zeros_like(q)
    for b in range(B):
        for i in range(SN):
            last = seqlens[b] + i if k_new is not None else seqlens[b] - SN + i
            slots = [j for j in range(leftpad[b], last + 1) if key_mask is None or key_mask[b, j]]
            if slots:
                out[b, :, i:i + 1] = F.scaled_dot_product_attention(
                    q[b:b + 1, :, i:i + 1], k_all[b:b + 1, :, slots], v_all[b:b + 1, :, slots], scale=scale,
                    enable_gqa=True)[0]
    return out, k_all, v_all


@pytest.mark.parametrize("appended", [True, False])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_append_leftpad_key_mask_scale_match_the_plain_definition(appended, num_splits):
    q, k_cache, v_cache, k_new, v_new = _inputs()
    seqlens, leftpad = [4, 7], [1, 3]
    if not appended:
        seqlens = [7, 9]
    key_mask = torch.rand(B, MAX_LEN, generator=torch.Generator().manual_seed(2)) > 0.3
    want, k_want, v_want = _plain(q, k_cache, v_cache, seqlens, k_new if appended else None, v_new, leftpad,
                                  key_mask, SCALE)
    out = torch.full_like(q, float("nan")) if num_splits == 3 else None  # both ops: with and without out=
    got = decode_attention(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32),
                           k_new=k_new if appended else None, v_new=v_new if appended else None,
                           cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), key_mask=key_mask, scale=SCALE,
                           num_splits=num_splits, out=out, validate=True)
    assert out is None or got is out
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(k_cache, k_want)
    torch.testing.assert_close(v_cache, v_want)


def test_each_argument_changes_the_output():
    """Each of scale, cache_leftpad, key_mask and the new tokens' causal rule moves the result: the
    test above would catch a kernel that ignores any of them."""
    q, k_cache, v_cache, k_new, v_new = _inputs(dtype=torch.float32)
    seqlens = torch.tensor([4, 7], dtype=torch.int32)

    def run(**kw):
        return decode_attention(q, k_cache.clone(), v_cache.clone(), seqlens, k_new=k_new, v_new=v_new, **kw)

    base = run()
    mask = torch.ones(B, MAX_LEN, dtype=torch.bool)
    mask[:, 2] = False
    for kw in (dict(scale=SCALE), dict(cache_leftpad=[1, 3]), dict(key_mask=mask)):
        assert not torch.allclose(run(**kw), base, atol=1e-3), kw
    plain, _, _ = _plain(q, k_cache, v_cache, seqlens.tolist(), k_new, v_new, [0, 0], None, D ** -0.5)
    torch.testing.assert_close(base, plain, atol=2e-6, rtol=2e-5)
    # Without the causal rule among the new tokens, the first new query would see the two after it.
    unmasked, _, _ = _plain(q, k_cache, v_cache, [s + SN - 1 for s in seqlens.tolist()], None, None, [0, 0], None,
                            D ** -0.5)
    assert not torch.allclose(base[:, :, 0], unmasked[:, :, -1], atol=1e-3)


def test_no_cache_seqlens_attends_to_every_slot():
    """cache_seqlens None: every slot holds a key, the last query sees all of them."""
    q, k_cache, v_cache, _, _ = _inputs()
    got = decode_attention(q, k_cache, v_cache, None, scale=SCALE)
    want, _, _ = _plain(q, k_cache, v_cache, [MAX_LEN] * B, None, None, [0, 0], None, SCALE)
    torch.testing.assert_close(got, want)
    last = F.scaled_dot_product_attention(q[:, :, -1:], k_cache, v_cache, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(got[:, :, -1:], last)


def test_a_one_row_key_mask_applies_to_every_sequence():
    q, k_cache, v_cache, _, _ = _inputs()
    mask = torch.ones(1, MAX_LEN, dtype=torch.bool)
    mask[0, 5:8] = False
    got = decode_attention(q, k_cache, v_cache, [10, 12], key_mask=mask, scale=SCALE)
    want, _, _ = _plain(q, k_cache, v_cache, [10, 12], None, None, [0, 0], mask.expand(B, MAX_LEN), SCALE)
    torch.testing.assert_close(got, want)


def _good(device):
    q = torch.zeros(2, 4, 1, 8, device=device)
    k = torch.zeros(2, 2, 16, 8, device=device)
    return q, k, k.clone(), torch.tensor([3, 4], dtype=torch.int32, device=device)


_OTHER = {"cpu": "meta", "meta": "cpu"}
KEY_MASK_ROWS = [  # (id, key_mask(device), exception, message)
    ("type", lambda d: [[True] * 16] * 2, TypeError, r"key_mask must be a torch.Tensor or None, got list"),
    ("dtype", lambda d: torch.ones(2, 16, device=d), ValueError,
     r"key_mask must have dtype torch.bool \(True = attend\), got torch.float32"),
    ("device", lambda d: torch.ones(2, 16, dtype=torch.bool, device=_OTHER[d]), ValueError,
     r"key_mask must be on the same device as q \((cpu|meta)\), got (meta|cpu)"),
    ("batch", lambda d: torch.ones(3, 16, dtype=torch.bool, device=d), ValueError,
     r"key_mask must have shape \(batch or 1, max_len\) = \(2 or 1, 16\), got \(3, 16\)"),
    ("max_len", lambda d: torch.ones(2, 15, dtype=torch.bool, device=d), ValueError,
     r"key_mask must have shape \(batch or 1, max_len\) = \(2 or 1, 16\), got \(2, 15\)"),
    ("dims", lambda d: torch.ones(2, 1, 1, 16, dtype=torch.bool, device=d), ValueError,
     r"key_mask must have shape \(batch or 1, max_len\) = \(2 or 1, 16\), got \(2, 1, 1, 16\)"),
    ("stride", lambda d: torch.ones(16, 2, dtype=torch.bool, device=d).t(), ValueError,
     r"key_mask must have a contiguous last dim \(stride 1\), got strides \(1, 2\)"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name,mask,exc,match", KEY_MASK_ROWS, ids=[r[0] for r in KEY_MASK_ROWS])
def test_bad_key_mask_is_named(device, name, mask, exc, match):
    q, k, v, s = _good(device)
    with pytest.raises(exc, match=match):
        decode_attention(q, k, v, s, key_mask=mask(device))
    if name == "type":
        return  # the op's schema takes only a tensor
    with pytest.raises(exc, match=match):  # the op itself (fake kernel on meta, CPU kernel on the CPU)
        torch.ops.fused_attn.decode_attention(q, k, v, s, None, None, None, mask(device), None, 0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("seqlens", [[3, 3], torch.tensor([3, 3]), 3])
def test_three_dim_q_is_named_before_the_lengths(device, seqlens):
    """q's batch size is what cache_seqlens is checked against: a 3-dim q must be blamed, not them."""
    _, k, v, _ = _good(device)
    with pytest.raises(ValueError, match=r"q must have 4 dims \[batch, nheads_q, seqlen_new, headdim\], got \(4, 1, 8\)"):
        decode_attention(torch.zeros(4, 1, 8, device=device), k, v, seqlens)
