"""Where the persistent GPT-2 step's stages spend their time: ``gpt2_decode_step`` built with its stage trace.

    python -m bench.trace_gpt2_step --batches 1,16 [--prompt 128] [--steps 5]

The op (csrc/gpt2_decode_step) is one cooperative launch whose blocks meet at grid barriers between
stages. Built with ``-DFUSED_ATTN_STEP_TRACE=<marks>`` (this tool appends it to ``$FUSED_ATTN_NVCC_FLAGS``
before the library loads, so it builds beside the default one in the cache), thread 0 of every block
stamps %globaltimer at fixed points of the step into the workspace, past the activations. Printed per
batch: the step from the median block's start to its end, then each interval between consecutive marks
(layers 1 .. L-1, the median over layers) as the median block's and the slowest block's microseconds,
then layer 0's and the lm_head's intervals one by one, and how far apart the blocks arrive at the
barriers. %globaltimer ticks in 32 ns .. 1 us steps depending on the GPU (H100: ~256 ns), so single
intervals are coarse; the medians over layers and blocks are what to read. A scratch tool, not a
benchmark: no JSON, not timed with the CUDA graph (eager calls of the step, one at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

MARKS = 400  # the build's -DFUSED_ATTN_STEP_TRACE: marks per block (a step of GPT-2 small has 331)
FLAG = f"-DFUSED_ATTN_STEP_TRACE={MARKS}"
# The kernel's marks (gpt2_decode_step_kernel.cuh, Consumer::run and gemv), in order: one at the start,
# these per layer, then the lm_head's.
LAYER = ("arrive.qkv", "waited", "normed", "qkv.slot", "qkv.dots", "qkv.done", "arrive.attn", "waited",
         "attn.done", "arrive.out", "waited", "staged", "out.slot", "out.dots", "out.done", "arrive.fc", "waited",
         "normed", "fc.slot", "fc.dots", "fc.done", "arrive.proj", "waited", "staged", "proj.slot", "proj.dots",
         "proj.done")
HEAD = ("arrive.head", "waited", "normed", "head.slot", "head.dots", "head.done")


def mark_names(n_layer: int) -> list[str]:
    """Every mark of a step of ``n_layer`` layers, in the kernel's order."""
    return ["start"] + [f"L{l}.{n}" for l in range(n_layer) for n in LAYER] + [f"H.{n}" for n in HEAD]


def summarize(ns: torch.Tensor, names: list[str]) -> dict:
    """``ns [steps, blocks, marks]`` (nanoseconds) -> the step's length (median block, median over steps),
    per repeated interval (layers 1 .. L-1) the median over layers of (median block, slowest block) in
    us, the first layer's and the head's intervals one by one, and the blocks' arrival spread at each
    barrier (max - min, median over steps, us)."""
    if ns.shape[-1] != len(names):
        raise ValueError(f"ns must have {len(names)} marks in its last dim, got {ns.shape[-1]}")
    ns = ns.double()
    d = ns[..., 1:] - ns[..., :-1]  # [steps, blocks, intervals]
    med = d.median(1).values.median(0).values / 1e3  # the median block, then the median step
    slow = d.max(1).values.median(0).values / 1e3
    step = (ns[:, :, -1] - ns[:, :, 0]).median(1).values.median().item() / 1e3
    repeated: dict[str, list[tuple[float, float]]] = {}
    single: list[tuple[str, float, float]] = []
    for i in range(1, len(names)):
        prev, cur = names[i - 1], names[i]
        if cur.startswith("L") and not cur.startswith("L0."):  # keyed by the position in the layer
            key = f"{(i - 1) % len(LAYER):2d} {prev.split('.', 1)[1]} -> {cur.split('.', 1)[1]}"
            repeated.setdefault(key, []).append((med[i - 1].item(), slow[i - 1].item()))
        else:
            single.append((f"{prev} -> {cur}", med[i - 1].item(), slow[i - 1].item()))
    per_layer = {k: (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
                 for k, vals in repeated.items()}
    spread = {n: ((ns[:, :, i].max(1).values - ns[:, :, i].min(1).values).median().item() / 1e3)
              for i, n in enumerate(names) if ".arrive." in n}
    return {"step_us": step, "per_layer": per_layer, "single": single, "spread": spread}


def trace(model, batch: int, prompt: int, steps: int) -> torch.Tensor:
    """``[steps, blocks, marks]`` globaltimer stamps of ``steps`` eager steps after a prefill and 5 warm ones."""
    from fused_attn.generate import make_batch
    from fused_attn.gpt2_decode_step import workspace_bytes

    c = model.config
    gen = torch.Generator().manual_seed(0)
    ids, mask = make_batch(torch.randint(0, c.vocab_size, (prompt,), generator=gen), batch)
    cache = model.decode_cache(batch, ids.shape[1] + steps + 8)
    need = workspace_bytes(batch, c.n_embd, 4 * c.n_embd, model.dtype)
    sms = torch.cuda.get_device_properties(model.device).multi_processor_count
    n = len(mark_names(c.n_layer))
    cache.workspace = torch.zeros(need + sms * MARKS * 16, dtype=torch.uint8, device=model.device)
    out = []
    with torch.no_grad():
        model.prefill(cache, ids.to(model.device), mask.to(model.device))
        for i in range(5 + steps):
            model.decode_step(cache)
            if i >= 5:
                out.append(cache.workspace[need:].view(torch.int64).view(sms, MARKS, 2)[:, :n, 0].cpu())
    stamps = torch.stack(out)
    if not bool((stamps != 0).all()):
        raise RuntimeError(f"the step wrote no trace: the library must be built with {FLAG} "
                           f"(FUSED_ATTN_NVCC_FLAGS={os.environ.get('FUSED_ATTN_NVCC_FLAGS', '')!r})")
    return stamps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    args = ap.parse_args(argv)
    flags = os.environ.get("FUSED_ATTN_NVCC_FLAGS", "")
    if FLAG not in flags.split():  # before the library loads: built beside the default one
        os.environ["FUSED_ATTN_NVCC_FLAGS"] = f"{flags} {FLAG}".strip()
    from fused_attn.generate import GRAPH_BACKENDS
    from fused_attn.gpt2 import GPT2, load_hf_model

    if not torch.cuda.is_available():
        print("trace_gpt2_step needs a CUDA GPU", file=sys.stderr)
        return 2
    model = GPT2.from_hf(load_hf_model(), dtype=getattr(torch, args.dtype), device="cuda",
                         backends=GRAPH_BACKENDS["graph-persistent"])
    names = mark_names(model.config.n_layer)
    for b in (int(x) for x in args.batches.split(",")):
        s = summarize(trace(model, b, args.prompt, args.steps), names)
        print(f"# {torch.cuda.get_device_name()} {args.dtype} B{b} prompt {args.prompt}: step {s['step_us']:.1f} us "
              f"(median block); us per interval, median block / slowest block")
        total = 0.0
        for k, (a, slow) in s["per_layer"].items():
            total += a
            print(f"  {k:28s} {a:7.2f} {slow:7.2f}")
        print(f"  a layer (layers 1..{model.config.n_layer - 1}, sum of the medians) {total:.2f}")
        for k, a, slow in s["single"]:
            print(f"  {k:40s} {a:7.2f} {slow:7.2f}")
        print(f"  blocks' arrival spread at a barrier, median over barriers: "
              f"{statistics.median(s['spread'].values()):.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
