"""gpt2_decode_step: the reference (the CPU kernel) against our GPT-2's module decode step, the CUDA
kernel against the float64 reference (logits, the cache slots written, nothing else touched), invalid
rows, CUDA graphs, back-to-back calls on one workspace, opcheck, fakes and argument errors. The spec is
the docstring of ``fused_attn.gpt2_decode_step.gpt2_decode_step``."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import fields, replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fused_attn import reference
from fused_attn.gpt2_decode_step import (GPT2StepWeights, gpt2_decode_step, is_batch_too_large, new_workspace,
                                         workspace_bytes)
from tests.prompts import HEAD64, left_padded
from tests.streams import on_side_stream_without_sync
from tests.tolerances import assert_close, assert_error_at_most_twice, fp32_tolerance

PERSISTENT = {"attention": "fused", "layer_norm": "fused", "linear": "fused", "mlp": "fused", "step": "persistent"}
POISON = math.nan  # every cache slot the step may neither read nor write
EPS = 1e-5
# (n_layer, nheads, n_inner, vocab, n_positions): a small model of odd sizes, and GPT-2 small.
SMALL_SHAPE = (2, 2, 200, 97, 64)
GPT2_SMALL_SHAPE = (12, 12, 3072, 50257, 1024)


# --------------------------------------------------------------------------- building a case


def random_weights(n_layer: int, nheads: int, n_inner: int, vocab: int, n_positions: int, dtype: torch.dtype,
                   device, seed: int) -> GPT2StepWeights:
    """Seeded weights drawn in float32 (then rounded to dtype) at scales that keep every stage of order 1:
    projections ~ 1/sqrt(fan_in), scores ~ 1, logits ~ 10; norms' weights around 1."""
    c = 64 * nheads
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return (torch.randn(shape, generator=g, device=device) * std + mean).to(dtype)

    norms = torch.stack([randn(2 * n_layer + 1, c, std=0.2, mean=1.0), randn(2 * n_layer + 1, c, std=0.2)], 1)
    return GPT2StepWeights(
        wte=randn(vocab, c, std=0.3), wpe=randn(n_positions, c, std=0.3), norms=norms,
        w_qkv=randn(n_layer, 3 * c, c, std=1.5 / math.sqrt(c)), b_qkv=randn(n_layer, 3 * c, std=0.1),
        w_o=randn(n_layer, c, c, std=1 / math.sqrt(c)), b_o=randn(n_layer, c, std=0.1),
        w_fc=randn(n_layer, n_inner, c, std=1 / math.sqrt(c)), b_fc=randn(n_layer, n_inner, std=0.1),
        w_proj=randn(n_layer, c, n_inner, std=1 / math.sqrt(n_inner)), b_proj=randn(n_layer, c, std=0.1))


def random_case(shape, batch: int, max_len: int, dtype: torch.dtype, device, seed: int, weights=None) -> dict:
    """The op's arguments: seeded lengths (some 0, some max_len - 1), left padding, tokens and positions;
    the cache holds random keys and values in each row's valid slots leftpad[b] .. seqlens[b] - 1 and NaN
    everywhere else (the step reads nothing else and writes slot seqlens[b] only)."""
    n_layer, nheads, n_inner, vocab, n_positions = shape
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, max_len, (batch,), generator=g)
    seqlens[0] = max_len - 1
    if batch > 1:
        seqlens[1] = 0
    leftpad = (torch.rand(batch, generator=g) * (seqlens + 1)).long().clamp(max=seqlens)
    pos = torch.randint(0, n_positions, (batch,), generator=g)
    token = torch.randint(0, vocab, (batch,), generator=g)
    kv = torch.randn(2, n_layer, batch, nheads, max_len, 64, generator=g).to(dtype)
    slot = torch.arange(max_len)
    valid = (slot >= leftpad[:, None]) & (slot < seqlens[:, None])  # [batch, max_len]
    kv = kv.masked_fill(~valid[None, None, :, None, :, None], POISON)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(token=token.to(device), pos=pos.to(**i32), seqlens=seqlens.to(**i32), leftpad=leftpad.to(**i32),
                k_cache=kv[0].to(device), v_cache=kv[1].to(device),
                weights=weights if weights is not None else random_weights(*shape, dtype, device, seed),
                workspace=new_workspace(batch, 64 * nheads, n_inner, dtype, device))


