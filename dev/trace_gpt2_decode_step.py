"""Where a gpt2_decode_step launch spends its time (GPU, sm_90): the kernel's own phase timeline (``trace=``).

    python -m dev.trace_gpt2_decode_step [--batch 1] [--prompt 128] [--dtype float16]

GPT-2 small's shapes with seeded random weights; one prefill, then the step launched a few times warm and once
traced. Printed per phase kind (medians over the layers): the work of its slowest block (after its wait to
its signal), the hop (the last block's signal to the first block of the next phase seeing it), and the
waits; then the lm_head, and the launch's total against the sum of the parts.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from fused_attn.generate import GRAPH_BACKENDS
from fused_attn.gpt2 import GPT2, DecodeCache, load_hf_model
from fused_attn.gpt2_decode_step import TRACE_PHASES, TRACE_STRIDE, gpt2_decode_step
from tests.prompts import left_padded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    model = GPT2.from_hf(load_hf_model(), dtype=dtype, device="cuda", backends=GRAPH_BACKENDS["graph-fused"])
    lengths = [a.prompt - i * (a.prompt // 2) // max(a.batch - 1, 1) for i in range(a.batch)]
    ids, mask = left_padded(model.config.vocab_size, lengths, "cuda")
    cache = DecodeCache(model.config, a.batch, a.prompt + 64, 0.0, 0, dtype, model.device)
    model.prefill(cache, ids, mask)
    c = model.config
    from fused_attn.gpt2_decode_step import workspace_bytes

    ws = torch.zeros(workspace_bytes(a.batch, c.n_embd, c.n_layer), dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(sms, TRACE_STRIDE, dtype=torch.int64, device="cuda")
    args = (cache.token, cache.pos, cache.seqlens, cache.leftpad, model.wte.weight, model.wpe.weight,
            model.step_layers(), model.ln_f.weight, model.ln_f.bias, cache.k, cache.v, ws, c.eps)
    for _ in range(5):
        gpt2_decode_step(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    gpt2_decode_step(*args, trace=trace)
    end.record()
    torch.cuda.synchronize()
    t = trace.cpu()
    t0 = int(t[:, 0][t[:, 0] > 0].min())

    def col(layer, phase, k):
        v = t[:, 1 + (layer * 5 + phase) * 6 + k]
        return v[v > 0] - t0

    def parts(layer, phase):
        """Median over the blocks of (staging, weights, dots, release + signal) in us, from the stamps."""
        v = t[:, 1 + (layer * 5 + phase) * 6:1 + (layer * 5 + phase) * 6 + 6].double()
        v = v[v[:, 3] > 0]
        if not len(v):
            return None
        d = torch.stack([v[:, 3] - v[:, 1], v[:, 4] - v[:, 3], v[:, 5] - v[:, 4], v[:, 2] - v[:, 5]], 1)
        return (d.median(0).values / 1e3).tolist()

    print(f"{torch.cuda.get_device_name()}, {a.dtype}, batch {a.batch}, prompt {a.prompt}: "
          f"event time {start.elapsed_time(end) * 1e3:.1f} us")
    print(f"{'phase':<12} {'blocks':>6} {'work max us':>12} {'work p50':>9} {'wait p50':>9} {'hop us':>8}")
    rows, total_work, total_hop = [], 0.0, 0.0
    for ph, name in enumerate(TRACE_PHASES):
        works, medians, waits, hops = [], [], [], []
        for layer in range(c.n_layer):
            b0, b1, b2 = col(layer, ph, 0), col(layer, ph, 1), col(layer, ph, 2)
            if len(b2) == 0:
                continue
            w = (b2 - b1).double()
            works.append(w.max().item() / 1e3)
            medians.append(w.median().item() / 1e3)
            waits.append((b1 - b0).double().median().item() / 1e3)
            nl, nph = (layer, ph + 1) if ph < 4 else (layer + 1, 0)
            nxt = col(nl, nph, 1)
            if len(nxt):
                hops.append((nxt.min() - b2.max()).item() / 1e3)
        rows.append((name, len(col(0, ph, 2)), statistics.median(works), statistics.median(medians),
                     statistics.median(waits), statistics.median(hops) if hops else float("nan")))
        total_work += sum(works)
        total_hop += sum(hops)
    for r in rows:
        print(f"{r[0]:<12} {r[1]:>6} {r[2]:>12.2f} {r[3]:>9.2f} {r[4]:>9.2f} {r[5]:>8.2f}")
    print("GEMV phases, median block (us): staging the input / waiting for the weights / dot products + epilogue / "
          "release + signal")
    for ph, name in enumerate(TRACE_PHASES):
        got = [x for x in (parts(layer, ph) for layer in range(c.n_layer)) if x is not None]
        if got:
            med = [statistics.median(g[i] for g in got) for i in range(4)]
            print(f"  {name:<12} " + " / ".join(f"{m:.2f}" for m in med))
    lm = parts(c.n_layer, 0)
    if lm:
        print("  lm_head (last chunk) " + " / ".join(f"{m:.2f}" for m in lm))
    lm_wait_end, lm_end = col(c.n_layer, 0, 1), col(c.n_layer, 0, 2)
    print(f"lm_head: from the last layer's end {lm_wait_end.min().item() / 1e3:.1f} us after the start to "
          f"{lm_end.max().item() / 1e3:.1f} us (slowest block {(lm_end - lm_wait_end).max().item() / 1e3:.1f} us)")
    print(f"sum over the layers: work of the slowest blocks {total_work:.1f} us, hops {total_hop:.1f} us; "
          f"first stamp to last {(t[t > 0].max() - t0).item() / 1e3:.1f} us")


if __name__ == "__main__":
    main()
