"""layer_norm / rms_norm: every argument at a non-default value (eps, each function's own default
eps, weight, bias, residual, gathered rows), forward and gradients checked against PyTorch's own
``F.layer_norm`` / ``F.rms_norm`` (independent of ``fused_attn.reference``, which the CPU path runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_attn import layer_norm, rms_norm

ROWS, W = 3, 16


def _t(seed, *shape, scale=1.0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(grad)


def _affine(grad=False):
    """A weight far from 1 and a bias far from 0, different in every column."""
    return 1 + _t(11, W, grad=False).mul(0.5).requires_grad_(grad), _t(12, W).requires_grad_(grad)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("tiny", [False, True])
def test_default_eps_is_the_documented_one(rms, tiny):
    """Rows of magnitude 1e-3 (mean square 1e-6): eps 1e-5 and 1e-6 give outputs far apart, so a
    default other than layer_norm's 1e-5 / rms_norm's 1e-6 fails here."""
    x = _t(1, ROWS, W, scale=1e-3 if tiny else 1.0)
    weight, bias = _affine()
    if rms:
        got, want = rms_norm(x, weight), F.rms_norm(x, (W,), weight, eps=1e-6)
    else:
        got, want = layer_norm(x, weight, bias), F.layer_norm(x, (W,), weight, bias, eps=1e-5)
    torch.testing.assert_close(got, want)
    if tiny:
        other = F.rms_norm(x, (W,), weight, eps=1e-5) if rms else F.layer_norm(x, (W,), weight, bias, eps=1e-6)
        assert not torch.allclose(got, other, rtol=1e-2)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_eps_weight_bias_residual_forward_and_grad_match_torch(rms, with_residual):
    eps = 0.3  # comparable to the rows' variance: ignoring it moves every output
    x, res = _t(1, ROWS, W, grad=True), _t(2, ROWS, W, grad=True)
    weight, bias = _affine(grad=True)
    g = _t(3, ROWS, W)
    if rms:
        got = rms_norm(x, weight, eps, residual=res if with_residual else None)
    else:
        got = layer_norm(x, weight, bias, eps, residual=res if with_residual else None)
    if with_residual:
        got, h = got
        torch.testing.assert_close(h, x + res)
    h = x + res if with_residual else x
    want = F.rms_norm(h, (W,), weight, eps=eps) if rms else F.layer_norm(h, (W,), weight, bias, eps=eps)
    torch.testing.assert_close(got, want)
    leaves = [x, weight] + ([] if rms else [bias]) + ([res] if with_residual else [])
    got_grads = torch.autograd.grad(got, leaves, g)
    want_grads = torch.autograd.grad(want, leaves, g)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_gathered_rows_match_indexing_then_layer_norm():
    wte, wpe = _t(1, 10, W), _t(2, 6, W)
    token, pos = torch.tensor([7, 2, 2, 9]), torch.tensor([0, 5, 1, 3])
    weight, bias = _affine()
    y, h = layer_norm(wte, weight, bias, 0.1, residual=wpe, x_index=token, residual_index=pos)
    torch.testing.assert_close(h, wte[token] + wpe[pos])
    torch.testing.assert_close(y, F.layer_norm(wte[token] + wpe[pos], (W,), weight, bias, eps=0.1))
