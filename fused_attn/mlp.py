"""``mlp``: a transformer's feed-forward block as two epilogue-fused ``fused_attn.linear`` launches.

    GPT-2:  y = c_proj(gelu_tanh(c_fc(x))) + residual          activation="gelu_tanh"
    Llama:  y = down(silu(gate(x)) * up(x)) + residual          activation="swiglu"

For the SwiGLU form the gate and up projections are one weight, gate rows over up rows
(``torch.cat([gate.weight, up.weight])``, ``[2 * hidden, in_features]``): the first launch reads
both once and writes ``silu(gate) * up`` directly, so the hidden activations cross memory once, in
x's dtype. No schema of its own: it is Python composing the ``linear`` op (CPU, meta,
``torch.compile`` and autograd come from there). A single-launch version (the second projection
waiting on the first through a grid-wide dependency) is not implemented.
"""

from __future__ import annotations

import torch

from fused_attn.linear import ACTIVATIONS, check_args, linear

MLP_ACTIVATIONS = ("gelu_tanh", "swiglu")


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
        norm, norm_weight, norm_bias, eps: the pre-normalization of x (a pre-LN block's ln_2), in the
            first launch's prologue: ``fused_attn.linear``'s arguments of those names.

    Returns ``[..., d_out]`` in x's dtype. The hidden activations are rounded to x's dtype between
    the two launches (as an eager chain in that dtype does); each launch accumulates in float32.
    """
    if not isinstance(activation, str) or activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be 'gelu_tanh' or 'swiglu', got {activation!r}")
    hidden = check_args(x, w_fc, b_fc, None, ACTIVATIONS[activation], names=("x", "w_fc", "b_fc", "residual"))
    if not isinstance(w_proj, torch.Tensor):
        raise TypeError(f"w_proj must be a torch.Tensor, got {type(w_proj).__name__}")
    if w_proj.dim() != 2 or w_proj.shape[1] != hidden:
        raise ValueError(f"w_proj must have shape [d_out, hidden] with hidden = {hidden} (from w_fc), "
                         f"got {tuple(w_proj.shape)}")
    h = linear(x, w_fc, b_fc, activation=activation, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps)
    check_args(h, w_proj, b_proj, residual, 0, names=("x", "w_proj", "b_proj", "residual"))
    return linear(h, w_proj, b_proj, residual=residual)
