"""``layer_norm`` and ``rms_norm``: LayerNorm / RMSNorm over the last dim, with the residual add fused in.

The pre-LN transformer's ``h = x + residual; y = norm(h)`` in one pass over memory: x and the
residual read once, y and h written once. Public wrappers, argument validation, the fake (meta)
kernels, the CPU path (``fused_attn.reference.layer_norm`` in float32; float64 input in float64) and
autograd. The CUDA kernel is in ``csrc/layer_norm/`` (one kernel; RMSNorm is a template flag of it).

Ops (schemas in ``fused_attn/_ops.py``): ``layer_norm(x, weight, bias, eps, *, rms)`` -> y and
``add_layer_norm(x, residual, weight, bias, eps, x_index, residual_index, *, rms)`` -> (y, h) (the indices:
gathered rows, an embedding lookup added and normalized in one pass).

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


def _check_index(index, name: str, table, table_name: str, x: torch.Tensor) -> None:
    """x_index / residual_index: a 1-D int32 / int64 tensor on x's device; its table 2-D."""
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(index).__name__}")
    if index.device != x.device:
        raise ValueError(f"{name} must be on the same device as x ({x.device}), got {index.device}")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must have dtype torch.int32 or torch.int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must have 1 dim [rows], got {_shape(index)}")
    if table.dim() != 2:
        raise ValueError(f"{table_name} must have 2 dims [table rows, width] with {name}, got {_shape(table)}")


def out_shape(x: torch.Tensor, x_index: torch.Tensor | None) -> tuple[int, ...]:
    """The shape of y (and h): ``(len(x_index), width)`` with gathered rows, else x's."""
    return (x_index.shape[0], x.shape[-1]) if x_index is not None else tuple(x.shape)


def check_args(x, residual, weight, bias, eps, x_index=None, residual_index=None) -> float:
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
    if x_index is not None:
        _check_index(x_index, "x_index", x, "x", x)
    if residual_index is not None and x_index is None and x.dim() != 2:
        raise ValueError(f"x must have 2 dims [rows, width] with residual_index, got {_shape(x)}")
    if residual is not None:
        gathered = x_index is not None or residual_index is not None
        _check_like(residual, "residual", x, "x", "a torch.Tensor or None", same_shape=not gathered)
        if residual_index is not None:
            _check_index(residual_index, "residual_index", residual, "residual", x)
            if residual.shape[1] != x.shape[-1]:
                raise ValueError(f"residual must have x's width ({x.shape[-1]}), got {residual.shape[1]}")
            rows = x_index.shape[0] if x_index is not None else x.shape[0]
            if residual_index.shape[0] != rows:
                raise ValueError(f"residual_index must have length {rows} (the rows of y), "
                                 f"got {residual_index.shape[0]}")
        elif gathered and tuple(residual.shape) != out_shape(x, x_index):
            raise ValueError(f"residual must have shape (len(x_index), width) {_shape(out_shape(x, x_index))}, "
                             f"got {_shape(residual)}")
    _check_affine(weight, "weight", x)
    _check_affine(bias, "bias", x)
    return float(eps)


def _call(x, residual, weight, bias, eps, rms: bool, x_index=None, residual_index=None):
    if not torch.compiler.is_compiling() and _ops.direct is not None and type(eps) is float:
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            if residual is None and x_index is None and residual_index is None:
                y = _ops.direct.layer_norm(x, weight, bias, eps, rms)
            else:
                y = _ops.direct.add_layer_norm(x, residual, weight, bias, eps, x_index, residual_index, rms)
        except (TypeError, ValueError):
            y = None  # bad input: the checks below raise it
        if y is not None:
            return y
    if residual is None:
        for name, index in (("x_index", x_index), ("residual_index", residual_index)):
            if index is not None:
                raise ValueError(f"{name} must be None without a residual (gathered rows are added, then "
                                 f"normalized), got a {type(index).__name__}")
    eps = check_args(x, residual, weight, bias, eps, x_index, residual_index)
    if x.device.type == "cuda":  # meta tensors (and torch.compile's tracing) run the fake kernel: no build
        _ops.ensure_loaded()
    if residual is None:
        return torch.ops.fused_attn.layer_norm(x, weight, bias, eps, rms=rms)
    y, h = torch.ops.fused_attn.add_layer_norm(x, residual, weight, bias, eps, x_index, residual_index, rms=rms)
    return y, h


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
    residual_index: torch.Tensor | None = None,
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
        x_index, residual_index: None, or 1-D int32 / int64 on x's device (with a residual only):
            gathered rows, row i of x is ``x[x_index[i]]`` of a 2-D ``[table rows, width]`` x, likewise
            of the residual; y and h are then ``[rows, width]``. GPT-2's embedding and first norm in one
            launch: ``layer_norm(wte, w, b, residual=wpe, x_index=token, residual_index=pos)``. An index
            outside ``[0, table rows)`` (negative ones included) makes that row of y and h NaN and reads
            nothing (a device-side value: no error without a host sync). Gradients reach the tables at
            the gathered rows.

    Returns y (x's shape and dtype), or ``(y, h)`` with a residual: ``h = x + residual`` rounded to
    x's dtype (bit for bit PyTorch's ``x + residual``) and ``y = layer_norm(h)``. Statistics are
    float32, the variance two-pass over the row (not E[h²] - E[h]²): a row of equal values gives
    exactly ``bias`` (0 without one), at any magnitude. A NaN in a row makes its y row NaN. Empty
    inputs give empty outputs.

    Gradients with respect to x, residual, weight and bias (the closed form in float32, on any
    device). On CUDA it launches on the current stream, never synchronizes the host, works under
    CUDA-graph capture and ``torch.compile(fullgraph=True)``.
    """
    return _call(x, residual, weight, bias, eps, rms=False, x_index=x_index, residual_index=residual_index)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
    residual_index: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (Llama): ``y = h * rsqrt(mean(h²) + eps) * weight`` with ``h = x``, or
    ``h = x + residual`` returned as ``(y, h)``. Same arguments, dtypes, edge cases and gradients as
    ``layer_norm`` (no bias). Computed in float32 and rounded once (Hugging Face's LlamaRMSNorm rounds
    the normalized value to x's dtype before the weight multiply: within one rounding of this)."""
    return _call(x, residual, weight, None, eps, rms=True, x_index=x_index, residual_index=residual_index)


