"""``layer_norm`` and ``rms_norm``: LayerNorm / RMSNorm over the last dim, with the residual add fused in.

The pre-LN transformer's ``h = x + residual; y = norm(h)`` in one pass over memory: x and the
residual read once, y and h written once. Public wrappers, argument validation, the fake (meta)
kernels, the CPU path (``fused_attn.reference.layer_norm`` in float32; float64 input in float64) and
autograd. The CUDA kernel is in ``csrc/layer_norm/`` (one kernel; RMSNorm is a template flag of it).

Ops (schemas in ``fused_attn/_ops.py``): ``layer_norm(x, weight, bias, eps, *, rms)`` -> y and
``add_layer_norm(x, residual, weight, bias, eps, *, rms)`` -> (y, h).

Gradients: with respect to x, residual, weight and bias, through the closed-form backward of the
reference (``fused_attn.reference.layer_norm_backward``: plain PyTorch in float32, float64 for
float64 input; correct, not fused), itself differentiable.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from fused_attn import _ops, reference
from fused_attn.softmax import _check_like, _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# float64 runs on the CPU path only (torch.autograd.gradcheck needs it); there is no float64 kernel.
_CPU_DTYPES = _DTYPES + (torch.float64,)
MIN_WIDTH, MAX_WIDTH = 64, 16384  # the CUDA kernel's widths; the CPU path takes any


def _check_affine(t, name: str, x: torch.Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the same device as x ({x.device}), got {t.device}")
    if t.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"{name} must have x's dtype ({x.dtype}) or torch.float32, got {t.dtype}")
    width = x.shape[-1]
    if tuple(t.shape) != (width,):
        raise ValueError(f"{name} must have shape (width,) = ({width},), got {_shape(t)}")


def eps_value(eps) -> float:
    """A norm's epsilon as a float: TypeError / ValueError unless a finite number >= 0 (the message every
    op with an ``eps`` raises)."""
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_args(x, residual, weight, bias, eps) -> float:
    """Raise TypeError (wrong type) / ValueError (bad value) naming the bad argument (the messages of
    csrc/layer_norm/layer_norm.cpp); return ``eps`` as a float. The wrapper, the CPU and the fake
    kernels all check here, so every path takes the same arguments."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    cpu = x.device.type == "cpu"
    if x.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"x must have dtype {names}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim [..., width], got {_shape(x)}")
    if not cpu and not MIN_WIDTH <= x.shape[-1] <= MAX_WIDTH:
        raise ValueError(f"x must have a width (last dim) in [{MIN_WIDTH}, {MAX_WIDTH}] on CUDA, got {x.shape[-1]}")
    eps = eps_value(eps)
    if residual is not None:
        _check_like(residual, "residual", x, "x", "a torch.Tensor or None")
    _check_affine(weight, "weight", x)
    _check_affine(bias, "bias", x)
    return float(eps)


