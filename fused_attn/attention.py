"""``attention``: full attention ``softmax(q·kᵀ·scale + mask)·v`` for prefill, in four modes.

Public wrapper, argument validation, the fake (meta) kernels, the CPU path
(``fused_attn.reference.attention`` in float32; float64 input in float64) and autograd. The CUDA
kernels are in ``csrc/attention/``:

- ``naive``: the teaching baseline, three steps that materialize the scores: a tiled shared-memory
  GEMM Q·Kᵀ (float32 accumulation, float32 scores), ``scaled_masked_softmax`` (causal and masks
  are handled there), a tiled GEMM P·V. Any dtype.
- ``flash``: FlashAttention-2's forward in one kernel (float16 / bfloat16): a tile of query rows per
  block, K/V tiles streamed through shared memory, online softmax in registers, tensor-core MMAs.
  Never allocates anything of size seqlen_q x seqlen_k. Two versions: on Hopper with an sm_90a build
  and headdim in (32, 128], warpgroup MMAs (wgmma); elsewhere mma.sync. ``flash_wgmma`` and
  ``flash_mma`` pin one (tests and benchmarks; ``flash_wgmma`` raises where it cannot run).
- ``tiled``: the same three steps with register-blocked GEMMs (a 64 x 64 tile per block, 4 x 4
  outputs per thread). Any dtype.
- ``auto``: ``flash`` where it applies (float16 / bfloat16, headdim a multiple of 8 up to 256), else
  ``naive``.

Gradients: a recompute through the PyTorch reference (float32, float64 for float64 input), with
respect to q, k, v and an additive float mask; ``out=`` raises when an input requires grad.
"""

from __future__ import annotations

import torch

from fused_attn import _ops, reference
from fused_attn.decode_attention import _aligned_copy, _check_aligned
from fused_attn.softmax import _check_dims, _check_is_tensor, _check_out, _requires_grad, _scale_value, _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = _DTYPES + (torch.float64,)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
MODES = ("auto", "naive", "tiled", "flash", "flash_mma", "flash_wgmma")
FLASH_MODES = ("flash", "flash_mma", "flash_wgmma")
MAX_HEADDIM = 256  # the flash kernel's largest head dim (multiples of 8; the naive kernels take any)


def _check_tensor(t, name: str, dims: str) -> None:
    _check_is_tensor(t, name)
    _check_dims(t, name, dims)


def flash_supports(dtype: torch.dtype, headdim: int) -> bool:
    """The flash kernel's inputs: float16 / bfloat16, headdim a multiple of 8 up to 256."""
    return dtype in _FLASH_DTYPES and headdim % 8 == 0 and 8 <= headdim <= MAX_HEADDIM


def resolve_mode(mode: str, dtype: torch.dtype, headdim: int) -> str:
    """The kernel ``mode`` runs: ``auto`` is ``flash`` where it applies, else ``naive`` (the C++
    launcher also falls back to naive on a GPU the flash kernel was not built for, and picks the flash
    kernel's version)."""
    if mode == "auto":
        return "flash" if flash_supports(dtype, headdim) else "naive"
    return mode


def _is_flash(mode: str, dtype: torch.dtype, headdim: int) -> bool:
    return resolve_mode(mode, dtype, headdim) in FLASH_MODES


