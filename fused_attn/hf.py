"""Hugging Face transformers integration: an attention implementation named "fused_attn".

    import fused_attn.hf
    fused_attn.hf.register()
    model = GPT2LMHeadModel.from_pretrained("gpt2", attn_implementation="fused_attn")
    # or: model.set_attn_implementation("fused_attn"), or fused_attn.hf.apply_to_gpt2(model)

Prompts (more than one query) on CUDA in float16 / bfloat16, with a head dim the flash kernel takes
(``fused_attn.attention.flash_supports``) and no dropout, run ``fused_attn.attention``'s flash kernel
over the un-repeated key and value heads (GQA / MQA): causal, plus the key-padding mask described
under Masks below when there is padding; no score matrix is allocated. Everything else (float32,
CPU tensors, a 4-D mask: a StaticCache prefill with padding, a user's own mask, a sliding window;
dropout in training) computes Q·Kᵀ with cuBLAS (torch.matmul), then ``scaled_masked_softmax``
(scale, causal / padding / cache masks in one pass), then P·V. A 4-D mask stays off the flash
kernel because the kernel reads it per score (440 µs a layer against cuDNN's 118 µs at batch 8,
960 tokens, GPT-2 small, H200: docs/lab-notes/attention.md); float32 keeps cuBLAS matmuls, on which
greedy tokens identical to eager's depend. CPU tensors go through the ops' pure-PyTorch paths. The
result is ``[batch, seqlen_q, nheads, headdim]`` as transformers expects.

Decode steps (one query per sequence, no gradient, no dropout) go through ``decode_attention``
instead: transformers has already written the step's key and value into its cache and passes
the whole cache (for a StaticCache, the whole buffer), so the op is called without ``k_new``,
with every slot valid (``cache_seqlens=None``) and the mask's row as ``key_mask``: padding and
the unfilled slots of a StaticCache never contribute, even when they hold garbage. Key and value
heads are read un-repeated (GQA / MQA). This path is taken only where the op accepts the inputs
as they are: the mask None, bool ``[batch or 1, 1, 1, seqlen_k]`` or the 2-D mask of a one-token
prompt (below); on CUDA float16 / bfloat16 /
float32, headdim a multiple of 8 up to 256, and query, key and value with a contiguous last dim
and 16-byte aligned rows. Everything else takes the path above. On the CPU the op is the float32
reference (``fused_attn.reference.decode_attention``). Under ``torch.compile`` (transformers'
compiled StaticCache decode) the op runs in place on the cache buffers: the graph holds no copy
of the cache (tests/test_hf.py checks the generated code).

Training works: gradients flow to query, key and value (and an additive mask) through the
ops' registered backwards (``fused_attn.attention``'s recomputes through the float32 reference), and
in training mode with dropout (which keeps the matmul path) the attention probabilities go through
``torch.nn.functional.dropout`` exactly where transformers' eager GPT-2 applies it (after
the cast to the value dtype), so with the same RNG state the two drop the same elements.

Masks: ``register()`` also registers ``fused_attn_mask`` as the mask builder under the same name
(``AttentionMaskInterface``); without that registration transformers >= 4.55 passes
``attention_mask=None`` to custom implementations even when there is padding. The builder is
transformers' ``sdpa_mask`` (a bool mask, True = attend, ``[batch, 1, seqlen_q, seqlen_k]`` covering
causality, padding and the unfilled slots of a StaticCache, or ``None`` when the mask is purely
causal over the keys given, where the op's own causal mask is used, aligned as SDPA's) except for one
case, a causal prefill from an empty cache with a 2-D padding mask, where it returns the padding mask
alone. The contract: **a 2-D bool mask ``[batch, seqlen_k]`` reaching the attention forward means
causal (bottom-right aligned, with seqlen_q == seqlen_k) AND key padding** (True = the key is a real
token). The forward reads it as ``causal=True`` plus a ``[batch, 1, 1, seqlen_k]`` mask, which the
flash kernel reads through broadcast strides (one byte per key, the same for every query row) and
with which it still skips the key tiles above the diagonal. See ``fused_attn_mask`` for the exact
conditions.

Supported: transformers 4.56 and later (AttentionMaskInterface with ``sdpa_mask``); CI runs the
tests against 4.57.6 and the current 5.x. ``register()`` raises with the installed version below 4.56.
"""

