"""Plain-PyTorch references: the definitions the CUDA kernels are tested against.

Readable over fast. Computation happens in ``compute_dtype`` (float64 in tests,
float32 for the CPU path of the public API) and the result is cast back to the
input dtype.
"""

from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[seqlen_q, seqlen_k]``, True where key j is visible to query i.

    Bottom-right aligned: j <= i + seqlen_k - seqlen_q, so the last query sees every
    key (a decode step with seqlen_q = 1 sees the whole cache), and with
    seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see nothing.
    """
    i = torch.arange(seqlen_q, device=device).unsqueeze(-1)
    j = torch.arange(seqlen_k, device=device)
    return j <= i + (seqlen_k - seqlen_q)


def scores(
    x: torch.Tensor,
    scale: float = 1.0,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The pre-softmax scores ``x * scale + mask`` in ``compute_dtype``: -inf where a bool mask is
    False or the causal mask hides a key, the additive mask added after the scale."""
    s = x.to(compute_dtype) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(compute_dtype)
    if causal:
        s = s.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], x.device), float("-inf"))
    return s


def scaled_masked_softmax(
    x: torch.Tensor,
    scale: float = 1.0,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """softmax(x * scale + mask) over the last dim; rows with every key masked give 0.

    ``attn_mask`` is bool (True = attend) or additive, broadcastable to ``x``.
    A NaN in a visible element makes its row NaN (as torch.softmax does).

    Written out as exp / sum so that autograd through it is the definition's gradient too:
    a row with no finite score is the constant 0 (gradient 0, where differentiating
    torch.softmax and then zeroing the row would give NaN), and the max is a detached
    shift (softmax does not depend on it).
    """
    s = scores(x, scale, causal=causal, attn_mask=attn_mask, compute_dtype=compute_dtype)
    if s.shape[-1] == 0:
        return s.to(x.dtype)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    return p.to(x.dtype)


def scaled_masked_softmax_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """dx = scale * y * (grad - sum_j grad_j * y_j) per row, over the visible keys (all of them,
    or the causal ones); 0 at invisible keys. With y = scaled_masked_softmax(x, scale, ...) this
    is the gradient of that softmax with respect to x; with scale = 1, with respect to an
    additive mask (before summing over its broadcast dims)."""
    g, yy = grad.to(compute_dtype), y.to(compute_dtype)
    if causal:
        visible = causal_mask(y.shape[-2], y.shape[-1], y.device)
        g, yy = g * visible, yy * visible
    dot = (g * yy).sum(dim=-1, keepdim=True)
    return (scale * yy * (g - dot)).to(y.dtype)


def eager_scaled_masked_softmax(x: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    """The unfused chain attention code runs today (the benchmarks' ``eager`` baseline):
    multiply by scale, masked_fill with -inf, softmax, each a separate kernel in x's dtype.
    ``masked`` is a bool mask built once by the caller, True where a key is hidden (e.g.
    ``~causal_mask(seqlen_q, seqlen_k)``), broadcastable to ``x``; or None (no masking)."""
    s = x * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return torch.softmax(s, dim=-1)
