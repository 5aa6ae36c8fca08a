"""Host time per eager call through each dispatch path, for the host-overhead work (scratch, GPU only).

For each op at a small shape: the public wrapper, ``torch.ops.fused_attn.<op>.default`` (the dispatcher, with the
Python autograd kernel torch.library registers), the same below autograd (``_AutoDispatchBelowAutograd``), a
redispatch straight to the CUDA key, and the PyTorch equivalent. Host clock over N calls without a sync (the GPU
work of each call is shorter than its host time, so the launch queue never fills); median of interleaved rounds.

    python -m dev.probe_host_paths [--calls 2000] [--rounds 9]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fused_attn
from fused_attn import _ops


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def cases():
    d, h = "cuda", torch.float16
    g = torch.Generator(device=d).manual_seed(0)
    r = lambda *s, dtype=h: torch.randn(*s, device=d, dtype=dtype, generator=g)
    ops = torch.ops.fused_attn
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    out = {}

    x = r(1, 768); w = r(768); b = r(768)
    out["layer_norm 1x768"] = dict(
        public=lambda: fused_attn.layer_norm(x, w, b, 1e-5),
        op=lambda: ops.layer_norm.default(x, w, b, 1e-5),
        redispatch=lambda: ops.layer_norm.default.redispatch(ks, x, w, b, 1e-5),
        below=(ops.layer_norm.default, (x, w, b, 1e-5), {}),
        peer=lambda: F.layer_norm(x, (768,), w, b, 1e-5))

    W = r(768, 768); bb = r(768)
    out["linear 1x768->768"] = dict(
        public=lambda: fused_attn.linear(x, W, bb),
        op=lambda: ops.linear.default(x, W, bb, None),
        redispatch=lambda: ops.linear.default.redispatch(ks, x, W, bb, None),
        below=(ops.linear.default, (x, W, bb, None), {}),
        peer=lambda: F.linear(x, W, bb))

    s = r(12, 128, 128)
    out["softmax 12x128x128 causal"] = dict(
        public=lambda: fused_attn.scaled_masked_softmax(s, 1.0, causal=True),
        op=lambda: ops.scaled_masked_softmax.default(s, 1.0, None, causal=True),
        redispatch=lambda: ops.scaled_masked_softmax.default.redispatch(ks, s, 1.0, None, causal=True),
        below=(ops.scaled_masked_softmax.default, (s, 1.0, None), dict(causal=True)),
        peer=lambda: torch.softmax(s, -1))

    q = r(1, 12, 128, 64); k = r(1, 12, 128, 64); v = r(1, 12, 128, 64)
    out["attention B1 H12 S128 D64 causal"] = dict(
        public=lambda: fused_attn.attention(q, k, v, causal=True),
        op=lambda: ops.attention.default(q, k, v, None, 0.125, causal=True),
        redispatch=lambda: ops.attention.default.redispatch(ks, q, k, v, None, 0.125, causal=True),
        below=(ops.attention.default, (q, k, v, None, 0.125), dict(causal=True)),
        peer=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    logits = r(1, 50257)
    out["sample greedy 50257"] = dict(
        public=lambda: fused_attn.sample(logits),
        op=lambda: ops.sample.default(logits, 0.0, 0, 0, None),
        redispatch=lambda: ops.sample.default.redispatch(ks, logits, 0.0, 0, 0, None),
        below=(ops.sample.default, (logits, 0.0, 0, 0, None), {}),
        peer=lambda: torch.argmax(logits, -1))

    qd = r(1, 12, 1, 64); kc = r(1, 12, 1040, 64); vc = r(1, 12, 1040, 64); kn = r(1, 12, 1, 64); vn = r(1, 12, 1, 64)
    lens = torch.tensor([1024], device=d, dtype=torch.int32)
    mask = torch.ones(1, 1, 1, 1024, device=d, dtype=torch.bool)
    out["decode_attention B1 H12 L1024 append"] = dict(
        public=lambda: fused_attn.decode_attention(qd, kc, vc, lens, k_new=kn, v_new=vn),
        op=lambda: ops.decode_attention.default(qd, kc, vc, lens, kn, vn),
        redispatch=lambda: ops.decode_attention.default.redispatch(ks, qd, kc, vc, lens, kn, vn, None, None, None, 0),
        below=(ops.decode_attention.default, (qd, kc, vc, lens, kn, vn), {}),
        peer=lambda: F.scaled_dot_product_attention(qd, kc[:, :, :1024], vc[:, :, :1024], attn_mask=mask))

    wfc = r(3072, 768); bfc = r(3072); wpr = r(768, 3072); bpr = r(768)
    out["mlp 1x768"] = dict(
        public=lambda: fused_attn.mlp(x, wfc, bfc, wpr, bpr),
        op=lambda: ops.mlp.default(x, wfc, bfc, wpr, bpr, None),
        redispatch=lambda: ops.mlp.default.redispatch(ks, x, wfc, bfc, wpr, bpr, None),
        below=(ops.mlp.default, (x, wfc, bfc, wpr, bpr, None), {}),
        peer=lambda: F.linear(F.gelu(F.linear(x, wfc, bfc), approximate="tanh"), wpr, bpr))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    _ops.ensure_loaded()
    G = torch._C._AutoDispatchBelowAutograd
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, median of {a.rounds}")
    print(f"{'case':40} " + " ".join(f"{n:>10}" for n in ("public", "op", "below", "redispatch", "peer")))
    with torch.inference_mode(False), torch.no_grad():
        for name, c in cases().items():
            f, args, kw = c["below"]

            def below(f=f, args=args, kw=kw):
                with G():
                    return f(*args, **kw)

            fns = dict(public=c["public"], op=c["op"], below=below, redispatch=c["redispatch"], peer=c["peer"])
            try:
                for fn in fns.values():
                    fn()
                samples = {n: [] for n in fns}
                for _ in range(a.rounds):
                    for n, fn in fns.items():
                        samples[n].append(host_us(fn, a.calls))
                med = {n: statistics.median(v) for n, v in samples.items()}
                print(f"{name:40} " + " ".join(f"{med[n]:10.2f}" for n in fns)
                      + f"   public/peer {med['public'] / med['peer']:.2f}  below/peer {med['below'] / med['peer']:.2f}")
            except Exception as e:  # a probe: report and go on
                print(f"{name:40} failed: {type(e).__name__}: {e}")
    print("grad enabled (no input requires grad):")
    for name, c in cases().items():
        fns = dict(public=c["public"], op=c["op"], peer=c["peer"])
        med = {n: statistics.median(host_us(fn, a.calls) for _ in range(a.rounds)) for n, fn in fns.items()}
        print(f"{name:40} " + " ".join(f"{n} {med[n]:.2f}" for n in fns))


if __name__ == "__main__":
    main()