def run_op(case: dict) -> torch.Tensor:
    return gpt2_decode_step(case["token"], case["pos"], case["seqlens"], case["leftpad"], case["k_cache"],
                            case["v_cache"], case["weights"], case["workspace"], eps=EPS)


def run_reference(case: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, k_cache, v_cache after the step) of ``fused_attn.reference.gpt2_decode_step`` on copies of
    the case's tensors converted to ``dtype`` (float64: the definition; the case's dtype: PyTorch's own
    rounding, the peer)."""
    dtype = dtype or case["k_cache"].dtype
    k, v = case["k_cache"].to(dtype, copy=True), case["v_cache"].to(dtype, copy=True)
    w = [t.to(dtype) for t in case["weights"].tensors()]
    logits = reference.gpt2_decode_step(case["token"], case["pos"], case["seqlens"], case["leftpad"], k, v, *w, EPS)
    return logits, k, v


def written_slots(cache: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """``[n_layer, batch, nheads, headdim]``: each row's slot seqlens[b] of every layer."""
    n_layer, batch, nheads, _, headdim = cache.shape
    index = seqlens.long().view(1, batch, 1, 1, 1).expand(n_layer, batch, nheads, 1, headdim)
    return cache.gather(3, index).squeeze(3)


def slot_mask(cache: torch.Tensor, seqlens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bool in the cache's shape: True at slot seqlens[b] of the rows in ``rows`` (bool [batch])."""
    slot = torch.arange(cache.shape[3], device=cache.device)
    hit = (slot == seqlens.long()[:, None]) & rows[:, None]  # [batch, max_len]
    return hit[None, :, None, :, None].expand(cache.shape)


def assert_untouched(after: torch.Tensor, before: torch.Tensor, what: str, keep: torch.Tensor | None = None) -> None:
    """Every element (where ``keep``) bit for bit what it was (NaN included)."""
    a, b = (after, before) if keep is None else (after[keep], before[keep])
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements changed that the step must not write"


def assert_matches_float64(ours: torch.Tensor, case: dict, want, peer, what: str) -> None:
    """float32: the fp32 tolerance (summation order only); 16-bit: at most twice the error of PyTorch at the
    same dtype (the reference in the case's dtype), in relative L2 and in max |err|, plus 1e-3 of the scale."""
    if ours.dtype == torch.float32:
        assert_close(ours, want, fp32_tolerance(want), what)
        return
    assert bool(torch.isfinite(ours).all()), f"{what}: non-finite values where the reference is finite"
    assert_error_at_most_twice(ours, peer, want, 1e-3, what + " (relative L2)")
    assert_error_at_most_twice(ours, peer, want, 1e-3 * want.abs().max().item(), what + " (max |err|)",
                               norm="max_abs")


def check_step(case: dict, what: str) -> None:
    """One call on the case against the float64 reference: the logits, the slots written, every other
    cache element untouched."""
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
    want, wk, wv = run_reference(case, torch.float64)
    peer, pk, pv = run_reference(case)
    rows = reference.gpt2_step_rows_valid(case["token"], case["pos"], case["seqlens"], case["leftpad"],
                                          case["weights"].wte.shape[0], case["weights"].wpe.shape[0],
                                          k0.shape[3]).to(k0.device)
    ours = run_op(case)
    assert ours.shape == want.shape and ours.dtype == k0.dtype
    assert bool(torch.isnan(ours[~rows]).all()), f"{what}: invalid rows must get NaN logits"
    assert_matches_float64(ours[rows], case, want[rows], peer[rows], what + " logits")
    for name, after, before, w, p in (("k_cache", case["k_cache"], k0, wk, pk),
                                      ("v_cache", case["v_cache"], v0, wv, pv)):
        keep = ~slot_mask(after, case["seqlens"], rows)
        assert_untouched(after, before, f"{what} {name}", keep)
        s = case["seqlens"]
        assert_matches_float64(written_slots(after, s)[:, rows], case, written_slots(w, s)[:, rows],
                               written_slots(p, s)[:, rows], f"{what} {name} slots written")


# --------------------------------------------------------------------------- the reference vs our GPT-2


def hf_model(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**HEAD64)).eval()


