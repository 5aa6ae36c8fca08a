"""scaled_masked_softmax: CUDA kernels (v0, v1) and the CPU path against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.softmax import scaled_masked_softmax
from tests.rowref import softmax_rows
from tests.tolerances import assert_close, fp32_tolerance, softmax_backward_tolerance, softmax_tolerance


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Launch-shape boundaries of v1 (csrc/softmax/softmax_row_class.h) and odd / prime lengths.
BOUNDARY_SK = [1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 127, 129, 255, 256, 257, 511, 513, 1000, 1023, 1024,
               1025, 2047, 2048, 2049, 4095, 4097, 8191, 8193, 12289, 16383, 16384]
MASK_FORMS = ["none", "bool_full", "bool_padding", "bool_qk", "add_padding", "add_full", "bool_unfoldable",
              "bool_dead_rows", "bool_strided", "add_strided"]
ON_GPU_BUDGET = 1 << 22  # elements per example
ON_CPU_BUDGET = 1 << 14


def scores_of(x, scale, causal, attn_mask):
    """The float64 pre-softmax scores the reference uses (for the tolerance)."""
    return reference.scores(x, scale, causal=causal, attn_mask=attn_mask)


def make_mask(form, lead, sq, sk, dtype, gen, device):
    def rand_bool(shape):
        return torch.rand(shape, generator=gen, device=device) > 0.3

    n = len(lead)
    if form == "none":
        return None
    if form == "bool_full":
        return rand_bool((*lead, sq, sk))
    if form == "bool_padding":  # [B, 1, ..., 1, sk]
        return rand_bool((*lead[:1], *([1] * max(n - 1, 0)), 1, sk))
    if form == "bool_qk":  # [sq, sk] broadcast over all leading dims
        return rand_bool((sq, sk))
    if form == "add_padding":
        m = torch.zeros((*lead[:1], *([1] * max(n - 1, 0)), 1, sk), device=device)
        m.masked_fill_(~rand_bool(m.shape), -math.inf)
        return (m + torch.randn(m.shape, generator=gen, device=device)).to(dtype)
    if form == "add_full":
        return torch.randn((*lead, sq, sk), generator=gen, device=device).to(dtype)
    if form == "bool_unfoldable":  # broadcast in a middle leading dim: strides don't fold
        shape = [*lead, sq, sk]
        if n >= 3:
            shape[1] = 1
        return rand_bool(tuple(shape))
    if form == "bool_dead_rows":  # about a third of the rows have no visible key
        keep = rand_bool((*lead, sq, sk))
        return keep & (torch.rand((*lead, sq, 1), generator=gen, device=device) > 0.35)
    if form == "bool_strided":  # padding mask whose last dim has stride 2
        return rand_bool((*lead[:1], *([1] * max(n - 1, 0)), 1, 2 * sk))[..., ::2]
    if form == "add_strided":  # additive [sq, sk] mask read through a transpose (last-dim stride sq)
        return torch.randn((sk, sq), generator=gen, device=device).to(dtype).t()
    raise AssertionError(form)


SCALES = st.one_of(st.just(1.0), st.floats(0.05, 3.0), st.floats(-3.0, -0.05))  # never 0 (that hides the scores)


@st.composite
def softmax_case(draw, budget, dtypes=tuple(DTYPES), versions=(0, 1)):
    # Batch and heads >= 2 half of the time (padding masks broadcast over them); empty tensors
    # are test_empty's.
    lead = draw(st.one_of(st.tuples(st.integers(2, 4), st.integers(2, 4)),
                          st.lists(st.integers(1, 3), max_size=3).map(tuple)))
    lead_n = max(math.prod(lead), 1)
    sk_max = max(1, min(16384, budget // lead_n))
    sk = draw(st.one_of(st.integers(1, min(64, sk_max)), st.integers(1, sk_max),
                        st.sampled_from([s for s in BOUNDARY_SK if s <= sk_max])))
    sq_max = max(1, min(2048, budget // (lead_n * sk)))
    sq = draw(st.one_of(st.just(1), st.integers(1, sq_max)))
    return dict(
        lead=lead, sq=sq, sk=sk,
        dtype=draw(st.sampled_from(dtypes)),
        version=draw(st.sampled_from(versions)),
        scale=draw(SCALES),
        causal=draw(st.booleans()),
        # padding masks (broadcast over batch and heads) in about half of the examples
        mask=draw(st.one_of(st.sampled_from(["bool_padding", "add_padding", "bool_strided"]),
                            st.sampled_from(MASK_FORMS))),
        magnitude=draw(st.sampled_from([1e-3, 1.0, 10.0, 1e2, 1e4])),
        use_out=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_case(case, device):
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    lead, sq, sk, dtype = case["lead"], case["sq"], case["sk"], case["dtype"]
    x = (torch.randn((*lead, sq, sk), generator=gen, device=device) * case["magnitude"]).to(dtype)
    mask = make_mask(case["mask"], lead, sq, sk, dtype, gen, device)
    check(x, case["scale"], case["causal"], mask, case["version"], case["use_out"])


def expected(x, scale, causal, mask):
    """float64 softmax: the row-by-row definition on the CPU (whose op path is reference.py itself),
    reference.py on the GPU."""
    if x.device.type == "cpu":
        return softmax_rows(x, scale, causal=causal, attn_mask=mask)
    return reference.scaled_masked_softmax(x.double(), scale, causal=causal, attn_mask=mask)


def check(x, scale, causal, mask, version=1, use_out=True):
    """Run the op (output poisoned with NaN first when use_out) and compare with float64."""
    if use_out:
        out = torch.full_like(x, math.nan)
        got = scaled_masked_softmax(x, scale, causal=causal, attn_mask=mask, out=out, version=version)
        assert got is out
    else:
        got = scaled_masked_softmax(x, scale, causal=causal, attn_mask=mask, version=version)
    want = expected(x, scale, causal, mask)
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = softmax_tolerance(want.double(), scores_of(x, scale, causal, mask), x.dtype)
    where = f"x{tuple(x.shape)} {x.dtype} scale={scale} causal={causal} mask={None if mask is None else (tuple(mask.shape), mask.dtype)} v{version}"
    assert_close(got, want, tol, where)


# --------------------------------------------------------------------------- GPU properties


@pytest.mark.gpu
@given(case=softmax_case(ON_GPU_BUDGET))
@example(case=dict(lead=(8, 12), sq=128, sk=128, dtype=torch.float16, version=1, scale=0.125, causal=True,
                   mask="none", magnitude=1.0, use_out=True, seed=0))
@example(case=dict(lead=(2, 3), sq=6, sk=12289, dtype=torch.float32, version=1, scale=1.0, causal=False,
                   mask="bool_dead_rows", magnitude=1.0, use_out=False, seed=1))
@example(case=dict(lead=(2, 3), sq=5, sk=40000, dtype=torch.float16, version=1, scale=0.3, causal=True,
                   mask="bool_dead_rows", magnitude=10.0, use_out=True, seed=1))
@example(case=dict(lead=(3, 2), sq=7, sk=1024, dtype=torch.float16, version=1, scale=0.5, causal=True,
                   mask="bool_strided", magnitude=1.0, use_out=True, seed=1))
@example(case=dict(lead=(2, 2), sq=64, sk=64, dtype=torch.bfloat16, version=1, scale=-1.5, causal=False,
                   mask="add_strided", magnitude=1.0, use_out=False, seed=1))
@example(case=dict(lead=(2, 3), sq=1, sk=16384, dtype=torch.bfloat16, version=1, scale=0.5, causal=True,
                   mask="add_padding", magnitude=10.0, use_out=True, seed=2))
@example(case=dict(lead=(2, 2, 3), sq=33, sk=1025, dtype=torch.float16, version=0, scale=1.0, causal=True,
                   mask="bool_unfoldable", magnitude=1.0, use_out=True, seed=3))
@example(case=dict(lead=(), sq=2048, sk=2047, dtype=torch.float32, version=1, scale=-0.7, causal=True,
                   mask="bool_qk", magnitude=1e2, use_out=True, seed=4))
# The causal-only launch shapes (csrc/softmax/softmax_row_class.h): 4097..8192 keys with its first rows fully masked
# (seqlen_q > seqlen_k), an odd length (scalar path) and bfloat16 extremes; the same at sq = 1;
# 65..128 keys, odd, fully masked rows, float16 extremes; 129..256 keys, vectorized, with a mask.
@example(case=dict(lead=(2,), sq=5003, sk=5001, dtype=torch.bfloat16, version=1, scale=0.125, causal=True,
                   mask="add_padding", magnitude=1e4, use_out=True, seed=5))
@example(case=dict(lead=(4, 3), sq=1, sk=8192, dtype=torch.float16, version=1, scale=1.0, causal=True,
                   mask="none", magnitude=1e2, use_out=True, seed=6))
@example(case=dict(lead=(3, 4), sq=130, sk=127, dtype=torch.float16, version=1, scale=0.01, causal=True,
                   mask="bool_qk", magnitude=1e4, use_out=True, seed=7))
@example(case=dict(lead=(2, 3), sq=256, sk=256, dtype=torch.float16, version=1, scale=0.5, causal=True,
                   mask="bool_full", magnitude=10.0, use_out=False, seed=8))
def test_matches_reference_gpu(case):
    run_case(case, "cuda")


@st.composite
def extreme_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    sk = draw(st.one_of(st.sampled_from(BOUNDARY_SK), st.integers(1, 4096)))
    sq = draw(st.integers(1, max(1, min(64, (1 << 20) // sk))))
    kind = draw(st.sampled_from(["fp16_edge", "huge", "all_equal", "spike", "neg_inf_entries", "tiny"]))
    return dict(dtype=dtype, sq=sq, sk=sk, kind=kind, version=draw(st.sampled_from([0, 1])),
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def extreme_input(case, device):
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    shape = (2, case["sq"], case["sk"])
    x = torch.randn(shape, generator=gen, device=device)
    scale = 1.0
    kind = case["kind"]
    if kind == "fp16_edge":  # values near the float16 limit; only a scale < 1 keeps them meaningful
        x = (x.sign() * (60000 + 5000 * torch.rand(shape, generator=gen, device=device))).clamp(-65504, 65504)
        scale = 0.01
    elif kind == "huge":
        x = x * 1e4
        scale = 0.5
    elif kind == "all_equal":
        x = torch.full(shape, 3.25, device=device)
    elif kind == "spike":
        x = x * 0.01
        idx = torch.randint(0, case["sk"], (2, case["sq"], 1), generator=gen, device=device)
        x.scatter_(-1, idx, 1e4)
    elif kind == "neg_inf_entries":
        x = x.masked_fill(torch.rand(shape, generator=gen, device=device) < 0.4, -math.inf)
    elif kind == "tiny":
        x = x * 1e-6
    return x.to(case["dtype"]), scale


@pytest.mark.gpu
@given(case=extreme_case())
@example(case=dict(dtype=torch.float16, sq=3, sk=1024, kind="fp16_edge", version=1, causal=False, seed=0))
@example(case=dict(dtype=torch.float32, sq=1, sk=1, kind="neg_inf_entries", version=1, causal=False, seed=5))
@example(case=dict(dtype=torch.float16, sq=64, sk=8000, kind="fp16_edge", version=1, causal=True, seed=6))
@example(case=dict(dtype=torch.bfloat16, sq=128, sk=120, kind="huge", version=1, causal=True, seed=7))
def test_extreme_magnitudes_gpu(case):
    x, scale = extreme_input(case, "cuda")
    check(x, scale, case["causal"], None, case["version"])


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [5, 100, 1024, 3000, 40000])
def test_fully_masked_rows_are_zero_gpu(dtype, version, sk):
    gen = torch.Generator(device="cuda").manual_seed(sk)
    x = torch.randn(2, 3, 6, sk, device="cuda", generator=gen).to(dtype)
    keep = torch.rand(2, 1, 6, sk, device="cuda", generator=gen) > 0.5
    keep[0, :, 2] = False  # row fully masked by attn_mask
    keep[1, :, :] = False  # a whole batch element masked
    x[1, 2, 4] = -math.inf  # row masked by -inf scores
    out = scaled_masked_softmax(x, 0.3, attn_mask=keep, version=version)
    assert not out.isnan().any()
    assert (out[0, :, 2] == 0).all() and (out[1] == 0).all()
    check(x, 0.3, False, keep, version)
    # causal with seqlen_q > seqlen_k: the first rows see no key
    xq = torch.randn(2, sk + 3, sk, device="cuda", generator=gen).to(dtype) if sk <= 3000 else None
    if xq is not None:
        outq = scaled_masked_softmax(xq, causal=True, version=version)
        assert (outq[:, :3] == 0).all() and not outq.isnan().any()
        check(xq, 1.0, True, None, version)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [32769, 40001, 65536, 131072])
def test_long_rows_gpu(dtype, version, sk):
    gen = torch.Generator(device="cuda").manual_seed(sk)
    x = torch.randn(2, 3, sk, device="cuda", generator=gen).to(dtype) * 4
    pad = torch.rand(2, 1, sk, device="cuda", generator=gen) > 0.1
    check(x, 0.7, True, None, version)
    check(x, 0.7, False, pad, version, use_out=False)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("sk", [7, 64, 1000, 40000])
def test_nan_in_visible_element_poisons_row_gpu(version, sk):
    x = torch.randn(3, 4, sk, device="cuda")
    x[0, 1, sk // 2] = math.nan
    keep = torch.ones(3, 4, sk, dtype=torch.bool, device="cuda")
    keep[1, 2] = False
    keep[1, 2, 0] = True
    x[1, 2, 0] = math.nan  # the only visible element is NaN
    x[2, 0, -1] = math.nan  # under the causal mask of row 0: never read
    out = scaled_masked_softmax(x, attn_mask=keep, version=version)
    assert out[0, 1].isnan().all() and out[1, 2].isnan().all()
    assert not out[0, 0].isnan().any()
    outc = scaled_masked_softmax(x[2:], causal=True, version=version)
    assert not outc[0, 0].isnan().any()
    check(x, 1.0, False, keep, version)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_finfo_min_on_every_key_gives_a_uniform_row(device, dtype):
    """Hugging Face's additive masks use finfo.min. Scores are float32, so for float32 and bfloat16
    (finfo.min = -3.4e38) a row masked that way everywhere is uniform, as in PyTorch; a float16 mask
    (-65504) does not swamp the scores in float32 and the row equals the unmasked softmax. Only -inf
    scores make a row 'fully masked' (zeros)."""
    x = torch.randn(2, 5, 37, device=device).to(dtype)
    mask = torch.zeros(2, 1, 5, 37, device=device, dtype=dtype)
    mask[1, :, 3] = torch.finfo(dtype).min
    for version in ([0, 1] if device == "cuda" else [1]):
        out = scaled_masked_softmax(x.unsqueeze(1), 0.5, attn_mask=mask, version=version)
        want = reference.scaled_masked_softmax(x.unsqueeze(1), 0.5, attn_mask=mask)
        assert_close(out, want, softmax_tolerance(want.double(), scores_of(x.unsqueeze(1), 0.5, False, mask), dtype))
        row = out[1, 0, 3].float()
        if dtype == torch.float16:
            unmasked = scaled_masked_softmax(x[1, 3].unsqueeze(0), 0.5).float()[0]
            torch.testing.assert_close(row, unmasked, rtol=2e-3, atol=1e-4)
        else:
            torch.testing.assert_close(row, torch.full((37,), 1 / 37, device=device), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [100, 128, 200, 256, 4100, 5001, 8000, 8192])
def test_causal_row_shapes_gpu(dtype, sk):
    """The causal-only launch shapes (csrc/softmax/softmax_row_class.h: 65..256, 4097..8192)
    over a whole causal triangle (seqlen_q = seqlen_k: every visible length from 1 to sk), with
    and without a padding mask; odd sizes take the scalar path."""
    gen = torch.Generator(device="cuda").manual_seed(sk)
    lead = (2,) if sk <= 256 else ()
    x = torch.randn(*lead, sk, sk, device="cuda", generator=gen).to(dtype) * 3
    pad = torch.rand(*lead, 1, sk, device="cuda", generator=gen) > 0.2
    check(x, 0.3, True, None)
    check(x, 0.3, True, pad, use_out=False)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
def test_noncontiguous_and_inplace_gpu(version):
    x = torch.randn(4, 64, 3, 96, device="cuda", dtype=torch.float16).transpose(1, 2)  # [4,3,64,96] strided
    assert not x.is_contiguous()
    check(x, 0.25, True, None, version, use_out=False)
    y = torch.randn(2, 8, 8, 200, device="cuda")[..., :130]  # row stride != row length
    check(y, 1.0, False, None, version)
    z = torch.randn(2, 3, 17, 33, device="cuda", dtype=torch.bfloat16)
    want = reference.scaled_masked_softmax(z, 0.5, causal=True)
    tol = softmax_tolerance(want.double(), scores_of(z, 0.5, True, None), z.dtype)
    scaled_masked_softmax(z, 0.5, causal=True, out=z, version=version)  # in place
    assert_close(z, want, tol)


@pytest.mark.gpu
def test_misaligned_pointers_take_scalar_path_gpu():
    base = torch.randn(3 * 256 + 1, device="cuda", dtype=torch.float16)
    x = base[1:].view(3, 256)  # 2-byte offset: not 16-byte aligned
    check(x, 1.0, True, None, 1)


@pytest.mark.gpu
def test_does_not_sync_and_uses_current_stream_gpu():
    x = torch.randn(16, 512, 512, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = scaled_masked_softmax(x, 0.1, causal=True)
            scaled_masked_softmax(x, 0.1, causal=True, version=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    check(x, 0.1, True, None)
    assert_close(y, reference.scaled_masked_softmax(x, 0.1, causal=True), torch.tensor(1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
def test_cuda_graph_capture_and_replay_gpu(version):
    x = torch.randn(2, 4, 100, 300, device="cuda", dtype=torch.float16)
    mask = torch.rand(2, 1, 1, 300, device="cuda") > 0.2
    out = torch.empty_like(x)
    scaled_masked_softmax(x, 0.5, causal=True, attn_mask=mask, out=out, version=version)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        scaled_masked_softmax(x, 0.5, causal=True, attn_mask=mask, out=out, version=version)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        mask.copy_(torch.rand(mask.shape, generator=gen, device="cuda") > 0.2)
        out.fill_(math.nan)
        g.replay()
        want = reference.scaled_masked_softmax(x, 0.5, causal=True, attn_mask=mask)
        assert_close(out, want, softmax_tolerance(want.double(), scores_of(x, 0.5, True, mask), x.dtype))


# --------------------------------------------------------------------------- every launch class, layouts

# Each row class of FA_SOFTMAX_ROW_CLASS (csrc/softmax/softmax_row_class.h) at its largest length (a multiple of 8:
# the vectorized path for every dtype) and its smallest (odd: the scalar path), up to the
# streaming path for rows over 32768.
ROW_CLASS_SK = [1, 7, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048, 2049, 4096, 4097,
                8192, 8193, 16384, 16385, 32768, 32769, 40960]
FULL_CHECK_MAX = 2 << 20  # elements of x checked whole; larger inputs are checked on sampled rows


def sampled_rows(sq, gen, n=24):
    """The first and last query rows (fully masked / shortest / longest causal rows) and random ones."""
    edge = {0, 1, 2, 3, 4, sq - 2, sq - 1}
    rand = torch.randint(0, sq, (n,), generator=gen).tolist()
    return sorted(r for r in edge | set(rand) if 0 <= r < sq)


def check_rows(x, scale, causal, mask, rows, version=1):
    """The op on the whole of x; query rows ``rows`` of its output against float64 of those rows alone
    (the causal mask of each sampled row rebuilt as a bool mask). ``mask``: None or bool, any shape
    broadcastable to x."""
    got = scaled_masked_softmax(x, scale, causal=causal, attn_mask=mask, version=version)
    sq, sk = x.shape[-2], x.shape[-1]
    idx = torch.tensor(rows, device=x.device)
    keep = torch.ones(len(rows), sk, dtype=torch.bool, device=x.device)
    if causal:
        keep = torch.arange(sk, device=x.device) <= idx[:, None] + (sk - sq)
    if mask is not None:
        keep = keep & mask.broadcast_to(x.shape).index_select(-2, idx)
    xs = x.index_select(-2, idx)
    want = expected(xs, scale, False, keep)
    tol = softmax_tolerance(want, scores_of(xs, scale, False, keep), x.dtype)
    assert_close(got.index_select(-2, idx), want, tol, f"rows {rows[:8]}... of x{tuple(x.shape)} {x.dtype} "
                 f"causal={causal} v{version}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq_kind", ["1", "sk", "sk+3"])
@pytest.mark.parametrize("sk", ROW_CLASS_SK)
def test_every_launch_class_gpu(sk, sq_kind, causal, dtype):
    sq = {"1": 1, "sk": sk, "sk+3": sk + 3}[sq_kind]
    lead = (2, 3) if sk <= 256 else (2,) if sk <= 2048 else ()
    gen = torch.Generator(device="cuda").manual_seed(sk * 7 + len(sq_kind))
    x = torch.randn((*lead, sq, sk), generator=gen, device="cuda", dtype=dtype).mul_(3)
    if x.numel() <= FULL_CHECK_MAX:
        check(x, 0.7, causal, None)
    else:
        check_rows(x, 0.7, causal, None, sampled_rows(sq, torch.Generator().manual_seed(sk)))


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [7, 1024, 1025, 40960])
def test_v0_rows_gpu(sk):
    gen = torch.Generator(device="cuda").manual_seed(sk)
    x = torch.randn(2, sk + 3 if sk < 2048 else 3, sk, generator=gen, device="cuda").half()
    check(x, 0.7, True, None, version=0)
    check(x, 0.7, False, None, version=0, use_out=False)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_benchmark_scale_shape_on_sampled_rows_gpu(causal):
    """The largest benchmark shapes (bench/bench_softmax.py), padding mask over B and H, sampled rows."""
    gen = torch.Generator(device="cuda").manual_seed(int(causal))
    x = torch.randn(1, 16, 8192, 8192, generator=gen, device="cuda", dtype=torch.float16)
    pad = torch.rand(1, 1, 1, 8192, generator=gen, device="cuda") > 0.1
    rows = sampled_rows(8192, torch.Generator().manual_seed(3))
    check_rows(x, 0.125, causal, None, rows)
    check_rows(x, 0.125, causal, pad, rows)
    x = torch.randn(16, 12, 2048, 2048, generator=gen, device="cuda", dtype=torch.float16)
    pad = torch.rand(16, 1, 1, 2048, generator=gen, device="cuda") > 0.3
    check_rows(x, 0.125, causal, pad, rows=sampled_rows(2048, torch.Generator().manual_seed(4)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [64, 1000, 1024, 40000])
def test_mask_with_last_dim_stride_not_one_gpu(dtype, sk):
    """Masks are read through their strides: a padding mask sliced [..., ::2], a [sq, sk] additive
    mask that is a transpose (stride_k = sq), a bool [B, H, sq, sk] mask sliced [..., ::3]."""
    gen = torch.Generator(device="cuda").manual_seed(sk)
    sq = 5
    x = torch.randn(2, 3, sq, sk, generator=gen, device="cuda").to(dtype)
    pad = (torch.rand(2, 1, 1, 2 * sk, generator=gen, device="cuda") > 0.4)[..., ::2]
    add = torch.randn(sk, sq, generator=gen, device="cuda").to(dtype).t()
    full = (torch.rand(2, 3, sq, 3 * sk, generator=gen, device="cuda") > 0.5)[..., ::3]
    for mask in (pad, add, full):
        assert mask.stride(-1) != 1
        check(x, 0.9, False, mask)
        check(x, 0.9, True, mask, use_out=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [64, 1024, 40000])
def test_misaligned_out_gpu(dtype, sk):
    """An aligned x (vectorizable) written to a contiguous out that starts one element into a buffer:
    the launch must not take the 16-byte vector stores."""
    gen = torch.Generator(device="cuda").manual_seed(sk)
    x = torch.randn(2, 3, sk, generator=gen, device="cuda").to(dtype)
    buf = torch.full((x.numel() + 2,), -7.0, device="cuda", dtype=dtype)
    out = buf[1:-1].view(x.shape)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0 and x.data_ptr() % 16 == 0
    got = scaled_masked_softmax(x, 0.5, causal=True, out=out)
    assert got is out
    want = expected(x, 0.5, True, None)
    assert_close(out, want, softmax_tolerance(want, scores_of(x, 0.5, True, None), dtype))
    assert buf[0].item() == -7.0 and buf[-1].item() == -7.0  # nothing written outside out


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [64, 1024, 8192, 40000])
def test_inplace_out_is_x_vectorized_gpu(sk, dtype, version):
    gen = torch.Generator(device="cuda").manual_seed(sk)
    z = (torch.randn(2, 3, 9, sk, generator=gen, device="cuda") * 2).to(dtype)
    pad = torch.rand(2, 1, 1, sk, generator=gen, device="cuda") > 0.2
    want = expected(z, 0.5, True, pad)
    tol = softmax_tolerance(want, scores_of(z, 0.5, True, pad), dtype)
    scaled_masked_softmax(z, 0.5, causal=True, attn_mask=pad, out=z, version=version)
    assert_close(z, want, tol, "in place")


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1])
def test_runs_on_the_current_nondefault_stream_gpu(version):
    """A sleep kernel, then the fill of x, then the op, all on stream s: an op launched on any
    other stream reads x before the fill."""
    gen = torch.Generator(device="cuda").manual_seed(version)
    src = torch.randn(8, 256, 512, generator=gen, device="cuda")
    x = torch.zeros_like(src)
    out = torch.empty_like(src)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of spinning on s
        x.copy_(src)
        y = scaled_masked_softmax(x, 0.3, causal=True, version=version)
        scaled_masked_softmax(x, 0.3, causal=True, version=version, out=out)
    torch.cuda.synchronize()
    want = expected(src, 0.3, True, None)
    tol = softmax_tolerance(want, scores_of(src, 0.3, True, None), src.dtype)
    assert_close(y, want, tol, "returned")
    assert_close(out, want, tol, "out=")


# --------------------------------------------------------------------------- CPU path


@given(case=softmax_case(ON_CPU_BUDGET, versions=(1,)))
@example(case=dict(lead=(2, 3), sq=4, sk=4, dtype=torch.float32, version=1, scale=1.0, causal=True,
                   mask="bool_full", magnitude=1.0, use_out=True, seed=0))
@example(case=dict(lead=(2, 3), sq=5, sk=9, dtype=torch.float32, version=1, scale=0.5, causal=True,
                   mask="add_padding", magnitude=1.0, use_out=False, seed=1))
def test_cpu_path_matches_row_definition(case):
    """The CPU path against tests/rowref.py (not against reference.py, which it calls)."""
    run_case(case, "cpu")


@given(case=softmax_case(ON_CPU_BUDGET, dtypes=(torch.float32,), versions=(1,)))
@example(case=dict(lead=(2, 3), sq=7, sk=5, dtype=torch.float32, version=1, scale=-0.5, causal=True,
                   mask="add_full", magnitude=1.0, use_out=False, seed=2))
def test_reference_matches_row_definition(case):
    """reference.py (what the GPU tests trust) in float64 against the row-by-row definition."""
    gen = torch.Generator().manual_seed(case["seed"])
    lead, sq, sk = case["lead"], case["sq"], case["sk"]
    x = torch.randn((*lead, sq, sk), generator=gen, dtype=torch.float64) * case["magnitude"]
    mask = make_mask(case["mask"], lead, sq, sk, torch.float64, gen, "cpu")
    got = reference.scaled_masked_softmax(x, case["scale"], causal=case["causal"], attn_mask=mask)
    want = softmax_rows(x, case["scale"], causal=case["causal"], attn_mask=mask)
    assert_close(got, want, torch.tensor(1e-12) + 1e-12 * want.abs(), f"{case}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq_kind", ["1", "sk", "sk+3"])
@pytest.mark.parametrize("mask", MASK_FORMS)
def test_cpu_grid_matches_row_definition(mask, sq_kind, causal, dtype):
    """Every mask form x causal x (seqlen_q = 1, = seqlen_k, > seqlen_k) x dtype, deterministic."""
    sk = 13
    sq = {"1": 1, "sk": sk, "sk+3": sk + 3}[sq_kind]
    lead = (2, 3, 2)
    gen = torch.Generator().manual_seed(len(mask) * 31 + sq)
    x = (torch.randn((*lead, sq, sk), generator=gen) * 2).to(dtype)
    check(x, 0.6, causal, make_mask(mask, lead, sq, sk, dtype, gen, "cpu"))


def test_cpu_fully_masked_rows_and_sq_gt_sk():
    x = torch.randn(2, 6, 4)
    out = scaled_masked_softmax(x, causal=True)
    assert (out[:, :2] == 0).all() and not out.isnan().any()
    torch.testing.assert_close(out[:, 2:].sum(-1), torch.ones(2, 4))
    # decode row: seqlen_q = 1 sees every key
    d = scaled_masked_softmax(torch.zeros(1, 1, 5), causal=True)
    torch.testing.assert_close(d, torch.full((1, 1, 5), 0.2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.xfail(strict=True, reason="x * scale is computed in float32 and overflows to inf "
                                       "(NaN rows) where the float64 definition is finite")
def test_scores_overflowing_float32_after_scaling(device, dtype):
    x = torch.tensor([[3.0e38, 2.9e38, -1.0e38, 1.0, 2.0e38]], device=device).to(dtype)
    x = x.expand(3, 5).clone()
    x[1, 1] = 3.0e38  # a tie at the top: two overflowing scores share the row
    check(x, 4.0, False, None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shape", [(0, 4, 4), (2, 0, 4), (2, 3, 0), (0, 0), (2, 0, 5, 7)])
def test_empty(device, shape, version):
    x = torch.randn(shape, device=device)
    pad = torch.ones(*shape[:-2], 1, shape[-1], dtype=torch.bool, device=device)
    for kwargs in (dict(causal=True), dict(attn_mask=pad), dict(out=torch.empty_like(x))):
        out = scaled_masked_softmax(x, 0.5, version=version, **kwargs)
        assert out.shape == x.shape and out.device == x.device and out.dtype == x.dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_traces_our_op(device):
    """torch.compile(fullgraph=True) of attention probabilities: the traced graph calls our op (on
    CUDA; the CPU path is plain PyTorch by design) and the compiled result matches float64."""
    graphs = []

    def recording_inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def attn_probs(q, k, mask, out):
        s = q @ k.transpose(-1, -2)
        p = scaled_masked_softmax(s, q.shape[-1] ** -0.5, causal=True, attn_mask=mask)
        scaled_masked_softmax(s, 0.5, out=out)
        return p * 2

    torch._dynamo.reset()
    compiled = torch.compile(attn_probs, fullgraph=True, backend=recording_inductor)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 3, 16, 8, generator=gen, device=device)
    k = torch.randn(2, 3, 24, 8, generator=gen, device=device)
    mask = torch.rand(2, 1, 1, 24, generator=gen, device=device) > 0.2
    out = torch.full((2, 3, 16, 24), math.nan, device=device)
    got = compiled(q, k, mask, out)
    assert len(graphs) == 1
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    if device == "cuda":
        assert sum("fused_attn.scaled_masked_softmax" in o for o in ops) >= 2, ops
    s = q @ k.transpose(-1, -2)
    for what, value, factor, args in (("returned", got, 2, (8 ** -0.5, True, mask)), ("out=", out, 1, (0.5, False, None))):
        want = expected(s, *args)
        tol = softmax_tolerance(want, scores_of(s, *args), torch.float32)
        assert_close(value, want * factor, tol * factor, what)


# --------------------------------------------------------------------------- bad input

BAD_INPUTS = [
    (lambda d: dict(x=torch.zeros(2, 3, dtype=torch.int64, device=d)), ValueError,
     r"x must have dtype float32, float16,? (or )?bfloat16( or float64 \(CPU\))?, got torch.int64"),
    (lambda d: dict(x=torch.zeros(5, device=d)), ValueError,
     r"x must have at least 2 dims \[\.\.\., seqlen_q, seqlen_k\], got \(5,\)"),
    (lambda d: dict(x=torch.zeros(2, 3, device=d), scale=math.inf), ValueError, r"scale must be a finite number, got inf"),
    (lambda d: dict(x=torch.zeros(2, 3, device=d), scale=math.nan), ValueError, r"scale must be a finite number, got nan"),
    (lambda d: dict(x=torch.zeros(2, 3, device=d), version=2), ValueError, r"version must be 0 or 1, got 2"),
    (lambda d: dict(x=torch.zeros(2, 3, 4, device=d), attn_mask=torch.ones(2, 1, 5, dtype=torch.bool, device=d)),
     ValueError, r"attn_mask must be broadcastable to \(2, 3, 4\), got \(2, 1, 5\)"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d), attn_mask=torch.ones(2, 3, 4, dtype=torch.bool, device=d)),
     ValueError, r"attn_mask must be broadcastable to \(3, 4\), got \(2, 3, 4\)"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d), attn_mask=torch.ones(3, 4, dtype=torch.int32, device=d)),
     ValueError, r"attn_mask must have dtype bool or x's dtype \(torch.float32\), got torch.int32"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d, dtype=torch.float16), attn_mask=torch.ones(3, 4, device=d)),
     ValueError, r"attn_mask must have dtype bool or x's dtype \(torch.float16\), got torch.float32"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d), out=torch.empty(3, 5, device=d)), ValueError,
     r"out must have x's shape \(3, 4\), got \(3, 5\)"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d), out=torch.empty(3, 4, device=d, dtype=torch.float16)), ValueError,
     r"out must have x's dtype \(torch.float32\), got torch.float16"),
    (lambda d: dict(x=torch.zeros(3, 4, device=d), out=torch.empty(4, 3, device=d).t()), ValueError,
     r"out must be contiguous, got strides \(1, 3\)"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make,exc,match", BAD_INPUTS)
def test_bad_input_raises(device, make, exc, match):
    kwargs = make(device)
    x = kwargs.pop("x")
    scale = kwargs.pop("scale", 1.0)
    with pytest.raises(exc, match=match):
        scaled_masked_softmax(x, scale, **kwargs)


@pytest.mark.gpu
def test_mixed_devices_raise_gpu():
    x = torch.zeros(3, 4, device="cuda")
    with pytest.raises(ValueError, match=r"attn_mask must be on the same device as x \(cuda:0\), got cpu"):
        scaled_masked_softmax(x, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"out must be on the same device as x \(cuda:0\), got cpu"):
        scaled_masked_softmax(x, out=torch.empty(3, 4))


@pytest.mark.gpu
def test_cpp_mixed_device_messages_gpu(built_library):
    x = torch.zeros(3, 4, device="cuda")
    ops = torch.ops.fused_attn
    with pytest.raises(ValueError, match=r"attn_mask must be on the same device as x \(cuda:0\), got cpu"):
        ops.scaled_masked_softmax(x, 1.0, causal=False, attn_mask=torch.ones(3, 4, dtype=torch.bool), version=1)
    with pytest.raises(ValueError, match=r"out must be on the same device as x \(cuda:0\), got cpu"):
        ops.scaled_masked_softmax_out(x, 1.0, causal=False, attn_mask=None, version=1, out=torch.empty(3, 4))


# Argument types: the same rules for the wrapper on every device, for the forward and the backward,
# those of F.scaled_dot_product_attention (is_causal a bool; scale a number or a 0-d tensor that does
# not require grad, read with float()), except that scale may be neither a bool (a misplaced causal)
# nor a CUDA tensor (reading it would synchronize the host).
SCALE_TYPE = r"scale must be a finite number or a 0-d CPU tensor that does not require grad, got "
BAD_ARGUMENT_TYPES = [
    (lambda: dict(causal="yes"), r"causal must be a bool, got 'yes'"),
    (lambda: dict(causal=None), r"causal must be a bool, got None"),
    (lambda: dict(causal=1), r"causal must be a bool, got 1"),
    (lambda: dict(scale="a"), SCALE_TYPE + r"'a'"),
    (lambda: dict(scale=None), SCALE_TYPE + r"None"),
    (lambda: dict(scale=True), SCALE_TYPE + r"True"),
    (lambda: dict(scale=torch.tensor([0.5])), SCALE_TYPE + r"tensor\(\[0.5000\]\)"),
    (lambda: dict(scale=torch.tensor(0.5, requires_grad=True)), SCALE_TYPE + r"tensor\(0.5000, requires_grad=True\)"),
    (lambda: dict(scale=torch.tensor(True)), SCALE_TYPE + r"tensor\(True\)"),
]


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make,match", BAD_ARGUMENT_TYPES)
def test_bad_argument_types_raise_type_error(device, make, match):
    from fused_attn.softmax import scaled_masked_softmax_backward

    kwargs = make()
    scale = kwargs.pop("scale", 1.0)
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(TypeError, match=match):
        scaled_masked_softmax(x, scale, **kwargs)
    with pytest.raises(TypeError, match=match):
        scaled_masked_softmax_backward(x, x, scale, **kwargs)


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_x_that_is_not_a_tensor_raises_type_error(device):
    from fused_attn.softmax import scaled_masked_softmax_backward

    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        scaled_masked_softmax([[0.0, 1.0]], 0.5)
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got list"):
        scaled_masked_softmax_backward(torch.zeros(1, 2, device=device), [[0.0, 1.0]], 0.5)
    with pytest.raises(TypeError, match=r"grad must be a torch.Tensor, got list"):
        scaled_masked_softmax_backward([[0.0, 1.0]], torch.zeros(1, 2, device=device), 0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scale", [torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64), torch.tensor(2)],
                         ids=["float32", "float64", "int64"])
def test_scale_may_be_a_0d_cpu_tensor(device, scale):
    """As SDPA's scale: a 0-d tensor is read once with float(); the result equals the Python number's."""
    from fused_attn.softmax import scaled_masked_softmax_backward

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 3, 7, generator=gen, device=device)
    want = scaled_masked_softmax(x, float(scale), causal=True)
    torch.testing.assert_close(scaled_masked_softmax(x, scale, causal=True), want, rtol=0, atol=0)
    dy = torch.randn(2, 3, 7, generator=gen, device=device)
    torch.testing.assert_close(scaled_masked_softmax_backward(dy, want, scale, causal=True),
                               scaled_masked_softmax_backward(dy, want, float(scale), causal=True), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got inf"):
        scaled_masked_softmax(x, torch.tensor(math.inf))


@pytest.mark.gpu
def test_scale_on_a_cuda_device_raises_gpu():
    with pytest.raises(TypeError, match=SCALE_TYPE + r"tensor\(0.5000, device='cuda:0'\)"):
        scaled_masked_softmax(torch.zeros(2, 3, device="cuda"), torch.tensor(0.5, device="cuda"))


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_ops_parse_arguments_alike_on_every_device(device):
    """torch.ops.fused_attn callers meet the schema's types before any kernel runs (the same torch
    error on every device) and then the kernels' value checks, which give the wrapper's messages
    (CPU kernel, fake kernel, C++ launcher: test_op_checks_pin_the_same_messages)."""
    ops = torch.ops.fused_attn
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'bool' for argument 'causal'"):
        ops.scaled_masked_softmax(x, 0.5, None, causal="yes")
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'float' for argument 'scale'"):
        ops.scaled_masked_softmax(x, "a", None)
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'bool' for argument 'causal'"):
        ops.scaled_masked_softmax_backward(x, x, 0.5, causal="yes")
    with pytest.raises(ValueError, match=r"scale must be a finite number, got inf"):
        ops.scaled_masked_softmax(x, math.inf, None)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got inf"):
        ops.scaled_masked_softmax_backward(x, x, math.inf)


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make,exc,match", BAD_INPUTS)
def test_op_checks_pin_the_same_messages(device, make, exc, match):
    """Callers of torch.ops.fused_attn who bypass the Python wrapper get its checks and messages from
    every kernel: CPU, fake (meta) and the C++ launcher (CUDA)."""
    kwargs = make(device)
    x = kwargs.pop("x")
    scale = kwargs.pop("scale", 1.0)
    mask = kwargs.pop("attn_mask", None)
    version = kwargs.pop("version", 1)
    out = kwargs.pop("out", None)
    with pytest.raises(exc, match=match):
        if out is None:
            torch.ops.fused_attn.scaled_masked_softmax(x, scale, causal=False, attn_mask=mask, version=version)
        else:
            torch.ops.fused_attn.scaled_masked_softmax_out(x, scale, causal=False, attn_mask=mask,
                                                           version=version, out=out)


# --------------------------------------------------------------------------- registration


def sample_inputs(device):
    """Shared inputs for opcheck: dtypes, masks, causal, both versions."""
    g = torch.Generator(device=device).manual_seed(0)
    x16 = torch.randn(2, 3, 5, 40, generator=g, device=device).half()
    x32 = torch.randn(4, 33, 33, generator=g, device=device)
    pad = torch.rand(2, 1, 1, 40, generator=g, device=device) > 0.3
    add = torch.randn(33, 33, generator=g, device=device)
    return [
        ((x16, 0.125), dict(causal=True, attn_mask=None, version=1)),
        ((x16, 1.0), dict(causal=False, attn_mask=pad, version=1)),
        ((x32, -0.5), dict(causal=True, attn_mask=add, version=0)),
        ((x32.bfloat16(), 2.0), dict(causal=False, attn_mask=None, version=1)),
    ]


_WITHOUT_A_BUILD = """
import torch
import fused_attn
from fused_attn import _ops, build, reference


