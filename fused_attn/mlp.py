"""``mlp``: a transformer's feed-forward block, as two epilogue-fused ``fused_attn.linear`` launches.

    GPT-2:  y = c_proj(gelu_tanh(c_fc(x))) + residual          activation="gelu_tanh"
    Llama:  y = down(silu(gate(x)) * up(x)) + residual          activation="swiglu"

For the SwiGLU form the gate and up projections are one weight, gate rows over up rows
(``torch.cat([gate.weight, up.weight])``, ``[2 * hidden, in_features]``): the first projection reads
both once and writes ``silu(gate) * up`` directly, so the hidden activations cross memory once, in
x's dtype.

``linear`` with the activation, then ``linear`` with the residual (float32 accumulation, the hidden
activations and the output each rounded once to x's dtype). The ``mlp`` op (``torch.ops.fused_attn.mlp``,
``csrc/mlp/mlp.cpp``) runs the same two launches from one dispatcher call, without the norm.
"""

from __future__ import annotations

import torch

from fused_attn import _ops
from fused_attn.linear import ACTIVATIONS, _check_param, _reference, check_args, check_norm, linear, norm_code
from fused_attn.softmax import _requires_grad

MLP_ACTIVATIONS = ("gelu_tanh", "swiglu")


def check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, activation: int) -> int:
    """Raise TypeError / ValueError naming the bad argument (csrc/mlp/mlp.cpp checks the same); return
    the output's width."""
    hidden = check_args(x, w_fc, b_fc, None, activation, names=("x", "w_fc", "b_fc", "residual"))
    if not isinstance(w_proj, torch.Tensor):
        raise TypeError(f"w_proj must be a torch.Tensor, got {type(w_proj).__name__}")
    if w_proj.dim() != 2 or w_proj.shape[1] != hidden:
        raise ValueError(f"w_proj must have shape [d_out, hidden] with hidden = {hidden} (from w_fc), "
                         f"got {tuple(w_proj.shape)}")
    d_out = w_proj.shape[0]
    _check_param(w_proj, "w_proj", x, "x", (d_out, hidden))
    if b_proj is not None:
        _check_param(b_proj, "b_proj", x, "x", (d_out,))
    if residual is not None:
        _check_param(residual, "residual", x, "x", (*x.shape[:-1], d_out))
    return d_out


def mlp(
    x: torch.Tensor,
    w_fc: torch.Tensor,
    b_fc: torch.Tensor | None,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor | None,
    *,
    activation: str = "gelu_tanh",
    residual: torch.Tensor | None = None,
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``linear(act(linear(norm(x), w_fc, b_fc)), w_proj, b_proj) + residual``.

    Args:
        x: ``[..., d_model]`` float16, bfloat16 or float32 (float64 on the CPU).
        w_fc: ``[hidden, d_model]`` for ``"gelu_tanh"``; ``[2 * hidden, d_model]`` (gate rows over
            up rows) for ``"swiglu"``. ``b_fc``: None or ``[w_fc.shape[0]]``.
        w_proj: ``[d_out, hidden]``; ``b_proj``: None or ``[d_out]``.
        activation: ``"gelu_tanh"`` (GPT-2: ``F.gelu(approximate="tanh")``) or ``"swiglu"``
            (Llama: ``silu(gate) * up``).
        residual: optional ``[..., d_out]``, added to the output (the block's skip connection).
        norm, norm_weight, norm_bias, eps: the pre-normalization of x (a pre-LN block's ln_2):
            ``fused_attn.linear``'s arguments of those names (the first launch's).

    Returns ``[..., d_out]`` in x's dtype. The hidden activations are rounded to x's dtype (as an
    eager chain in that dtype does); each projection accumulates in float32.
    """
    if (norm is None and norm_weight is None and norm_bias is None and not torch.compiler.is_compiling()
            and _ops.direct is not None and type(activation) is str and activation in MLP_ACTIVATIONS):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            y = _ops.direct.mlp(x, w_fc, b_fc, w_proj, b_proj, residual, ACTIVATIONS[activation])
        except (TypeError, ValueError):
            y = None  # bad input: the checks below raise it
        if y is not None:
            return y
    if not isinstance(activation, str) or activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be 'gelu_tanh' or 'swiglu', got {activation!r}")
    code = ACTIVATIONS[activation]
    check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, code)
    ncode = norm_code(norm)
    eps = check_norm(x, ncode, norm_weight, norm_bias, eps)
    h = linear(x, w_fc, b_fc, activation=activation, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps)
    return linear(h, w_proj, b_proj, residual=residual)


# --------------------------------------------------------------------------- the op's CPU, fake, autograd


def _register() -> None:
    lib = "fused_attn::mlp"

    def _checks(x, w_fc, b_fc, w_proj, b_proj, residual, activation):
        if activation not in (ACTIVATIONS["gelu_tanh"], ACTIVATIONS["swiglu"]):
            raise ValueError(f"activation must be 1 (gelu_tanh) or 2 (swiglu), got {activation!r}")
        return check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, activation)

    @torch.library.register_fake(lib)
    def _fake(x, w_fc, b_fc, w_proj, b_proj, residual, *, activation=1):
        d_out = _checks(x, w_fc, b_fc, w_proj, b_proj, residual, activation)
        return x.new_empty((*x.shape[:-1], d_out))

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, w_fc, b_fc, w_proj, b_proj, residual, *, activation=1):
        _checks(x, w_fc, b_fc, w_proj, b_proj, residual, activation)
        h = _reference(x, w_fc, b_fc, None, None, None, activation, 0, 0.0)
        return _reference(h, w_proj, b_proj, residual, None, None, 0, 0, 0.0)

    names = ("x", "w_fc", "b_fc", "w_proj", "b_proj", "residual")

    def _autograd(*args, **kwargs):
        """The op records no gradient: a clear error naming the first input that requires grad."""
        for name, t in zip(names, args):
            if _requires_grad(t):
                raise ValueError(f"{name} must not require grad (the mlp op records no gradient; fused_attn.mlp "
                                 f"runs two linear launches when a gradient is wanted), got requires_grad=True")
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.fused_attn.mlp(*args, **kwargs)

    _ops.LIB.impl("mlp", _autograd, "Autograd")


_register()
