"""mlp: the feed-forward block (GPT-2's GELU form and Llama's SwiGLU form), as two linear launches from
fused_attn.mlp and from the mlp op, against the float64 reference and the eager chain at the same dtype,
gradients, torch.compile, CUDA graphs and argument errors. The spec is the docstring of
``fused_attn.mlp.mlp``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.mlp import mlp
from tests.test_linear import _kernels_run, poison_allocator, with_examples
from tests.tolerances import assert_linear_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def mlp_case(draw, cuda):
    big = cuda and draw(st.booleans())
    d = draw(st.sampled_from([768, 1024]) if big else st.integers(1, 96))
    hidden = draw(st.sampled_from([3072, 2752]) if big else st.integers(1, 96))
    return dict(m=draw(st.one_of(st.integers(1, 17), st.sampled_from([64, 300]))) if cuda else draw(st.integers(1, 20)),
                d=d, hidden=hidden, d_out=draw(st.sampled_from([d, 7])),
                activation=draw(st.sampled_from(["gelu_tanh", "swiglu"])), bias=draw(st.booleans()),
                residual=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64])),
                seed=draw(st.integers(0, 2**31 - 1)))


def case_of(**kw):
    base = dict(m=1, d=64, hidden=256, d_out=64, activation="gelu_tanh", bias=True, residual=True,
                dtype=torch.float16, seed=0)
    return {**base, **kw}


def make_inputs(c, device):
    gen = torch.Generator(device=device).manual_seed(c["seed"])  # drawn on the device: test_linear says why
    fc_rows = 2 * c["hidden"] if c["activation"] == "swiglu" else c["hidden"]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64, device=device) * scale).to(c["dtype"])

    x = randn(c["m"], c["d"], scale=c.get("scale", 1.0))  # scale: the extreme-magnitude examples
    w_fc, w_proj = randn(fc_rows, c["d"], scale=c["d"] ** -0.5), randn(c["d_out"], c["hidden"], scale=c["hidden"] ** -0.5)
    b_fc = randn(fc_rows) if c["bias"] else None
    b_proj = randn(c["d_out"]) if c["bias"] else None
    r = randn(c["m"], c["d_out"], scale=c.get("scale", 1.0)) if c["residual"] else None
    return x, w_fc, b_fc, w_proj, b_proj, r


def run_and_check(c, device, **kw):
    x, w_fc, b_fc, w_proj, b_proj, r = make_inputs(c, device)
    poison_allocator(c["m"] * max(c["hidden"], c["d_out"]) * x.element_size(), device)
    got = mlp(x, w_fc, b_fc, w_proj, b_proj, activation=c["activation"], residual=r, **kw)
    assert got.shape == (c["m"], c["d_out"]) and got.dtype == x.dtype
    want = reference.mlp(x, w_fc, b_fc, w_proj, b_proj, activation=c["activation"], residual=r,
                         compute_dtype=torch.float64)
    if x.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        return
    h = reference._linear_compute(x, w_fc, b_fc, c["activation"], None, torch.float64)
    want = reference._linear_compute(h, w_proj, b_proj, None, r, torch.float64)
    eager = reference.eager_linear(reference.eager_linear(x, w_fc, b_fc, c["activation"]), w_proj, b_proj, None, r)
    assert_linear_close(got, eager, want, f"mlp {c}", k=max(x.shape[-1], w_proj.shape[-1]))


EDGES = [case_of(), case_of(activation="swiglu", bias=False, dtype=torch.bfloat16, m=4),
         case_of(d=768, hidden=3072, d_out=768, m=1), case_of(d=33, hidden=17, d_out=5, activation="swiglu", m=3),
         case_of(m=17, activation="swiglu")]


@pytest.mark.gpu
@given(case=mlp_case(cuda=True))
@with_examples(EDGES + [case_of(d=4096, hidden=11008, d_out=4096, activation="swiglu", bias=False, m=m,
                                dtype=torch.bfloat16) for m in (1, 16)])
def test_matches_reference_gpu(case):
    run_and_check(case, "cuda")


# --------------------------------------------------------------------------- the op


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_default_is_two_linear_launches_gpu(m):
    """fused_attn.mlp and the mlp op are the two linear launches, nothing else."""
    x, w_fc, b_fc, w_proj, b_proj, r = make_inputs(case_of(m=m, d=768, hidden=3072, d_out=768), "cuda")
    mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r)
    for call in (lambda: mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r),
                 lambda: torch.ops.fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, r, activation=1)):
        names = _kernels_run(call)
        assert len(names) == 2 and all("linear_" in n for n in names), names


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_op_is_fused_attn_mlp(device, activation):
    """The op computes exactly what fused_attn.mlp's two linear launches do (each rounds once to x's dtype)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    c = case_of(m=5, d=24, hidden=40, d_out=9, activation=activation, dtype=dtype)
    x, w_fc, b_fc, w_proj, b_proj, r = make_inputs(c, device)
    code = {"gelu_tanh": 1, "swiglu": 2}[activation]
    assert torch.equal(torch.ops.fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, r, activation=code),
                       mlp(x, w_fc, b_fc, w_proj, b_proj, activation=activation, residual=r))


