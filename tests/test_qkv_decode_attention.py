"""qkv_decode_attention (fused_attn/qkv_decode_attention.py, csrc/qkv_decode_attention/): the fused QKV
projection + decode attention against a float64 reference, beside the two-op chain it replaces
(fused_attn.linear with the weightless norm, then fused_attn.decode_attention with k_new / v_new)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn import decode_attention, linear, qkv_decode_attention
from fused_attn.gpt2 import _qkv_attention_applies
from tests.test_layer_norm import poison_allocations

HD = 64


def make_case(dtype, device, batch, d, max_len, seed, bias=True, leftpad=True, mag=3.0):
    g = torch.Generator().manual_seed(seed)
    heads = d // HD
    x = (torch.randn(batch, 1, d, generator=g) * mag + 0.5).to(dtype)
    w = (torch.randn(3 * d, d, generator=g) * d ** -0.5).to(dtype)
    b = (torch.randn(3 * d, generator=g) * 0.5).to(dtype) if bias else None
    kc = torch.randn(batch, heads, max_len, HD, generator=g).to(dtype)
    vc = torch.randn(batch, heads, max_len, HD, generator=g).to(dtype)
    lens = torch.randint(0, max_len, (batch,), generator=g, dtype=torch.int32)
    lens[0] = max_len - 1  # the last slot
    if batch > 1:
        lens[1] = 0  # only the new key
    left = (torch.rand(batch, generator=g) * (lens.float() + 1)).floor().to(torch.int32).clamp(max=lens) \
        if leftpad else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(kc), to(vc), to(lens), to(left)


def reference64(x, w, b, kc, vc, lens, left, eps, scale):
    """float64, q / k / v rounded to x's dtype as the op stores them; returns (out, k_new, v_new)."""
    batch, _, d = x.shape
    heads = d // HD
    xn = F.layer_norm(x.double().cpu(), (d,), eps=eps)
    qkv = xn @ w.double().cpu().T + (0 if b is None else b.double().cpu())
    q, k, v = qkv.to(x.dtype).double().view(batch, 3, heads, HD).unbind(1)
    out = torch.empty(batch, heads, HD, dtype=torch.float64)
    for i in range(batch):
        n = int(lens[i])
        lo = 0 if left is None else int(left[i])
        keys = torch.cat([kc[i, :, lo:n].double().cpu(), k[i][:, None]], 1)
        vals = torch.cat([vc[i, :, lo:n].double().cpu(), v[i][:, None]], 1)
        p = torch.softmax((keys @ q[i][:, :, None]).squeeze(-1) * scale, -1)
        out[i] = (p[:, None, :] @ vals).squeeze(1)
    return out.reshape(batch, 1, d), k, v


