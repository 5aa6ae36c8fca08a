"""ONNX export of the fused_attn ops (fused_attn/onnx.py): exported models run by onnxruntime on the
CPU against the row-by-row definition, and a Hugging Face GPT-2 against the model itself.

A model's CUDA forward records torch.ops.fused_attn.* in the exported graph (on the CPU the softmax
wrapper runs plain PyTorch, which exports without us); the CPU tests call the ops directly to get the
same graph. attention's CPU kernel is the op's own, so a CPU model records it as a CUDA one does.
"""

from __future__ import annotations

import math

import pytest
import torch

INSTALL = 'pip install ".[onnx]"'
pytest.importorskip("onnxscript", reason=f"needs onnxscript for the ONNX translations ({INSTALL})")
ort = pytest.importorskip("onnxruntime", reason=f"needs onnxruntime to run the exported models ({INSTALL})")

import fused_attn  # noqa: E402
import fused_attn.onnx  # noqa: E402
from fused_attn import reference  # noqa: E402
from tests.prompts import TINY, left_padded  # noqa: E402
from tests.rowref import softmax_rows  # noqa: E402
from tests.tolerances import (  # noqa: E402
    assert_attention_close, assert_close, fp32_tolerance, lse_tolerance, softmax_tolerance)


def export(model, args, path, dynamic_shapes=None):
    """torch.onnx.export with our translations, saved at ``path``; the onnxruntime CPU session."""
    program = torch.onnx.export(model.eval(), args, dynamo=True, dynamic_shapes=dynamic_shapes,
                                custom_translation_table=fused_attn.onnx.TRANSLATIONS, verbose=False)
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run(session, *args):
    names = [i.name for i in session.get_inputs()]
    return [torch.from_numpy(o) for o in session.run(None, {n: a.numpy() for n, a in zip(names, args)})]


class Softmax(torch.nn.Module):
    def __init__(self, scale, causal):
        super().__init__()
        self.scale, self.causal = scale, causal

    def forward(self, s, mask=None):
        return torch.ops.fused_attn.scaled_masked_softmax(s, self.scale, mask, causal=self.causal)


def scores_with_edge_cases(lead, sq, sk, dtype, seed=0):
    """Random scores with a NaN in a visible element (its row is NaN) and one under the causal mask
    of the last row-but-one query (never read when causal)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(*lead, sq, sk, generator=gen) * 4
    s[0, 0, -1, 0] = math.nan
    if sq > 1:
        s[0, -1, -2, -1] = math.nan
    return s.to(dtype)


def check(got, s, scale, causal, mask, what):
    want = softmax_rows(s, scale, causal=causal, attn_mask=mask)
    assert got.dtype == s.dtype and got.shape == s.shape, what
    tol = softmax_tolerance(want, reference.scores(s, scale, causal=causal, attn_mask=mask), s.dtype)
    assert_close(got, want, tol, what)
    assert torch.equal(got == 0, want == 0), f"{what}: exact zeros differ"  # masked keys, dead rows


# (name, scale, causal, mask kind, dtype, sq, sk): the bottom-right causal edge with sq < sk and
# sq > sk (the first rows see nothing) and sq = 1 (a decode row sees every key), bool masks with a
# fully masked row, additive masks with -inf and finfo.min, float16 in and out (onnxruntime takes no
# bfloat16 numpy input).
CASES = [
    ("causal_bool_padding", 0.35, True, "bool_padding", torch.float32, 5, 9),
    ("causal_sq_gt_sk_additive", -0.7, True, "additive", torch.float32, 9, 5),
    ("bool_qk_float16", 1.0, False, "bool_qk", torch.float16, 6, 6),
    ("causal_decode_no_mask_float16", 0.125, True, None, torch.float16, 1, 8),
]


def make_mask(kind, lead, sq, sk, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool_padding":
        m = torch.rand(lead[0], 1, 1, sk, generator=gen) > 0.3
        m[0] = False  # every key of batch 0 masked: its rows are 0
        return m
    if kind == "bool_qk":
        m = torch.rand(sq, sk, generator=gen) > 0.4
        m[1] = False
        return m
    if kind == "additive":
        m = torch.randn(lead[0], 1, sq, sk, generator=gen)
        m[0, 0, :, 1] = -math.inf
        m[-1, 0, -1, :] = torch.finfo(torch.float32).min
        return m.to(dtype)
    return None


@pytest.mark.parametrize("name,scale,causal,kind,dtype,sq,sk", CASES, ids=[c[0] for c in CASES])
def test_exported_softmax_matches_the_definition(tmp_path, name, scale, causal, kind, dtype, sq, sk):
    lead = (2, 3)
    s = scores_with_edge_cases(lead, sq, sk, dtype)
    mask = make_mask(kind, lead, sq, sk, dtype)
    args = (s,) if mask is None else (s, mask)
    session = export(Softmax(scale, causal), args, tmp_path / "softmax.onnx")
    (got,) = run(session, *args)
    check(got, s, scale, causal, mask, name)
    torch.testing.assert_close(got, torch.ops.fused_attn.scaled_masked_softmax(s, scale, mask, causal=causal),
                               rtol=0, atol=2e-6 if dtype == torch.float32 else 0, equal_nan=True)


def test_exported_causal_mask_follows_the_runtime_shape(tmp_path):
    """Exported with dynamic seqlen_q / seqlen_k: the causal edge comes from the input's shape."""
    q, k = torch.export.Dim("seqlen_q"), torch.export.Dim("seqlen_k")
    s = scores_with_edge_cases((2, 3), 4, 6, torch.float32)
    session = export(Softmax(0.5, True), (s,), tmp_path / "dynamic.onnx", dynamic_shapes=({2: q, 3: k},))
    for sq, sk in ((1, 7), (7, 3), (5, 5), (3, 11)):
        s = scores_with_edge_cases((2, 3), sq, sk, torch.float32, seed=sq * sk)
        (got,) = run(session, s)
        check(got, s, 0.5, True, None, f"sq={sq} sk={sk}")


