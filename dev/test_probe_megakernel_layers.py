"""dev.probe_megakernel_layers' host side: the trace summary and the float32 reference (the kernel itself runs on
an H200 only; these run anywhere)."""

from __future__ import annotations

import math

import torch

from dev import probe_megakernel_layers as probe


def test_summarize_takes_the_slowest_block_and_the_first_past_the_wait():
    n_layers, us = 2, 1000  # stamps in ns
    t = torch.zeros(probe.BLOCKS, n_layers, 3, 3, dtype=torch.int64)
    clock = 0
    for l in range(n_layers):
        for ph in range(3):
            start = clock + 2 * us  # every block past its wait 2 us after the phase before signalled
            t[:, l, ph, 0] = start
            t[:, l, ph, 1] = start + 1 * us
            t[:, l, ph, 2] = start + 3 * us
            t[7, l, ph, 0] = start + us // 2  # one block later past its wait, its parts as long as the others'
            t[7, l, ph, 1] = start + us // 2 + 1 * us
            t[7, l, ph, 2] = start + us // 2 + 3 * us
            clock = start + us // 2 + 3 * us  # the phase's last signal
    out = probe.summarize(t.flatten(), n_layers)
    for name in "ABC":
        work, first, rest, hop = out[name]
        assert (work, first, rest) == (3.0, 1.0, 2.0)
        assert hop == 2.0  # from the last signal to the first block past the wait, not the late one


def test_reference_is_one_block_of_gpt2_by_hand():
    layers = probe.make_layers(1, 3, seed=5, device="cpu")
    wqkv, bqkv, wo, bo, wfc, bfc, wpr, bpr, g1, b1, g2, b2, kc, vc = (t.double() for t in layers[0])
    x0 = torch.randn(probe.C, generator=torch.Generator().manual_seed(6))
    T, H, D = 2, probe.H, probe.D

    def ln(x, g, b):
        m = x.mean()
        return (x - m) / torch.sqrt(((x - m) ** 2).mean() + 1e-5) * g + b

    x = x0.double()
    h = ln(x, g1, b1).half().double()
    q, k, v = (wqkv @ h + bqkv).split(probe.C)
    k, v = k.half().double(), v.half().double()
    o = torch.empty(probe.C, dtype=torch.float64)
    for hh in range(H):
        keys = [kc[hh, j] for j in range(T)] + [k[hh * D:(hh + 1) * D]]
        vals = [vc[hh, j] for j in range(T)] + [v[hh * D:(hh + 1) * D]]
        s = torch.stack([q[hh * D:(hh + 1) * D] @ kk / math.sqrt(D) for kk in keys])
        p = torch.exp(s - s.max())
        o[hh * D:(hh + 1) * D] = sum(pi * vv for pi, vv in zip(p / p.sum(), vals))
    x = x + wo @ o + bo
    h2 = ln(x, g2, b2).half().double()
    u = wfc @ h2 + bfc
    x = x + wpr @ (0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))) + bpr
    got = probe.reference(layers, x0, T).double()
    assert torch.allclose(got, x, rtol=1e-4, atol=1e-4), float((got - x).abs().max())
