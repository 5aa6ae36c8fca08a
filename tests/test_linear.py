"""linear: the CUDA kernel (M <= 16: ours; more rows: cuBLAS) and the CPU path against the float64
reference, every activation x bias x residual combination, odd shapes and layouts, poisoned outputs,
gradients, CUDA graphs, torch.compile, opcheck and argument errors. The spec is the docstring of
``fused_attn.linear.linear``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.linear import MAX_GEMV_ROWS, MAX_MMA_ROWS, linear
from tests.tolerances import NORM_ULPS, assert_close, assert_linear_close, norm_tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "gelu_tanh", "swiglu"]
GPU_BUDGET = 1 << 22  # M x K x N per example
CPU_BUDGET = 1 << 15
# Input scale: x, bias and residual are this large (the weight ~ 1 / sqrt(K), outputs ~ scale).
SCALES = {torch.float16: (2.0**-8, 1.0, 2.0**5), torch.bfloat16: (2.0**-40, 1.0, 2.0**40),
          torch.float32: (2.0**-40, 1.0, 2.0**40), torch.float64: (1.0,)}


@st.composite
def linear_case(draw, budget, cuda):
    dtype = draw(st.sampled_from(DTYPES if cuda else DTYPES + [torch.float64]))
    k = draw(st.one_of(st.sampled_from([1, 8, 64, 768, 1000, 4096]), st.integers(0, 300)))
    activation = draw(st.sampled_from(ACTIVATIONS))
    n = draw(st.one_of(st.sampled_from([1, 8, 64, 768, 2304]), st.integers(1, 300)))
    n = 2 * n if activation == "swiglu" else n
    m_cap = max(1, budget // max(1, k * n))
    m = draw(st.one_of(st.integers(1, MAX_GEMV_ROWS), st.sampled_from([1, 4, 5, 16, 17, 24, 32, 33, 128]),
                       st.integers(1, 4096))) if m_cap > 1 else 1
    m = min(m, m_cap)
    if k * n > 4 * budget:
        n = max(2, budget // max(1, k)) // 2 * 2
    return dict(m=m, k=k, n=n, dtype=dtype, activation=activation, bias=draw(st.booleans()),
                residual=draw(st.booleans()), lead=draw(st.sampled_from(["2d", "3d", "1d"])),
                layout=draw(st.sampled_from(["contiguous", "strided", "misaligned"])),
                scale=draw(st.sampled_from(SCALES[dtype])), seed=draw(st.integers(0, 2**31 - 1)))


def case_of(**kw):
    base = dict(m=1, k=64, n=64, dtype=torch.float16, activation=None, bias=True, residual=True, lead="2d",
                layout="contiguous", scale=1.0, seed=0)
    return {**base, **kw}


def _place(t: torch.Tensor, layout: str, gen) -> torch.Tensor:
    """``t``'s values in the requested layout: a fresh contiguous tensor, a view of every other row/column of
    a larger buffer (strides, no contiguous last dim), or rows at an odd element offset (not 16-byte
    aligned, last dim contiguous)."""
    if layout == "contiguous" or t.numel() == 0:
        return t.clone()
    if layout == "strided":
        big = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        big[..., ::2] = t
        return big[..., ::2]
    big = torch.empty((*t.shape[:-1], t.shape[-1] + 1), dtype=t.dtype, device=t.device)
    big[..., 1:] = t
    return big[..., 1:]


def make_inputs(case, device):
    # Drawn on the case's device (seeded there): the tensor-core cases' weights (up to 11008 x 4224) took most
    # of a GPU test's time as float64 normals on the host.
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    m, k, n, dtype, s = case["m"], case["k"], case["n"], case["dtype"], case["scale"]
    lead = {"2d": (m,), "1d": (), "3d": (1, m)}[case["lead"]] if case["lead"] != "1d" or m == 1 else (m,)
    n_out = n // 2 if case["activation"] == "swiglu" else n

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64, device=device) * scale).to(dtype)

    x = _place(randn(*lead, k, scale=s), case["layout"], gen)
    w = _place(randn(n, k, scale=1 / math.sqrt(max(k, 1))), case["layout"], gen)
    b = randn(n, scale=s) if case["bias"] else None
    r = _place(randn(*lead, n_out, scale=s), case["layout"], gen) if case["residual"] else None
    return x, w, b, r


def poison_allocator(nbytes: int, device) -> None:
    """On CUDA, free a NaN-filled block of the output's size: the caching allocator hands the op's output
    that block, so an element the kernel does not write stays NaN."""
    if torch.device(device).type == "cuda":
        torch.full((max(1, nbytes // 4),), math.nan, device=device)


def run_and_check(case, device):
    x, w, b, r = make_inputs(case, device)
    n_out = case["n"] // 2 if case["activation"] == "swiglu" else case["n"]
    poison_allocator(x[..., :1].numel() * n_out * x.element_size(), device)
    got = linear(x, w, b, activation=case["activation"], residual=r)
    want = reference.linear(x, w, b, activation=case["activation"], residual=r, compute_dtype=torch.float64)
    assert got.shape == (*x.shape[:-1], n_out) and got.dtype == x.dtype and got.device == x.device
    assert got.is_contiguous(), f"linear {case}: strides {got.stride()}"
    if x.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * case["scale"])
        return
    want = reference._linear_compute(x, w, b, case["activation"], r, torch.float64)
    assert_linear_close(got, reference.eager_linear(x, w, b, case["activation"], r), want, f"linear {case}",
                        k=x.shape[-1])


EDGE_EXAMPLES = [
    case_of(),
    case_of(k=0, n=8, bias=False, residual=False),  # an empty reduction: zeros
    case_of(k=0, n=8, activation="gelu_tanh"),  # act(bias) + residual
    case_of(k=7, n=5, m=3, dtype=torch.bfloat16, activation="gelu_tanh"),  # K not a multiple of 8: element-wise path
    case_of(k=768, n=2304, m=1, dtype=torch.bfloat16, activation="gelu_tanh", residual=False),
    case_of(k=3072, n=768, m=4, dtype=torch.float16, lead="3d"),
    case_of(k=1000, n=6, m=16, dtype=torch.float32, activation="swiglu", layout="misaligned"),
    case_of(k=64, n=10, m=17, dtype=torch.bfloat16, activation="swiglu", layout="strided"),  # cuBLAS path
    # cuBLAS rows with GELU: in float32 its own pass (the Lt epilogue's tanh is ~1e-6 off), in 16-bit the
    # GEMM's epilogue (_addmm_activation)
    case_of(k=96, n=40, m=33, dtype=torch.float32, activation="gelu_tanh", scale=2.0),
    case_of(k=8, n=8, m=17, dtype=torch.float32, activation="gelu_tanh", residual=False),
    case_of(k=128, n=72, m=48, dtype=torch.float16, activation="gelu_tanh", residual=False),
    case_of(k=0, n=3, m=17, dtype=torch.float32, activation="gelu_tanh", residual=False),  # no epilogue: gelu(bias)
    case_of(k=33, n=9, m=5, dtype=torch.float16, layout="strided", activation="gelu_tanh"),
    case_of(k=256, n=64, m=2, dtype=torch.float16, scale=2.0**5, activation="gelu_tanh"),
    case_of(k=256, n=64, m=8, dtype=torch.bfloat16, scale=2.0**-40, activation="swiglu"),
]


def with_examples(cases):
    def wrap(f):
        for c in cases:
            f = example(case=c)(f)
        return f
    return wrap


@pytest.mark.gpu
@given(case=linear_case(GPU_BUDGET, cuda=True))
@with_examples(EDGE_EXAMPLES + [case_of(k=4096, n=1024, m=m, dtype=torch.bfloat16, activation="gelu_tanh")
                                for m in (1, 2, 3, 4, 9, 16, 17, 512)]
               + [case_of(k=3072, n=768, m=16, dtype=torch.float16, activation="gelu_tanh"),  # split-K
                  case_of(k=3072, n=1536, m=13, dtype=torch.bfloat16, activation="swiglu", layout="misaligned")])
def test_matches_reference_gpu(case):
    run_and_check(case, "cuda")


@given(case=linear_case(CPU_BUDGET, cuda=False))
@with_examples([c for c in EDGE_EXAMPLES if c["m"] * c["k"] * c["n"] <= 1 << 16]
               + [case_of(k=13, n=6, m=3, dtype=torch.float64, activation="swiglu")])
def test_matches_reference_cpu(case):
    run_and_check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("m", list(range(1, MAX_GEMV_ROWS + 2)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count_and_epilogue_gpu(m, activation, dtype):
    """Each MT class and the tail rows inside it (m < MT), at GPT-2's c_proj width (N = 768: 2 rows per
    block) and a K with a partial last loop iteration; from 5 rows a K below 2048, where float32's
    CUDA-core kernel still runs (above it those rows go to cuBLAS: linear.cpp's gemv_wins) and float16 /
    bfloat16 take the split-K kernel."""
    k = 3072 + 8 if m <= 4 else 1536 + 8
    for bias in (False, True):
        for residual in (False, True):
            run_and_check(case_of(m=m, k=k, n=768, dtype=dtype, activation=activation, bias=bias,
                                  residual=residual, seed=m), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_path_gpu(m, activation, dtype):
    """The tensor-core kernel (float16 / bfloat16, 2-16 rows, one row without a norm at K <= 4096; 16-byte
    rows, >= 2112 output columns on an H100): a K with a partial last chunk of 32 and a partial last tile of output columns, and Llama's
    widths (the kernel's long build: more than 3 chunks of 32 k per warp), GPT-2's 768 x 2304 (the short
    build); beside it the split-K kernel at N = 768 (too few tiles for the tensor-core one: on sm_90), and
    K 11008, where these rows go to cuBLAS. With 9-16 rows the short build stages x through shared memory
    where its grid is resident at once (768 x 2304, 744 x 2305 with a partial chunk and tile, the split-K
    grids) and loads it into registers in grids of many waves (744 x 10000: 625 blocks, more than three
    per SM of any GPU up to 208 SMs). Each build is compiled for its launch's bias and residual (present or
    not: linear_kernel.cuh's with_build_epilogue), so every shape runs two of the four combinations and every
    row class all four: neither and both where the shape's index and m have the same parity, else one of
    them alone."""
    swiglu = activation == "swiglu"
    shapes = ((776, 2305), (4096, 4096), (768, 2304), (744, 2305), (744, 10000), (1536, 768), (11008, 2112))
    for i, (k, n_out) in enumerate(shapes):
        combos = ((False, False), (True, True)) if (i + m) % 2 == 0 else ((True, False), (False, True))
        for bias, residual in combos:
            run_and_check(case_of(m=m, k=k, n=2 * n_out if swiglu else n_out, dtype=dtype, activation=activation,
                                  bias=bias, residual=residual, seed=m + k), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_epilogue_gpu(dtype):
    """The cuBLAS path (more than MAX_MMA_ROWS rows; float32 from MAX_GEMV_ROWS + 1, and where the tensor-core
    kernels' wide build does not take the shape), each epilogue x bias x residual: in float16 /
    bfloat16 one cuBLASLt call (bias, GELU and the residual as its C operand: linear_cublaslt.cpp), in
    float32 and at layouts Lt does not take ATen's addmm; the one-pass SwiGLU kernel (linear_swiglu.cu)
    in its 16-byte build (hidden a multiple of the vector width) and its element-wise one (odd hidden),
    over more rows than a grid's y dimension holds (its stride loop)."""
    for activation in (None, "gelu_tanh"):
        for bias in (False, True):
            for residual in (False, True):
                for layout in ("contiguous", "strided", "misaligned"):
                    run_and_check(case_of(m=40, k=72, n=64, dtype=dtype, activation=activation, bias=bias,
                                          residual=residual, layout=layout, seed=len(layout)), "cuda")
    # Output rows that are not whole 16-byte pieces (1001 and 77 columns: a vocabulary's lm_head), with and
    # without the residual as Lt's C operand: Lt's D at 2-byte-aligned rows.
    for n in (1001, 77):
        for activation in (None, "gelu_tanh"):
            for bias, residual in ((False, False), (True, False), (True, True)):
                run_and_check(case_of(m=64, k=96, n=n, dtype=dtype, activation=activation, bias=bias,
                                      residual=residual, seed=n), "cuda")
    # Wide outputs (4096 columns and more) whose rows are whole 16-byte pieces or not (the last piece 1 or 7
    # elements), x at an odd offset too: linear_cublas's split of such outputs into two GEMMs (kLtSplitMinCols).
    for n in (4097, 4103, 4096):
        for activation in (None, "gelu_tanh"):
            for bias, residual, layout in ((False, False, "contiguous"), (True, False, "misaligned"),
                                           (True, True, "contiguous"), (False, True, "misaligned")):
                run_and_check(case_of(m=40, k=72, n=n, dtype=dtype, activation=activation, bias=bias,
                                      residual=residual, layout=layout, seed=n), "cuda")
    for m, n_out in ((MAX_MMA_ROWS + 1, 64), (40, 5), (65535 + 3, 8)):
        for bias, residual in ((False, False), (True, True), (False, True)):
            run_and_check(case_of(m=m, k=24, n=2 * n_out, dtype=dtype, activation="swiglu", bias=bias,
                                  residual=residual, seed=m), "cuda")
    # x and the residual expanded from one row (row stride 0): rows that overlap, which the GEMM may not
    # read with a leading dimension of its own choosing.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 72, generator=gen, dtype=torch.float64).to(dtype).cuda().expand(40, 72)
    w = (torch.randn(64, 72, generator=gen, dtype=torch.float64) / 72**0.5).to(dtype).cuda()
    r = torch.randn(1, 64, generator=gen, dtype=torch.float64).to(dtype).cuda().expand(40, 64)
    for b in (None, torch.randn(64, generator=gen, dtype=torch.float64).to(dtype).cuda()):
        got = linear(x, w, b, residual=r)
        want = reference._linear_compute(x, w, b, None, r, torch.float64)
        assert_linear_close(got, reference.eager_linear(x, w, b, None, r), want, f"expanded {dtype} bias={b is not None}",
                            k=72)


# (K, output columns) of the split-K kernel (float16 / bfloat16, 2-16 rows, fewer 16-row tiles than SMs,
# sm_90): GPT-2's c_proj (3072 -> 768) and attention c_proj (768 -> 768), Llama's down K over few
# columns, odd tile counts with a partial last tile (776: 49 tiles, 200: 13; on an H100 3080 x 776 runs
# 6 splits, the last one short), a K with a partial last chunk of 32 over 3 splits, one chunk (a
# cluster of one block) and 9 chunks over 5 splits (the last one a single chunk).
SPLIT_K_SHAPES = [(3072, 768), (768, 768), (11008, 200), (3080, 776), (72, 200), (8, 768), (288, 776)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", list(range(2, MAX_GEMV_ROWS + 1)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_path_gpu(m, activation, dtype):
    """The split-K kernel at every row count it takes (one or two n-tiles, tail rows), each epilogue, with
    and without bias and residual, each output poisoned."""
    for i, (k, n_out) in enumerate(SPLIT_K_SHAPES):
        n = 2 * n_out if activation == "swiglu" else n_out
        extras = i % 2 == m % 2
        run_and_check(case_of(m=m, k=k, n=n, dtype=dtype, activation=activation, bias=extras, residual=not extras,
                              lead="3d" if i == 0 else "2d", seed=m * 100 + i), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [MAX_GEMV_ROWS + 1, 20, 25, 32, 33, 47, MAX_MMA_ROWS, MAX_MMA_ROWS + 1])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wide_rows_gpu(m, activation, dtype):
    """17-32 rows of float16 / bfloat16 x: the tensor-core kernels' wide build (four n-tiles; the last one
    partly rows past m), the whole-K kernel's shapes (a partial last chunk of 32 and a partial last tile, GPT-2's
    c_attn, Llama's 4096 x 4096, 625 blocks of many waves) and the split-K kernel's (SPLIT_K_SHAPES' first four:
    a cluster of up to 8 blocks, a partial last tile, a short last split); 33 rows, the same shapes on cuBLAS.
    Bias and residual as test_tensor_core_path_gpu pairs them; each output poisoned."""
    swiglu = activation == "swiglu"
    shapes = ((776, 2305), (768, 2304), (4096, 4096), (744, 10000)) + tuple(SPLIT_K_SHAPES[:4])
    for i, (k, n_out) in enumerate(shapes):
        combos = ((False, False), (True, True)) if (i + m) % 2 == 0 else ((True, False), (False, True))
        for bias, residual in combos:
            run_and_check(case_of(m=m, k=k, n=2 * n_out if swiglu else n_out, dtype=dtype, activation=activation,
                                  bias=bias, residual=residual, lead="3d" if i == 4 else "2d", seed=m + k), "cuda")


def _kernels_run(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,kernel", [(16, 3072, 768, "linear_splitk_kernel"),
                                          (5, 768, 768, "linear_splitk_kernel"),
                                          (16, 4096, 4096, "linear_mma_kernel"),
                                          (2, 3072, 768, "linear_splitk_kernel"),
                                          (2, 768, 2304, "linear_mma_kernel"),
                                          (1, 3072, 768, "linear_gemv_kernel"),
                                          (1, 768, 2304, "linear_mma_kernel"),
                                          (1, 11008, 4096, "linear_gemv_kernel"),
                                          (17, 3072, 768, "linear_splitk_kernel"),
                                          (MAX_MMA_ROWS, 768, 768, "linear_splitk_kernel"),
                                          (24, 768, 3072, "linear_mma_kernel"),
                                          (MAX_MMA_ROWS, 4096, 4096, "linear_mma_kernel"),
                                          (MAX_MMA_ROWS + 1, 768, 3072, "cuBLAS"),
                                          (24, 11008, 4096, "cuBLAS")])
def test_kernel_choice_gpu(m, k, n, kernel):
    """linear.cpp's dispatch at GPT-2 / Llama decode shapes, read from the kernel names torch.profiler
    records: 2-16 rows over fewer 16-row tiles than SMs take the split-K kernel (sm_90), one tile per SM
    or more the tensor-core kernel; one row the CUDA-core kernel, except the tensor-core kernel's class
    (a tile per SM) at K <= 4096 (linear.cpp's kMmaOneRowMaxK); 17-32 rows the same two kernels' wide build
    (sm_90), except K > 4096 on the tensor-core kernel's class (gemv_wins); more rows none of ours."""
    props = torch.cuda.get_device_properties(0)
    if (kernel == "linear_splitk_kernel" or m > MAX_GEMV_ROWS) and props.major < 9:
        pytest.skip("the split-K kernel and the wide build need sm_90")
    if kernel == "linear_mma_kernel" and n // 16 < props.multi_processor_count:
        pytest.skip(f"{n} output columns give fewer 16-row tiles than this GPU's SMs")
    x, w, b, r = make_inputs(case_of(m=m, k=k, n=n, activation="gelu_tanh"), "cuda")
    linear(x, w, b, activation="gelu_tanh", residual=r)  # loads the library outside the profile
    names = _kernels_run(lambda: linear(x, w, b, activation="gelu_tanh", residual=r))
    ours = [name for name in names if any(k in name for k in ("linear_mma_kernel", "linear_splitk_kernel",
                                                              "linear_gemv_kernel"))]
    if kernel == "cuBLAS":
        assert not ours and names, names
    else:
        assert any(kernel in name for name in ours), names


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gradcheck_float64_cpu(activation, with_bias, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    n_out = 3 if activation == "swiglu" else 6
    r = torch.randn(2, 3, n_out, generator=gen, dtype=torch.float64, requires_grad=True) if with_residual else None
    inputs = tuple(t for t in (x, w, b, r) if t is not None)

    def f(*ts):
        it = iter(ts)
        xx, ww = next(it), next(it)
        bb = next(it) if with_bias else None
        rr = next(it) if with_residual else None
        return linear(xx, ww, bb, activation=activation, residual=rr)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gradients_match_float64_autograd(device):
    """Gradients in float32 on the device against float64 autograd through the reference."""
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((3, 16), (10, 16), (10,), (3, 5))]
    x, w, b, r = (t.float().to(device).requires_grad_() for t in ts)
    y = linear(x, w, b, activation="swiglu", residual=r)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g.float().to(device))
    leaves = [t.clone().requires_grad_() for t in ts]
    reference.linear(*leaves[:3], activation="swiglu", residual=leaves[3]).backward(g)
    for got, want in zip((x, w, b, r), leaves):
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- CUDA graphs, compile, opcheck


def captured(fn):
    """(graph, output) of fn captured in a CUDA graph after a warm-up on a side stream (which loads the
    library), as torch.cuda.graphs asks."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.gpu
def test_cuda_graph_replays():
    gen = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(s, generator=gen).half().cuda() for s in ((4, 768), (2304, 768), (2304,), (4, 2304)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (loads the library) on a side stream, as torch.cuda.graphs asks
        linear(x, w, b, activation="gelu_tanh", residual=r)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w, b, activation="gelu_tanh", residual=r)
    for i in range(2):
        x.copy_(torch.randn(x.shape, generator=gen).half())
        g.replay()
        torch.cuda.synchronize()
        want = linear(x, w, b, activation="gelu_tanh", residual=r)
        assert torch.equal(y, want), f"replay {i}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def block(x, w, b, r):
        return linear(x, w, b, activation="gelu_tanh", residual=r) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(s, generator=gen).to(device) for s in ((2, 3, 32), (48, 32), (48,), (2, 3, 48)))
    torch.testing.assert_close(compiled(x, w, b, r), block(x, w, b, r))


def opcheck_inputs(device):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    return [
        ((randn(1, 64), randn(96, 64), randn(96), randn(1, 96)), dict(activation=1)),
        ((randn(2, 3, 40, dtype=torch.float32), randn(16, 40, dtype=torch.float32), None, None), dict(activation=2)),
        ((randn(20, 24, dtype=torch.bfloat16), randn(8, 24, dtype=torch.bfloat16), None,
          randn(20, 8, dtype=torch.bfloat16)), dict(activation=0)),
        ((randn(7, dtype=torch.float32), randn(5, 7, dtype=torch.float32)), {}),
        # norm=: norm_weight / norm_bias are the 5th and 6th positional arguments
        ((randn(1, 64), randn(96, 64), randn(96), randn(1, 96), randn(64), randn(64, dtype=torch.float32)),
         dict(activation=1, norm=1, eps=1e-5)),
        ((randn(2, 3, 40, dtype=torch.float32), randn(16, 40, dtype=torch.float32), None, None,
          randn(40, dtype=torch.float32), None), dict(activation=2, norm=2, eps=1e-6)),
        ((randn(20, 72, dtype=torch.bfloat16), randn(8, 72, dtype=torch.bfloat16), None, None, None, None),
         dict(norm=1)),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    for args, kwargs in opcheck_inputs(device):
        torch.library.opcheck(torch.ops.fused_attn.linear.default, args, kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_autograd(device):
    for args, kwargs in opcheck_inputs(device):
        args = tuple(None if t is None else t.float().requires_grad_() for t in args)
        torch.library.opcheck(torch.ops.fused_attn.linear.default, args, kwargs,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_meta_tensors_give_shapes():
    x = torch.empty(2, 5, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(100, 64, device="meta", dtype=torch.bfloat16)
    assert linear(x, w).shape == (2, 5, 100)
    assert linear(x, w, activation="swiglu").shape == (2, 5, 50)


# --------------------------------------------------------------------------- argument errors


def _good(device="cpu"):
    return dict(x=torch.randn(3, 8, device=device), weight=torch.randn(6, 8, device=device),
                bias=torch.randn(6, device=device), residual=torch.randn(3, 6, device=device), activation=None)


BAD = [
    ("x", dict(x="not a tensor"), TypeError, "x must be a torch.Tensor, got str"),
    ("x int", dict(x=torch.ones(3, 8, dtype=torch.int32)), ValueError,
     r"x must have dtype float32, float16, bfloat16 or float64 \(CPU\), got torch.int32"),
    ("x 0-d", dict(x=torch.tensor(1.0)), ValueError, r"x must have at least 1 dim \[..., in_features\], got \(\)"),
    ("weight 1-d", dict(weight=torch.randn(8)), ValueError,
     r"weight must have 2 dims \[out_features, in_features\], got \(8,\)"),
    ("weight dtype", dict(weight=torch.randn(6, 8, dtype=torch.float64)), ValueError,
     r"weight must have x's dtype \(torch.float32\), got torch.float64"),
    ("shape mismatch", dict(weight=torch.randn(6, 9)), ValueError,
     r"weight must have in_features = x's last dim \(8\), got \(6, 9\)"),
    ("bias shape", dict(bias=torch.randn(5)), ValueError, r"bias must have shape \(6,\), got \(5,\)"),
    ("bias dtype", dict(bias=torch.randn(6).half()), ValueError,
     r"bias must have x's dtype \(torch.float32\), got torch.float16"),
    ("residual shape", dict(residual=torch.randn(3, 5)), ValueError, r"residual must have shape \(3, 6\), got \(3, 5\)"),
    ("activation", dict(activation="relu"), ValueError, r"activation must be None, 'gelu_tanh' or 'swiglu', got 'relu'"),
    ("swiglu odd", dict(weight=torch.randn(5, 8), bias=None, residual=None, activation="swiglu"), ValueError,
     r"weight must have an even out_features \(gate rows over up rows\) for swiglu, got \(5, 8\)"),
    ("residual width swiglu", dict(activation="swiglu"), ValueError,
     r"residual must have shape \(3, 3\), got \(3, 6\)"),
]


@pytest.mark.parametrize("name,changes,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(name, changes, exc, match):
    args = {**_good(), **changes}
    with pytest.raises(exc, match=match):
        linear(args["x"], args["weight"], args["bias"], activation=args["activation"], residual=args["residual"])


def test_device_mismatch_raises():
    args = _good()
    with pytest.raises(ValueError, match=r"weight must be on the same device as x \(cpu\), got meta"):
        linear(args["x"], args["weight"].to("meta"))
    with pytest.raises(ValueError, match=r"bias must be on the same device as x \(cpu\), got meta"):
        linear(args["x"], args["weight"], args["bias"].to("meta"))


@pytest.mark.gpu
def test_bad_inputs_through_the_op_gpu():
    """The C++ launcher's own checks, for callers of torch.ops.fused_attn.linear who bypass the wrapper."""
    import fused_attn

    fused_attn.load()
    op = torch.ops.fused_attn.linear
    x, w = torch.randn(3, 8, device="cuda"), torch.randn(6, 8, device="cuda")
    with pytest.raises(ValueError, match=r"weight must have in_features = x's last dim \(8\), got \(6, 9\)"):
        op(x, torch.randn(6, 9, device="cuda"))
    with pytest.raises(ValueError, match=r"weight must be on the same device as x \(cuda:0\), got cpu"):
        op(x, w.cpu())
    with pytest.raises(ValueError, match=r"weight must have x's dtype \(torch.float32\), got torch.float16"):
        op(x, w.half())
    with pytest.raises(ValueError, match=r"activation must be 0 \(none\), 1 \(gelu_tanh\) or 2 \(swiglu\), got 3"):
        op(x, w, activation=3)
    with pytest.raises(ValueError, match=r"weight must have a contiguous last dim \(stride 1\)"):
        op(x, torch.randn(8, 6, device="cuda").t())


# --------------------------------------------------------------------------- pre-normalization (norm=)

NORMS = ["layer_norm", "rms_norm"]
# Rows of x: "normal" (randn x scale), "offset" (1e4 plus a spread of a few units of the dtype's
# precision at 1e4: the mean's cancellation), "constant" (all-equal rows: zero variance).
MAGNITUDES = ["normal", "offset", "constant"]


@st.composite
def norm_case(draw, budget, cuda):
    case = draw(linear_case(budget, cuda))
    if case["k"] == 0:
        case["k"] = draw(st.sampled_from([1, 7, 768]))
        if case["m"] * case["k"] * case["n"] > 4 * budget:
            case["m"] = 1
    norm = draw(st.sampled_from(NORMS))
    return {**case, "norm": norm, "norm_weight": draw(st.booleans()),
            "norm_bias": norm == "layer_norm" and draw(st.booleans()),
            "affine_fp32": draw(st.booleans()), "affine_misaligned": draw(st.booleans()),
            "magnitude": draw(st.sampled_from(MAGNITUDES)),
            "eps": draw(st.sampled_from([1e-5, 1e-6, 0.1]))}


def norm_case_of(**kw):
    base = dict(norm="layer_norm", norm_weight=True, norm_bias=True, affine_fp32=False, magnitude="normal", eps=1e-5,
                affine_misaligned=False)
    return case_of(**{**base, **kw})


def make_norm_inputs(case, device):
    x, w, b, r = make_inputs(case, device)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    k, dtype = case["k"], case["dtype"]
    if case["magnitude"] != "normal":
        spread = 0.0 if case["magnitude"] == "constant" else 1e4 * 4 * torch.finfo(dtype).eps
        rows = 1e4 + spread * torch.randn((*x.shape[:-1], k), generator=gen, dtype=torch.float64)
        x = _place(rows.to(dtype).to(device), case["layout"], gen)
    adt = torch.float32 if case["affine_fp32"] else dtype

    def affine(mean):
        a = (mean + 0.5 * torch.randn(k, generator=gen, dtype=torch.float64)).to(adt).to(device)
        if case.get("affine_misaligned"):  # one element into a buffer: not 16-byte aligned (read, not staged)
            a = torch.cat([a[:1], a])[1:]
        return a

    nw = affine(1.0) if case["norm_weight"] else None
    nb = affine(0.0) if case["norm_bias"] else None
    return x, w, b, r, nw, nb


def run_and_check_norm(case, device):
    x, w, b, r, nw, nb = make_norm_inputs(case, device)
    rms, act, eps = case["norm"] == "rms_norm", case["activation"], case["eps"]
    n_out = case["n"] // 2 if act == "swiglu" else case["n"]
    poison_allocator(x[..., :1].numel() * n_out * x.element_size(), device)
    got = linear(x, w, b, activation=act, residual=r, norm=case["norm"], norm_weight=nw, norm_bias=nb, eps=eps)
    assert got.shape == (*x.shape[:-1], n_out) and got.dtype == x.dtype and got.device == x.device
    # The float64 composition (the normalized rows not rounded), and PyTorch's at x's dtype: the norm
    # in float32 rounded to x's dtype (F.layer_norm's arithmetic), then the eager chain.
    xn64 = reference.layer_norm(x.double(), nw, nb, eps, rms=rms, compute_dtype=torch.float64)
    want = reference._linear_compute(xn64, w, b, act, r, torch.float64)
    if x.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * max(1.0, want.abs().max().item()))
        return
    xn = reference.layer_norm(x, nw, nb, eps, rms=rms, compute_dtype=torch.float32)
    assert_linear_close(got, reference.eager_linear(xn, w, b, act, r), want, f"linear norm {case}", k=x.shape[-1])


NORM_EXAMPLES = [
    norm_case_of(),
    norm_case_of(norm="rms_norm", norm_bias=False, activation="gelu_tanh"),
    norm_case_of(k=768, n=2304, m=1, dtype=torch.bfloat16),  # GPT-2's ln_1 + c_attn at B1
    norm_case_of(k=768, n=3072, m=4, dtype=torch.float16, activation="gelu_tanh", residual=False),  # ln_2 + c_fc
    norm_case_of(k=768, n=2304, m=16, dtype=torch.float16, affine_fp32=True),  # tensor-core kernel (N >= 2112)
    norm_case_of(k=768, n=96, m=16, dtype=torch.float32, magnitude="offset"),  # fp32: 16 x 768 x 4 = 48 KB of rows
    norm_case_of(k=2048, n=64, m=16, dtype=torch.float32),  # 128 KB of rows: normalized in a launch of its own
    norm_case_of(k=7, n=5, m=3, dtype=torch.bfloat16, magnitude="constant"),  # element-wise path, zero variance
    norm_case_of(k=33, n=9, m=5, dtype=torch.float16, layout="strided", norm="rms_norm", norm_bias=False),
    norm_case_of(k=1000, n=6, m=16, dtype=torch.float32, activation="swiglu", layout="misaligned"),
    # 17-32 rows: the norm's own launch, then the split-K kernel's wide build (a width layer_norm's kernel does not
    # take: the ATen composition); more rows cuBLAS.
    norm_case_of(k=64, n=10, m=17, dtype=torch.bfloat16, activation="swiglu", magnitude="offset"),
    norm_case_of(k=40, n=10, m=20, dtype=torch.float16),
    norm_case_of(k=64, n=10, m=40, dtype=torch.bfloat16, activation="swiglu", magnitude="offset"),
    norm_case_of(k=40, n=10, m=33, dtype=torch.float16),
    norm_case_of(k=256, n=64, m=2, dtype=torch.float16, magnitude="constant", norm_weight=False, norm_bias=False),
    norm_case_of(k=256, n=64, m=8, dtype=torch.bfloat16, magnitude="constant", norm="rms_norm", norm_bias=False),
    # The prologue's weight and bias: staged in shared memory before the wait where aligned, else read
    # from global memory after the statistics (both paths, both kernels; a bias without a weight).
    norm_case_of(k=768, n=2304, m=1, dtype=torch.float16, affine_misaligned=True),
    norm_case_of(k=768, n=2304, m=16, dtype=torch.bfloat16, affine_misaligned=True),
    norm_case_of(k=768, n=2304, m=16, dtype=torch.float16, norm_weight=False, affine_fp32=True),
    norm_case_of(k=768, n=3072, m=1, dtype=torch.bfloat16, norm_weight=False),
    # One row into more than kOneRowNormMaxCols (16384) columns: the norm's own launch first, then the kernel.
    norm_case_of(k=768, n=16392, m=1, dtype=torch.float16),
    norm_case_of(k=64, n=16385, m=1, dtype=torch.bfloat16, activation="gelu_tanh", norm="rms_norm",
                 norm_bias=False, affine_misaligned=True),
]


@pytest.mark.gpu
@given(case=norm_case(GPU_BUDGET, cuda=True))
@with_examples(NORM_EXAMPLES + [norm_case_of(k=4096, n=1024, m=m, dtype=torch.bfloat16, activation="gelu_tanh")
                                for m in (1, 3, 9, 17)])
def test_norm_matches_reference_gpu(case):
    run_and_check_norm(case, "cuda")


@given(case=norm_case(CPU_BUDGET, cuda=False))
@with_examples([c for c in NORM_EXAMPLES if c["m"] * c["k"] * c["n"] <= 1 << 16]
               + [norm_case_of(k=13, n=6, m=3, dtype=torch.float64, activation="swiglu")])
def test_norm_matches_reference_cpu(case):
    run_and_check_norm(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 9, 16, 17, MAX_MMA_ROWS, MAX_MMA_ROWS + 1])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rows_match_layer_norm_gpu(m, norm, dtype):
    """The normalized rows the kernels multiply are layer_norm's / rms_norm's: with the weight's first K
    rows the identity, the first K output columns are those rows themselves (float32 sums of one exact
    product). The float32 statistics are the same formulas summed in another order, so an element may
    differ by one rounding of x's dtype, or (near 0, where that rounding is finer) by the statistics'
    float32 error (tolerances.NORM_ULPS); in float16 / bfloat16, 99% of them are bit for bit equal.
    N = 2304: the tensor-core kernel from 2 rows in float16 / bfloat16 (17-32 rows its wide build); from 17 rows
    layer_norm's kernel first, and from 33 cuBLAS."""
    from fused_attn.layer_norm import layer_norm, rms_norm

    gen = torch.Generator().manual_seed(m)
    k, n = 768, 2304
    x = (3 + torch.randn(m, k, generator=gen)).to(dtype).cuda()
    w = torch.cat([torch.eye(k), torch.randn(n - k, k, generator=gen) / math.sqrt(k)]).to(dtype).cuda()
    nw = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype).cuda()
    nb = (0.5 * torch.randn(k, generator=gen)).to(dtype).cuda() if norm == "layer_norm" else None
    got = linear(x, w, norm=norm, norm_weight=nw, norm_bias=nb)
    xn = layer_norm(x, nw, nb) if norm == "layer_norm" else rms_norm(x, nw, eps=1e-5)
    xhat = reference.layer_norm(x.double(), None, None, 1e-5, rms=norm == "rms_norm").abs().amax(-1, keepdim=True)
    diff = (got[:, :k].double() - xn.double()).abs()
    allowed = torch.finfo(dtype).eps * xn.double().abs() + NORM_ULPS * xhat * nw.double().abs()
    assert bool((diff <= allowed).all()), f"{int((diff > allowed).sum())} elements apart by more, max {diff.max()}"
    if dtype != torch.float32:  # float32 rows differ in the last bit wherever the statistics do
        assert (diff == 0).double().mean().item() >= 0.99
        assert (got[:, k:] == linear(xn, w)[:, k:]).double().mean().item() >= 0.95


