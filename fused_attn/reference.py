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
    """
    s = x.to(compute_dtype) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(compute_dtype)
    if causal:
        s = s.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], x.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if s.shape[-1] > 0:
        # torch.softmax gives NaN on a row of all -inf; we define it as 0.
        p = p.masked_fill((s == float("-inf")).all(dim=-1, keepdim=True), 0.0)
    return p.to(x.dtype)


def eager_scaled_masked_softmax(x: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    """The unfused chain attention code runs today (the benchmarks' ``eager`` baseline):
    multiply by scale, masked_fill with -inf, softmax, each a separate kernel in x's dtype.
    ``masked`` is a bool mask built once by the caller, True where a key is hidden (e.g.
    ``~causal_mask(seqlen_q, seqlen_k)``), broadcastable to ``x``; or None (no masking)."""
    s = x * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return torch.softmax(s, dim=-1)
