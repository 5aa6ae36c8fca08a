"""Tolerances, defined once, and the comparison helper every test uses."""

from __future__ import annotations

import math

import torch

# Output rounding of each dtype plus float32 accumulation.
DTYPES_TESTED = (torch.float32, torch.float16, torch.bfloat16)
ATOL = {torch.float32: 1e-7, torch.float16: 1e-6, torch.bfloat16: 1e-5}
RTOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
# Float32 score arithmetic: s_j - max carries an absolute error of a few ulps of the row's largest
# |s| (the rounding of x * scale and of the mask sum).
SCORE_ULPS = 8 * 2.0**-24


def softmax_tolerance(ref: torch.Tensor, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Allowed |ours - ref| per element for a softmax over the last dim.

    ``scores`` are the float64 pre-softmax scores (x * scale + mask) the reference used.
    An error e_k in every exponent s_k - max moves p_j by p_j * (e_j - sum_k p_k e_k), at most
    2 * (1 - p_j) * E * p_j for |e_k| <= E: so the score-magnitude term vanishes on the dominant
    entries of a near-one-hot row (no 1% error passes there, however large the scores)."""
    finite = torch.where(torch.isfinite(scores), scores.abs(), torch.zeros_like(scores))
    row_mag = finite.amax(dim=-1, keepdim=True) if scores.shape[-1] else finite
    rel = RTOL[dtype] + 2 * SCORE_ULPS * row_mag * (1 - _softmax64(scores))
    return ATOL[dtype] + rel * ref.abs()


def _softmax64(scores: torch.Tensor) -> torch.Tensor:
    """float64 softmax with 0 on rows without a finite score and on NaN rows."""
    p = torch.softmax(scores.to(torch.float64), dim=-1)
    return torch.nan_to_num(p, nan=0.0).clamp(0.0, 1.0)


# Float32 logits and attention outputs against float32 (or float64) computations of the same model:
# summation order and kernel choice only. Relative to the largest |value| of the row (logits of
# one position, one attention output vector), since cancellation leaves small entries with the
# absolute error of the large ones. Measured: <= 3.1e-6 of the row's max (tests/test_gpt2.py's
# decode vs teacher-forced logits on the CPU); 5e-5 leaves room for cuBLAS's shape-dependent
# algorithms and still fails the bugs this guards against by 100x or more (a 1% error in every
# attention probability moves GPT-2 small's logits by ~1% of the row's max).
FP32_RTOL, FP32_ATOL = 5e-5, 1e-6


def fp32_tolerance(expected: torch.Tensor) -> torch.Tensor:
    e = expected.detach().abs().to(torch.float64)
    return FP32_ATOL + FP32_RTOL * (e.amax(dim=-1, keepdim=True) if e.numel() else e)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, allowed: torch.Tensor, what: str = "") -> None:
    """Elementwise |actual - expected| <= allowed, identical NaN positions; on failure print
    the worst elements with their indices."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    tol = allowed.detach().to(a.device, torch.float64).expand_as(e)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        a, e, nan_a, nan_e = a.cpu(), e.cpu(), nan_a.cpu(), nan_e.cpu()
        idx = (nan_a != nan_e).nonzero()[:8].tolist()
        raise AssertionError(
            f"{what}: NaN mismatch at {int((nan_a != nan_e).sum())} elements, e.g. "
            + ", ".join(f"{tuple(i)}: got {a[tuple(i)].item()!r}, want {e[tuple(i)].item()!r}" for i in idx)
        )
    err = torch.where(nan_e, torch.zeros_like(e), (a - e).abs())
    excess = err - tol
    if excess.numel() and bool(excess.max() > 0):
        a, e, err, tol, excess = (t.cpu() for t in (a, e, err, tol, excess))
        order = excess.flatten().argsort(descending=True)[:8]
        lines = []
        for flat in order.tolist():
            idx = tuple(torch.unravel_index(torch.tensor(flat), e.shape))
            idx = tuple(int(i) for i in idx)
            lines.append(
                f"  {idx}: got {a[idx].item():.9g}, want {e[idx].item():.9g}, "
                f"|err| {err[idx].item():.3g} > allowed {tol[idx].item():.3g}"
            )
        bad = int((excess > 0).sum())
        raise AssertionError(f"{what}: {bad} of {e.numel()} elements out of tolerance; worst:\n" + "\n".join(lines))


def softmax_backward_tolerance(
    y_ref: torch.Tensor, dy: torch.Tensor, scale: float, scores: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Allowed |ours - ref| per element for dx = scale * y * (dy - <dy, y>) (the softmax backward).

    Ours starts from y as the forward computed it in ``dtype`` (error up to ``softmax_tolerance``),
    so the bound propagates that error through the formula: through y itself, and through the
    row's dot product <dy, y>; plus dx's own rounding to ``dtype``. ``y_ref`` is the float64 output,
    ``scores`` the float64 pre-softmax scores."""
    y = y_ref.double()
    g = dy.double()
    ty = softmax_tolerance(y, scores, dtype)
    dot = (g * y).sum(dim=-1, keepdim=True)
    dot_err = (ty * g.abs()).sum(dim=-1, keepdim=True) + RTOL[torch.float32] * (g * y).abs().sum(dim=-1, keepdim=True)
    dx = scale * y * (g - dot)
    return ATOL[dtype] + RTOL[dtype] * dx.abs() + abs(scale) * (ty * (g - dot).abs() + y.abs() * dot_err)


def assert_error_at_most_twice(ours: torch.Tensor, peer: torch.Tensor, want: torch.Tensor, slack: float,
                               what: str = "", norm: str = "rel_l2") -> None:
    """flash-attention's rule: our error against the float64 ``want`` is at most twice a PyTorch peer's
    error at the same dtype, plus ``slack``. ``norm``: "rel_l2" (||err|| / ||want||) or "max_abs"."""
    want = want.double()

    def error(t: torch.Tensor) -> float:
        d = t.double() - want
        return (d.norm() / want.norm()).item() if norm == "rel_l2" else d.abs().max().item()

    e_ours, e_peer = error(ours), error(peer)
    assert e_ours <= 2 * e_peer + slack, f"{what}: error {e_ours:.3g} > 2 x the peer's {e_peer:.3g} + {slack:g}"


# Attention outputs (decode_attention): flash-attention's rule, measured per query row relative to
# the row's magnitude r = sum_j p_j |v_j| (the float64 attention of |v|: the scale any rounding of
# p or v moves the output by; 0 exactly when no key is visible). Our normalized error must be at
# most twice the PyTorch peer's largest normalized error over the tensor, plus a few units of the
# dtype's rounding and the float32 score arithmetic (SCORE_ULPS of the row's largest |score|: an
# error e in every exponent moves the output by up to 2 e r; two float32 computations differing in
# where the scale is applied disagree by that much); and never above ATTN_CAP, so a peer that loses
# everything (float16 scores of 1e4) cannot make the check vacuous. A row with r = 0 must be exact.
ATTN_SLACK_EPS = 1  # eps is twice the unit roundoff: 2 x our one output rounding
ATTN_CAP = 0.05


def assert_attention_close(ours: torch.Tensor, peer: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor,
                           score_max: torch.Tensor, what: str = "") -> None:
    """``ours`` and ``peer`` (PyTorch at our dtype) against the float64 ``want``; ``magnitude``: the
    float64 attention of |v| (same shape); ``score_max``: the largest |score| a row sees (its shape
    without the last dim). Prints the worst rows on failure."""
    assert ours.shape == want.shape == peer.shape == magnitude.shape, \
        f"{what}: shapes {tuple(ours.shape)}, {tuple(peer.shape)}, {tuple(want.shape)}, {tuple(magnitude.shape)}"
    if ours.numel() == 0:
        return
    o, p, w = (t.detach().to(torch.float64).cpu() for t in (ours, peer, want))
    r = magnitude.detach().to(torch.float64).cpu().abs().amax(dim=-1)
    bad_nan = torch.isnan(o) & ~torch.isnan(w)
    if bad_nan.any():
        idx = bad_nan.nonzero()[:8].tolist()
        raise AssertionError(f"{what}: {int(bad_nan.sum())} NaN outputs where the reference is finite, e.g. at {idx}")
    err = (o - w).abs().amax(dim=-1)
    peer_err = torch.nan_to_num((p - w).abs(), nan=math.inf).amax(dim=-1)
    live = r > 0
    peer_norm = (peer_err[live] / r[live]).max().item() if live.any() else 0.0
    eps = torch.finfo(ours.dtype).eps
    slack = ATTN_SLACK_EPS * eps + 2 * SCORE_ULPS * score_max.detach().to(torch.float64).cpu()
    allowed_norm = torch.clamp(2 * peer_norm + slack, max=max(ATTN_CAP, ATTN_SLACK_EPS * eps))
    allowed = allowed_norm * r
    excess = err - allowed
    if bool(excess.max() > 0):
        order = excess.flatten().argsort(descending=True)[:8]
        lines = []
        for flat in order.tolist():
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
            if excess[idx] <= 0:
                break
            lines.append(f"  row {idx}: max |err| {err[idx].item():.3g} > allowed {allowed[idx].item():.3g} "
                         f"(row magnitude {r[idx].item():.3g}, max |score| {float(score_max[idx]):.3g}); "
                         f"got {o[idx][:4].tolist()}, want {w[idx][:4].tolist()}")
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {err.numel()} rows out of tolerance (peer's "
                             f"normalized error {peer_norm:.3g}); worst:\n"
                             + "\n".join(lines))


# LayerNorm / RMSNorm outputs (layer_norm, rms_norm): the dtype's output rounding (ATOL, RTOL) plus
# the float32 statistics. The mean and the variance carry errors of a few tens of float32 ulps of
# the row's spread (sums of up to 16384 terms: 32 per thread, then a tree), which move
# y = xhat * weight + bias by up to NORM_ULPS x max|xhat| of the row x |weight| (|xhat| <= sqrt(width)).
NORM_ULPS = 64 * 2.0**-24


def norm_tolerance(ref: torch.Tensor, xhat: torch.Tensor, weight: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """Allowed |ours - ref| per element of a LayerNorm / RMSNorm output; ``ref`` and ``xhat`` (the
    normalized row before weight and bias) are float64. float64 input (the CPU path computes in
    float64): float64 rounding only."""
    w = 1.0 if weight is None else weight.detach().double().abs().cpu()
    row = xhat.abs().amax(dim=-1, keepdim=True) if xhat.numel() else xhat
    ulps = NORM_ULPS * (2.0**-29 if dtype == torch.float64 else 1.0)
    return ATOL.get(dtype, 0.0) + RTOL.get(dtype, 0.0) * ref.abs() + ulps * row.cpu() * w
# Attention's log-sum-exp (float32, natural log) against the float64 reference: the float32 score
# arithmetic (SCORE_ULPS of score_max per exponent, as above; callers pass the row's largest sum of
# |terms| of a score, sum_i |q_i k_i| |scale|, which bounds that rounding where cancellation makes the
# score itself small) plus the float32 sum and log (a few 1e-7 relative); -inf (no visible key) must
# match exactly.
LSE_ATOL = 1e-5


def lse_tolerance(want: torch.Tensor, score_max: torch.Tensor) -> torch.Tensor:
    return LSE_ATOL + 4 * SCORE_ULPS * score_max.double().cpu() + 4 * 2.0**-24 * want.double().cpu().abs().nan_to_num(0)
# Matmuls (linear, mlp): flash-attention's rule through assert_error_at_most_twice, against the eager
# chain at the same dtype (cuBLAS on CUDA), in two norms: relative L2 over the tensor (bugs spread over
# many elements) and max |err| (a few wrong elements). Slack: a few units of the dtype's output rounding
# (relative to ||want|| / max |want|): the peer can be exact where we round once (K = 0, say); plus
# the float32 accumulation over K terms, LINEAR_ACC_ULPS x sqrt(K) units of 2^-24 (its statistical
# size): the peer's error at one output can be near zero by luck (measured on the H100: K 250, N 1,
# float32, ours 1.75e-6 relative against cuBLAS's 9e-8), which twice-the-peer alone does not allow.
LINEAR_SLACK_EPS = 2
LINEAR_ACC_ULPS = 4


def assert_linear_close(ours: torch.Tensor, peer: torch.Tensor, want: torch.Tensor, what: str = "", *,
                        k: int = 0) -> None:
    """``ours`` and ``peer`` (PyTorch at ``ours.dtype``) against the float64 ``want``; ``k``: the
    length of the dot products."""
    assert ours.shape == peer.shape == want.shape, f"{what}: shapes {ours.shape}, {peer.shape}, {want.shape}"
    if want.numel() == 0:
        return
    bad = torch.isnan(ours.detach()).cpu() & ~torch.isnan(want.detach()).cpu()
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN outputs where the reference is finite, e.g. at " \
                          f"{bad.nonzero()[:8].tolist()}"
    eps = torch.finfo(ours.dtype).eps
    w = want.detach().double().cpu()
    o, p = ours.detach().cpu(), peer.detach().cpu()
    if w.abs().max().item() == 0:
        assert bool((o == 0).all()), f"{what}: the reference is all zeros, got max |out| {o.double().abs().max().item()}"
        return
    rel = LINEAR_SLACK_EPS * eps + LINEAR_ACC_ULPS * math.sqrt(k) * 2.0**-24
    assert_error_at_most_twice(o, p, w, rel, what + " (relative L2)", norm="rel_l2")
    assert_error_at_most_twice(o, p, w, rel * w.abs().max().item(), what + " (max |err|)", norm="max_abs")
