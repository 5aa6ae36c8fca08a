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
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


# --------------------------------------------------------------------------- the op on the CPU

from fused_attn.attention import Attention, attention  # noqa: E402


def test_cpu_path_matches_definition_with_lse_and_out():
    q, k, v = make_qkv(2, 6, 2, 7, 11, 16, torch.float32, "cpu", 5)
    mask = make_mask("additive_key", 2, 6, 7, 11, torch.float32, "cpu", 5)
    want, want_lse = reference.attention(q, k, v, causal=True, attn_mask=mask)
    out, lse = attention(q, k, v, causal=True, attn_mask=mask, return_lse=True)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    buf = torch.full_like(q, math.nan)
    got, lse2 = attention(q, k, v, causal=True, attn_mask=mask, out=buf, return_lse=True)
    assert got is buf
    torch.testing.assert_close(buf, out)
    torch.testing.assert_close(lse2, lse)
    torch.testing.assert_close(Attention(causal=True)(q, k, v, mask), out)


def test_strided_views_of_a_fused_projection():
    """Hugging Face's layout: q, k, v are [B, H, S, D] views of one [B, S, 3 H D] projection."""
    b, s, h, d = 2, 9, 4, 8
    x = torch.randn(b, s, 3 * h * d, dtype=torch.float64)
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.split(h * d, dim=-1))
    assert not q.is_contiguous()
    torch.testing.assert_close(attention(q, k, v, causal=True),
                               reference.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "additive_full", "bool_key"])
def test_gradcheck_cpu_float64(causal, mask):
    q, k, v = make_qkv(1, 4, 2, 5, 6, 8, torch.float64, "cpu", 11)
    m = make_mask(mask, 1, 4, 5, 6, torch.float64, "cpu", 11, share=0.2)
    if m is not None and m.dtype != torch.bool:
        m = m.nan_to_num(neginf=-3.0).requires_grad_(True)  # a finite additive mask: differentiable everywhere
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    inputs = (q, k, v) + ((m,) if m is not None and m.requires_grad else ())

    def f(q, k, v, *rest):
        out, lse = attention(q, k, v, causal=causal, attn_mask=rest[0] if rest else m, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, inputs)


def test_gradient_of_fully_masked_rows_is_zero():
    q, k, v = make_qkv(1, 1, 1, 3, 2, 8, torch.float64, "cpu", 2)
    q.requires_grad_(True)
    out = attention(q, k, v, causal=True)  # Sq = 3 > Sk = 2: row 0 sees nothing
    out.sum().backward()
    assert q.grad[:, :, 0].eq(0).all() and torch.isfinite(q.grad).all()


def test_opcheck_cpu_and_meta():
    q, k, v = make_qkv(1, 4, 2, 5, 6, 8, torch.float32, "cpu", 3)
    mask = make_mask("bool_key", 1, 4, 5, 6, torch.float32, "cpu", 3)
    torch.library.opcheck(torch.ops.fused_attn.attention.default, (q, k, v, mask, 0.5),
                          {"causal": True, "mode": "auto", "return_lse": True})
    out, lse = torch.ops.fused_attn.attention(q.to("meta"), k.to("meta"), v.to("meta"), None, None,
                                              return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 4, 5) and lse.dtype == torch.float32


def test_out_refuses_inputs_that_require_grad():
    q, k, v = make_qkv(1, 2, 2, 3, 3, 8, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match=r"out must be None when q, k, v or attn_mask requires grad"):
        attention(q.requires_grad_(True), k, v, out=torch.empty_like(q))