def test_op_refuses_grad_cpu():
    """The op records no gradient and says so, naming the input; fused_attn.mlp differentiates (gradcheck
    below)."""
    x, wf, bf, wp, bp, r = make_inputs(case_of(m=3, d=5, hidden=4, d_out=6, dtype=torch.float64), "cpu")
    with pytest.raises(ValueError, match=r"w_proj must not require grad \(the mlp op records no gradient"):
        torch.ops.fused_attn.mlp(x, wf, bf, wp.requires_grad_(), bp, r, activation=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_op_compiles_fullgraph(device):
    def block(x, w_fc, w_proj):
        return torch.ops.fused_attn.mlp(x, w_fc, None, w_proj, None, x, activation=1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    dtype = torch.float16 if device == "cuda" else torch.float32
    x, w_fc, _, w_proj, _, _ = make_inputs(case_of(m=4, d=64, hidden=256, d_out=64, dtype=dtype), device)
    torch.testing.assert_close(compiled(x, w_fc, w_proj), block(x, w_fc, w_proj), rtol=0, atol=0)


@given(case=mlp_case(cuda=False))
@with_examples([e for e in EDGES if e["d"] * e["hidden"] <= 1 << 14]
               + [case_of(dtype=torch.float64, activation="swiglu", m=2, d=9, hidden=5, d_out=9)])
def test_matches_reference_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_gradcheck_float64_cpu(activation):
    c = case_of(m=3, d=5, hidden=4, d_out=6, activation=activation, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in make_inputs(c, "cpu"))
    assert torch.autograd.gradcheck(
        lambda x, wf, bf, wp, bp, r: mlp(x, wf, bf, wp, bp, activation=activation, residual=r), inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def block(x, w_fc, w_proj):
        return mlp(x, w_fc, None, w_proj, None, activation="swiglu", residual=x)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    x, w_fc, _, w_proj, _, _ = make_inputs(case_of(m=2, d=32, hidden=48, d_out=32, activation="swiglu",
                                                   dtype=torch.float32), device)
    torch.testing.assert_close(compiled(x, w_fc, w_proj), block(x, w_fc, w_proj))


@pytest.mark.gpu
def test_cuda_graph_replays():
    x, w_fc, b_fc, w_proj, b_proj, r = make_inputs(case_of(m=4, d=768, hidden=3072, d_out=768), "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r)
    x.copy_(torch.randn(x.shape, device="cuda").half())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r))


BAD = [
    ("activation", dict(activation="relu"), ValueError, r"activation must be 'gelu_tanh' or 'swiglu', got 'relu'"),
    ("w_fc width", dict(w_fc=torch.randn(16, 9)), ValueError,
     r"w_fc must have in_features = x's last dim \(8\), got \(16, 9\)"),
    ("w_fc dtype", dict(w_fc=torch.randn(16, 8).half()), ValueError,
     r"w_fc must have x's dtype \(torch.float32\), got torch.float16"),
    ("b_fc shape", dict(b_fc=torch.randn(15)), ValueError, r"b_fc must have shape \(16,\), got \(15,\)"),
    ("swiglu odd", dict(w_fc=torch.randn(15, 8), b_fc=None, activation="swiglu"), ValueError,
     r"w_fc must have an even out_features \(gate rows over up rows\) for swiglu, got \(15, 8\)"),
    ("w_proj hidden", dict(w_proj=torch.randn(8, 15)), ValueError,
     r"w_proj must have shape \[d_out, hidden\] with hidden = 16 \(from w_fc\), got \(8, 15\)"),
    ("w_proj hidden swiglu", dict(activation="swiglu"), ValueError,
     r"w_proj must have shape \[d_out, hidden\] with hidden = 8 \(from w_fc\), got \(8, 16\)"),
    ("b_proj dtype", dict(b_proj=torch.randn(8).double()), ValueError,
     r"b_proj must have x's dtype \(torch.float32\), got torch.float64"),
    ("residual shape", dict(residual=torch.randn(3, 7)), ValueError, r"residual must have shape \(3, 8\), got \(3, 7\)"),
    ("w_proj device", dict(w_proj=torch.randn(8, 16, device="meta")), ValueError,
     r"w_proj must be on the same device as x \(cpu\), got meta"),
]


@pytest.mark.parametrize("name,changes,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(name, changes, exc, match):
    a = dict(x=torch.randn(3, 8), w_fc=torch.randn(16, 8), b_fc=torch.randn(16), w_proj=torch.randn(8, 16),
             b_proj=torch.randn(8), residual=None, activation="gelu_tanh", **{})
    a.update(changes)
    with pytest.raises(exc, match=match):
        mlp(a["x"], a["w_fc"], a["b_fc"], a["w_proj"], a["b_proj"], activation=a["activation"], residual=a["residual"])


OP_BAD = [
    ("activation none", dict(activation=0), r"activation must be 1 \(gelu_tanh\) or 2 \(swiglu\), got 0"),
    ("w_proj width", dict(w_proj=torch.randn(8, 15)), r"w_proj must have shape \[d_out, hidden\] with hidden = 16"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,changes,match", OP_BAD, ids=[b[0] for b in OP_BAD])
def test_op_bad_inputs_raise(device, name, changes, match):
    """The op's own checks (C++ on CUDA, Python on the CPU) name the argument the same way."""
    a = dict(x=torch.randn(3, 8), w_fc=torch.randn(16, 8), b_fc=None, w_proj=torch.randn(8, 16), b_proj=None,
             residual=None, activation=1)
    a.update(changes)
    a = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    with pytest.raises(ValueError, match=match):
        torch.ops.fused_attn.mlp(a["x"], a["w_fc"], a["b_fc"], a["w_proj"], a["b_proj"], a["residual"],
                                 activation=a["activation"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("m", [1, 4, 17])
def test_norm_is_the_first_projections(device, norm, m):
    """mlp's norm arguments go to the first projection: the same as normalizing x first (layer_norm's
    result), bit for bit on the CPU, within the linear tolerances on CUDA."""
    from fused_attn.layer_norm import layer_norm, rms_norm

    c = case_of(m=m, d=768 if device == "cuda" else 64, hidden=3072 if device == "cuda" else 96, d_out=7)
    x, w_fc, b_fc, w_proj, b_proj, r = make_inputs(c, device)
    gen = torch.Generator().manual_seed(m)
    nw = (1 + torch.randn(x.shape[-1], generator=gen)).to(x.dtype).to(device)
    nb = torch.randn(x.shape[-1], generator=gen).to(x.dtype).to(device) if norm == "layer_norm" else None
    got = mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r, norm=norm, norm_weight=nw, norm_bias=nb, eps=1e-5)
    xn = layer_norm(x, nw, nb, 1e-5) if norm == "layer_norm" else rms_norm(x, nw, 1e-5)
    two = mlp(xn, w_fc, b_fc, w_proj, b_proj, residual=r)
    if device == "cpu":
        assert torch.equal(got, two)
    else:
        xn64 = reference.layer_norm(x, nw, nb, 1e-5, rms=norm == "rms_norm", compute_dtype=torch.float64).double()
        h = reference._linear_compute(xn64, w_fc, b_fc, "gelu_tanh", None, torch.float64)
        want = reference._linear_compute(h, w_proj, b_proj, None, r, torch.float64)
        assert_linear_close(got, two, want, f"mlp norm {c}", k=w_proj.shape[-1])
