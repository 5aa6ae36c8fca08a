"""decode_attention: the CUDA kernel and the CPU path against the float64 reference, the cache
append (exact, in place, nothing else written), lengths, CUDA graphs, torch.compile, opcheck and
argument errors. The spec is the docstring of ``fused_attn.decode_attention.decode_attention``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.decode_attention import VALIDATE_ENV, decode_attention
from tests.streams import on_side_stream_without_sync
from tests.tolerances import assert_attention_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA_HEADDIMS = [8, 16, 24, 32, 40, 48, 64, 72, 80, 96, 104, 112, 128, 160, 192, 224, 256]
SPLITS = [None, 0, 1, 2, 3, 7, 12, 16, 64, 256]
ON_GPU_BUDGET = 1 << 19  # cache elements (batch x nheads_kv x max_len x headdim) per example
ON_CPU_BUDGET = 1 << 13
POISON = math.nan  # every cache slot no query may see, and out before the call


# --------------------------------------------------------------------------- building a case


@st.composite
def decode_case(draw, budget, cuda):
    """Shapes, lengths and options of one call. Lengths per sequence: 0, 1, the largest allowed, or any."""
    batch = draw(st.integers(1, 4))
    ratio = draw(st.sampled_from(["1", "4", "8", "mqa", "any"]))
    if ratio == "mqa":
        nheads_kv, group = 1, draw(st.integers(1, 16))
    else:
        nheads_kv = draw(st.integers(1, 3))
        group = {"1": 1, "4": 4, "8": 8}.get(ratio) or draw(st.integers(1, 6))
    seqlen_new = draw(st.one_of(st.just(1), st.integers(1, 16)))
    if cuda:
        headdim = draw(st.one_of(st.sampled_from([32, 64, 80, 96, 128, 256]), st.sampled_from(CUDA_HEADDIMS)))
    else:
        headdim = draw(st.one_of(st.sampled_from([8, 32, 64]), st.integers(1, 40)))
    append = draw(st.booleans())
    lo = seqlen_new if append else 0
    # the budget bounds the cache and (x 4) the reference's score matrix [batch, nheads_q, seqlen_new, max_len]
    max_len_cap = max(lo, min(budget // (batch * nheads_kv * headdim),
                              4 * budget // (batch * nheads_kv * group * seqlen_new)))
    max_len = draw(st.one_of(st.integers(lo, min(lo + 40, max_len_cap)), st.integers(lo, max_len_cap)))
    hi = max_len - (seqlen_new if append else 0)
    seqlens = [draw(st.one_of(st.sampled_from([0, min(1, hi), hi]), st.integers(0, hi))) for _ in range(batch)]
    leftpad = None
    if draw(st.booleans()):
        leftpad = [draw(st.one_of(st.just(0), st.just(n), st.integers(0, n))) for n in seqlens]
    return dict(
        batch=batch, nheads_kv=nheads_kv, group=group, seqlen_new=seqlen_new, headdim=headdim, max_len=max_len,
        seqlens=seqlens, leftpad=leftpad, append=append,
        dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
        num_splits=draw(st.sampled_from(SPLITS)),
        # host values (list / CPU tensor) are checked by the wrapper; a device tensor is read by the kernel only
        lengths_as=draw(st.sampled_from(["device", "list", "cpu_tensor"])),
        qkv="fused" if draw(st.booleans()) else "contiguous",  # q (and k_new, v_new) sliced from one projection
        cache_layout=draw(st.sampled_from(["bhsd", "bshd"])),  # bshd: [batch, max_len, nheads, headdim] transposed
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.floats(-2.0, -0.05))),
        qk_mag=draw(st.sampled_from([1.0, 1.0, 8.0, 70.0])),  # 70: scores of order 1e4 (at scale 1)
        v_mag=draw(st.sampled_from([1.0, 1.0, 1e-3, 1e3])),
        use_out=draw(st.booleans()),
        # key_mask: None, or the share of slots masked (the mask itself drawn from the seed: key_mask_of)
        key_mask=draw(st.sampled_from([None, None, 0.0, 0.5, 0.9, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def key_mask_of(case):
    """The case's bool key_mask [batch, max_len] (True = attend) on the CPU, or None."""
    share = case.get("key_mask")
    if share is None:
        return None
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    return torch.rand(case["batch"], case["max_len"], generator=gen) >= share


def make_inputs(case, device):
    """Tensors from a seeded generator. Cache slots outside [leftpad, seqlen + appended) hold NaN: a
    kernel that reads them poisons its output, and they must be bit-identical afterwards."""
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    b, hkv, sn, d = case["batch"], case["nheads_kv"], case["seqlen_new"], case["headdim"]
    hq, n, dtype = hkv * case["group"], case["max_len"], case["dtype"]
    qk, vm = case.get("qk_mag", 1.0), case.get("v_mag", 1.0)
    # the scale multiplies q so that q . k * scale stays of order qk_mag**2 for any scale
    scale = case.get("scale")
    q_mag = qk / math.sqrt(abs(scale) * math.sqrt(d)) if scale is not None else qk
    k_mag = qk / math.sqrt(abs(scale) * math.sqrt(d)) if scale is not None else qk

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32 if dtype != torch.float64
                           else torch.float64)

    if case.get("qkv", "contiguous") == "fused":
        x = randn(b, sn, hq + 2 * hkv, d)  # one projection [batch, seqlen, heads_q + 2 heads_kv, headdim]
        x[:, :, :hq] *= q_mag
        x[:, :, hq:hq + hkv] *= k_mag
        x[:, :, hq + hkv:] *= vm
        x = x.to(dtype)
        q = x[:, :, :hq].transpose(1, 2)
        k_new, v_new = x[:, :, hq:hq + hkv].transpose(1, 2), x[:, :, hq + hkv:].transpose(1, 2)
    else:
        q = (randn(b, hq, sn, d) * q_mag).to(dtype)
        k_new, v_new = (randn(b, hkv, sn, d) * k_mag).to(dtype), (randn(b, hkv, sn, d) * vm).to(dtype)
    if case.get("cache_layout", "bhsd") == "bshd":
        k_cache = (randn(b, n, hkv, d) * k_mag).to(dtype).transpose(1, 2)
        v_cache = (randn(b, n, hkv, d) * vm).to(dtype).transpose(1, 2)
    else:
        k_cache, v_cache = (randn(b, hkv, n, d) * k_mag).to(dtype), (randn(b, hkv, n, d) * vm).to(dtype)
    if not case["append"]:
        k_new = v_new = None
    seqlens = torch.tensor(case["seqlens"], dtype=torch.int32)
    leftpad = None if case["leftpad"] is None else torch.tensor(case["leftpad"], dtype=torch.int32)
    visible = reference.decode_visible(seqlens, sn, n, case["append"], leftpad, key_mask_of(case), b)  # [b,1,sn,n]
    seen = visible.any(dim=2).view(b, 1, n, 1).to(device)
    k_cache.masked_fill_(~seen, POISON)
    v_cache.masked_fill_(~seen, POISON)
    return q, k_cache, v_cache, seqlens, leftpad, k_new, v_new