@functools.lru_cache(maxsize=None)
def models(dtype: torch.dtype):
    """(the default GPT-2: every module in PyTorch, the persistent-step GPT-2) of one tiny random model."""
    from fused_attn.gpt2 import GPT2

    hf = hf_model()
    return GPT2.from_hf(hf, dtype=dtype), GPT2.from_hf(hf, dtype=dtype, backends=PERSISTENT)


@given(batch=st.integers(1, 5), longest=st.integers(1, 12), pad=st.integers(0, 11),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31 - 1))
@example(batch=1, longest=1, pad=0, dtype=torch.float32, seed=0)
@example(batch=5, longest=12, pad=11, dtype=torch.float64, seed=1)
def test_reference_matches_model_decode_step_cpu(batch, longest, pad, dtype, seed):
    """After a prefill of left-padded prompts, the module decode step of our GPT-2 (PyTorch's layer norm,
    addmm, GELU, decode_attention's CPU path) and the op's CPU kernel on the same cache give the same
    logits and write the same keys and values at slot seqlens[b] of every layer, nothing else."""
    modules, persistent = models(dtype)
    g = torch.Generator().manual_seed(seed)
    lengths = [longest] + [max(1, longest - int(torch.randint(0, pad + 1, (), generator=g))) for _ in range(batch - 1)]
    ids, mask = left_padded(HEAD64["vocab_size"], lengths, seed=seed % 1000)
    cache = modules.decode_cache(batch, longest + 2)
    modules.prefill(cache, ids, mask)
    state = dict(token=cache.token.clone(), pos=cache.pos.clone(), seqlens=cache.seqlens.clone(),
                 leftpad=cache.leftpad.clone(), k_cache=cache.k.clone(), v_cache=cache.v.clone())
    seen = []
    cache.set_next_token = seen.append
    try:
        modules.decode_step(cache)
    finally:
        del cache.set_next_token
    k0 = state["k_cache"].clone()
    ours = gpt2_decode_step(state["token"], state["pos"], state["seqlens"], state["leftpad"], state["k_cache"],
                            state["v_cache"], persistent.step_weights, cache.workspace, eps=modules.config.eps)
    want = seen[0]
    tol = fp32_tolerance(want) if dtype == torch.float32 else 1e-12 * (1 + want.abs())
    assert_close(ours, want, tol, "logits")
    rows = torch.ones(batch, dtype=torch.bool)
    for name, got, model_cache in (("k_cache", state["k_cache"], cache.k), ("v_cache", state["v_cache"], cache.v)):
        keep = ~slot_mask(got, state["seqlens"], rows)
        assert_untouched(got, model_cache, name, keep)
        written, model_written = written_slots(got, state["seqlens"]), written_slots(model_cache, state["seqlens"])
        tol = fp32_tolerance(model_written) if dtype == torch.float32 else 1e-12 * (1 + model_written.abs())
        assert_close(written, model_written, tol, name + " slots written")
    assert not torch.equal(k0, state["k_cache"])


# --------------------------------------------------------------------------- invalid rows

# (argument, value given to row 1 of a batch of 3, from its case): each makes that row invalid.
INVALID = [
    ("seqlens", lambda c: c["k_cache"].shape[3]), ("seqlens", lambda c: -1),
    ("leftpad", lambda c: int(c["seqlens"][1]) + 1), ("leftpad", lambda c: -1),
    ("pos", lambda c: c["weights"].wpe.shape[0]), ("pos", lambda c: -1),
    ("token", lambda c: c["weights"].wte.shape[0]), ("token", lambda c: -1),
]
INVALID_IDS = ["seqlens_max_len", "seqlens_negative", "leftpad_above_seqlens", "leftpad_negative",
               "pos_n_positions", "pos_negative", "token_vocab", "token_negative"]