# One row of float16 / bfloat16 x with a norm but no norm weight and bias: the GEMV folds the norm into its
# dot products (csrc/linear/linear_kernel.cuh, kFold). Rows: random, a large offset (1e4 + N(0, 1): the
# shift by the first element keeps the sums exact enough), constant (zero variance), an outlier first
# element (the worst case of that shift), one huge value elsewhere.
FOLD_ROWS = ["randn", "offset", "constant", "outlier_first", "outlier_last"]


def fold_row(kind: str, k: int, gen) -> torch.Tensor:
    x = torch.randn(k, generator=gen, dtype=torch.float64)
    if kind == "offset":
        x = 1e4 + x
    elif kind == "constant":
        x = torch.full((k,), 3.25, dtype=torch.float64)
    elif kind == "outlier_first":
        x[0] = 300.0
    elif kind == "outlier_last":
        x[-1] = -300.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FOLD_ROWS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,n,act", [(768, 2304, None), (1001, 96, "gelu_tanh"), (64, 4000, None),
                                     (4096, 512, None), (768, 40, "swiglu"), (64, 16392, None)])
def test_norm_fold_one_row_gpu(k, n, act, dtype, norm, kind):
    """linear(x [1, k], norm=..., no norm weight or bias), the fold, against float64 (the norm, the matmul,
    bias, activation and residual all in float64): no further off than the two launches (our layer_norm,
    then linear), or than one rounding of the output, whichever is larger."""
    gen = torch.Generator().manual_seed(k + n)
    x = fold_row(kind, k, gen).view(1, k).to(dtype)
    check_weightless_norm(*weightless_norm_inputs(x, n, act, norm, gen), act, norm)


