"""attention: the float64 definition and the FlashAttention-2 algorithm in PyTorch
(``fused_attn.reference``), the public op's CPU path, fake kernel, gradients and argument errors, and on
a GPU the ``flash`` (both versions: ``flash_mma``, and ``flash_wgmma`` on Hopper), ``naive`` and ``tiled``
kernels against the float64 definition (flash-attention's rule: our error at most twice PyTorch's own at the
same dtype), poisoned outputs, opcheck, torch.compile and CUDA graphs. The spec is the docstring of
``fused_attn.attention.attention``."""

from __future__ import annotations

import math
import re

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
                          {"causal": True, "algo": "auto", "return_lse": True})
    out, lse = torch.empty_like(q), torch.empty(1, 4, 5)
    torch.library.opcheck(torch.ops.fused_attn.attention_out.default, (q, k, v, mask, 0.3),
                          {"causal": False, "algo": "tiled", "out": out, "lse": lse})
    out, lse = torch.ops.fused_attn.attention(q.to("meta"), k.to("meta"), v.to("meta"), None, None,
                                              return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 4, 5) and lse.dtype == torch.float32


def test_compile_fullgraph_cpu_with_and_without_out():
    """torch.compile traces both ops (the out= one through auto_functionalize and Inductor's fallback)."""
    q, k, v = make_qkv(1, 2, 1, 5, 6, 8, torch.float32, "cpu", 4)
    want, want_lse = attention(q, k, v, causal=True, return_lse=True)
    f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, return_lse=True), fullgraph=True)
    got, lse = f(q, k, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)
    out = torch.full_like(q, math.nan)
    g = torch.compile(lambda q, k, v, o: attention(q, k, v, causal=True, out=o, mode="tiled"), fullgraph=True)
    g(q, k, v, out)
    torch.testing.assert_close(out, want)


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
    (lambda q, k, v: attention(q, k, v, mode="fast"), ValueError, r"mode must be 'auto', 'naive', 'tiled', 'flash', 'flash_mma' or 'flash_wgmma', got 'fast'"),
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
    assert attention(q, k, v, mode="naive").shape == q.shape  # naive and tiled take any head dim
    assert attention(q, k, v, mode="tiled").shape == q.shape
    q, k, v = (torch.empty(1, 2, 4, 32, device="meta", dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"q must have a headdim that is a multiple of 8 in \[40, 128\] for "
                                         r"mode='flash_wgmma', got 32"):
        attention(q, k, v, mode="flash_wgmma")
    assert attention(q, k, v, mode="flash_mma").shape == q.shape


@pytest.mark.parametrize("mode", ["flash_mma", "flash_wgmma"])
def test_pinned_flash_versions_run_the_reference_on_cpu(mode):
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, causal=True, mode=mode), attention(q, k, v, causal=True))


# --------------------------------------------------------------------------- the CUDA kernels

from tests.tolerances import assert_attention_close, assert_close, lse_tolerance  # noqa: E402

# The wgmma version of the flash kernel runs on sm_90 (the build targets sm_90a there by default).
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_wgmma = pytest.mark.skipif(not HOPPER, reason="mode='flash_wgmma' runs on sm_90 devices only")
WGMMA_HEADDIMS = list(range(40, 129, 8))  # padded to 64 or 128
GPU_BUDGET = 1 << 22  # batch x nheads_q x seqlen_q x seqlen_k per example (the float64 reference's scores)
PRIMES = [1, 2, 3, 7, 13, 31, 61, 127, 251, 509, 1021]


