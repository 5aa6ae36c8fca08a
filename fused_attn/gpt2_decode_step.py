"""``gpt2_decode_step``: GPT-2's whole decode step (one new token per sequence) in one persistent launch.

    logits = gpt2_decode_step(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b,
                              k_cache, v_cache, workspace, eps)

computes, for each sequence b (C = n_embd, heads of 64):

    x = wte[token[b]] + wpe[pos[b]]                                   (rounded to the weights' dtype)
    per layer: h = ln_1(x); q, k, v = h · w_qkvᵀ + b_qkv; k, v written at slot seqlens[b] of the layer's
               cache; a = softmax(q · Kᵀ / 8) · V over slots leftpad[b] .. seqlens[b];
               x = x + a · w_oᵀ + b_o; x = x + gelu_tanh(ln_2(x) · w_fcᵀ + b_fc) · w_pᵀ + b_p
    logits[b] = ln_f(x) · wteᵀ

with every intermediate rounded to the weights' dtype where GPT-2's PyTorch modules round it (norm
outputs, q / k / v, the attention's output, the MLP's hidden, the residual stream after each add) and
every sum in float32. ``layers`` holds 12 tensors a layer: ln_1 weight, bias; c_attn weight ``[3C, C]``, bias;
c_proj weight ``[C, C]``, bias; ln_2 weight, bias; c_fc weight ``[4C, C]``, bias; the MLP's c_proj weight
``[C, 4C]``, bias (weights in nn.Linear's ``[n_out, n_in]`` layout, all contiguous). Caches ``[n_layer,
batch, C / 64, max_len, 64]``. ``workspace``: uint8, at least ``workspace_bytes(batch, C, n_layer)``
bytes, zeros before its first call and used by one call at a time.

On CUDA (float16 / bfloat16, 1-4 sequences, C a multiple of 256 up to 1024, sm_90) one cooperative launch
(``csrc/gpt2_decode_step/``): one block an SM, every phase's weights cut into one tile a block and streamed
into shared memory ahead of the phase, each hand-off between blocks a flagged store that its readers poll (no
counter, no fence, no grid barrier). The
next token is the caller's (``fused_attn.sample`` over the logits). A token, position or length out of
range (device values, not checked on the host) gives that sequence NaN logits and reads nothing out of
bounds. On the CPU: the same computation in PyTorch (float32 sums), with the lengths checked.
No gradient: an input that requires grad raises.

``fused_attn.gpt2`` runs its decode step on it where ``MEGAKERNEL_MAX_ROWS`` (the heuristics table there)
says it beats the launch chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fused_attn import _ops

HEAD_DIM = 64
MAX_ROWS = 4        # csrc/gpt2_decode_step/gpt2_decode_step_launch.h: kStepMaxRows
MAX_LAYERS = 48     # kStepMaxLayers
MAX_WIDTH = 1024    # kStepMaxWidth
LAYER_TENSORS = 12
_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


MAX_SPLITS, PART_LINES = 4, 33  # kStepMaxSplits, kStepPartLines: the attention's split partials


def workspace_bytes(batch: int, width: int, n_layer: int) -> int:
    """The workspace a call needs (csrc/gpt2_decode_step/gpt2_decode_step_launch.h: step_workspace_bytes): a
    256-byte header, then per layer its hand-offs as 16-byte lines: q, k, v, the residual stream twice and the
    MLP's hidden (9 C / 4 lines a sequence) and the attention's split partials."""
    lines = 9 * batch * width // 4 + batch * (width // HEAD_DIM) * MAX_SPLITS * PART_LINES
    return 256 + n_layer * lines * 16


def _layer_shapes(c: int) -> list[tuple[int, ...]]:
    return [(c,), (c,), (3 * c, c), (3 * c,), (c, c), (c,), (c,), (c,), (4 * c, c), (4 * c,), (c, 4 * c), (c,)]


def check_step_args(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace,
                    eps) -> None:
    """Raise TypeError / ValueError naming the bad argument (csrc/gpt2_decode_step checks what guards memory)."""
    for name, t in (("token", token), ("pos", pos), ("seqlens", seqlens), ("leftpad", leftpad), ("wte", wte),
                    ("wpe", wpe), ("lnf_w", lnf_w), ("lnf_b", lnf_b), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("workspace", workspace)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    cpu = wte.device.type == "cpu"
    if wte.dtype not in (_CPU_DTYPES if cpu else _DTYPES):
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float16 or bfloat16 on CUDA"
        raise ValueError(f"wte must have dtype {names}, got {wte.dtype}")
    if wte.dim() != 2 or not wte.is_contiguous():
        raise ValueError(f"wte must be a contiguous [vocab, n_embd] tensor, got {tuple(wte.shape)}")
    c = wte.shape[1]
    if c % 256 != 0 or c > MAX_WIDTH:
        raise ValueError(f"wte must have n_embd a multiple of 256 up to {MAX_WIDTH}, got {tuple(wte.shape)}")
    if wpe.device != wte.device or wpe.dtype != wte.dtype or wpe.dim() != 2 or wpe.shape[1] != c \
            or not wpe.is_contiguous():
        raise ValueError(f"wpe must be a contiguous [n_positions, {c}] tensor of wte's dtype and device, got "
                         f"{tuple(wpe.shape)} {wpe.dtype} {wpe.device}")
    if not isinstance(layers, (list, tuple)) or not layers or len(layers) % LAYER_TENSORS \
            or len(layers) // LAYER_TENSORS > MAX_LAYERS:
        n = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
        raise ValueError(f"layers must hold 12 tensors a layer for 1 to {MAX_LAYERS} layers, got {n} tensors")
    shapes = _layer_shapes(c)
    for i, t in enumerate(layers):
        want = shapes[i % LAYER_TENSORS]
        if not isinstance(t, torch.Tensor) or t.device != wte.device or t.dtype != wte.dtype \
                or tuple(t.shape) != want or not t.is_contiguous():
            got = (f"{tuple(t.shape)} {t.dtype} {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"layers must hold contiguous tensors of wte's dtype and device, tensor {i} of shape "
                             f"{want}, got {got}")
    n_layer = len(layers) // LAYER_TENSORS
    for name, t in (("lnf_w", lnf_w), ("lnf_b", lnf_b)):
        if t.device != wte.device or t.dtype != wte.dtype or tuple(t.shape) != (c,) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{c}] tensor of wte's dtype and device, got "
                             f"{tuple(t.shape)} {t.dtype} {t.device}")
    if token.device != wte.device or token.dtype != torch.int64 or token.dim() != 1 or not token.is_contiguous():
        raise ValueError(f"token must be a contiguous int64 [batch] tensor on wte's device, got "
                         f"{tuple(token.shape)} {token.dtype} {token.device}")
    batch = token.shape[0]
    if batch < 1 or (not cpu and batch > MAX_ROWS):
        raise ValueError(f"token must have 1 to {MAX_ROWS} rows, got {tuple(token.shape)}")
    for name, t in (("pos", pos), ("seqlens", seqlens), ("leftpad", leftpad)):
        if t.device != wte.device or t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.stride(0) != 1:
            raise ValueError(f"{name} must be an int32 [{batch}] tensor on wte's device, got "
                             f"{tuple(t.shape)} {t.dtype} {t.device}")
    want = (n_layer, batch, c // HEAD_DIM)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != wte.device or t.dtype != wte.dtype or t.dim() != 5 or tuple(t.shape[:3]) != want \
                or t.shape[4] != HEAD_DIM or t.shape[3] < 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{n_layer}, {batch}, {c // HEAD_DIM}, max_len, 64] tensor "
                             f"of wte's dtype and device, got {tuple(t.shape)} {t.dtype} {t.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    need = workspace_bytes(batch, c, n_layer)
    if workspace.device != wte.device or workspace.dtype != torch.uint8 or not workspace.is_contiguous() \
            or workspace.numel() < need:
        raise ValueError(f"workspace must be a contiguous uint8 tensor of at least {need} bytes on wte's device, got "
                         f"{tuple(workspace.shape)} {workspace.dtype} {workspace.device}")


TRACE_STRIDE = 2048  # kStepTraceStride: stamps a block
TRACE_PHASES = ("c_attn", "attention", "c_proj", "c_fc", "mlp c_proj")


def gpt2_decode_step(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace,
                     eps: float = 1e-5, *, trace: torch.Tensor | None = None) -> torch.Tensor:
    """The logits ``[batch, vocab]`` of one decode step, with every layer's key and value appended (module
    docstring). ``trace`` (CUDA only): an int64 ``[SMs, 2048]`` tensor; each block's thread 0 writes its phase
    timeline there in %globaltimer nanoseconds: column 0 its start, then for layer l and phase p
    (``TRACE_PHASES``) columns ``1 + (5 l + p) * 6 + k``: k = 0 before the phase's wait, 1 after it, 2 after its
    signal, and for the GEMV phases 3 after the input is staged, 4 after the weights are in, 5 after the dot
    products (0 where the block has no such work); then the lm_head's (layer n_layer, phase 0)."""
    check_step_args(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace, eps)
    if trace is not None and wte.device.type != "cuda":
        raise ValueError(f"trace must be None on {wte.device.type} (it records the CUDA kernel's phases), got a tensor")
    if wte.device.type == "cuda":
        _ops.ensure_loaded()
    return torch.ops.fused_attn.gpt2_decode_step(token, pos, seqlens, leftpad, wte, wpe, list(layers), lnf_w, lnf_b,
                                                 k_cache, v_cache, workspace, float(eps), trace)


