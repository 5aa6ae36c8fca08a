"""A compact GPT-2 with named modules, a static KV cache and a CUDA-graph decode step.

    from fused_attn.gpt2 import GPT2, load_hf_model
    model = GPT2.from_hf(load_hf_model("gpt2-random"), dtype=torch.float16, device="cuda")
    tokens = model.generate(prompt_ids, attention_mask, max_new_tokens=128, use_graph=True)

Modules (gpt-fast's seams; names follow the Hugging Face state dict, which loads directly):
``GPT2`` = ``wte``/``wpe`` embeddings, ``h`` = ``Block`` × n_layer, ``ln_f``; a ``Block`` is ``ln_1``
(``LayerNorm``), ``attn`` (``Attention``: ``c_attn``, ``c_proj``, each a Conv1D-style ``Linear``
x @ W + b), ``ln_2``, ``mlp`` (``MLP``: ``c_fc`` → tanh GELU → ``c_proj``). The lm_head is tied to
``wte``. Each module kind has a backend, chosen per kind (``backends=``): attention "fused"
(prompt: ``fused_attn.attention``, one flash launch in 16-bit types; decode step:
``decode_attention``, the cache append and the attention in one call), "eager" (Q·Kᵀ, the reference
softmax, P·V with PyTorch ops) or "sdpa"; LayerNorm, Linear and MLP "eager" (PyTorch) or "fused" (our
kernels). A later kernel plugs into one module.

Generation state lives in a ``DecodeCache`` (one ``KVCache`` per layer, whose ``update()`` writes new
keys and values at device-side positions, plus the key mask, the next slot, positions and the last
token), created per (batch, max length, sampling settings) and reused. Prompts are left padded
(``attention_mask`` 0 on the left); positions follow transformers' generate() (cumulative sum of the
mask), so greedy tokens match Hugging Face's. The decode step reads and writes only device-side
state, so it is captured once in a CUDA graph and replayed per token with no host synchronization;
the prefill is captured too, once per prompt shape. Timing is the caller's: ``generate(on_token=)``
is called right after each token is enqueued (the CLI and the benchmark record CUDA events there).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fused_attn import reference
from fused_attn.attention import attention
from fused_attn.decode_attention import decode_attention
from fused_attn.layer_norm import layer_norm
from fused_attn.linear import MAX_GEMV_ROWS, linear, packed_in_out
from fused_attn.mlp import mlp
from fused_attn.qkv_decode_attention import qkv_decode_attention
from fused_attn.sample import sample
from fused_attn.softmax import _requires_grad


RANDOM_NAME = "gpt2-random"
# Backends per module kind; the first is the default.
# attention: "fused" (prompts: fused_attn.attention; decode steps: one decode_attention launch per layer, or
# c_attn and the attention in one qkv_decode_attention launch where QKV_ATTENTION_MAX_ROWS says), "eager"
# (the float32 PyTorch reference), "sdpa" (plain PyTorch: F.scaled_dot_product_attention over the cache
# under the key mask in decode steps, the eager reference in the prompt, whose padding rows see no key;
# the peer torch.compile runs on).
# layer_norm / linear / mlp: "eager" (PyTorch: F.layer_norm; addmm, then GELU and the residual add as
# kernels of their own) or "fused" (fused_attn.layer_norm; fused_attn.linear with bias, GELU and the
# residual in the epilogue, our GEMV at decode sizes; fused_attn.mlp: two such launches). The linear
# backend "fused" also draws the next token with fused_attn.sample (greedy or sampled, one launch).
# layer_norm "folded" (with linear "fused"): ln_1, ln_2 and ln_f run in the launch of the linear after
# them (c_attn, c_fc, the lm_head), their weight and bias folded into that linear's (folded_linear): at
# one row in float16 / bfloat16 fused_attn.linear folds the normalization into the GEMV's dot products
# (no norm launch at batch 1); at more rows it runs the norm's launch first. Costs a folded copy of those
# weights (~176 MB for GPT-2 small in float16, the lm_head's included).
# embed "fused" (with layer_norm "fused" or "folded"): the embedding lookup wte[ids] + wpe[pos] and layer
# 0's ln_1 in one fused_attn.layer_norm launch (its gathered rows: x_index / residual_index), in the
# prefill and in each decode step, in place of two index_select launches, an add and the norm's launch
# (H100 fp16, hot step: batch 16 452 -> 432 us, batch 1 even; docs/lab-notes/gpt2-decode.md).
BACKENDS = {"attention": ("fused", "eager", "sdpa"), "layer_norm": ("eager", "fused", "folded"),
            "linear": ("eager", "fused"), "mlp": ("eager", "fused"), "embed": ("eager", "fused")}

# The decode step's heuristics (attention "fused" with layer_norm "folded"), each with the measurement that
# chose it (us a step of GPT-2 small, float16, prompt 128, against decode_attention's launch after c_attn's;
# docs/lab-notes/decode-attention.md, time_decode_graph / bench_gpt2):
# - QKV_ATTENTION_MAX_ROWS: c_attn (with the folded ln_1) and the attention as one qkv_decode_attention
#   launch up to 8 sequences. H200 batch 1 206 -> 191; H100 batch 1 214 -> 205, batch 4 233 -> 215
#   (clusters of 4 sequences), batch 8 even (262), batch 16 320 -> 340 (two clusters of 8 a head, two
#   blocks a SM; H200 295.6 against 292.6).
# - QKV_ATTENTION_MAX_SLOTS: from 2 sequences, only over caches of at most 256 slots: the op attends a
#   sequence with 8 / G blocks (4 at 2 rows, one from 5) where decode_attention splits long caches over
#   more (H200: batch 4 at 328 / 456 / 584 slots +6.6 / +1.1 / +29 us a step, batch 8 at 328 / 456
#   +22 / +48). One sequence takes it at any length: its one-row attention (16 keys a pass) wins at every
#   length measured (H200: 584 slots 192.9 us against 212.5, 972 slots 199.7 against 224.3).
# - LM_HEAD_PAD_ROWS: the folded lm_head's vocabulary rows padded with zero rows to a multiple of 64
#   (folded_linear), used above MAX_GEMV_ROWS rows: above MAX_MMA_ROWS cuBLAS writes the logits, and
#   GPT-2's 50257 columns leave each logits row 2-byte aligned, so cuBLAS runs an align1 CUTLASS kernel
#   (H200, fp16, batch 64: 106.6 us a step of 653, bench.profile); with 50304 columns its 16-byte-aligned
#   kernels run, and the logits are a view of the first 50257 (17-32 rows, our kernels' wide build, were
#   measured on the padded rows: linear.cpp's kMmaWideMaxRows). Up to MAX_GEMV_ROWS rows our kernel reads
#   the unpadded rows ([:vocab] of the same tensors) and the logits stay contiguous.
QKV_ATTENTION_MAX_ROWS = 8
QKV_ATTENTION_MAX_SLOTS = 256
LM_HEAD_PAD_ROWS = 64


def _qkv_attention_applies(rows: int, slots: int) -> bool:
    """Whether a decode step of ``rows`` sequences over a cache of ``slots`` slots runs c_attn and the attention
    as one qkv_decode_attention launch (by the table above; the layer checks the op's other conditions)."""
    return rows <= QKV_ATTENTION_MAX_ROWS and (rows == 1 or slots <= QKV_ATTENTION_MAX_SLOTS)

_annotate = False  # profiler labels around each module (bench.profile); never inside a graph


def scope(name: str):
    return torch.profiler.record_function(name) if _annotate else contextlib.nullcontext()


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    n_positions: int
    eps: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def load_hf_model(name_or_path: str = RANDOM_NAME, seed: int = 0):
    """``gpt2-random``: GPT-2 small's configuration (124M parameters) with seeded random
    weights (no download needed); anything else goes to ``GPT2LMHeadModel.from_pretrained``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if name_or_path == RANDOM_NAME:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return GPT2LMHeadModel(GPT2Config()).eval()
    return GPT2LMHeadModel.from_pretrained(name_or_path).eval()


# --------------------------------------------------------------------------- modules


class Linear(nn.Module):
    """y = act(x @ weight + bias) + residual with weight ``[n_in, n_out]`` (GPT-2's Conv1D layout, as
    checkpoints store it). ``pack()`` stores it transposed, ``[n_out, n_in]`` contiguous (nn.Linear's
    layout, which fused_attn.linear streams), and keeps ``weight`` as a view of that storage, so
    both backends read the same bytes."""

    def __init__(self, n_in: int, n_out: int, backend: str = "eager"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.backend = backend

    def pack(self) -> None:
        self.weight = packed_in_out(self.weight)

    @property
    def weight_nk(self) -> torch.Tensor:
        """``[n_out, n_in]``: contiguous after ``pack()``."""
        return self.weight.t()

    def forward(self, x: torch.Tensor, *, activation: str | None = None,
                residual: torch.Tensor | None = None, ln: "LayerNorm | None" = None) -> torch.Tensor:
        """``ln``: a LayerNorm applied to x first, in the launch's prologue with the fused backend."""
        if self.backend == "fused":
            folded = None if ln is None else ln.folded_into(self.weight_nk, self.bias, self, x)
            if folded is not None:
                return linear(x, *folded, activation=activation, residual=residual, norm="layer_norm", eps=ln.eps)
            return linear(x, self.weight_nk, self.bias, activation=activation, residual=residual,
                          **({} if ln is None else ln.fold_args()))
        if ln is not None:
            x = ln(x)
        y = torch.addmm(self.bias, x.flatten(0, -2), self.weight).view(*x.shape[:-1], -1)
        if activation == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        return y if residual is None else y + residual


@torch.no_grad()
def folded_linear(weight_nk: torch.Tensor, bias: torch.Tensor | None, ln: "LayerNorm",
                  owner: nn.Module, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W * g, bias + W @ b)``: a linear ``[n_out, n_in]`` with the LayerNorm ``ln`` (weight g, bias b)
    before it folded in, so that ``linear(x, *folded, norm="layer_norm")`` (the norm without weight and
    bias) computes ``linear(ln(x), W, bias)`` (up to the roundings of the folded weights to W's dtype).
    Without the norm's weight and bias, fused_attn.linear folds the norm itself into a one-row GEMV's
    dot products (csrc/linear/linear_kernel.cuh, kFold): layer_norm "folded"'s decode step at batch 1
    then has no norm launch. Computed in float32 once and kept on ``owner`` while the four tensors are
    the same (storage and version counter): an in-place change or a new state dict folds again.
    ``pad_rows``: both come with zero rows after the n_out real ones, up to a multiple of it (the lm_head's
    vocabulary: ``GPT2.logits``); ``[:n_out]`` of each is the unpadded pair."""
    key = tuple((t.data_ptr(), t._version) if t is not None else None for t in (weight_nk, bias, ln.weight, ln.bias))
    key = (*key, pad_rows)
    cached = getattr(owner, "_folded", None)
    if cached is None or cached[0] != key:
        w = weight_nk.float()
        n_out = w.shape[0]
        rows = -(-n_out // pad_rows) * pad_rows
        wf = w.new_zeros(rows, w.shape[1], dtype=weight_nk.dtype)
        bf = w.new_zeros(rows, dtype=weight_nk.dtype)
        wf[:n_out] = w * ln.weight.float()[None, :]
        bf[:n_out] = w @ ln.bias.float() + (0.0 if bias is None else bias.float())
        cached = (key, wf, bf)
        owner._folded = cached
    return cached[1], cached[2]


class LayerNorm(nn.Module):
    def __init__(self, n: int, eps: float, backend: str = "eager"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.bias = nn.Parameter(torch.empty(n))
        self.eps = eps
        self.backend = backend

    def folded_into(self, weight_nk: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module,
                    x: torch.Tensor, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With the "folded" backend and no gradient to record: the linear after this norm with the norm's
        weight and bias folded in (``folded_linear``, its ``pad_rows``), to call with a weightless
        ``norm="layer_norm"``; else None (the caller passes ``fold_args()``)."""
        if self.backend != "folded" or _requires_grad(x, weight_nk, self.weight):
            return None
        return folded_linear(weight_nk, bias, self, owner, pad_rows)

    def fold_args(self) -> dict:
        """This norm as fused_attn.linear's (and mlp's) pre-normalization arguments."""
        return dict(norm="layer_norm", norm_weight=self.weight, norm_bias=self.bias, eps=self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend in ("fused", "folded"):  # on its own, a folded norm is our kernel's launch
            return layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class KVCache(nn.Module):
    """One layer's keys and values ``[batch, nheads, max_len, headdim]``, preallocated: views of the
    DecodeCache's storage of every layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` ``[batch, nheads, len(input_pos), headdim]`` at cache slots ``input_pos``
        (a device tensor: capturable) and return the whole cache."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: Config, backend: str, linear_backend: str = "eager"):
        super().__init__()
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, linear_backend)
        self.c_proj = Linear(config.n_embd, config.n_embd, linear_backend)
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.backend = backend
        # num_splits of the "fused" decode step's decode_attention call: None lets its heuristic choose (a
        # tuning knob: `python -m bench.time_decode_graph --decode-splits N` sets it on every layer).
        self.decode_splits: int | None = None

    def forward(self, x: torch.Tensor, keys_ok: torch.Tensor, *, causal: bool,
                cache: KVCache | None = None, input_pos: torch.Tensor | None = None,
                attend_cache: bool = False, lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
                residual: torch.Tensor | None = None, ln: LayerNorm | None = None) -> torch.Tensor:
        """``x`` ``[batch, seqlen, n_embd]``; ``keys_ok`` bool, broadcastable to the scores
        ``[batch, nheads, seqlen, keys]``. With ``cache``, the new keys and values are written at
        ``input_pos``; ``attend_cache`` attends over the whole cache instead of the new keys only.
        ``lengths`` = (cache_seqlens, cache_leftpad), int32 ``[batch]`` device tensors of a
        left-padded decode step: the "fused" backend then appends and attends in one
        ``decode_attention`` call (``input_pos`` and ``keys_ok`` are the eager backend's). ``residual``
        is added to the output projection (in its epilogue with the fused linear backend); ``ln`` is
        applied to x first (in c_attn's prologue with the fused linear backend)."""
        b, s, _ = x.shape
        if (cache is not None and attend_cache and lengths is not None and self.backend == "fused"
                and _qkv_attention_applies(b, cache.k.shape[-2])
                and ln is not None and s == 1 and x.is_cuda
                and x.dtype in (torch.float16, torch.bfloat16) and self.head_dim == 64
                and x.shape[-1] % 256 == 0 and x.shape[-1] <= 1024):
            folded = ln.folded_into(self.c_attn.weight_nk, self.c_attn.bias, self.c_attn, x)
            if folded is not None and x.is_contiguous():  # c_attn + attention in one launch (qkv_decode_attention)
                a = qkv_decode_attention(x, *folded, cache.k, cache.v, lengths[0], lengths[1], eps=ln.eps,
                                         scale=self.scale)
                return self.c_proj(a, residual=residual)
        qkv = self.c_attn(x, ln=ln)
        q, k, v = qkv.view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None and attend_cache and lengths is not None and self.backend == "fused":
            a = decode_attention(q, cache.k, cache.v, lengths[0], k_new=k, v_new=v, cache_leftpad=lengths[1],
                                 scale=self.scale, num_splits=self.decode_splits)
            return self.c_proj(a.transpose(1, 2).reshape(b, s, -1), residual=residual)
        if cache is not None:
            k_all, v_all = cache.update(input_pos, k, v)
            if attend_cache:
                k, v = k_all, v_all
        if self.backend == "fused" and causal:  # a prompt: fused_attn.attention, in c_proj's layout
            return self.c_proj(self.attend_prompt(q, k, v, keys_ok), residual=residual)
        return self.c_proj(self.attend(q, k, v, keys_ok, causal).transpose(1, 2).reshape(b, s, -1), residual=residual)

    def attend_prompt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_ok: torch.Tensor) -> torch.Tensor:
        """Causal attention over the prompt with ``fused_attn.attention`` (one flash launch in 16-bit types),
        returned as ``[batch, seqlen, n_embd]``: written there in place (no transpose copy) unless a gradient
        is recorded (``out=`` records none). Padding query rows see no key: zeros."""
        b, h, s, d = q.shape
        if _requires_grad(q, k, v):
            o = attention(q, k, v, causal=True, attn_mask=keys_ok, scale=self.scale)
            return o.transpose(1, 2).reshape(b, s, h * d)
        o = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
        attention(q, k, v, causal=True, attn_mask=keys_ok, scale=self.scale, out=o.transpose(1, 2))
        return o.view(b, s, h * d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_ok: torch.Tensor,
               causal: bool) -> torch.Tensor:
        """softmax(q·kᵀ·scale, masked) · v: q ``[batch, nheads, seqlen_q, headdim]``, k and v
        ``[batch, nheads, seqlen_k, headdim]``; returns q's shape. Query rows with no visible key give 0."""
        if self.backend == "sdpa" and not causal:  # a decode step: every query sees its own new key
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keys_ok, scale=self.scale)
        scores = q @ k.transpose(-1, -2)
        probs = reference.scaled_masked_softmax(scores, self.scale, causal=causal, attn_mask=keys_ok,
                                                compute_dtype=torch.float32)
        return probs @ v


class MLP(nn.Module):
    def __init__(self, config: Config, backend: str = "eager", linear_backend: str = "eager"):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, linear_backend)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, linear_backend)
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ln: LayerNorm | None = None) -> torch.Tensor:
        """c_proj(gelu_tanh(c_fc(ln(x)))) + residual (x itself without ``ln``)."""
        if self.backend == "fused":
            folded = None if ln is None else ln.folded_into(self.c_fc.weight_nk, self.c_fc.bias, self.c_fc, x)
            if folded is not None:
                return mlp(x, *folded, self.c_proj.weight_nk, self.c_proj.bias, residual=residual, norm="layer_norm",
                           eps=ln.eps)
            return mlp(x, self.c_fc.weight_nk, self.c_fc.bias, self.c_proj.weight_nk, self.c_proj.bias,
                       residual=residual, **({} if ln is None else ln.fold_args()))
        return self.c_proj(self.c_fc(x, activation="gelu_tanh", ln=ln), residual=residual)


