"""linear and mlp: every argument at a non-default value (bias, residual, activation gelu_tanh /
swiglu, norm / norm_weight / norm_bias / eps), forward and gradients checked against PyTorch's own
functionals (``F.linear``, ``F.gelu(approximate="tanh")``, ``F.layer_norm``, ``F.rms_norm``) and
transformers' ``LlamaMLP`` for SwiGLU's gate / up order: all independent of ``fused_attn.reference``,
which the CPU path runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from fused_attn import linear, mlp

ROWS, K, N = 3, 16, 12


def _t(seed, *shape, scale=1.0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(grad)


def _llama_mlp(seed=0):
    cfg = LlamaConfig(hidden_size=K, intermediate_size=N, num_attention_heads=2, num_key_value_heads=2,
                      hidden_act="silu", mlp_bias=True)
    torch.manual_seed(seed)
    m = LlamaMLP(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def _grads_close(got, want, leaves, seed=9):
    g = _t(seed, *got.shape)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b)


def test_swiglu_is_llama_mlps_gate_then_up():
    m = _llama_mlp()
    x = _t(1, ROWS, K, grad=True)
    w = torch.cat([m.gate_proj.weight, m.up_proj.weight])
    b = torch.cat([m.gate_proj.bias, m.up_proj.bias])
    hidden = linear(x, w, b, activation="swiglu")
    want_hidden = F.silu(m.gate_proj(x)) * m.up_proj(x)
    torch.testing.assert_close(hidden, want_hidden)
    _grads_close(hidden, want_hidden, [x, m.gate_proj.weight, m.up_proj.bias])
    got = mlp(x, w, b, m.down_proj.weight, m.down_proj.bias, activation="swiglu")
    torch.testing.assert_close(got, m(x))
    _grads_close(got, m(x), [x, m.gate_proj.weight, m.down_proj.weight])


def test_gelu_tanh_bias_residual_match_torch():
    x, w, b, r = _t(1, ROWS, K, grad=True), _t(2, N, K, grad=True), _t(3, N, grad=True), _t(4, ROWS, N, grad=True)
    got = linear(x, w, b, activation="gelu_tanh", residual=r)
    want = F.gelu(F.linear(x, w, b), approximate="tanh") + r
    torch.testing.assert_close(got, want)
    _grads_close(got, want, [x, w, b, r])
    plain = linear(x, w, b, residual=r)
    torch.testing.assert_close(plain, F.linear(x, w, b) + r)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norm_weight_bias_eps_match_torch(norm):
    eps = 0.3  # comparable to the rows' variance
    x, w, b = _t(1, ROWS, K, grad=True), _t(2, N, K, grad=True), _t(3, N, grad=True)
    nw = (1 + 0.5 * _t(5, K)).requires_grad_(True)
    nb = _t(6, K, grad=True) if norm == "layer_norm" else None
    got = linear(x, w, b, norm=norm, norm_weight=nw, norm_bias=nb, eps=eps)
    normed = F.layer_norm(x, (K,), nw, nb, eps=eps) if norm == "layer_norm" else F.rms_norm(x, (K,), nw, eps=eps)
    want = F.linear(normed, w, b)
    torch.testing.assert_close(got, want)
    _grads_close(got, want, [x, w, nw] + ([nb] if nb is not None else []))


def test_default_eps_is_1e_5():
    """Rows of magnitude 1e-3: eps 1e-5 and 1e-6 give outputs far apart."""
    x, w = _t(1, ROWS, K, scale=1e-3), _t(2, N, K)
    for norm, f in (("layer_norm", lambda x, eps: F.layer_norm(x, (K,), eps=eps)),
                    ("rms_norm", lambda x, eps: F.rms_norm(x, (K,), eps=eps))):
        torch.testing.assert_close(linear(x, w, norm=norm), F.linear(f(x, 1e-5), w))
        assert not torch.allclose(linear(x, w, norm=norm), F.linear(f(x, 1e-6), w), rtol=1e-2)


@pytest.mark.parametrize("norm", [None, "layer_norm"])
def test_mlp_gelu_tanh_with_norm_and_residual_matches_torch(norm):
    x, r = _t(1, ROWS, K, grad=True), _t(2, ROWS, K, grad=True)
    w_fc, b_fc, w_proj, b_proj = _t(3, N, K, grad=True), _t(4, N, grad=True), _t(5, K, N, grad=True), _t(6, K, grad=True)
    nw, nb = 1 + 0.5 * _t(7, K), _t(8, K)
    kw = dict(norm=norm, norm_weight=nw, norm_bias=nb, eps=0.2) if norm else {}
    got = mlp(x, w_fc, b_fc, w_proj, b_proj, residual=r, **kw)
    h = F.layer_norm(x, (K,), nw, nb, eps=0.2) if norm else x
    want = F.linear(F.gelu(F.linear(h, w_fc, b_fc), approximate="tanh"), w_proj, b_proj) + r
    torch.testing.assert_close(got, want)
    _grads_close(got, want, [x, r, w_fc, b_fc, w_proj, b_proj])
