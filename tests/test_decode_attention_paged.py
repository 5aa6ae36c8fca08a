"""decode_attention over a paged KV cache (block_table): page pools [num_pages, nheads_kv, page_size,
headdim] whose pages are handed out in random order, against a float64 definition written here (the
logical cache gathered from the pages by this file, then one query at a time with
``F.scaled_dot_product_attention``); the append written into the right page and nothing else; the
paged result equal bit for bit to the contiguous layout's on the GPU; CUDA graphs; block_table entries
out of range (NaN and no write on the device, ValueError for host-checked ones); opcheck."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn.decode_attention import decode_attention
from tests.test_decode_attention import (DTYPES, POISON, SPLITS, bits, case_of, key_mask_of, make_inputs,
                                         peer_attention, score_max)
from tests.tolerances import assert_attention_close

PAGE_SIZES = [16, 32, 64, 128, 256]
ON_CPU_BUDGET = 1 << 14  # cache elements (batch x nheads_kv x max_len x headdim) per example
ON_GPU_BUDGET = 1 << 19


@st.composite
def paged_case(draw, budget, cuda):
    """One call's shapes, lengths (0, the full cache, or any) and options, and how its pages are laid out."""
    page_size = draw(st.sampled_from(PAGE_SIZES))
    batch = draw(st.integers(1, 3))
    nheads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 4, 8, 3]))  # MHA, GQA, an odd group
    seqlen_new = draw(st.one_of(st.just(1), st.integers(1, 8)))
    if cuda:
        headdim = draw(st.sampled_from([32, 64, 128, 256, 80]))
    else:
        headdim = draw(st.one_of(st.sampled_from([8, 16, 32]), st.integers(1, 24)))
    blocks_cap = max(1, budget // (batch * nheads_kv * headdim * page_size))
    max_blocks = draw(st.integers(1, min(blocks_cap, 6)))
    max_len = max_blocks * page_size
    append = draw(st.booleans())
    hi = max_len - (seqlen_new if append else 0)
    seqlens = [draw(st.one_of(st.sampled_from([0, hi, max(hi - 1, 0)]), st.integers(0, hi))) for _ in range(batch)]
    leftpad = None
    if draw(st.booleans()):
        leftpad = [draw(st.one_of(st.just(0), st.just(n), st.integers(0, n))) for n in seqlens]
    return case_of(
        batch=batch, nheads_kv=nheads_kv, group=group, seqlen_new=seqlen_new, headdim=headdim, max_len=max_len,
        seqlens=seqlens, leftpad=leftpad, append=append,
        dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
        num_splits=draw(st.sampled_from(SPLITS)), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        qkv="fused" if draw(st.booleans()) else "contiguous", use_out=draw(st.booleans()),
        key_mask=draw(st.sampled_from([None, None, 0.5, 1.0])), seed=draw(st.integers(0, 2**31 - 1)),
        page_size=page_size, spare_pages=draw(st.integers(0, 3)),
        # the entries of blocks a sequence never reads: -1 (vLLM's padding), or past the pool
        unused_entry=draw(st.sampled_from(["minus_one", "past_the_pool"])),
        # hnd: pools [num_pages, nheads_kv, page_size, headdim]; nhd: a view of [num_pages, page_size, nheads_kv,
        # headdim] (vLLM's and SGLang's token-major pages) transposed into that shape
        pool_layout=draw(st.sampled_from(["hnd", "nhd"])),
    )


def pages_of(case, k_cache, v_cache):
    """The page pools holding the contiguous caches' slots [leftpad, end) and the block_table, the pages
    in a random order (from the seed); rows no sequence owns hold NaN."""
    b, ps = case["batch"], case["page_size"]
    max_blocks = case["max_len"] // ps
    num_pages = b * max_blocks + case["spare_pages"]
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(case["seed"] + 2)).tolist()
    unused = -1 if case["unused_entry"] == "minus_one" else num_pages + 7
    table = torch.full((b, max_blocks), unused, dtype=torch.int32)
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    if case.get("pool_layout", "hnd") == "nhd":
        k_pool, v_pool = (torch.full((num_pages, ps, hkv, d), POISON, dtype=k_cache.dtype,
                                     device=k_cache.device).transpose(1, 2) for _ in range(2))
    else:
        k_pool, v_pool = (torch.full((num_pages, hkv, ps, d), POISON, dtype=k_cache.dtype, device=k_cache.device)
                          for _ in range(2))
    sn = case["seqlen_new"] if case["append"] else 0
    for i in range(b):
        start, end = (case["leftpad"] or [0] * b)[i], case["seqlens"][i] + sn
        for blk in range(start // ps, (end + ps - 1) // ps if end > start else 0):
            page = order[i * max_blocks + blk]
            table[i, blk] = page
            k_pool[page] = k_cache[i, :, blk * ps:(blk + 1) * ps]
            v_pool[page] = v_cache[i, :, blk * ps:(blk + 1) * ps]
    return k_pool, v_pool, table.to(k_cache.device)


def logical(pool, table, page_size, batch, max_len):
    """The contiguous cache [batch, nheads_kv, max_len, headdim] the pages hold (entries out of the pool:
    zeros, never seen)."""
    out = pool.new_zeros(batch, pool.shape[1], max_len, pool.shape[3])
    for i in range(batch):
        for blk, page in enumerate(table[i].tolist()):
            if 0 <= page < pool.shape[0]:
                out[i, :, blk * page_size:(blk + 1) * page_size] = pool[page]
    return out


def appended_pool(pool, new, table, seqlens, page_size):
    """The pool after the append, bit for bit: new token t of sequence b at slot seqlens[b] + t."""
    want = pool.clone()
    if new is not None:
        for i, n in enumerate(seqlens):
            for t in range(new.shape[2]):
                s = n + t
                want[int(table[i, s // page_size]), :, s % page_size] = new[i, :, t]
    return want


def definition(q, k_all, v_all, seqlens, leftpad, appended, key_mask, scale):
    """float64, query by query: query i of sequence b sees slots leftpad[b] .. end - seqlen_new + i of
    the logical cache after the append (k_all / v_all), key_mask permitting; none visible: zeros."""
    b, hq, sn, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    q, k_all, v_all = q.double(), k_all.double(), v_all.double()
    out = torch.zeros_like(q)
    for i in range(b):
        end = seqlens[i] + (sn if appended else 0)
        for t in range(sn):
            slots = [j for j in range((leftpad or [0] * b)[i], end - sn + t + 1)
                     if key_mask is None or key_mask[min(i, key_mask.shape[0] - 1), j]]
            if slots:
                out[i, :, t:t + 1] = F.scaled_dot_product_attention(
                    q[i:i + 1, :, t:t + 1], k_all[i:i + 1, :, slots], v_all[i:i + 1, :, slots], scale=scale,
                    enable_gqa=True)[0]
    return out


def run_and_check(case, device):
    q, k_cache, v_cache, seqlens, leftpad, k_new, v_new = make_inputs(case, device)
    k_pool, v_pool, table = pages_of(case, k_cache, v_cache)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    ps, b, n, appended = case["page_size"], case["batch"], case["max_len"], k_new is not None
    key_mask = key_mask_of(case)
    out = torch.full(q.shape, POISON, dtype=q.dtype, device=device) if case["use_out"] else None
    got = decode_attention(q, k_pool, v_pool, seqlens.to(device), k_new=k_new, v_new=v_new,
                           cache_leftpad=None if leftpad is None else leftpad.to(device), scale=case["scale"],
                           key_mask=None if key_mask is None else key_mask.to(device),
                           num_splits=case["num_splits"], out=out, block_table=table)
    assert out is None or got is out
    where = (f"b={b} hkv={case['nheads_kv']} group={case['group']} sn={case['seqlen_new']} d={case['headdim']} "
             f"page_size={ps} max_len={n} seqlens={case['seqlens']} leftpad={case['leftpad']} append={appended} "
             f"{case['dtype']} splits={case['num_splits']} key_mask={case['key_mask']} table={table.tolist()}")
    k_want = appended_pool(k_before, k_new, table, case["seqlens"], ps)
    v_want = appended_pool(v_before, v_new, table, case["seqlens"], ps)
    assert torch.equal(bits(k_pool), bits(k_want)), f"{where}: k pool after the call"
    assert torch.equal(bits(v_pool), bits(v_want)), f"{where}: v pool after the call"
    assert not got.isnan().any(), f"{where}: NaN in the output (a poisoned row read, or out not written)"
    k_all, v_all = logical(k_want, table, ps, b, n), logical(v_want, table, ps, b, n)
    lp = case["leftpad"]
    want = definition(q, k_all, v_all, case["seqlens"], lp, appended, key_mask, case["scale"])
    magnitude = definition(q, k_all, v_all.abs(), case["seqlens"], lp, appended, key_mask, case["scale"])
    peer = peer_attention(q, k_all, v_all, seqlens, leftpad, appended, case["scale"],
                          None if key_mask is None else key_mask.to(device))
    smax = score_max(q, k_all, seqlens, leftpad, appended, case["scale"],
                     None if key_mask is None else key_mask.to(device))
    assert_attention_close(got, peer, want.to(device), magnitude.to(device), smax, where)


def paged_case_of(**kw):
    base = dict(page_size=16, spare_pages=1, unused_entry="minus_one", key_mask=None)
    base.update(kw)
    return case_of(**base)


EDGE_EXAMPLES = [
    paged_case_of(seqlens=[0, 0], append=False, max_len=32),  # no key at all: zeros
    paged_case_of(seqlens=[28, 25], seqlen_new=4, max_len=32, leftpad=[0, 3]),  # one full cache after the append
    paged_case_of(seqlens=[64, 0], append=False, max_len=64, page_size=32, unused_entry="past_the_pool",
                  pool_layout="nhd"),
    # pages smaller than the kernels' tiles (64 keys), GQA on the tensor-core kernel (CUDA), appends across pages
    paged_case_of(batch=3, nheads_kv=1, group=8, seqlens=[0, 47, 17], seqlen_new=5, max_len=64, num_splits=3,
                  leftpad=[0, 40, 16], headdim=32, dtype=torch.float32, use_out=True),
    paged_case_of(batch=1, seqlens=[250], seqlen_new=6, max_len=256, page_size=256, num_splits=7, headdim=8,
                  dtype=torch.float64, key_mask=0.5),
    paged_case_of(batch=2, group=4, seqlens=[100, 127], seqlen_new=1, max_len=128, page_size=64, headdim=16,
                  dtype=torch.bfloat16, num_splits=64),
]


def with_examples(examples, budget):
    def deco(f):
        for ex in reversed(examples):
            if ex["batch"] * ex["nheads_kv"] * ex["max_len"] * ex["headdim"] <= budget:
                f = example(case=ex)(f)
        return f
    return deco


@given(case=paged_case(ON_CPU_BUDGET, cuda=False))
@with_examples(EDGE_EXAMPLES, ON_CPU_BUDGET)
def test_paged_matches_definition_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.gpu
@given(case=paged_case(ON_GPU_BUDGET, cuda=True))
@with_examples([dict(e, headdim=max(32, e["headdim"]), dtype=torch.float16 if e["dtype"] == torch.float64
                     else e["dtype"]) for e in EDGE_EXAMPLES], ON_GPU_BUDGET)
def test_paged_matches_definition_gpu(case):
    run_and_check(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("dtype,headdim", [(torch.float16, 128), (torch.bfloat16, 64), (torch.float32, 64)])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_equals_contiguous_bitwise_gpu(page_size, num_splits, dtype, headdim, group):
    """The same cache laid out in pages gives the contiguous layout's output bit for bit (same kernel
    build, same tiles: only the row addresses differ), and the same appended rows. Batch 3 (< the wide
    build's 16: the paged cache has the 128-thread build only)."""
    case = paged_case_of(batch=3, nheads_kv=2, group=group, seqlen_new=3, headdim=headdim, max_len=4 * page_size,
                         seqlens=[0, 2 * page_size + 5, 4 * page_size - 3], leftpad=[0, 7, 1], dtype=dtype,
                         num_splits=num_splits, page_size=page_size, spare_pages=2, seed=page_size + num_splits)
    q, k_cache, v_cache, seqlens, leftpad, k_new, v_new = make_inputs(case, "cuda")
    k_pool, v_pool, table = pages_of(case, k_cache, v_cache)
    lengths, pad = seqlens.cuda(), leftpad.cuda()
    got = decode_attention(q, k_pool, v_pool, lengths, k_new=k_new, v_new=v_new, cache_leftpad=pad,
                           num_splits=num_splits, block_table=table)
    want = decode_attention(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, cache_leftpad=pad,
                            num_splits=num_splits)
    assert torch.equal(bits(got), bits(want))
    ps, n = page_size, case["max_len"]
    for i, (s, lp) in enumerate(zip(case["seqlens"], case["leftpad"])):
        lo, hi = lp, s + 3
        assert torch.equal(bits(logical(k_pool, table, ps, 3, n)[i, :, lo:hi]), bits(k_cache[i, :, lo:hi]))
        assert torch.equal(bits(logical(v_pool, table, ps, 3, n)[i, :, lo:hi]), bits(v_cache[i, :, lo:hi]))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_paged_cuda_graph_replays_at_growing_lengths_gpu(page_size, num_splits):
    """One captured call with device-side lengths and block_table; between replays the lengths grow in
    place (3 new tokens a step, across page boundaries) and new pages are handed out by editing the
    table in place: every replay appends into the right page and matches the definition."""
    b, hkv, group, max_blocks, d, sn, dtype = 3, 2, 4, 8, 128, 3, torch.float16
    n = max_blocks * page_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_pages = b * max_blocks + 2
    k_pool = torch.randn(num_pages, hkv, page_size, d, generator=gen, device="cuda").to(dtype)
    v_pool = torch.randn(num_pages, hkv, page_size, d, generator=gen, device="cuda").to(dtype)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[:b * max_blocks]
    full_table = order.view(b, max_blocks).to(torch.int32).cuda()
    table = torch.full((b, max_blocks), -1, dtype=torch.int32, device="cuda")
    q = torch.empty(b, hkv * group, sn, d, device="cuda", dtype=dtype)
    kn, vn = (torch.empty(b, hkv, sn, d, device="cuda", dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([0, 1, page_size - 2], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def hand_out_pages():  # the blocks the next step reads or writes get their pages
        blocks = (seqlens + sn + page_size - 1) // page_size
        used = torch.arange(max_blocks, device="cuda").view(1, -1) < blocks.view(-1, 1)
        table.copy_(torch.where(used, full_table, -1))

    def step():
        decode_attention(q, k_pool, v_pool, seqlens, k_new=kn, v_new=vn, num_splits=num_splits, out=out,
                         block_table=table)

    hand_out_pages()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (loads the library) on a side stream, as torch.cuda.graphs asks
        k_keep, v_keep = k_pool.clone(), v_pool.clone()
        step()
        k_pool.copy_(k_keep), v_pool.copy_(v_keep)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for t in range(6):
        for x in (q, kn, vn):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        hand_out_pages()
        k0, v0, lens = k_pool.clone(), v_pool.clone(), seqlens.tolist()
        out.fill_(math.nan)
        g.replay()
        k_want, v_want = (appended_pool(p, x, table, lens, page_size) for p, x in ((k0, kn), (v0, vn)))
        assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want), f"replay {t}: the append"
        k_all, v_all = logical(k_want, table, page_size, b, n), logical(v_want, table, page_size, b, n)
        want = definition(q, k_all, v_all, lens, None, True, None, None).cuda()
        magnitude = definition(q, k_all, v_all.abs(), lens, None, True, None, None).cuda()
        lens_t = torch.tensor(lens, dtype=torch.int32)
        assert_attention_close(out, peer_attention(q, k_all, v_all, lens_t, None, True, None), want, magnitude,
                               score_max(q, k_all, lens_t, None, True, None), f"replay {t} at lengths {lens}")
        seqlens.add_(sn if t < 3 else page_size + 1)


def _pool_inputs(seed, num_pages, b, hkv, group, ps, d, sn, dtype):
    """k_pool, v_pool [num_pages, hkv, ps, d], q [b, hkv x group, sn, d], k_new, v_new [b, hkv, sn, d] on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pools = [torch.randn(num_pages, hkv, ps, d, generator=gen, device="cuda").to(dtype) for _ in range(2)]
    q = torch.randn(b, hkv * group, sn, d, generator=gen, device="cuda").to(dtype)
    new = [torch.randn(b, hkv, sn, d, generator=gen, device="cuda").to(dtype) for _ in range(2)]
    return (*pools, q, *new)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, 20])  # one split, merged in a cluster, through the combine kernel
@pytest.mark.parametrize("group", [1, 8])
def test_out_of_range_pages_give_nan_and_no_write_gpu(dtype, num_splits, group):
    """Device-side block_table entries are not read on the host: a sequence with an entry out of [0,
    num_pages) among the pages it reads or writes gets NaN outputs and no page is written for it; an
    out-of-range entry of a block it never touches changes nothing; the other sequences are computed."""
    ps, max_blocks, hkv, d, sn = 16, 4, 2, 64, 3
    b = 5
    num_pages = b * max_blocks
    k_pool, v_pool, q, kn, vn = _pool_inputs(1, num_pages, b, hkv, group, ps, d, sn, dtype)
    table = torch.arange(num_pages, dtype=torch.int32).view(b, max_blocks)
    seqlens = [20, 20, 20, 20, 14]
    #   ok  read page negative  append page past the pool  unused block bad (ok)  append page = -1 (2nd block)
    table[1, 0] = -5
    table[2, 1] = num_pages
    table[3, 3] = 2**31 - 1
    table[4, 1] = -1
    bad = [False, True, True, False, True]
    table = table.cuda()
    k0, v0 = k_pool.clone(), v_pool.clone()
    out = torch.full_like(q, 7.0)
    decode_attention(q, k_pool, v_pool, torch.tensor(seqlens, dtype=torch.int32, device="cuda"), k_new=kn, v_new=vn,
                     num_splits=num_splits, out=out, block_table=table)
    good = [i for i in range(b) if not bad[i]]
    for i in range(b):
        if bad[i]:
            assert out[i].isnan().all(), f"sequence {i}: NaN outputs expected"
    k_want = appended_pool(k0, kn[good], table[good], [seqlens[i] for i in good], ps)
    v_want = appended_pool(v0, vn[good], table[good], [seqlens[i] for i in good], ps)
    assert torch.equal(bits(k_pool), bits(k_want)) and torch.equal(bits(v_pool), bits(v_want))
    k_all, v_all = logical(k_want, table, ps, b, max_blocks * ps), logical(v_want, table, ps, b, max_blocks * ps)
    want = definition(q, k_all, v_all, seqlens, None, True, None, None).cuda()
    magnitude = definition(q, k_all, v_all.abs(), seqlens, None, True, None, None).cuda()
    lens_t = torch.tensor(seqlens, dtype=torch.int32)
    idx = torch.tensor(good, device="cuda")
    assert_attention_close(out[idx], peer_attention(q, k_all, v_all, lens_t, None, True, None)[idx], want[idx],
                           magnitude[idx], score_max(q, k_all, lens_t, None, True, None)[idx], "in-range sequences")



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [3, 20])  # merged in a cluster, through the combine kernel
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("entry", [-3, "num_pages"])
@pytest.mark.parametrize("append", [True, False])
def test_bad_page_read_by_a_later_split_gives_nan_gpu(dtype, num_splits, group, entry, append):
    """An entry out of the pool among the pages only a later split reads (slots 160-175 of 224: the first split
    covers at most the first 128) still makes every row of its sequence NaN and leaves its pages unwritten,
    whatever kernel (CUDA cores at group 1, tensor cores at group 8 in 16-row chunks) and merge serve it, and
    with no append too (the CUDA-core kernel's first split checks the rest of the sequence's entries only for
    its append: there the later split's own check is what finds it)."""
    ps, max_blocks, hkv, d, sn = 16, 16, 2, 64, 3
    b = 2
    num_pages = b * max_blocks
    k_pool, v_pool, q, kn, vn = _pool_inputs(3, num_pages, b, hkv, group, ps, d, sn, dtype)
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).to(torch.int32).view(b, max_blocks)
    table[1, 10] = num_pages if entry == "num_pages" else entry
    table = table.cuda()
    seqlens = [221, 221] if append else [224, 224]  # the same slots read either way
    k0, v0 = k_pool.clone(), v_pool.clone()
    out = torch.full_like(q, 7.0)
    new = {"k_new": kn, "v_new": vn} if append else {"k_new": None, "v_new": None}
    decode_attention(q, k_pool, v_pool, torch.tensor(seqlens, dtype=torch.int32, device="cuda"), **new,
                     num_splits=num_splits, out=out, block_table=table)
    assert out[1].isnan().all(), "sequence 1: NaN outputs expected in every row"
    if append:
        k_want = appended_pool(k0, kn[:1], table[:1], seqlens[:1], ps)
        v_want = appended_pool(v0, vn[:1], table[:1], seqlens[:1], ps)
    else:
        k_want, v_want = k0, v0
    assert torch.equal(bits(k_pool), bits(k_want)) and torch.equal(bits(v_pool), bits(v_want))
    k_all = logical(k_want, table[:1], ps, 1, max_blocks * ps)
    v_all = logical(v_want, table[:1], ps, 1, max_blocks * ps)
    want = definition(q[:1], k_all, v_all, seqlens[:1], None, append, None, None).cuda()
    magnitude = definition(q[:1], k_all, v_all.abs(), seqlens[:1], None, append, None, None).cuda()
    lens_t = torch.tensor(seqlens[:1], dtype=torch.int32)
    assert_attention_close(out[:1], peer_attention(q[:1], k_all, v_all, lens_t, None, append, None), want, magnitude,
                           score_max(q[:1], k_all, lens_t, None, append, None), "the in-range sequence")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [3, 20])  # merged in a cluster, through the combine kernel
@pytest.mark.parametrize("where", ["first single", "staged group", "later group", "last single"])
def test_bad_page_anywhere_in_a_long_table_gives_nan_gpu(num_splits, where):
    """The tensor-core kernel's first split checks a long sequence's entries in parts: the 16-byte groups of four
    (the first 128 a block staged before its loop, the others loaded after it) and up to three single entries at
    either end of them. A row of the table that starts off a 16-byte boundary (a view with row stride 603) puts
    entry 0 before the groups and the last three after them. An entry out of the pool in any part makes every row
    of its sequence NaN and leaves its pages unwritten; the other sequence is computed as with a good table."""
    ps, d, hkv, group, sn, b, n_entries, stride = 16, 64, 1, 8, 1, 2, 600, 603
    seqlen = n_entries * ps - sn  # the append fills the last page's last slot
    num_pages = b * n_entries
    k_pool, v_pool, q, kn, vn = _pool_inputs(5, num_pages, b, hkv, group, ps, d, sn, torch.float16)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)).to(torch.int32).view(b, n_entries)
    table = torch.zeros(b * stride, dtype=torch.int32, device="cuda").as_strided((b, n_entries), (stride, 1))
    table.copy_(order)
    assert table[1].data_ptr() % 16 == 12, "row 1 starts one entry before a 16-byte boundary"
    seqlens = torch.tensor([seqlen, seqlen], dtype=torch.int32, device="cuda")
    k_good, v_good = k_pool.clone(), v_pool.clone()
    want = decode_attention(q, k_good, v_good, seqlens, k_new=kn, v_new=vn, num_splits=num_splits, block_table=table)
    # row 1: entry 0 single, entries 1 .. 512 the staged groups (128 of 4), 513 .. 596 later groups, 597 .. 599 singles
    table[1, {"first single": 0, "staged group": 200, "later group": 560, "last single": 599}[where]] = num_pages
    k0, v0 = k_pool.clone(), v_pool.clone()
    out = torch.full_like(q, 7.0)
    decode_attention(q, k_pool, v_pool, seqlens, k_new=kn, v_new=vn, num_splits=num_splits, out=out, block_table=table)
    assert out[1].isnan().all(), f"a bad {where} entry: NaN expected in every row of its sequence"
    assert torch.equal(bits(out[0]), bits(want[0])), "the other sequence as with a good table"
    k_want = appended_pool(k0, kn[:1], table[:1], [seqlen], ps)
    v_want = appended_pool(v0, vn[:1], table[:1], [seqlen], ps)
    assert torch.equal(bits(k_pool), bits(k_want)) and torch.equal(bits(v_pool), bits(v_want))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 20])
def test_empty_pool_gpu(num_splits):
    """A pool of no page: a sequence that reads or writes a slot gets NaN (every entry is out of the pool); one
    with no slot to read and none to append gets zeros (no visible key), and nothing is read or written."""
    q = torch.randn(3, 4, 1, 64, device="cuda", dtype=torch.float16)
    pool = torch.empty(0, 2, 16, 64, device="cuda", dtype=torch.float16)
    table = torch.zeros(3, 2, dtype=torch.int32, device="cuda")
    out = decode_attention(q, pool, pool.clone(), torch.tensor([0, 5, 0], dtype=torch.int32, device="cuda"),
                           cache_leftpad=torch.tensor([0, 0, 0], dtype=torch.int32, device="cuda"),
                           num_splits=num_splits, block_table=table)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[1].isnan().all()
    kn = torch.randn(3, 2, 1, 64, device="cuda", dtype=torch.float16)
    out = decode_attention(q, pool, pool.clone(), torch.tensor([0, 0, 0], dtype=torch.int32, device="cuda"),
                           k_new=kn, v_new=kn.clone(), num_splits=num_splits, block_table=table)
    assert out.isnan().all(), "an append into an empty pool: every sequence NaN"

def _pool_call(device, table_rows, seqlens, **kw):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 2, 1, 32, generator=g, device=device)
    pool = torch.randn(4, 1, 16, 32, generator=g, device=device)
    table = torch.tensor(table_rows, dtype=torch.int32, device=device)
    return decode_attention(q, pool, pool.clone(), seqlens, block_table=table, **kw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_checked_pages_raise(device):
    """On the CPU the entries are host values (always checked); on CUDA with validate=True."""
    kw = {} if device == "cpu" else dict(validate=True)
    match = r"block_table must have entries in \[0, num_pages\) = \[0, 4\) for the slots a sequence reads or " \
            r"writes, got (4|-1) at batch index 1"
    with pytest.raises(ValueError, match=match):
        _pool_call(device, [[0, 1], [2, 4]], [20, 17], **kw)
    with pytest.raises(ValueError, match=match):
        _pool_call(device, [[0, 1], [-1, 3]], [20, 17], cache_leftpad=[0, 15], **kw)
    # entries of blocks a sequence does not touch are never read: padding is fine
    _pool_call(device, [[0, -1], [-1, 3]], [16, 32], cache_leftpad=[0, 16], **kw)


def test_opcheck_paged():
    """The schema's block_table argument through opcheck (the CPU path; the fake kernel's shapes)."""
    ops = torch.ops.fused_attn
    g = torch.Generator().manual_seed(0)
    q, pool = torch.randn(2, 4, 2, 16, generator=g), torch.randn(5, 2, 16, 16, generator=g)
    kn, vn = torch.randn(2, 2, 2, 16, generator=g), torch.randn(2, 2, 2, 16, generator=g)
    lens = torch.tensor([3, 17], dtype=torch.int32)
    table = torch.tensor([[4, -1], [0, 2]], dtype=torch.int32)
    args = (q, pool, pool.clone(), lens, kn, vn, None, None, None, 0, table)
    torch.library.opcheck(ops.decode_attention.default, args)
    torch.library.opcheck(ops.decode_attention_out.default, args, dict(out=torch.empty_like(q)))
    m = dict(device="meta", dtype=torch.float16)
    out = ops.decode_attention(torch.empty(2, 8, 3, 64, **m), torch.empty(9, 2, 32, 64, **m),
                               torch.empty(9, 2, 32, 64, **m), torch.empty(2, device="meta", dtype=torch.int32),
                               block_table=torch.empty(2, 3, device="meta", dtype=torch.int32))
    assert out.shape == (2, 8, 3, 64) and out.device.type == "meta"


def test_page_strides_of_4gb_raise():
    """The kernels take a pool's page and row strides in bytes as 32-bit values: a page stride of 2**32 bytes
    (2**31 float16 elements, meta tensors: no storage) is refused, for k_cache and v_cache alike; a pool of one
    page, whose page stride is never used, is not. The C++ launcher's message is the same text."""
    ops = torch.ops.fused_attn
    m = dict(device="meta", dtype=torch.float16)
    q = torch.empty(2, 4, 1, 64, **m)
    lens = torch.empty(2, device="meta", dtype=torch.int32)
    table = torch.empty(2, 2, device="meta", dtype=torch.int32)
    pool = torch.empty(2, 2, 16, 64, **m)
    far = torch.empty_strided((2, 2, 16, 64), (2**31, 1024, 64, 1), **m)
    requirement = (r"must have page \(dim 0, when num_pages > 1\) and row \(dim 2\) strides below 2\*\*32 bytes "
                   r"with block_table, got strides \(2147483648, 1024, 64, 1\)")
    for name, k, v in (("k_cache", far, pool), ("v_cache", pool, far)):
        with pytest.raises(ValueError, match=f"{name} {requirement}"):
            ops.decode_attention(q, k, v, lens, block_table=table)
    one = torch.empty_strided((1, 2, 16, 64), (2**31, 1024, 64, 1), **m)
    assert ops.decode_attention(q, one, one, lens, block_table=table).shape == q.shape


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_paged_inputs_through_the_op(device):
    """The op itself (no wrapper) checks block_table and the pools: the CPU kernel and the fake kernel
    through check_args, the C++ launcher on CUDA, with the same messages (tests/test_bad_inputs.py pins the
    wrapper's)."""
    ops = torch.ops.fused_attn
    q = torch.zeros(2, 4, 1, 64, dtype=torch.float16, device=device)
    pool = torch.zeros(5, 2, 16, 64, dtype=torch.float16, device=device)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)

    def run(k=pool, v=pool, block_table=table, key_mask=None):
        ops.decode_attention(q, k, v, lens, None, None, None, key_mask, None, 0, block_table)

    run()
    cases = [
        (dict(block_table=table.long()), r"block_table must have dtype torch.int32, got torch.int64"),
        (dict(block_table=table[:1]), r"block_table must have shape \(batch, max_blocks\) = \(2, max_blocks\), "
                                      r"got \(1, 2\)"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32, device=device)[:, ::2]),
         r"block_table must have a contiguous last dim \(stride 1\), got strides \(4, 2\)"),
        (dict(k=pool[:, :, :8], v=pool[:, :, :8]),
         r"k_cache must have a page_size \(dim 2\) that is a power of two in \[16, 256\] with block_table, "
         r"got \(5, 2, 8, 64\)"),
        (dict(v=pool[:4]), r"v_cache must have k_cache's shape \(5, 2, 16, 64\), got \(4, 2, 16, 64\)"),
        (dict(key_mask=torch.ones(2, 16, dtype=torch.bool, device=device)),
         r"key_mask must have shape \(batch or 1, max_len\) = \(2 or 1, 32\), got \(2, 16\)"),
    ]
    for changes, match in cases:
        with pytest.raises((ValueError, RuntimeError), match=match):
            run(**changes)