def check_invalid_row(device, dtype, which, value) -> None:
    """Row 1 invalid: its logits all NaN and its cache untouched; rows 0 and 2 as in the call where every
    row is valid (the same logits and slots written)."""
    case = random_case(SMALL_SHAPE, 3, 24, dtype, device, seed=4)
    case["seqlens"][1] = 5  # room for a leftpad above it
    case["leftpad"][1] = 2
    for cache in (case["k_cache"], case["v_cache"]):  # row 1's valid slots now 2 .. 4
        cache[:, 1, :, 2:5] = torch.randn(cache[:, 1, :, 2:5].shape, generator=torch.Generator().manual_seed(1)).to(
            cache.device, dtype)
    good = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    case[which][1] = value(case)
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
    want = run_op(good)
    got = run_op(case)
    assert bool(torch.isnan(got[1]).all()), f"{which}: the invalid row's logits must all be NaN"
    keep = torch.tensor([0, 2], device=device)
    tol = fp32_tolerance(want[keep]) if dtype != torch.float64 else 1e-12 * (1 + want[keep].abs())
    assert_close(got[keep], want[keep], tol, f"{which}: the valid rows")
    for name, after, before, valid_after in (("k_cache", case["k_cache"], k0, good["k_cache"]),
                                             ("v_cache", case["v_cache"], v0, good["v_cache"])):
        assert_untouched(after[:, 1], before[:, 1], f"{which} {name} row 1")
        # (on the CPU a matmul's rounding may depend on how many rows it has: rows 0 and 2 alone here)
        want_rows = valid_after[:, keep]
        tol = fp32_tolerance(want_rows) if dtype != torch.float64 else 1e-12 * (1 + want_rows.abs())
        assert_close(after[:, keep], want_rows, tol, f"{which} {name} rows 0 and 2")


@pytest.mark.parametrize("which,value", INVALID, ids=INVALID_IDS)
def test_invalid_row_gets_nan_and_writes_nothing_cpu(which, value):
    check_invalid_row("cpu", torch.float64, which, value)


@pytest.mark.gpu
@pytest.mark.parametrize("which,value", INVALID, ids=INVALID_IDS)
def test_invalid_row_gets_nan_and_writes_nothing_gpu(which, value):
    check_invalid_row("cuda", torch.float32, which, value)


def test_reference_float32_matches_float64_cpu():
    """The CPU kernel in float32 against the float64 definition (the same numbers, rounded)."""
    check_step(random_case(SMALL_SHAPE, 3, 24, torch.float32, "cpu", seed=2), "cpu float32")


# --------------------------------------------------------------------------- CUDA: against float64


def skip_unless_batch_fits(case: dict) -> None:
    """The kernel keeps the batch's activations in shared memory: a batch too large for this width and
    dtype raises (the launcher's message); that case is then not one the kernel runs."""
    try:
        run_op({**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()})
    except ValueError as e:
        if is_batch_too_large(e):
            pytest.skip(str(e))
        raise


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("shape", [SMALL_SHAPE, GPT2_SMALL_SHAPE], ids=["small", "gpt2_small"])
def test_matches_float64_reference_gpu(shape, batch, dtype, built_library):
    case = random_case(shape, batch, 80, dtype, "cuda", seed=batch)
    skip_unless_batch_fits(case)
    check_step(case, f"{shape} batch {batch} {dtype}")


@pytest.mark.gpu
@given(batch=st.integers(1, 16), max_len=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       scale=st.sampled_from([1.0, 100.0]), seed=st.integers(0, 2**31 - 1))
@example(batch=1, max_len=1, dtype=torch.float16, scale=1.0, seed=0)  # the only key is this step's own
@example(batch=16, max_len=300, dtype=torch.bfloat16, scale=100.0, seed=1)  # large residual stream in bf16
@example(batch=7, max_len=129, dtype=torch.float16, scale=100.0, seed=2)  # odd batch, a key past 128
def test_matches_float64_reference_property_gpu(batch, max_len, dtype, scale, seed):
    """Generated batches (1-16: every accumulator bucket and odd ones), cache lengths from the step's own
    key alone up to 300 slots (several key tiles per warp), left padding, every dtype, and embeddings
    scaled up 100x (a residual stream of order 30 into each LayerNorm, still inside fp16's range), at the
    small model's odd sizes (n_inner 200, vocab 97): logits and written slots against the float64
    reference, everything else in the cache untouched."""
    weights = random_weights(*SMALL_SHAPE, dtype, "cuda", seed)
    if scale != 1.0:
        weights = replace(weights, wte=weights.wte * scale, wpe=weights.wpe * scale)
    check_step(random_case(SMALL_SHAPE, batch, max_len, dtype, "cuda", seed, weights=weights),
               f"batch {batch} max_len {max_len} {dtype} scale {scale}")


