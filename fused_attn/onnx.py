"""ONNX export of the fused_attn ops: translations into standard ONNX operators.

``torch.onnx.export(..., dynamo=True)`` has no translation for a custom op; hand it ours::

    import fused_attn.onnx

    torch.onnx.export(model, args, "model.onnx", dynamo=True,
                      custom_translation_table=fused_attn.onnx.TRANSLATIONS)

Needs the ``onnx`` extra (``pip install "fused_attn[onnx]"``: onnxscript, and onnxruntime to run
the result). Each translation is the op's definition (``fused_attn/reference.py``) written with
ONNX opset 18 operators, computed in float32 (float64 input: float64) as the kernels and the CPU
path compute, cast back to the input's dtype:

- ``scaled_masked_softmax``: ``x * scale``, an additive ``attn_mask`` added or a bool one
  (True = attend) applied, the bottom-right causal mask (key j visible to query i iff
  ``j <= i + seqlen_k - seqlen_q``, from the runtime shape, so dynamic sequence lengths work),
  then exp / sum over the last dim; masked elements are exact zeros, a row with no visible key
  is all zeros, a NaN in a visible element makes its row NaN.
- ``scaled_masked_softmax_backward``: ``dx = scale * y * (grad - sum_j grad * y)`` over the
  visible keys.
- ``attention``: ``softmax(q·kᵀ·scale + mask)·v`` with the softmax's masking (scale default
  ``headdim ** -0.5``; a mask broadcastable to ``[batch, nheads_q, seqlen_q, seqlen_k]``), GQA / MQA
  by repeating each kv head ``nheads_q // nheads_kv`` times (query head h reads kv head
  ``h // (nheads_q // nheads_kv)``); a row with no visible key is 0. The head counts (and headdim
  when scale is None) must be static in the exported graph; batch and sequence lengths may be
  dynamic. ``return_lse``: the natural-log log-sum-exp ``[batch, nheads_q, seqlen_q]`` (-inf on a
  row with no visible key), else the op's empty placeholder of shape ``(0,)``; both float32
  (float64 for float64 q). ``algo`` only picks a CUDA kernel and is ignored.

``scaled_masked_softmax_out`` and ``attention_out`` write into ``out`` (CUDA graphs) and have no ONNX
translation: an exported model calls the functional op (``out=None``), which is what
``torch.export`` records.
"""

from __future__ import annotations

import numpy as np
import torch
from onnxscript import ir
from onnxscript import opset18 as op


def _compute_type(x) -> ir.DataType:
    return ir.DataType.DOUBLE if x.dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT


def _scalar(value: float, dtype: ir.DataType):
    """A constant of ``dtype`` (a float64 scale stays exact, not rounded through float32)."""
    return op.Constant(value=ir.tensor(value, dtype=dtype))


def _causal_visible(x):
    """Bool [seqlen_q, seqlen_k]: True where key j is visible to query i (bottom-right aligned)."""
    shape = op.Shape(x)
    seqlen_q = op.Squeeze(op.Slice(shape, [-2], [-1]))
    seqlen_k = op.Squeeze(op.Slice(shape, [-1], [2**62]))
    i = op.Unsqueeze(op.Range(0, seqlen_q, 1), [-1])
    j = op.Range(0, seqlen_k, 1)
    return op.LessOrEqual(j, op.Add(i, op.Sub(seqlen_k, seqlen_q)))


def _masked_exp(s, ct: ir.DataType, attn_mask, causal: bool):
    """The masking and exponentials of a softmax over the last dim of the scaled scores ``s``
    (of type ``ct``): an additive ``attn_mask`` added or a bool one (True = attend) applied, then the
    bottom-right causal mask. Returns ``(e, m, total)``: ``e = exp(s - m)`` (exact zeros where
    masked), the row's shift ``m`` (its max; 0 for a row with no finite score) and ``total = sum e``
    (0 on a row with no visible key, NaN on a row with a NaN in a visible element)."""
    neg_inf, zero = _scalar(float("-inf"), ct), _scalar(0.0, ct)
    visible = None
    if attn_mask is not None:
        if attn_mask.dtype == ir.DataType.BOOL:
            visible = attn_mask
        else:
            s = op.Add(s, op.Cast(attn_mask, to=ct))
    if causal:
        causal_ok = _causal_visible(s)
        visible = causal_ok if visible is None else op.And(visible, causal_ok)
    if visible is not None:
        s = op.Where(visible, s, neg_inf)
    # A row with no finite score has max -inf: shift it by 0 instead (exp(-inf) = 0, sum 0 -> row 0).
    m = op.ReduceMax(s, [-1], keepdims=1)
    m = op.Where(op.Equal(m, neg_inf), zero, m)
    e = op.Exp(op.Sub(s, m))
    return e, m, op.ReduceSum(e, [-1], keepdims=1)


