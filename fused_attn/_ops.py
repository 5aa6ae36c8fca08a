"""The ``fused_attn`` operator library: every op's schema, in one place, and the CUDA library
loaded on the first CUDA call.

The schemas are defined here, from Python, when ``fused_attn`` is imported, so
``torch.ops.fused_attn.*`` exist without a build: each op's module (``fused_attn/<op>.py``)
registers its CPU kernel, fake (meta) kernel and autograd at import, so CPU tensors, meta
tensors and ``torch.compile`` tracing never need nvcc. The CUDA kernels are the compiled
library's (``TORCH_LIBRARY_IMPL(fused_attn, CUDA, m)`` in ``csrc/<op>/<op>.cpp``); the C++ side
defines no schema, so loading it never collides with the definitions below.

Until the library is loaded, a CUDA tensor reaches the op's ``CompositeExplicitAutograd``
kernel registered here (the dispatcher's fallback for a backend with no kernel of its own),
which builds and loads the library (``fused_attn.build``: first time on a machine only) and
calls the op again, now reaching the C++ kernel. Loading adds kernels under the ``CUDA`` key,
which no Python registration uses, and the fallback stays registered but is never reached again.
"""

from __future__ import annotations

import torch

LIB = torch.library.Library("fused_attn", "DEF")
OPS: list[str] = []  # the names defined below


def _define(schema: str) -> None:
    LIB.define(schema)
    OPS.append(schema.split("(", 1)[0])


# softmax(x * scale + attn_mask) over the last dim of x [..., seqlen_q, seqlen_k];
# causal masks key j for query i unless j <= i + seqlen_k - seqlen_q.
# version: 0 = textbook kernel, 1 = fused kernel (default).
# attn_mask is positional here (keyword-only in the Python API): torch.library's
# register_autograd takes no keyword-only tensors, and an additive mask can require grad.
_define(
    "scaled_masked_softmax(Tensor x, float scale=1.0, Tensor? attn_mask=None, *, "
    "bool causal=False, int version=1) -> Tensor"
)
# The out= variant records no gradient: it raises when an input requires grad.
_define(
    "scaled_masked_softmax_out(Tensor x, float scale, Tensor? attn_mask, *, bool causal, "
    "int version, Tensor(a!) out) -> ()"
)
# Backward of scaled_masked_softmax: dx = scale * y * (grad - sum_j grad * y) per row, with
# y the forward's output (its zeros carry the mask). Differentiable again (double backward).
_define("scaled_masked_softmax_backward(Tensor grad, Tensor y, float scale, *, bool causal=False) -> Tensor")

# New queries q [batch, nheads_q, seqlen_new, headdim] attending over a KV cache [batch, nheads_kv,
# max_len, headdim]; with k_new/v_new, they are first written at slots cache_seqlens[b]... (in place).
# cache_seqlens / cache_leftpad: int32 [batch] on q's device (cache_seqlens None: every slot valid);
# key_mask: bool [batch or 1, max_len], True = attend. num_splits 0: the heuristic's choice.
# block_table: int32 [batch, max_blocks] on q's device: the caches are then page pools [num_pages,
# nheads_kv, page_size, headdim], slot s of sequence b at row s % page_size of page block_table[b, s // page_size].
# cu_seqlens_q: int32 [batch + 1] on q's device, a ragged batch: q packed [total_q, nheads_q, headdim] (k_new / v_new
# [total_q, nheads_kv, headdim]), sequence b's new tokens rows cu[b] .. cu[b + 1] - 1, batch the cache's;
# max_seqlen_q >= every cu[b + 1] - cu[b] sizes the grid (0 without cu_seqlens_q).
_define(
    "decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? cache_seqlens, "
    "Tensor? k_new=None, Tensor? v_new=None, Tensor? cache_leftpad=None, Tensor? key_mask=None, "
    "float? scale=None, int num_splits=0, Tensor? block_table=None, Tensor? cu_seqlens_q=None, "
    "int max_seqlen_q=0) -> Tensor"
)
_define(
    "decode_attention_out(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? cache_seqlens, "
    "Tensor? k_new, Tensor? v_new, Tensor? cache_leftpad, Tensor? key_mask, float? scale, int num_splits, "
    "Tensor? block_table=None, Tensor? cu_seqlens_q=None, int max_seqlen_q=0, *, Tensor(c!) out) -> ()"
)

