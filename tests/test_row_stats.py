"""linear's row statistics (``row_stats=True``: the output rows' per-16-column mean and M2) and the norm
that uses them (``norm_stats=``: x normalized with the statistics the launch before wrote): against the
float64 references (``fused_attn.reference.row_stats`` / ``normalize_from_stats``), the tensor-core kernels'
paths and the PyTorch fallbacks, constant rows and offsets, poisoned outputs, opcheck and argument errors;
and GPT-2's decode step with the statistics chain against the same step with a launch per norm. The spec is
the docstring of ``fused_attn.linear.linear``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fused_attn.gpt2 as gpt2_module
from fused_attn import reference
from fused_attn.linear import linear
from tests.test_linear import poison_allocator
from tests.tolerances import assert_linear_close

ACTIVATIONS = [None, "gelu_tanh", "swiglu"]


def _stats_close(got: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """got (float32 [..., groups, 2]) against the float64 statistics of y as returned: the mean within a few
    float32 roundings of the group's largest magnitude, M2 within a few of the group's sum of squares."""
    want = reference.row_stats(y, compute_dtype=torch.float64).double()
    n = y.shape[-1]
    groups = want.shape[-2]
    v = torch.nn.functional.pad(y.double(), (0, groups * 16 - n)).reshape(*y.shape[:-1], groups, 16)
    scale_mean = v.abs().amax(-1) + 1e-30
    scale_m2 = v.square().sum(-1) + 1e-30
    assert got.shape == want.shape and got.dtype == torch.float32, f"{what}: {got.shape} {got.dtype}"
    assert not torch.isnan(got).any(), f"{what}: NaN statistics (an element not written?)"
    err_mean = ((got[..., 0].double() - want[..., 0]).abs() / scale_mean).max().item()
    err_m2 = ((got[..., 1].double() - want[..., 1]).abs() / scale_m2).max().item()
    assert err_mean <= 8 * 2.0**-24 and err_m2 <= 64 * 2.0**-24, f"{what}: mean {err_mean:.3g}, M2 {err_m2:.3g}"


@st.composite
def stats_case(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    activation = draw(st.sampled_from(ACTIVATIONS))
    n = draw(st.sampled_from([8, 24, 768, 2304, 100]))
    n = 2 * n if activation == "swiglu" else n
    return dict(m=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 9, 13, 16, 17])), k=draw(st.sampled_from([64, 200, 768])),
                n=n, dtype=dtype, activation=activation, residual=draw(st.booleans()),
                offset=draw(st.sampled_from([0.0, 8.0])), seed=draw(st.integers(0, 2**31 - 1)))


def _inputs(case, device):
    gen = torch.Generator(device="cpu").manual_seed(case["seed"])
    m, k, n, dt = case["m"], case["k"], case["n"], case["dtype"]
    n_out = n // 2 if case["activation"] == "swiglu" else n
    x = (torch.randn(m, k, generator=gen) + case.get("offset", 0.0)).to(dt).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dt).to(device)
    b = torch.randn(n, generator=gen).to(dt).to(device)
    r = (torch.randn(m, n_out, generator=gen) + case.get("offset", 0.0)).to(dt).to(device) if case["residual"] else None
    return x, w, b, r, n_out


def check_row_stats(case, device):
    x, w, b, r, n_out = _inputs(case, device)
    plain = linear(x, w, b, activation=case["activation"], residual=r)
    poison_allocator(x.shape[0] * ((n_out + 15) // 16) * 8, device)
    y, stats = linear(x, w, b, activation=case["activation"], residual=r, row_stats=True)
    assert torch.equal(y, plain), f"{case}: y differs from linear's without row_stats"
    _stats_close(stats.cpu(), y.cpu(), str(case))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_row_stats_y_is_linears_with_activation_and_residual_gpu(m, activation):
    """y from the statistics builds (the activation read at run time) against linear's own (activation, bias
    and residual compiled in), every element: in session 27 nvcc contracted the activation's last product
    with the residual add into one FMA in the compiled-in builds only, one ulp off in 1-3 elements of
    these shapes (found at 1-8 rows with GELU; linear_kernel.cuh's store_output now adds the residual
    with __fadd_rn). Tensor-core (n 2304) and split-K (n 768) shapes, short and long K."""
    for k in (64, 200, 768):
        for n in (768, 2304):
            case = dict(m=m, k=k, n=2 * n if activation == "swiglu" else n, dtype=torch.float16,
                        activation=activation, residual=True, offset=0.0, seed=1)
            x, w, b, r, _ = _inputs(case, "cuda")
            plain = linear(x, w, b, activation=activation, residual=r)
            y, _ = linear(x, w, b, activation=activation, residual=r, row_stats=True)
            assert torch.equal(y, plain), f"m {m}, k {k}, n {n}: {int((y != plain).sum())} elements differ"


@pytest.mark.gpu
@given(case=stats_case())
def test_row_stats_match_reference_gpu(case):
    check_row_stats(case, "cuda")


@given(case=stats_case())
def test_row_stats_match_reference_cpu(case):
    check_row_stats({**case, "m": min(case["m"], 5)}, "cpu")


def check_stats_norm(case, device, stats_from_kernel: bool):
    """x's rows normalized from statistics (as the previous launch would hand them), then the linear: against
    float64 LayerNorm / RMSNorm of x and the linear, with at most twice the error of PyTorch's own path at
    x's dtype (the norm, rounded, then the linear)."""
    x, w, b, r, n_out = _inputs(case, device)
    norm = case.get("norm", "layer_norm")
    if stats_from_kernel:  # x written by a residual projection that also wrote its statistics
        x0, w0, _, _, _ = _inputs({**case, "k": case["k"], "n": case["k"], "activation": None, "seed": case["seed"] + 1},
                                  device)
        x, stats = linear(x0, w0, residual=x, row_stats=True)
    else:
        stats = reference.row_stats(x, compute_dtype=torch.float64)
    sums = w.float().sum(1)
    poison_allocator(x.shape[0] * n_out * x.element_size(), device)
    got = linear(x, w, b, activation=case["activation"], residual=r, norm=norm, norm_stats=stats, weight_sums=sums)
    xn = reference.layer_norm(x, None, None, 1e-5, rms=norm == "rms_norm", compute_dtype=torch.float64)
    want = reference._linear_compute(xn, w, b, case["activation"], r, torch.float64)
    peer = reference.eager_linear(xn.to(x.dtype), w, b, case["activation"], r)
    assert_linear_close(got, peer, want, f"stats norm {case}", k=x.shape[-1])