def _normalized(e, total, ct: ir.DataType):
    """``e / total``; total == 0 (every key masked) -> 0; a NaN total keeps its row NaN."""
    zero = _scalar(0.0, ct)
    return op.Where(op.Equal(total, zero), zero, op.Div(e, total))


def scaled_masked_softmax(x, scale: float = 1.0, attn_mask=None, causal: bool = False, version: int = 1):
    """ONNX translation of ``torch.ops.fused_attn.scaled_masked_softmax.default``. ``version`` only
    picks a CUDA kernel (0 textbook, 1 fused); both compute this function."""
    ct = _compute_type(x)
    e, _, total = _masked_exp(op.Mul(op.Cast(x, to=ct), _scalar(scale, ct)), ct, attn_mask, causal)
    return op.CastLike(_normalized(e, total, ct), x)


def scaled_masked_softmax_backward(grad, y, scale: float, causal: bool = False):
    """ONNX translation of ``torch.ops.fused_attn.scaled_masked_softmax_backward.default``."""
    ct = _compute_type(y)
    g, yy = op.Cast(grad, to=ct), op.Cast(y, to=ct)
    if causal:
        visible = op.CastLike(_causal_visible(y), yy)
        g, yy = op.Mul(g, visible), op.Mul(yy, visible)
    dot = op.ReduceSum(op.Mul(g, yy), [-1], keepdims=1)
    dx = op.Mul(op.Mul(yy, _scalar(scale, ct)), op.Sub(g, dot))
    return op.CastLike(dx, y)


def _static_dim(value, axis: int, name: str, dim: str) -> int:
    """``value``'s size along ``axis`` as a Python int: the translation builds the graph from it."""
    size = value.shape[axis] if value.shape is not None else None
    if not isinstance(size, int):
        raise ValueError(f"{name} must have a static {dim} (dim {axis}) to export attention to ONNX, got {size!r}")
    return size


def _repeat_kv(t, group: int, nheads_q: int):
    """k or v ``[batch, nheads_kv, seqlen_k, headdim]`` repeated to ``nheads_q`` heads: query head h
    reads kv head ``h // group`` (each kv head repeated ``group`` times in a row, as
    ``repeat_interleave`` does)."""
    if group == 1:
        return t
    shape = op.Shape(t)
    repeated = op.Expand(op.Unsqueeze(t, [2]), op.Constant(value_ints=[1, 1, group, 1, 1]))
    return op.Reshape(repeated, op.Concat(op.Slice(shape, [0], [1]), op.Constant(value_ints=[nheads_q]),
                                          op.Slice(shape, [2], [4]), axis=0))


def attention(q, k, v, attn_mask=None, scale: float | None = None, causal: bool = False, algo: str = "auto",
              return_lse: bool = False):
    """ONNX translation of ``torch.ops.fused_attn.attention.default``. ``algo`` only picks a CUDA
    kernel; every kernel computes this function. The head counts must be static in the exported
    graph (headdim too when ``scale`` is None)."""
    nheads_q = _static_dim(q, 1, "q", "nheads_q")
    nheads_kv = _static_dim(k, 1, "k", "nheads_kv")
    if nheads_kv == 0 or nheads_q % nheads_kv != 0:
        raise ValueError(f"q must have nheads_q a multiple of k's nheads_kv ({nheads_kv}), got {nheads_q}")
    if scale is None:
        scale = _static_dim(q, 3, "q", "headdim") ** -0.5
    ct = _compute_type(q)
    group = nheads_q // nheads_kv
    k_all = _repeat_kv(op.Cast(k, to=ct), group, nheads_q)
    v_all = _repeat_kv(op.Cast(v, to=ct), group, nheads_q)
    s = op.Mul(op.MatMul(op.Cast(q, to=ct), op.Transpose(k_all, perm=[0, 1, 3, 2])), _scalar(scale, ct))
    e, m, total = _masked_exp(s, ct, attn_mask, causal)
    out = op.CastLike(op.MatMul(_normalized(e, total, ct), v_all), q)
    if return_lse:
        # A row with no visible key has m = 0 and total = 0: log 0 = -inf.
        lse = op.Squeeze(op.Add(m, op.Log(total)), [-1])
    else:  # the op's empty placeholder (its fake kernel: shape (0,))
        lse = op.Constant(value=ir.tensor(np.zeros((0,), dtype=ct.numpy())))
    return out, lse


TRANSLATIONS = {
    torch.ops.fused_attn.scaled_masked_softmax.default: scaled_masked_softmax,
    torch.ops.fused_attn.scaled_masked_softmax_backward.default: scaled_masked_softmax_backward,
    torch.ops.fused_attn.attention.default: attention,
}
