"""Plain-PyTorch references: the definitions the CUDA kernels are tested against.

Readable over fast. Computation happens in ``compute_dtype`` (float64 in tests,
float32 for the CPU path of the public API) and the result is cast back to the
input dtype.
"""

from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[seqlen_q, seqlen_k]``, True where key j is visible to query i.

    Bottom-right aligned: j <= i + seqlen_k - seqlen_q, so the last query sees every
    key (a decode step with seqlen_q = 1 sees the whole cache), and with
    seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see nothing.
    """
    i = torch.arange(seqlen_q, device=device).unsqueeze(-1)
    j = torch.arange(seqlen_k, device=device)
    return j <= i + (seqlen_k - seqlen_q)


def scores(
    x: torch.Tensor,
    scale: float = 1.0,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The pre-softmax scores ``x * scale + mask`` in ``compute_dtype``: -inf where a bool mask is
    False or the causal mask hides a key, the additive mask added after the scale."""
    s = x.to(compute_dtype) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(compute_dtype)
    if causal:
        s = s.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], x.device), float("-inf"))
    return s


def scaled_masked_softmax(
    x: torch.Tensor,
    scale: float = 1.0,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """softmax(x * scale + mask) over the last dim; rows with every key masked give 0.

    ``attn_mask`` is bool (True = attend) or additive, broadcastable to ``x``.
    A NaN in a visible element makes its row NaN (as torch.softmax does).

    Written out as exp / sum so that autograd through it is the definition's gradient too:
    a row with no finite score is the constant 0 (gradient 0, where differentiating
    torch.softmax and then zeroing the row would give NaN), and the max is a detached
    shift (softmax does not depend on it).
    """
    s = scores(x, scale, causal=causal, attn_mask=attn_mask, compute_dtype=compute_dtype)
    if s.shape[-1] == 0:
        return s.to(x.dtype)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    return p.to(x.dtype)


def scaled_masked_softmax_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """dx = scale * y * (grad - sum_j grad_j * y_j) per row, over the visible keys (all of them,
    or the causal ones); 0 at invisible keys. With y = scaled_masked_softmax(x, scale, ...) this
    is the gradient of that softmax with respect to x; with scale = 1, with respect to an
    additive mask (before summing over its broadcast dims)."""
    g, yy = grad.to(compute_dtype), y.to(compute_dtype)
    if causal:
        visible = causal_mask(y.shape[-2], y.shape[-1], y.device)
        g, yy = g * visible, yy * visible
    dot = (g * yy).sum(dim=-1, keepdim=True)
    return (scale * yy * (g - dot)).to(y.dtype)


def eager_scaled_masked_softmax(x: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    """The unfused chain attention code runs today (the benchmarks' ``eager`` baseline):
    multiply by scale, masked_fill with -inf, softmax, each a separate kernel in x's dtype.
    ``masked`` is a bool mask built once by the caller, True where a key is hidden (e.g.
    ``~causal_mask(seqlen_q, seqlen_k)``), broadcastable to ``x``; or None (no masking)."""
    s = x * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return torch.softmax(s, dim=-1)


def decode_visible(cache_seqlens: torch.Tensor | None, seqlen_new: int, max_len: int, appended: bool,
                   cache_leftpad: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                   batch: int | None = None) -> torch.Tensor:
    """Bool ``[batch, 1, seqlen_new, max_len]``: True where query i of sequence b sees cache slot j.

    The sequence's keys end at ``end = cache_seqlens[b] + (seqlen_new if appended else 0)``
    (``cache_seqlens`` None: every slot is valid, end = max_len); query i (of the seqlen_new new
    queries) sees slots ``cache_leftpad[b] <= j < end - seqlen_new + 1 + i`` where
    ``key_mask[b, j]`` (bool ``[batch or 1, max_len]``, True = attend) also holds: causal among the new
    tokens, bottom-right aligned (the last query sees every key up to end)."""
    if cache_seqlens is None:
        seqlens = torch.full((batch, 1, 1, 1), max_len, dtype=torch.int64)
    else:
        seqlens = cache_seqlens.to(torch.int64).view(-1, 1, 1, 1)
    end = seqlens + (seqlen_new if appended else 0)
    i = torch.arange(seqlen_new, device=seqlens.device).view(1, 1, -1, 1)
    j = torch.arange(max_len, device=seqlens.device).view(1, 1, 1, -1)
    visible = j < end - seqlen_new + 1 + i
    if cache_leftpad is not None:
        visible = visible & (j >= cache_leftpad.to(torch.int64).view(-1, 1, 1, 1))
    if key_mask is not None:
        visible = visible & key_mask.to(visible.device).view(key_mask.shape[0], 1, 1, max_len)
    return visible


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    key_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of new queries over a KV cache, without touching the inputs.

    q ``[batch, nheads_q, seqlen_new, headdim]``; k_cache, v_cache ``[batch, nheads_kv, max_len,
    headdim]`` with nheads_q a multiple of nheads_kv (query head h reads kv head h // (nheads_q /
    nheads_kv)); cache_seqlens ``[batch]`` integers, the valid slots of each sequence (None: all
    max_len, without k_new); key_mask optional bool ``[batch or 1, max_len]``. With k_new
    and v_new ``[batch, nheads_kv, seqlen_new, headdim]``, they are first written at slots
    ``cache_seqlens[b] ...`` of a copy of the cache. Visibility: ``decode_visible``. A query with no
    visible key gives zeros.

    Returns ``(out, k_cache_after, v_cache_after)``: out in q's shape and dtype, and the caches
    after the append (copies in the caches' dtype; the inputs themselves are left as they are).
    Differentiable with respect to every float input."""
    batch, nheads_q, seqlen_new, headdim = q.shape
    nheads_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = headdim ** -0.5
    appended = k_new is not None
    k_all, v_all = k_cache, v_cache
    if appended:
        slots = cache_seqlens.to(torch.int64).view(-1, 1) + torch.arange(seqlen_new, device=q.device)
        index = slots.view(batch, 1, seqlen_new, 1).expand(batch, nheads_kv, seqlen_new, headdim)
        k_all = k_cache.scatter(2, index, k_new.to(k_cache.dtype))
        v_all = v_cache.scatter(2, index, v_new.to(v_cache.dtype))
    group = nheads_q // nheads_kv
    visible = decode_visible(cache_seqlens, seqlen_new, max_len, appended, cache_leftpad, key_mask, batch).to(q.device)
    # Slots no query sees are never read (the kernel skips them; they may hold garbage such as NaN
    # in a cache from torch.empty): zeroed here, since 0 * NaN in p @ v would leak into the output.
    seen = visible.any(dim=2).unsqueeze(-1)  # [batch, 1, max_len, 1]
    k = torch.where(seen, k_all, 0).to(compute_dtype).repeat_interleave(group, dim=1)
    v = torch.where(seen, v_all, 0).to(compute_dtype).repeat_interleave(group, dim=1)
    s = (q.to(compute_dtype) @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    if max_len == 0:  # amax of an empty row raises; no key gives zeros
        return q.new_zeros(q.shape), k_all, v_all
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / total.where(total > 0, torch.ones_like(total))  # no visible key: e = 0, total = 0
    return (p @ v).to(q.dtype), k_all, v_all


def add_rounded(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``x + residual`` as PyTorch stores it, in x's dtype (one rounding of the exact sum); x without a residual."""
    if residual is None:
        return x
    return (x.to(torch.float64) + residual.to(torch.float64)).to(x.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    rms: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMSNorm with ``rms``) over the last dim of ``h = x + residual`` (h rounded to x's
    dtype; h = x without a residual), computed in ``compute_dtype``:

        LayerNorm: y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias   (biased variance)
        RMSNorm:   y = h / sqrt(mean(h^2) + eps) * weight (+ bias if given)

    weight / bias ``[width]`` or None (1 / 0). Returns y in x's dtype, and ``(y, h)`` with a residual.
    Differentiable (the rounding of h passes gradients through unchanged)."""
    h = add_rounded(x, residual)
    y = _normalized(h.to(compute_dtype), eps, rms)
    if weight is not None:
        y = y * weight.to(compute_dtype)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def _centered(h: torch.Tensor) -> torch.Tensor:
    """h - mean(h) over the last dim, computed on h shifted by its first element (the kernel's
    numerics): a row of equal values is exactly 0 at any magnitude and in any compute dtype."""
    d = h - h[..., :1].detach()
    return d - d.mean(dim=-1, keepdim=True)


def _rstd(h: torch.Tensor, eps: float, rms: bool) -> torch.Tensor:
    t = h if rms else _centered(h)
    return torch.rsqrt(t.square().mean(dim=-1, keepdim=True) + eps)


def _normalized(h: torch.Tensor, eps: float, rms: bool) -> torch.Tensor:
    return (h if rms else _centered(h)) * _rstd(h, eps, rms)


def layer_norm_backward(
    grad_y: torch.Tensor | None,
    grad_h: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    rms: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dx, dresidual, dweight, dbias)`` of ``layer_norm`` given the output gradients
    (``grad_h``: of h, with a residual; None counts as 0), the closed form in ``compute_dtype``:
    with xhat = the normalized h, rstd = 1 / sqrt(var + eps) and g = grad_y * weight,

        LayerNorm: dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
        RMSNorm:   dh = rstd * (g - xhat * mean(g * xhat))

    dx = dresidual = dh + grad_h; dweight = sum over rows of grad_y * xhat, dbias = sum of grad_y.
    Each in its input's dtype (None for an absent input). Plain tensor operations, so it is
    differentiable again."""
    ct = compute_dtype
    h = add_rounded(x, residual).to(ct)
    xhat, rstd = _normalized(h, eps, rms), _rstd(h, eps, rms)
    gy = torch.zeros_like(h) if grad_y is None else grad_y.to(ct)
    g = gy if weight is None else gy * weight.to(ct)
    dh = g - xhat * (g * xhat).mean(dim=-1, keepdim=True)
    if not rms:
        dh = dh - g.mean(dim=-1, keepdim=True)
    dh = rstd * dh
    if grad_h is not None:
        dh = dh + grad_h.to(ct)
    lead = tuple(range(h.dim() - 1))
    dw = None if weight is None else (gy * xhat).sum(dim=lead).to(weight.dtype)
    db = None if bias is None else gy.sum(dim=lead).to(bias.dtype)
    dr = None if residual is None else dh.to(residual.dtype)
    return dh.to(x.dtype), dr, dw, db
def _expand_kv(t: torch.Tensor, nheads_q: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """k or v ``[batch, nheads_kv, seqlen_k, headdim]`` repeated to ``nheads_q`` heads: query head h
    reads kv head ``h // (nheads_q // nheads_kv)`` (MHA, GQA, MQA)."""
    return t.to(compute_dtype).repeat_interleave(nheads_q // t.shape[1], dim=1)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention's log-sum-exp is float32, float64 for float64 inputs (the CPU path)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of full attention: ``softmax(q·kᵀ·scale + mask)·v``.

    q ``[batch, nheads_q, seqlen_q, headdim]``; k, v ``[batch, nheads_kv, seqlen_k, headdim]`` with
    nheads_q a multiple of nheads_kv; ``attn_mask`` bool (True = attend) or additive, broadcastable to
    ``[batch, nheads_q, seqlen_q, seqlen_k]``; causal is bottom-right aligned (``causal_mask``), both
    exactly as ``scaled_masked_softmax`` defines them; scale defaults to ``headdim ** -0.5``.

    Returns ``(out, lse)``: out in q's shape and dtype (a row with no visible key is 0); lse
    ``[batch, nheads_q, seqlen_q]`` float32 (float64 for float64 q), the natural log-sum-exp of the
    row's scores (-inf for a row with no visible key). Differentiable with respect to q, k, v and an additive mask."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    k_all = _expand_kv(k, q.shape[1], compute_dtype)
    v_all = _expand_kv(v, q.shape[1], compute_dtype)
    s = scores(q.to(compute_dtype) @ k_all.transpose(-1, -2), scale, causal=causal, attn_mask=attn_mask,
               compute_dtype=compute_dtype)
    if s.shape[-1] == 0:  # no keys: every row is fully masked
        lse = torch.full(s.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), lse
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    live = total > 0
    p = e / torch.where(live, total, torch.ones_like(total))
    lse = torch.where(live, m + torch.log(torch.where(live, total, torch.ones_like(total))), float("-inf"))
    return (p @ v_all).to(q.dtype), lse.squeeze(-1).to(lse_dtype(q.dtype))


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's forward (Algorithm 1 of the paper) in plain PyTorch, tiled like the CUDA
    kernel (``csrc/attention/attention_kernel.cuh``): same arguments and result as ``attention``.

    For each tile Q_i of ``block_q`` query rows, loop over tiles K_j, V_j of ``block_k`` keys keeping a
    running max m, running sum l and an unnormalized output O, all per row:

        S = Q_i K_jᵀ · scale + mask_ij          (-inf where masked)
        m_new = max(m, rowmax(S));  P = exp(S - m_new)
        l = exp(m - m_new) · l + rowsum(P)
        O = diag(exp(m - m_new)) · O + P V_j     (the paper prints diag(...)⁻¹ here: a typo,
                                                  github.com/Dao-AILab/flash-attention/issues/991;
                                                  the rescale multiplies)
        m = m_new

    and at the end O / l and lse = m + log l. Rows that have seen nothing keep m = -inf: their
    shift is taken as 0 (P = exp(-inf) = 0 and nothing is rescaled), so a fully masked row ends
    with l = 0, which gives O = 0 and lse = -inf (the kernel's rule). Under causal the key tiles
    wholly past the tile's last visible key (bottom-right alignment) are never visited, as in
    the kernel."""
    batch, nheads_q, seqlen_q, headdim = q.shape
    seqlen_k = k.shape[2]
    if scale is None:
        scale = headdim ** -0.5
    qd = q.to(compute_dtype)
    k_all = _expand_kv(k, nheads_q, compute_dtype)
    v_all = _expand_kv(v, nheads_q, compute_dtype)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(batch, nheads_q, seqlen_q, seqlen_k)
    out = torch.zeros(batch, nheads_q, seqlen_q, v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, nheads_q, seqlen_q), float("-inf"), dtype=compute_dtype, device=q.device)
    neg_inf = torch.tensor(float("-inf"), dtype=compute_dtype, device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        m = torch.full((batch, nheads_q, i1 - i0, 1), float("-inf"), dtype=compute_dtype, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(batch, nheads_q, i1 - i0, v.shape[-1], dtype=compute_dtype, device=q.device)
        # the last key any row of this tile sees, + 1 (causal: row i sees j <= i + seqlen_k - seqlen_q)
        k_end = min(seqlen_k, i1 + seqlen_k - seqlen_q) if causal else seqlen_k
        for j0 in range(0, max(k_end, 0), block_k):
            j1 = min(j0 + block_k, seqlen_k)
            s = (qd[:, :, i0:i1] @ k_all[:, :, j0:j1].transpose(-1, -2)) * scale
            if mask is not None:
                mj = mask[:, :, i0:i1, j0:j1]
                s = s.masked_fill(~mj, float("-inf")) if mj.dtype == torch.bool else s + mj.to(compute_dtype)
            if causal:
                ii = torch.arange(i0, i1, device=q.device).unsqueeze(-1)
                jj = torch.arange(j0, j1, device=q.device)
                s = torch.where(jj <= ii + (seqlen_k - seqlen_q), s, neg_inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - shift)
            corr = torch.exp(m - shift)  # m = -inf (nothing seen yet): 0, and l, o are 0 anyway
            l = corr * l + p.sum(dim=-1, keepdim=True)
            o = corr * o + p @ v_all[:, :, j0:j1]
            m = m_new
        live = l > 0
        out[:, :, i0:i1] = o / torch.where(live, l, torch.ones_like(l))
        lse[:, :, i0:i1] = torch.where(live, m + torch.log(torch.where(live, l, torch.ones_like(l))),
                                       neg_inf).squeeze(-1)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))
def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """linear's activations on the pre-activation ``y`` (its dtype): None, ``"gelu_tanh"`` or ``"swiglu"``
    (``y``'s last dim holds gate then up: ``silu(gate) * up``, half as wide)."""
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if activation is not None:
        raise ValueError(f"activation must be None, 'gelu_tanh' or 'swiglu', got {activation!r}")
    return y


def eager_linear(x, weight, bias=None, activation: str | None = None, residual=None) -> torch.Tensor:
    """The eager PyTorch chain at x's dtype (F.linear, the activation, the add: cuBLAS on CUDA, each step
    rounded): the peer whose error bounds ours in the tests, and the benchmarks' eager provider."""
    y = activate(torch.nn.functional.linear(x, weight, bias), activation)
    return y if residual is None else y + residual


def _linear_compute(x, weight, bias, activation, residual, compute_dtype):
    y = x.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        y = y + bias.to(compute_dtype)
    y = activate(y, activation)
    if residual is not None:
        y = y + residual.to(compute_dtype)
    return y


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``act(x @ weight^T + bias) + residual`` in ``compute_dtype``, cast to x's dtype. x ``[..., K]``,
    weight ``[N, K]``; activation None, ``"gelu_tanh"`` (F.gelu(approximate="tanh")) or ``"swiglu"``
    (weight = gate rows over up rows: ``silu(gate) * up``, N / 2 columns)."""
    return _linear_compute(x, weight, bias, activation, residual, compute_dtype).to(x.dtype)


def mlp(
    x: torch.Tensor,
    w_fc: torch.Tensor,
    b_fc: torch.Tensor | None,
    w_proj: torch.Tensor,
    b_proj: torch.Tensor | None,
    *,
    activation: str = "gelu_tanh",
    residual: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``proj(act(fc(x))) + residual`` in ``compute_dtype`` throughout (no rounding of the hidden
    activations), cast to x's dtype."""
    h = _linear_compute(x, w_fc, b_fc, activation, None, compute_dtype)
    return _linear_compute(h, w_proj, b_proj, None, residual, compute_dtype).to(x.dtype)


# --------------------------------------------------------------------------- sampling

_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b, a a 32-bit constant, b int64 holding 32-bit values: the
    product split over b's 16-bit halves so no intermediate leaves int64's range."""
    p_lo = a * (b & 0xFFFF)  # < 2**48
    p_hi = a * (b >> 16)  # < 2**48; weighs 2**16
    low_sum = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2**49
    return (p_hi >> 16) + (low_sum >> 32), low_sum & _MASK32


def philox4x32_10(c: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) on int64
    tensors holding 32-bit words: counters ``c`` (4 tensors), key (2 ints); returns the 4 output words.
    The generator of csrc/sample/sample_kernel.cuh, word for word."""
    c0, c1, c2, c3 = (t & _MASK32 for t in c)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return [c0, c1, c2, c3]


def gumbel_noise(rows: int, vocab: int, seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """float32 [rows, vocab]: G = -log(-log U) with U = (top 23 bits + 0.5) / 2**23 of the Philox word
    ``col % 4`` of counter (col // 4, row, offset low, offset high), key (seed low, seed high);
    ``offsets`` int64 [rows] (each row's offset, wrapped to 64 bits)."""
    col = torch.arange(vocab, dtype=torch.int64).repeat(rows)
    row = torch.arange(rows, dtype=torch.int64).repeat_interleave(vocab)
    off = offsets.to(torch.int64).repeat_interleave(vocab)
    words = philox4x32_10([col >> 2, row, off & _MASK32, (off >> 32) & _MASK32], (seed, seed >> 32))
    pick = col & 3
    bits = torch.where(pick == 0, words[0], torch.where(pick == 1, words[1], torch.where(pick == 2, words[2], words[3])))
    return gumbel_of_bits(bits.view(rows, vocab))


def gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 G = -log(-log U) of 32-bit words (int64 tensor), U = (top 23 bits + 0.5) / 2**23: exact in
    float32 and inside (0, 1), so G is finite (within [-2.8, 16.7]) and a -inf logit's score stays -inf.
    (24 bits would round U = (2**24 - 1 + 0.5) / 2**24 up to 1 in float32: G = +inf, and -inf + inf = NaN,
    the argmax: a masked column drawn, one word in 2**24.)"""
    u = ((bits >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, temperature: float, seed: int = 0, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The next token per row of ``logits [..., vocab]`` (int64 ``[...]``): ``argmax(logits)`` at
    temperature 0; else ``argmax(float32(logits) / temperature + G)`` with ``gumbel_noise`` (the
    Gumbel-max trick: a sample of softmax(logits / temperature)). ``offsets``: int64, one per row (0 if
    None). NaN counts as the maximum and the first of equal maxima wins, as in torch.argmax."""
    shape = logits.shape[:-1]
    x = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    if temperature > 0:
        rows, vocab = x.shape
        off = torch.zeros(rows, dtype=torch.int64) if offsets is None else offsets.cpu().to(torch.int64)
        x = x / temperature + gumbel_noise(rows, vocab, seed, off)
    return x.argmax(-1).reshape(shape).to(logits.device)