def chain(x, w, b, kc, vc, lens, left, eps, scale):
    batch, _, d = x.shape
    qkv = linear(x, w, b, norm="layer_norm", eps=eps)
    q, k, v = qkv.view(batch, 1, 3, d // HD, HD).permute(2, 0, 3, 1, 4).unbind(0)
    a = decode_attention(q, kc, vc, lens, k_new=k, v_new=v, cache_leftpad=left, scale=scale)
    return a.transpose(1, 2).reshape(batch, 1, d)


def check_against_chain(device, dtype, batch, d, max_len, seed, bias=True, leftpad=True, mag=3.0):
    eps, scale = 1e-5, HD ** -0.5
    x, w, b, kc, vc, lens, left = make_case(dtype, device, batch, d, max_len, seed, bias, leftpad, mag)
    kc0, vc0 = kc.clone(), vc.clone()
    ref, k_ref, v_ref = reference64(x, w, b, kc, vc, lens, left, eps, scale)
    kc2, vc2 = kc.clone(), vc.clone()
    want = chain(x, w, b, kc2, vc2, lens, left, eps, scale)
    poison_allocations((batch, 1, d), dtype, device, 2)  # an output element the kernel misses stays NaN
    got = qkv_decode_attention(x, w, b, kc, vc, lens, left, eps=eps, scale=scale)
    assert got.shape == (batch, 1, d) and torch.isfinite(got).all()
    err = (got.double().cpu() - ref).abs().max().item()
    err_chain = (want.double().cpu() - ref).abs().max().item()
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}.get(dtype, 2.0 ** -20)
    assert err <= 2 * err_chain + ulp * ref.abs().max().item(), (err, err_chain)
    # The caches: slot lens[b] holds k / v within 2x the chain's error there (plus two ulps: at 2-16 rows
    # the kernel rounds the normalized x to the dtype, as the chain's norm does), every other slot unchanged.
    for i in range(batch):
        n = int(lens[i])
        for cache, chain_cache, cache0, new in ((kc, kc2, kc0, k_ref), (vc, vc2, vc0, v_ref)):
            e = (cache[i][:, n].double().cpu() - new[i]).abs().max().item()
            e_chain = (chain_cache[i][:, n].double().cpu() - new[i]).abs().max().item()
            assert e <= 2 * e_chain + 2 * ulp * new[i].abs().max().item(), (i, n, e, e_chain)
            keep = torch.ones(max_len, dtype=torch.bool)
            keep[n] = False
            assert torch.equal(cache[i][:, keep.to(cache.device)], cache0[i][:, keep.to(cache.device)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,d", [(1, 256), (3, 768)])
def test_cpu_path_matches_the_chain(dtype, batch, d):
    check_against_chain("cpu", dtype, batch, d, 40, seed=batch * 7 + d)


# Drawn cases: batch (1-16: clusters of 1, 2, 4 and 8 sequences, the last one part-filled at 3, 5-7, 9-15),
# heads (d = 64 heads, a multiple of 256 as the kernel takes), cache length (1: only the new key), bias and
# left padding on or off, and x's magnitude (the norm's input: tiny, unit, and near float16's range).
QKV_CASE = dict(batch=st.integers(1, 16), heads=st.sampled_from([4, 8, 12, 16]), max_len=st.integers(1, 300),
                seed=st.integers(0, 2**31 - 1), bias=st.booleans(), leftpad=st.booleans(),
                mag=st.sampled_from([1e-3, 1.0, 3.0, 1e3]))


@given(**QKV_CASE)
@example(batch=1, heads=12, max_len=1, seed=0, bias=True, leftpad=False, mag=3.0)
@example(batch=3, heads=4, max_len=257, seed=1, bias=False, leftpad=True, mag=1e3)
def test_cpu_path_matches_the_chain_drawn(batch, heads, max_len, seed, bias, leftpad, mag):
    check_against_chain("cpu", torch.float32, batch, heads * HD, max_len, seed, bias, leftpad, mag)


@pytest.mark.gpu
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), **QKV_CASE)
@example(dtype=torch.float16, batch=1, heads=12, max_len=1, seed=0, bias=True, leftpad=False, mag=1e3)
@example(dtype=torch.bfloat16, batch=4, heads=16, max_len=300, seed=2, bias=True, leftpad=True, mag=1e-3)
@example(dtype=torch.float16, batch=13, heads=12, max_len=200, seed=3, bias=True, leftpad=True, mag=1e3)
def test_matches_reference_gpu_drawn(dtype, batch, heads, max_len, seed, bias, leftpad, mag):
    check_against_chain("cuda", dtype, batch, heads * HD, max_len, seed, bias, leftpad, mag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,d,max_len", [(1, 768, 300), (3, 768, 200), (2, 256, 97), (4, 1024, 1100), (1, 512, 9),
                                             (5, 768, 129), (8, 512, 64), (9, 256, 33), (16, 768, 300), (13, 1024, 70),
                                             (1, 768, 1024), (1, 256, 2600)])  # one row: 1 and 3 passes a warp
@pytest.mark.parametrize("bias,leftpad", [(True, True), (False, False)])
def test_matches_reference_gpu(dtype, batch, d, max_len, bias, leftpad):
    for seed in range(3):
        check_against_chain("cuda", dtype, batch, d, max_len, seed, bias, leftpad)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 11])