def _cpu(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, eps) -> torch.Tensor:
    dt, c = wte.dtype, wte.shape[1]
    acc = torch.float64 if dt == torch.float64 else torch.float32  # the kernel's float32 sums
    batch, heads, max_len = token.shape[0], c // HEAD_DIM, k_cache.shape[3]
    slots, starts = seqlens.tolist(), leftpad.tolist()
    for b, (n, s) in enumerate(zip(slots, starts)):
        if not (0 <= s <= n < max_len):
            raise ValueError(f"seqlens must be in [leftpad, max_len - 1] = [{s}, {max_len - 1}] for the new slot, "
                             f"got seqlens[{b}] = {n}")
    if not all(0 <= t < wte.shape[0] for t in token.tolist()) or not all(0 <= p < wpe.shape[0] for p in pos.tolist()):
        raise ValueError(f"token and pos must index wte ({wte.shape[0]}) and wpe ({wpe.shape[0]}), got "
                         f"{token.tolist()} and {pos.tolist()}")

    def rnd(v):  # stored in the weights' dtype, as the modules store it
        return v.to(dt).to(acc)

    def ln(v, w, bias):
        return rnd(F.layer_norm(v, (c,), w, bias, eps))

    x = rnd(wte[token].to(acc) + wpe[pos.long()].to(acc))
    for i in range(len(layers) // LAYER_TENSORS):
        ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_p, b_p = (
            t.to(acc) for t in layers[i * LAYER_TENSORS:(i + 1) * LAYER_TENSORS])
        qkv = rnd(ln(x, ln1_w, ln1_b) @ w_qkv.T + b_qkv).view(batch, 3, heads, HEAD_DIM)
        a = torch.empty(batch, heads, HEAD_DIM, dtype=acc)
        for b in range(batch):
            k_cache[i, b, :, slots[b]] = qkv[b, 1].to(dt)
            v_cache[i, b, :, slots[b]] = qkv[b, 2].to(dt)
            keys = k_cache[i, b, :, starts[b]:slots[b] + 1].to(acc)   # [heads, n, 64]
            values = v_cache[i, b, :, starts[b]:slots[b] + 1].to(acc)
            scores = torch.einsum("hd,hnd->hn", qkv[b, 0], keys) * HEAD_DIM ** -0.5
            a[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
        x = rnd(rnd(a.reshape(batch, c)) @ w_o.T + b_o + x)
        hidden = rnd(F.gelu(ln(x, ln2_w, ln2_b) @ w_fc.T + b_fc, approximate="tanh"))
        x = rnd(hidden @ w_p.T + b_p + x)
    return (ln(x, lnf_w.to(acc), lnf_b.to(acc)) @ wte.to(acc).T).to(dt)


def _autograd(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace, eps,
              trace=None):
    for name, t in (("wte", wte), ("wpe", wpe), ("lnf_w", lnf_w), ("lnf_b", lnf_b), ("k_cache", k_cache),
                    ("v_cache", v_cache), *((f"layers[{i}]", t) for i, t in enumerate(layers))):
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} must not require grad (gpt2_decode_step writes into the caches and records no "
                             "gradient), got requires_grad=True")
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fused_attn.gpt2_decode_step(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b,
                                                     k_cache, v_cache, workspace, eps, trace)


def _register() -> None:
    lib = "fused_attn::gpt2_decode_step"

    @torch.library.register_fake(lib)
    def _fake(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace, eps,
              trace=None):
        check_step_args(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace,
                        eps)
        return wte.new_empty(token.shape[0], wte.shape[0])

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace, eps,
                    trace=None):
        check_step_args(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, workspace,
                        eps)
        return _cpu(token, pos, seqlens, leftpad, wte, wpe, layers, lnf_w, lnf_b, k_cache, v_cache, eps)

    _ops.LIB.impl("gpt2_decode_step", _autograd, "Autograd")


_register()