@pytest.mark.gpu
def test_back_to_back_calls_reuse_the_workspace_gpu(built_library):
    """Three steps on one workspace (the grid barrier left valid by each call), each advancing the lengths
    and positions as a decode loop does: each against the float64 reference."""
    case = random_case(GPT2_SMALL_SHAPE, 3, 80, torch.float16, "cuda", seed=7)
    case["seqlens"].clamp_(max=70)
    case["pos"].clamp_(max=1000)
    for t in range(3):
        case["token"] = torch.randint(0, GPT2_SMALL_SHAPE[3], (3,), device="cuda",
                                      generator=torch.Generator(device="cuda").manual_seed(t))
        check_step(case, f"call {t}")
        case["seqlens"].add_(1)
        case["pos"].add_(1)


@pytest.mark.gpu
def test_cuda_graph_replays_gpu(built_library):
    """One captured call, replayed with new tokens and lengths / positions advanced in place between
    replays: every replay against the float64 reference."""
    case = random_case(SMALL_SHAPE, 3, 40, torch.float16, "cuda", seed=8)
    case["seqlens"].clamp_(max=30)
    case["pos"].clamp_(max=50)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (loads the library), the cache restored after
        k_keep, v_keep = case["k_cache"].clone(), case["v_cache"].clone()
        run_op(case)
        case["k_cache"].copy_(k_keep), case["v_cache"].copy_(v_keep)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = run_op(case)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in range(4):
        case["token"].copy_(torch.randint(0, SMALL_SHAPE[3], (3,), device="cuda", generator=gen))
        k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
        before = {**case, "k_cache": k0.clone(), "v_cache": v0.clone()}
        want, wk, wv = run_reference(before, torch.float64)
        peer, pk, pv = run_reference(before)
        logits.fill_(math.nan)
        graph.replay()
        assert_matches_float64(logits, case, want, peer, f"replay {t} logits")
        for name, after, w, p in (("k_cache", case["k_cache"], wk, pk), ("v_cache", case["v_cache"], wv, pv)):
            s = case["seqlens"]
            assert_matches_float64(written_slots(after, s), case, written_slots(w, s), written_slots(p, s),
                                   f"replay {t} {name}")
        case["seqlens"].add_(1)
        case["pos"].add_(1)


@pytest.mark.gpu
def test_launches_on_the_current_stream_without_sync_gpu(built_library):
    case = random_case(SMALL_SHAPE, 2, 24, torch.float16, "cuda", seed=9)
    tokens = case["token"].clone()
    case["token"].zero_()
    before = {**case, "token": tokens, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    want, _, _ = run_reference(before, torch.float64)
    peer, _, _ = run_reference(before)
    got = on_side_stream_without_sync(case["token"], tokens, lambda: run_op(case))
    assert_matches_float64(got, case, want, peer, "side stream")


# --------------------------------------------------------------------------- compile, opcheck, fakes


def op_args(case: dict) -> tuple:
    return (case["token"], case["pos"], case["seqlens"], case["leftpad"], case["k_cache"], case["v_cache"],
            *case["weights"].tensors(), case["workspace"], EPS)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device):
    """Every opcheck test (the caches mutated in place, the schema's (a!) / (b!)). The inputs do not require
    grad: with requires_grad the op raises by design (test_requires_grad_raises)."""
    for dtype, batch in ((torch.float16, 2), (torch.float32, 1)):
        if device == "cpu" and dtype == torch.float16:
            dtype = torch.float64
        case = random_case(SMALL_SHAPE, batch, 16, dtype, device, seed=batch)
        torch.library.opcheck(torch.ops.fused_attn.gpt2_decode_step.default, op_args(case))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    def step(case):
        return run_op(case) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    case = random_case(SMALL_SHAPE, 2, 16, torch.float32, device, seed=5)
    eager_case = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    got = compiled(case)
    want = step(eager_case)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert_untouched(case["k_cache"], eager_case["k_cache"], "k_cache")
    assert_untouched(case["v_cache"], eager_case["v_cache"], "v_cache")