class Backward(torch.nn.Module):
    def forward(self, grad, y):
        return torch.ops.fused_attn.scaled_masked_softmax_backward(grad, y, -0.6, causal=True)


def test_exported_backward_matches_the_definition(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    y = reference.scaled_masked_softmax(x, -0.6, causal=True).float()
    grad = torch.randn(2, 3, 5, 8, generator=gen)
    session = export(Backward(), (grad, y), tmp_path / "backward.onnx")
    (got,) = run(session, grad, y)
    want = reference.scaled_masked_softmax_backward(grad.double(), y.double(), -0.6, causal=True)
    assert_close(got, want, fp32_tolerance(want), "backward")


class Attention(torch.nn.Module):
    def __init__(self, scale, causal, return_lse):
        super().__init__()
        self.scale, self.causal, self.return_lse = scale, causal, return_lse

    def forward(self, q, k, v, mask=None):
        return torch.ops.fused_attn.attention(q, k, v, mask, self.scale, causal=self.causal,
                                              return_lse=self.return_lse)


def attention_inputs(b, hkv, group, sq, sk, d, dtype, kind, seed=0):
    """q, k, v with scores of a few units (the softmax far from uniform) and a mask of ``kind``:
    "bool_padding" [b, 1, 1, sk] with every key of batch 0 masked, "bool_qk" [sq, sk] with a fully
    masked query row, "additive" [b, 1, sq, sk] with a -inf key column and a finfo.min row, or None."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hkv * group, sq, d, generator=gen) * 2).to(dtype)
    k = (torch.randn(b, hkv, sk, d, generator=gen) * 2).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    mask = None
    if kind == "bool_padding":
        mask = torch.rand(b, 1, 1, sk, generator=gen) > 0.3
        mask[0] = False
    elif kind == "bool_qk":
        mask = torch.rand(sq, sk, generator=gen) > 0.4
        mask[1] = False
    elif kind == "additive":
        mask = torch.randn(b, 1, sq, sk, generator=gen)
        mask[0, 0, :, 1] = -math.inf
        mask[-1, 0, -1, :] = torch.finfo(torch.float32).min
        mask = mask.to(dtype)
    return q, k, v, mask


def check_attention(out, lse, q, k, v, mask, scale, causal, return_lse, what):
    """``out`` (and ``lse``) against the float64 definition: flash-attention's rule for the output
    (twice PyTorch's own error at q's dtype), lse_tolerance for the lse, exact zeros and -inf on rows
    with no visible key; without return_lse, the op's empty lse."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    m64 = None if mask is None or mask.dtype == torch.bool else mask.double()
    m64 = mask if m64 is None else m64
    q64, k64, v64 = q.double(), k.double(), v.double()
    want, want_lse = reference.attention(q64, k64, v64, causal=causal, attn_mask=m64, scale=scale)
    magnitude, _ = reference.attention(q64, k64, v64.abs(), causal=causal, attn_mask=m64, scale=scale)
    peer, _ = reference.attention(q, k, v, causal=causal, attn_mask=mask, scale=scale, compute_dtype=q.dtype)
    k_all = k64.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q64 @ k_all.transpose(-1, -2)) * scale
    terms = (q64.abs() @ k_all.abs().transpose(-1, -2)) * abs(scale)
    if m64 is not None and m64.dtype != torch.bool:
        s, terms = s + m64, terms + m64.abs()
    smax = torch.where(torch.isfinite(s), s.abs(), 0).amax(dim=-1)
    tmax = torch.where(torch.isfinite(s), terms, 0).amax(dim=-1)
    assert out.dtype == q.dtype, what
    assert_attention_close(out, peer, want, magnitude, smax, what)
    no_key = want_lse == -math.inf
    assert no_key.any() == (causal and q.shape[2] > k.shape[2] or mask is not None and mask.dtype == torch.bool), \
        f"{what}: the case must have rows with no visible key exactly when it masks some"
    assert (out[no_key] == 0).all(), f"{what}: rows with no visible key must be exact zeros"
    lse_dtype = reference.lse_dtype(q.dtype)
    if not return_lse:
        assert lse.shape == (0,) and lse.dtype == lse_dtype, f"{what}: lse {lse.dtype} {tuple(lse.shape)}"
        return
    assert lse.shape == want_lse.shape and lse.dtype == lse_dtype, f"{what}: lse {lse.dtype} {tuple(lse.shape)}"
    assert torch.equal(lse == -math.inf, no_key), f"{what}: lse -inf exactly on rows with no visible key"
    live = ~no_key
    assert_close(lse[live], want_lse[live], lse_tolerance(want_lse[live], tmax[live]), f"{what}: lse")


