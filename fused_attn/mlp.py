"""``mlp``: a transformer's feed-forward block, as one launch or as two epilogue-fused ``fused_attn.linear``
launches.

    GPT-2:  y = c_proj(gelu_tanh(c_fc(x))) + residual          activation="gelu_tanh"
    Llama:  y = down(silu(gate(x)) * up(x)) + residual          activation="swiglu"

For the SwiGLU form the gate and up projections are one weight, gate rows over up rows
(``torch.cat([gate.weight, up.weight])``, ``[2 * hidden, in_features]``): the first projection reads
both once and writes ``silu(gate) * up`` directly, so the hidden activations cross memory once, in
x's dtype.

Two ways to run it on CUDA, the same arithmetic either way (float32 accumulation, the hidden
activations and the output each rounded once to x's dtype; only the order of the float32 sums differs):
- two launches: ``linear`` with the activation, then ``linear`` with the residual (the CPU path, meta,
  ``torch.compile`` and autograd come from that op);
- one launch: the ``mlp`` op (``csrc/mlp/``) for float16 / bfloat16 and 1-16 rows: one grid computes
  the hidden tiles, waits until all are stored through a counter in ``workspace``, and computes the
  output (``csrc/mlp/mlp_kernel.cuh``). Where its kernel does not apply (other dtypes, more rows,
  in_features or hidden not a multiple of 8, misaligned rows, a device before sm_90, a grid the device
  cannot hold at once) the op runs the two launches itself.
The default is the two launches: measured on an H100 (bench/NOTES.md, session 17), the one launch is
slower in GPT-2's chained decode step at batch 8 and 16 (+1-4 and +12-15 us a step; under programmatic
dependent launch the two launches already overlap, and the grid-wide wait costs more than the hop it
replaces) and, alone, at every M but 16 (GPT-2's MLP: M 1 11.1 against 10.1 us, M 4 11.5 against 10.4,
M 16 12.7 against 13.1; Llama-2-7B's 107-133 against 95-104). Loading both weights from the kernel's
start (two register sets, 2 blocks per SM) was slower still.
"""

from __future__ import annotations

import torch

from fused_attn import _ops
from fused_attn.layer_norm import layer_norm, rms_norm
from fused_attn.linear import (ACTIVATIONS, NORMS, _check_param, _reference, check_args, check_norm, check_workspace,
                               gradless_autograd, linear, norm_code)
from fused_attn.softmax import _requires_grad

MLP_ACTIVATIONS = ("gelu_tanh", "swiglu")
# The op's int32 workspace: the single launch's two counters (kMlpWorkspaceWords in csrc/mlp/mlp_launch.h).
WORKSPACE_WORDS = 2


def new_workspace(device) -> torch.Tensor:
    """A workspace for ``mlp(..., workspace=)``: int32 zeros, reusable by the calls of one stream."""
    return torch.zeros(WORKSPACE_WORDS, dtype=torch.int32, device=device)


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
    single_launch: bool = False,
    workspace: torch.Tensor | None = None,
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
            ``fused_attn.linear``'s arguments of those names. With the one launch, x is normalized
            by ``fused_attn.layer_norm`` / ``rms_norm`` first (what ``linear`` does at 2-16 rows, but at
            2-8 rows without ``norm_weight`` / ``norm_bias`` where its tensor-core kernel folds the norm).
        single_launch: True: the ``mlp`` op (one launch where its kernel applies, see the module
            docstring); False (default, the measured winner): two ``linear`` launches. An input that requires grad always runs the
            two launches (their backward).
        workspace: for the one launch, an int32 tensor of >= ``WORKSPACE_WORDS`` elements, zeros
            before its first use (each call leaves it zero; ``new_workspace``), so calls sharing one
            must run one after the other (one stream). None: a fresh one per call (one fill launch
            more).

    Returns ``[..., d_out]`` in x's dtype. The hidden activations are rounded to x's dtype (as an
    eager chain in that dtype does); each projection accumulates in float32.
    """
    if not isinstance(activation, str) or activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be 'gelu_tanh' or 'swiglu', got {activation!r}")
    if not isinstance(single_launch, bool):
        raise TypeError(f"single_launch must be a bool, got {type(single_launch).__name__}")
    code = ACTIVATIONS[activation]
    check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, code)
    ncode = norm_code(norm)
    eps = check_norm(x, ncode, norm_weight, norm_bias, eps)
    if workspace is not None:
        check_workspace(x, workspace, WORKSPACE_WORDS)
    if single_launch and not _requires_grad(x, w_fc, b_fc, w_proj, b_proj, residual, norm_weight, norm_bias):
        if ncode == NORMS["rms_norm"]:
            x = rms_norm(x, norm_weight, eps)
        elif ncode:
            x = layer_norm(x, norm_weight, norm_bias, eps)
        if workspace is None:
            workspace = new_workspace(x.device)
        if x.device.type == "cuda":
            _ops.ensure_loaded()
        return torch.ops.fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, activation=code)
    h = linear(x, w_fc, b_fc, activation=activation, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps)
    return linear(h, w_proj, b_proj, residual=residual)


# --------------------------------------------------------------------------- the op's CPU, fake, autograd


def _register() -> None:
    lib = "fused_attn::mlp"

    def _checks(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, activation):
        if activation not in (ACTIVATIONS["gelu_tanh"], ACTIVATIONS["swiglu"]):
            raise ValueError(f"activation must be 1 (gelu_tanh) or 2 (swiglu), got {activation!r}")
        d_out = check_mlp_args(x, w_fc, b_fc, w_proj, b_proj, residual, activation)
        check_workspace(x, workspace, WORKSPACE_WORDS)
        return d_out

    @torch.library.register_fake(lib)
    def _fake(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, *, activation=1):
        d_out = _checks(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, activation)
        return x.new_empty((*x.shape[:-1], d_out))

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, *, activation=1):
        _checks(x, w_fc, b_fc, w_proj, b_proj, residual, workspace, activation)
        h = _reference(x, w_fc, b_fc, None, None, None, activation, 0, 0.0)
        return _reference(h, w_proj, b_proj, residual, None, None, 0, 0, 0.0)

    names = ("x", "w_fc", "b_fc", "w_proj", "b_proj", "residual")
    _ops.LIB.impl("mlp", gradless_autograd("mlp", names, "fused_attn.mlp runs two linear launches"), "Autograd")

_register()
