"""Where a Hugging Face GPT-2 prefill spends its time with attn_implementation="fused_attn" against "sdpa"
(scratch, GPU only): TTFT of each path in one process, and a torch.profiler table of one forward.

Paths: sdpa; fused_attn as shipped (flash kernel for prompts); fused_attn with the prompts forced onto the
matmul -> scaled_masked_softmax -> matmul path (flash_supports patched to False).

    python -m dev.probe_hf_prefill [--rounds 20]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fused_attn.hf
from fused_attn.gpt2 import load_hf_model
from tests.prompts import left_padded


def lengths(batch, prompt):
    return [prompt] if batch == 1 else [prompt - i * (prompt // 2) // (batch - 1) for i in range(batch)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    fused_attn.hf.register()
    base = load_hf_model()
    models = {}
    for impl in ("sdpa", "fused_attn"):
        m = copy.deepcopy(base).to("cuda", torch.float16).eval()
        m.set_attn_implementation(impl)
        models[impl] = m
    real = fused_attn.hf.flash_supports
    for batch, prompt in ((1, 128), (8, 960)):
        ids, mask = (t.cuda() for t in left_padded(base.config.vocab_size, lengths(batch, prompt), seed=0))

        def run(impl):
            with torch.no_grad():
                return models[impl](ids, attention_mask=mask, use_cache=True).logits[:, -1].argmax(-1).tolist()

        paths = {"sdpa": ("sdpa", real), "fused-flash": ("fused_attn", real),
                 "fused-matmul": ("fused_attn", lambda *args: False)}
        times = {p: [] for p in paths}
        for _ in range(3):
            for p, (impl, fs) in paths.items():
                fused_attn.hf.flash_supports = fs
                run(impl)
        for _ in range(a.rounds):
            for p, (impl, fs) in paths.items():
                fused_attn.hf.flash_supports = fs
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(impl)
                times[p].append((time.perf_counter() - t0) * 1e3)
        med = {p: statistics.median(v) for p, v in times.items()}
        print(f"B{batch} p{prompt}: " + ", ".join(f"{p} {v:.2f} ms" for p, v in med.items()))
        for p in ("sdpa", "fused-flash", "fused-matmul"):
            impl, fs = paths[p]
            fused_attn.hf.flash_supports = fs
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(impl)
            print(f"--- B{batch} p{prompt} {p}: top by self CUDA time")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
            print(f"--- B{batch} p{prompt} {p}: top by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
    fused_attn.hf.flash_supports = real


if __name__ == "__main__":
    main()