# (name, causal, mask kind, dtype, nheads_kv, group, seqlen_q, seqlen_k, scale, return_lse): the
# bottom-right causal edge with sq < sk and sq > sk (the first rows see nothing), bool and additive
# masks (with fully masked rows), GQA and MQA, the default scale, float16 (computed in float32) and
# float64 (computed in float64, float64 lse).
ATTENTION_CASES = [
    ("causal_sq_lt_sk_lse", True, None, torch.float32, 2, 1, 5, 9, None, True),
    ("causal_sq_gt_sk_bool_padding_lse", True, "bool_padding", torch.float32, 2, 1, 9, 5, 0.3, True),
    ("additive", False, "additive", torch.float32, 2, 1, 6, 7, -0.4, False),
    ("gqa_causal_additive_lse", True, "additive", torch.float32, 2, 3, 7, 7, None, True),
    ("mqa_bool_qk_float64", False, "bool_qk", torch.float64, 1, 4, 4, 6, 0.25, False),
    ("gqa_causal_float16_lse", True, "bool_padding", torch.float16, 2, 2, 3, 8, None, True),
    ("causal_decode_float64_lse", True, None, torch.float64, 3, 1, 1, 6, None, True),
]


@pytest.mark.parametrize("name,causal,kind,dtype,hkv,group,sq,sk,scale,return_lse", ATTENTION_CASES,
                         ids=[c[0] for c in ATTENTION_CASES])
def test_exported_attention_matches_the_definition(tmp_path, name, causal, kind, dtype, hkv, group, sq, sk, scale,
                                                   return_lse):
    q, k, v, mask = attention_inputs(2, hkv, group, sq, sk, 8, dtype, kind)
    args = (q, k, v) if mask is None else (q, k, v, mask)
    session = export(Attention(scale, causal, return_lse), args, tmp_path / "attention.onnx")
    out, lse = run(session, *args)
    check_attention(out, lse, q, k, v, mask, scale, causal, return_lse, name)