def test_lengths_out_of_bounds_give_nan_and_leave_the_cache_gpu(batch):
    """Bad lengths: that sequence's output is NaN and no slot of its cache changes; the good sequences beside
    it (batch 11: in the same cluster of 8 and in the next) are right."""
    x, w, b, kc, vc, lens, left = make_case(torch.float16, "cuda", batch, 768, 50, seed=5)
    bad = [0, 1, 2] if batch == 3 else [1, 8, 10]
    lens[bad] = torch.tensor([50, -1, 10], dtype=torch.int32, device="cuda")  # slot 50 is past max_len; -1
    left[bad] = torch.tensor([0, 0, 11], dtype=torch.int32, device="cuda")  # leftpad past seqlens
    good = [i for i in range(batch) if i not in bad]
    kc0, vc0 = kc.clone(), vc.clone()
    ref, _, _ = reference64(x, w, b, kc, vc, lens.clamp(0, 49), left.clamp(max=lens.clamp(0, 49)), 1e-5, HD ** -0.5)
    out = qkv_decode_attention(x, w, b, kc, vc, lens, left)
    assert torch.isnan(out[bad]).all()
    assert torch.equal(kc[bad], kc0[bad]) and torch.equal(vc[bad], vc0[bad])
    if good:
        err = (out[good].double().cpu() - ref[good]).abs().max().item()
        assert err <= 2.0 ** -8 * ref[good].abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 16])
def test_graph_replay_at_growing_lengths_gpu(batch):
    dtype, d, max_len = torch.float16, 768, 64
    x, w, b, kc, vc, lens, left = make_case(dtype, "cuda", batch, d, max_len, seed=11)
    lens.copy_(torch.arange(batch, dtype=torch.int32) % 7 + 5)
    left.copy_(torch.arange(batch, dtype=torch.int32) % 4)
    qkv_decode_attention(x, w, b, kc, vc, lens, left)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qkv_decode_attention(x, w, b, kc, vc, lens, left)
    for step in range(4):
        x.copy_(torch.randn(batch, 1, d).to(dtype))
        lens.add_(1)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        want = chain(x, w, b, kc_ref, vc_ref, lens, left, 1e-5, HD ** -0.5)
        g.replay()
        torch.cuda.synchronize()
        ref, _, _ = reference64(x, w, b, kc_ref, vc_ref, lens, left, 1e-5, HD ** -0.5)
        err = (out.double().cpu() - ref).abs().max().item()
        err_chain = (want.double().cpu() - ref).abs().max().item()
        assert err <= 2 * err_chain + 2.0 ** -10 * ref.abs().max().item(), (step, err, err_chain)


def test_argument_errors_name_the_argument():
    x, w, b, kc, vc, lens, left = make_case(torch.float32, "cpu", 2, 256, 20, seed=1)
    with pytest.raises(ValueError, match="w_qkv must have shape"):
        qkv_decode_attention(x, w[:-1], b, kc, vc, lens, left)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        qkv_decode_attention(x, w, b, kc[:, :1], vc, lens, left)
    with pytest.raises(ValueError, match="cache_seqlens must be an int32"):
        qkv_decode_attention(x, w, b, kc, vc, lens.long(), left)
    with pytest.raises(ValueError, match="x must have shape"):
        qkv_decode_attention(x[:, :0], w, b, kc, vc, lens, left)


def test_an_input_requiring_grad_raises():
    x, w, b, kc, vc, lens, left = make_case(torch.float32, "cpu", 1, 256, 8, seed=2)
    with pytest.raises(ValueError, match="w_qkv must not require grad"):
        qkv_decode_attention(x, w.requires_grad_(), b, kc, vc, lens, left)


def test_opcheck_cpu():
    """The schema's mutations, the fake kernel and the autograd registration (torch.library.opcheck)."""
    x, w, b, kc, vc, lens, left = make_case(torch.float32, "cpu", 2, 256, 12, seed=4)
    torch.library.opcheck(torch.ops.fused_attn.qkv_decode_attention, (x, w, b, kc, vc, lens, left, 1e-5, 0.125))


@pytest.mark.parametrize("rows,slots,want", [(1, 256, True), (8, 256, True), (9, 256, False), (16, 256, False),
                                             (1, 257, True), (2, 257, False), (4, 640, False), (8, 1024, False),
                                             (1, 1024, True), (1, 1, True)])
def test_gpt2_rule_by_rows_and_slots(rows, slots, want):
    """GPT-2's step takes the fused launch at one row over any cache, and at 2-8 rows over caches of up to 256
    slots (measured slower above: the table in fused_attn/gpt2.py)."""
    assert _qkv_attention_applies(rows, slots) is want