def test_fake_and_meta_tensors_give_shapes():
    case = random_case(SMALL_SHAPE, 3, 16, torch.float16, "cpu", seed=0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
        fake["weights"] = GPT2StepWeights(*(mode.from_tensor(t) for t in case["weights"].tensors()))
        out = run_op(fake)
        assert out.shape == (3, SMALL_SHAPE[3]) and out.dtype == torch.float16
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in op_args(case)]
    out = torch.ops.fused_attn.gpt2_decode_step(*meta)
    assert out.shape == (3, SMALL_SHAPE[3]) and out.dtype == torch.float16 and out.device.type == "meta"


def test_workspace_bytes():
    assert workspace_bytes(1, 768, 3072, torch.float16) == 256 + (3 * 768 + 3072) * 2
    assert workspace_bytes(3, 128, 200, torch.float32) == 256 + 3 * (384 + 200) * 4
    assert workspace_bytes(1, 64, 8, torch.float16) % 16 == 0
    assert workspace_bytes(1, 1, 1, torch.float16) == 272  # 264 rounded up to 16 bytes
    ws = new_workspace(2, 128, 200, torch.bfloat16, "cpu")
    assert ws.dtype == torch.uint8 and ws.numel() == workspace_bytes(2, 128, 200, torch.bfloat16) and not ws.any()


# --------------------------------------------------------------------------- bad arguments


def _replace(case: dict, **changes) -> dict:
    """The case with some arguments changed: a weight's name changes that field of the weights."""
    out = dict(case)
    weight_changes = {k: changes.pop(k) for k in list(changes) if k in {f.name for f in fields(GPT2StepWeights)}}
    out["weights"] = replace(case["weights"], **weight_changes)
    out.update(changes)
    return out


def _bad(c: dict, name: str, how: str):
    """The case's tensor ``name`` (an argument or a weight) made bad in one way."""
    t = c[name] if name in c else getattr(c["weights"], name)
    return {"float16": t.to(torch.float16), "int64": t.to(torch.int64), "shape": t[..., :-1].contiguous(),
            "strided": t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t[::2],
            "elsewhere": t.to("meta" if t.device.type == "cpu" else "cpu")}[how]


