"""What is alive at the peak of a Hugging Face GPT-2 prefill, per attention implementation (scratch, GPU only).

bench_hf_prefill reports the peak allocated memory above the model's own; this probe says which tensors make
it. For each implementation it records the allocator's history over one prefill forward (torch.cuda.memory's
``_record_memory_history``), replays the trace to the moment of the peak, and prints the blocks alive there
grouped by the first frame in transformers, fused_attn or torch.nn (sizes in MB), then the difference of the
groups between each implementation and sdpa.

    python -m dev.probe_hf_peak_memory [--batch 8] [--prompt 960]

Then, per implementation, the allocator's blocks at the peak itself (a snapshot taken in a forward hook on the
lm_head, whose output is the last allocation of the forward): the blocks whose size exceeds what their tensor
requested (a cached block reused whole, or a segment's remainder left unsplit), grouped as above: where
max_memory_allocated and the live tensors part.
"""
from __future__ import annotations

import argparse
import copy
from collections import Counter

import torch

import fused_attn.hf
from fused_attn.gpt2 import load_hf_model
from tests.prompts import left_padded

OURS = ("transformers/", "fused_attn/", "torch/nn/")


def where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in OURS):
            return f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(no python frame)"


def live_at_peak(snapshot: dict, base: int) -> tuple[int, Counter]:
    """Replay the trace of device 0: the largest allocated total and the blocks alive then."""
    trace = snapshot["device_traces"][0]
    alive, total, peak, at_peak = {}, 0, -1, {}
    for ev in trace:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
            total += ev["size"]
        elif ev["action"] in ("free_requested",) and ev["addr"] in alive:
            total -= alive.pop(ev["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(alive)
    groups = Counter()
    for ev in at_peak.values():
        groups[where(ev.get("frames", []))] += ev["size"]
    return peak, groups


def rounding_at(snapshot: dict) -> Counter:
    """Block size minus requested size of every allocated block of the snapshot, grouped by allocation site."""
    over = Counter()
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated" and blk["size"] > blk.get("requested_size", blk["size"]):
                over[where(blk.get("frames", []))] += blk["size"] - blk["requested_size"]
    return over


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=960)
    a = ap.parse_args()
    fused_attn.hf.register()
    base_model = load_hf_model()
    lengths = ([a.prompt] if a.batch == 1 else
               [a.prompt - i * (a.prompt // 2) // (a.batch - 1) for i in range(a.batch)])
    ids, mask = (t.cuda() for t in left_padded(base_model.config.vocab_size, lengths, seed=0))
    results = {}
    for impl in ("sdpa", "fused_attn", "eager"):
        m = copy.deepcopy(base_model).to("cuda", torch.float16).eval()
        m.set_attn_implementation(impl)

        def run():
            with torch.no_grad():
                return m(ids, attention_mask=mask, use_cache=True).logits[:, -1].argmax(-1).tolist()

        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
        run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        traced, groups = live_at_peak(snap, base)
        results[impl] = groups
        print(f"== {impl}: peak above the model {peak_mb:.3f} MB (max_memory_allocated); traced peak "
              f"{traced / 2**20:.3f} MB")
        for k, v in groups.most_common(12):
            print(f"  {v / 2**20:10.3f} MB  {k}")
        at_peak = []
        hook = m.lm_head.register_forward_hook(lambda *_: at_peak.append(torch.cuda.memory._snapshot()))
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
        run()
        torch.cuda.memory._record_memory_history(enabled=None)
        hook.remove()
        over = rounding_at(at_peak[0])
        print(f"   blocks larger than their tensors at the lm_head's output, from an empty cache: "
              f"{sum(over.values()) / 2**20:.3f} MB")
        for k, v in over.most_common(8):
            print(f"  {v / 2**20:10.3f} MB  {k}")
        del m
        torch.cuda.empty_cache()
    for impl in ("fused_attn", "eager"):
        keys = set(results[impl]) | set(results["sdpa"])
        diff = {k: results[impl][k] - results["sdpa"][k] for k in keys}
        print(f"== {impl} minus sdpa, groups that differ (MB):")
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
            if v:
                print(f"  {v / 2**20:+10.3f}  {k}")


if __name__ == "__main__":
    main()
