"""attention: the float64 definition and the FlashAttention-2 algorithm in PyTorch
(``fused_attn.reference``), the public op's CPU path, fake kernel, gradients and argument errors, and on
a GPU the ``flash`` and ``naive`` kernels against the float64 definition (flash-attention's rule: our
error at most twice PyTorch's own at the same dtype), poisoned outputs, opcheck, torch.compile and CUDA
graphs. The spec is the docstring of ``fused_attn.attention.attention``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn import reference

MASK_FORMS = [None, "bool_key", "bool_full", "bool_head", "additive_key", "additive_full", "additive_query"]


def mask_shape(form: str, b: int, h: int, sq: int, sk: int) -> tuple[int, ...]:
    """Each broadcast form of [batch, nheads_q, seqlen_q, seqlen_k] a caller passes."""
    return {"key": (b, 1, 1, sk), "full": (b, h, sq, sk), "head": (1, h, 1, sk), "query": (sq, sk)}[form.split("_")[1]]


def make_mask(form, b, h, sq, sk, dtype, device, seed, share=0.3):
    """A bool mask (True = attend) with ``share`` of the keys masked, or an additive one (0 / -inf / a
    finite bias); None for no mask."""
    if form is None:
        return None
    gen = torch.Generator().manual_seed(seed + 7)
    shape = mask_shape(form, b, h, sq, sk)
    keep = torch.rand(shape, generator=gen) >= share
    if form.startswith("bool"):
        return keep.to(device)
    bias = torch.randn(shape, generator=gen) * 2
    return torch.where(keep, bias, float("-inf")).to(device=device, dtype=dtype)


def make_qkv(b, hq, hkv, sq, sk, d, dtype, device, seed, mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen, dtype=torch.float64) * mag
    k = torch.randn(b, hkv, sk, d, generator=gen, dtype=torch.float64) * mag
    v = torch.randn(b, hkv, sk, d, generator=gen, dtype=torch.float64)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def sdpa_definition(q, k, v, causal, attn_mask, scale):
    """PyTorch's SDPA (math) in float64 with the causal mask spelled out bottom-right: an independent
    check of the reference. SDPA gives NaN on fully masked rows where ours gives 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = attn_mask
    if causal:
        cm = reference.causal_mask(q.shape[2], k.shape[2], q.device)
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask & cm
        else:
            mask = mask.masked_fill(~cm, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).nan_to_num(0.0)


# --------------------------------------------------------------------------- the references (CPU)


@st.composite
def small_case(draw):
    hkv = draw(st.integers(1, 2))
    return dict(
        b=draw(st.integers(1, 2)), hkv=hkv, group=draw(st.sampled_from([1, 2, 3])),
        sq=draw(st.integers(1, 40)), sk=draw(st.integers(0, 40)), d=draw(st.sampled_from([1, 8, 16])),
        causal=draw(st.booleans()), mask=draw(st.sampled_from(MASK_FORMS)),
        block_q=draw(st.sampled_from([1, 7, 16, 64])), block_k=draw(st.sampled_from([1, 5, 16, 64])),
        scale=draw(st.one_of(st.none(), st.floats(-2, 2))), mag=draw(st.sampled_from([1.0, 10.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(small_case())
@example(dict(b=1, hkv=1, group=1, sq=5, sk=3, d=8, causal=True, mask=None, block_q=2, block_k=2, scale=None,
              mag=1.0, seed=0)).via("seqlen_q > seqlen_k causal: the first rows see nothing")
@example(dict(b=2, hkv=2, group=3, sq=17, sk=31, d=16, causal=True, mask="bool_full", block_q=16, block_k=5,
              scale=None, mag=10.0, seed=1)).via("GQA, Sq != Sk, bool mask and causal")
def test_flash_algorithm_matches_definition(case):
    c = case
    hq = c["hkv"] * c["group"]
    q, k, v = make_qkv(c["b"], hq, c["hkv"], c["sq"], c["sk"], c["d"], torch.float64, "cpu", c["seed"], c["mag"])
    mask = make_mask(c["mask"], c["b"], hq, c["sq"], c["sk"], torch.float64, "cpu", c["seed"])
    want, want_lse = reference.attention(q, k, v, causal=c["causal"], attn_mask=mask, scale=c["scale"])
    got, lse = reference.flash_attention_forward(q, k, v, causal=c["causal"], attn_mask=mask, scale=c["scale"],
                                                 block_q=c["block_q"], block_k=c["block_k"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    if c["sk"] > 0:
        torch.testing.assert_close(want, sdpa_definition(q, k, v, c["causal"], mask, c["scale"]), rtol=1e-10,
                                   atol=1e-12)


def test_definition_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v = make_qkv(1, 2, 1, 4, 3, 8, torch.float64, "cpu", 0)
    mask = torch.ones(1, 1, 4, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    out, lse = reference.attention(q, k, v, attn_mask=mask)
    assert out[:, :, 1].eq(0).all() and lse[:, :, 1].eq(float("-inf")).all()
    assert torch.isfinite(lse[:, :, [0, 2, 3]]).all()
    out, lse = reference.attention(q, k, v, causal=True)  # Sq = 4 > Sk = 3: row 0 sees nothing
    assert out[:, :, 0].eq(0).all() and lse[:, :, 0].eq(float("-inf")).all()


def test_definition_lse_is_logsumexp_of_scores():
    q, k, v = make_qkv(2, 4, 2, 6, 9, 16, torch.float64, "cpu", 3)
    _, lse = reference.attention(q, k, v, scale=0.3)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float())
