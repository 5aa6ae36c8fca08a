"""``linear``: y = act(norm(x) · weightᵀ + bias) + residual, the epilogue (and optionally the
LayerNorm / RMSNorm of x) fused into the matmul.

The projections of a transformer layer. Public wrapper, argument validation, the fake (meta)
kernel, the CPU path (``fused_attn.reference.linear`` in float32) and autograd. The CUDA kernel is in
``csrc/linear/``: for up to ``MAX_GEMV_ROWS`` rows of x (decode) our weight-streaming kernel, which
reads the weight once at the copy bandwidth with bias, activation and residual in its epilogue (on
CUDA cores; from 2 rows in float16 / bfloat16 on tensor cores (one row too where no norm is folded
in, K <= 4096 and the weight has a 16-row tile per SM), mma.sync with the weight as the
16-row operand, K split over the blocks of a thread-block cluster where the weight has fewer 16-row
tiles than the GPU has SMs, e.g. GPT-2's 768 outputs; the same two kernels' wide build to ``MAX_MMA_ROWS``
rows on sm_90 where the weight's rows are 16-byte pieces); above that, cuBLAS (in float16 / bfloat16 one
cuBLASLt call with the bias, GELU and, without GELU, the residual as its C operand in the epilogue;
elsewhere ATen's ``addmm`` and the rest of the epilogue in place; SwiGLU as one pass of our own over
the gate and up columns). With ``norm`` and one row of x, the norm runs in our kernel's launch: in float16 /
bfloat16 without the norm's weight and bias (a caller that folded them into ``weight`` and ``bias``, as
``fused_attn.gpt2``'s "folded" backend does) folded into the dot products (the row's sums ride along
the matmul and its rstd is applied in the epilogue: nothing waits for the statistics), otherwise in the
kernel's prologue. At 2-8 rows without the norm's weight and bias the tensor-core kernel does the same
where it runs in one wave (in_features <= 768, 1-3 tiles of 16 weight rows per SM: GPT-2's c_attn and
c_fc): the MMAs multiply x as it is, the row statistics are summed from x's pieces alongside, and the
epilogue applies rstd (w · x - mean sum(w)); a block with a row whose mean is more than 8 standard
deviations from 0 (where that subtraction would cancel too many bits; an all-equal row) redoes its
products on the normalized rows (at 9-16 rows it measured slower in GPT-2's step than the norm's own
launch). For other rows, and in float32 beyond what the prologue's shared memory
holds, x is normalized by ``fused_attn.layer_norm``'s kernel first (one launch more). The folds do not
round the normalized row to x's dtype as the other paths do (their result is closer to float64, not bit
for bit theirs).

Gradients: a backward registered with ``torch.library.register_autograd`` that recomputes the op
through the PyTorch reference (float32; float64 for float64 inputs) and differentiates it: correct,
not fast.
"""

from __future__ import annotations

import torch

from fused_attn import _ops, reference
from fused_attn.layer_norm import eps_value
from fused_attn.softmax import _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = _DTYPES + (torch.float64,)
# The schema's int codes (csrc/linear/linear_launch.h, LinearActivation).
ACTIVATIONS = {None: 0, "gelu_tanh": 1, "swiglu": 2}
_NAMES = {code: name for name, code in ACTIVATIONS.items()}
# The pre-normalization's codes (LinearNorm in csrc/linear/linear_launch.h).
NORMS = {None: 0, "layer_norm": 1, "rms_norm": 2}
_NORM_NAMES = {code: name for name, code in NORMS.items()}
# Rows of x (the product of its leading dims) up to which our CUDA kernels run (kMaxGemvRows in
# csrc/linear/linear.cpp); above it, cuBLAS, except MAX_MMA_ROWS below.
MAX_GEMV_ROWS = 16
# Up to this many rows float16 / bfloat16 x still runs our tensor-core kernels (their wide build, on sm_90, where
# the weight's rows are 16-byte pieces and K is a multiple of 8: kMmaWideMaxRows in csrc/linear/linear.cpp).
MAX_MMA_ROWS = 64
_KEYS = (str, type(None))  # the types activation / norm may have


def activation_code(activation) -> int:
    if not isinstance(activation, (str, type(None))) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'gelu_tanh' or 'swiglu', got {activation!r}")
    return ACTIVATIONS[activation]


def norm_code(norm) -> int:
    if not isinstance(norm, (str, type(None))) or norm not in NORMS:
        raise ValueError(f"norm must be None, 'layer_norm' or 'rms_norm', got {norm!r}")
    return NORMS[norm]