def check_args(q, k, v, attn_mask, scale, causal, mode, out=None, lse=None) -> float:
    """Raise TypeError / ValueError naming the bad argument; return the scale as a float (default ``headdim ** -0.5``). The C++ launcher repeats the checks
    that guard memory."""
    _check_tensor(q, "q", "[batch, nheads_q, seqlen_q, headdim]")
    _check_tensor(k, "k", "[batch, nheads_kv, seqlen_k, headdim]")
    _check_tensor(v, "v", "[batch, nheads_kv, seqlen_k, headdim]")
    cpu = q.device.type == "cpu"
    if q.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"q must have dtype {names}, got {q.dtype}")
    for t, name in ((k, "k"), (v, "v")):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype ({q.dtype}), got {t.dtype}")
    batch, nheads_q, seqlen_q, headdim = q.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {_shape(k)}, got {_shape(v)}")
    if k.shape[0] != batch:
        raise ValueError(f"k must have q's batch size ({batch}), got {_shape(k)}")
    if k.shape[3] != headdim:
        raise ValueError(f"k must have q's headdim ({headdim}), got {_shape(k)}")
    nheads_kv, seqlen_k = k.shape[1], k.shape[2]
    if nheads_kv == 0 or nheads_q % nheads_kv != 0:
        raise ValueError(f"q must have nheads_q a multiple of k's nheads_kv ({nheads_kv}), got {nheads_q}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be 'auto', 'naive', 'tiled', 'flash', 'flash_mma' or 'flash_wgmma', got {mode!r}")
    if not cpu and _is_flash(mode, q.dtype, headdim):
        if q.dtype not in _FLASH_DTYPES:
            raise ValueError(f"q must have dtype float16 or bfloat16 for mode='flash', got {q.dtype}")
        if headdim % 8 != 0 or not 8 <= headdim <= MAX_HEADDIM:
            raise ValueError(f"q must have a headdim that is a multiple of 8 in [8, {MAX_HEADDIM}] for mode='flash', "
                             f"got {headdim}")
        if mode == "flash_wgmma" and not 32 < headdim <= 128:
            raise ValueError(f"q must have a headdim that is a multiple of 8 in [40, 128] for mode='flash_wgmma', "
                             f"got {headdim}")
    full = (batch, nheads_q, seqlen_q, seqlen_k)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on the same device as q ({q.device}), got {attn_mask.device}")
        if attn_mask.dtype not in (torch.bool, q.dtype):
            raise ValueError(f"attn_mask must have dtype bool or q's dtype ({q.dtype}), got {attn_mask.dtype}")
        if attn_mask.dim() > 4 or any(m not in (1, n) for m, n in zip(reversed(attn_mask.shape), reversed(full))):
            raise ValueError(f"attn_mask must be broadcastable to {full}, got {_shape(attn_mask)}")
    scale = headdim ** -0.5 if scale is None else _scale_value(scale)
    if out is not None:
        _check_out(out, q, "q")
        if not cpu and _is_flash(mode, q.dtype, headdim):
            _check_aligned(out, "out")
    if lse is not None and lse.numel() > 0:
        if lse.dtype != reference.lse_dtype(q.dtype) or lse.device != q.device or tuple(lse.shape) != full[:3]:
            raise ValueError(f"lse must be a {reference.lse_dtype(q.dtype)} tensor of shape {full[:3]} on q's device, got "
                             f"{lse.dtype} {_shape(lse)} on {lse.device}")
        if not lse.is_contiguous():
            raise ValueError(f"lse must be contiguous, got strides {lse.stride()}")
    return float(scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    mode: str = "auto",
    return_lse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Full attention ``softmax(q·kᵀ·scale + mask)·v`` (prefill; multi-, grouped- and multi-query).

    Args:
        q: ``[batch, nheads_q, seqlen_q, headdim]`` float16, bfloat16 or float32 (float64 on the
            CPU). Any strides with a contiguous last dim and 16-byte aligned rows are read in place
            (Hugging Face's non-contiguous ``[B, H, S, D]`` views of a fused QKV projection); for
            ``flash`` anything else is copied once (``naive`` and ``tiled`` read any strides).
        k, v: ``[batch, nheads_kv, seqlen_k, headdim]``, q's dtype and device, same strides rule;
            nheads_q a multiple of nheads_kv (query head h reads kv head ``h // (nheads_q // nheads_kv)``).
        causal: bool; query i sees key j iff ``j <= i + seqlen_k - seqlen_q`` (bottom-right aligned,
            as ``scaled_masked_softmax``: with seqlen_q > seqlen_k the first rows see nothing).
        attn_mask: bool (True = attend) or additive with q's dtype, broadcastable to ``[batch,
            nheads_q, seqlen_q, seqlen_k]`` (``[B, 1, 1, Sk]`` padding masks, ``[Sq, Sk]``, ...), read
            through its broadcast strides (never expanded in memory); combined with ``causal``.
        scale: score multiplier, default ``headdim ** -0.5``.
        mode: ``"auto"`` (``flash`` where it applies, else ``naive``), ``"naive"`` (three
            kernels through a float32 score matrix: O(seqlen_q x seqlen_k) memory), ``"tiled"`` (the
            same with register-blocked GEMMs) or ``"flash"`` (one kernel, float16 / bfloat16, headdim
            a multiple of 8 up to 256: wgmma on Hopper with an sm_90a build at headdim 40..128, else
            mma.sync; ``"flash_wgmma"`` / ``"flash_mma"`` pin one version, for tests and benchmarks).
            On the CPU every mode runs the reference.
        return_lse: also return the log-sum-exp of each row's scores (natural log).
        out: optional preallocated ``[batch, nheads_q, seqlen_q, headdim]`` output (q's dtype; for
            ``flash`` last dim contiguous and 16-byte aligned rows), returned. Records no gradient.

    Returns:
        ``out`` in q's shape and dtype (float32 accumulation); with ``return_lse``, ``(out, lse)``
        with lse float32 ``[batch, nheads_q, seqlen_q]`` (float64 for float64 input). A row with no visible key (masked
        everywhere, or above the causal diagonal) is all zeros with lse = -inf. A NaN among the
        visible scores makes its row NaN, as in PyTorch.

    Launches on the current stream, never synchronizes the host, works under
    ``torch.compile(fullgraph=True)`` and CUDA-graph capture. Differentiable with respect to q, k,
    v and an additive mask (the backward recomputes through ``fused_attn.reference.attention``).
    """
    if (not torch.compiler.is_compiling() and _ops.direct is not None and type(causal) is bool
            and type(return_lse) is bool and type(mode) is str and (scale is None or type(scale) is float)):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            r = (_ops.direct.attention(q, k, v, attn_mask, scale, causal, mode, return_lse) if out is None
                 else _ops.direct.attention_out(q, k, v, attn_mask, scale, causal, mode, return_lse, out))
        except (TypeError, ValueError):
            r = None  # bad input (or a layout the checks below copy): the path below
        if r is not None:
            return r if return_lse else r[0]
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    scale = check_args(q, k, v, attn_mask, scale, causal, mode, out)
    if _is_flash(mode, q.dtype, q.shape[-1]):  # the flash kernels read rows with 16-byte copies
        q, k, v = (_aligned_copy(t) for t in (q, k, v))
    if q.device.type == "cuda":
        _ops.ensure_loaded()
    op = torch.ops.fused_attn
    if out is None:
        o, lse = op.attention(q, k, v, attn_mask, scale, causal=causal, algo=mode, return_lse=return_lse)
        return (o, lse) if return_lse else o
    if _requires_grad(q, k, v, attn_mask):
        raise ValueError("out must be None when q, k, v or attn_mask requires grad (out= records no gradient), "
                         "got a tensor")
    lse = q.new_empty(_lse_shape(q, return_lse), dtype=reference.lse_dtype(q.dtype))
    op.attention_out(q, k, v, attn_mask, scale, causal=causal, algo=mode, out=out, lse=lse)
    return (out, lse) if return_lse else out


class Attention(torch.nn.Module):
    """``attention`` as a module for dropping into a model: ``forward(q, k, v, attn_mask=None)``."""

    def __init__(self, *, causal: bool = False, scale: float | None = None, mode: str = "auto"):
        super().__init__()
        self.causal, self.scale, self.mode = causal, scale, mode

    def forward(self, q, k, v, attn_mask=None):
        return attention(q, k, v, causal=self.causal, attn_mask=attn_mask, scale=self.scale, mode=self.mode)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, mode={self.mode!r}"


# --------------------------------------------------------------------------- CPU, fake, autograd


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _lse_shape(q: torch.Tensor, return_lse: bool) -> tuple[int, ...]:
    return (q.shape[0], q.shape[1], q.shape[2]) if return_lse else (0,)


def _cpu(q, k, v, attn_mask, scale, causal, return_lse):
    out, lse = reference.attention(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale,
                                   compute_dtype=_compute_dtype(q))
    return out, lse if return_lse else lse.new_empty((0,))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v = inputs[:3]
    attn_mask = inputs[3] if len(inputs) > 3 else None
    scale = inputs[4] if len(inputs) > 4 else None
    ctx.scale = q.shape[-1] ** -0.5 if scale is None else scale
    ctx.causal = keyword_only_inputs.get("causal", False)
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(q, k, v, attn_mask)


def _backward(ctx, grad_out, grad_lse):
    """Recompute the forward through the reference with autograd and differentiate it."""
    q, k, v, attn_mask = ctx.saved_tensors
    need = (*ctx.needs_input_grad, False, False)[:4]
    leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), need[:3])]
    mask = attn_mask
    mask_grad = need[3] and attn_mask is not None and attn_mask.dtype != torch.bool
    if mask_grad:
        mask = attn_mask.detach().requires_grad_(True)
    with torch.enable_grad():
        out, lse = reference.attention(*leaves, causal=ctx.causal, attn_mask=mask, scale=ctx.scale,
                                       compute_dtype=_compute_dtype(q))
        outputs, grads = [out], [grad_out]
        if grad_lse is not None and grad_lse.numel() > 0:
            live = torch.isfinite(lse)  # -inf rows are constants: their gradient is 0
            outputs.append(torch.where(live, lse, 0.0))
            grads.append(torch.where(live, grad_lse, 0.0))
        wrt = [t for t, n in zip((*leaves, mask), (*need[:3], mask_grad)) if n]
        found = iter(torch.autograd.grad(outputs, wrt, grads, allow_unused=True)) if wrt else iter(())
    result = [next(found) if n else None for n in (*need[:3], mask_grad)]
    result = [None if g is None else g.to(t.dtype) for g, t in zip(result, (q, k, v, attn_mask))]
    return (*result, None)[:ctx.n_inputs]


def _out_autograd(q, k, v, attn_mask, scale, *, causal, algo, out, lse):
    """Autograd kernel of the out= variant: a clear error instead of a silently missing gradient."""
    if _requires_grad(q, k, v, attn_mask):
        raise ValueError("out must be None when q, k, v or attn_mask requires grad (out= records no gradient), "
                         "got a tensor")
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.fused_attn.attention_out(q, k, v, attn_mask, scale, causal=causal, algo=algo, out=out, lse=lse)


def _register() -> None:
    lib = "fused_attn::attention"

    @torch.library.register_fake(lib)
    def _fake(q, k, v, attn_mask=None, scale=None, *, causal=False, algo="auto", return_lse=False):
        check_args(q, k, v, attn_mask, scale, causal, algo)
        return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty(_lse_shape(q, return_lse), dtype=reference.lse_dtype(q.dtype), device=q.device))

    @torch.library.register_fake(lib + "_out")
    def _fake_out(q, k, v, attn_mask, scale, *, causal, algo, out, lse):
        check_args(q, k, v, attn_mask, scale, causal, algo, out, lse)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(q, k, v, attn_mask=None, scale=None, *, causal=False, algo="auto", return_lse=False):
        scale = check_args(q, k, v, attn_mask, scale, causal, algo)
        return _cpu(q, k, v, attn_mask, scale, causal, return_lse)

    @torch.library.register_kernel(lib + "_out", "cpu")
    def _cpu_kernel_out(q, k, v, attn_mask, scale, *, causal, algo, out, lse):
        scale = check_args(q, k, v, attn_mask, scale, causal, algo, out, lse)
        o, l = _cpu(q, k, v, attn_mask, scale, causal, lse.numel() > 0)
        out.copy_(o)
        if lse.numel() > 0:
            lse.copy_(l)

    torch.library.register_autograd(lib, _backward, setup_context=_setup_context)
    _ops.LIB.impl("attention_out", _out_autograd, "Autograd")


_register()
