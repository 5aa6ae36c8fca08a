"""``scaled_masked_softmax``: scale + mask + softmax over the last dim in one pass.

Public wrapper, argument validation, the fake (meta) implementations, the CPU path
and autograd: the op's backward is its own op, ``scaled_masked_softmax_backward``
(one fused pass on CUDA, the reference formula on the CPU), itself differentiable.
The ``out=`` variant records no gradient and raises when an input requires grad.
The CUDA kernels are in ``csrc/softmax/`` (``softmax.cpp`` launchers, ``softmax_kernel.cuh`` kernels).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from fused_attn import _ops, reference

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# float64 runs on the CPU path only (torch.autograd.gradcheck needs it); there is no float64 kernel.
_CPU_DTYPES = _DTYPES + (torch.float64,)
VERSIONS = (0, 1)


def _shape(t: torch.Tensor | torch.Size) -> str:
    return str(tuple(t.shape if isinstance(t, torch.Tensor) else t))


def _check_is_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_dims(t: torch.Tensor, name: str, layout: str) -> None:
    """``t`` has as many dims as ``layout`` names, e.g. ``"[batch, nheads, seqlen_q, headdim]"``."""
    n = layout.count(",") + 1
    if t.dim() != n:
        raise ValueError(f"{name} must have {n} dim{'s' if n > 1 else ''} {layout}, got {_shape(t)}")


def check_args(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    causal: bool,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor | None,
    version: int,
    name: str = "x",
) -> float:
    """Raise TypeError (wrong type) / ValueError (bad value) naming the bad argument (same messages
    as csrc/softmax/softmax.cpp); return ``scale`` as a float. ``name``: what the scores tensor is
    called in the caller's signature (``y`` in the backward).

    The wrapper, the CPU and the fake kernels all check here, so every path takes the same
    arguments. As ``F.scaled_dot_product_attention`` does, ``causal`` must be a bool (not 1,
    None or "yes") and ``scale`` may be a 0-d tensor that does not require grad, read with
    ``float()``; unlike SDPA, not a CUDA one (reading it would synchronize the host) and not a
    bool (``scaled_masked_softmax(x, True)`` is a misplaced ``causal``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "cpu" and x.dtype not in _CPU_DTYPES:
        raise ValueError(f"{name} must have dtype float32, float16, bfloat16 or float64 (CPU), got {x.dtype}")
    if x.device.type != "cpu" and x.dtype not in _DTYPES:
        raise ValueError(f"{name} must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., seqlen_q, seqlen_k], got {_shape(x)}")
    scale = _scale_value(scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if isinstance(version, bool) or version not in VERSIONS:
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
        _check_out(out, x, name)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    return scale


def _scale_value(scale) -> float:
    if isinstance(scale, torch.Tensor):
        if (scale.dim() != 0 or scale.device.type != "cpu" or scale.requires_grad
                or scale.dtype == torch.bool or scale.is_complex()):
            raise TypeError(f"scale must be a finite number or a 0-d CPU tensor that does not require grad, "
                            f"got {scale!r}")
        scale = scale.item()
    elif isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a finite number or a 0-d CPU tensor that does not require grad, "
                        f"got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return float(scale)


def _check_like(t, t_name: str, ref: torch.Tensor, ref_name: str, kind: str = "a torch.Tensor",
                same_shape: bool = True) -> None:
    """``t`` is a tensor on ``ref``'s device with ``ref``'s dtype and (``same_shape``) shape (messages name
    both)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{t_name} must be {kind}, got {type(t).__name__}")
    if t.device != ref.device:
        raise ValueError(f"{t_name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{t_name} must have {ref_name}'s dtype ({ref.dtype}), got {t.dtype}")
    if same_shape and t.shape != ref.shape:
        raise ValueError(f"{t_name} must have {ref_name}'s shape {_shape(ref)}, got {_shape(t)}")


def _check_out(out, ref: torch.Tensor, ref_name: str) -> None:
    """An op's ``out=``: a tensor like ``ref`` (_check_like) that autograd would not see written: under grad mode
    it must not require grad (PyTorch's own out= variants refuse it too)."""
    _check_like(out, "out", ref, ref_name, "a torch.Tensor or None")
    if torch.is_grad_enabled() and out.requires_grad:
        raise ValueError("out must not require grad (out= records no gradient), got a tensor that requires grad")


def _requires_grad(*tensors) -> bool:
    """Whether autograd would record an op on these (tensors or None): grad mode on and one requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_no_grad_for_out(x: torch.Tensor, attn_mask: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """out= records no gradient (as PyTorch's own out= variants): refuse it under autograd."""
    if out is not None and _requires_grad(x, attn_mask):
        raise ValueError(
            "out must be None when x or attn_mask requires grad (out= records no gradient), got a tensor"
        )


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
            ``headdim ** -0.5``); a number, or a 0-d CPU tensor that does not require
            grad (read with ``float()``, as SDPA's ``scale``). Else TypeError.
        causal: a bool (else TypeError); mask key j for query i unless ``j <= i + seqlen_k - seqlen_q``
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

    Gradients: differentiable with respect to ``x`` and an additive float ``attn_mask``
    (summed over its broadcast dims). The backward is one fused pass on CUDA
    (``dx = scale * y * (dy - sum(dy * y))``, 0 at masked keys and on fully masked
    rows) and differentiable again. ``out=`` raises when an input requires grad.

    CPU tensors use the pure-PyTorch path (``fused_attn.reference``, float32; float64
    input is computed in float64) with the same semantics, differentiated by autograd.
    Works under ``torch.compile(fullgraph=True)`` and CUDA graph capture; never
    synchronizes the host.
    """
    if (out is None and not torch.compiler.is_compiling() and _ops.direct is not None and type(scale) is float
            and type(causal) is bool and type(version) is int):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            y = _ops.direct.scaled_masked_softmax(x, scale, attn_mask, causal, version)
        except (TypeError, ValueError):
            y = None  # bad input: the checks below raise it
        if y is not None:
            return y
    scale = check_args(x, scale, causal, attn_mask, out, version)
    check_no_grad_for_out(x, attn_mask, out)
    if x.device.type == "cpu":
        result = _cpu(x, scale, causal, attn_mask)
        if out is None:
            return result
        return out.copy_(result)
    if x.device.type == "cuda":  # meta tensors (and torch.compile's tracing) run the fake kernel: no build
        _ops.ensure_loaded()
    if out is None:
        return torch.ops.fused_attn.scaled_masked_softmax(x, scale, attn_mask, causal=causal, version=version)
    torch.ops.fused_attn.scaled_masked_softmax_out(x, scale, attn_mask, causal=causal, version=version, out=out)
    return out


def scaled_masked_softmax_backward(
    grad: torch.Tensor, y: torch.Tensor, scale: float = 1.0, *, causal: bool = False
) -> torch.Tensor:
    """The backward of ``scaled_masked_softmax``: ``dx = scale * y * (grad - sum_j grad * y)`` per row.

    Args:
        grad: ``[..., seqlen_q, seqlen_k]``, the gradient with respect to the output, y's dtype.
        y: the forward's output (its exact zeros carry the mask), float32 / float16 / bfloat16.
        scale: the forward's scale (1.0 gives the gradient with respect to an additive mask).
        causal: the forward's causal flag; keys past the causal edge are not read and get 0.

    Returns dx, y's shape and dtype (float32 arithmetic). Autograd calls this; it is public
    for benchmarks and for callers who keep y themselves.
    """
    scale = _check_backward_args(grad, y, scale, causal)
    if y.device.type == "cpu":
        return _backward_cpu(grad, y, scale, causal)
    if y.device.type == "cuda":
        _ops.ensure_loaded()
    return torch.ops.fused_attn.scaled_masked_softmax_backward(grad, y, scale, causal=causal)


def _check_backward_args(grad: torch.Tensor, y: torch.Tensor, scale: float | torch.Tensor, causal: bool) -> float:
    scale = check_args(y, scale, causal, None, None, 1, name="y")
    _check_like(grad, "grad", y, "y")
    return scale


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _cpu(x: torch.Tensor, scale: float, causal: bool, attn_mask: torch.Tensor | None) -> torch.Tensor:
    return reference.scaled_masked_softmax(
        x, scale, causal=causal, attn_mask=attn_mask, compute_dtype=_compute_dtype(x)
    )


def _backward_cpu(grad: torch.Tensor, y: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    return reference.scaled_masked_softmax_backward(grad, y, scale, causal=causal, compute_dtype=_compute_dtype(y))


# --------------------------------------------------------------------------- autograd


# Callers (opcheck, AOTAutograd) may leave defaulted positional arguments out: the inputs,
# needs_input_grad and the returned gradients then have that shorter length.
def _setup_context(ctx, inputs, keyword_only_inputs, output):
    scale = inputs[1] if len(inputs) > 1 else 1.0
    attn_mask = inputs[2] if len(inputs) > 2 else None
    ctx.scale = scale
    ctx.causal = keyword_only_inputs["causal"]
    ctx.mask_shape = None if attn_mask is None else attn_mask.shape
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    n_inputs = len(ctx.needs_input_grad)
    need_x, _, need_mask = (*ctx.needs_input_grad, False, False)[:3]
    bwd = torch.ops.fused_attn.scaled_masked_softmax_backward
    dx = bwd(grad, y, ctx.scale, causal=ctx.causal) if need_x else None
    dmask = None
    if need_mask:  # an additive mask enters as s = x * scale + mask: its gradient is dx at scale 1
        g = bwd(grad, y, 1.0, causal=ctx.causal)
        dmask = g.to(_compute_dtype(g)).sum_to_size(ctx.mask_shape).to(g.dtype)
    return (dx, None, dmask)[:n_inputs]


def _setup_context_backward(ctx, inputs, keyword_only_inputs, output):
    grad, y, scale = inputs
    ctx.scale = scale
    ctx.causal = keyword_only_inputs["causal"]
    ctx.save_for_backward(grad, y)


def _backward_backward(ctx, u):
    """Gradients of dx = s * y * (g - <g, y>) (over the visible keys): with respect to g it is the
    same map applied to u; with respect to y, s * (u * (g - <g, y>) - <u, y> * g)."""
    grad, y = ctx.saved_tensors
    need_grad, need_y = ctx.needs_input_grad[:2]
    d_grad = d_y = None
    if need_grad:
        d_grad = torch.ops.fused_attn.scaled_masked_softmax_backward(u, y, ctx.scale, causal=ctx.causal)
    if need_y:
        ct = _compute_dtype(y)
        g, yy, uu = grad.to(ct), y.to(ct), u.to(ct)
        if ctx.causal:
            visible = reference.causal_mask(y.shape[-2], y.shape[-1], y.device)
            g, yy, uu = g * visible, yy * visible, uu * visible
        dot_gy = (g * yy).sum(dim=-1, keepdim=True)
        dot_uy = (uu * yy).sum(dim=-1, keepdim=True)
        d_y = (ctx.scale * (uu * (g - dot_gy) - dot_uy * g)).to(y.dtype)
    return d_grad, d_y, None


def _out_autograd(x, scale, attn_mask, *, causal, version, out):
    """Autograd kernel of the out= variant: a clear error instead of a silently missing gradient."""
    check_no_grad_for_out(x, attn_mask, out)
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.fused_attn.scaled_masked_softmax_out(x, scale, attn_mask, causal=causal, version=version, out=out)


def _register() -> None:
    """CPU and fake kernels and autograd of the three ops (schemas: fused_attn/_ops.py), at import:
    CPU and meta tensors never need the CUDA library."""
    lib = "fused_attn::scaled_masked_softmax"

    @torch.library.register_fake(lib)
    def _fake(x, scale=1.0, attn_mask=None, *, causal=False, version=1):
        check_args(x, scale, causal, attn_mask, None, version)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake(lib + "_out")
    def _fake_out(x, scale, attn_mask, *, causal, version, out):
        check_args(x, scale, causal, attn_mask, out, version)

    @torch.library.register_fake(lib + "_backward")
    def _fake_backward(grad, y, scale, *, causal=False):
        _check_backward_args(grad, y, scale, causal)
        return torch.empty(y.shape, dtype=y.dtype, device=y.device)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, scale=1.0, attn_mask=None, *, causal=False, version=1):
        check_args(x, scale, causal, attn_mask, None, version)
        return _cpu(x, scale, causal, attn_mask)

    @torch.library.register_kernel(lib + "_out", "cpu")
    def _cpu_kernel_out(x, scale, attn_mask, *, causal, version, out):
        check_args(x, scale, causal, attn_mask, out, version)
        out.copy_(_cpu(x, scale, causal, attn_mask))

    @torch.library.register_kernel(lib + "_backward", "cpu")
    def _cpu_kernel_backward(grad, y, scale, *, causal=False):
        _check_backward_args(grad, y, scale, causal)
        return _backward_cpu(grad, y, scale, causal)

    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)
    torch.library.register_autograd(lib + "_backward", _backward_backward, setup_context=_setup_context_backward)
    _ops.LIB.impl("scaled_masked_softmax_out", _out_autograd, "Autograd")


_register()