L, H, I, V, P = SMALL_SHAPE
C = 64 * H
# The messages name the case's float dtype as DTYPE, its device as DEVICE, the other device (meta for
# the CPU, the CPU for CUDA) as ELSEWHERE and the workspace's size as WS_BYTES: bad_case() fills them in.
BAD_INPUTS = [  # (id, changes(case), exception, message)
    ("token_type", lambda c: dict(token=[1, 2]), TypeError, r"token must be a torch.Tensor, got list"),
    ("w_o_type", lambda c: dict(w_o=None), TypeError, r"w_o must be a torch.Tensor, got NoneType"),
    ("workspace_type", lambda c: dict(workspace=3), TypeError, r"workspace must be a torch.Tensor, got int"),
    ("token_dims", lambda c: dict(token=c["token"][None]), ValueError,
     r"token must have 1 dim \[batch\], got \(1, 2\)"),
    ("token_dtype", lambda c: dict(token=c["token"].int()), ValueError,
     r"token must have dtype torch.int64, got torch.int32"),
    ("batch_0", lambda c: dict(token=c["token"][:0]), ValueError,
     r"token must have at least 1 element \(batch\), got \(0,\)"),
    ("device", lambda c: dict(wpe=_bad(c, "wpe", "elsewhere")), ValueError,
     r"wpe must be on the same device as token \(DEVICE\), got ELSEWHERE"),
    ("pos_dtype", lambda c: dict(pos=c["pos"].long()), ValueError, r"pos must have dtype torch.int32, got torch.int64"),
    ("seqlens_shape", lambda c: dict(seqlens=c["seqlens"][:1]), ValueError,
     r"seqlens must have shape \(2,\), got \(1,\)"),
    ("leftpad_dtype", lambda c: dict(leftpad=c["leftpad"].float()), ValueError,
     r"leftpad must have dtype torch.int32, got torch.float32"),
    ("dtype_follows_wte", lambda c: dict(wte=c["weights"].wte.half()), ValueError,
     r"k_cache must have wte's dtype \(torch.float16\), got DTYPE"),
    ("wte_int", lambda c: dict(wte=c["weights"].wte.long()), ValueError,
     r"wte must have dtype float32, float16,? (or )?bfloat16( or float64 \(CPU\))?, got torch.int64"),
    ("k_dtype", lambda c: dict(k_cache=_bad(c, "k_cache", "float16")), ValueError,
     r"k_cache must have wte's dtype \(DTYPE\), got torch.float16"),
    ("b_fc_dtype", lambda c: dict(b_fc=_bad(c, "b_fc", "float16")), ValueError,
     r"b_fc must have wte's dtype \(DTYPE\), got torch.float16"),
    ("k_dims", lambda c: dict(k_cache=c["k_cache"][0], v_cache=c["v_cache"][0]), ValueError,
     r"k_cache must have 5 dims \[n_layer, batch, nheads, max_len, headdim\], got \(2, 2, 16, 64\)"),
    ("headdim", lambda c: dict(k_cache=_bad(c, "k_cache", "shape"), v_cache=_bad(c, "v_cache", "shape")), ValueError,
     rf"k_cache must have headdim \(last dim\) 64, got \({L}, 2, {H}, 16, 63\)"),
    ("cache_batch", lambda c: dict(k_cache=c["k_cache"][:, :1].contiguous(), v_cache=c["v_cache"][:, :1].contiguous()),
     ValueError, rf"k_cache must have token's batch size \(2\) in dim 1, got \({L}, 1, {H}, 16, 64\)"),
    ("v_shape", lambda c: dict(v_cache=c["v_cache"][:, :, :, :8].contiguous()), ValueError,
     rf"v_cache must have shape \({L}, 2, {H}, 16, 64\), got \({L}, 2, {H}, 8, 64\)"),
    ("wte_dims", lambda c: dict(wte=c["weights"].wte[None]), ValueError,
     rf"wte must have 2 dims \[vocab, n_embd\], got \(1, {V}, {C}\)"),
    ("wpe_dims", lambda c: dict(wpe=c["weights"].wpe[0]), ValueError,
     rf"wpe must have 2 dims \[n_positions, n_embd\], got \({C},\)"),
    ("w_fc_dims", lambda c: dict(w_fc=c["weights"].w_fc[0]), ValueError,
     rf"w_fc must have 3 dims \[n_layer, n_inner, n_embd\], got \({I}, {C}\)"),
    ("n_inner", lambda c: dict(w_fc=c["weights"].w_fc[:, :-1].contiguous()), ValueError,
     rf"w_fc must have n_inner \(dim 1\) a multiple of 8, got \({L}, {I - 1}, {C}\)"),
    ("norms", lambda c: dict(norms=c["weights"].norms[:-1].contiguous()), ValueError,
     rf"norms must have shape \({2 * L + 1}, 2, {C}\), got \({2 * L}, 2, {C}\)"),
    ("w_qkv_strided", lambda c: dict(w_qkv=_bad(c, "w_qkv", "strided")), ValueError,
     rf"w_qkv must be contiguous, got strides \(\d+, 1, {3 * C}\)"),
    ("k_strided", lambda c: dict(k_cache=_bad(c, "k_cache", "strided")), ValueError,
     r"k_cache must be contiguous, got strides \(\d+, \d+, \d+, 1, 16\)"),
    ("seqlens_strided", lambda c: dict(seqlens=c["seqlens"].repeat_interleave(2)[::2]), ValueError,
     r"seqlens must be contiguous, got strides \(2,\)"),
    ("workspace_dtype", lambda c: dict(workspace=c["workspace"].float()), ValueError,
     r"workspace must have dtype torch.uint8, got torch.float32"),
    ("workspace_dims", lambda c: dict(workspace=c["workspace"][None]), ValueError,
     r"workspace must have 1 dim \[bytes\], got \(1, \d+\)"),
    ("workspace_small", lambda c: dict(workspace=c["workspace"][:-16]), ValueError,
     rf"workspace must have at least WS_BYTES bytes \(workspace_bytes\(batch=2, n_embd={C}, n_inner={I}, "
     rf"dtype=DTYPE\)\), got WS_SHORT"),
    ("eps_nan", lambda c: dict(eps=math.nan), ValueError, r"eps must be a finite number >= 0, got nan"),
    ("eps_negative", lambda c: dict(eps=-1e-5), ValueError, r"eps must be a finite number >= 0, got -1e-05"),
    ("eps_type", lambda c: dict(eps="1e-5"), TypeError, r"eps must be a finite number >= 0, got '1e-5'"),
]