@pytest.mark.gpu
@given(case=stats_case(), norm=st.sampled_from(["layer_norm", "rms_norm"]), big=st.booleans())
def test_stats_norm_property_gpu(case, norm, big):
    """Generated shapes, dtypes, activations, row counts (one row and 17 on the fallbacks), offsets up to 1e4."""
    check_stats_norm({**case, "norm": norm, "offset": 1e4 if big else case["offset"]}, "cuda", False)


@given(case=stats_case(), norm=st.sampled_from(["layer_norm", "rms_norm"]))
def test_stats_norm_property_cpu(case, norm):
    check_stats_norm({**case, "m": min(case["m"], 5), "norm": norm}, "cpu", False)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("n", [2304, 768])  # the tensor-core kernel (16 weight rows per SM), the fallback
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("from_kernel", [False, True])
def test_stats_norm_matches_reference_gpu(m, n, activation, dtype, from_kernel):
    n = 2 * n if activation == "swiglu" else n
    check_stats_norm(dict(m=m, k=768, n=n, dtype=dtype, activation=activation, residual=True, offset=0.0,
                          seed=m * 7 + n), "cuda", from_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(m=16, k=200, n=2304, dtype=torch.float16, activation=None, residual=False, offset=100.0, seed=1),
    dict(m=4, k=776, n=2304, dtype=torch.bfloat16, activation="gelu_tanh", residual=True, offset=1e3, seed=2),
    dict(m=13, k=768, n=3072, dtype=torch.float16, activation="gelu_tanh", residual=False, offset=-30.0, seed=3,
         norm="rms_norm"),
    dict(m=1, k=768, n=2304, dtype=torch.float16, activation=None, residual=True, offset=0.0, seed=4),  # CUDA cores
    dict(m=16, k=768, n=2304, dtype=torch.float32, activation=None, residual=True, offset=0.0, seed=5),
])
def test_stats_norm_odd_cases_gpu(case):
    check_stats_norm(case, "cuda", False)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_stats_norm_matches_reference_cpu(norm):
    check_stats_norm(dict(m=5, k=40, n=24, dtype=torch.float32, activation="gelu_tanh", residual=True, offset=3.0,
                          seed=0, norm=norm), "cpu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stats_norm_constant_rows_gpu(dtype):
    """A row of equal values (zero variance) normalizes to zeros: the output is act(bias) exactly, at an
    offset the shift in x's dtype represents exactly."""
    m, k, n = 16, 768, 2304
    x = torch.full((m, k), 1000.0, dtype=dtype, device="cuda")
    x[1::2] = -3.0
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    got = linear(x, w, b, activation="gelu_tanh", norm="layer_norm", norm_stats=reference.row_stats(x))
    want = torch.nn.functional.gelu(b.float(), approximate="tanh").to(dtype).expand(m, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_stats_kernels_run_gpu():
    """At 16 rows of float16 the producer's statistics come from the split-K kernel (no extra launch) and the
    consumer's norm from linear_mma_kernel (no layer_norm launch)."""
    from tests.test_linear import _kernels_run

    x = torch.randn(16, 3072, device="cuda", dtype=torch.float16)
    w1 = torch.randn(768, 3072, device="cuda", dtype=torch.float16) / 60
    w2 = torch.randn(2304, 768, device="cuda", dtype=torch.float16) / 30
    res = torch.randn(16, 768, device="cuda", dtype=torch.float16)
    sums = w2.float().sum(1)

    def step():
        h, stats = linear(x, w1, residual=res, row_stats=True)
        linear(h, w2, norm="layer_norm", norm_stats=stats, weight_sums=sums)

    step()
    names = _kernels_run(step)
    assert len(names) == 2 and "linear_splitk_kernel" in names[0] and "linear_mma_kernel" in names[1], names


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    x = torch.randn(5, 64, device=device, dtype=torch.float32)
    w = torch.randn(48, 64, device=device)
    torch.library.opcheck(torch.ops.fused_attn.linear_row_stats, (x, w, None, None), {"activation": 1})
    stats = reference.row_stats(x)
    torch.library.opcheck(torch.ops.fused_attn.linear_stats_norm, (x, stats, w, w.sum(1)), {"norm": 1})


def test_bad_arguments():
    x = torch.randn(4, 32)
    w = torch.randn(16, 32)
    stats = reference.row_stats(x)
    cases = [
        (dict(norm_stats=stats), "norm_stats must be None without a norm, got a tensor"),
        (dict(norm="layer_norm", norm_stats=stats[:, :1]), "norm_stats must have shape (4, 2, 2), got (4, 1, 2)"),
        (dict(norm="layer_norm", norm_stats=stats.double()), "norm_stats must have dtype torch.float32, got torch.float64"),
        (dict(norm="layer_norm", norm_stats=stats, weight_sums=torch.ones(3)),
         "weight_sums must have shape (16,), got (3,)"),
        (dict(weight_sums=torch.ones(16)), "weight_sums must be None without norm_stats, got a tensor"),
        (dict(row_stats=1), "row_stats must be a bool, got int"),
        (dict(row_stats=True, post_norm="layer_norm"), "row_stats must be False with a post_norm, got True"),
    ]
    for kw, msg in cases:
        with pytest.raises((ValueError, TypeError)) as e:
            linear(x, w, **kw)
        assert str(e.value) == msg, (kw, str(e.value))


def test_gradient_flows_through_own_statistics():
    """With a gradient wanted, norm_stats are not used (the gradient flows through the norm's own statistics)
    and row_stats are PyTorch ops on y: both differentiable."""
    x = torch.randn(4, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.float64)
    y = linear(x, w, norm="layer_norm", norm_stats=reference.row_stats(x.detach()))
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    x2 = x.detach().clone().requires_grad_()
    (gx2,) = torch.autograd.grad(linear(x2, w, norm="layer_norm").square().sum(), x2)
    torch.testing.assert_close(gx, gx2)
    _, stats = linear(x, w, row_stats=True)
    assert stats.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [4, 16])
def test_gpt2_step_stats_chain_gpu(batch, monkeypatch):
    """GPT-2's captured decode step at 4-16 rows of float16 with the statistics chain (no norm launch between
    the projections) against the same step with a launch per norm: the same next tokens where the logits'
    top two are apart, and logits within float16 noise."""
    from fused_attn.generate import GRAPH_BACKENDS, make_batch
    from fused_attn.gpt2 import GPT2, load_hf_model

    hf = load_hf_model("gpt2-random")
    m = GPT2.from_hf(hf, dtype=torch.float16, device="cuda", backends=GRAPH_BACKENDS["graph-fused"])
    gen = torch.Generator().manual_seed(0)
    ids, mask = make_batch(torch.randint(0, m.config.vocab_size, (32,), generator=gen), batch)
    out = {}
    for off in (True, False):
        monkeypatch.setattr(gpt2_module, "_STATS_CHAIN_OFF", off)
        cache = m.decode_cache(batch, ids.shape[1] + 8) if off else cache
        with torch.no_grad():
            m.prefill(cache, ids.cuda(), mask.cuda())
            x, normed = m.embed_first_norm(cache.token[:, None], cache.pos[:, None])
            assert m._stats_chain(x, normed) is (not off)
            lengths = (cache.seqlens, cache.leftpad)
            h, _ = m._blocks(x, normed, cache.keys_ok[:, None, None, :], cache, causal=False, input_pos=cache.slot,
                             attend_cache=True, lengths=lengths)
            out[off] = m.logits(h[:, 0]).float()
    ref, got = out[True], out[False]
    err = (got - ref).abs().max().item()
    assert err <= 0.05 * ref.abs().max().item(), err
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