from __future__ import annotations

import types

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fused_attn.attention import attention, flash_supports
from fused_attn.decode_attention import _CPU_DTYPES, _DTYPES, MAX_HEADDIM, _readable, decode_attention
from fused_attn.layer_norm import layer_norm
from fused_attn.linear import packed_in_out
from fused_attn.mlp import mlp
from fused_attn.softmax import _requires_grad, scaled_masked_softmax

NAME = "fused_attn"
MIN_TRANSFORMERS = (4, 56)


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _tracing(t: torch.Tensor) -> bool:
    """Whether t's values cannot be read now (compile, export, jit / fx tracing, fake tensors, CUDA graph
    capture): the union of what transformers 4.57 and 5.x check before sdpa_mask reads a padding mask."""
    return (isinstance(t, torch.fx.Proxy) or isinstance(t, FakeTensor) or torch.compiler.is_compiling()
            or torch.jit.is_tracing() or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def fused_attn_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask builder registered for "fused_attn" (transformers' AttentionMaskInterface): transformers'
    ``sdpa_mask`` called with the same arguments, except for a causal prefill from an empty cache with a
    padding mask, where it returns the padding mask alone, bool ``[batch, kv_length]`` (True = attend):
    the attention forward reads a 2-D mask as causal AND key padding (module docstring).

    That case is exactly: every argument by keyword (as create_causal_mask passes them); ``mask_function``
    transformers' ``causal_mask_function`` itself (no or/and overlay, packing, blocks, sliding window or
    chunks, which all wrap it), ``local_size`` None, ``allow_is_causal_skip`` True (False asks for a
    materialized mask), ``allow_is_bidirectional_skip`` not set or False; ``kv_offset`` the int 0; as many queries
    as keys (``q_length``, or on 4.57 ``cache_position.shape[0]``, equal to ``kv_length``) and, where
    transformers passes an int ``q_offset`` (5.x), 0 (a tensor q_offset, a StaticCache's, is not read:
    with kv_offset 0 and as many queries as keys, the cache was empty); ``attention_mask`` a 2-D bool
    ``[batch_size, >= kv_length]``. Its first kv_length columns are the columns sdpa_mask reads
    (kv_offset 0). Like sdpa_mask, it returns None when no key is padding, which it checks (``.all()``, a
    host sync as in sdpa_mask) only outside tracing; under compile or export the 2-D mask is returned
    as it is, correct whatever its values.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    pad = kwargs.get("attention_mask")
    kv_length, kv_offset, q_offset = kwargs.get("kv_length"), kwargs.get("kv_offset", 0), kwargs.get("q_offset", 0)
    if "q_length" in kwargs:
        q_length = kwargs["q_length"]
    else:
        cache_position = kwargs.get("cache_position")
        q_length = cache_position.shape[0] if isinstance(cache_position, torch.Tensor) else None
    if (args or kwargs.get("mask_function", causal_mask_function) is not causal_mask_function
            or kwargs.get("local_size") is not None or not kwargs.get("allow_is_causal_skip", True)
            or kwargs.get("allow_is_bidirectional_skip", False)
            or type(kv_offset) is not int or kv_offset != 0 or (type(q_offset) is int and q_offset != 0)
            or kv_length is None or q_length is None or q_length != kv_length
            or not isinstance(pad, torch.Tensor) or pad.dim() != 2 or pad.dtype != torch.bool
            or pad.shape[0] != kwargs.get("batch_size") or pad.shape[1] < kv_length):
        return sdpa_mask(*args, **kwargs)
    key_pad = pad[:, :kv_length]
    if not _tracing(key_pad) and bool(key_pad.all()):
        return None
    return key_pad


def _check_key_padding(attention_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    """A 2-D mask is fused_attn_mask's causal + key padding: bool [batch, seqlen_k], seqlen_q == seqlen_k."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (batch, kv_len) or q_len != kv_len:
        raise ValueError(
            "attention_mask must be bool [batch, seqlen_k] with seqlen_q == seqlen_k when it is 2-D (causal + key "
            f"padding, as fused_attn_mask builds it), got {attention_mask.dtype} {tuple(attention_mask.shape)} "
            f"with seqlen_q {q_len}, seqlen_k {kv_len}")


def _decode_step(module, query, key, value, attention_mask, dropout) -> bool:
    """Whether this call is a decode step decode_attention takes as it is: one query per sequence, no
    gradient, no dropout, key and value of one shape and query's dtype, the mask None, bool
    [batch or 1, 1, 1, seqlen_k] or a checked 2-D key padding, and on CUDA the op's dtypes, head dims
    and alignment."""
    batch, nheads, q_len, headdim = query.shape
    if q_len != 1 or (dropout and module.training) or query.device.type not in ("cpu", "cuda"):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if (key.shape != value.shape or key.dim() != 4 or key.shape[0] != batch or key.shape[3] != headdim
            or key.shape[1] == 0 or nheads % key.shape[1] != 0
            or key.dtype != query.dtype or value.dtype != query.dtype or query.dtype not in _CPU_DTYPES):
        return False
    m = attention_mask
    if m is not None and m.dim() != 2 and (m.dtype != torch.bool or m.device != query.device or m.dim() != 4
                          or m.shape[0] not in (1, batch) or tuple(m.shape[1:]) != (1, 1, key.shape[2])):
        return False
    if query.device.type == "cuda":
        return (query.dtype in _DTYPES and headdim % 8 == 0 and 8 <= headdim <= MAX_HEADDIM
                and all(_readable(t) for t in (query, key, value)))
    return True


def fused_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' AttentionInterface.

    query ``[batch, nheads, seqlen_q, headdim]``, key/value ``[batch, nheads_kv, seqlen_k, headdim]``
    (nheads a multiple of nheads_kv), attention_mask bool ``[batch or 1, 1, seqlen_q, seqlen_k]`` or
    additive in the query's dtype, bool ``[batch, seqlen_k]`` (causal + key padding, seqlen_q ==
    seqlen_k: ``fused_attn_mask``), or None. Returns ``([batch, seqlen_q, nheads, headdim], None)``.
    Query rows with no visible key give zeros (SDPA may give NaN there). A decode step (seqlen_q 1,
    see the module docstring) goes through ``decode_attention`` over the whole key/value given; a
    prompt in float16 / bfloat16 on CUDA without a 4-D mask through ``fused_attn.attention``.
    """
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions must be False with the fused_attn attention, got True")
    for name in ("softcap", "s_aux"):  # score transforms not applied here (a sliding window is in the mask)
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} must be None with the fused_attn attention (not supported), got {kwargs[name]!r}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key_pad = None
    if attention_mask is not None and attention_mask.dim() == 2:
        _check_key_padding(attention_mask, query, key)
        key_pad = attention_mask
    if _decode_step(module, query, key, value, attention_mask, dropout):
        key_mask = None
        if attention_mask is not None:
            key_mask = key_pad if key_pad is not None else attention_mask[:, 0, 0, :]
            if key_mask.shape[1] > 1 and key_mask.stride(1) != 1:
                key_mask = key_mask.contiguous()
        out = decode_attention(query, key, value, None, key_mask=key_mask, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = False
    mask = attention_mask
    if key_pad is not None:
        causal, mask = True, key_pad[:, None, None, :]  # read through broadcast strides, never expanded
    elif mask is None:
        if is_causal and q_len > 1:
            # transformers leaves the mask out only for a purely causal prefill, where SDPA's
            # top-left causal mask applies; with an empty StaticCache the keys beyond q_len are
            # unfilled slots. Keep the first q_len keys so bottom-right alignment is the same.
            if kv_len > q_len:
                key, value = key[:, :, :q_len], value[:, :, :q_len]
            causal = True
    elif mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    if (query.device.type == "cuda" and (mask is None or key_pad is not None) and not (dropout and module.training)
            and flash_supports(query.dtype, query.shape[-1]) and key.dtype == query.dtype
            and value.dtype == query.dtype):
        # No score matrix; a 4-D mask never gets here (the kernel would read it per score).
        if _requires_grad(query, key, value):
            out = attention(query, key, value, causal=causal, attn_mask=mask, scale=scale)
            return out.transpose(1, 2).contiguous(), None
        # Without autograd, written straight into the [batch, seqlen_q, nheads, headdim] layout returned, as
        # SDPA's flash and cuDNN kernels lay their output out: no transposing copy, and a prompt's allocations
        # are sdpa's (bench_hf_prefill's peak memory).
        out = query.new_empty(query.shape[0], q_len, query.shape[1], query.shape[3])
        attention(query, key, value, causal=causal, attn_mask=mask, scale=scale, out=out.transpose(1, 2))
        return out, None
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2))
    probs = scaled_masked_softmax(scores, scale, causal=causal, attn_mask=mask)
    probs = probs.to(value.dtype)
    if dropout and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "fused_attn" with transformers' AttentionInterface and AttentionMaskInterface
    (idempotent)."""
    import transformers

    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        raise RuntimeError(
            "transformers must be >= {}.{} for fused_attn.hf.register(), got {}".format(
                *MIN_TRANSFORMERS, transformers.__version__)
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fused_attention_forward)
    AttentionMaskInterface.register(NAME, fused_attn_mask)


def _layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm.forward through fused_attn.layer_norm (one pass, float32 statistics)."""
    return layer_norm(x, self.weight, self.bias, self.eps)