def no_build():
    raise SystemExit("the CUDA library was about to be built")


build.library_path = no_build
ops = torch.ops.fused_attn
gen = torch.Generator().manual_seed(0)
x = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
keep = torch.rand(2, 1, 1, 6, generator=gen) > 0.3
y = ops.scaled_masked_softmax(x, 0.5, keep, causal=True)
want = reference.scaled_masked_softmax(x.detach(), 0.5, causal=True, attn_mask=keep)
assert torch.allclose(y, want), "forward"
dy = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64)
(dx,) = torch.autograd.grad(y, x, dy)
assert torch.allclose(dx, ops.scaled_masked_softmax_backward(dy, y.detach(), 0.5, causal=True)), "autograd"
out = torch.empty(2, 3, 4, 6, dtype=torch.float64)
ops.scaled_masked_softmax_out(x.detach(), 0.5, keep, causal=True, version=1, out=out)
assert torch.equal(out, y.detach()), "out="
m = torch.empty(2, 3, 4, 6, device="meta", dtype=torch.float16)
for got in (ops.scaled_masked_softmax(m, 0.5, None, causal=True), ops.scaled_masked_softmax_backward(m, m, 0.5),
            fused_attn.scaled_masked_softmax(m, 0.5, causal=True, attn_mask=keep.to("meta")),
            fused_attn.scaled_masked_softmax_backward(m, m, 0.5)):
    assert got.device.type == "meta" and got.shape == m.shape and got.dtype == m.dtype, got