@st.composite
def gpu_case(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    flash = ["auto", "flash", "flash_mma"] + (["flash_wgmma", "flash_wgmma"] if HOPPER else [])
    mode = draw(st.sampled_from(flash + ["naive", "tiled"] if dtype != torch.float32 else ["naive", "tiled"]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.integers(1, 2))
    if mode in ("naive", "tiled"):
        d = draw(st.one_of(st.sampled_from([64, 128]), st.integers(1, 160)))
    elif mode == "flash_wgmma":
        d = draw(st.one_of(st.sampled_from([64, 128]), st.sampled_from(WGMMA_HEADDIMS)))
    else:
        d = draw(st.one_of(st.sampled_from([64, 128]), st.sampled_from(list(range(8, 257, 8)))))
    seqlen = st.one_of(st.integers(1, 80), st.sampled_from(PRIMES), st.integers(1, 1024))
    sq, sk = draw(seqlen), draw(st.one_of(st.just(None), seqlen))
    sk = sq if sk is None else sk
    while b * hkv * group * sq * sk > GPU_BUDGET:
        sq, sk = max(1, sq // 2), max(1, sk // 2)
    return dict(b=b, hkv=hkv, group=group, sq=sq, sk=sk, d=d, dtype=dtype, mode=mode,
                causal=draw(st.booleans()), mask=draw(st.sampled_from(MASK_FORMS)),
                share=draw(st.sampled_from([0.3, 0.9, 1.0])),  # 1.0: every key masked (rows of zeros)
                scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.floats(-2.0, -0.05))),
                mag=draw(st.sampled_from([1.0, 1.0, 8.0, 70.0])), v_mag=draw(st.sampled_from([1.0, 1e-3, 1e3])),
                layout=draw(st.sampled_from(["contiguous", "fused_qkv"])), use_out=draw(st.booleans()),
                return_lse=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def gpu_inputs(c, device="cuda"):
    """q, k, v and the mask of a case. fused_qkv: the three are [B, H, S, D] views of one [B, S, (Hq + 2 Hkv) D]
    projection (Hugging Face's layout, non-contiguous; needs Sq == Sk, else separate projections per tensor
    transposed from [B, S, H, D]); kv_broadcast: k and v repeat their first kv head (head stride 0)."""
    hq = c["hkv"] * c["group"]
    gen = torch.Generator(device=device).manual_seed(c["seed"])
    b, sq, sk, d = c["b"], c["sq"], c["sk"], c["d"]
    scale = c["scale"] if c["scale"] is not None else d ** -0.5
    qk = c["mag"] / math.sqrt(abs(scale) * math.sqrt(d))  # scores of order mag**2 for any scale

    def rand(*shape, mag):
        return torch.randn(shape, generator=gen, device=device) * mag

    if c["layout"] == "fused_qkv" and sq == sk:
        x = torch.cat([rand(b, sq, hq, d, mag=qk), rand(b, sq, c["hkv"], d, mag=qk),
                       rand(b, sq, c["hkv"], d, mag=c["v_mag"])], dim=2).to(c["dtype"])
        q, k, v = x.transpose(1, 2).split([hq, c["hkv"], c["hkv"]], dim=1)
    elif c["layout"] == "fused_qkv":
        q = rand(b, sq, hq, d, mag=qk).to(c["dtype"]).transpose(1, 2)
        k = rand(b, sk, c["hkv"], d, mag=qk).to(c["dtype"]).transpose(1, 2)
        v = rand(b, sk, c["hkv"], d, mag=c["v_mag"]).to(c["dtype"]).transpose(1, 2)
    else:
        q = rand(b, hq, sq, d, mag=qk).to(c["dtype"])
        k = rand(b, c["hkv"], sk, d, mag=qk).to(c["dtype"])
        v = rand(b, c["hkv"], sk, d, mag=c["v_mag"]).to(c["dtype"])
    if c["layout"] == "kv_broadcast":  # one kv head's rows for every kv head (stride 0: no TMA tensor map)
        k, v = k[:, :1].expand(k.shape), v[:, :1].expand(v.shape)
    mask = make_mask(c["mask"], b, hq, sq, sk, c["dtype"], device, c["seed"], c["share"])
    return q, k, v, mask


def peer_attention(q, k, v, causal, mask, scale):
    """PyTorch's own computation at q's dtype (the peer of the tolerance rule): (q * scale) @ kᵀ, mask,
    softmax, @ v, with rows that see nothing set to 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q * scale) @ k.transpose(-1, -2)
    visible = torch.ones_like(s, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            s = s + mask
    if causal:
        visible = visible & reference.causal_mask(q.shape[2], k.shape[2], q.device)
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def check_case(c, device="cuda"):
    q, k, v, mask = gpu_inputs(c, device)
    scale = c["scale"] if c["scale"] is not None else c["d"] ** -0.5
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device) if c["use_out"] else None
    got = attention(q, k, v, causal=c["causal"], attn_mask=mask, scale=c["scale"], mode=c["mode"],
                    return_lse=c["return_lse"], out=out)
    got, lse = got if c["return_lse"] else (got, None)
    if out is not None:
        assert got is out
    where = ", ".join(f"{key}={c[key]}" for key in ("b", "hkv", "group", "sq", "sk", "d", "dtype", "mode", "causal",
                                                     "mask", "share", "scale", "mag", "v_mag", "layout"))
    m64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), causal=c["causal"], attn_mask=m64,
                                         scale=scale)
    magnitude, _ = reference.attention(q.double(), k.double(), v.double().abs(), causal=c["causal"], attn_mask=m64,
                                       scale=scale)
    k64 = k.double().repeat_interleave(c["group"], 1)
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    if m64 is not None and m64.dtype != torch.bool:
        s = s + m64
    smax = torch.where(torch.isfinite(s), s.abs(), 0).amax(dim=-1)
    # The float32 rounding of a score scales with its terms, sum_i |q_i k_i| |scale| (+ |mask|), not with
    # the score, which cancellation can make far smaller (mag 70 draws rows of terms ~1e4 that sum to
    # ~1e2: an lse off by 4e-4 there is float32 arithmetic, not a bug). The lse has no peer to compare
    # with, so its tolerance takes that bound; the output's check keeps smax (its peer carries the rest).
    terms = (q.double().abs() @ k64.abs().transpose(-1, -2)) * abs(scale)
    if m64 is not None and m64.dtype != torch.bool:
        terms = terms + m64.abs()
    tmax = torch.where(torch.isfinite(s), terms, 0).amax(dim=-1)
    peer = peer_attention(q, k, v, c["causal"], mask, scale)
    assert_attention_close(got, peer, want, magnitude, smax, where)
    no_key = want_lse == -math.inf
    assert (got[no_key] == 0).all(), f"{where}: rows with no visible key must be exact zeros"
    if lse is not None:
        assert lse.shape == want_lse.shape and lse.dtype == torch.float32
        assert torch.equal(lse.cpu() == -math.inf, no_key.cpu()), f"{where}: lse -inf exactly on rows with no key"
        live = ~no_key
        assert_close(lse[live], want_lse[live], lse_tolerance(want_lse[live], tmax[live]), f"{where}: lse")


def gcase(**kw):
    base = dict(b=1, hkv=2, group=1, sq=64, sk=64, d=64, dtype=torch.float16, mode="flash", causal=False, mask=None,
                share=0.3, scale=None, mag=1.0, v_mag=1.0, layout="contiguous", use_out=True, return_lse=True, seed=0)
    base.update(kw)
    return base


GPU_EXAMPLES = [
    gcase(),
    gcase(sq=1, sk=1, causal=True),
    gcase(sq=1021, sk=509, causal=True, group=4, hkv=2, d=128, dtype=torch.bfloat16),  # Sq > Sk: leading rows empty
    gcase(sq=127, sk=1021, causal=True, d=32, mask="bool_key"),
    gcase(sq=200, sk=200, d=256, causal=True, mask="additive_full", layout="fused_qkv"),
    gcase(sq=333, sk=77, d=80, mask="bool_head", share=1.0),  # every key masked: zeros, lse -inf
    gcase(sq=256, sk=256, d=128, mag=70.0, v_mag=1e3, scale=-1.0, causal=True),  # scores ~1e4, negative scale
    gcase(sq=129, sk=65, d=64, mask="additive_query", dtype=torch.bfloat16, mag=8.0, layout="fused_qkv"),
    gcase(sq=100, sk=300, d=40, mode="naive", dtype=torch.float32, causal=True, mask="additive_key"),
    gcase(sq=17, sk=23, d=13, mode="naive", dtype=torch.float16, mask="bool_full"),
    gcase(sq=130, sk=67, d=72, mode="tiled", dtype=torch.bfloat16, causal=True, mask="additive_key", group=2,
          layout="fused_qkv"),
    gcase(sq=64, sk=200, d=128, mode="tiled", dtype=torch.float32, mask="bool_head", share=1.0),
    gcase(sq=1024, sk=1024, d=128, hkv=1, group=8, causal=True, mode="auto", use_out=False),
]


# The wgmma kernel's edges: BR 128 query rows in 2 warpgroups of 64, BC 128 keys, 64-column panels.
WGMMA_EXAMPLES = [
    gcase(mode="flash_wgmma"),
    gcase(mode="flash_wgmma", sq=1, sk=1, causal=True),
    gcase(mode="flash_wgmma", sq=128, sk=128, d=128, causal=True),
    gcase(mode="flash_wgmma", sq=129, sk=257, d=128, dtype=torch.bfloat16, causal=True),  # Sq < Sk: bottom-right
    gcase(mode="flash_wgmma", sq=1021, sk=509, causal=True, group=4, hkv=2, d=128),  # Sq > Sk: leading rows empty
    gcase(mode="flash_wgmma", sq=300, sk=300, d=64, causal=True, hkv=1, group=8, dtype=torch.bfloat16),  # MQA
    gcase(mode="flash_wgmma", sq=65, sk=1000, d=64, mask="bool_key", use_out=False),
    gcase(mode="flash_wgmma", sq=200, sk=200, d=128, causal=True, mask="additive_full", layout="fused_qkv"),
    gcase(mode="flash_wgmma", sq=333, sk=77, d=80, mask="bool_head", share=1.0),  # every key masked: zeros
    gcase(mode="flash_wgmma", sq=256, sk=256, d=128, mag=70.0, v_mag=1e3, scale=-1.0, causal=True),
    gcase(mode="flash_wgmma", sq=129, sk=65, d=64, mask="additive_query", dtype=torch.bfloat16, mag=8.0,
          layout="fused_qkv"),
    gcase(mode="flash_wgmma", sq=97, sk=131, d=40, causal=True, return_lse=False),
    gcase(mode="flash_wgmma", sq=1024, sk=1024, d=128, hkv=1, group=8, causal=True, use_out=False),
    gcase(mode="flash_wgmma", sq=1024, sk=1024, d=64, b=2, hkv=1, causal=True, seed=3),
]


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("case", WGMMA_EXAMPLES, ids=lambda c: f"{c['dtype']}-d{c['d']}-{c['sq']}x{c['sk']}-"
                                                               f"{'causal' if c['causal'] else 'full'}-{c['mask']}")
def test_wgmma_cases_gpu(case):
    check_case(case)


def wgmma_launches(fn):
    """fn's result and the Hopper flash kernel's launches during it, (head dim, tile, TMA loader) each, read
    from the kernel names torch.profiler records (attention_flash_wgmma_kernel<T, HD, kTile, kTma, kMask>)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    launches = []
    for e in prof.events():
        m = re.search(r"attention_flash_wgmma_kernel<[^,]+, (\d+), (\d+), (true|false), (true|false)>", e.name)
        if e.device_type == torch.autograd.DeviceType.CUDA and m:
            launches.append((int(m[1]), int(m[2]), m[3] == "true"))
    return result, launches


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("case", WGMMA_EXAMPLES, ids=lambda c: f"{c['dtype']}-d{c['d']}-{c['sq']}x{c['sk']}-"
                                                               f"{'causal' if c['causal'] else 'full'}-{c['mask']}")
def test_wgmma_cases_tma_loader_gpu(case):
    """The TMA loader (attention_heuristics.h's kFlashTma) runs wherever q, k and v can be described as tensor
    maps, as in every case here; the cp.async loader where they cannot (k and v broadcast over their kv heads:
    stride 0), with bit for bit the output and lse of the same values copied out (TMA): the shared-memory tiles
    the consumers read must be the same bytes. Against float64: test_wgmma_cases_gpu."""
    q, k, v, mask = gpu_inputs(case)
    run = lambda k, v: attention(q, k, v, causal=case["causal"], attn_mask=mask,  # noqa: E731
                                 scale=case["scale"], mode="flash_wgmma", return_lse=True)
    _, launches = wgmma_launches(lambda: run(k, v))
    assert launches and all(tma for _, _, tma in launches), launches
    if k.shape[1] > 1:
        kb, vb = k[:, :1].expand(k.shape), v[:, :1].expand(v.shape)
        (cp_out, cp_lse), cp_launches = wgmma_launches(lambda: run(kb, vb))
        (tma_out, tma_lse), tma_launches = wgmma_launches(lambda: run(kb.contiguous(), vb.contiguous()))
        assert [tma for _, _, tma in cp_launches] == [False] and [tma for _, _, tma in tma_launches] == [True]
        assert torch.equal(tma_out, cp_out) and torch.equal(tma_lse, cp_lse)


# Head dim 64's wgmma cases (tiles 1 and 2: attention_heuristics.h's flash_d64_tile): the edges above at
# d <= 64, a causal grid of many blocks (partial last query and key tiles in each), one query row against many
# keys, fully masked rows (every key masked; Sq > Sk under causal), large bfloat16 scores.
WGMMA_D64_EXAMPLES = [c for c in WGMMA_EXAMPLES if c["d"] <= 64] + [
    gcase(mode="flash_wgmma", b=2, hkv=3, sq=700, sk=700, d=64, causal=True, seed=5),
    gcase(mode="flash_wgmma", sq=1, sk=517, d=64, causal=True, group=2, mask="bool_key", seed=6),
    gcase(mode="flash_wgmma", sq=333, sk=77, d=64, mask="bool_head", share=1.0, seed=7),  # every key masked: zeros
    # Sq > Sk under causal: the rows before the diagonal see no key (zeros); large bfloat16 scores.
    gcase(mode="flash_wgmma", sq=600, sk=300, d=64, causal=True, dtype=torch.bfloat16, mag=70.0, seed=8),
]


def with_blocks_over(case, blocks: int, rows: int = 128):
    """case with its batch raised until its grid has more than `blocks` blocks of `rows` query rows."""
    per_batch = -(-case["sq"] // rows) * case["hkv"] * case["group"]
    return dict(case, b=max(case["b"], blocks // per_batch + 1))


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("loader", ["tma", "cp_async"])
@pytest.mark.parametrize("case", WGMMA_D64_EXAMPLES, ids=lambda c: f"{c['dtype']}-d{c['d']}-b{c['b']}-{c['sq']}x"
                                                                   f"{c['sk']}-{'causal' if c['causal'] else 'full'}"
                                                                   f"-{c['mask']}")
def test_wgmma_d64_tiles_gpu(case, loader):
    """Each of head dim 64's tiles against float64, with the TMA loader and the cp.async one (k and v broadcast
    over their kv heads): the case as it is (tile 2 where its grid has at most one 128-row block per SM), and a
    causal case with its batch raised past one 128-row block per SM (tile 1), each tile read from the kernel
    names."""
    sms = sm_count()
    for c in [case] + ([with_blocks_over(case, sms)] if case["causal"] else []):
        if loader == "cp_async":
            c = dict(c, hkv=max(2, c["hkv"]), layout="kv_broadcast")
        blocks = -(-c["sq"] // 128) * c["hkv"] * c["group"] * c["b"]
        tile = 1 if c["causal"] and blocks > sms else 2
        _, launches = wgmma_launches(lambda: check_case(c))  # noqa: B023
        assert launches == [(64, tile, loader == "tma")], (c, launches)


@pytest.mark.gpu
@needs_wgmma
def test_wgmma_d64_tile_choice_gpu():
    """attention_heuristics.h's flash_d64_tile at its bound: tile 1 under causal where the grid has more 128-row
    query blocks than the device has SMs, else tile 2 (also without causal at the same grid); head dim 128 has
    tile 0 alone."""
    sms = sm_count()
    for sq, causal, d, want in ((128 * (sms // 8), True, 64, 2), (128 * (sms // 8 + 1), True, 64, 1),
                                (128 * (sms // 8 + 1), False, 64, 2),
                                (128 * (sms // 8 + 1), True, 128, 0)):  # 8 heads: 8 blocks per 128 rows
        q, k, v, _ = gpu_inputs(gcase(hkv=2, group=4, sq=sq, sk=sq, d=d))
        _, launches = wgmma_launches(lambda: attention(q, k, v, causal=causal, mode="flash_wgmma"))  # noqa: B023
        assert launches == [(d, want, True)], (sq, causal, d, launches)


# Causal grids whose query tiles own very different numbers of key tiles, for the block order (attention_
# heuristics.h's flash_longest_first: longest-first within 8 waves of blocks, as these): several tiles per
# (head, batch) with a partial last one, GQA, Sq < Sk, and Sq > Sk (leading tiles that see no key: zeros), at
# head dims 64 and 128.
WGMMA_ORDER_EXAMPLES = [
    gcase(mode="flash_wgmma", b=2, hkv=3, group=2, sq=700, sk=700, d=64, causal=True, seed=9),
    gcase(mode="flash_wgmma", b=3, hkv=1, group=4, sq=129, sk=1000, d=64, causal=True, mask="bool_key", seed=10),
    gcase(mode="flash_wgmma", b=2, hkv=2, group=2, sq=600, sk=300, d=64, causal=True, dtype=torch.bfloat16,
          seed=11),
    gcase(mode="flash_wgmma", b=2, hkv=2, group=4, sq=1021, sk=509, d=128, causal=True, seed=12),
    gcase(mode="flash_wgmma", b=2, hkv=2, group=2, sq=500, sk=500, d=96, causal=True, dtype=torch.bfloat16,
          seed=13),
]


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("case", WGMMA_ORDER_EXAMPLES, ids=lambda c: f"d{c['d']}-b{c['b']}-{c['sq']}x{c['sk']}")
def test_wgmma_block_order_gpu(case):
    """The causal query tiles longest-first across every (head, batch) (grids of a few waves), against float64,
    with the TMA loader and the cp.async one; and the natural order past 8 waves of blocks: the same case with
    its batch raised past 8 blocks per SM (head dim 64: two blocks per SM, 128-row tile 1 there)."""
    check_case(case)
    check_case(dict(case, hkv=max(2, case["hkv"]), layout="kv_broadcast"))
    per_sm = 2 if case["d"] <= 64 else 1
    check_case(with_blocks_over(dict(case, sk=min(case["sk"], 512)), 8 * per_sm * sm_count()))


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("d", [64, 128])
def test_flash_is_the_wgmma_kernel_on_hopper_gpu(d):
    """On an sm_90 device mode='flash' (and 'auto') run the wgmma kernel: bit for bit its output. Where it
    does not apply it says so."""
    q, k, v, mask = gpu_inputs(gcase(sq=300, sk=300, d=d, mask="bool_key", group=2))
    want = attention(q, k, v, causal=True, attn_mask=mask, mode="flash_wgmma")
    assert torch.equal(attention(q, k, v, causal=True, attn_mask=mask, mode="flash"), want)
    assert torch.equal(attention(q, k, v, causal=True, attn_mask=mask), want)
    q, k, v, _ = gpu_inputs(gcase(d=32))
    with pytest.raises(ValueError, match=r"q must have a headdim that is a multiple of 8 in \[40, 128\] for "
                                         r"mode='flash_wgmma', got 32"):
        attention(q, k, v, mode="flash_wgmma")


@pytest.mark.gpu
@pytest.mark.skipif(HOPPER, reason="the wgmma kernel runs here")
def test_flash_wgmma_refuses_other_devices_gpu():
    q, k, v, _ = gpu_inputs(gcase(d=64))
    with pytest.raises(ValueError, match=r"q must be on an sm_90 device with the library built for sm_90a "
                                         r"\(TORCH_CUDA_ARCH_LIST=9.0a\) for mode='flash_wgmma', got cuda:0"):
        attention(q, k, v, mode="flash_wgmma")


@pytest.mark.gpu
@given(case=gpu_case())
def test_matches_reference_gpu(case):
    check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_EXAMPLES, ids=lambda c: f"{c['mode']}-{c['dtype']}-d{c['d']}-{c['sq']}x{c['sk']}")
def test_pinned_cases_gpu(case):
    check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["flash", "flash_mma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", list(range(8, 257, 8)))
def test_every_flash_headdim_gpu(dtype, d, mode):
    check_case(gcase(d=d, dtype=dtype, sq=97, sk=131, causal=d % 16 == 0, mask="bool_key" if d % 24 == 0 else None,
                     seed=d, mode=mode))


FLASH_VERSIONS = ["flash", "flash_mma", pytest.param("flash_wgmma", marks=needs_wgmma)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [*FLASH_VERSIONS, "naive", "tiled"])
def test_opcheck_gpu(mode):
    q, k, v, mask = gpu_inputs(gcase(sq=33, sk=47, hkv=1, group=2, mask="bool_key", layout="fused_qkv"))
    torch.library.opcheck(torch.ops.fused_attn.attention.default, (q, k, v, mask, None),
                          {"causal": True, "algo": mode, "return_lse": True})
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
    torch.library.opcheck(torch.ops.fused_attn.attention_out.default, (q, k, v, mask, 0.3),
                          {"causal": False, "algo": mode, "out": out, "lse": lse})


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    q, k, v, mask = gpu_inputs(gcase(sq=70, sk=70, mask="additive_key"))
    f = torch.compile(lambda q, k, v, m: attention(q, k, v, causal=True, attn_mask=m) * 2, fullgraph=True)
    want = attention(q, k, v, causal=True, attn_mask=mask)
    torch.testing.assert_close(f(q, k, v, mask), want * 2)
    out = torch.full_like(q, math.nan)
    g = torch.compile(lambda q, k, v, m, o: attention(q, k, v, causal=True, attn_mask=m, out=o), fullgraph=True)
    g(q, k, v, mask, out)
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [*FLASH_VERSIONS, "naive", "tiled"])
def test_cuda_graph_gpu(mode):
    q, k, v, mask = gpu_inputs(gcase(sq=100, sk=150, mask="bool_key", group=2))
    out = torch.empty_like(q)
    attention(q, k, v, attn_mask=mask, causal=True, mode=mode, out=out)  # warm-up (build, first launch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(q, k, v, attn_mask=mask, causal=True, mode=mode, out=out)
    for seed in (1, 2):
        q2, k2, v2, _ = gpu_inputs(gcase(sq=100, sk=150, group=2, seed=seed))
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, attention(q, k, v, attn_mask=mask, causal=True, mode=mode))


@pytest.mark.gpu
def test_flash_allocates_no_score_matrix_gpu():
    """mode='flash' at S = 4096: the peak allocation above the inputs is the output (and lse), nowhere
    near the 4096 x 4096 score matrix that mode='naive' allocates."""
    q, k, v, _ = gpu_inputs(gcase(sq=4096, sk=4096, hkv=4, d=128, use_out=False))
    attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention(q, k, v, causal=True, return_lse=True)
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= q.numel() * q.element_size() + q.shape[0] * q.shape[1] * q.shape[2] * 4 + (1 << 20), extra


@pytest.mark.gpu
def test_gradient_through_the_op_gpu():
    q, k, v, _ = gpu_inputs(gcase(sq=40, sk=50, group=2, dtype=torch.float32, mode="naive"))
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    attention(q, k, v, causal=True).square().sum().backward()
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    reference.attention(q2, k2, v2, causal=True)[0].square().sum().backward()
    for a, b_ in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b_.grad.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_errors_gpu():
    q, k, v, _ = gpu_inputs(gcase(sq=8, sk=8))
    with pytest.raises(ValueError, match=r"k must be on the same device as q \(cuda:0\), got cpu"):
        attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match=r"q must have dtype float16 or bfloat16 for mode='flash', got torch.float32"):
        attention(q.float(), k.float(), v.float(), mode="flash")
    with pytest.raises(ValueError, match=r"q must have a contiguous last dim and 16-byte aligned rows"):
        torch.ops.fused_attn.attention(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, None, None,
                                       algo="flash")
    with pytest.raises(ValueError, match=r"attn_mask must be broadcastable to \(1, 2, 8, 8\), got \(3, 8\)"):
        torch.ops.fused_attn.attention(q, k, v, torch.ones(3, 8, dtype=torch.bool, device="cuda"), None)