def as_lengths(values, form, device):
    if values is None:
        return None
    if form == "device":
        return values.to(device)
    if form == "list":
        return values.tolist()
    return values.to(torch.int64)  # a CPU tensor, any integer dtype


def peer_attention(q, k_all, v_all, seqlens, leftpad, appended, scale, key_mask=None):
    """PyTorch's own computation at q's dtype: (q * scale) @ k^T, masked softmax, @ v (the peer of the
    tolerance rule). Never-visible slots are zeroed (they hold NaN)."""
    b, hq, sn, d = q.shape
    hkv, n = k_all.shape[1], k_all.shape[2]
    scale = d ** -0.5 if scale is None else scale
    visible = reference.decode_visible(seqlens.to(q.device), sn, n, appended,
                                       None if leftpad is None else leftpad.to(q.device), key_mask, b)
    seen = visible.any(dim=2).unsqueeze(-1)
    k = torch.where(seen, k_all, 0).repeat_interleave(hq // hkv, dim=1)
    v = torch.where(seen, v_all, 0).repeat_interleave(hq // hkv, dim=1)
    s = (q * scale) @ k.transpose(-1, -2)
    p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
    p = torch.where(visible.any(dim=-1, keepdim=True), p, 0)
    return p @ v


def score_max(q, k_all, seqlens, leftpad, appended, scale, key_mask=None):
    """float64 max |q . k * scale| over the keys each query row sees (0 where none)."""
    b, hq, sn, d = q.shape
    hkv, n = k_all.shape[1], k_all.shape[2]
    scale = d ** -0.5 if scale is None else scale
    visible = reference.decode_visible(seqlens.to(q.device), sn, n, appended,
                                       None if leftpad is None else leftpad.to(q.device), key_mask, b)
    k = torch.nan_to_num(k_all.double(), nan=0.0).repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ k.transpose(-1, -2) * scale).abs().masked_fill(~visible, 0)
    return s.amax(dim=-1) if n else s.sum(dim=-1)


def want_and_magnitude(q, k_cache, v_cache, seqlens, k_new, v_new, leftpad, scale, key_mask=None):
    """The float64 reference from the inputs in float64 (not rounded back to q's dtype), and the float64
    attention of |v| (the row magnitude of the tolerance rule)."""
    def d(t):
        return None if t is None else t.double()

    want = reference.decode_attention(d(q), d(k_cache), d(v_cache), seqlens, d(k_new), d(v_new), leftpad, scale,
                                      key_mask=key_mask)[0]
    magnitude = reference.decode_attention(d(q), d(k_cache), d(v_cache).abs(), seqlens, d(k_new),
                                           None if v_new is None else d(v_new).abs(), leftpad, scale,
                                           key_mask=key_mask)[0]
    return want, magnitude


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def appended_copy(cache, new, seqlens):
    """The cache after the append, bit for bit (plain slice copies: NaN payloads kept)."""
    want = cache.clone()
    if new is not None:
        for b, n in enumerate(seqlens):
            want[b, :, n:n + new.shape[2]] = new[b]
    return want


def run_and_check(case, device):
    q, k_cache, v_cache, seqlens, leftpad, k_new, v_new = make_inputs(case, device)
    appended = k_new is not None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    scale = case.get("scale")
    lengths = as_lengths(seqlens, case.get("lengths_as", "device"), device)
    pad = as_lengths(leftpad, case.get("lengths_as", "device"), device)
    out = None
    if case.get("use_out"):
        out = torch.full(q.shape, POISON, dtype=q.dtype, device=device)
    key_mask = key_mask_of(case)
    got = decode_attention(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, cache_leftpad=pad, scale=scale,
                           key_mask=None if key_mask is None else key_mask.to(device),
                           num_splits=case.get("num_splits"), out=out)
    if out is not None:
        assert got is out
    assert got.shape == q.shape and got.dtype == q.dtype and got.device == q.device
    dev_seqlens, dev_pad = seqlens.to(device), None if leftpad is None else leftpad.to(device)
    want, magnitude = want_and_magnitude(q, k_before, v_before, dev_seqlens, k_new, v_new, dev_pad, scale, key_mask)
    where = (f"b={case['batch']} hkv={case['nheads_kv']} group={case['group']} sn={case['seqlen_new']} "
             f"d={case['headdim']} max_len={case['max_len']} seqlens={case['seqlens']} leftpad={case['leftpad']} "
             f"append={appended} {case['dtype']} splits={case.get('num_splits')} key_mask={case.get('key_mask')}")
    # The cache: appended slots equal k_new / v_new exactly, everything else (NaN tails included) untouched.
    k_want, v_want = appended_copy(k_before, k_new, case["seqlens"]), appended_copy(v_before, v_new, case["seqlens"])
    assert torch.equal(bits(k_cache), bits(k_want)), f"{where}: k_cache after the call"
    assert torch.equal(bits(v_cache), bits(v_want)), f"{where}: v_cache after the call"
    assert not got.isnan().any(), f"{where}: NaN in the output (out not fully written, or a poisoned slot read)"
    peer = peer_attention(q, k_want, v_want, seqlens, leftpad, appended, scale, key_mask)
    assert_attention_close(got, peer, want, magnitude,
                           score_max(q, k_want, seqlens, leftpad, appended, scale, key_mask), where)
    no_key = magnitude.abs().amax(dim=-1) == 0
    assert (got[no_key] == 0).all(), f"{where}: rows with no visible key must be exact zeros"


def case_of(**kw):
    base = dict(batch=2, nheads_kv=2, group=1, seqlen_new=1, headdim=64, max_len=32, seqlens=[5, 9], leftpad=None,
                append=True, dtype=torch.float16, num_splits=None, lengths_as="device", qkv="contiguous",
                cache_layout="bhsd", scale=None, qk_mag=1.0, v_mag=1.0, use_out=False, seed=0)
    base.update(kw)
    return base


# --------------------------------------------------------------------------- properties

EDGE_EXAMPLES = [
    case_of(seqlens=[0, 0], append=False),  # no key at all: zeros
    case_of(seqlens=[0, 0], append=True, seqlen_new=4, max_len=4),  # only the new keys
    case_of(seqlens=[1, 0], append=False, max_len=1),
    case_of(seqlens=[31, 32], append=False, max_len=32, leftpad=[0, 32]),  # full caches; all of one padded away
    case_of(seqlens=[28, 16], append=True, seqlen_new=4, max_len=32, leftpad=[3, 16]),  # full after the append
    case_of(batch=3, seqlens=[0, 100, 37], max_len=120, seqlen_new=16, append=True, group=8, nheads_kv=1,
            num_splits=7, leftpad=[0, 99, 36], use_out=True),
    # MQA, more splits than keys
    case_of(batch=1, nheads_kv=1, group=16, seqlens=[50], max_len=60, num_splits=256, qkv="fused"),
    case_of(batch=2, nheads_kv=2, group=4, seqlens=[3, 1], max_len=8, num_splits=64, cache_layout="bshd",
            dtype=torch.bfloat16, qkv="fused", seqlen_new=5, use_out=True),
    case_of(qk_mag=70.0, v_mag=1e3, seqlens=[40, 200], max_len=256, dtype=torch.float16, num_splits=3),  # extremes
    case_of(qk_mag=70.0, v_mag=1e3, seqlens=[40, 200], max_len=256, dtype=torch.bfloat16, scale=-1.0),
    case_of(qk_mag=70.0, seqlens=[40, 200], max_len=256, dtype=torch.float32, num_splits=2, lengths_as="list"),
    case_of(headdim=256, group=4, seqlens=[300, 511], max_len=512, dtype=torch.float32, lengths_as="cpu_tensor",
            num_splits=1, seqlen_new=1, append=True),
    case_of(headdim=32, seqlens=[17, 0], max_len=40, dtype=torch.float16, seqlen_new=16, leftpad=[17, 0]),
    case_of(headdim=80, seqlens=[7, 70], max_len=100, dtype=torch.bfloat16, append=False, num_splits=3,
            leftpad=[2, 69], use_out=True),
    case_of(key_mask=1.0, seqlens=[5, 30], seqlen_new=2),  # every slot masked: zeros
    case_of(key_mask=0.5, group=4, headdim=128, max_len=300, seqlens=[298, 150], seqlen_new=2, leftpad=[3, 0],
            qk_mag=70.0, num_splits=16),  # a masked GQA block on the tensor-core kernel (CUDA), scores ~1e4
]


def with_examples(examples):
    def deco(f):
        for ex in reversed(examples):
            f = example(case=ex)(f)
        return f
    return deco


@pytest.mark.gpu
@given(case=decode_case(ON_GPU_BUDGET, cuda=True))
@with_examples(EDGE_EXAMPLES + [
    case_of(batch=4, nheads_kv=8, group=4, headdim=128, seqlens=[4000, 1, 0, 2047], max_len=4096,
            dtype=torch.float16, seqlen_new=1, num_splits=None, leftpad=[100, 0, 0, 0]),  # a long row, heuristic
    case_of(batch=1, nheads_kv=2, group=8, headdim=96, seqlens=[4090], max_len=4096, seqlen_new=6,
            dtype=torch.bfloat16, num_splits=256),
])
def test_matches_reference_gpu(case):
    run_and_check(case, "cuda")


@given(case=decode_case(ON_CPU_BUDGET, cuda=False))
@with_examples([e for e in EDGE_EXAMPLES if e["max_len"] * e["batch"] * e["nheads_kv"] * e["headdim"] <= 1 << 16]
               + [case_of(headdim=33, dtype=torch.float64, seqlens=[3, 4], max_len=9, seqlen_new=2, group=3)])
def test_matches_reference_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_lengths_advanced_by_the_previous_kernel_gpu(rows):
    """decode_attention right after sample(advance=) on the same stream, nothing between: both are
    programmatic launches, so the attention kernel starts (and reads the lengths for its L2 prefetch)
    while the sampler may still be advancing them. It must see the advanced lengths: the append lands one slot
    further, the output is that of the longer cache (float64 reference), repeated over several steps."""
    from fused_attn.sample import sample

    gen = torch.Generator(device="cuda").manual_seed(rows)
    hkv, d, max_len, steps = 12, 64, 320, 6
    k_cache = torch.randn(rows, hkv, max_len, d, device="cuda", dtype=torch.float16, generator=gen)
    v_cache = torch.randn(rows, hkv, max_len, d, device="cuda", dtype=torch.float16, generator=gen)
    counters = torch.full((2, rows), 200, dtype=torch.int32, device="cuda")  # seqlens, a second counter
    logits = torch.randn(rows, 50257, device="cuda", dtype=torch.float16, generator=gen)  # a slow sampler
    token = torch.zeros(rows, dtype=torch.long, device="cuda")
    for step in range(steps):
        q = torch.randn(rows, hkv, 1, d, device="cuda", dtype=torch.float16, generator=gen)
        kn = torch.randn(rows, hkv, 1, d, device="cuda", dtype=torch.float16, generator=gen)
        vn = torch.randn(rows, hkv, 1, d, device="cuda", dtype=torch.float16, generator=gen)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        torch.cuda.synchronize()
        sample(logits, out=token, advance=counters)
        out = decode_attention(q, k_cache, v_cache, counters[0], k_new=kn, v_new=vn)
        torch.cuda.synchronize()
        lengths = torch.full((rows,), 201 + step, dtype=torch.int32)
        assert torch.equal(counters[0].cpu(), lengths), f"step {step}: the sampler's advance"
        where = f"rows={rows} step={step}"
        k_want, v_want = appended_copy(k_before, kn, lengths.tolist()), appended_copy(v_before, vn, lengths.tolist())
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), f"{where}: the append's slot"
        want, magnitude = want_and_magnitude(q, k_before, v_before, lengths.cuda(), kn, vn, None, None)
        assert_attention_close(out, peer_attention(q, k_want, v_want, lengths, None, True, None), want, magnitude,
                               score_max(q, k_want, lengths, None, True, None), where)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 12, 16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 12])
