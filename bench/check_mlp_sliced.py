"""Scratch check of mlp_sliced_kernel (session 32's A/B; run with FUSED_ATTN_EXP_MLP_SLICED=1): the op's
output against a float64 reference, beside the two-launch chain's error, over shapes, row counts, bias /
residual present or not, repeated launches (the accumulator must come back to zero) and a CUDA graph."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

assert os.environ.get("FUSED_ATTN_EXP_MLP_SLICED") == "1", "run with FUSED_ATTN_EXP_MLP_SLICED=1"
import fused_attn  # noqa: E402
from fused_attn import linear  # noqa: E402


def reference(x, w_fc, b_fc, w_proj, b_proj, residual, dtype):
    h = x.double() @ w_fc.double().T
    if b_fc is not None:
        h = h + b_fc.double()
    h = F.gelu(h, approximate="tanh").to(dtype).double()
    y = h @ w_proj.double().T
    if b_proj is not None:
        y = y + b_proj.double()
    if residual is not None:
        y = y + residual.double()
    return y


def main() -> int:
    fails = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for d, hidden, n in ((768, 3072, 768), (1024, 4096, 1024), (256, 512, 384), (64, 128, 128)):
            for m in (1, 3, 8, 13, 16):
                for biased, resid in ((True, True), (False, False), (True, False)):
                    def r(*s, scale=1.0):
                        return (torch.randn(*s, generator=gen, device="cuda") * scale).to(dtype)
                    x = r(m, d)
                    w_fc, w_proj = r(hidden, d, scale=d ** -0.5), r(n, hidden, scale=hidden ** -0.5)
                    b_fc = r(hidden) if biased else None
                    b_proj = r(n) if biased else None
                    residual = r(m, n) if resid else None
                    ref = reference(x, w_fc, b_fc, w_proj, b_proj, residual, dtype)
                    two = linear(linear(x, w_fc, b_fc, activation="gelu_tanh"), w_proj, b_proj, residual=residual)
                    err_two = (two.double() - ref).abs().max().item()
                    for rep in range(3):
                        y = fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, residual=residual)
                        err = (y.double() - ref).abs().max().item()
                        ok = torch.isfinite(y).all().item() and err <= 2 * err_two + 1e-3 * (1 + ref.abs().max().item())
                        if not ok:
                            fails += 1
                            print(f"FAIL {dtype} d{d} h{hidden} n{n} m{m} bias{biased} res{resid} rep{rep}: "
                                  f"err {err:.3e} two-launch {err_two:.3e}")
                    print(f"ok? {dtype} d{d} h{hidden} n{n} m{m} bias{biased} res{resid}: err {err:.3e} "
                          f"two-launch {err_two:.3e}")
    # A captured graph, replayed on new inputs.
    dtype, d, hidden, n, m = torch.float16, 768, 3072, 768, 16
    x = torch.randn(m, d, device="cuda").to(dtype)
    w_fc = (torch.randn(hidden, d, device="cuda") * d ** -0.5).to(dtype)
    w_proj = (torch.randn(n, hidden, device="cuda") * hidden ** -0.5).to(dtype)
    b_fc, b_proj = torch.randn(hidden, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)
    res = torch.randn(m, n, device="cuda").to(dtype)
    fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, residual=res)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fused_attn.mlp(x, w_fc, b_fc, w_proj, b_proj, residual=res)
    for i in range(5):
        x.copy_(torch.randn(m, d, device="cuda").to(dtype))
        res.copy_(torch.randn(m, n, device="cuda").to(dtype))
        g.replay()
        ref = reference(x, w_fc, b_fc, w_proj, b_proj, res, dtype)
        err = (y.double() - ref).abs().max().item()
        print(f"graph replay {i}: err {err:.3e}")
        if not err < 0.05:
            fails += 1
            print("FAIL graph replay")
    print("FAILS", fails)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