class Probs(torch.nn.Module):
    def forward(self, s):
        return fused_attn.scaled_masked_softmax(s, 0.5, causal=True) * 2


with torch.device("meta"):  # traced with the fake kernels
    ep = torch.export.export(Probs(), (torch.empty(2, 3, 4, 6),))
assert "fused_attn.scaled_masked_softmax" in str(ep.graph), ep.graph
assert not _ops.is_loaded(), "the CUDA library was loaded"
print("ok")
"""


def test_ops_work_after_import_without_a_build(tmp_path):
    """Right after `import fused_attn`, in a fresh process: torch.ops.fused_attn.* forward, out=,
    backward and autograd on CPU tensors, meta tensors through the ops and the wrapper, and
    torch.export tracing, with the CUDA library never built nor loaded (its cache stays empty)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cache = tmp_path / "cache"
    env = dict(os.environ, FUSED_ATTN_CACHE=str(cache), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", _WITHOUT_A_BUILD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
    assert "building" not in run.stderr, run.stderr
    assert not cache.exists(), sorted(cache.rglob("*"))


def test_the_cuda_fallback_builds_for_cuda_tensors_only(monkeypatch):
    """Until the CUDA library is loaded, the ops' CompositeExplicitAutograd kernel (fused_attn/_ops.py)
    is what a CUDA tensor reaches; any other device gets a clear error, not a build."""
    from fused_attn import _ops

    def no_build():
        raise AssertionError("ensure_loaded called")

    monkeypatch.setattr(_ops, "ensure_loaded", no_build)
    fallback = _ops._load_on_first_cuda_call("scaled_masked_softmax")
    with pytest.raises(NotImplementedError, match=r"fused_attn::scaled_masked_softmax's tensors must be CPU, CUDA "
                                                  r"or meta tensors, got cpu, meta"):
        fallback(torch.zeros(2, 3), 1.0, torch.zeros(2, 3, device="meta"), causal=False, version=1)
    for name in _ops.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_attn::{name}", "CompositeExplicitAutograd")


def test_a_build_says_where_it_goes(tmp_path, monkeypatch, capsys):
    """A build prints one line naming its directory under $FUSED_ATTN_CACHE (the compiler is stubbed)."""
    import os
    from pathlib import Path

    from torch.utils import cpp_extension

    from fused_attn import build

    built = []

    def fake_load(*, build_directory, **kwargs):
        built.append(build_directory)
        (Path(build_directory) / f"{build.LIB_NAME}.so").write_bytes(b"")

    monkeypatch.setenv("FUSED_ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "find_cuda_home", lambda: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    # library_path points torch's builder at the toolkit: restored after the test.
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    lib = build.library_path()
    err = capsys.readouterr().err
    assert built == [str(lib.parent)] and lib.parent.parent == tmp_path
    ours = [line for line in err.splitlines() if "fused_attn" in line]
    assert ours == [line for line in ours if line.startswith(f"fused_attn: building the CUDA library in {lib.parent} ")]
    assert len(ours) == 1, err
    assert build.library_path() == lib and "fused_attn" not in capsys.readouterr().err  # built: no build, no line


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    for args, kwargs in sample_inputs(device):
        torch.library.opcheck(torch.ops.fused_attn.scaled_masked_softmax.default, args, kwargs)
        out = torch.empty_like(args[0])
        torch.library.opcheck(torch.ops.fused_attn.scaled_masked_softmax_out.default, args, dict(kwargs, out=out))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("version", [0, 1])
def test_torch_compile_fullgraph(device, version):
    def attn_probs(q, k, mask, out):
        s = q @ k.transpose(-1, -2)
        p = scaled_masked_softmax(s, q.shape[-1] ** -0.5, causal=True, attn_mask=mask, version=version)
        scaled_masked_softmax(s, 1.0, out=out, version=version)
        return p * 2

    torch._dynamo.reset()
    compiled = torch.compile(attn_probs, fullgraph=True)
    q = torch.randn(2, 3, 16, 8, device=device)
    k = torch.randn(2, 3, 24, 8, device=device)
    mask = torch.rand(2, 1, 1, 24, device=device) > 0.2
    out_c, out_e = torch.empty(2, 3, 16, 24, device=device), torch.empty(2, 3, 16, 24, device=device)
    got = compiled(q, k, mask, out_c)
    want = attn_probs(q, k, mask, out_e)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(out_c, out_e)


# --------------------------------------------------------------------------- backward
# dx through the op (its registered autograd: the CUDA kernel on GPU, the op's CPU path otherwise)
# against autograd through the float64 reference, over the same case space as the forward.


def check_backward(x, scale, causal, mask, version=1, mask_grad=False, seed=0):
    """Gradients of <op(x), dy> with respect to x (and an additive mask) vs the float64 reference;
    the gradient buffer is poisoned with NaN first (the caching allocator hands the freed block to
    the kernel's output of the same size), so an element the kernel does not write fails."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    dy = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    xg = x.detach().requires_grad_()
    mg = mask.detach().requires_grad_() if mask_grad else mask
    y = scaled_masked_softmax(xg, scale, causal=causal, attn_mask=mg, version=version)
    poison = torch.full_like(y, math.nan)
    del poison
    inputs = (xg, mg) if mask_grad else (xg,)
    got = torch.autograd.grad(y, inputs, dy)

    xr = x.detach().double().requires_grad_()
    mr = mask.detach().double().requires_grad_() if mask_grad else mask
    yr = reference.scaled_masked_softmax(xr, scale, causal=causal, attn_mask=mr)
    want = torch.autograd.grad(yr, (xr, mr) if mask_grad else (xr,), dy.double())
    scores = scores_of(x, scale, causal, mask)
    where = (f"backward x{tuple(x.shape)} {x.dtype} scale={scale} causal={causal} "
             f"mask={None if mask is None else (tuple(mask.shape), mask.dtype)} v{version}")
    tol = softmax_backward_tolerance(yr.detach(), dy, scale, scores, x.dtype)
    assert got[0].dtype == x.dtype and got[0].shape == x.shape
    assert_close(got[0], want[0], tol, where + " dx")
    if mask_grad:
        # d(mask) is dx at scale 1 summed over the mask's broadcast dims
        tol_m = softmax_backward_tolerance(yr.detach(), dy, 1.0, scores, x.dtype).sum_to_size(mask.shape)
        assert_close(got[1], want[1], tol_m, where + " dmask")


def run_backward_case(case, device):
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    lead, sq, sk, dtype = case["lead"], case["sq"], case["sk"], case["dtype"]
    x = (torch.randn((*lead, sq, sk), generator=gen, device=device) * case["magnitude"]).to(dtype)
    mask = make_mask(case["mask"], lead, sq, sk, dtype, gen, device)
    mask_grad = mask is not None and mask.dtype != torch.bool and case["use_out"]  # reuse the flag's draw
    check_backward(x, case["scale"], case["causal"], mask, case["version"], mask_grad, case["seed"])


@pytest.mark.gpu
@given(case=softmax_case(ON_GPU_BUDGET // 2))
@example(case=dict(lead=(8, 12), sq=128, sk=128, dtype=torch.float16, version=1, scale=0.125, causal=True,
                   mask="none", magnitude=1.0, use_out=True, seed=0))
@example(case=dict(lead=(2, 3), sq=1, sk=16384, dtype=torch.bfloat16, version=1, scale=0.5, causal=True,
                   mask="add_padding", magnitude=10.0, use_out=True, seed=2))
@example(case=dict(lead=(3, 4), sq=130, sk=127, dtype=torch.float16, version=1, scale=0.01, causal=True,
                   mask="bool_qk", magnitude=1e4, use_out=True, seed=7))
@example(case=dict(lead=(2,), sq=9, sk=20001, dtype=torch.float32, version=0, scale=0.3, causal=True,
                   mask="add_full", magnitude=1.0, use_out=True, seed=9))
@example(case=dict(lead=(2, 2), sq=33, sk=1025, dtype=torch.bfloat16, version=1, scale=-1.5, causal=False,
                   mask="bool_padding", magnitude=1e2, use_out=False, seed=10))
def test_backward_matches_reference_gpu(case):
    run_backward_case(case, "cuda")


@given(case=softmax_case(ON_CPU_BUDGET, versions=(1,)))
def test_backward_cpu_path_matches_reference(case):
    run_backward_case(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [3, 64, 65, 1000, 1024, 4100, 16384, 16385, 40000])
def test_backward_every_row_class_gpu(dtype, sk):
    """Each launch class of the backward (csrc/softmax/softmax_row_class.h FA_SOFTMAX_BACKWARD_ROW_CLASS, streaming past
    16384), vectorized and scalar (odd sk), with fully masked rows (causal with seqlen_q > seqlen_k,
    and a padding mask masking a whole batch element)."""
    gen = torch.Generator(device="cuda").manual_seed(sk)
    sq = 5 if sk > 4096 else 12
    x = (torch.randn(2, 3, sq, sk, device="cuda", generator=gen) * 3).to(dtype)
    keep = torch.rand(2, 1, 1, sk, device="cuda", generator=gen) > 0.3
    keep[1] = False
    check_backward(x, 0.3, True, None)
    check_backward(x, 0.3, False, keep)
    xq = (torch.randn(2, sk + 3, sk, device="cuda", generator=gen)).to(dtype) if sk <= 1024 else None
    if xq is not None:
        check_backward(xq, 1.0, True, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_fully_masked_rows_are_zero_gpu(dtype):
    x = torch.randn(2, 3, 6, 40, device="cuda", dtype=dtype, requires_grad=True)
    keep = torch.rand(2, 1, 6, 40, device="cuda") > 0.5
    keep[0, :, 2] = False
    y = scaled_masked_softmax(x, 0.5, attn_mask=keep)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert not dx.isnan().any()
    assert (dx[0, :, 2] == 0).all() and (dx.masked_select(~keep.expand_as(dx)) == 0).all()


@pytest.mark.gpu
def test_backward_of_a_sum_gets_an_expanded_gradient_gpu():
    """y.sum().backward() hands the op a stride-0 gradient: the kernel must see real rows."""
    x = torch.randn(3, 5, 70, device="cuda", dtype=torch.float16, requires_grad=True)
    scaled_masked_softmax(x * 1.0, 0.7, causal=True).mul(torch.arange(70, device="cuda")).sum().backward()
    xr = x.detach().double().requires_grad_()
    reference.scaled_masked_softmax(xr, 0.7, causal=True).mul(torch.arange(70, device="cuda")).sum().backward()
    assert_close(x.grad, xr.grad, 1e-3 * (1 + xr.grad.abs()), "expanded gradient")


@pytest.mark.gpu
def test_backward_kernel_writes_every_element_gpu(built_library):
    """Deterministic version of the poisoning in check_backward: the freed NaN block is the one the
    kernel writes, so a single unwritten element shows as NaN."""
    for sk in (7, 64, 1000, 20000):
        y = torch.softmax(torch.randn(4, 9, sk, device="cuda"), dim=-1)
        dy = torch.randn_like(y)
        poison = torch.full_like(y, math.nan)
        ptr = poison.data_ptr()
        del poison
        dx = torch.ops.fused_attn.scaled_masked_softmax_backward(dy, y, 0.5, causal=True)
        assert dx.data_ptr() == ptr, "the allocator did not reuse the poisoned block"
        assert not dx.isnan().any()
        want = reference.scaled_masked_softmax_backward(dy, y, 0.5, causal=True)
        assert_close(dx, want, 1e-6 + 1e-5 * want.abs(), f"sk={sk}")


@pytest.mark.gpu
def test_backward_on_current_stream_without_sync_gpu():
    x = torch.randn(8, 256, 256, device="cuda", requires_grad=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = scaled_masked_softmax(x, 0.1, causal=True)
        dy = torch.randn_like(y)
        torch.cuda.set_sync_debug_mode("error")
        try:
            dx = torch.ops.fused_attn.scaled_masked_softmax_backward(dy, y.detach(), 0.1, causal=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    want = reference.scaled_masked_softmax_backward(dy, y.detach(), 0.1, causal=True)
    assert_close(dx, want, 1e-6 + 1e-5 * want.abs())


@pytest.mark.gpu
def test_backward_cuda_graph_capture_and_replay_gpu():
    y = torch.empty(2, 4, 100, 300, device="cuda", dtype=torch.float16)
    dy = torch.empty_like(y)
    torch.ops.fused_attn.scaled_masked_softmax_backward(dy, y, 0.5, causal=True)  # warm-up (loads the library)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dx = torch.ops.fused_attn.scaled_masked_softmax_backward(dy, y, 0.5, causal=True)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        y.copy_(scaled_masked_softmax(torch.randn(y.shape, generator=gen, device="cuda").half(), causal=True))
        dy.copy_(torch.randn(y.shape, generator=gen, device="cuda"))
        dx.fill_(math.nan)
        g.replay()
        want = reference.scaled_masked_softmax_backward(dy, y, 0.5, causal=True)
        assert_close(dx, want, 2e-3 * (1e-3 + want.abs()), f"replay {seed}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_under_torch_compile(device):
    def f(q, k, mask):
        return scaled_masked_softmax(q @ k.transpose(-1, -2), 0.25, causal=True, attn_mask=mask)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 3, 16, 8, device=device, generator=gen, requires_grad=True)
    k = torch.randn(2, 3, 24, 8, device=device, generator=gen, requires_grad=True)
    mask = torch.randn(1, 1, 16, 24, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(2, 3, 16, 24, device=device, generator=gen)
    got = torch.autograd.grad(compiled(q, k, mask), (q, k, mask), dy)
    want = torch.autograd.grad(f(q, k, mask), (q, k, mask), dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_gradcheck_cpu_path():
    """torch.autograd.gradcheck / gradgradcheck in float64 through the public CPU path."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    add = torch.randn(1, 3, 1, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
    keep[0, 0, 1] = False  # a fully masked row: gradient 0
    assert torch.autograd.gradcheck(lambda x, m: scaled_masked_softmax(x, 0.7, causal=True, attn_mask=m), (x, add))
    assert torch.autograd.gradgradcheck(lambda x: scaled_masked_softmax(x, -1.3, attn_mask=keep), (x,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gradcheck_op_and_its_backward(device):
    """The registered autograd of the op and of its backward op (double backward), float64 on the CPU;
    on CUDA the same formulas run through the kernels in float32 against finite differences."""
    ops = torch.ops.fused_attn
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = dict(eps=1e-6, atol=1e-5, rtol=1e-3) if device == "cpu" else dict(eps=1e-2, atol=5e-3, rtol=5e-2)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=gen, device=device, dtype=dtype, requires_grad=True)
    add = torch.randn(5, 7, generator=gen, device=device, dtype=dtype, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, m: ops.scaled_masked_softmax(x, 0.7, m, causal=True), (x, add), **tol)
    assert torch.autograd.gradgradcheck(lambda x, m: ops.scaled_masked_softmax(x, 0.7, m, causal=True), (x, add),
                                        **tol)
    g = torch.randn(3, 4, 9, generator=gen, device=device, dtype=dtype, requires_grad=True)
    y = torch.rand(3, 4, 9, generator=gen, device=device, dtype=dtype, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, y: ops.scaled_masked_softmax_backward(g, y, -0.4, causal=True),
                                    (g, y), **tol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_autograd(device):
    """opcheck's autograd-registration and AOT-dispatch checks with inputs that require grad."""
    ops = torch.ops.fused_attn
    for (x, scale), kwargs in sample_inputs(device):
        mask = kwargs["attn_mask"]
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.clone().requires_grad_()
        args = (x.clone().requires_grad_(), scale, mask)
        torch.library.opcheck(ops.scaled_masked_softmax.default, args,
                              dict(causal=kwargs["causal"], version=kwargs["version"]))
        y = scaled_masked_softmax(x, scale, causal=kwargs["causal"], attn_mask=kwargs["attn_mask"])
        torch.library.opcheck(ops.scaled_masked_softmax_backward.default,
                              (torch.randn_like(y).requires_grad_(), y.clone().requires_grad_(), scale),
                              dict(causal=kwargs["causal"]))


BAD_BACKWARD_INPUTS = [
    (lambda d: (torch.zeros(3, 4, device=d, dtype=torch.float16), torch.zeros(3, 4, device=d)),
     r"grad must have y's dtype \(torch.float32\), got torch.float16"),
    (lambda d: (torch.zeros(3, 5, device=d), torch.zeros(3, 4, device=d)),
     r"grad must have y's shape \(3, 4\), got \(3, 5\)"),
    (lambda d: (torch.zeros(4, device=d), torch.zeros(4, device=d)),
     r"y must have at least 2 dims \[\.\.\., seqlen_q, seqlen_k\], got \(4,\)"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make,match", BAD_BACKWARD_INPUTS)
def test_backward_bad_input_raises(device, make, match):
    from fused_attn.softmax import scaled_masked_softmax_backward

    grad, y = make(device)
    with pytest.raises(ValueError, match=match):
        scaled_masked_softmax_backward(grad, y, 1.0)


@pytest.mark.gpu
def test_backward_cpp_checks_gpu(built_library):
    bwd = torch.ops.fused_attn.scaled_masked_softmax_backward
    y = torch.zeros(3, 4, device="cuda")
    with pytest.raises(ValueError, match=r"grad must have y's dtype \(torch.float32\), got torch.float16"):
        bwd(y.half(), y, 1.0)
    with pytest.raises(ValueError, match=r"grad must have y's shape \(3, 4\), got \(4, 3\)"):
        bwd(torch.zeros(4, 3, device="cuda"), y, 1.0)
    with pytest.raises(ValueError, match=r"grad must be a CUDA tensor, got cpu"):
        bwd(torch.zeros(3, 4), y, 1.0)
    with pytest.raises(ValueError, match=r"y must have dtype float32, float16 or bfloat16, got torch.float64"):
        bwd(y.double(), y.double(), 1.0)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got inf"):
        bwd(y, y, math.inf)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_out_that_requires_grad_is_written_under_no_grad(device):
    """As PyTorch's out= variants: refused under grad mode (test_bad_inputs.py pins the message), written
    without it."""
    x = torch.randn(3, 4, device=device)
    out = torch.zeros(3, 4, device=device, requires_grad=True)
    with torch.no_grad():
        got = scaled_masked_softmax(x, out=out)
    assert got is out
    torch.testing.assert_close(out.detach(), torch.softmax(x, -1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_out_under_autograd_raises(device):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    match = r"out must be None when x or attn_mask requires grad \(out= records no gradient\), got a tensor"
    with pytest.raises(ValueError, match=match):
        scaled_masked_softmax(x, out=torch.empty(3, 4, device=device))
    add = torch.zeros(3, 4, device=device, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        scaled_masked_softmax(x.detach(), attn_mask=add, out=torch.empty(3, 4, device=device))
    with torch.no_grad():  # no graph is recorded: allowed
        scaled_masked_softmax(x, out=torch.empty(3, 4, device=device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_out_op_under_autograd_raises(device):
    """torch.ops callers of the out= variant get the same error from its autograd kernel."""
    x = torch.randn(3, 4, device=device, requires_grad=True)
    with pytest.raises(ValueError, match=r"out must be None when x or attn_mask requires grad"):
        torch.ops.fused_attn.scaled_masked_softmax_out(x, 1.0, None, causal=False, version=1,
                                                       out=torch.empty(3, 4, device=device))


def test_float64_runs_on_the_cpu_only():
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    got = scaled_masked_softmax(x, 0.5, causal=True)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference.scaled_masked_softmax(x, 0.5, causal=True), rtol=1e-12, atol=1e-15)


@pytest.mark.gpu
def test_float64_on_cuda_raises_gpu():
    with pytest.raises(ValueError, match=r"x must have dtype float32, float16 or bfloat16, got torch.float64"):
        scaled_masked_softmax(torch.zeros(2, 3, device="cuda", dtype=torch.float64))