# A pre-LN block's QKV projection and its decode attention in one launch (one new token per sequence):
# x [batch, 1, d] normalized (LayerNorm without affine, eps), qkv = that · w_qkvᵀ + b_qkv (w_qkv [3 d, d]:
# the norm's weight and bias folded in), k / v appended to the caches [batch, d / 64, max_len, 64] at
# slot cache_seqlens[b], attention over slots cache_leftpad[b] .. cache_seqlens[b]; returns [batch, 1, d].
_define(
    "qkv_decode_attention(Tensor x, Tensor w_qkv, Tensor? b_qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor cache_seqlens, Tensor? cache_leftpad, float eps, float scale) -> Tensor"
)

# GPT-2's decode step in one persistent launch (float16 / bfloat16, 1-4 sequences, sm_90): embedding of token
# [batch] at pos, every layer (layers: 12 tensors a layer, ln_1 w/b, c_attn w [3C, C] / b, c_proj w [C, C] / b,
# ln_2 w/b, c_fc w [4C, C] / b, c_proj w [C, 4C] / b), each layer's key and value appended at slot seqlens[b]
# of k_cache / v_cache [n_layer, batch, C / 64, max_len, 64], attention over slots leftpad[b] .. seqlens[b],
# ln_f and the tied lm_head; returns the logits [batch, vocab]. workspace: uint8, zeros before the first call.
# trace: optional int64 [SMs, 2048] (CUDA): each block's phase timeline in %globaltimer ns.
_define(
    "gpt2_decode_step(Tensor token, Tensor pos, Tensor seqlens, Tensor leftpad, Tensor wte, Tensor wpe, "
    "Tensor[] layers, Tensor lnf_w, Tensor lnf_b, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) workspace, "
    "float eps, Tensor? trace=None) -> Tensor"
)

# LayerNorm over the last dim of x [..., width] (rms: RMSNorm, no centering), float32 statistics;
# weight / bias [width] (x's dtype or float32) or None. add_layer_norm first adds residual (x's shape
# and dtype) and returns (y, h = x + residual in x's dtype): the pre-LN transformer's add + norm.
# x_index / residual_index (int32 / int64 [rows]): gathered rows, row i of x is x[x_index[i]] of a
# [table rows, width] x (likewise the residual): an embedding's lookup, added and normalized in the
# same pass (GPT-2's wte[token] + wpe[pos], then ln_1); an index out of range gives a NaN row.
_define("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, *, bool rms=False) -> Tensor")
_define(
    "add_layer_norm(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, Tensor? x_index=None, "
    "Tensor? residual_index=None, *, bool rms=False) -> (Tensor, Tensor)"
)