def test_forced_splits_gpu(num_splits, dtype, headdim, rows):
    """Every forced split count over lengths shorter than the split count (empty splits), around it,
    and long, with appends and left padding; 12 query rows per kv head (GQA group 4 x 3 new tokens: the
    tensor-core kernel in 16-bit types, row chunks with padding rows on CUDA cores) and one (MHA decoding:
    each split of up to 16 one block of a cluster, whose merge pushes every block's slice to its owner)."""
    group, seqlen_new = (4, 3) if rows == 12 else (1, 1)
    case = case_of(batch=4, nheads_kv=2, group=group, headdim=headdim, max_len=600, seqlens=[0, 3, 255, 590],
                   leftpad=[0, 1, 0, 300], seqlen_new=seqlen_new, dtype=dtype, num_splits=num_splits, use_out=True,
                   seed=num_splits)
    run_and_check(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_causal_limit_inside_a_full_tile_gpu(num_splits, dtype, headdim, group):
    """Three new tokens whose sequence ends on a 64-slot boundary: the last full tile of the split holds the keys
    the first two new rows may not see (slots 126 and 127 of 128; 62 and 63 of 64), with no partial tile after
    it. The tensor-core kernel (group 4: 12 rows in 16-bit types) scales a full tile without masking only where
    no live row's limit falls inside it; group 1 is the CUDA-core kernel (3 rows)."""
    case = case_of(batch=2, nheads_kv=2, group=group, headdim=headdim, max_len=256, seqlens=[125, 61],
                   leftpad=[0, 0], seqlen_new=3, dtype=dtype, num_splits=num_splits, use_out=True, seed=7)
    run_and_check(case, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_zero_visible_keys_give_exact_zeros(device):
    """Empty caches, caches left-padded all the way, max_len 0: zeros, never NaN; the cache untouched."""
    for dtype in DTYPES:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(3, 4, 2, 64, generator=gen, device=device).to(dtype)
        k = torch.full((3, 2, 16, 64), math.nan, device=device, dtype=dtype)
        v = torch.full((3, 2, 16, 64), math.nan, device=device, dtype=dtype)
        lens = torch.tensor([0, 5, 16], dtype=torch.int32, device=device)
        out = decode_attention(q, k, v, lens, cache_leftpad=lens.clone(), num_splits=3)
        assert torch.equal(out, torch.zeros_like(out)), dtype
        assert k.isnan().all() and v.isnan().all()
        out = torch.full_like(q, math.nan)
        empty = torch.empty(3, 2, 0, 64, device=device, dtype=dtype)
        decode_attention(q, empty, empty.clone(), [0, 0, 0], out=out)
        assert torch.equal(out, torch.zeros_like(out)), dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_without_k_new_the_cache_is_untouched(device):
    case = case_of(append=False, seqlens=[10, 31], max_len=32, leftpad=[2, 0], dtype=torch.float32)
    q, k, v, seqlens, leftpad, _, _ = make_inputs(case, device)
    k0, v0 = k.clone(), v.clone()
    decode_attention(q, k, v, seqlens.to(device), cache_leftpad=leftpad.to(device))
    assert torch.equal(bits(k), bits(k0)) and torch.equal(bits(v), bits(v0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_length_forms_agree(device):
    """An int, a list, a CPU tensor of any integer dtype and an int32 device tensor give one result."""
    case = case_of(seqlens=[7, 7], max_len=16, append=True, seqlen_new=2, dtype=torch.float32)
    results = []
    for form in (7, [7, 7], torch.tensor([7, 7]), torch.tensor([7, 7], dtype=torch.int16),
                 torch.tensor([7, 7], dtype=torch.int32, device=device)):
        q, k, v, _, _, kn, vn = make_inputs(case, device)
        results.append((decode_attention(q, k, v, form, k_new=kn, v_new=vn, cache_leftpad=1), k, v))
    for out, k, v in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(bits(k), bits(results[0][1]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_q_k_new_and_out_layout(device, dtype):
    """q and k_new without a contiguous last dim or misaligned (copied once by the wrapper), and an out
    whose heads and positions are transposed (last dim contiguous): the same result as contiguous."""
    case = case_of(batch=2, nheads_kv=2, group=2, headdim=64, max_len=40, seqlens=[3, 30], seqlen_new=4,
                   leftpad=[1, 0], dtype=dtype)
    q, k, v, seqlens, leftpad, kn, vn = make_inputs(case, device)
    want = decode_attention(q, k.clone(), v.clone(), seqlens.to(device), k_new=kn, v_new=vn,
                            cache_leftpad=leftpad.to(device))
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last-dim stride seqlen_new
    buf = torch.empty(q.numel() + 1, device=device, dtype=dtype)
    q_off = buf[1:].view(q.shape).copy_(q)  # 2 or 4 bytes past a 16-byte boundary
    kn_t = kn.transpose(-1, -2).contiguous().transpose(-1, -2)
    for qq in (q_t, q_off):
        out = torch.empty(2, 4, 4, 64, device=device, dtype=dtype).transpose(1, 2)  # [b, hq, sn, d], strided
        out.fill_(math.nan)
        k2, v2 = k.clone(), v.clone()
        got = decode_attention(qq, k2, v2, seqlens.to(device), k_new=kn_t, v_new=vn, cache_leftpad=leftpad.to(device),
                               out=out)
        assert got is out
        assert torch.equal(out, want)
        assert torch.equal(bits(k2), bits(appended_copy(k, kn, case["seqlens"])))


@pytest.mark.gpu
def test_does_not_sync_and_uses_the_current_stream_gpu():
    """Device lengths, an append and out=: no host synchronization; launched on the current stream
    (a sleep, then the fill of q on stream s: a launch on another stream reads q before the fill)."""
    case = case_of(batch=4, nheads_kv=2, group=4, headdim=128, max_len=512, seqlens=[0, 100, 300, 500],
                   seqlen_new=2, dtype=torch.bfloat16)
    q, k, v, seqlens, leftpad, kn, vn = make_inputs(case, "cuda")
    k0, v0 = k.clone(), v.clone()
    lens = seqlens.cuda()
    q_src, q_dst = q.clone(), torch.zeros_like(q)
    out = torch.empty_like(q)
    on_side_stream_without_sync(q_dst, q_src,
                                lambda: decode_attention(q_dst, k, v, lens, k_new=kn, v_new=vn, out=out, num_splits=3))
    want, magnitude = want_and_magnitude(q, k0, v0, lens, kn, vn, None, None)
    k_all, v_all = appended_copy(k0, kn, case["seqlens"]), appended_copy(v0, vn, case["seqlens"])
    assert torch.equal(bits(k), bits(k_all)) and torch.equal(bits(v), bits(v_all))
    assert_attention_close(out, peer_attention(q, k_all, v_all, seqlens, None, True, None), want, magnitude,
                           score_max(q, k_all, seqlens, None, True, None), "on a side stream")


# --------------------------------------------------------------------------- lengths out of bounds


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, 20])  # one split, merged in a cluster, through the combine kernel
def test_out_of_bounds_device_lengths_give_nan_and_no_write_gpu(dtype, num_splits):
    """Device-side lengths are not read on the host: a sequence with cache_seqlens past
    max_len - seqlen_new, negative, or cache_leftpad past cache_seqlens gets NaN outputs and its cache
    is untouched; the other sequences are computed as usual."""
    b, hkv, n, d, sn = 7, 2, 32, 64, 3
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, 4, sn, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen, device="cuda").to(dtype)
    kn = torch.randn(b, hkv, sn, d, generator=gen, device="cuda").to(dtype)
    vn = torch.randn(b, hkv, sn, d, generator=gen, device="cuda").to(dtype)
    #         ok  overflow  negative  ok(full)  leftpad>seqlens  huge  leftpad<0
    seqlens = [5, n - sn + 1, -1, n - sn, 4, 2**31 - 1, 3]
    leftpad = [1, 0, 0, 0, 5, 0, -1]
    bad = [False, True, True, False, True, True, True]
    k0, v0 = k.clone(), v.clone()
    out = torch.full_like(q, 7.0)
    decode_attention(q, k, v, torch.tensor(seqlens, dtype=torch.int32, device="cuda"), k_new=kn, v_new=vn,
                     cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device="cuda"), num_splits=num_splits,
                     out=out)
    for i in range(b):
        if bad[i]:
            assert out[i].isnan().all(), f"sequence {i}: NaN outputs expected"
            assert torch.equal(bits(k[i]), bits(k0[i])) and torch.equal(bits(v[i]), bits(v0[i])), f"sequence {i}"
    good = [i for i in range(b) if not bad[i]]
    idx = torch.tensor(good, device="cuda")
    sl = torch.tensor([seqlens[i] for i in good], dtype=torch.int32, device="cuda")
    lp = torch.tensor([leftpad[i] for i in good], dtype=torch.int32, device="cuda")
    _, k_all, v_all = reference.decode_attention(q[idx], k0[idx], v0[idx], sl, kn[idx], vn[idx], lp)
    assert torch.equal(k[idx], k_all) and torch.equal(v[idx], v_all)
    want, magnitude = want_and_magnitude(q[idx], k0[idx], v0[idx], sl, kn[idx], vn[idx], lp, None)
    peer = peer_attention(q[idx], k_all, v_all, sl, lp, True, None)
    assert_attention_close(out[idx], peer, want, magnitude, score_max(q[idx], k_all, sl, lp, True, None),
                           "in-bounds sequences")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_known_bad_lengths_raise(device):
    q = torch.zeros(2, 2, 3, 8, device=device)
    k = torch.zeros(2, 2, 10, 8, device=device)
    kn = torch.zeros(2, 2, 3, 8, device=device)
    for seqlens in ([8, 0], torch.tensor([0, 8]), 8):
        with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_len - seqlen_new = 10 - 3\] for "
                                             r"every sequence, got 8 at batch index (0|1)"):
            decode_attention(q, k, k.clone(), seqlens, k_new=kn, v_new=kn.clone())
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_len = 10\] for every sequence, got 11 "
                                         r"at batch index 1"):
        decode_attention(q, k, k.clone(), [0, 11])
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_len = 10\] for every sequence, got -1"):
        decode_attention(q, k, k.clone(), [-1, 0])
    with pytest.raises(ValueError, match=r"cache_leftpad must be in \[0, cache_seqlens\[b\]\] for every sequence, "
                                         r"got 5 at batch index 0 \(cache_seqlens 4\)"):
        decode_attention(q, k, k.clone(), [4, 4], cache_leftpad=[5, 0])
    assert (k == 0).all()


