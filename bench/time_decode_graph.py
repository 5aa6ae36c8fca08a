"""Time our GPT-2's captured decode step (one CUDA-graph replay per token), hot, for quick A/Bs of
kernel variants built side by side (FUSED_ATTN_NVCC_FLAGS) or switched by environment (FUSED_ATTN_PDL=0):

    python -m bench.time_decode_graph --backends graph-fused,graph --batches 1,4,16
    python -m bench.time_decode_graph --batches 8 --decode-splits 1     (decode_attention's split count forced)
    python -m bench.time_decode_graph --batches 16 --steps-per-graph 4  (four decode steps in each graph)
    FUSED_ATTN_NVCC_FLAGS=-DX python -m bench.time_decode_graph --tag X

Per (backend, batch): a random 128-token prompt (left-padded batch) is prefilled, the step captured, then
`--reps` rounds of `--replays` replays, each round from the same cache lengths (prompt .. prompt +
replays), timed with CUDA events around the round. Printed: the median and the spread of ms per step
over the rounds, one line per case, prefixed with `--tag`. Not a benchmark (bench/bench_gpt2.py is):
no cold L2, no JSON; two variants compare only within one device
call. The first replay's last tokens are checked against as many eager steps' from the same state: a
variant that races shows here as a difference.

Cases run in a settled process (`--settle`, default bench.harness.SETTLE_STREAMS; 0: a young one):
bench.harness.settle_process says why, and with it the cases' order no longer moves their times. Each
line prints the memory the process held when the case began (torch.cuda.memory_allocated /
memory_reserved) and the address its wte (the tied lm_head) landed at; `--hold-mb` moves where the
models land.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch

from bench.harness import SETTLE_STREAMS, settle_process
from fused_attn.generate import GRAPH_BACKENDS, make_batch
from fused_attn.gpt2 import GPT2, _capture, load_hf_model


def run_case(hf, backend: str, dtype: torch.dtype, batch: int, replays: int, reps: int, prompt_len: int,
             decode_splits: int | None = None, free_between: bool = False, steps: int = 1):
    if free_between:  # the earlier cases' models and graphs collected, their cached blocks returned to the driver
        gc.collect()
        torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20
    m = GPT2.from_hf(hf, dtype=dtype, device="cuda", backends=GRAPH_BACKENDS[backend])
    where = m.wte.weight.data_ptr() >> 20  # the largest weight's (the tied lm_head's) address, in MB
    for block in m.h:  # decode_attention's split count in the fused step (None: its heuristic)
        block.attn.decode_splits = decode_splits
    c = m.config
    gen = torch.Generator().manual_seed(0)
    ids, mask = make_batch(torch.randint(0, c.vocab_size, (prompt_len,), generator=gen), batch)
    replays = max(1, replays // steps)  # graph replays a round, each `steps` decode steps
    cache = m.decode_cache(batch, ids.shape[1] + (replays + 1) * steps + 8)
    with torch.no_grad():
        m.prefill(cache, ids.cuda(), mask.cuda())
    saved = [t.clone() for t in cache.buffers()]

    def restore():  # the cache back at the prefilled state
        for dst, src in zip(cache.buffers(), saved):
            dst.copy_(src)

    def run_steps():
        for _ in range(steps):
            m.decode_step(cache)

    # `steps` eager steps' last token, then the same steps replayed from the same state: equal (same kernels).
    # The token is read from the cache, so every backend's step is checked.
    with torch.no_grad():
        run_steps()
    token_eager = cache.token.clone()
    restore()
    g, _ = _capture(cache, run_steps)  # as fused_attn.gpt2._DecodeGraph captures its one step
    restore()
    g.replay()
    torch.cuda.synchronize()
    token_graph = cache.token.clone()
    agree = (token_graph == token_eager).float().mean().item()
    times = []
    for _ in range(reps):
        restore()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()  # warm
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (replays * steps))
    return statistics.median(times), min(times), max(times), agree, held, where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="graph-fused")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--replays", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tag", default="")
    ap.add_argument("--decode-splits", type=int, default=None,
                    help="decode_attention's num_splits in every layer (default: its heuristic)")
    ap.add_argument("--free-between", action="store_true",
                    help="gc.collect() and torch.cuda.empty_cache() before each case")
    ap.add_argument("--hold-mb", type=int, default=0,
                    help="allocate this many MB before the first case and keep them (moves where the models land)")
    ap.add_argument("--steps-per-graph", type=int, default=1,
                    help="decode steps captured in one graph (--replays counts steps; times are per step)")
    ap.add_argument("--settle", type=int, default=SETTLE_STREAMS,
                    help="fresh streams joined before the first case (0: a young process; see the module's text)")
    args = ap.parse_args(argv)
    if args.steps_per_graph < 1:
        ap.error(f"--steps-per-graph must be at least 1, got {args.steps_per_graph}")
    settle_process(args.settle)
    hold = torch.empty(args.hold_mb << 20, dtype=torch.uint8, device="cuda") if args.hold_mb else None  # noqa: F841
    hf = load_hf_model()
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} {args.dtype} prompt {args.prompt} "
          f"{args.replays} replays x {args.reps}; settled with {args.settle} streams", flush=True)
    bad = False
    for backend in args.backends.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            med, lo, hi, agree, held, where = run_case(hf, backend, dtype, b, args.replays, args.reps, args.prompt,
                                                args.decode_splits, args.free_between, args.steps_per_graph)
            per = f" ({args.steps_per_graph} steps a graph)" if args.steps_per_graph > 1 else ""
            print(f"{args.tag} {backend}{per} B{b}: {med * 1e3:.1f} us/step (min {lo * 1e3:.1f}, max {hi * 1e3:.1f}); "
                  f"first token agrees with eager {agree:.3f}; held at the start {held[0]:.0f} MB allocated, "
                  f"{held[1]:.0f} MB reserved; wte at {where:#x} MB", flush=True)
            bad |= agree < 0.99
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
