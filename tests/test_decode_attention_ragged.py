"""decode_attention over a ragged batch (cu_seqlens_q / max_seqlen_q): q, k_new, v_new and out packed
[total_q, heads, headdim], sequence b's n_b new tokens at rows cu[b] .. cu[b+1] - 1 (n_b = 0 included),
against a float64 definition written here (each sequence's rows as a batch of one through
``fused_attn.reference.decode_attention`` in float64, not the op's CPU path); the append exact and nothing else
written, with a contiguous or a paged cache (pages in random order), cache_leftpad, key_mask, num_splits,
GQA; out= poisoned with NaN; the rows and the causal rule of each sequence; offsets as device tensors,
lists and CPU tensors; CUDA graphs replayed at new lengths and offsets; device offsets out of range (NaN
and no write, ValueError for host-checked ones and under validate=True); torch.compile; opcheck; bad
inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn.decode_attention import decode_attention
from tests.test_decode_attention import (DTYPES, POISON, SPLITS, bits, case_of, peer_attention, score_max,
                                         want_and_magnitude)
from tests.test_decode_attention_paged import logical, pages_of
from tests.tolerances import assert_attention_close

ON_CPU_BUDGET = 1 << 13  # cache elements (batch x nheads_kv x max_len x headdim) per example
ON_GPU_BUDGET = 1 << 19
PAGE_SIZES = [16, 32, 64]


@st.composite
def ragged_case(draw, budget, cuda):
    """Shapes, each sequence's new tokens (0, 1, the most, or any), lengths (0, the full cache, or any)
    and options of one call."""
    batch = draw(st.integers(1, 4))
    nheads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 4, 8, 3]))
    most = draw(st.one_of(st.just(1), st.integers(1, 12)))
    new = [draw(st.one_of(st.sampled_from([0, 1, most]), st.integers(0, most))) for _ in range(batch)]
    if cuda:
        headdim = draw(st.sampled_from([32, 64, 128, 256, 80]))
    else:
        headdim = draw(st.one_of(st.sampled_from([8, 16, 32]), st.integers(1, 24)))
    append = draw(st.booleans())
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from(PAGE_SIZES))
    lo = max(new) if append else 0
    cap = max(lo, budget // (batch * nheads_kv * headdim))
    if paged:
        fewest = max(1, -(-lo // page_size))  # blocks for the longest append
        max_len = page_size * draw(st.integers(fewest, max(fewest, cap // page_size)))
    else:
        max_len = draw(st.one_of(st.integers(lo, min(lo + 40, cap)), st.integers(lo, cap)))
    seqlens = []
    for n in new:
        hi = max_len - (n if append else 0)
        seqlens.append(draw(st.one_of(st.sampled_from([0, hi, max(hi - 1, 0)]), st.integers(0, hi))))
    leftpad = None
    if draw(st.booleans()):
        leftpad = [draw(st.one_of(st.just(0), st.just(n), st.integers(0, n))) for n in seqlens]
    cu_as = draw(st.sampled_from(["device", "list", "cpu_tensor"]))
    # max_seqlen_q: derived (host offsets only), the longest n_b, or more (a grid with idle rows)
    extra = draw(st.sampled_from([None, 0, 3])) if cu_as != "device" else draw(st.sampled_from([0, 3]))
    return ragged_case_of(
        batch=batch, nheads_kv=nheads_kv, group=group, new=new, headdim=headdim, max_len=max_len, seqlens=seqlens,
        leftpad=leftpad, append=append, dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
        num_splits=draw(st.sampled_from(SPLITS)), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        qkv=draw(st.sampled_from(["fused", "contiguous"])), use_out=draw(st.booleans()),
        key_mask=draw(st.sampled_from([None, None, 0.5, 1.0])), seed=draw(st.integers(0, 2**31 - 1)),
        paged=paged, page_size=page_size, cu_as=cu_as, extra=extra)


def ragged_case_of(**kw):
    base = case_of(new=[1, 3], seqlens=[5, 9], paged=False, page_size=16, spare_pages=1, unused_entry="minus_one",
                   pool_layout="hnd", cu_as="device", extra=0, key_mask=None)
    base.update(kw)
    base["batch"] = len(base["new"])
    return base


def offsets(new):
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    return cu


def key_mask_of(case):
    share = case.get("key_mask")
    if share is None:
        return None
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    return torch.rand(case["batch"], case["max_len"], generator=gen) >= share


def visible(case, key_mask):
    """[batch, max_len] bool: the slots some query of the sequence sees (the others hold NaN)."""
    seen = torch.zeros(case["batch"], case["max_len"], dtype=torch.bool)
    for b, n in enumerate(case["new"]):
        if n == 0:
            continue
        lo = (case["leftpad"] or [0] * case["batch"])[b]
        seen[b, lo:case["seqlens"][b] + (n if case["append"] else 0)] = True
    if key_mask is not None:
        seen &= key_mask
    return seen


def make_inputs(case, device):
    """Packed q [total_q, hq, d] (k_new, v_new [total_q, hkv, d]), contiguous or sliced from one projection
    [total_q, hq + 2 hkv, d]; caches [batch, hkv, max_len, d] with NaN in every slot no query sees."""
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    hkv, d, n = case["nheads_kv"], case["headdim"], case["max_len"]
    hq, dtype, total = hkv * case["group"], case["dtype"], sum(case["new"])
    compute = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=compute).to(dtype)

    if case["qkv"] == "fused":
        x = randn(total, hq + 2 * hkv, d)
        q, k_new, v_new = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    else:
        q, k_new, v_new = randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d)
    k_cache, v_cache = randn(case["batch"], hkv, n, d), randn(case["batch"], hkv, n, d)
    seen = visible(case, key_mask_of(case)).view(case["batch"], 1, n, 1).to(device)
    k_cache.masked_fill_(~seen, POISON)
    v_cache.masked_fill_(~seen, POISON)
    if not case["append"]:
        k_new = v_new = None
    return q, k_cache, v_cache, k_new, v_new


def one(t, rows):
    """Rows of one sequence of a packed tensor as the 4-dim layout of a batch of one: [1, heads, n_b, d]."""
    return None if t is None else t[rows].transpose(0, 1).unsqueeze(0)


def definition(case, q, k_before, v_before, k_new, v_new, key_mask):
    """Sequence by sequence, its rows of q as a batch of one through fused_attn.reference in float64 (and
    PyTorch at q's dtype: the tolerance rule's peer): (want, magnitude, peer, score max) packed like q,
    and the caches after the append."""
    cu, b = offsets(case["new"]), case["batch"]
    want = torch.zeros(q.shape, dtype=torch.float64)
    magnitude, peer = torch.zeros_like(want), torch.zeros(q.shape, dtype=q.dtype)
    smax = torch.zeros(q.shape[:-1], dtype=torch.float64)
    k_after, v_after = k_before.clone(), v_before.clone()
    appended = k_new is not None
    for i in range(b):
        rows = slice(cu[i], cu[i + 1])
        if cu[i + 1] == cu[i]:
            continue
        s = torch.tensor(case["seqlens"][i:i + 1], dtype=torch.int32)
        lp = None if case["leftpad"] is None else torch.tensor(case["leftpad"][i:i + 1], dtype=torch.int32)
        km = None if key_mask is None else key_mask[i:i + 1]
        qb, kb, vb = (x.cpu() for x in (one(q, rows), k_before[i:i + 1], v_before[i:i + 1]))
        kn, vn = (None if x is None else one(x, rows).cpu() for x in (k_new, v_new))
        w, m = want_and_magnitude(qb, kb, vb, s, kn, vn, lp, case["scale"], km)
        if appended:  # plain slice copies (NaN payloads kept): new token t of the sequence at slot seqlens + t
            at = slice(case["seqlens"][i], case["seqlens"][i] + kn.shape[2])
            k_after[i, :, at], v_after[i, :, at] = kn[0], vn[0]
        ka, va = k_after[i:i + 1], v_after[i:i + 1]
        want[rows], magnitude[rows] = w[0].transpose(0, 1), m[0].transpose(0, 1)
        peer[rows] = peer_attention(qb, ka, va, s, lp, appended, case["scale"], km)[0].transpose(0, 1)
        smax[rows] = score_max(qb, ka, s, lp, appended, case["scale"], km)[0].transpose(0, 1)
    return want, magnitude, peer, smax, k_after, v_after


def cu_argument(cu, form, device):
    if form == "device":
        return torch.tensor(cu, dtype=torch.int32, device=device)
    if form == "list":
        return cu
    return torch.tensor(cu, dtype=torch.int64)  # a CPU tensor, any integer dtype


def run_and_check(case, device):
    q, k_cache, v_cache, k_new, v_new = make_inputs(case, device)
    k_before, v_before = k_cache.cpu().clone(), v_cache.cpu().clone()
    key_mask = key_mask_of(case)
    cu, b = offsets(case["new"]), case["batch"]
    kw = dict(k_new=k_new, v_new=v_new, scale=case["scale"], num_splits=case["num_splits"],
              cache_leftpad=None if case["leftpad"] is None else torch.tensor(case["leftpad"], dtype=torch.int32,
                                                                                device=device),
              key_mask=None if key_mask is None else key_mask.to(device),
              cu_seqlens_q=cu_argument(cu, case["cu_as"], device),
              max_seqlen_q=None if case["extra"] is None else max(case["new"]) + case["extra"])
    seqlens = torch.tensor(case["seqlens"], dtype=torch.int32, device=device)
    if case["paged"]:
        # pages for each sequence's slots [leftpad, seqlens + n_b) (pages_of maps [leftpad, seqlens) without
        # an append), in random order; the other entries -1 or past the pool
        ends = [s + (n if case["append"] else 0) for s, n in zip(case["seqlens"], case["new"])]
        k_pool, v_pool, table = pages_of(dict(case, seqlens=ends, append=False), k_cache, v_cache)
        k_cache, v_cache = k_pool, v_pool
        kw["block_table"] = table
    out = None
    if case["use_out"]:
        out = torch.full(q.shape, POISON, dtype=q.dtype, device=device)
    got = decode_attention(q, k_cache, v_cache, seqlens, out=out, **kw)
    assert out is None or got is out
    assert got.shape == q.shape and got.dtype == q.dtype and got.device == q.device
    where = (f"new={case['new']} hkv={case['nheads_kv']} group={case['group']} d={case['headdim']} "
             f"max_len={case['max_len']} seqlens={case['seqlens']} leftpad={case['leftpad']} append={case['append']} "
             f"{case['dtype']} splits={case['num_splits']} key_mask={case['key_mask']} paged={case['paged']} "
             f"cu_as={case['cu_as']} extra={case['extra']}")
    want, magnitude, peer, smax, k_after, v_after = definition(case, q, k_before, v_before, k_new, v_new, key_mask)
    if case["paged"]:
        ps, n = case["page_size"], case["max_len"]
        k_got, v_got = logical(k_cache, table, ps, b, n).cpu(), logical(v_cache, table, ps, b, n).cpu()
        # the logical cache holds zeros where no page is mapped: compare the slots the pages hold
        mapped = torch.zeros(b, n, dtype=torch.bool)
        for i in range(b):
            for blk, page in enumerate(table[i].tolist()):
                if 0 <= page < k_cache.shape[0]:
                    mapped[i, blk * ps:(blk + 1) * ps] = True
        m = mapped.view(b, 1, n, 1).expand_as(k_got)
        assert torch.equal(bits(k_got[m]), bits(k_after[m])), f"{where}: k pages after the call"
        assert torch.equal(bits(v_got[m]), bits(v_after[m])), f"{where}: v pages after the call"
    else:
        assert torch.equal(bits(k_cache.cpu()), bits(k_after)), f"{where}: k_cache after the call"
        assert torch.equal(bits(v_cache.cpu()), bits(v_after)), f"{where}: v_cache after the call"
    assert not got.isnan().any(), f"{where}: NaN in the output (a row not written, or a poisoned slot read)"
    assert_attention_close(got, peer.to(device), want.to(device), magnitude.to(device), smax.to(device), where)
    no_key = magnitude.abs().amax(dim=-1) == 0
    assert (got.cpu()[no_key] == 0).all(), f"{where}: rows with no visible key must be exact zeros"


EDGE_EXAMPLES = [
    ragged_case_of(new=[0, 0], seqlens=[3, 4]),  # no new token at all: an empty output, nothing appended
    ragged_case_of(new=[0, 3, 0, 1], seqlens=[2, 29, 32, 0], max_len=32, leftpad=[0, 4, 32, 0]),  # a cache filled
    ragged_case_of(new=[5, 1], seqlens=[11, 31], max_len=16 * 2, append=False, key_mask=0.5, use_out=True,
                   num_splits=3),
    ragged_case_of(new=[1, 7, 2], seqlens=[0, 57, 17], max_len=64, group=8, nheads_kv=1, headdim=32,
                   leftpad=[0, 50, 16], paged=True, dtype=torch.float32, num_splits=7, use_out=True, qkv="fused"),
    ragged_case_of(new=[4, 0, 6], seqlens=[250, 0, 0], max_len=256, page_size=64, paged=True, headdim=8, nheads_kv=1,
                   dtype=torch.float64, num_splits=64, extra=3, cu_as="list"),
    ragged_case_of(new=[2, 3], seqlens=[7, 3], max_len=12, group=3, headdim=16, dtype=torch.bfloat16,
                   cu_as="cpu_tensor", extra=None, scale=0.3),
]


def with_examples(examples, budget):
    def deco(f):
        for ex in reversed(examples):
            if ex["batch"] * ex["nheads_kv"] * ex["max_len"] * ex["headdim"] <= budget:
                f = example(case=ex)(f)
        return f
    return deco


@given(case=ragged_case(ON_CPU_BUDGET, cuda=False))
@with_examples(EDGE_EXAMPLES, ON_CPU_BUDGET)
def test_ragged_matches_definition_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.gpu
@given(case=ragged_case(ON_GPU_BUDGET, cuda=True))
@with_examples([dict(e, headdim=max(32, e["headdim"]), dtype=torch.float16 if e["dtype"] == torch.float64
                     else e["dtype"]) for e in EDGE_EXAMPLES] + [
    # GQA on the tensor-core kernel with idle rows, a long row split over the heuristic's choice
    ragged_case_of(new=[16, 1, 0, 9], seqlens=[1000, 1, 7, 1011], max_len=1024, nheads_kv=1, group=4, headdim=128,
                   num_splits=None, extra=0),
    ragged_case_of(new=[6, 2], seqlens=[1018, 100], max_len=1024, nheads_kv=2, group=8, headdim=96,
                   dtype=torch.bfloat16, num_splits=256, extra=5),
    ragged_case_of(new=[3, 1, 3], seqlens=[500, 0, 1000], max_len=1024, headdim=64, group=4, num_splits=12,
                   paged=True, page_size=64, use_out=True),
], ON_GPU_BUDGET)
def test_ragged_matches_definition_gpu(case):
    run_and_check(case, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_of_each_sequence_and_its_causal_rule(device):
    """Each sequence's rows are its own (swapping two sequences' offsets moves their outputs), and query i
    of a sequence sees exactly i + 1 of the new keys: the definition above would not tell a kernel that
    offsets by max_seqlen_q instead of n_b from one that does it right if the sequences were all as long."""
    hkv, d, n = 1, 16, 24
    g = torch.Generator(device=device).manual_seed(3)
    dtype = torch.float32
    q = torch.randn(5, 2, d, generator=g, device=device, dtype=dtype)
    kn = torch.randn(5, hkv, d, generator=g, device=device, dtype=dtype)
    vn = torch.randn(5, hkv, d, generator=g, device=device, dtype=dtype)
    cache = torch.zeros(2, hkv, n, d, device=device, dtype=dtype)
    cu = torch.tensor([0, 1, 5], dtype=torch.int32, device=device)  # n = [1, 4]
    k, v = cache.clone(), cache.clone()
    out = decode_attention(q, k, v, torch.tensor([0, 0], dtype=torch.int32, device=device), k_new=kn, v_new=vn,
                           cu_seqlens_q=cu, max_seqlen_q=6, num_splits=1)
    # only new keys (cache empty): query i of sequence 1 averages v_new rows 1 .. 1 + i with softmax weights
    for i in range(4):
        rows = slice(1, 2 + i)
        s = (q[1 + i].double() @ kn[rows, 0].double().T) * d ** -0.5
        want = torch.softmax(s, dim=-1) @ vn[rows, 0].double()
        torch.testing.assert_close(out[1 + i].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0].double(), vn[0, 0].double().expand(2, d), atol=1e-6, rtol=1e-6)
    assert torch.equal(k[0, 0, :1], kn[:1, 0]) and torch.equal(k[1, 0, :4], kn[1:, 0])
    assert (k[0, 0, 1:] == 0).all() and (k[1, 0, 4:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("dtype,headdim,group", [(torch.float16, 128, 4), (torch.bfloat16, 64, 1),
                                                 (torch.float32, 64, 8), (torch.float16, 256, 2)])
def test_equal_lengths_equal_the_padded_layout_bitwise_gpu(num_splits, dtype, headdim, group):
    """Every n_b equal to max_seqlen_q: the same grid, rows and kernel as the 4-dim layout, so the same
    output bit for bit and the same appended rows."""
    b, hkv, sn, n = 3, 2, 3, 200
    g = torch.Generator(device="cuda").manual_seed(num_splits)
    q4 = torch.randn(b, hkv * group, sn, headdim, generator=g, device="cuda").to(dtype)
    kn4 = torch.randn(b, hkv, sn, headdim, generator=g, device="cuda").to(dtype)
    vn4 = torch.randn(b, hkv, sn, headdim, generator=g, device="cuda").to(dtype)
    kc = torch.randn(b, hkv, n, headdim, generator=g, device="cuda").to(dtype)
    vc = torch.randn(b, hkv, n, headdim, generator=g, device="cuda").to(dtype)
    lens = torch.tensor([0, 100, n - sn], dtype=torch.int32, device="cuda")
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = decode_attention(q4, k1, v1, lens, k_new=kn4, v_new=vn4, num_splits=num_splits)

    def packed(t):
        return t.transpose(1, 2).reshape(b * sn, t.shape[1], headdim)

    cu = torch.arange(0, b * sn + 1, sn, dtype=torch.int32, device="cuda")
    got = decode_attention(packed(q4), k2, v2, lens, k_new=packed(kn4), v_new=packed(vn4), cu_seqlens_q=cu,
                           max_seqlen_q=sn, num_splits=num_splits)
    assert torch.equal(bits(got), bits(packed(want)))
    assert torch.equal(bits(k2), bits(k1)) and torch.equal(bits(v2), bits(v1))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_cuda_graph_replays_at_new_lengths_and_offsets_gpu(paged, num_splits):
    """One captured call with device lengths and offsets (max_seqlen_q fixed at capture); between replays
    the lengths grow and the offsets change in place (a sequence with no new token among them): every
    replay appends each sequence's tokens at its slots and matches the definition."""
    b, hkv, group, d, n, most, dtype = 3, 2, 4, 128, 256, 5, torch.float16
    g = torch.Generator(device="cuda").manual_seed(7)
    total = b * most
    q = torch.empty(total, hkv * group, d, device="cuda", dtype=dtype)
    kn, vn = (torch.empty(total, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
    k_cache = torch.randn(b, hkv, n, d, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(b, hkv, n, d, generator=g, device="cuda").to(dtype)
    seqlens = torch.tensor([0, 17, 100], dtype=torch.int32, device="cuda")
    cu = torch.tensor(offsets([most] * b), dtype=torch.int32, device="cuda")
    out = torch.full_like(q, math.nan)
    kw = dict(k_new=kn, v_new=vn, cu_seqlens_q=cu, max_seqlen_q=most, num_splits=num_splits, out=out)
    if paged:
        ps = 16
        order = torch.randperm(b * n // ps, generator=torch.Generator().manual_seed(1))
        table = order.view(b, n // ps).to(torch.int32).cuda()
        k_pool = torch.empty(b * n // ps, hkv, ps, d, device="cuda", dtype=dtype)
        v_pool = torch.empty_like(k_pool)
        for i in range(b):
            for blk in range(n // ps):
                k_pool[table[i, blk]] = k_cache[i, :, blk * ps:(blk + 1) * ps]
                v_pool[table[i, blk]] = v_cache[i, :, blk * ps:(blk + 1) * ps]
        kc, vc = k_pool, v_pool
        kw["block_table"] = table
    else:
        kc, vc = k_cache, v_cache

    def step():
        decode_attention(q, kc, vc, seqlens, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (loads the library) on a side stream, as torch.cuda.graphs asks
        k_keep, v_keep = kc.clone(), vc.clone()
        step()
        kc.copy_(k_keep), vc.copy_(v_keep)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, new in enumerate([[5, 5, 5], [1, 0, 3], [0, 2, 5], [3, 1, 1]]):
        for x in (q, kn, vn):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        cu_host = offsets(new)
        # the packed rows past cu[b] are not any sequence's: whatever they hold, unread
        cu.copy_(torch.tensor(cu_host, dtype=torch.int32))
        lens = seqlens.tolist()
        k_log = logical(kc, table, ps, b, n) if paged else kc.clone()
        v_log = logical(vc, table, ps, b, n) if paged else vc.clone()
        out.fill_(math.nan)
        graph.replay()
        case = ragged_case_of(new=new, seqlens=lens, max_len=n, nheads_kv=hkv, group=group, headdim=d, dtype=dtype,
                              append=True, scale=None)
        live = cu_host[-1]
        want, magnitude, peer, smax, k_after, v_after = definition(case, q[:live], k_log.cpu(), v_log.cpu(),
                                                                   kn[:live], vn[:live], None)
        k_now = logical(kc, table, ps, b, n) if paged else kc
        v_now = logical(vc, table, ps, b, n) if paged else vc
        assert torch.equal(k_now.cpu(), k_after) and torch.equal(v_now.cpu(), v_after), f"replay {t}: the append"
        assert out[live:].isnan().all(), f"replay {t}: rows past cu[batch] written"
        assert_attention_close(out[:live], peer.cuda(), want.cuda(), magnitude.cuda(), smax.cuda(),
                               f"replay {t} new={new} lengths={lens}")
        seqlens.add_(torch.tensor(new, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 20])  # one split, merged in a cluster, through the combine kernel
@pytest.mark.parametrize("group", [1, 8])
def test_out_of_range_device_offsets_give_nan_and_no_write_gpu(num_splits, group):
    """Device offsets are not read on the host: a sequence whose offsets decrease, leave [0, total_q] or
    exceed max_seqlen_q gets no append and NaN in the rows it can be given (none when its offsets leave q);
    the other sequences are computed; no row outside q's is written (out is a view of a larger buffer)."""
    hkv, d, n, most, dtype = 2, 64, 64, 3, torch.float16
    g = torch.Generator(device="cuda").manual_seed(2)
    #       ok   n_b 4 > 3   decreasing  ok     past total_q
    cu = [0, 2, 6, 5, 7, 40]
    b, total = len(cu) - 1, 9
    q = torch.randn(total, hkv * group, d, generator=g, device="cuda").to(dtype)
    kn = torch.randn(total, hkv, d, generator=g, device="cuda").to(dtype)
    vn = torch.randn(total, hkv, d, generator=g, device="cuda").to(dtype)
    k_cache = torch.randn(b, hkv, n, d, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(b, hkv, n, d, generator=g, device="cuda").to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    buffer = torch.full((total + 8, hkv * group, d), 7.0, device="cuda", dtype=dtype)
    out = buffer[4:4 + total]
    seqlens = [10, 10, 10, 10, 10]
    decode_attention(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32, device="cuda"), k_new=kn,
                     v_new=vn, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"), max_seqlen_q=most,
                     num_splits=num_splits, out=out)
    torch.cuda.synchronize()
    assert (buffer[:4] == 7).all() and (buffer[4 + total:] == 7).all(), "rows outside out written"
    assert out[2:5].isnan().all(), "sequence 1 (n_b 4 > max_seqlen_q 3): NaN in its first 3 rows"
    for i in (1, 2, 4):
        assert torch.equal(k_cache[i], k0[i]) and torch.equal(v_cache[i], v0[i]), f"sequence {i}: no append"
    for i in (0, 3):
        case = ragged_case_of(new=[cu[i + 1] - cu[i]], seqlens=[10], max_len=n, nheads_kv=hkv, group=group,
                              headdim=d, dtype=dtype, append=True, scale=None)
        rows = slice(cu[i], cu[i + 1])
        want, magnitude, peer, smax, k_after, v_after = definition(case, q[rows], k0[i:i + 1].cpu(),
                                                                   v0[i:i + 1].cpu(), kn[rows], vn[rows], None)
        assert torch.equal(k_cache[i:i + 1].cpu(), k_after) and torch.equal(v_cache[i:i + 1].cpu(), v_after)
        assert_attention_close(out[rows], peer.cuda(), want.cuda(), magnitude.cuda(), smax.cuda(), f"sequence {i}")


def _call(device, cu=(0, 1, 3), max_seqlen_q=None, q_rows=3, **kw):
    """A ragged call with batch 2 (the cache's), q [q_rows, 4, 8], caches [2, 2, 16, 8], lengths [3, 5]."""
    z = dict(device=device, dtype=torch.float32)
    args = dict(k_new=torch.zeros(q_rows, 2, 8, **z), v_new=torch.zeros(q_rows, 2, 8, **z))
    args.update(kw)
    q = args.pop("q", torch.zeros(q_rows, 4, 8, **z))
    return decode_attention(q, torch.zeros(2, 2, 16, 8, **z), torch.zeros(2, 2, 16, 8, **z),
                            args.pop("cache_seqlens", [3, 5]), cu_seqlens_q=cu, max_seqlen_q=max_seqlen_q, **args)


def _dev_cu(values, device, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=device)


BAD_INPUTS = [
    ("cu-type", lambda d: _call(d, cu="0,1,3"), TypeError,
     r"cu_seqlens_q must be a sequence of ints or a tensor, got str"),
    ("cu-float-host", lambda d: _call(d, cu=torch.tensor([0.0, 1.0, 3.0])), ValueError,
     r"cu_seqlens_q must have an integer dtype \(torch.int32 on the device\), got torch.float32"),
    ("cu-length", lambda d: _call(d, cu=[0, 3]), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\) = \(3,\), got \(2,\)"),
    ("cu-length-device", lambda d: _call(d, cu=_dev_cu([0, 1, 2, 3], d), max_seqlen_q=2), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\) = \(3,\), got \(4,\)"),
    ("cu-start", lambda d: _call(d, cu=[1, 2, 3]), ValueError, r"cu_seqlens_q must start at 0, got 1"),
    ("cu-decreasing", lambda d: _call(d, cu=[0, 3, 2], q_rows=2), ValueError,
     r"cu_seqlens_q must be non-decreasing, got 3 then 2 at batch index 1"),
    ("cu-end", lambda d: _call(d, cu=[0, 1, 2]), ValueError, r"cu_seqlens_q must end at q's total_q \(3\), got 2"),
    ("max_seqlen_q-small", lambda d: _call(d, max_seqlen_q=1), ValueError,
     r"max_seqlen_q must be at least the longest sequence's new tokens \(2\), got 1"),
    ("max_seqlen_q-type", lambda d: _call(d, max_seqlen_q=2.0), ValueError,
     r"max_seqlen_q must be an int in \[0, 2\*\*20\) with cu_seqlens_q, got 2.0"),
    ("max_seqlen_q-without-cu", lambda d: decode_attention(
        torch.zeros(2, 4, 1, 8, device=d), torch.zeros(2, 2, 16, 8, device=d), torch.zeros(2, 2, 16, 8, device=d),
        [3, 5], max_seqlen_q=1), ValueError, r"max_seqlen_q must be None without cu_seqlens_q, got 1"),
    ("q-dims", lambda d: _call(d, q=torch.zeros(2, 4, 1, 8, device=d)), ValueError,
     r"q must have 3 dims \[total_q, nheads_q, headdim\], got \(2, 4, 1, 8\)"),
    ("k_new-shape", lambda d: _call(d, k_new=torch.zeros(2, 2, 8, device=d)), ValueError,
     r"k_new must have shape \(total_q, nheads_kv, headdim\) = \(3, 2, 8\), got \(2, 2, 8\)"),
    ("k_new-dims", lambda d: _call(d, k_new=torch.zeros(2, 2, 1, 8, device=d)), ValueError,
     r"k_new must have 3 dims \[total_q, nheads_kv, headdim\], got \(2, 2, 1, 8\)"),
    ("out-shape", lambda d: _call(d, out=torch.zeros(2, 4, 8, device=d)), ValueError,
     r"out must have q's shape \(3, 4, 8\), got \(2, 4, 8\)"),
    ("cache_seqlens-batch", lambda d: _call(d, cache_seqlens=[3, 5, 1]), ValueError,
     r"cache_seqlens must have one length per sequence \(2\), got 3"),
    # the append of sequence 1 (2 tokens at slot 15) would pass max_len 16
    ("cache_seqlens-append-range", lambda d: _call(d, cache_seqlens=[3, 15]), ValueError,
     r"cache_seqlens must be in \[0, max_len - n_b = 16 - 2\] for every sequence, got 15 at batch index 1"),
    ("cu-device-validate", lambda d: _call(d, cu=_dev_cu([0, 2, 1], d), q_rows=1, max_seqlen_q=2, validate=True),
     ValueError, r"cu_seqlens_q must be non-decreasing, got 2 then 1 at batch index 1"),
    ("max_seqlen_q-device-validate", lambda d: _call(d, cu=_dev_cu([0, 1, 3], d), max_seqlen_q=1, validate=True),
     ValueError, r"max_seqlen_q must be at least the longest sequence's new tokens \(2\), got 1"),
]


# A tensor on q's device is read by the kernel only (on the CPU, a CPU tensor is host values: checked as above).
DEVICE_BAD_INPUTS = [
    ("cu-dtype-device", lambda d: _call(d, cu=_dev_cu([0, 1, 3], d, torch.int64), max_seqlen_q=2), ValueError,
     r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    ("cu-stride-device", lambda d: _call(d, cu=_dev_cu([0, 9, 1, 9, 3, 9], d)[::2], max_seqlen_q=2), ValueError,
     r"cu_seqlens_q must be contiguous, got strides \(2,\)"),
    ("max_seqlen_q-missing", lambda d: _call(d, cu=_dev_cu([0, 1, 3], d)), ValueError,
     r"max_seqlen_q must be given with a device cu_seqlens_q \(it sizes the grid\), got None"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,call,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_ragged_inputs_raise(device, name, call, exc, match):
    _call(device)  # the unchanged call runs
    with pytest.raises(exc, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("name,call,exc,match", DEVICE_BAD_INPUTS, ids=[b[0] for b in DEVICE_BAD_INPUTS])
def test_bad_device_offsets_raise_gpu(name, call, exc, match):
    _call("cuda", cu=_dev_cu([0, 1, 3], "cuda"), max_seqlen_q=2)  # the unchanged call runs
    with pytest.raises(exc, match=match):
        call("cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_ragged_inputs_through_the_op(device):
    """The op itself (no wrapper): the CPU kernel and the fake kernel through check_args, the C++ launcher on
    CUDA, with the same messages; the CPU kernel reads the offsets (host values there) and checks them."""
    ops = torch.ops.fused_attn
    z = dict(device=device, dtype=torch.float16)
    q, cache = torch.zeros(3, 4, 64, **z), torch.zeros(2, 2, 16, 64, **z)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)

    def run(q=q, cu_seqlens_q=cu, max_seqlen_q=2, k_new=None):
        ops.decode_attention(q, cache, cache.clone(), lens, k_new, k_new, None, None, None, 0, None, cu_seqlens_q,
                             max_seqlen_q)

    run()
    cases = [
        (dict(cu_seqlens_q=cu.long()), r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
        (dict(cu_seqlens_q=cu[:2]), r"cu_seqlens_q must have shape \(batch \+ 1,\) = \(3,\), got \(2,\)"),
        (dict(max_seqlen_q=-1), r"max_seqlen_q must be an int in \[0, 2\*\*20\) with cu_seqlens_q, got -1"),
        (dict(q=torch.zeros(3, 4, 1, 64, **z)), r"q must have 3 dims \[total_q, nheads_q, headdim\], got "
                                                r"\(3, 4, 1, 64\)"),
        (dict(k_new=torch.zeros(3, 2, 1, 64, **z)), r"k_new must have 3 dims \[total_q, nheads_kv, headdim\]"),
        (dict(q=torch.zeros(2, 4, 1, 64, **z), cu_seqlens_q=None),
         r"max_seqlen_q must be 0 \(unused\) without cu_seqlens_q, got 2"),
    ]
    for changes, match in cases:
        with pytest.raises((ValueError, RuntimeError), match=match):
            run(**changes)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"max_seqlen_q must be at least the longest sequence's new tokens"):
            run(max_seqlen_q=1)
        with pytest.raises(ValueError, match=r"cu_seqlens_q must end at q's total_q \(3\), got 4"):
            run(cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32))


def test_opcheck_ragged():
    """The schema's cu_seqlens_q / max_seqlen_q through opcheck (the CPU path; the fake kernel's packed
    shape), with a paged cache too, and meta tensors."""
    ops = torch.ops.fused_attn
    g = torch.Generator().manual_seed(0)
    q, cache = torch.randn(5, 4, 16, generator=g), torch.randn(3, 2, 16, 16, generator=g)
    kn, vn = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    lens = torch.tensor([3, 0, 12], dtype=torch.int32)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    args = (q, cache, cache.clone(), lens, kn, vn, None, None, None, 0, None, cu, 4)
    torch.library.opcheck(ops.decode_attention.default, args)
    torch.library.opcheck(ops.decode_attention_out.default, args, dict(out=torch.empty_like(q)))
    pool, table = torch.randn(4, 2, 16, 16, generator=g), torch.tensor([[3], [-1], [0]], dtype=torch.int32)
    torch.library.opcheck(ops.decode_attention.default, (q, pool, pool.clone(), lens, kn, vn, None, None, None, 0,
                                                         table, cu, 3))
    m = dict(device="meta", dtype=torch.float16)
    out = ops.decode_attention(torch.empty(7, 8, 64, **m), torch.empty(3, 2, 32, 64, **m),
                               torch.empty(3, 2, 32, 64, **m), torch.empty(3, device="meta", dtype=torch.int32),
                               cu_seqlens_q=torch.empty(4, device="meta", dtype=torch.int32), max_seqlen_q=4)
    assert out.shape == (7, 8, 64) and out.device.type == "meta"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_ragged(device):
    """Under torch.compile(fullgraph=True) with tensor offsets (no graph break), the packed output and the
    append as in eager mode."""
    torch._dynamo.reset()
    g = torch.Generator(device=device).manual_seed(4)
    q = torch.randn(6, 4, 32, generator=g, device=device)
    kn, vn = torch.randn(6, 2, 32, generator=g, device=device), torch.randn(6, 2, 32, generator=g, device=device)
    cache = torch.randn(3, 2, 40, 32, generator=g, device=device)
    lens = torch.tensor([5, 0, 30], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4, 4, 6], dtype=torch.int32, device=device)

    def f(q, k, v, lens, kn, vn, cu):
        return decode_attention(q, k, v, lens, k_new=kn, v_new=vn, cu_seqlens_q=cu, max_seqlen_q=4) * 2

    k1, v1, k2, v2 = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    want = f(q, k1, v1, lens, kn, vn, cu)
    got = torch.compile(f, fullgraph=True)(q, k2, v2, lens, kn, vn, cu)
    torch.testing.assert_close(got, want)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