def test_cpu_op_checks_lengths_itself():
    """torch.ops.fused_attn.decode_attention on CPU tensors (no wrapper) checks the lengths too."""
    q, k = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_len - seqlen_new = 4 - 1\]"):
        torch.ops.fused_attn.decode_attention(q, k, k.clone(), torch.tensor([4], dtype=torch.int32), q, q.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_validate_reads_device_lengths_gpu(how, monkeypatch):
    q = torch.zeros(2, 2, 1, 64, device="cuda", dtype=torch.float16)
    k = torch.zeros(2, 2, 8, 64, device="cuda", dtype=torch.float16)
    kw = dict(validate=True)
    if how == "environment":
        monkeypatch.setenv(VALIDATE_ENV, "1")
        kw = {}
    bad = torch.tensor([3, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_len - seqlen_new = 8 - 1\] for every "
                                         r"sequence, got 8 at batch index 1"):
        decode_attention(q, k, k.clone(), bad, k_new=q[:, :2].clone(), v_new=q[:, :2].clone(), **kw)
    with pytest.raises(ValueError, match=r"cache_leftpad must be in \[0, cache_seqlens\[b\]\]"):
        decode_attention(q, k, k.clone(), bad - 1, cache_leftpad=torch.tensor([3, 8], dtype=torch.int32,
                                                                               device="cuda"), **kw)
    assert (k == 0).all()
    decode_attention(q, k, k.clone(), bad, **kw)  # without an append 8 is in bounds
    monkeypatch.setenv(VALIDATE_ENV, "0")
    decode_attention(q, k, k.clone(), bad, k_new=q[:, :2].clone(), v_new=q[:, :2].clone())  # not read: NaN, no raise


# --------------------------------------------------------------------------- CUDA graphs, compile, opcheck


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 5, 13])
def test_cuda_graph_replays_at_growing_lengths_gpu(num_splits):
    """One captured call with device-side lengths; between replays the lengths grow in place (a
    decode loop of 3 new tokens per step): every replay appends at the new position and matches."""
    b, hkv, group, n, d, sn, dtype = 3, 2, 4, 256, 128, 3, torch.float16
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(b, hkv, n, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen, device="cuda").to(dtype)
    q = torch.empty(b, hkv * group, sn, d, device="cuda", dtype=dtype)
    kn, vn = torch.empty(b, hkv, sn, d, device="cuda", dtype=dtype), torch.empty(b, hkv, sn, d, device="cuda",
                                                                                  dtype=dtype)
    seqlens = torch.tensor([0, 1, 17], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 1, 5], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step():
        decode_attention(q, k, v, seqlens, k_new=kn, v_new=vn, cache_leftpad=leftpad, num_splits=num_splits, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (loads the library) on a side stream, as torch.cuda.graphs asks
        k_keep, v_keep = k.clone(), v.clone()
        step()
        k.copy_(k_keep), v.copy_(v_keep)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
        with pytest.raises(ValueError, match=r"validate must be False during CUDA graph capture"):
            decode_attention(q, k, v, seqlens, validate=True)
    for t in range(6):
        for x in (q, kn, vn):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        k0, v0, lens = k.clone(), v.clone(), seqlens.clone()
        out.fill_(math.nan)
        g.replay()
        _, k_all, v_all = reference.decode_attention(q, k0, v0, lens, kn, vn, leftpad)
        assert torch.equal(k, k_all) and torch.equal(v, v_all), f"replay {t}: the append"
        want, magnitude = want_and_magnitude(q, k0, v0, lens, kn, vn, leftpad, None)
        assert_attention_close(out, peer_attention(q, k_all, v_all, lens, leftpad, True, None), want,
                               magnitude, score_max(q, k_all, lens, leftpad, True, None),
                               f"replay {t} at lengths {lens.tolist()}")
        seqlens.add_(sn if t < 2 else 40)  # grow, then jump ahead (every split count stays fixed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def step(q, k, v, seqlens, kn, vn, leftpad, out):
        o = decode_attention(q, k, v, seqlens, k_new=kn, v_new=vn, cache_leftpad=leftpad, num_splits=2)
        decode_attention(q, k, v, seqlens + 2, cache_leftpad=leftpad, out=out)
        return o * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 4, 2, 32, generator=gen, device=device)
    k = torch.randn(2, 2, 24, 32, generator=gen, device=device)
    v = torch.randn(2, 2, 24, 32, generator=gen, device=device)
    kn = torch.randn(2, 2, 2, 32, generator=gen, device=device)
    vn = torch.randn(2, 2, 2, 32, generator=gen, device=device)
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    leftpad = torch.tensor([1, 0], dtype=torch.int32, device=device)
    kc, vc, ke, ve = k.clone(), v.clone(), k.clone(), v.clone()
    out_c, out_e = torch.empty_like(q), torch.empty_like(q)
    got = compiled(q, kc, vc, seqlens, kn, vn, leftpad, out_c)
    want = step(q, ke, ve, seqlens, kn, vn, leftpad, out_e)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(out_c, out_e)
    assert torch.equal(kc, ke) and torch.equal(vc, ve)
    ref = reference.decode_attention(q, k, v, seqlens, kn, vn, leftpad)
    torch.testing.assert_close(got, 2 * ref[0].float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, ref[1]) and torch.equal(vc, ref[2])


