"""scaled_masked_softmax and its backward at non-default values (scale, causal with seqlen_q != seqlen_k,
bool and broadcast additive masks, out=, version 0 / 1), forward and gradients (x and the additive
mask) checked against ``torch.softmax`` of the scores written out here and its autograd: independent of
``fused_attn.reference``, which the CPU path runs."""

from __future__ import annotations

import pytest
import torch

from fused_attn import scaled_masked_softmax, scaled_masked_softmax_backward

B, H, SQ, SK = 2, 3, 4, 6
SCALE = 0.7  # the default is 1.0


def _x(seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, SQ, SK, generator=gen, dtype=torch.float64) * 2).requires_grad_(grad)


def _torch(x, scale, causal, bool_mask=None, additive=None):
    """torch.softmax of x * scale + additive, -inf where the bool mask is False or key j lies past query
    i's causal edge j <= i + SK - SQ (bottom-right); every row keeps key 0."""
    s = x * scale
    if additive is not None:
        s = s + additive
    hidden = torch.zeros(SQ, SK, dtype=torch.bool)
    if causal:
        hidden = torch.tensor([[j > i + SK - SQ for j in range(SK)] for i in range(SQ)])
    if bool_mask is not None:
        hidden = hidden | ~bool_mask
    return torch.softmax(s.masked_fill(hidden, float("-inf")), -1)


def _bool_mask():
    keep = torch.rand(B, 1, 1, SK, generator=torch.Generator().manual_seed(4)) > 0.4
    keep[..., 0] = True
    return keep


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("version", [0, 1])
def test_scale_causal_mask_version_forward_and_grad_match_torch(causal, mask, version):
    x = _x(grad=True)
    bool_mask = _bool_mask() if mask == "bool" else None
    additive = None
    if mask == "additive":
        additive = torch.randn(1, H, 1, SK, generator=torch.Generator().manual_seed(5),
                               dtype=torch.float64).requires_grad_(True)
    got = scaled_masked_softmax(x, SCALE, causal=causal, attn_mask=bool_mask if mask == "bool" else additive,
                                version=version)
    want = _torch(x, SCALE, causal, bool_mask, additive)
    torch.testing.assert_close(got, want)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    leaves = [x] + ([additive] if additive is not None else [])
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_the_ops_own_autograd_with_scale_and_masks_matches_torch(causal):
    """The registered autograd formula (what CUDA tensors differentiate through; the public function's CPU
    path is differentiated by PyTorch itself), reached on the CPU through the op."""
    x = _x(grad=True)
    additive = torch.randn(1, H, 1, SK, generator=torch.Generator().manual_seed(5),
                           dtype=torch.float64).requires_grad_(True)
    got = torch.ops.fused_attn.scaled_masked_softmax(x, SCALE, additive, causal=causal)
    want = _torch(x, SCALE, causal, None, additive)
    torch.testing.assert_close(got, want)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, additive), g), torch.autograd.grad(want, (x, additive), g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_op_with_scale_and_causal_matches_torch_autograd(causal):
    x = _x(grad=True)
    y = _torch(x, SCALE, causal)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (want,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(scaled_masked_softmax_backward(g, y.detach(), SCALE, causal=causal), want)


def test_out_with_scale_mask_and_causal():
    x = _x().float()
    out = torch.full_like(x, float("nan"))
    res = scaled_masked_softmax(x, SCALE, causal=True, attn_mask=_bool_mask(), out=out)
    assert res is out
    torch.testing.assert_close(out, _torch(x, SCALE, True, _bool_mask()))


def test_a_0d_tensor_scale_is_read():
    x = _x()
    torch.testing.assert_close(scaled_masked_softmax(x, torch.tensor(SCALE)), _torch(x, SCALE, False))