def weightless_norm_inputs(x: torch.Tensor, n: int, act, norm: str, gen):
    """x [m, k] (T, CPU) with W [n, k], a bias and a residual drawn from gen, on the GPU, and the float64
    reference of linear(norm(x)) (no norm weight or bias) with them."""
    m, k = x.shape
    dtype = x.dtype
    w = (torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)  # SwiGLU: gate and up rows' biases
    r = torch.randn(m, n // 2 if act == "swiglu" else n, generator=gen, dtype=torch.float64).to(dtype)
    xd = reference.layer_norm(x.double(), None, None, 1e-5, rms=norm == "rms_norm")
    want = reference._linear_compute(xd, w.double(), b.double(), act, r.double(), torch.float64)
    return *(t.cuda() for t in (x, w, b, r)), want


def check_weightless_norm(xc, wc, bc, rc, want, act, norm) -> None:
    """linear(norm=..., no norm weight or bias) against the float64 want, row by row (each row's own
    scale): no further off than our layer_norm then linear, or than one rounding of the output."""
    from fused_attn.layer_norm import layer_norm, rms_norm

    got = linear(xc, wc, bc, activation=act, residual=rc, norm=norm).double().cpu()
    xn = (layer_norm(xc) if norm == "layer_norm" else rms_norm(xc)).contiguous()
    two = linear(xn, wc, bc, activation=act, residual=rc).double().cpu()
    assert not got.isnan().any(), "NaN in the output"
    for i in range(got.shape[0]):
        err, err_two = (got[i] - want[i]).abs().max().item(), (two[i] - want[i]).abs().max().item()
        one_rounding = torch.finfo(xc.dtype).eps * want[i].abs().max().item()
        assert err <= max(err_two, one_rounding), f"row {i}: {err:.3g}, two launches {err_two:.3g}"


def fold_rows(m: int, k: int, dtype, gen) -> torch.Tensor:
    """m rows of FOLD_ROWS' kinds in turn; in float16 from 6 rows on the last one spans float16's range
    (x[0] = 6e4, the rest near -6e4: x - x[0] is beyond float16)."""
    x = torch.stack([fold_row(FOLD_ROWS[i % len(FOLD_ROWS)], k, gen) for i in range(m)])
    if dtype == torch.float16 and m > len(FOLD_ROWS):
        x[-1] = -6e4 + 10 * torch.randn(k, generator=gen, dtype=torch.float64)
        x[-1, 0] = 6e4
    return x.to(dtype)


def fold_rows_inputs(k, n, act, dtype, norm, m):
    """x (fold_rows), W, bias, residual on the GPU and the float64 reference of the weightless norm + linear."""
    n_out = n // 2 if act == "swiglu" else n
    gen = torch.Generator().manual_seed(k + n + m)
    x = fold_rows(m, k, dtype, gen)
    w = (torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    r = torch.randn(m, n_out, generator=gen, dtype=torch.float64).to(dtype)
    xd = reference.layer_norm(x.double(), None, None, 1e-5, rms=norm == "rms_norm")
    want = reference._linear_compute(xd, w.double(), b.double(), act, r.double(), torch.float64)
    return *(t.cuda() for t in (x, w, b, r)), want


def plain_rows(m: int, k: int, dtype, gen) -> torch.Tensor:
    """m rows whose means sit within a few standard deviations of 0 (the self-normalizing kernel's fast
    path: kSelfNormMaxMean = 8): N(0, 1) plus offsets up to 7.5, an outlier first or last element."""
    kinds = ["randn", "outlier_first", "outlier_last"]
    offsets = [0.0, 7.5, -3.0, 1.0, -7.5]
    return torch.stack([fold_row(kinds[i % 3], k, gen) + offsets[i % 5] for i in range(m)]).to(dtype)


def self_norm_expected(m: int, k: int, n_out: int, act) -> bool:
    """Whether linear(norm=..., no norm weight or bias) at m 16-bit rows normalizes inside the tensor-core
    kernel (csrc/linear/linear.cpp, self_norm_in_mma): 2-8 rows, its short build (k <= 768) in one wave
    (16-column tiles between the SM count and three per SM; 8 with SwiGLU)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cols = 8 if act == "swiglu" else 16
    tiles = (n_out + cols - 1) // cols
    return 2 <= m <= 8 and k % 8 == 0 and k <= 768 and sms <= tiles <= 3 * sms


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["mixed", "plain"])
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,n,act", [(768, 2304, None), (768, 3072, "gelu_tanh"), (4096, 2200, None),
                                     (1000, 4400, "swiglu"), (512, 4000, "swiglu"), (200, 2200, None)])
def test_weightless_norm_rows_gpu(k, n, act, dtype, norm, m, rows):
    """linear(x [m, k], norm=..., no norm weight or bias: weights folded at load time, as GPT-2's
    graph-fused step passes them) at 2-16 rows where the tensor-core kernel runs (one 16-row tile per SM
    or more), against float64 (check_weightless_norm). Rows "mixed": every FOLD_ROWS kind (an offset row
    of 1e4 + N(0, 1) and a constant row send the self-normalizing kernel's block to its redo pass), in
    float16 one spanning float16's range; "plain": means within 7.5 standard deviations (its fast path).
    The path: the tensor-core kernel normalizing x itself where self_norm_expected says so (one launch),
    else our layer_norm launch, then the tensor-core kernel."""
    n_out = n // 2 if act == "swiglu" else n
    if (n_out + (7 if act == "swiglu" else 15)) // (8 if act == "swiglu" else 16) < \
            torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip(f"{n_out} output columns give fewer tensor-core tiles than this GPU's SMs")
    gen = torch.Generator().manual_seed(k + n + m)
    x = fold_rows(m, k, dtype, gen) if rows == "mixed" else plain_rows(m, k, dtype, gen)
    xc, wc, bc, rc, want = weightless_norm_inputs(x, n, act, norm, gen)
    names = _kernels_run(lambda: linear(xc, wc, bc, activation=act, residual=rc, norm=norm))
    if self_norm_expected(m, k, n_out, act):
        assert len(names) == 1 and "linear_mma_kernel" in names[0], names
    else:
        assert any("linear_mma_kernel" in nm for nm in names) and any("layer_norm" in nm for nm in names), names
    check_weightless_norm(xc, wc, bc, rc, want, act, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 768, 1000, 2048, 4096])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_norm_smem_budget_gpu(k, m):
    """Normalized rows of more than 64 KB (float32, 16 x 2048 and up) fall back to layer_norm's kernel
    and the plain kernels: the same result as those two launches, bit for bit."""
    from fused_attn.layer_norm import layer_norm

    gen = torch.Generator().manual_seed(k + m)
    x, w = torch.randn(m, k, generator=gen).cuda(), (torch.randn(512, k, generator=gen) / math.sqrt(k)).cuda()
    got = linear(x, w, norm="layer_norm")
    want = linear(layer_norm(x), w)
    if m * k * 4 > 64 * 1024:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("with_norm_weight", [False, True])
def test_norm_gradcheck_float64_cpu(norm, with_norm_weight):
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)

    x, w, b, r = t(2, 3, 5), t(6, 5), t(6), t(2, 3, 6)
    nw = t(5) if with_norm_weight else None
    nb = t(5) if norm == "layer_norm" else None
    inputs = tuple(v for v in (x, w, b, r, nw, nb) if v is not None)

    def f(*ts):
        it = iter(ts)
        xx, ww, bb, rr = next(it), next(it), next(it), next(it)
        nnw = next(it) if with_norm_weight else None
        nnb = next(it) if norm == "layer_norm" else None
        return linear(xx, ww, bb, activation="gelu_tanh", residual=rr, norm=norm, norm_weight=nnw, norm_bias=nnb,
                      eps=1e-3)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_norm_gradients_match_float64_autograd(device):
    gen = torch.Generator().manual_seed(2)
    ts = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((3, 64), (10, 64), (10,), (3, 10), (64,),
                                                                       (64,))]
    leaves = [v.float().to(device).requires_grad_() for v in ts]
    x, w, b, r, nw, nb = leaves
    y = linear(x, w, b, residual=r, norm="layer_norm", norm_weight=nw, norm_bias=nb)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g.float().to(device))
    ref = [v.clone().requires_grad_() for v in ts]
    xn = reference.layer_norm(ref[0], ref[4], ref[5], 1e-5)
    reference.linear(xn, ref[1], ref[2], residual=ref[3]).backward(g)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=1e-4, atol=1e-4)


def test_norm_meta_shapes_and_default_eps():
    x = torch.empty(2, 5, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(100, 64, device="meta", dtype=torch.bfloat16)
    nw = torch.empty(64, device="meta", dtype=torch.float32)
    assert linear(x, w, norm="rms_norm", norm_weight=nw).shape == (2, 5, 100)
    assert linear(x, w, activation="swiglu", norm="layer_norm").shape == (2, 5, 50)


@pytest.mark.gpu
def test_norm_cuda_graph_replays():
    gen = torch.Generator().manual_seed(0)
    x, w, b, nw, nb = (torch.randn(s, generator=gen).half().cuda() for s in ((1, 768), (2304, 768), (2304,), (768,),
                                                                             (768,)))
    kw = dict(norm="layer_norm", norm_weight=nw, norm_bias=nb)
    g, y = captured(lambda: linear(x, w, b, **kw))
    for i in range(2):
        x.copy_(torch.randn(x.shape, generator=gen).half())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, linear(x, w, b, **kw)), f"replay {i}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_norm_torch_compile_fullgraph(device):
    def block(x, w, b, nw, nb):
        return linear(x, w, b, activation="gelu_tanh", norm="layer_norm", norm_weight=nw, norm_bias=nb, eps=1e-6) + 1

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).to(device) for s in ((1, 1, 64), (48, 64), (48,), (64,), (64,))]
    torch.testing.assert_close(compiled(*args), block(*args))


NORM_BAD = [
    ("norm name", dict(norm="batch_norm"), ValueError,
     r"norm must be None, 'layer_norm' or 'rms_norm', got 'batch_norm'"),
    ("norm type", dict(norm=1), ValueError, r"norm must be None, 'layer_norm' or 'rms_norm', got 1"),
    ("norm_weight type", dict(norm_weight=[1.0] * 8), TypeError,
     r"norm_weight must be a torch.Tensor or None, got list"),
    ("norm_weight shape", dict(norm_weight=torch.randn(7)), ValueError,
     r"norm_weight must have shape \(in_features,\) = \(8,\), got \(7,\)"),
    ("norm_weight dtype", dict(norm_weight=torch.randn(8, dtype=torch.float64)), ValueError,
     r"norm_weight must have x's dtype \(torch.float32\) or torch.float32, got torch.float64"),
    ("norm_weight device", dict(norm_weight=torch.randn(8, device="meta")), ValueError,
     r"norm_weight must be on the same device as x \(cpu\), got meta"),
    ("norm_bias shape", dict(norm_bias=torch.randn(8, 1)), ValueError,
     r"norm_bias must have shape \(in_features,\) = \(8,\), got \(8, 1\)"),
    ("norm_bias with rms", dict(norm="rms_norm", norm_bias=torch.randn(8)), ValueError,
     r"norm_bias must be None with rms_norm, got a tensor"),
    ("norm_weight without norm", dict(norm=None, norm_weight=torch.randn(8)), ValueError,
     r"norm_weight must be None without a norm, got a tensor"),
    ("eps negative", dict(eps=-1e-5), ValueError, r"eps must be a finite number >= 0, got -1e-05"),
    ("eps nan", dict(eps=math.nan), ValueError, r"eps must be a finite number >= 0, got nan"),
    ("eps type", dict(eps="small"), TypeError, r"eps must be a finite number >= 0, got 'small'"),
]


@pytest.mark.parametrize("name,changes,exc,match", NORM_BAD, ids=[b[0] for b in NORM_BAD])
def test_norm_bad_inputs_raise(name, changes, exc, match):
    args = {**_good(), "norm": "layer_norm", "norm_weight": None, "norm_bias": None, "eps": 1e-5, **changes}
    with pytest.raises(exc, match=match):
        linear(args["x"], args["weight"], args["bias"], activation=args["activation"], residual=args["residual"],
               norm=args["norm"], norm_weight=args["norm_weight"], norm_bias=args["norm_bias"], eps=args["eps"])


def test_norm_bad_code_through_the_op_cpu():
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"norm must be 0 \(none\), 1 \(layer_norm\) or 2 \(rms_norm\), got 3"):
        torch.ops.fused_attn.linear(x, w, norm=3)


@pytest.mark.gpu
def test_norm_bad_inputs_through_the_op_gpu():
    """The C++ launcher's own checks of the norm arguments."""
    import fused_attn

    fused_attn.load()
    op = torch.ops.fused_attn.linear
    x, w = torch.randn(3, 8, device="cuda"), torch.randn(6, 8, device="cuda")
    with pytest.raises(ValueError, match=r"norm must be 0 \(none\), 1 \(layer_norm\) or 2 \(rms_norm\), got 3"):
        op(x, w, norm=3)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got -1"):
        op(x, w, norm=1, eps=-1.0)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(in_features,\) = \(8,\), got \(7,\)"):
        op(x, w, None, None, torch.randn(7, device="cuda"), norm=1)
    with pytest.raises(ValueError, match=r"norm_weight must be None without a norm, got a tensor"):
        op(x, w, None, None, torch.randn(8, device="cuda"))
    with pytest.raises(ValueError, match=r"norm_bias must be None with rms_norm, got a tensor"):
        op(x, w, None, None, None, torch.randn(8, device="cuda"), norm=2)
    with pytest.raises(ValueError, match=r"norm_bias must have x's dtype \(torch.float32\) or torch.float32, got "
                                         r"torch.float16"):
        op(x, w, None, None, None, torch.randn(8, device="cuda").half(), norm=1)