def opcheck_inputs(device):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    i32 = dict(dtype=torch.int32, device=device)
    return [
        (randn(2, 4, 1, 64), randn(2, 2, 16, 64), randn(2, 2, 16, 64), torch.tensor([3, 15], **i32),
         randn(2, 2, 1, 64), randn(2, 2, 1, 64), None, None, None, 0),
        (randn(2, 8, 3, 32, dtype=torch.float32), randn(2, 1, 20, 32, dtype=torch.float32),
         randn(2, 1, 20, 32, dtype=torch.float32), torch.tensor([0, 17], **i32), None, None,
         torch.tensor([0, 5], **i32), torch.rand(2, 20, generator=g, device=device) > 0.3, 0.3, 3),
        (randn(1, 2, 4, 128, dtype=torch.bfloat16), randn(1, 2, 9, 128, dtype=torch.bfloat16),
         randn(1, 2, 9, 128, dtype=torch.bfloat16), torch.tensor([5], **i32), randn(1, 2, 4, 128, dtype=torch.bfloat16),
         randn(1, 2, 4, 128, dtype=torch.bfloat16), torch.tensor([2], **i32), None, None, 256),
        (randn(2, 4, 1, 64), randn(2, 2, 16, 64), randn(2, 2, 16, 64), None, None, None, None,
         torch.rand(1, 16, generator=g, device=device) > 0.5, None, 0),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    """Every opcheck test, with the cache mutated in place (k_new given: the schema's (a!)/(b!)) and not.
    The inputs do not require grad: with requires_grad the op raises by design (no gradient through a
    cache write; test_requires_grad_raises pins that), so there is no opcheck-with-autograd variant as
    test_softmax.py's test_opcheck_autograd."""
    ops = torch.ops.fused_attn
    for args in opcheck_inputs(device):
        torch.library.opcheck(ops.decode_attention.default, args)
        out = torch.empty_like(args[0])
        torch.library.opcheck(ops.decode_attention_out.default, args, dict(out=out))


def test_meta_tensors_give_shapes():
    m = dict(device="meta", dtype=torch.float16)
    q, k = torch.empty(2, 8, 3, 64, **m), torch.empty(2, 2, 40, 64, **m)
    lens = torch.empty(2, device="meta", dtype=torch.int32)
    out = torch.ops.fused_attn.decode_attention(q, k, k, lens, torch.empty(2, 2, 3, 64, **m),
                                                torch.empty(2, 2, 3, 64, **m))
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"


# --------------------------------------------------------------------------- bad arguments


def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def good(device, dtype=torch.float16):
    """q, k_cache, v_cache, cache_seqlens (device int32) of a valid call."""
    return dict(q=_t(2, 4, 2, 64, dtype=dtype, device=device), k_cache=_t(2, 2, 16, 64, dtype=dtype, device=device),
                v_cache=_t(2, 2, 16, 64, dtype=dtype, device=device),
                cache_seqlens=torch.tensor([3, 4], dtype=torch.int32, device=device))


def call(device, **changes):
    kw = good(device)
    kw.update(changes)
    q, k, v, s = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), kw.pop("cache_seqlens")
    return decode_attention(q, k, v, s, **kw)