def check_norm(x: torch.Tensor, norm: int, norm_weight, norm_bias, eps) -> float:
    """Raise TypeError / ValueError naming the bad pre-normalization argument (after ``check_args`` has
    checked x); return ``eps`` as a float. The messages of csrc/linear/linear.cpp. norm_weight / norm_bias:
    None, or [in_features] tensors on x's device in x's dtype or float32; none without the norm (code 0),
    no bias with rms_norm."""
    if norm not in _NORM_NAMES:
        raise ValueError(f"norm must be 0 (none), 1 (layer_norm) or 2 (rms_norm), got {norm!r}")
    eps = eps_value(eps)
    size = x.shape[-1]
    for t, name in ((norm_weight, "norm_weight"), (norm_bias, "norm_bias")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if norm == 0:
            raise ValueError(f"{name} must be None without a norm, got a tensor")
        if t.device != x.device:
            raise ValueError(f"{name} must be on the same device as x ({x.device}), got {t.device}")
        if t.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"{name} must have x's dtype ({x.dtype}) or torch.float32, got {t.dtype}")
        if tuple(t.shape) != (size,):
            raise ValueError(f"{name} must have shape (in_features,) = ({size},), got {_shape(t)}")
    if norm == NORMS["rms_norm"] and norm_bias is not None:
        raise ValueError("norm_bias must be None with rms_norm, got a tensor")
    return float(eps)


def _check_tensor_on(t, name: str, x: torch.Tensor, xn: str = "x") -> None:
    """An optional argument that was given: a tensor on ``x``'s device (``xn``: x's name in the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the same device as {xn} ({x.device}), got {t.device}")


def _check_param(t, name: str, x: torch.Tensor, xn: str, shape: tuple) -> None:
    _check_tensor_on(t, name, x, xn)
    if t.dtype != x.dtype:
        raise ValueError(f"{name} must have {xn}'s dtype ({x.dtype}), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(t)}")


def check_args(x, weight, bias, residual, activation: int, names=("x", "weight", "bias", "residual")) -> int:
    """Raise TypeError / ValueError naming the bad argument (the C++ launcher repeats the checks that
    guard memory); return the number of output features. ``names``: what the caller calls the four
    tensors (``fused_attn.mlp``'s second projection reads its hidden activations as x)."""
    xn, wn, bn, rn = names
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{xn} must be a torch.Tensor, got {type(x).__name__}")
    cpu = x.device.type == "cpu"
    if x.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        allowed = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"{xn} must have dtype {allowed}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{xn} must have at least 1 dim [..., in_features], got {_shape(x)}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{wn} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{wn} must have 2 dims [out_features, in_features], got {_shape(weight)}")
    if weight.device != x.device:
        raise ValueError(f"{wn} must be on the same device as {xn} ({x.device}), got {weight.device}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{wn} must have {xn}'s dtype ({x.dtype}), got {weight.dtype}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{wn} must have in_features = {xn}'s last dim ({x.shape[-1]}), got {_shape(weight)}")
    if activation not in _NAMES:
        raise ValueError(f"activation must be 0 (none), 1 (gelu_tanh) or 2 (swiglu), got {activation!r}")
    n = weight.shape[0]
    if activation == ACTIVATIONS["swiglu"] and n % 2:
        raise ValueError(f"{wn} must have an even out_features (gate rows over up rows) for swiglu, "
                         f"got {_shape(weight)}")
    n_out = n // 2 if activation == ACTIVATIONS["swiglu"] else n
    if bias is not None:
        _check_param(bias, bn, x, xn, (n,))
    if residual is not None:
        _check_param(residual, rn, x, xn, (*x.shape[:-1], n_out))
    return n_out