# Full attention softmax(q·kᵀ·scale + mask)·v: q [batch, nheads_q, seqlen_q, headdim], k / v [batch,
# nheads_kv, seqlen_k, headdim] (nheads_q a multiple of nheads_kv); causal bottom-right aligned as in
# scaled_masked_softmax; attn_mask bool (True = attend) or additive, broadcastable to [batch, nheads_q,
# seqlen_q, seqlen_k]. algo: the Python API's mode ("auto", "naive", "tiled", "flash", "flash_mma", "flash_wgmma"; neither
# `mode` nor `kernel` here: torch.compile's auto_functionalize and Inductor's fallback take those
# names positionally, and a keyword of the same name collides with them). Returns (out, lse): lse float32 [batch,
# nheads_q, seqlen_q] (natural log, -inf on rows with no visible key) when return_lse, else an empty
# float32 tensor. attn_mask is positional for the same reason as scaled_masked_softmax's.
_define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float? scale=None, *, bool causal=False, "
    "str algo=\"auto\", bool return_lse=False) -> (Tensor, Tensor)"
)
# The out= variant records no gradient; lse is written when it has numel > 0 (shape [batch, nheads_q, seqlen_q]).
_define(
    "attention_out(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float? scale, *, bool causal, str algo, "
    "Tensor(a!) out, Tensor(b!) lse) -> ()"
)
# The next token of each row of logits [..., vocab] (returns int64 [...]): the argmax at temperature 0,
# else a sample of softmax(logits / temperature) by the Gumbel-max trick with Philox4x32-10 uniforms of
# (seed, offset + offsets[row], row, column): offsets None, or int32 / int64 with 1 element or one per row.
# top_k > 0 (sampling only): the draw among the top_k largest logits of the row and any equal to the
# top_k-th (torch.topk's order: NaN largest; a NaN top_k-th keeps every column); 0 or >= vocab: all.
# sample_out's advance (int32 / int64 [k, rows]): column r += 1 once row r's token is written (a decode
# loop's per-row counters, advanced in the same launch); offsets may be one of its rows, never shared.
# history (int64 [rows, L], last dim stride 1, stride(0) >= L) with history_index (int32 / int64 [rows]),
# both or neither: row r's token also goes to history[r, history_index[r]], the index read before the row
# advances (it may be one of advance's rows); an index outside [0, L) writes nothing there and -1 to out[r].
_define("sample(Tensor logits, float temperature, int seed, int offset, Tensor? offsets, int top_k=0) -> Tensor")
_define(
    "sample_out(Tensor logits, float temperature, int seed, int offset, Tensor? offsets, int top_k=0, *, "
    "Tensor(a!) out, "
    "Tensor(b!)? advance=None, Tensor(c!)? history=None, Tensor? history_index=None) -> ()"
)
# y = act(x @ weight^T + bias) + residual: x [..., in_features], weight [out_features, in_features]
# (nn.Linear's layout), bias [out_features], residual [..., out]. activation: 0 none, 1 gelu_tanh,
# 2 swiglu (weight = gate rows over up rows; out = silu(gate) * up has out_features / 2 columns).
# norm: 0 none, 1 layer_norm, 2 rms_norm of x's rows first (norm_weight / norm_bias [in_features], x's
# dtype or float32, eps), as layer_norm / rms_norm compute it. norm_weight and norm_bias are positional:
# register_autograd differentiates positional tensors only.
_define("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, *, int activation=0, int norm=0, float eps=1e-05) -> Tensor")
# The feed-forward block: linear(linear(x, w_fc, b_fc, activation), w_proj, b_proj, residual), the hidden
# activations rounded to x's dtype between the two. x [..., in_features]; w_fc [hidden, in_features]
# ([2 hidden, in_features], gate rows over up rows, for swiglu), b_fc [w_fc rows]; w_proj [out, hidden],
# b_proj [out]; residual [..., out]. activation: 1 gelu_tanh, 2 swiglu. On CUDA the two linear launches
# (csrc/mlp/mlp.cpp). Not differentiable (fused_attn.mlp runs the two linears when a gradient is wanted).
_define("mlp(Tensor x, Tensor w_fc, Tensor? b_fc, Tensor w_proj, Tensor? b_proj, Tensor? residual, *, "
        "int activation=1) -> Tensor")

_loaded = False
# The direct path (csrc/direct/direct.cpp): the loaded library as a Python module whose functions run an
# op's CUDA implementation without the dispatcher, or return None where the dispatcher must run it
# (autograd, a mode, a subclass, a non-CUDA tensor). None until the library is loaded. The wrappers call
# it for eager calls only (never while torch.compile traces); a ValueError / TypeError from it makes them
# take the dispatcher path, whose checks raise the message the tests pin.
direct = None


def ensure_loaded() -> bool:
    """Build (first time on this machine) and load the CUDA library; idempotent. Only CUDA
    tensors need it: CPU and meta tensors run the kernels registered from Python."""
    global _loaded, direct
    if not _loaded:
        import importlib.util

        from fused_attn import build

        path = build.library_path()
        torch.ops.load_library(str(path))
        # The same file, already loaded: importing it runs only its module init (PYBIND11_MODULE).
        spec = importlib.util.spec_from_file_location(build.LIB_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        direct = module
        _loaded = True
    return True


def is_loaded() -> bool:
    return _loaded


# torch.compile calls ensure_loaded at trace time and treats the result as a constant
# instead of tracing the build into the graph. This is what
# torch._dynamo.assume_constant_result does; setting the marker directly keeps
# `import fused_attn` from importing torch._dynamo (~3 s).
ensure_loaded._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _load_on_first_cuda_call(name: str):
    qualname = f"fused_attn::{name}"

    def kernel(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(t.device.type == "cuda" for t in tensors):
            devices = ", ".join(sorted({str(t.device) for t in tensors}))
            raise NotImplementedError(f"{qualname}'s tensors must be CPU, CUDA or meta tensors, got {devices}")
        ensure_loaded()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"):  # else this kernel again
            raise RuntimeError(f"{qualname} must have a CUDA kernel once the CUDA library is loaded, got none")
        return getattr(torch.ops.fused_attn, name).default(*args, **kwargs)

    return kernel


for _name in OPS:
    LIB.impl(_name, _load_on_first_cuda_call(_name), "CompositeExplicitAutograd")