OTHER = {"cpu": "cuda", "cuda": "cpu"}
BAD_INPUTS = [  # (id, changes(device), exception, message); "cuda_only" ids skip on the CPU
    ("q_dims", lambda d: dict(q=_t(2, 4, 64, device=d)), ValueError,
     r"q must have 4 dims \[batch, nheads_q, seqlen_new, headdim\], got \(2, 4, 64\)"),
    ("q_type", lambda d: dict(q=[[1.0]]), TypeError, r"q must be a torch.Tensor, got list"),
    ("q_dtype", lambda d: dict(q=_t(2, 4, 2, 64, dtype=torch.int32, device=d)), ValueError,
     r"q must have dtype float32, float16,? (or )?bfloat16.*, got torch.int32"),
    ("k_dtype", lambda d: dict(k_cache=_t(2, 2, 16, 64, dtype=torch.float32, device=d)), ValueError,
     r"k_cache must have q's dtype \(torch.float16\), got torch.float32"),
    ("v_shape", lambda d: dict(v_cache=_t(2, 2, 17, 64, device=d)), ValueError,
     r"v_cache must have k_cache's shape \(2, 2, 16, 64\), got \(2, 2, 17, 64\)"),
    ("batch", lambda d: dict(k_cache=_t(3, 2, 16, 64, device=d), v_cache=_t(3, 2, 16, 64, device=d)), ValueError,
     r"k_cache must have q's batch size \(2\), got \(3, 2, 16, 64\)"),
    ("headdim", lambda d: dict(k_cache=_t(2, 2, 16, 32, device=d), v_cache=_t(2, 2, 16, 32, device=d)), ValueError,
     r"k_cache must have q's headdim \(64\), got \(2, 2, 16, 32\)"),
    ("heads", lambda d: dict(k_cache=_t(2, 3, 16, 64, device=d), v_cache=_t(2, 3, 16, 64, device=d)), ValueError,
     r"q must have nheads_q a multiple of k_cache's nheads_kv \(3\), got 4"),
    ("k_new_alone", lambda d: dict(k_new=_t(2, 2, 2, 64, device=d)), ValueError,
     r"k_new and v_new must both be given or both be None, got k_new=a tensor, v_new=None"),
    ("v_new_alone", lambda d: dict(v_new=_t(2, 2, 2, 64, device=d)), ValueError,
     r"k_new and v_new must both be given or both be None, got k_new=None, v_new=a tensor"),
    ("k_new_shape", lambda d: dict(k_new=_t(2, 2, 3, 64, device=d), v_new=_t(2, 2, 3, 64, device=d)), ValueError,
     r"k_new must have shape \(batch, nheads_kv, seqlen_new, headdim\) = \(2, 2, 2, 64\), got \(2, 2, 3, 64\)"),
    ("v_new_shape", lambda d: dict(k_new=_t(2, 2, 2, 64, device=d), v_new=_t(2, 4, 2, 64, device=d)), ValueError,
     r"v_new must have shape \(batch, nheads_kv, seqlen_new, headdim\) = \(2, 2, 2, 64\), got \(2, 4, 2, 64\)"),
    ("k_new_dtype", lambda d: dict(k_new=_t(2, 2, 2, 64, dtype=torch.bfloat16, device=d),
                                   v_new=_t(2, 2, 2, 64, device=d)), ValueError,
     r"k_new must have q's dtype \(torch.float16\), got torch.bfloat16"),
    ("splits_high", lambda d: dict(num_splits=257), ValueError,
     r"num_splits must be an int in \[0, 256\] \(0: chosen by the heuristic\), got 257"),
    ("splits_negative", lambda d: dict(num_splits=-1), ValueError, r"num_splits must be an int in \[0, 256\]"),
    ("splits_bool", lambda d: dict(num_splits=True), ValueError, r"num_splits must be an int in \[0, 256\] .*got True"),
    ("splits_float", lambda d: dict(num_splits=2.0), ValueError, r"num_splits must be an int in \[0, 256\] .*got 2.0"),
    ("seqlens_float_cpu", lambda d: dict(cache_seqlens=torch.tensor([1.0, 2.0])), ValueError,
     r"cache_seqlens must have an integer dtype \(torch.int32 on the device\), got torch.float32"),
    ("seqlens_len", lambda d: dict(cache_seqlens=[1, 2, 3]), ValueError,
     r"cache_seqlens must have one length per sequence \(2\), got 3"),
    ("seqlens_bool", lambda d: dict(cache_seqlens=True), TypeError,
     r"cache_seqlens must be an int, a sequence of ints or a tensor, got True"),
    ("seqlens_str", lambda d: dict(cache_seqlens="3"), TypeError,
     r"cache_seqlens must be an int, a sequence of ints or a tensor, got str"),
    ("leftpad_shape", lambda d: dict(cache_leftpad=torch.tensor([[0, 0]])), ValueError,
     r"cache_leftpad must have shape \(batch,\) = \(2,\), got \(1, 2\)"),
    ("out_shape", lambda d: dict(out=_t(2, 4, 1, 64, device=d)), ValueError,
     r"out must have q's shape \(2, 4, 2, 64\), got \(2, 4, 1, 64\)"),
    ("out_dtype", lambda d: dict(out=_t(2, 4, 2, 64, dtype=torch.float32, device=d)), ValueError,
     r"out must have q's dtype \(torch.float16\), got torch.float32"),
    ("out_type", lambda d: dict(out=3), TypeError, r"out must be a torch.Tensor or None, got int"),
    ("scale", lambda d: dict(scale="x"), TypeError, r"scale must be a finite number"),
    # CUDA only
    ("cuda_only_seqlens_int64", lambda d: dict(cache_seqlens=torch.tensor([1, 2], device=d)), ValueError,
     r"cache_seqlens must have dtype torch.int32, got torch.int64"),
    ("cuda_only_leftpad_int64", lambda d: dict(cache_leftpad=torch.tensor([0, 0], device=d)), ValueError,
     r"cache_leftpad must have dtype torch.int32, got torch.int64"),
    ("cuda_only_seqlens_shape", lambda d: dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32, device=d)),
     ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\), got \(3,\)"),
    ("cuda_only_headdim_33", lambda d: dict(q=_t(2, 4, 2, 33, device=d), k_cache=_t(2, 2, 16, 33, device=d),
                                            v_cache=_t(2, 2, 16, 33, device=d)), ValueError,
     r"q must have a headdim that is a multiple of 8 in \[8, 256\] on CUDA, got 33"),
    ("cuda_only_headdim_264", lambda d: dict(q=_t(2, 4, 2, 264, device=d), k_cache=_t(2, 2, 16, 264, device=d),
                                             v_cache=_t(2, 2, 16, 264, device=d)), ValueError,
     r"q must have a headdim that is a multiple of 8 in \[8, 256\] on CUDA, got 264"),
    ("cuda_only_float64", lambda d: dict(q=_t(2, 4, 2, 64, dtype=torch.float64, device=d)), ValueError,
     r"q must have dtype float32, float16 or bfloat16, got torch.float64"),
    ("cuda_only_cache_last_stride", lambda d: dict(k_cache=_t(2, 2, 64, 16, device=d).transpose(-1, -2)), ValueError,
     r"k_cache must have a contiguous last dim and 16-byte aligned rows \(other strides multiples of 8\), got "
     r"strides \(2048, 1024, 1, 16\)"),
    ("cuda_only_cache_misaligned", lambda d: dict(v_cache=_t(2 * 2 * 16 * 64 + 1, device=d)[1:].view(2, 2, 16, 64)),
     ValueError, r"v_cache must have a contiguous last dim and 16-byte aligned rows"),
    ("cuda_only_out_stride", lambda d: dict(out=_t(2, 4, 64, 2, device=d).transpose(-1, -2)), ValueError,
     r"out must have a contiguous last dim and 16-byte aligned rows"),
    ("cuda_only_k_cache_device", lambda d: dict(k_cache=_t(2, 2, 16, 64)), ValueError,
     r"k_cache must be on the same device as q \(cuda:0\), got cpu"),
    ("cuda_only_k_new_device", lambda d: dict(k_new=_t(2, 2, 2, 64), v_new=_t(2, 2, 2, 64, device=d)), ValueError,
     r"k_new must be on the same device as q \(cuda:0\), got cpu"),
    ("cuda_only_out_device", lambda d: dict(out=_t(2, 4, 2, 64)), ValueError,
     r"out must be on the same device as q \(cuda:0\), got cpu"),
    ("cpu_only_k_cache_device", lambda d: dict(k_cache=_t(2, 2, 16, 64, device="cuda")), ValueError,
     r"k_cache must be on the same device as q \(cpu\), got cuda"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,changes,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(device, name, changes, exc, match):
    if name.startswith("cuda_only") and device != "cuda":
        pytest.skip("a CUDA-only check")
    if name.startswith("cpu_only"):
        if device != "cpu":
            pytest.skip("a CPU-q check")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA tensor")
    with pytest.raises(exc, match=match):
        call(device, **changes(device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_inputs_through_the_op(device):
    """The op itself (no wrapper) repeats the checks: fake kernel, CPU kernel, C++ launcher (on CUDA
    the message is the launcher's: pinned to the argument's name and requirement)."""
    ops = torch.ops.fused_attn
    kw = good(device)
    q, k, v, s = kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_seqlens"]
    with pytest.raises((ValueError, RuntimeError), match=r"q must have nheads_q a multiple of"):
        ops.decode_attention(q[:, :3], k, v, s)
    with pytest.raises((ValueError, RuntimeError),
                       match=r"cache_seqlens must have dtype .*int32.*, got .*(int64|Long)"):
        ops.decode_attention(q, k, v, s.long())
    with pytest.raises((ValueError, RuntimeError), match=r"num_splits must be .*256.*, got 300"):
        ops.decode_attention(q, k, v, s, None, None, None, None, None, 300)
    with pytest.raises((ValueError, RuntimeError),
                       match=r"k_new (and v_new must both be given or both be None|must be given together with v_new)"):
        ops.decode_attention(q, k, v, s, q[:, :2].clone(), None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "k_new", "v_new"])
def test_requires_grad_raises(device, which):
    kw = good(device, torch.float32)
    kw["k_new"], kw["v_new"] = _t(2, 2, 2, 64, dtype=torch.float32, device=device), _t(2, 2, 2, 64,
                                                                                       dtype=torch.float32,
                                                                                       device=device)
    kw[which] = kw[which].clone().requires_grad_()
    match = rf"{which} must not require grad \(decode_attention writes the cache and records no gradient; " \
            r"fused_attn.reference.decode_attention is differentiable\), got requires_grad=True"
    with pytest.raises(ValueError, match=match):
        decode_attention(kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_seqlens"], k_new=kw["k_new"],
                         v_new=kw["v_new"])
    args = (kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_seqlens"], kw["k_new"], kw["v_new"], None, None, None, 0)
    with pytest.raises(ValueError, match=match):
        torch.ops.fused_attn.decode_attention(*args)
    with pytest.raises(ValueError, match=match):
        torch.ops.fused_attn.decode_attention_out(*args, out=torch.empty_like(kw["q"]).detach())
    with torch.no_grad():  # no grad mode: allowed
        decode_attention(kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_seqlens"], k_new=kw["k_new"],
                         v_new=kw["v_new"])


# --------------------------------------------------------------------------- key_mask, cache_seqlens=None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16, 64])
@pytest.mark.parametrize("form", ["all_slots", "lengths_append", "broadcast"])
def test_key_mask(device, dtype, num_splits, form):
    """A key padding mask on top of the lengths (transformers' decode-step mask row): masked slots hold
    NaN and are read by the kernel, yet contribute nothing; a row whose every key is masked gives 0.
    ``all_slots``: cache_seqlens None (every slot valid, no append); ``broadcast``: a [1, max_len] mask."""
    g = torch.Generator().manual_seed(hash((str(dtype), num_splits, form)) % 2**31)
    batch, nheads_kv, group, headdim, max_len = 3, 2, 4, 64, 300
    seqlen_new = 1 if form != "lengths_append" else 2

    def randn(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    q = randn(batch, nheads_kv * group, seqlen_new, headdim)
    k, v = randn(batch, nheads_kv, max_len, headdim), randn(batch, nheads_kv, max_len, headdim)
    mask = torch.rand(1 if form == "broadcast" else batch, max_len, generator=g) > 0.4
    if form != "broadcast":
        mask[2] = False  # a sequence that sees nothing
    k_new = v_new = seqlens = None
    if form == "lengths_append":
        seqlens = torch.tensor([max_len - seqlen_new, 150, 0], dtype=torch.int32)
        k_new, v_new = randn(batch, nheads_kv, seqlen_new, headdim), randn(batch, nheads_kv, seqlen_new, headdim)
        mask[:, 150:152] = True  # sequence 1's new slots: visible
    hidden = ~mask.expand(batch, max_len)[:, None, :, None]
    k, v = k.masked_fill(hidden, math.nan), v.masked_fill(hidden, math.nan)  # read, never used
    k0, v0 = k.clone(), v.clone()
    args = [t if t is None else t.to(device) for t in (q, k, v, seqlens, k_new, v_new, mask)]
    q_d, k_d, v_d, s_d, kn_d, vn_d, m_d = args
    got = decode_attention(q_d, k_d, v_d, s_d, k_new=kn_d, v_new=vn_d, key_mask=m_d, num_splits=num_splits)
    assert not got.isnan().any()
    want = reference.decode_attention(q.double(), k0.double(), v0.double(), seqlens, None if k_new is None else
                                      k_new.double(), None if v_new is None else v_new.double(), key_mask=mask)[0]
    peer = reference.decode_attention(q, k0, v0, seqlens, k_new, v_new, key_mask=mask, compute_dtype=dtype)[0]
    magnitude = reference.decode_attention(q.double(), k0.double(), v0.double().nan_to_num().abs(), seqlens,
                                           None if k_new is None else k_new.double(),
                                           None if v_new is None else v_new.double().abs(), key_mask=mask)[0]
    visible = reference.decode_visible(seqlens, seqlen_new, max_len, k_new is not None, None, mask, batch)
    k_all = reference.decode_attention(q, k0, v0, seqlens, k_new, v_new, key_mask=mask)[1].double()
    scores = (q.double() @ k_all.nan_to_num().repeat_interleave(group, dim=1).transpose(-1, -2)) * headdim ** -0.5
    smax = scores.abs().masked_fill(~visible, 0).amax(dim=-1)
    assert_attention_close(got.cpu(), peer, want, magnitude, smax, f"{form} splits={num_splits} {dtype}")
    if form != "broadcast":
        assert (got[2] == 0).all()
