"""``gpt2_decode_step``: one whole GPT-2 decode step in one launch.

A GPT-2 decode step at batch 1-16 is ~75 small launches (norms, GEMVs, attention, lm_head) whose
gaps and ramps, not the weight bytes, set the time: a CUDA graph removes the launch cost on the host
but not the drain-and-fill between kernels on the device. This op runs the whole step (embedding, every
layer's ln_1 / QKV / cache append / attention / output projection / ln_2 / MLP, ln_f, the lm_head tied
to wte) in one persistent kernel whose blocks meet at grid-wide barriers between stages (issue 13).
Public wrapper, argument validation, the fake (meta) kernel and the CPU path
(``fused_attn.reference.gpt2_decode_step``, the definition). The CUDA kernel is in
``csrc/gpt2_decode_step/``.

Op (schema in ``fused_attn/_ops.py``): ``gpt2_decode_step(token, pos, seqlens, leftpad, k_cache, v_cache,
wte, wpe, norms, w_qkv, b_qkv, w_o, b_o, w_fc, b_fc, w_proj, b_proj, workspace, eps) -> logits``. The
weights travel as one ``GPT2StepWeights``; ``fused_attn.gpt2`` packs a model's into it
(``backends={"step": "persistent"}``).

Gradients: none. The op writes the KV cache and is meant for inference; when an input requires grad
it raises (``fused_attn.reference.gpt2_decode_step`` is plain PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fused_attn import _ops, reference
from fused_attn.layer_norm import eps_value
from fused_attn.softmax import _check_dims, _check_is_tensor, _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = _DTYPES + (torch.float64,)
HEADDIM = 64  # the kernel's one head size (GPT-2's)
BARRIER_BYTES = 256  # the workspace's head: the grid barrier's two counters (bytes 0 and 128)


@dataclass(frozen=True)
class GPT2StepWeights:
    """A GPT-2's weights in the op's layout (T: one float dtype; L layers, C = n_embd, I = n_inner,
    V = vocab, P = n_positions; all contiguous, one device):

    - ``wte [V, C]``, ``wpe [P, C]``: the embeddings (wte is the lm_head too).
    - ``norms [2L + 1, 2, C]``: ``norms[2l]`` layer l's ln_1, ``norms[2l + 1]`` its ln_2, ``norms[2L]``
      ln_f; ``[., 0]`` the weight, ``[., 1]`` the bias.
    - ``w_qkv [L, 3C, C]``, ``b_qkv [L, 3C]``; ``w_o [L, C, C]``, ``b_o [L, C]``; ``w_fc [L, I, C]``,
      ``b_fc [L, I]``; ``w_proj [L, C, I]``, ``b_proj [L, C]``: each layer's projections in nn.Linear's
      ``[out, in]`` layout (``fused_attn.linear``'s), stacked over layers.
    """

    wte: torch.Tensor
    wpe: torch.Tensor
    norms: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor
    w_fc: torch.Tensor
    b_fc: torch.Tensor
    w_proj: torch.Tensor
    b_proj: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in the schema's order."""
        return tuple(getattr(self, f.name) for f in fields(self))


def workspace_bytes(batch: int, n_embd: int, n_inner: int, dtype: torch.dtype) -> int:
    """The smallest ``workspace`` of the op: the barrier's 256 bytes and the activations exchanged
    between stages (``batch x (3 n_embd + n_inner)`` elements of dtype), rounded up to 16 bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = BARRIER_BYTES + batch * (3 * n_embd + n_inner) * itemsize
    return (n + 15) // 16 * 16


def new_workspace(batch: int, n_embd: int, n_inner: int, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
    """A zeroed ``workspace`` (the barrier must start at 0); reusable by every later call of this shape."""
    return torch.zeros(workspace_bytes(batch, n_embd, n_inner, dtype), dtype=torch.uint8, device=device)


# The launcher's message for a batch whose activations do not fit shared memory ("token must have at
# most N elements (batch) for this model's width and dtype, got M"): a shape the kernel does not run.
_BATCH_TOO_LARGE = "elements (batch) for this model's width and dtype"


def is_batch_too_large(error: BaseException) -> bool:
    """Whether ``error`` is the CUDA launcher's refusal of a batch too large for its shared memory (tests
    and benchmarks skip such shapes)."""
    return isinstance(error, ValueError) and _BATCH_TOO_LARGE in str(error)


# The weights' names in the schema's order (the dataclass's fields).
_WEIGHTS = tuple(f.name for f in fields(GPT2StepWeights))
_LENGTHS = ("pos", "seqlens", "leftpad")


def _check_shape(t: torch.Tensor, name: str, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {_shape(t)}")


def check_args(token, pos, seqlens, leftpad, k_cache, v_cache, wte, wpe, norms, w_qkv, b_qkv, w_o, b_o, w_fc, b_fc,
               w_proj, b_proj, workspace, eps) -> float:
    """Raise TypeError (not a tensor, eps not a number) / ValueError naming the bad argument, the
    messages of csrc/gpt2_decode_step (which checks them too); return ``eps`` as a float. The shapes:
    L, batch, H, S from k_cache (headdim 64), C = 64 H, V from wte, P from wpe, I from w_fc."""
    weights = (wte, wpe, norms, w_qkv, b_qkv, w_o, b_o, w_fc, b_fc, w_proj, b_proj)
    named = dict(zip(("token", *_LENGTHS, "k_cache", "v_cache", *_WEIGHTS, "workspace"),
                     (token, pos, seqlens, leftpad, k_cache, v_cache, *weights, workspace)))
    for name, t in named.items():
        _check_is_tensor(t, name)
    # The sequences.
    _check_dims(token, "token", "[batch]")
    if token.dtype != torch.int64:
        raise ValueError(f"token must have dtype torch.int64, got {token.dtype}")
    batch = token.shape[0]
    if batch < 1:
        raise ValueError(f"token must have at least 1 element (batch), got {_shape(token)}")
    for name, t in named.items():
        if t.device != token.device:
            raise ValueError(f"{name} must be on the same device as token ({token.device}), got {t.device}")
    for name in _LENGTHS:
        t = named[name]
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
        _check_shape(t, name, (batch,))
    # The float dtype, the model's sizes, the caches.
    cpu = token.device.type == "cpu"
    if wte.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        allowed = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"wte must have dtype {allowed}, got {wte.dtype}")
    for name in ("k_cache", "v_cache", *_WEIGHTS[1:]):
        if named[name].dtype != wte.dtype:
            raise ValueError(f"{name} must have wte's dtype ({wte.dtype}), got {named[name].dtype}")
    _check_dims(k_cache, "k_cache", "[n_layer, batch, nheads, max_len, headdim]")
    n_layer, cache_batch, nheads, max_len, headdim = k_cache.shape
    if headdim != HEADDIM:
        raise ValueError(f"k_cache must have headdim (last dim) {HEADDIM}, got {_shape(k_cache)}")
    if cache_batch != batch:
        raise ValueError(f"k_cache must have token's batch size ({batch}) in dim 1, got {_shape(k_cache)}")
    _check_shape(v_cache, "v_cache", tuple(k_cache.shape))
    c = nheads * headdim  # a multiple of 8 (the kernel's 16-byte rows) with headdim 64
    _check_dims(wte, "wte", "[vocab, n_embd]")
    _check_shape(wte, "wte", (wte.shape[0], c))
    _check_dims(wpe, "wpe", "[n_positions, n_embd]")
    _check_shape(wpe, "wpe", (wpe.shape[0], c))
    _check_dims(w_fc, "w_fc", "[n_layer, n_inner, n_embd]")
    n_inner = w_fc.shape[1]
    if n_inner % 8:
        raise ValueError(f"w_fc must have n_inner (dim 1) a multiple of 8, got {_shape(w_fc)}")
    for name, want in (("norms", (2 * n_layer + 1, 2, c)), ("w_qkv", (n_layer, 3 * c, c)),
                       ("b_qkv", (n_layer, 3 * c)), ("w_o", (n_layer, c, c)), ("b_o", (n_layer, c)),
                       ("w_fc", (n_layer, n_inner, c)), ("b_fc", (n_layer, n_inner)),
                       ("w_proj", (n_layer, c, n_inner)), ("b_proj", (n_layer, c))):
        _check_shape(named[name], name, want)
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    # The scratch.
    if workspace.dtype != torch.uint8:
        raise ValueError(f"workspace must have dtype torch.uint8, got {workspace.dtype}")
    _check_dims(workspace, "workspace", "[bytes]")
    need = workspace_bytes(batch, c, n_inner, wte.dtype)
    if workspace.shape[0] < need:
        raise ValueError(f"workspace must have at least {need} bytes (workspace_bytes(batch={batch}, n_embd={c}, "
                         f"n_inner={n_inner}, dtype={wte.dtype})), got {workspace.shape[0]}")
    return eps_value(eps)


def check_no_grad(*tensors: torch.Tensor) -> None:
    if not torch.is_grad_enabled():
        return
    names = ("token", *_LENGTHS, "k_cache", "v_cache", *_WEIGHTS, "workspace")
    for name, t in zip(names, tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name} must not require grad (gpt2_decode_step writes the KV cache and records no "
                             f"gradient; fused_attn.reference.gpt2_decode_step is plain PyTorch), got "
                             f"requires_grad=True")


def gpt2_decode_step(
    token: torch.Tensor,
    pos: torch.Tensor,
    seqlens: torch.Tensor,
    leftpad: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    weights: GPT2StepWeights,
    workspace: torch.Tensor,
    *,
    eps: float,
) -> torch.Tensor:
    """One GPT-2 decode step for every sequence of a batch: the logits of its next token, and this
    step's keys and values of every layer written into the caches (in place).

    Args:
        token: int64 ``[batch]``, each sequence's last token (batch >= 1).
        pos: int32 ``[batch]``, its position id (``wpe`` row).
        seqlens: int32 ``[batch]``, the valid cache slots of each sequence before this step: its keys
            and values go to slot ``seqlens[b]``.
        leftpad: int32 ``[batch]``, each sequence's first valid slot (left padding): slots before it
            are never read.
        k_cache, v_cache: ``[n_layer, batch, nheads, max_len, 64]``, dtype T (float32, float16 or
            bfloat16; float64 on the CPU too), written at slot ``seqlens[b]`` of every layer.
        weights: ``GPT2StepWeights`` in T (n_embd = 64 nheads; n_inner a multiple of 8).
        workspace: uint8 ``[>= workspace_bytes(batch, n_embd, n_inner, T)]`` scratch whose first 8 bytes
            are the kernel's grid barrier: zeros before the first call (``new_workspace``), left valid
            by every call, so one buffer serves every later call of the shape (not two at once).
        eps: the LayerNorms' epsilon (finite, >= 0).

    Everything on one device and contiguous. The sequences' values are read on the device only: a row
    with ``seqlens[b]`` outside ``[0, max_len - 1]``, ``leftpad[b]`` outside ``[0, seqlens[b]]``,
    ``pos[b]`` outside ``[0, n_positions - 1]`` or ``token[b]`` outside ``[0, vocab - 1]`` gets NaN
    logits and writes nothing to the caches; the other rows are unaffected.

    Computes ``fused_attn.reference.gpt2_decode_step``: each matmul, norm and attention with float32
    accumulation and one rounding to T (residual adds before it), attention over slots ``leftpad[b]
    .. seqlens[b]`` (this step's key included). Does not advance seqlens or pos (the caller does).

    Returns the logits, T ``[batch, vocab]`` (a new tensor). Launches on the current stream, never
    synchronizes the host, works under CUDA-graph capture and ``torch.compile``. On CUDA it needs an
    sm_90 (Hopper) GPU and a batch whose activations fit shared memory (the launcher raises
    ValueError naming the largest batch otherwise). No gradient: raises when an input requires grad.
    """
    if not isinstance(weights, GPT2StepWeights):
        raise TypeError(f"weights must be a GPT2StepWeights, got {type(weights).__name__}")
    tensors = (token, pos, seqlens, leftpad, k_cache, v_cache, *weights.tensors(), workspace)
    eps = check_args(*tensors, eps)
    check_no_grad(*tensors)
    if token.device.type == "cuda":  # meta tensors (and torch.compile's tracing) run the fake kernel: no build
        _ops.ensure_loaded()
    return torch.ops.fused_attn.gpt2_decode_step(*tensors, eps)


# --------------------------------------------------------------------------- CPU, fake, autograd


def _autograd(*args):
    check_no_grad(*args[:-1])
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fused_attn.gpt2_decode_step(*args)


def _register() -> None:
    lib = "fused_attn::gpt2_decode_step"

    # The schema's arguments, in its order: token, pos, seqlens, leftpad, k_cache, v_cache, the weights
    # (GPT2StepWeights' fields), workspace, eps.
    @torch.library.register_fake(lib)
    def _fake(*args):
        check_args(*args)
        token, wte = args[0], args[6]
        return wte.new_empty((token.shape[0], wte.shape[0]))

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(*args):
        eps = check_args(*args)
        return reference.gpt2_decode_step(*args[:-2], eps)  # the workspace is the kernel's scratch only

    _ops.LIB.impl("gpt2_decode_step", _autograd, "Autograd")


_register()
