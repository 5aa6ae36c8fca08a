"""layer_norm / rms_norm: the CUDA kernel and the CPU path against the float64 reference (h = x + residual
bit for bit, y within norm_tolerance), equal rows giving exactly the bias, layouts, gradients against
autograd through the reference, CUDA graphs, torch.compile, opcheck and argument errors. The spec is
the docstring of ``fused_attn.layer_norm.layer_norm``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.layer_norm import layer_norm, rms_norm
from tests.streams import on_side_stream_without_sync
from tests.test_decode_attention import with_examples
from tests.tolerances import assert_close, norm_tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA_WIDTHS = [64, 65, 100, 127, 128, 255, 256, 512, 768, 1000, 1024, 1025, 2048, 3072, 4095, 4096, 4104, 5120,
               8192, 11008, 16383, 16384]
ON_GPU_BUDGET = 1 << 22  # elements of x per example
ON_CPU_BUDGET = 1 << 14
# kind of rows: "randn" N(0, 1); "offset" 1e4 + N(0, 1) (large mean, small spread); "large" N(0, 1e4);
# "equal" every element of a row the same (zero variance); "tiny" 1 + 1e-3 N(0, 1) (variance below eps)
MAGNITUDES = ["randn", "randn", "offset", "large", "equal", "tiny"]
LAYOUTS = ["contiguous", "strided_rows", "transposed", "misaligned"]


@st.composite
def norm_case(draw, budget, cuda):
    if cuda:
        width = draw(st.one_of(st.sampled_from(CUDA_WIDTHS), st.integers(64, 16384)))
    else:
        width = draw(st.one_of(st.sampled_from([1, 7, 64, 768]), st.integers(1, 300)))
    max_rows = max(1, budget // width)
    rows = draw(st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, min(4096, max_rows))))
    lead = draw(st.sampled_from(["1d", "2d", "3d"]))
    rms = draw(st.booleans())
    return dict(
        rows=rows, width=width, lead=lead, rms=rms, residual=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
        weight=draw(st.sampled_from([None, "dtype", "float32"])),
        bias=None if rms else draw(st.sampled_from([None, "dtype", "float32"])),
        magnitude=draw(st.sampled_from(MAGNITUDES)), layout=draw(st.sampled_from(LAYOUTS)),
        eps=draw(st.sampled_from([1e-5, 1e-6, 0.0, 0.1])), seed=draw(st.integers(0, 2**31 - 1)),
    )


def case_of(**kw):
    base = dict(rows=8, width=768, lead="2d", rms=False, residual=True, dtype=torch.float16, weight="dtype",
                bias="dtype", magnitude="randn", layout="contiguous", eps=1e-5, seed=0)
    base.update(kw)
    return base


def lead_shape(case) -> tuple[int, ...]:
    """The leading dims holding the case's rows: [rows], [2, rows / 2] (or [1, rows]) or [1, rows, 1]."""
    rows = case["rows"]
    if case["lead"] == "1d":
        return (rows,)
    if case["lead"] == "2d":
        return (2, rows // 2) if rows % 2 == 0 else (1, rows)
    return (1, rows, 1)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another layout: rows strided by more than the width, x transposed in memory
    (no contiguous last dim), or the base 1 element past an aligned address."""
    if layout == "strided_rows":
        buf = torch.full((*t.shape[:-1], t.shape[-1] + 5), math.nan, dtype=t.dtype, device=t.device)
        buf[..., :t.shape[-1]] = t
        return buf[..., :t.shape[-1]]
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "misaligned":
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        return buf[1:].view(t.shape).copy_(t)
    return t


def make_inputs(case, device):
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    dtype, width = case["dtype"], case["width"]
    shape = (*lead_shape(case), width)
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def values(mag):
        z = torch.randn(shape, generator=gen, device=device, dtype=wide)
        if mag == "offset":
            return 1e4 + z
        if mag == "large":
            return 1e4 * z
        if mag == "equal":
            return (z[..., :1] * 100).expand(shape).contiguous()
        if mag == "tiny":
            return 1 + 1e-3 * z
        return z

    x = laid_out(values(case["magnitude"]).to(dtype), case["layout"])
    r = None
    if case["residual"]:
        # the residual of an "equal" case is equal along rows too, so h keeps the magnitude's kind
        r = laid_out(values(case["magnitude"] if case["magnitude"] in ("equal", "offset") else "randn").to(dtype),
                     case["layout"])
        if case["magnitude"] == "offset":
            r = r - 2e4  # h = x + r around -1e4: cancellation in the add

    def param(kind, mean):
        if kind is None:
            return None
        p = mean + torch.randn(width, generator=gen, device=device, dtype=wide)
        return p.to(dtype if kind == "dtype" else torch.float32)

    return x, r, param(case["weight"], 1.0), param(case["bias"], 0.0)


def poison_allocations(shape, dtype, device, count):
    """NaN blocks freed right before the op allocates its outputs (the caching allocator hands them
    back for the same size), so an element the kernel does not write stays NaN."""
    if device != "cpu":
        blocks = [torch.full(shape, math.nan, dtype=dtype, device=device) for _ in range(count)]
        del blocks


def call(case, x, r, w, b):
    if case["rms"]:
        return rms_norm(x, w, case["eps"], residual=r)
    return layer_norm(x, w, b, case["eps"], residual=r)


def expected(case, x, r, w, b):
    """(y in float64, xhat in float64, h in x's dtype): the reference from h = x + residual rounded to x's
    dtype (PyTorch's own add), all on the CPU."""
    h = (x + r if r is not None else x).cpu()
    d = None if w is None else w.double().cpu()
    want = reference.layer_norm(h.double(), d, None if b is None else b.double().cpu(), case["eps"], rms=case["rms"])
    xhat = reference.layer_norm(h.double(), None, None, case["eps"], rms=case["rms"])
    return want, xhat, h


def run_and_check(case, device):
    x, r, w, b = make_inputs(case, device)
    x0, r0 = x.clone(), None if r is None else r.clone()
    poison_allocations(x.shape, x.dtype, device, 2)
    got = call(case, x, r, w, b)
    y, h = got if r is not None else (got, None)
    where = (f"rows={case['rows']} width={case['width']} {case['dtype']} rms={case['rms']} residual={case['residual']} "
             f"weight={case['weight']} bias={case['bias']} {case['magnitude']} {case['layout']} eps={case['eps']}")
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device, where
    assert torch.equal(x, x0) and (r is None or torch.equal(r, r0)), f"{where}: inputs changed"
    want, xhat, h_want = expected(case, x, r, w, b)
    if r is not None:
        assert h.shape == x.shape and h.dtype == x.dtype
        assert torch.equal(h.cpu(), h_want), f"{where}: h must be x + residual bit for bit"
    assert_close(y.cpu(), want, norm_tolerance(want, xhat, w, x.dtype), where)
    if case["magnitude"] == "equal" and not case["rms"] and case["eps"] > 0:  # eps = 0: 0 / 0, NaN as in PyTorch
        bias = torch.zeros(case["width"], dtype=x.dtype) if b is None else b.cpu().to(x.dtype)
        assert torch.equal(y.cpu(), bias.expand(y.shape)), f"{where}: a row of equal values must give the bias exactly"


# --------------------------------------------------------------------------- properties

EDGE_EXAMPLES = [
    case_of(rows=0),  # no rows
    case_of(rows=1, width=64, residual=False, weight=None, bias=None),
    case_of(rows=4, width=768, magnitude="equal", bias="float32", dtype=torch.bfloat16),  # zero variance: y = bias
    case_of(rows=5, width=768, magnitude="equal", residual=False, bias=None, eps=0.1),  # y = 0 exactly
    case_of(rows=3, width=1000, magnitude="equal", dtype=torch.float32, residual=False),  # an inexact float32 sum
    case_of(rows=6, width=1000, magnitude="offset", dtype=torch.float32, layout="strided_rows"),
    case_of(rows=7, width=130, magnitude="large", dtype=torch.float16, rms=True, bias=None, weight="float32"),
    case_of(rows=3, width=129, magnitude="tiny", dtype=torch.float32, layout="transposed", eps=1e-6),
    case_of(rows=9, width=100, layout="misaligned", rms=True, bias=None, dtype=torch.bfloat16),
]


@pytest.mark.gpu
@given(case=norm_case(ON_GPU_BUDGET, cuda=True))
@with_examples(EDGE_EXAMPLES + [
    case_of(rows=4096, width=768),  # GPT-2 small, the benchmark's shape
    case_of(rows=4096, width=4096, rms=True, bias=None, weight="dtype", dtype=torch.bfloat16),  # Llama
    case_of(rows=256, width=16384, magnitude="offset", weight="float32", bias="float32", dtype=torch.float32),
    case_of(rows=33, width=4097, layout="misaligned", magnitude="large"),  # odd width, scalar path
    case_of(rows=17, width=8192, magnitude="equal", dtype=torch.float16, layout="strided_rows"),
    case_of(rows=3, width=65, lead="3d", residual=False, weight="float32", bias=None, magnitude="tiny"),
])
def test_matches_reference_gpu(case):
    run_and_check(case, "cuda")


@given(case=norm_case(ON_CPU_BUDGET, cuda=False))
@with_examples(EDGE_EXAMPLES + [case_of(rows=5, width=33, dtype=torch.float64, rms=True, bias=None),
                                case_of(rows=2, width=1, magnitude="equal")])
def test_matches_reference_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 128, 256, 512, 768, 769, 1024, 2048, 4096, 8192, 16384, 257, 4095])
@pytest.mark.parametrize("rms", [False, True])
def test_every_row_class_gpu(dtype, width, rms):
    """Each launch class at its capacity and one past the class below (and the scalar path), rows
    more than one block holds."""
    for residual in (False, True):
        run_and_check(case_of(rows=37, width=width, dtype=dtype, rms=rms, residual=residual,
                              bias=None if rms else "dtype", seed=width), "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_matches_torch_functional(device):
    """F.layer_norm / F.rms_norm / the add, in float32: the same numbers up to float32 rounding."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, r = (torch.randn(3, 5, 768, generator=gen, device=device) for _ in range(2))
    w, b = torch.randn(768, generator=gen, device=device), torch.randn(768, generator=gen, device=device)
    y, h = layer_norm(x, w, b, 1e-5, residual=r)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (768,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer_norm(x), F.layer_norm(x, (768,)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (768,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_poisons_its_row_only(device):
    x = torch.randn(4, 256, device=device, dtype=torch.float16)
    x[1, 7] = math.nan
    y = layer_norm(x, None, None)
    assert y[1].isnan().all() and not y[[0, 2, 3]].isnan().any()
    y, h = rms_norm(x, None, residual=torch.zeros_like(x))
    assert y[1].isnan().all() and not y[[0, 2, 3]].isnan().any() and h[1, 7].isnan()


@pytest.mark.gpu
def test_does_not_sync_and_uses_the_current_stream_gpu():
    """A sleep, then the fill of x on stream s: a launch on another stream would read x before the fill."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(512, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(512, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(src)
    y, h = on_side_stream_without_sync(x, src, lambda: layer_norm(x, None, None, residual=r))
    want, xhat, h_want = expected(dict(eps=1e-5, rms=False), src, r, None, None)
    assert torch.equal(h.cpu(), h_want)
    assert_close(y.cpu(), want, norm_tolerance(want, xhat, None, y.dtype), "on a side stream")


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty(64, 768, device="cuda", dtype=torch.float16)
    r = torch.empty_like(x)
    w = torch.randn(768, generator=gen, device="cuda", dtype=torch.float16)
    b = torch.randn(768, generator=gen, device="cuda")  # float32 bias
    outs = {}

    def step():
        outs["ln"] = layer_norm(x, w, b, residual=r)
        outs["rms"] = rms_norm(x, w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (loads the library) on a side stream, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        r.copy_(torch.randn(r.shape, generator=gen, device="cuda"))
        for t in (*outs["ln"], outs["rms"]):
            t.fill_(math.nan)
        g.replay()
        y, h = outs["ln"]
        want, xhat, h_want = expected(dict(eps=1e-5, rms=False), x, r, w, b)
        assert torch.equal(h.cpu(), h_want), f"replay {seed}"
        assert_close(y.cpu(), want, norm_tolerance(want, xhat, w, x.dtype), f"replay {seed}")
        want, xhat, _ = expected(dict(eps=1e-6, rms=True), x, None, w, None)
        assert_close(outs["rms"].cpu(), want, norm_tolerance(want, xhat, w, x.dtype), f"replay {seed} rms")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def block(x, r, w, b):
        y, h = layer_norm(x, w, b, residual=r)
        return rms_norm(y * 2, w, residual=h)[0] + layer_norm(x, None, None, 1e-3)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    x, r = (torch.randn(2, 7, 256, generator=gen, device=device) for _ in range(2))
    w, b = torch.randn(256, generator=gen, device=device), torch.randn(256, generator=gen, device=device)
    torch.testing.assert_close(compiled(x, r, w, b), block(x, r, w, b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_empty(device):
    for shape in [(0, 128), (3, 0, 128)]:
        x = torch.empty(shape, device=device, dtype=torch.float16)
        assert layer_norm(x).shape == shape
        y, h = rms_norm(x, None, residual=x.clone())
        assert y.shape == h.shape == shape


def test_meta_tensors_give_shapes():
    x = torch.empty(3, 5, 768, device="meta", dtype=torch.bfloat16)
    w = torch.empty(768, device="meta")
    y = torch.ops.fused_attn.layer_norm(x, w, None, 1e-5)
    y2, h = torch.ops.fused_attn.add_layer_norm(x, x, w, w, 1e-5, rms=True)
    assert y.shape == y2.shape == h.shape == x.shape and y.dtype == x.dtype and h.device.type == "meta"


# --------------------------------------------------------------------------- gradients


def check_gradients(x, r, w, b, rms, eps, seed=0):
    """Gradients of <y, dy> (+ <h, dh>) through the op vs autograd through the float64 reference, for every
    input that is given; each within the forward's tolerance scaled by the gradient's magnitude."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    inputs = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    xg, rg, wg, bg = inputs
    out = rms_norm(xg, wg, eps, residual=rg) if rms else layer_norm(xg, wg, bg, eps, residual=rg)
    outs = out if rg is not None else (out,)
    grads_out = [torch.randn(o.shape, generator=gen, device=x.device).to(o.dtype) for o in outs]
    live = [t for t in inputs if t is not None]
    got = torch.autograd.grad(outs, live, grads_out)

    ref_in = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    xr, rr, wr, br = ref_in
    hr = xr if rr is None else xr + rr
    yr = reference.layer_norm(hr, wr, br, eps, rms=rms)
    ref_outs = (yr, hr) if rr is not None else (yr,)
    want = torch.autograd.grad(ref_outs, [t for t in ref_in if t is not None], [g.double() for g in grads_out])
    names = [n for n, t in zip(("dx", "dresidual", "dweight", "dbias"), inputs) if t is not None]
    for name, g, wnt, t in zip(names, got, want, live):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        # float32 arithmetic over the inputs rounded to their dtype: relative to the gradient's scale
        scale = wnt.abs().amax().item() if wnt.numel() else 0.0
        rel = 2e-2 if x.dtype != torch.float32 else 1e-4
        assert_close(g.cpu(), wnt.cpu(), torch.tensor(rel * scale + 1e-6), f"{name} rms={rms} {x.dtype}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_gradients_match_reference(device, dtype, rms, residual):
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(3, 4, 96, generator=gen, device=device).to(dtype)
    r = torch.randn(3, 4, 96, generator=gen, device=device).to(dtype) if residual else None
    w = (1 + torch.randn(96, generator=gen, device=device)).to(dtype)
    b = None if rms else torch.randn(96, generator=gen, device=device)  # float32 bias with any x dtype
    check_gradients(x, r, w, b, rms, 1e-5)
    check_gradients(x, r, None, None, rms, 1e-2)


def test_gradcheck_cpu():
    """torch.autograd.gradcheck / gradgradcheck in float64 through the ops' registered autograd."""
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)

    x, r, w, b = t(2, 3, 9), t(2, 3, 9), t(9), t(9)
    assert torch.autograd.gradcheck(lambda x, r, w, b: layer_norm(x, w, b, 1e-5, residual=r), (x, r, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, r, w: rms_norm(x, w, 1e-6, residual=r), (x, r, w))
    assert torch.autograd.gradcheck(lambda x: rms_norm(x, None, 0.1), (x,))
    assert torch.autograd.gradgradcheck(lambda x, r, w, b: layer_norm(x, w, b, 1e-5, residual=r), (x, r, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w: rms_norm(x, w), (x, w))


def opcheck_inputs(device, grad=False):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float16):
        t = torch.randn(shape, generator=g, device=device).to(dtype)
        return t.requires_grad_() if grad and dtype in (torch.float32, torch.float64) else t

    f32 = torch.float32
    return [
        ("layer_norm", (randn(4, 768, dtype=f32), randn(768, dtype=f32), randn(768, dtype=f32), 1e-5), {}),
        ("layer_norm", (randn(2, 3, 100, dtype=torch.bfloat16), None, randn(100, dtype=f32), 1e-2), {}),
        ("layer_norm", (randn(5, 128, dtype=f32), randn(128, dtype=f32), None, 1e-6), dict(rms=True)),
        ("add_layer_norm", (randn(3, 256, dtype=f32), randn(3, 256, dtype=f32), randn(256, dtype=f32),
                            randn(256, dtype=f32), 1e-5), {}),
        ("add_layer_norm", (randn(2, 2, 4096), randn(2, 2, 4096), randn(4096), None, 1e-6), dict(rms=True)),
        ("add_layer_norm", (randn(3, 65, dtype=f32), randn(3, 65, dtype=f32), None, None, 0.0), {}),
        ("add_layer_norm", (randn(9, 64, dtype=f32), randn(5, 64, dtype=f32), randn(64, dtype=f32), None, 1e-5,
                            torch.tensor([8, 0, 8, 3], device=device),
                            torch.tensor([4, 4, 0, 1], dtype=torch.int32, device=device)), {}),
        ("add_layer_norm", (randn(4, 64, dtype=f32), randn(5, 64, dtype=f32), None, None, 1e-5, None,
                            torch.tensor([4, 4, 0, 1], device=device)), dict(rms=True)),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grad", [False, True])
def test_opcheck(device, grad):
    """Every opcheck test; with grad, the float32 inputs require grad (autograd registration, AOT dispatch)."""
    for name, args, kwargs in opcheck_inputs(device, grad):
        torch.library.opcheck(getattr(torch.ops.fused_attn, name).default, args, kwargs)


# --------------------------------------------------------------------------- gathered rows (x_index)


@st.composite
def gather_case(draw, cuda):
    width = draw(st.sampled_from([64, 768, 1000, 4096] if cuda else [1, 7, 64, 768]))
    gathered = draw(st.sampled_from(["both", "x", "residual"]))
    return dict(width=width, gathered=gathered, rows=draw(st.integers(0, 40)),
                x_rows=draw(st.one_of(st.just(0), st.integers(1, 300))), r_rows=draw(st.integers(1, 300)),
                index_dtypes=(draw(st.sampled_from([torch.int32, torch.int64])),
                              draw(st.sampled_from([torch.int32, torch.int64]))),
                bad=draw(st.sampled_from([0.0, 0.0, 0.2])),  # share of indices out of range (negative or past)
                dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
                rms=draw(st.booleans()), weight=draw(st.sampled_from([None, "dtype", "float32"])),
                bias=draw(st.sampled_from([None, "dtype", "float32"])), scale=draw(st.sampled_from([1.0, 1e3])),
                seed=draw(st.integers(0, 2**31 - 1)))


def gather_inputs(c, device):
    gen = torch.Generator().manual_seed(c["seed"])
    w_, rows = c["width"], c["rows"]

    def index(table_rows, dtype):
        i = torch.randint(0, max(table_rows, 1), (rows,), generator=gen)
        bad = torch.rand(rows, generator=gen) < c["bad"]
        wild = torch.where(torch.rand(rows, generator=gen) < 0.5, -1 - i, table_rows + i)  # below 0 or past the end
        return torch.where(bad | (table_rows == 0), wild, i).to(dtype).to(device)

    x_index = index(c["x_rows"], c["index_dtypes"][0]) if c["gathered"] in ("both", "x") else None
    r_index = index(c["r_rows"], c["index_dtypes"][1]) if c["gathered"] in ("both", "residual") else None
    x = (torch.randn(c["x_rows"] if x_index is not None else rows, w_, generator=gen) * c["scale"]).to(c["dtype"])
    r = (torch.randn(c["r_rows"] if r_index is not None else rows, w_, generator=gen) * c["scale"]).to(c["dtype"])

    def param(kind, mean):
        return None if kind is None else (mean + torch.randn(w_, generator=gen)).to(
            c["dtype"] if kind == "dtype" else torch.float32).to(device)

    return x.to(device), r.to(device), x_index, r_index, param(c["weight"], 1.0), param(c["bias"], 0.0)


def run_and_check_gathered(c, device):
    """y and h against the float64 reference of the gathered rows; h bit for bit PyTorch's add of them;
    rows whose index is out of range NaN in y and h (and nothing else NaN); the tables untouched."""
    x, r, xi, ri, w, b = gather_inputs(c, device)
    x0, r0 = x.clone(), r.clone()
    bias = None if c["rms"] else b
    poison_allocations((c["rows"], c["width"]), x.dtype, device, 2)
    fn = rms_norm if c["rms"] else layer_norm
    args = (x, w, c["rms"] and 1e-6 or 1e-5) if c["rms"] else (x, w, bias, 1e-5)
    y, h = fn(*args, residual=r, x_index=xi, residual_index=ri)
    where = {k: c[k] for k in ("width", "gathered", "rows", "x_rows", "r_rows", "bad", "dtype", "rms", "scale")}
    assert y.shape == h.shape == (c["rows"], c["width"]) and y.dtype == h.dtype == x.dtype, where
    assert torch.equal(x, x0) and torch.equal(r, r0), f"{where}: the tables changed"

    def rows_of(table, index):
        if index is None:
            return table.cpu(), torch.ones(c["rows"], dtype=torch.bool)
        i = index.long().cpu()
        ok = (i >= 0) & (i < table.shape[0])
        return table.cpu()[i.clamp(0, max(table.shape[0] - 1, 0))] if table.shape[0] else \
            torch.zeros(c["rows"], c["width"], dtype=table.dtype), ok

    xs, x_ok = rows_of(x, xi)
    rs, r_ok = rows_of(r, ri)
    live = x_ok & r_ok
    assert torch.isnan(y.cpu()[~live]).all() and torch.isnan(h.cpu()[~live]).all(), f"{where}: out-of-range rows NaN"
    h_want = (xs + rs)[live]
    assert torch.equal(h.cpu()[live], h_want), f"{where}: h must be x[x_index] + residual[residual_index] bit for bit"
    d = None if w is None else w.double().cpu()
    eps = 1e-6 if c["rms"] else 1e-5
    want = reference.layer_norm(h_want.double(), d, None if bias is None else bias.double().cpu(), eps, rms=c["rms"])
    xhat = reference.layer_norm(h_want.double(), None, None, eps, rms=c["rms"])
    assert_close(y.cpu()[live], want, norm_tolerance(want, xhat, w, x.dtype), str(where))


GATHER_EXAMPLES = [
    dict(width=768, gathered="both", rows=1, x_rows=300, r_rows=100, index_dtypes=(torch.int64, torch.int32), bad=0.0,
         dtype=torch.float16, rms=False, weight="dtype", bias="dtype", scale=1.0, seed=0),  # GPT-2's embedding at B1
    dict(width=64, gathered="x", rows=40, x_rows=3, r_rows=1, index_dtypes=(torch.int32, torch.int64), bad=0.2,
         dtype=torch.bfloat16, rms=True, weight=None, bias=None, scale=1e3, seed=1),  # repeats, out of range
    dict(width=64, gathered="residual", rows=7, x_rows=1, r_rows=2, index_dtypes=(torch.int64, torch.int64), bad=0.2,
         dtype=torch.float32, rms=False, weight="float32", bias="float32", scale=1.0, seed=2),
    dict(width=64, gathered="both", rows=5, x_rows=0, r_rows=9, index_dtypes=(torch.int64, torch.int64), bad=0.0,
         dtype=torch.float16, rms=False, weight=None, bias="dtype", scale=1.0, seed=3),  # an empty table: all NaN
    dict(width=64, gathered="both", rows=0, x_rows=5, r_rows=5, index_dtypes=(torch.int32, torch.int32), bad=0.0,
         dtype=torch.float16, rms=False, weight=None, bias=None, scale=1.0, seed=4),  # no rows
]


@pytest.mark.gpu
@given(case=gather_case(cuda=True))
@with_examples(GATHER_EXAMPLES)
def test_gathered_rows_match_reference_gpu(case):
    run_and_check_gathered(case, "cuda")


@given(case=gather_case(cuda=False))
@with_examples(GATHER_EXAMPLES)
def test_gathered_rows_match_reference_cpu(case):
    run_and_check_gathered(case, "cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gathered_rows_gradients_reach_the_tables(device):
    """Gradients of the gathered rows land at their table rows (summed over repeats; an out-of-range row
    gives none): against autograd through PyTorch's own indexing and F.layer_norm."""
    gen = torch.Generator().manual_seed(0)
    wte = torch.randn(11, 64, generator=gen).to(device).requires_grad_()
    wpe = torch.randn(6, 64, generator=gen).to(device).requires_grad_()
    w = torch.randn(64, generator=gen).to(device).requires_grad_()
    b = torch.randn(64, generator=gen).to(device).requires_grad_()
    tok = torch.tensor([3, 7, 3, 10, 11], device=device)  # 11: out of range
    pos = torch.tensor([0, 5, 1, 2, 4], dtype=torch.int32, device=device)
    gy = torch.randn(5, 64, generator=gen).to(device)
    gh = torch.randn(5, 64, generator=gen).to(device)
    y, h = layer_norm(wte, w, b, 1e-5, residual=wpe, x_index=tok, residual_index=pos)
    live = torch.tensor([True, True, True, True, False], device=device)
    torch.autograd.backward((y[live], h[live]), (gy[live], gh[live]))
    got = [t.grad.clone() for t in (wte, wpe, w, b)]
    for t in (wte, wpe, w, b):
        t.grad = None
    hh = wte[tok[live]] + wpe[pos[live].long()]
    yy = F.layer_norm(hh, (64,), w, b, 1e-5)
    torch.autograd.backward((yy, hh), (gy[live], gh[live]))
    for g, t, name in zip(got, (wte, wpe, w, b), ("wte", "wpe", "weight", "bias")):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_gathered_rows_follow_device_side_indices_in_a_cuda_graph_gpu():
    """The indices are read on the device at each replay (a sampled token written by the previous kernel)."""
    gen = torch.Generator().manual_seed(0)
    wte = torch.randn(50, 768, generator=gen).half().cuda()
    wpe = torch.randn(20, 768, generator=gen).half().cuda()
    tok = torch.tensor([1, 2], device="cuda")
    pos = torch.tensor([0, 0], dtype=torch.int32, device="cuda")
    layer_norm(wte, None, None, residual=wpe, x_index=tok, residual_index=pos)  # warm-up: build and load
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = layer_norm(wte, None, None, residual=wpe, x_index=tok, residual_index=pos)
    for t, p_ in ([[4, 49], [3, 19]], [[0, 7], [1, 2]]):
        tok.copy_(torch.tensor(t))
        pos.copy_(torch.tensor(p_))
        graph.replay()
        want = F.layer_norm((wte[tok] + wpe[pos.long()]).float(), (768,)).half()
        torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)
        assert torch.equal(h, wte[tok] + wpe[pos.long()])


# --------------------------------------------------------------------------- bad arguments


def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


BAD_INPUTS = [  # (id, call(device), exception, message); "cuda_only" ids skip on the CPU
    ("x_type", lambda d: layer_norm([[1.0]]), TypeError, r"x must be a torch.Tensor, got list"),
    ("x_int", lambda d: layer_norm(_t(2, 64, dtype=torch.int32, device=d)), ValueError,
     r"x must have dtype float32, float16,? (or )?bfloat16.*, got torch.int32"),
    ("x_bool", lambda d: rms_norm(_t(2, 64, dtype=torch.bool, device=d)), ValueError,
     r"x must have dtype float32, float16,? (or )?bfloat16.*, got torch.bool"),
    ("x_0d", lambda d: layer_norm(_t(device=d)), ValueError, r"x must have at least 1 dim \[\.\.\., width\], got \(\)"),
    ("weight_shape", lambda d: layer_norm(_t(4, 768, device=d), _t(767, device=d)), ValueError,
     r"weight must have shape \(width,\) = \(768,\), got \(767,\)"),
    ("bias_shape", lambda d: layer_norm(_t(4, 768, device=d), None, _t(1, 768, device=d)), ValueError,
     r"bias must have shape \(width,\) = \(768,\), got \(1, 768\)"),
    ("weight_dtype", lambda d: rms_norm(_t(4, 768, device=d), _t(768, dtype=torch.bfloat16, device=d)), ValueError,
     r"weight must have x's dtype \(torch.float16\) or torch.float32, got torch.bfloat16"),
    ("bias_dtype", lambda d: layer_norm(_t(4, 64, device=d), None, _t(64, dtype=torch.float64, device=d)), ValueError,
     r"bias must have x's dtype \(torch.float16\) or torch.float32, got torch.float64"),
    ("weight_type", lambda d: layer_norm(_t(4, 64, device=d), 1.0), TypeError,
     r"weight must be a torch.Tensor or None, got float"),
    ("residual_shape", lambda d: layer_norm(_t(4, 768, device=d), residual=_t(4, 767, device=d)), ValueError,
     r"residual must have x's shape \(4, 768\), got \(4, 767\)"),
    ("residual_dtype", lambda d: rms_norm(_t(4, 64, device=d), residual=_t(4, 64, dtype=torch.float32, device=d)),
     ValueError, r"residual must have x's dtype \(torch.float16\), got torch.float32"),
    ("residual_type", lambda d: layer_norm(_t(4, 64, device=d), residual=3), TypeError,
     r"residual must be a torch.Tensor or None, got int"),
    ("eps_negative", lambda d: layer_norm(_t(4, 64, device=d), eps=-1e-5), ValueError,
     r"eps must be a finite number >= 0, got -1e-05"),
    ("eps_nan", lambda d: rms_norm(_t(4, 64, device=d), eps=math.nan), ValueError,
     r"eps must be a finite number >= 0, got nan"),
    ("eps_str", lambda d: layer_norm(_t(4, 64, device=d), eps="1e-5"), TypeError,
     r"eps must be a finite number >= 0, got '1e-5'"),
    ("x_index_type", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(2, 64, device=d), x_index=[1, 2]),
     TypeError, r"x_index must be a torch.Tensor or None, got list"),
    ("x_index_dtype", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(2, 64, device=d),
                                           x_index=_t(2, dtype=torch.float32, device=d)),
     ValueError, r"x_index must have dtype torch.int32 or torch.int64, got torch.float32"),
    ("x_index_2d", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(2, 64, device=d),
                                        x_index=_t(1, 2, dtype=torch.int64, device=d)),
     ValueError, r"x_index must have 1 dim \[rows\], got \(1, 2\)"),
    ("x_index_table_3d", lambda d: layer_norm(_t(3, 9, 64, device=d), residual=_t(2, 64, device=d),
                                              x_index=_t(2, dtype=torch.int64, device=d)),
     ValueError, r"x must have 2 dims \[table rows, width\] with x_index, got \(3, 9, 64\)"),
    ("x_index_residual_shape", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(3, 64, device=d),
                                                    x_index=_t(2, dtype=torch.int64, device=d)),
     ValueError, r"residual must have shape \(len\(x_index\), width\) \(2, 64\), got \(3, 64\)"),
    ("residual_index_length", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(5, 64, device=d),
                                                   x_index=_t(2, dtype=torch.int64, device=d),
                                                   residual_index=_t(3, dtype=torch.int32, device=d)),
     ValueError, r"residual_index must have length 2 \(the rows of y\), got 3"),
    ("residual_index_width", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(5, 65, device=d),
                                                  residual_index=_t(9, dtype=torch.int32, device=d)),
     ValueError, r"residual must have x's width \(64\), got 65"),
    ("residual_index_table_1d", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(64, device=d),
                                                     residual_index=_t(9, dtype=torch.int32, device=d)),
     ValueError, r"residual must have 2 dims \[table rows, width\] with residual_index, got \(64,\)"),
    ("residual_index_x_3d", lambda d: layer_norm(_t(1, 9, 64, device=d), residual=_t(5, 64, device=d),
                                                 residual_index=_t(9, dtype=torch.int32, device=d)),
     ValueError, r"x must have 2 dims \[rows, width\] with residual_index, got \(1, 9, 64\)"),
    ("x_index_without_residual", lambda d: layer_norm(_t(9, 64, device=d), x_index=_t(2, dtype=torch.int64, device=d)),
     ValueError, r"x_index must be None without a residual \(gathered rows are added, then normalized\), got a "
                 r"Tensor"),
    # CUDA only
    ("cuda_only_x_index_device", lambda d: layer_norm(_t(9, 64, device=d), residual=_t(2, 64, device=d),
                                                      x_index=_t(2, dtype=torch.int64)),
     ValueError, r"x_index must be on the same device as x \(cuda:0\), got cpu"),
    ("cuda_only_width_63", lambda d: layer_norm(_t(4, 63, device=d)), ValueError,
     r"x must have a width \(last dim\) in \[64, 16384\] on CUDA, got 63"),
    ("cuda_only_width_16385", lambda d: rms_norm(_t(2, 16385, device=d)), ValueError,
     r"x must have a width \(last dim\) in \[64, 16384\] on CUDA, got 16385"),
    ("cuda_only_float64", lambda d: layer_norm(_t(4, 64, dtype=torch.float64, device=d)), ValueError,
     r"x must have dtype float32, float16 or bfloat16, got torch.float64"),
    ("cuda_only_weight_device", lambda d: layer_norm(_t(4, 64, device=d), _t(64)), ValueError,
     r"weight must be on the same device as x \(cuda:0\), got cpu"),
    ("cuda_only_residual_device", lambda d: layer_norm(_t(4, 64, device=d), residual=_t(4, 64)), ValueError,
     r"residual must be on the same device as x \(cuda:0\), got cpu"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,make,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise(device, name, make, exc, match):
    if name.startswith("cuda_only") and device != "cuda":
        pytest.skip("a CUDA-only check")
    with pytest.raises(exc, match=match):
        make(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bad_inputs_through_the_op(device):
    """The ops themselves (no wrapper) repeat the checks: CPU kernel, fake kernel, C++ launcher (the same
    messages)."""
    ops = torch.ops.fused_attn
    x = _t(4, 768, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(width,\) = \(768,\), got \(767,\)"):
        ops.layer_norm(x, _t(767, device=device), None, 1e-5)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(4, 768\), got \(4, 767\)"):
        ops.add_layer_norm(x, _t(4, 767, device=device), None, None, 1e-5)
    with pytest.raises(ValueError, match=r"residual must have x's dtype \(torch.float16\), got torch.bfloat16"):
        ops.add_layer_norm(x, _t(4, 768, dtype=torch.bfloat16, device=device), None, None, 1e-5, rms=True)
    with pytest.raises(ValueError, match=r"bias must have x's dtype \(torch.float16\) or torch.float32, got "
                                         r"torch.bfloat16"):
        ops.layer_norm(x, None, _t(768, dtype=torch.bfloat16, device=device), 1e-5)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got -1"):
        ops.layer_norm(x, None, None, -1.0)
    with pytest.raises(ValueError, match=r"x_index must have dtype torch.int32 or torch.int64, got torch.float16"):
        ops.add_layer_norm(_t(9, 768, device=device), _t(2, 768, device=device), None, None, 1e-5, _t(2, device=device))
    with pytest.raises(ValueError, match=r"residual_index must have length 2 \(the rows of y\), got 3"):
        ops.add_layer_norm(_t(9, 768, device=device), _t(5, 768, device=device), None, None, 1e-5,
                           _t(2, dtype=torch.int64, device=device), _t(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"x must have a width \(last dim\) in \[64, 16384\] on CUDA, got 32"):
        ops.layer_norm(_t(4, 32, device="meta"), None, None, 1e-5)  # the fake kernel, as torch.compile sees it
    if device == "cuda":
        with pytest.raises(ValueError, match=r"x must have a width \(last dim\) in \[64, 16384\] on CUDA, got 32"):
            ops.layer_norm(_t(4, 32, device=device), None, None, 1e-5)