# --------------------------------------------------------------------------- CPU, fake, autograd


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gather_rows(table: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``table[index]`` with a NaN row for every index outside ``[0, len(table))`` (the kernel's rule);
    ``table`` itself without an index. Differentiable: gradients reach the gathered rows of the table."""
    if index is None:
        return table
    index = index.long()
    ok = (index >= 0) & (index < table.shape[0])
    rows = table[index.clamp(0, max(table.shape[0] - 1, 0))] if table.shape[0] else table.new_zeros(
        (index.shape[0], table.shape[1]))
    return torch.where(ok[:, None], rows, torch.full_like(rows, math.nan))


def _cpu(x, residual, weight, bias, eps, rms, x_index=None, residual_index=None):
    x, residual = gather_rows(x, x_index), None if residual is None else gather_rows(residual, residual_index)
    return reference.layer_norm(x, weight, bias, eps, residual=residual, rms=rms, compute_dtype=_compute_dtype(x))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps, ctx.rms = eps, keyword_only_inputs.get("rms", False)
    ctx.save_for_backward(x, weight, bias)


def _setup_context_add(ctx, inputs, keyword_only_inputs, output):
    x, residual, weight, bias, eps, x_index, residual_index = inputs
    ctx.eps, ctx.rms = eps, keyword_only_inputs.get("rms", False)
    ctx.save_for_backward(x, residual, weight, bias, x_index, residual_index)


def _grads(ctx, grad_y, grad_h, x, residual, weight, bias):
    dx, dr, dw, db = reference.layer_norm_backward(grad_y, grad_h, x, residual, weight, bias, ctx.eps, rms=ctx.rms,
                                                   compute_dtype=_compute_dtype(x))
    return dx, dr, dw, db


def _backward(ctx, grad_y):
    x, weight, bias = ctx.saved_tensors
    dx, _, dw, db = _grads(ctx, grad_y, None, x, None, weight, bias)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None)


def _in_range(index: torch.Tensor | None, rows: int) -> torch.Tensor | bool:
    return True if index is None else (index >= 0) & (index < rows)


def _scatter_rows(grad: torch.Tensor, index: torch.Tensor | None, shape: torch.Size, live: torch.Tensor) -> torch.Tensor:
    """The gradients of the live rows (``live``: a mask over y's rows) back into the operand's shape: at
    their gathered rows of the table (summed where an index repeats), or at their own rows without one."""
    table = grad.new_zeros(shape)
    if index is None:
        table[live] = grad
        return table
    return table.index_add_(0, index.long(), grad)


def _backward_add(ctx, grad_y, grad_h):
    x, residual, weight, bias, x_index, residual_index = ctx.saved_tensors
    xs, rs = gather_rows(x, x_index), gather_rows(residual, residual_index)
    if x_index is None and residual_index is None:
        dx, dr, dw, db = _grads(ctx, grad_y, grad_h, xs, rs, weight, bias)
    else:
        # A row with an index out of range (NaN in y and h) gives no gradient to anything.
        live = _in_range(x_index, x.shape[0]) & _in_range(residual_index, residual.shape[0])
        gh = None if grad_h is None else grad_h[live]
        dxl, drl, dw, db = _grads(ctx, grad_y[live], gh, xs[live], rs[live], weight, bias)
        dx = _scatter_rows(dxl, None if x_index is None else x_index[live], x.shape, live)
        dr = _scatter_rows(drl, None if residual_index is None else residual_index[live], residual.shape, live)
    need = ctx.needs_input_grad
    return tuple(g if n else None for g, n in zip((dx, dr, dw, db), need[:4])) + (None, None, None)


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
    def _fake_add(x, residual, weight, bias, eps, x_index=None, residual_index=None, *, rms=False):
        check_args(x, residual, weight, bias, eps, x_index, residual_index)
        shape = out_shape(x, x_index)
        return torch.empty(shape, dtype=x.dtype, device=x.device), torch.empty(shape, dtype=x.dtype, device=x.device)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, weight, bias, eps, *, rms=False):
        eps = check_args(x, None, weight, bias, eps)
        return _cpu(x, None, weight, bias, eps, rms)

    @torch.library.register_kernel(add, "cpu")
    def _cpu_kernel_add(x, residual, weight, bias, eps, x_index=None, residual_index=None, *, rms=False):
        eps = check_args(x, residual, weight, bias, eps, x_index, residual_index)
        return _cpu(x, residual, weight, bias, eps, rms, x_index, residual_index)

    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)
    torch.library.register_autograd(add, _backward_add, setup_context=_setup_context_add)


_register()
