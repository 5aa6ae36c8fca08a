"""An independent definition of scaled_masked_softmax for the tests: one row at a time, float64.

Written from the README's definition, not from ``fused_attn/reference.py`` (the CPU path of the op
*is* that file, so comparing the two would test nothing): for query row q of a
``[..., seqlen_q, seqlen_k]`` input, key j is visible iff the bool mask (if any) is True there and,
with ``causal``, ``j <= q + seqlen_k - seqlen_q``. Visible keys get the score ``x * scale`` plus the
additive mask (if any); the row is ``exp(s_j - max s) / sum exp(s_k - max s)`` over the visible keys,
0 elsewhere; a row with no visible key, or whose visible scores are all -inf, is all zeros; a NaN score
makes the row NaN. Slow (a Python loop over rows): meant for CPU-sized inputs.

``attention_definition`` builds float64 attention on it; ``eager_same_dtype`` is the unfused chain at
a half dtype that half-precision errors are measured against.
"""

from __future__ import annotations

import math

import torch


def softmax_rows(x: torch.Tensor, scale: float = 1.0, *, causal: bool = False,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 tensor of x's shape (on the CPU)."""
    sq, sk = x.shape[-2], x.shape[-1]
    xs = x.detach().cpu().to(torch.float64).reshape(-1, sq, sk)
    if attn_mask is None:
        ms = None
    else:
        ms = attn_mask.detach().cpu().broadcast_to(x.shape).reshape(-1, sq, sk)
        if ms.dtype != torch.bool:
            ms = ms.to(torch.float64)
    out = torch.zeros(xs.shape, dtype=torch.float64)
    for b in range(xs.shape[0]):
        for q in range(sq):
            xrow = xs[b, q].tolist()
            mrow = None if ms is None else ms[b, q].tolist()
            last = q + sk - sq if causal else sk - 1  # last visible key of this row
            scores = []
            for j in range(min(last, sk - 1) + 1):
                s = xrow[j] * scale
                if mrow is not None:
                    if ms.dtype == torch.bool:
                        if not mrow[j]:
                            continue
                    else:
                        s += mrow[j]
                scores.append((j, s))
            out[b, q] = _row(scores, sk)
    return out.reshape(x.shape)


def _row(scores: list[tuple[int, float]], sk: int) -> torch.Tensor:
    row = torch.zeros(sk, dtype=torch.float64)
    values = [s for _, s in scores]
    if any(math.isnan(s) for s in values):
        return torch.full((sk,), math.nan, dtype=torch.float64)
    finite_or_pos = [s for s in values if s != -math.inf]
    if not finite_or_pos:
        return row  # no visible key, or every visible score is -inf
    m = max(finite_or_pos)
    if m == math.inf:
        return torch.full((sk,), math.nan, dtype=torch.float64)  # inf - inf, as torch.softmax gives
    e = [(j, math.exp(s - m)) for j, s in scores]
    total = math.fsum(v for _, v in e)
    for j, v in e:
        row[j] = v / total
    return row


def attention_definition(q, k, v, mask, scale, causal):
    """float64 attention from the row-by-row softmax: query head h uses key/value head
    h // (nheads / nheads_kv) (transformers' repeat_kv). Returns [batch, seqlen_q, nheads, headdim]."""
    h = q.shape[1]
    kv_of = torch.arange(h, device=q.device) // (h // k.shape[1])
    k64, v64 = k.double().index_select(1, kv_of), v.double().index_select(1, kv_of)
    scores = q.double() @ k64.transpose(-1, -2)
    probs = softmax_rows(scores, scale, causal=causal, attn_mask=mask).to(q.device)
    return (probs @ v64).transpose(1, 2)


def eager_same_dtype(q, k, v, mask, scale, causal):
    """PyTorch's unfused chain at q's dtype (as transformers' eager attention runs it, GQA by repeat):
    scores rounded to the dtype, softmax in float32 rounded back, P.V at the dtype. ``causal`` for
    square scores only. The comparison point of "our error <= 2 x PyTorch's own error at the same
    dtype"; rows with no visible key are NaN here."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (torch.softmax(s.float(), -1).to(q.dtype) @ v).transpose(1, 2)
