"""``qkv_decode_attention``: a pre-LN block's QKV projection and its decode attention in one launch.

For one new token per sequence (plain decoding), with x the block's input (the residual stream):

    qkv = layer_norm(x) · w_qkvᵀ + b_qkv      (the norm without weight and bias: fold them into w_qkv, b_qkv,
                                               as fused_attn.gpt2.folded_linear does; qkv rounded to x's dtype)
    q, k, v = qkv split into 3 x heads x 64
    k, v written into the caches at slot cache_seqlens[b]; o = softmax(q · Kᵀ · scale) · V over slots
    cache_leftpad[b] .. cache_seqlens[b]

which is ``fused_attn.linear(x, w_qkv, b_qkv, norm="layer_norm")`` followed by ``fused_attn.decode_attention``
with ``k_new`` / ``v_new``. On CUDA (float16 / bfloat16, head_dim 64, d a multiple of 256 up to 1024, sm_90)
one launch (``csrc/qkv_decode_attention/``): a thread-block cluster of 8 blocks per (head, group of G
sequences) computes the head's 192 columns for its G rows, exchanges them through distributed shared memory
and attends, each sequence's keys split over 8 / G blocks. G is 1 at batch 1 (the columns on CUDA cores from
x normalized in float32), 2 / 4 at 2 / 3-4 rows and 8 from 5 rows (the columns on tensor cores from x
normalized and rounded to x's dtype, as the chain's norm rounds it). On the CPU: the reference, in float64.
No gradient: an input that requires grad raises.

GPT-2's decode step (fused_attn.gpt2, backends with layer_norm "folded") runs it in place of c_attn and
decode_attention at one row over any cache and at 2-8 rows over caches of up to 256 slots. The measurements
behind that rule are in the heuristics table of fused_attn/gpt2.py (QKV_ATTENTION_MAX_ROWS / _SLOTS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fused_attn import _ops, reference
from fused_attn.decode_attention import check_lengths

HEAD_DIM = 64
_DTYPES = (torch.float16, torch.bfloat16)  # the CUDA kernel's (meta tensors stand in for CUDA ones)
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _number(v, name: str, requirement: str) -> float:
    """A Python int or float as a float; anything else (a string, a bool, a tensor) raises naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be {requirement}, got {v!r}")
    return float(v)


def check_qkv_args(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale) -> None:
    """Raise TypeError / ValueError naming the bad argument (csrc/qkv_decode_attention checks the same)."""
    for name, t in (("x", x), ("w_qkv", w_qkv), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    cpu = x.device.type == "cpu"
    if x.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float16 or bfloat16 on CUDA"
        raise ValueError(f"x must have dtype {names}, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"x must have shape [batch, 1, d], got {tuple(x.shape)}")
    batch, _, d = x.shape
    if d % HEAD_DIM != 0 or d == 0:
        raise ValueError(f"x must have d a positive multiple of {HEAD_DIM}, got {tuple(x.shape)}")
    heads = d // HEAD_DIM
    for name, t, shape in (("w_qkv", w_qkv, (3 * d, d)), ("b_qkv", b_qkv, (3 * d,))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must have x's dtype and device ({x.dtype}, {x.device}), got {t.dtype}, {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != batch or t.shape[1] != heads or t.shape[3] != HEAD_DIM:
            raise ValueError(f"{name} must have shape [{batch}, {heads}, max_len, {HEAD_DIM}], got {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must have x's dtype and device ({x.dtype}, {x.device}), got {t.dtype}, {t.device}")
    if v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"v_cache must have k_cache's max_len {k_cache.shape[2]}, got {tuple(v_cache.shape)}")
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != x.device:
            raise ValueError(f"{name} must be an int32 [{batch}] tensor on x's device, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if not isinstance(eps, float) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if not isinstance(scale, float) or scale != scale:
        raise ValueError(f"scale must be a float other than NaN, got {scale!r}")


def qkv_decode_attention(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor | None = None,
                         *, eps: float = 1e-5, scale: float | None = None) -> torch.Tensor:
    """See the module docstring. x ``[batch, 1, d]``; w_qkv ``[3 d, d]`` (rows: q, k, v, each heads x 64);
    b_qkv ``[3 d]`` or None; caches ``[batch, d / 64, max_len, 64]`` (written at slot cache_seqlens[b]);
    cache_seqlens / cache_leftpad int32 ``[batch]`` on x's device. Returns ``[batch, 1, d]`` (the heads'
    outputs side by side, the layout the output projection reads)."""
    if (not torch.compiler.is_compiling() and _ops.direct is not None and type(eps) is float
            and (scale is None or type(scale) is float)):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            y = _ops.direct.qkv_decode_attention(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps,
                                                 HEAD_DIM ** -0.5 if scale is None else scale)
        except (TypeError, ValueError):
            y = None  # bad input (or a layout the path below copies): the path below
        if y is not None:
            return y
    scale = HEAD_DIM ** -0.5 if scale is None else _number(scale, "scale", "a float")
    eps = _number(eps, "eps", "a float >= 0")
    check_qkv_args(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale)
    if x.device.type == "cuda":
        _ops.ensure_loaded()
        x, w_qkv = x.contiguous(), w_qkv.contiguous()  # the kernel's 16-byte rows (caches are the caller's)
    return torch.ops.fused_attn.qkv_decode_attention(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad,
                                                     eps, scale)


def _cpu(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale) -> torch.Tensor:
    batch, _, d = x.shape
    heads = d // HEAD_DIM
    # float64: the CPU path is the reference, and a float32 mean leaves rows of large mean and small spread
    # (|mean| / std ~ 500) with ~1e-4 relative error after the subtraction.
    compute = torch.float64
    xn = F.layer_norm(x.to(compute), (d,), eps=eps)
    qkv = xn @ w_qkv.to(compute).T
    if b_qkv is not None:
        qkv = qkv + b_qkv.to(compute)
    q, k, v = qkv.to(x.dtype).view(batch, 1, 3, heads, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
    seqlens = cache_seqlens.tolist()
    leftpad = None if cache_leftpad is None else cache_leftpad.tolist()
    check_lengths(seqlens, leftpad, 1, k_cache.shape[2], True)
    out, _, _ = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad, scale,
                                           compute_dtype=compute)
    for b, n in enumerate(seqlens):
        k_cache[b, :, n:n + 1] = k[b]
        v_cache[b, :, n:n + 1] = v[b]
    return out.to(x.dtype).transpose(1, 2).reshape(batch, 1, d)


_NAMES = ("x", "w_qkv", "b_qkv", "k_cache", "v_cache")


def _autograd(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale):
    for name, t in zip(_NAMES, (x, w_qkv, b_qkv, k_cache, v_cache)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} must not require grad (qkv_decode_attention writes into the caches and records "
                             "no gradient; fused_attn.reference.decode_attention after a linear is differentiable), "
                             "got requires_grad=True")
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fused_attn.qkv_decode_attention(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens,
                                                         cache_leftpad, eps, scale)


def _register() -> None:
    lib = "fused_attn::qkv_decode_attention"

    @torch.library.register_fake(lib)
    def _fake(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale):
        check_qkv_args(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale)
        return x.new_empty(x.shape)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale):
        check_qkv_args(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale)
        return _cpu(x, w_qkv, b_qkv, k_cache, v_cache, cache_seqlens, cache_leftpad, eps, scale)

    _ops.LIB.impl("qkv_decode_attention", _autograd, "Autograd")


_register()