def test_exported_attention_follows_the_runtime_shapes(tmp_path):
    """Exported with dynamic batch, seqlen_q and seqlen_k (GQA, causal, a bool padding mask): the causal
    edge and the mask's broadcast come from the inputs' shapes."""
    b, q_len, k_len = torch.export.Dim("batch"), torch.export.Dim("seqlen_q"), torch.export.Dim("seqlen_k")
    q, k, v, mask = attention_inputs(2, 2, 2, 4, 6, 8, torch.float32, "bool_padding")
    kv = {0: b, 2: k_len}
    session = export(Attention(None, True, True), (q, k, v, mask), tmp_path / "dynamic.onnx",
                     dynamic_shapes=({0: b, 2: q_len}, kv, kv, {0: b, 3: k_len}))
    for batch, sq, sk in ((3, 1, 7), (2, 7, 3), (2, 5, 5), (4, 3, 11)):
        q, k, v, mask = attention_inputs(batch, 2, 2, sq, sk, 8, torch.float32, "bool_padding", seed=sq * sk)
        out, lse = run(session, q, k, v, mask)
        check_attention(out, lse, q, k, v, mask, None, True, True, f"batch={batch} sq={sq} sk={sk}")


def test_attention_translation_needs_static_head_counts():
    from onnxscript import ir

    def value(name, dims):
        return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(ir.DataType.FLOAT))

    q, kv = value("q", ["batch", "nheads", "seqlen_q", 8]), value("k", ["batch", 2, "seqlen_k", 8])
    with pytest.raises(ValueError, match=r"q must have a static nheads_q \(dim 1\) to export attention to ONNX"):
        fused_attn.onnx.attention(q, kv, kv)
    q, kv = value("q", ["batch", 4, "seqlen_q", 8]), value("k", ["batch", "nheads_kv", "seqlen_k", 8])
    with pytest.raises(ValueError, match=r"k must have a static nheads_kv \(dim 1\) to export attention to ONNX"):
        fused_attn.onnx.attention(q, kv, kv)
    q, kv = value("q", ["batch", 4, "seqlen_q", "headdim"]), value("k", ["batch", 2, "seqlen_k", "headdim"])
    with pytest.raises(ValueError, match=r"q must have a static headdim \(dim 3\) to export attention to ONNX"):
        fused_attn.onnx.attention(q, kv, kv)
    q, kv = value("q", ["batch", 5, "seqlen_q", 8]), value("k", ["batch", 2, "seqlen_k", 8])
    with pytest.raises(ValueError, match=r"q must have nheads_q a multiple of k's nheads_kv \(2\), got 5"):
        fused_attn.onnx.attention(q, kv, kv)


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        return self.model(ids, attention_mask=attention_mask, use_cache=False).logits


def gpt2(device):
    transformers = pytest.importorskip("transformers")
    import fused_attn.hf as fhf

    fhf.register()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval().to(device)
    model.set_attn_implementation("fused_attn")
    return model


def check_gpt2_export(model, path):
    ids, mask = left_padded(TINY["vocab_size"], (9, 6, 4), model.device)
    with torch.no_grad():
        want = Logits(model)(ids, mask)
    session = export(Logits(model), (ids, mask), path)
    (got,) = run(session, ids.cpu(), mask.cpu())
    assert_close(got, want.cpu(), fp32_tolerance(want.cpu()), "GPT-2 logits")


def test_gpt2_exports_and_matches(tmp_path, monkeypatch):
    """Hugging Face GPT-2 with the fused_attn attention, exported with the op in the graph (as a CUDA
    export records it; on the CPU the wrapper would record plain PyTorch), against the model."""
    import fused_attn.hf as fhf

    calls = []

    def the_op(x, scale, *, causal, attn_mask):
        calls.append(causal)
        return torch.ops.fused_attn.scaled_masked_softmax(x, scale, attn_mask, causal=causal)

    model = gpt2("cpu")
    monkeypatch.setattr(fhf, "scaled_masked_softmax", the_op)
    check_gpt2_export(model, tmp_path / "gpt2.onnx")
    assert len(calls) >= 2 * TINY["n_layer"], calls  # the eager run and the export went through the op


@pytest.mark.gpu
def test_gpt2_exported_on_cuda_runs_on_the_cpu_gpu(tmp_path):
    """The user's case: a CUDA model exported as it is (the wrapper records the op); onnxruntime on the
    CPU gives the CUDA model's logits."""
    check_gpt2_export(gpt2("cuda"), tmp_path / "gpt2.onnx")