# Each weight with its last dim cut by one.
WANT_SHAPES = {"wte": (V, C), "wpe": (P, C), "w_qkv": (L, 3 * C, C), "b_qkv": (L, 3 * C), "w_o": (L, C, C),
               "b_o": (L, C), "b_fc": (L, I), "w_proj": (L, C, I), "b_proj": (L, C)}
BAD_INPUTS += [(f"{name}_shape", lambda c, name=name: {name: _bad(c, name, "shape")}, ValueError,
                rf"{name} must have shape {re.escape(str(want))}, got {re.escape(str((*want[:-1], want[-1] - 1)))}")
               for name, want in WANT_SHAPES.items()]


def bad_case(device: str) -> tuple[dict, dict]:
    """A valid call's arguments (float64 on the CPU, float32 on CUDA) and the values of the messages'
    placeholders."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    case = dict(random_case(SMALL_SHAPE, 2, 16, dtype, device, seed=0), eps=EPS)
    ws = workspace_bytes(2, C, I, dtype)
    return case, dict(DTYPE=str(dtype), DEVICE=str(case["token"].device),
                      ELSEWHERE="meta" if device == "cpu" else "cpu", WS_BYTES=str(ws), WS_SHORT=str(ws - 16))


def _message(match: str, values: dict) -> str:
    for key, value in values.items():
        match = match.replace(key, re.escape(value))
    return match


def _call_op(c: dict):
    return torch.ops.fused_attn.gpt2_decode_step(c["token"], c["pos"], c["seqlens"], c["leftpad"], c["k_cache"],
                                                 c["v_cache"], *c["weights"].tensors(), c["workspace"], c["eps"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,changes,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_arguments_raise(name, changes, exc, match, device, request):
    """Through the wrapper and through torch.ops directly: on the CPU its kernel checks the same, on CUDA
    the launcher (csrc/gpt2_decode_step) must raise the same messages."""
    if device == "cuda":
        request.getfixturevalue("built_library")
    base, values = bad_case(device)
    match = _message(match, values)
    c = _replace(base, **changes(base))
    with pytest.raises(exc, match=match):
        gpt2_decode_step(c["token"], c["pos"], c["seqlens"], c["leftpad"], c["k_cache"], c["v_cache"], c["weights"],
                         c["workspace"], eps=c["eps"])
    if exc is ValueError or name.startswith("eps"):
        with pytest.raises((exc, RuntimeError, NotImplementedError), match=match if exc is ValueError else None):
            _call_op(c)


def test_weights_must_be_the_dataclass():
    c, _ = bad_case("cpu")
    with pytest.raises(TypeError, match=r"weights must be a GPT2StepWeights, got tuple"):
        gpt2_decode_step(c["token"], c["pos"], c["seqlens"], c["leftpad"], c["k_cache"], c["v_cache"],
                         c["weights"].tensors(), c["workspace"], eps=EPS)


@pytest.mark.parametrize("which", ["k_cache", "w_qkv", "norms", "wte"])
def test_requires_grad_raises(which):
    c = random_case(SMALL_SHAPE, 2, 16, torch.float32, "cpu", seed=0)
    t = (c[which] if which in c else getattr(c["weights"], which)).clone().requires_grad_()
    c = _replace(c, **{which: t})
    match = (rf"{which} must not require grad \(gpt2_decode_step writes the KV cache and records no gradient; "
             r"fused_attn.reference.gpt2_decode_step is plain PyTorch\), got requires_grad=True")
    with pytest.raises(ValueError, match=match):
        run_op(c)
    with pytest.raises(ValueError, match=match):
        _call_op(dict(c, eps=EPS))
    with torch.no_grad():
        run_op(c)  # no graph is recorded: allowed