def _call(x, residual, weight, bias, eps, rms: bool):
    eps = check_args(x, residual, weight, bias, eps)
    if x.device.type == "cuda":  # meta tensors (and torch.compile's tracing) run the fake kernel: no build
        _ops.ensure_loaded()
    if residual is None:
        return torch.ops.fused_attn.layer_norm(x, weight, bias, eps, rms=rms)
    y, h = torch.ops.fused_attn.add_layer_norm(x, residual, weight, bias, eps, rms=rms)
    return y, h


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim, as ``F.layer_norm(x, (width,), weight, bias, eps)``; with
    ``residual``, first ``h = x + residual`` (the pre-LN transformer's add + norm, one pass).

    Args:
        x: ``[..., width]`` float32, float16 or bfloat16 (float64 on the CPU). Any strides (a layout
            whose rows cannot be viewed with a contiguous last dim is copied once). Width 64..16384
            on CUDA, any on the CPU.
        weight, bias: ``[width]``, x's dtype or float32, or None (1 / 0).
        eps: finite, >= 0, added to the variance.
        residual: None, or a tensor of x's shape, dtype and device.

    Returns y (x's shape and dtype), or ``(y, h)`` with a residual: ``h = x + residual`` rounded to
    x's dtype (bit for bit PyTorch's ``x + residual``) and ``y = layer_norm(h)``. Statistics are
    float32, the variance two-pass over the row (not E[h²] - E[h]²): a row of equal values gives
    exactly ``bias`` (0 without one), at any magnitude. A NaN in a row makes its y row NaN. Empty
    inputs give empty outputs.

    Gradients with respect to x, residual, weight and bias (the closed form in float32, on any
    device). On CUDA it launches on the current stream, never synchronizes the host, works under
    CUDA-graph capture and ``torch.compile(fullgraph=True)``.
    """
    return _call(x, residual, weight, bias, eps, rms=False)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (Llama): ``y = h * rsqrt(mean(h²) + eps) * weight`` with ``h = x``, or
    ``h = x + residual`` returned as ``(y, h)``. Same arguments, dtypes, edge cases and gradients as
    ``layer_norm`` (no bias). Computed in float32 and rounded once (Hugging Face's LlamaRMSNorm rounds
    the normalized value to x's dtype before the weight multiply: within one rounding of this)."""
    return _call(x, residual, weight, None, eps, rms=True)


# --------------------------------------------------------------------------- CPU, fake, autograd


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cpu(x, residual, weight, bias, eps, rms):
    return reference.layer_norm(x, weight, bias, eps, residual=residual, rms=rms, compute_dtype=_compute_dtype(x))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps, ctx.rms = eps, keyword_only_inputs.get("rms", False)
    ctx.save_for_backward(x, weight, bias)


def _setup_context_add(ctx, inputs, keyword_only_inputs, output):
    x, residual, weight, bias, eps = inputs
    ctx.eps, ctx.rms = eps, keyword_only_inputs.get("rms", False)
    ctx.save_for_backward(x, residual, weight, bias)


def _grads(ctx, grad_y, grad_h, x, residual, weight, bias):
    dx, dr, dw, db = reference.layer_norm_backward(grad_y, grad_h, x, residual, weight, bias, ctx.eps, rms=ctx.rms,
                                                   compute_dtype=_compute_dtype(x))
    return dx, dr, dw, db


def _backward(ctx, grad_y):
    x, weight, bias = ctx.saved_tensors
    dx, _, dw, db = _grads(ctx, grad_y, None, x, None, weight, bias)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None)


def _backward_add(ctx, grad_y, grad_h):
    x, residual, weight, bias = ctx.saved_tensors
    dx, dr, dw, db = _grads(ctx, grad_y, grad_h, x, residual, weight, bias)
    need = ctx.needs_input_grad
    return tuple(g if n else None for g, n in zip((dx, dr, dw, db), need[:4])) + (None,)


def _register() -> None:
    """CPU and fake kernels and autograd of the two ops (schemas: fused_attn/_ops.py), at import:
    CPU and meta tensors never need the CUDA library."""
    lib = "fused_attn::layer_norm"
    add = "fused_attn::add_layer_norm"

    @torch.library.register_fake(lib)
    def _fake(x, weight, bias, eps, *, rms=False):
        check_args(x, None, weight, bias, eps)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake(add)
    def _fake_add(x, residual, weight, bias, eps, *, rms=False):
        check_args(x, residual, weight, bias, eps)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype,
                                                                                  device=x.device)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, weight, bias, eps, *, rms=False):
        eps = check_args(x, None, weight, bias, eps)
        return _cpu(x, None, weight, bias, eps, rms)

    @torch.library.register_kernel(add, "cpu")
    def _cpu_kernel_add(x, residual, weight, bias, eps, *, rms=False):
        eps = check_args(x, residual, weight, bias, eps)
        return _cpu(x, residual, weight, bias, eps, rms)

    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)
    torch.library.register_autograd(add, _backward_add, setup_context=_setup_context_add)


_register()