def _qkv(hq=4, hkv=2, sq=5, sk=6, d=8, dtype=torch.float32):
    return make_qkv(2, hq, hkv, sq, sk, d, dtype, "cpu", 0)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: attention(q, k[..., :4], v[..., :4]), ValueError, r"k must have q's headdim \(8\), got \(2, 2, 6, 4\)"),
    (lambda q, k, v: attention(q, k, v[:, :, :5]), ValueError, r"v must have k's shape \(2, 2, 6, 8\), got \(2, 2, 5, 8\)"),
    (lambda q, k, v: attention(q[:, :3], k, v), ValueError, r"q must have nheads_q a multiple of k's nheads_kv \(2\), got 3"),
    (lambda q, k, v: attention(q, k[:1], v[:1]), ValueError, r"k must have q's batch size \(2\), got \(1, 2, 6, 8\)"),
    (lambda q, k, v: attention(q[0], k, v), ValueError, r"q must have 4 dims \[batch, nheads_q, seqlen_q, headdim\], got \(4, 5, 8\)"),
    (lambda q, k, v: attention(q, k.half(), v), ValueError, r"k must have q's dtype \(torch.float32\), got torch.float16"),
    (lambda q, k, v: attention(q, k, v.to("meta")), ValueError, r"v must be on the same device as q \(cpu\), got meta"),
    (lambda q, k, v: attention(q.int(), k, v), ValueError, r"q must have dtype float32, float16, bfloat16 or float64 \(CPU\), got torch.int32"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.ones(3, 6, dtype=torch.bool)), ValueError,
     r"attn_mask must be broadcastable to \(2, 4, 5, 6\), got \(3, 6\)"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.ones(1, 2, 4, 5, 6, dtype=torch.bool)), ValueError,
     r"attn_mask must be broadcastable to \(2, 4, 5, 6\), got \(1, 2, 4, 5, 6\)"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.float16)), ValueError,
     r"attn_mask must have dtype bool or q's dtype \(torch.float32\), got torch.float16"),
    (lambda q, k, v: attention(q, k, v, attn_mask=[1]), TypeError, r"attn_mask must be a torch.Tensor or None, got list"),
    (lambda q, k, v: attention(q, k, v, mode="fast"), ValueError, r"mode must be 'auto', 'naive' or 'flash', got 'fast'"),
    (lambda q, k, v: attention(q, k, v, mode="tiled"), NotImplementedError, r"mode must be .*'tiled' is planned in issue 14.*got 'tiled'"),
    (lambda q, k, v: attention(q, k, v, causal=1), TypeError, r"causal must be a bool, got 1"),
    (lambda q, k, v: attention(q, k, v, scale=float("nan")), ValueError, r"scale must be a finite number, got nan"),
    (lambda q, k, v: attention(q, k, v, return_lse=None), TypeError, r"return_lse must be a bool, got None"),
    (lambda q, k, v: attention(q, k, v, out=torch.empty(2, 4, 5, 7)), ValueError, r"out must have q's shape \(2, 4, 5, 8\), got \(2, 4, 5, 7\)"),
    (lambda q, k, v: attention("q", k, v), TypeError, r"q must be a torch.Tensor, got str"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(*_qkv())


def test_flash_rules_on_meta_tensors():
    """The CUDA-only rules (dtype and head dim of mode='flash') are checked by the fake kernel too, so
    torch.compile reports them at trace time; meta tensors stand in for CUDA ones here."""
    q, k, v = (torch.empty(1, 2, 4, d, device="meta", dtype=torch.float16) for d in (12, 12, 12))
    with pytest.raises(ValueError, match=r"q must have a headdim that is a multiple of 8 in \[8, 256\] for mode='flash', got 12"):
        attention(q, k, v, mode="flash")
    q, k, v = (torch.empty(1, 2, 4, 8, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match=r"q must have dtype float16 or bfloat16 for mode='flash', got torch.float32"):
        attention(q, k, v, mode="flash")
    q, k, v = (torch.empty(1, 2, 4, 264, device="meta", dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"q must have a headdim that is a multiple of 8 in \[8, 256\] for mode='flash', got 264"):
        attention(q, k, v, mode="flash")
    assert attention(q, k, v, mode="naive").shape == q.shape  # naive takes any head dim