class Block(nn.Module):
    def __init__(self, config: Config, backends: dict[str, str]):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.eps, backends["layer_norm"])
        self.attn = Attention(config, backends["attention"], backends["linear"])
        self.ln_2 = LayerNorm(config.n_embd, config.eps, backends["layer_norm"])
        self.mlp = MLP(config, backends["mlp"], backends["linear"])
        # layer_norm "folded": ln_1 runs in c_attn's launch, ln_2 in c_fc's (their prologue).
        self.fold_norms = backends["layer_norm"] == "folded"

    def forward(self, x: torch.Tensor, keys_ok: torch.Tensor, normed: torch.Tensor | None = None,
                **attn_kw) -> torch.Tensor:
        """x + attn(ln_1(x)), then that + mlp(ln_2(that)); each residual add is the output
        projection's (an epilogue with the fused linear backend, an add kernel with eager). ``normed``:
        ln_1(x) already computed (the fused embedding's launch), not computed again; with layer_norm
        "folded" unused: ln_1 runs in c_attn's launch."""
        if self.fold_norms:
            with scope("attention"):  # ln_1 + QKV projection, cache update, attention, output projection + residual
                x = self.attn(x, keys_ok, residual=x, ln=self.ln_1, **attn_kw)
            with scope("mlp"):  # ln_2 + c_fc, c_proj + residual
                return self.mlp(x, residual=x, ln=self.ln_2)
        with scope("ln_1"):
            h = self.ln_1(x) if normed is None else normed
        with scope("attention"):  # QKV and output projections (+ residual), cache update, attention
            x = self.attn(h, keys_ok, residual=x, **attn_kw)
        with scope("ln_2"):
            h = self.ln_2(x)
        with scope("mlp"):  # + residual
            return self.mlp(h, residual=x)