def packed_in_out(weight: torch.Tensor) -> torch.nn.Parameter:
    """An ``[in, out]`` weight (GPT-2's Conv1D layout) stored transposed: ``[out, in]`` contiguous, the
    rows ``linear`` streams, with the returned parameter an ``[in, out]`` view of that storage (so an
    ``addmm(bias, x, weight)`` reads the same values, and ``weight.t()`` is what ``linear`` takes).
    Values and ``requires_grad`` are kept; an already packed weight is returned as it is."""
    if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.stride(0) == 1:
        return weight
    return torch.nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``act(norm(x) @ weight.T + bias) + residual``, float32 accumulation, one rounding to x's dtype.

    Args:
        x: ``[..., in_features]`` float16, bfloat16 or float32 (float64 on the CPU), any strides.
        weight: ``[out_features, in_features]`` (``nn.Linear.weight``'s layout), x's dtype and
            device. A weight whose last dim is not contiguous is copied (once per call: pass a
            contiguous one).
        bias: optional ``[out_features]``.
        activation: None, ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``, GPT-2's) or
            ``"swiglu"``: weight holds the gate rows over the up rows (``[2 * hidden,
            in_features]``, bias likewise) and the output is ``silu(gate) * up``, ``[..., hidden]``.
        residual: optional ``[..., out]`` (x's leading dims, the output's width), added after the
            activation.
        norm: None, ``"layer_norm"`` or ``"rms_norm"``: x's rows are first normalized exactly as
            ``fused_attn.layer_norm(x, norm_weight, norm_bias, eps)`` / ``rms_norm(x, norm_weight,
            eps)`` return them (float32 statistics, the normalized row rounded to x's dtype), then
            multiplied. A pre-LN transformer's norm and the projection after it in one launch.
        norm_weight, norm_bias: optional ``[in_features]``, x's dtype or float32 (absent: 1 / 0);
            ``norm_bias`` with ``"layer_norm"`` only. eps: finite, >= 0, added to the variance.

    Returns ``[..., out]`` in x's dtype, where out is out_features (hidden for swiglu). On CUDA,
    up to ``MAX_GEMV_ROWS`` rows of x (the product of its leading dims) run our kernel, one launch
    that reads the weight once (float16 / bfloat16 on sm_90 up to ``MAX_MMA_ROWS``, where the weight's
    rows are 16-byte pieces); more rows run cuBLAS (cuBLASLt with the epilogue fused, else ``addmm``
    with the epilogue as separate passes). Launches on the current stream, never synchronizes the host, works under
    ``torch.compile(fullgraph=True)`` and CUDA-graph capture. Differentiable (the backward
    recomputes through the PyTorch reference), also with respect to norm_weight and norm_bias.
    With ``norm``, up to ``MAX_GEMV_ROWS`` rows whose normalized copy fits 64 KB of shared memory
    normalize in the kernel's prologue; other shapes run ``layer_norm``'s kernel first (same result).
    """
    code, ncode = ACTIVATIONS.get(activation) if type(activation) in _KEYS else None, \
        NORMS.get(norm) if type(norm) in _KEYS else None
    if (not torch.compiler.is_compiling() and _ops.direct is not None and code is not None and ncode is not None
            and type(eps) is float):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            y = _ops.direct.linear(x, weight, bias, residual, norm_weight, norm_bias, code, ncode, eps)
        except (TypeError, ValueError):
            y = None  # bad input: the checks below raise it
        if y is not None:
            return y
    code = activation_code(activation)
    ncode = norm_code(norm)
    check_args(x, weight, bias, residual, code)
    eps = check_norm(x, ncode, norm_weight, norm_bias, eps)
    if x.device.type == "cuda":
        if weight.stride(-1) != 1 and weight.shape[-1] > 1:
            weight = weight.contiguous()
        _ops.ensure_loaded()
    if ncode == 0:  # the schema's defaults: graphs and traces of the plain op stay as they were
        return torch.ops.fused_attn.linear(x, weight, bias, residual, activation=code)
    return torch.ops.fused_attn.linear(x, weight, bias, residual, norm_weight, norm_bias, activation=code,
                                       norm=ncode, eps=eps)


# --------------------------------------------------------------------------- CPU, fake, autograd


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _reference(x, weight, bias, residual, norm_weight, norm_bias, activation: int, norm: int,
               eps: float) -> torch.Tensor:
    """The op on the CPU and its backward's recompute: ``fused_attn.layer_norm``'s CPU path (its float32
    statistics, the row rounded to x's dtype), then linear's reference."""
    ct = _compute_dtype(x)
    if norm:
        x = reference.layer_norm(x, norm_weight, norm_bias, eps, rms=norm == NORMS["rms_norm"], compute_dtype=ct)
    return reference.linear(x, weight, bias, activation=_NAMES[activation], residual=residual, compute_dtype=ct)


# Callers (opcheck, AOTAutograd) may leave defaulted positional arguments out: the inputs,
# needs_input_grad and the returned gradients then have that shorter length.
def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias, residual, norm_weight, norm_bias = (*inputs, None, None, None, None)[:6]
    ctx.activation = keyword_only_inputs.get("activation", 0)
    ctx.norm = keyword_only_inputs.get("norm", 0)
    ctx.eps = keyword_only_inputs.get("eps", 1e-5)
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(x, weight, bias, residual, norm_weight, norm_bias)


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    # Grad mode is on here only when the caller asked for a differentiable backward (create_graph):
    # then the recompute stays on the saved inputs' graph, so double backward is correct too.
    double = torch.is_grad_enabled()
    wants = [t is not None and i < len(need) and need[i] for i, t in enumerate(saved)]
    with torch.enable_grad():
        leaves = [t if double or t is None else t.detach().requires_grad_(w) for t, w in zip(saved, wants)]
        y = _reference(*leaves, ctx.activation, ctx.norm, ctx.eps)
        wanted = [t for t, w in zip(leaves, wants) if w]
        grads = iter(torch.autograd.grad(y, wanted, grad, create_graph=double) if wanted else ())
    out = tuple(next(grads) if w else None for w in wants)
    return out[:len(need)]


def _register() -> None:
    lib = "fused_attn::linear"

    @torch.library.register_fake(lib)
    def _fake(x, weight, bias=None, residual=None, norm_weight=None, norm_bias=None, *, activation=0, norm=0,
              eps=1e-5):
        n_out = check_args(x, weight, bias, residual, activation)
        check_norm(x, norm, norm_weight, norm_bias, eps)
        return x.new_empty((*x.shape[:-1], n_out))

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, weight, bias=None, residual=None, norm_weight=None, norm_bias=None, *, activation=0, norm=0,
                    eps=1e-5):
        check_args(x, weight, bias, residual, activation)
        eps = check_norm(x, norm, norm_weight, norm_bias, eps)
        return _reference(x, weight, bias, residual, norm_weight, norm_bias, activation, norm, eps)

    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)


_register()