def _mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """GPT2MLP.forward as fused_attn.mlp (c_fc + GELU(tanh) in one launch's epilogue, then c_proj);
    with dropout active (training, resid_pdrop > 0) the module's own forward, which applies it."""
    if self.training and self.dropout.p > 0:
        return type(self).forward(self, hidden_states)
    return mlp(hidden_states, self.c_fc.weight.t(), self.c_fc.bias, self.c_proj.weight.t(), self.c_proj.bias)


def apply_to_gpt2(model: torch.nn.Module, *, attention: bool = True, layer_norm: bool = True,
                  mlp: bool = True) -> torch.nn.Module:
    """Swap fused_attn's kernels into a Hugging Face GPT-2 model in place, one flag per module kind
    (Liger's ``apply_liger_kernel_to_*`` idea); returns the model.

    attention: the "fused_attn" attention implementation (``register()`` + ``set_attn_implementation``).
    layer_norm: every LayerNorm (ln_1, ln_2, ln_f) through ``fused_attn.layer_norm``.
    mlp: every GPT2MLP through ``fused_attn.mlp`` (its Conv1D weights are stored transposed, values
    unchanged: ``fused_attn.linear.packed_in_out``; with dropout active in training the module's own
    forward runs).
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2":
        raise ValueError(
            f"model must be a transformers GPT-2 model (config.model_type 'gpt2'), got {type(model).__name__}"
            + (f" with model_type {config.model_type!r}" if config is not None else ""))
    if mlp and config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError("model.config.activation_function must be gelu_new or gelu_pytorch_tanh (GELU's tanh form) "
                         f"for mlp=True, got {config.activation_function!r}")
    if attention:
        register()
        model.set_attn_implementation(NAME)
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    for module in model.modules():
        if layer_norm and isinstance(module, torch.nn.LayerNorm):
            module.forward = types.MethodType(_layer_norm_forward, module)
        elif mlp and isinstance(module, GPT2MLP):
            module.c_fc.weight = packed_in_out(module.c_fc.weight)  # values unchanged, stored [out, in]
            module.c_proj.weight = packed_in_out(module.c_proj.weight)
            module.forward = types.MethodType(_mlp_forward, module)
    return model