class DecodeCache(nn.Module):
    """Device-side state of one generation shape: a KVCache per layer, which keys hold a real token
    (``keys_ok [batch, max_len]``), the cache slot of the next token, its position id, and the last
    token. Everything a decode step reads or writes, so that step can be a replayed CUDA graph.
    ``fused_sampler``: the next token from ``fused_attn.sample`` (one launch, written in place; its
    Philox offset ``rng`` drawn at the prefill from the seeded default generator), else from PyTorch ops."""

    def __init__(self, config: Config, batch: int, max_len: int, temperature: float, top_k: int,
                 dtype: torch.dtype, device: torch.device, fused_sampler: bool = False):
        super().__init__()
        self.batch, self.max_len = batch, max_len
        self.temperature, self.top_k = temperature, top_k
        self.fused_sampler = fused_sampler
        # Every layer's keys and values in one tensor each, [n_layer, batch, nheads, max_len, headdim], zeros;
        # each layer's KVCache holds views of its slice. Plain attributes, not buffers: buffers() (what a
        # graph capture saves and restores) lists each element once.
        shape = (config.n_layer, batch, config.n_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = nn.ModuleList(KVCache(k, v) for k, v in zip(self.k, self.v))
        self.register_buffer("keys_ok", torch.zeros(batch, max_len, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("slot", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
        # The per-token counters in one int32 buffer [3, batch]: decode_attention's valid slots per sequence
        # (seqlens), the position ids (pos) and the fused sampler's Philox offset (rng, equal in every row).
        # The fused sampler advances them in its own launch (sample's advance); else one add does.
        self.register_buffer("counters", torch.zeros(3 * batch, dtype=torch.int32, device=device),
                             persistent=False)
        self.seqlens, self.pos, self.rng = self.counters.view(3, batch).unbind(0)
        # decode_attention's first real slot per sequence.
        self.register_buffer("leftpad", torch.zeros(batch, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("token", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        # The fused sampler also records every new token here, at column seqlens (before its advance): the
        # prefill's at the prompt's last slot, step t's at the slot its keys went to. generate() reads the
        # new tokens from it, with no copy of `token` between replays.
        self.register_buffer("history", torch.zeros(batch, max_len, dtype=torch.long, device=device),
                             persistent=False)
        self.prefill_graphs: dict[int, _PrefillGraph] = {}  # by prompt length
        self.decode_graph: _DecodeGraph | None = None

    def set_next_token(self, logits: torch.Tensor) -> None:
        """``token`` = the next token of ``logits [batch, vocab]`` (``next_token``, or the fused sampler in
        place, which also records it in ``history`` and advances the counters: one launch for all three)."""
        if self.fused_sampler:
            sample(logits, self.temperature, top_k=self.top_k, offset=self.rng, out=self.token,
                   advance=self.counters.view(3, self.batch), history=self.history, history_index=self.seqlens)
        else:
            self.token.copy_(self.next_token(logits))

    def advance(self, slot: bool = True) -> None:
        """After a decode step: one more valid slot, position and sampler offset per sequence (unless the
        fused sampler advanced them), and the next cache slot (``slot=False``: the fused attention
        backend reads no slot)."""
        if not self.fused_sampler:
            self.counters.add_(1)
        if slot:
            self.slot.add_(1)

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy at temperature 0; else a sample of softmax(top-k(logits) / temperature)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits); capturable in a graph.
        # The default generator: CUDA graphs advance its offset on every replay.
        u = torch.rand(logits.shape, device=logits.device).clamp_(1e-20, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1)


# --------------------------------------------------------------------------- model


class GPT2(nn.Module):
    def __init__(self, config: Config, backends: dict[str, str] | None = None):
        super().__init__()
        self.config = config
        self.backends = check_backends(backends)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, self.backends) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.eps, self.backends["layer_norm"])
        # One DecodeCache per (batch, max_len, temperature, top_k), with its captured graphs:
        # a later generate() of the same shape reuses both.
        self._caches: dict[tuple, DecodeCache] = {}
        self._step: Callable[[DecodeCache], None] = self._decode_step

    def compile_decode_step(self, **compile_kw) -> "GPT2":
        """gpt-fast's recipe: the decode step through ``torch.compile`` (inductor's fused kernels;
        ``generate()`` then captures the compiled step in its CUDA graph). Returns the model."""
        self._step = torch.compile(self._decode_step, **compile_kw)
        for cache in self._caches.values():  # graphs captured from the uncompiled step
            cache.decode_graph = None
        return self

    @classmethod
    def from_hf(cls, hf_model, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                backends: dict[str, str] | None = None) -> "GPT2":
        """Weights of a transformers GPT2LMHeadModel (object, hub name or local path)."""
        if isinstance(hf_model, str):
            hf_model = load_hf_model(hf_model)
        c = hf_model.config
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(c, flag, False):
                raise ValueError(f"hf_model.config.{flag} must be False for fused_attn.gpt2, got True")
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hf_model.config.activation_function must be gelu_new, got {c.activation_function}")
        config = Config(c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions, c.layer_norm_epsilon)
        with torch.device("meta"):
            model = cls(config, backends)
        sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
        # Copies: the Hugging Face model keeps its own parameters (and their requires_grad).
        weights = {k: sd[k].detach().to(device=device, dtype=dtype, copy=True) for k in model.state_dict()}
        model.load_state_dict(weights, assign=True)
        if "fused" in (model.backends["linear"], model.backends["mlp"]):
            for m in model.modules():
                if isinstance(m, Linear):
                    m.pack()
        return model.requires_grad_(False).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def annotate(self) -> bool:
        return _annotate

    @annotate.setter
    def annotate(self, on: bool) -> None:
        global _annotate
        _annotate = bool(on)

    @staticmethod
    def positions(attention_mask: torch.Tensor) -> torch.Tensor:
        """transformers' generate() positions for left padding: cumsum(mask) - 1, pads at 1."""
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.masked_fill(attention_mask == 0, 1)

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with scope("embeddings"):
            return self.wte(ids) + self.wpe(pos)

    def embed_first_norm(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x, ln_1(x))`` of the embeddings ``x = wte[ids] + wpe[pos]`` (ids / pos of any shape; x is
        ``[*ids.shape, n_embd]``): with embed "fused" one layer_norm launch over the gathered rows, layer
        0's ln_1 included; else the lookups and the add, and None (layer 0 runs its ln_1 itself)."""
        if self.backends["embed"] != "fused":
            return self.embed(ids, pos), None
        ln_1 = self.h[0].ln_1
        with scope("embeddings"):
            normed, x = layer_norm(self.wte.weight, ln_1.weight, ln_1.bias, ln_1.eps, residual=self.wpe.weight,
                                   x_index=ids.reshape(-1), residual_index=pos.reshape(-1))
        shape = (*ids.shape, self.config.n_embd)
        return x.view(shape), normed.view(shape)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head(ln_f(x))."""
        folded = None
        if self.backends["linear"] == "fused":
            folded = self.ln_f.folded_into(self.wte.weight, None, self.ln_f, x, pad_rows=LM_HEAD_PAD_ROWS)
        if folded is not None:
            with scope("lm_head"):  # ln_f in the lm_head's launch, folded (folded_linear)
                vocab = self.config.vocab_size
                if x.numel() <= MAX_GEMV_ROWS * x.shape[-1]:  # our kernel: the unpadded rows, contiguous logits
                    return linear(x, folded[0][:vocab], folded[1][:vocab], norm="layer_norm", eps=self.ln_f.eps)
                return linear(x, *folded, norm="layer_norm", eps=self.ln_f.eps)[..., :vocab]
        with scope("ln_f"):
            x = self.ln_f(x)
        with scope("lm_head"):
            if self.backends["linear"] == "fused":  # wte is [vocab, n_embd]: nn.Linear's layout already
                return linear(x, self.wte.weight)
            return x @ self.wte.weight.t()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seqlen, vocab]`` of a causal (teacher-forced) pass over left-padded prompts."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.logits(self.hidden(input_ids, attention_mask))

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               cache: DecodeCache | None = None) -> torch.Tensor:
        """Hidden states ``[batch, seqlen, n_embd]`` of a causal pass over left-padded prompts; with
        ``cache``, each layer's keys and values are also written into its first seqlen slots."""
        keys_ok = attention_mask.bool()[:, None, None, :]
        x, normed = self.embed_first_norm(input_ids, self.positions(attention_mask))
        kw: dict = dict(causal=True)
        if cache is not None:
            kw["input_pos"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self._blocks(x, normed, keys_ok, cache, **kw)

    def _blocks(self, x: torch.Tensor, normed: torch.Tensor | None, keys_ok: torch.Tensor,
                cache: DecodeCache | None, **kw) -> torch.Tensor:
        """Every block over x (``normed``: layer 0's ln_1(x) or None)."""
        for i, block in enumerate(self.h):
            x = block(x, keys_ok, normed if i == 0 else None, cache=None if cache is None else cache.layers[i], **kw)
        return x

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def prefill(self, cache: DecodeCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompt, fill the cache's first seqlen slots, and set up the first decode step;
        returns the first new token ``[batch]``."""
        s = input_ids.shape[1]
        cache.keys_ok.zero_()
        cache.keys_ok[:, :s] = attention_mask.bool()
        x = self.hidden(input_ids, attention_mask, cache=cache)
        if cache.fused_sampler and cache.temperature > 0:  # seeded: generate() calls torch.manual_seed(seed)
            cache.rng.copy_(torch.randint(0, 2**31 - 1, (1,), device=cache.rng.device))  # every row's
        logits = self.logits(x[:, -1])
        cache.slot.fill_(s)
        cache.leftpad.copy_(s - attention_mask.sum(-1))
        last_pos = self.positions(attention_mask)[:, -1]
        if cache.fused_sampler:  # the sampler records the token at column seqlens, then advances the counters
            cache.seqlens.fill_(s - 1)
            cache.pos.copy_(last_pos)
            cache.set_next_token(logits)
        else:
            cache.set_next_token(logits)
            cache.seqlens.fill_(s)
            cache.pos.copy_(last_pos + 1)
        return cache.token.clone()

    @torch.no_grad()
    def decode_step(self, cache: DecodeCache) -> None:
        """One token for every sequence from device-side state only (capturable): embed the last
        token, write its keys and values at the cache's slot, attend over the cache, next token
        (compiled after ``compile_decode_step()``)."""
        self._step(cache)

    def _decode_step(self, cache: DecodeCache) -> None:
        fused = self.backends["attention"] == "fused"
        if not fused:  # the fused backend reads seqlens / leftpad instead of the key mask
            cache.keys_ok.index_fill_(1, cache.slot, True)
        x, normed = self.embed_first_norm(cache.token[:, None], cache.pos[:, None])
        keys_ok = cache.keys_ok[:, None, None, :]
        lengths = (cache.seqlens, cache.leftpad) if fused else None
        x = self._blocks(x, normed, keys_ok, cache, causal=False, input_pos=cache.slot, attend_cache=True,
                         lengths=lengths)
        cache.set_next_token(self.logits(x[:, 0]))
        cache.advance(slot=not fused)

    def decode_cache(self, batch: int, max_len: int, temperature: float = 0.0, top_k: int = 0) -> DecodeCache:
        """The DecodeCache of this shape and sampling setting (created on first use, then reused)."""
        key = (batch, max_len, float(temperature), int(top_k))
        if key not in self._caches:
            self._caches[key] = DecodeCache(self.config, batch, max_len, temperature, top_k, self.dtype, self.device,
                                            fused_sampler=self.backends["linear"] == "fused")
        return self._caches[key]

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        eos_token_id: int | None = None,
        use_graph: bool = True,
        sync_every: int = 16,
        seed: int = 0,
        on_token: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Prompt ``[batch, seqlen]`` (left padded per ``attention_mask``) followed by up to
        ``max_new_tokens`` tokens; greedy when temperature == 0, else softmax sampling at that
        temperature (top_k > 0 keeps the k largest logits). After a sequence emits
        ``eos_token_id`` it is filled with it; generation stops early when all have (checked
        every ``sync_every`` tokens, the only host synchronization). ``on_token()`` is called
        right after each new token is enqueued, the first included (for timing with CUDA events)."""
        c = self.config
        b, s = input_ids.shape
        if input_ids.device != self.device:
            raise ValueError(f"input_ids must be on the model's device ({self.device}), got {input_ids.device}")
        total = s + max_new_tokens
        if total > c.n_positions:
            raise ValueError(f"prompt length + max_new_tokens must be <= n_positions ({c.n_positions}), got {total}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.backends["attention"] == "fused":
            check_left_padded(attention_mask)
        cuda = self.device.type == "cuda"
        use_graph = use_graph and cuda
        cache = self.decode_cache(b, total, temperature, top_k)
        notify = on_token or (lambda: None)

        # Sampling draws from the seeded default generators, forked so the caller's stream of random numbers
        # is untouched; greedy decoding draws nothing (and saves the ~0.2 ms of host time the two cost).
        seeded = temperature > 0
        with torch.random.fork_rng(devices=[self.device] if cuda else []) if seeded else contextlib.nullcontext():
            if seeded:
                torch.manual_seed(seed)
            if use_graph:  # the prefill is host-bound (~180 launches): replay it as one graph too
                pg = cache.prefill_graphs.get(s)
                if pg is None:
                    pg = cache.prefill_graphs[s] = _PrefillGraph(self, cache, input_ids, attention_mask)
                first = pg.run(input_ids, attention_mask)
                if cache.decode_graph is None:
                    cache.decode_graph = _DecodeGraph(self, cache)
                step = cache.decode_graph.replay
            else:
                first = self.prefill(cache, input_ids, attention_mask)
                step = lambda: self.decode_step(cache)  # noqa: E731
            notify()
            # The fused sampler records each token in cache.history (columns s - 1 on); otherwise each is
            # copied out of cache.token between steps.
            recorded = cache.fused_sampler
            out = [first]

            def so_far(n: int) -> torch.Tensor:  # the first n new tokens
                return cache.history[:, s - 1:s - 1 + n] if recorded else torch.stack(out, 1)[:, :n]

            done_at = None
            for t in range(1, max_new_tokens):
                step()
                if not recorded:
                    out.append(cache.token.clone())
                notify()
                if eos_token_id is not None and t % sync_every == 0:
                    if bool((so_far(t + 1) == eos_token_id).any(1).all()):
                        done_at = t + 1
                        break
        gen = so_far(max_new_tokens if done_at is None else done_at).clone()
        if eos_token_id is not None:
            hit = (gen == eos_token_id).long().cumsum(1) > 0
            after = torch.cat([torch.zeros_like(hit[:, :1]), hit[:, :-1]], 1)
            gen = gen.masked_fill(after, eos_token_id)
        return torch.cat([input_ids, gen], 1)


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """The fused decode step reads a start offset per sequence (``DecodeCache.leftpad``), so a prompt's
    padding must all sit on the left. Reads the mask on the host (one synchronization per generate())."""
    m = attention_mask.bool()
    if bool((m.long().cummax(-1).values.bool() & ~m).any()):
        raise ValueError("attention_mask must be left padded (0s only before a row's first 1) for the fused "
                         "attention backend, got a row with a 0 after a 1")


def check_backends(backends: dict[str, str] | None) -> dict[str, str]:
    """Fill in defaults and reject unknown module kinds or backends, naming them."""
    chosen = {kind: options[0] for kind, options in BACKENDS.items()}
    for kind, backend in (backends or {}).items():
        if kind not in BACKENDS:
            raise ValueError(f"backends must name module kinds among {tuple(BACKENDS)}, got {kind!r}")
        if backend not in BACKENDS[kind]:
            raise ValueError(f"backends[{kind!r}] must be one of {BACKENDS[kind]}, got {backend!r}")
        chosen[kind] = backend
    if chosen["layer_norm"] == "folded" and chosen["linear"] != "fused":
        raise ValueError(f"backends['layer_norm'] 'folded' must come with backends['linear'] 'fused' (the norm runs "
                         f"in fused_attn.linear's launch), got {chosen['linear']!r}")
    if chosen["embed"] == "fused" and chosen["layer_norm"] not in ("fused", "folded"):
        raise ValueError(f"backends['embed'] 'fused' must come with backends['layer_norm'] 'fused' or 'folded' (the "
                         f"embedding is our norm kernel's gathered-row launch), got {chosen['layer_norm']!r}")
    return chosen


# --------------------------------------------------------------------------- CUDA graphs


def _capture(cache: DecodeCache, fn):
    """Warm ``fn`` up on a side stream, undo its effect on the cache and on the device's random numbers, then
    capture it. The warm-up draws from the seeded generator: kept, the first generate() after a capture drew
    other tokens than every later one with the same seed."""
    saved = [t.clone() for t in cache.buffers()]
    device = cache.keys_ok.device
    rng = torch.cuda.get_rng_state(device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # allocator, cuBLAS workspaces, our library
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for dst, src in zip(cache.buffers(), saved):
        dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run
        result = fn()
    torch.cuda.set_rng_state(rng, device)
    return graph, result


class _PrefillGraph:
    """The prefill of one prompt shape, captured with its own input buffers."""

    def __init__(self, model: GPT2, cache: DecodeCache, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.ids, self.mask = input_ids.clone(), attention_mask.clone()
        self.graph, self.first = _capture(cache, lambda: model.prefill(cache, self.ids, self.mask))

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(input_ids)
        self.mask.copy_(attention_mask)
        self.graph.replay()
        return self.first.clone()


class _DecodeGraph:
    """The decode step of one DecodeCache, captured once; each replay advances that cache."""

    def __init__(self, model: GPT2, cache: DecodeCache):
        self.graph, _ = _capture(cache, lambda: model.decode_step(cache))

    def replay(self) -> None:
        self.graph.replay()
