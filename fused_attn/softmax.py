"""``scaled_masked_softmax``: scale + mask + softmax over the last dim in one pass.

Public wrapper, argument validation, the fake (meta) implementation and the CPU
path. The CUDA kernels are in ``csrc/softmax.cu`` / ``csrc/softmax_kernel.cuh``.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from fused_attn import _ops, reference

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VERSIONS = (0, 1)


def _shape(t: torch.Tensor | torch.Size) -> str:
    return str(tuple(t.shape if isinstance(t, torch.Tensor) else t))


def check_args(
    x: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor | None,
    version: int,
) -> None:
    """Raise ValueError / TypeError naming the bad argument (same messages as csrc/softmax.cu)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., seqlen_q, seqlen_k], got {_shape(x)}")
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if version not in VERSIONS:
        raise ValueError(f"version must be 0 or 1, got {version!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != x.device:
            raise ValueError(
                f"attn_mask must be on the same device as x ({x.device}), got {attn_mask.device}"
            )
        if attn_mask.dtype not in (torch.bool, x.dtype):
            raise ValueError(f"attn_mask must have dtype bool or x's dtype ({x.dtype}), got {attn_mask.dtype}")
        if attn_mask.dim() > x.dim() or any(
            m not in (1, n) for m, n in zip(reversed(attn_mask.shape), reversed(x.shape))
        ):
            raise ValueError(f"attn_mask must be broadcastable to {_shape(x)}, got {_shape(attn_mask)}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.device != x.device:
            raise ValueError(f"out must be on the same device as x ({x.device}), got {out.device}")
        if out.dtype != x.dtype:
            raise ValueError(f"out must have x's dtype ({x.dtype}), got {out.dtype}")
        if out.shape != x.shape:
            raise ValueError(f"out must have x's shape {_shape(x)}, got {_shape(out)}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def scaled_masked_softmax(
    x: torch.Tensor,
    scale: float = 1.0,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    version: int = 1,
) -> torch.Tensor:
    """softmax(x * scale + attn_mask) over the last dim, in one pass over memory.

    Args:
        x: ``[..., seqlen_q, seqlen_k]`` float32, float16 or bfloat16, any device.
            A non-contiguous CUDA ``x`` is copied once to contiguous memory.
        scale: finite multiplier applied before the mask (attention uses
            ``headdim ** -0.5``).
        causal: mask key j for query i unless ``j <= i + seqlen_k - seqlen_q``
            (bottom-right aligned: with seqlen_q = 1 every key is visible; with
            seqlen_q > seqlen_k the first rows see nothing). Masked elements are
            not read from memory.
        attn_mask: bool (True = attend, as in ``F.scaled_dot_product_attention``)
            or additive with x's dtype; broadcastable to ``x`` (``[B, 1, 1, seqlen_k]``
            padding masks, ``[1, 1, seqlen_q, seqlen_k]``, ...). Combined with ``causal``.
        out: optional preallocated contiguous tensor of x's shape, dtype and device
            (for CUDA graphs); returned.
        version: CUDA kernel version, 0 (textbook, for comparison) or 1 (fused, default).

    Returns:
        Tensor of x's shape and dtype; accumulation is float32. Masked elements are
        exact zeros. A row whose every key is masked (or whose scores are all -inf) is
        all zeros — PyTorch's eager softmax gives NaN there. A NaN in a visible element
        makes its row NaN, as in PyTorch. Empty inputs give empty outputs.

    CPU tensors use the pure-PyTorch path (``fused_attn.reference``, float32) with the
    same semantics. Works under ``torch.compile(fullgraph=True)`` and CUDA graph capture;
    never synchronizes the host.
    """
    check_args(x, scale, attn_mask, out, version)
    scale = float(scale)
    if x.device.type == "cpu":
        result = _cpu(x, scale, causal, attn_mask)
        if out is None:
            return result
        return out.copy_(result)
    _ops.ensure_loaded()
    if out is None:
        return torch.ops.fused_attn.scaled_masked_softmax(
            x, scale, causal=causal, attn_mask=attn_mask, version=version
        )
    torch.ops.fused_attn.scaled_masked_softmax_out(
        x, scale, causal=causal, attn_mask=attn_mask, version=version, out=out
    )
    return out


def _cpu(x: torch.Tensor, scale: float, causal: bool, attn_mask: torch.Tensor | None) -> torch.Tensor:
    return reference.scaled_masked_softmax(
        x, scale, causal=causal, attn_mask=attn_mask, compute_dtype=torch.float32
    )


@_ops.after_load
def _register() -> None:
    lib = "fused_attn::scaled_masked_softmax"

    @torch.library.register_fake(lib)
    def _fake(x, scale=1.0, *, causal=False, attn_mask=None, version=1):
        check_args(x, scale, attn_mask, None, version)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake(lib + "_out")
    def _fake_out(x, scale, *, causal, attn_mask, version, out):
        check_args(x, scale, attn_mask, out, version)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, scale=1.0, *, causal=False, attn_mask=None, version=1):
        check_args(x, scale, attn_mask, None, version)
        return _cpu(x, scale, causal, attn_mask)

    @torch.library.register_kernel(lib + "_out", "cpu")
    def _cpu_kernel_out(x, scale, *, causal, attn_mask, version, out):
        check_args(x, scale, attn_mask, out, version)
        out.copy_(_cpu(x, scale, causal, attn_mask))
