"""Quick GPU check of gpt2_decode_step (the one-launch GPT-2 decode step) against our module-per-launch
step (graph-fused's kernels), at GPT-2 small's shapes with seeded random weights (~1 min):

    python -m bench.check_gpt2_decode_step
    python -m bench.check_gpt2_decode_step --cases fp16:1,fp16:16 --steps 8 --replays 200

Per case (dtype, batch): a left-padded batch of a random 128-token prompt is prefilled by the model;
then `--steps` teacher-forced steps run both ways from the same cache state: the model's decode step
(fused_attn.linear / layer_norm / decode_attention, eager) and the op. Printed: the largest logit
difference between the two, the share of rows whose argmax agrees, and the largest difference of
the cache slots the steps wrote. Timing (a quick look, bench/bench_gpt2.py is the measurement): a CUDA
graph of [op, fused_attn.sample into the token, counters + 1] against the model's captured decode
step (graph-fused), each replayed `--replays` times from the same lengths; ms per step from CUDA
events around all replays. Exits 1 when an argmax disagrees in float32 or a difference is not finite.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fused_attn.generate import GRAPH_BACKENDS, make_batch
from fused_attn.gpt2 import GPT2, _DecodeGraph, load_hf_model
from fused_attn.gpt2_decode_step import gpt2_decode_step, new_workspace
from fused_attn.sample import sample
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def step(state, w, eps):
    return gpt2_decode_step(state["token"], state["pos"], state["seqlens"], state["leftpad"], state["k"], state["v"],
                            w, state["workspace"], eps=eps)


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def run_case(hf, dtype: torch.dtype, batch: int, steps: int, replays: int, prompt_len: int) -> dict:
    m = GPT2.from_hf(hf, dtype=dtype, device="cuda", backends=GRAPH_BACKENDS["graph-fused"])
    c = m.config
    gen = torch.Generator().manual_seed(0)
    ids, mask = make_batch(torch.randint(0, c.vocab_size, (prompt_len,), generator=gen), batch)
    ids, mask = ids.cuda(), mask.cuda()
    max_len = ids.shape[1] + steps + replays + 8
    cache = m.decode_cache(batch, max_len)
    with torch.no_grad():
        m.prefill(cache, ids, mask)
    # The same weights packed in the op's layout (a model of the persistent backend: its step_weights).
    w = GPT2.from_hf(hf, dtype=dtype, device="cuda", backends=GRAPH_BACKENDS["graph-persistent"]).step_weights
    counters = cache.counters.clone()
    state = dict(token=cache.token.clone(), seqlens=counters[:batch], pos=counters[batch:2 * batch],
                 leftpad=cache.leftpad.clone(), k=cache.k.clone(), v=cache.v.clone(),
                 workspace=new_workspace(batch, c.n_embd, 4 * c.n_embd, dtype, "cuda"))
    start_slot = int(counters[0])
    # The model's own steps, their logits recorded.
    seen, tokens = [], []
    real = m.logits
    m.logits = lambda x, normed=None: seen.append(real(x, normed)) or seen[-1]
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(cache.token.clone())
            m.decode_step(cache)
    del m.logits
    out = dict(dtype=str(dtype).removeprefix("torch."), batch=batch, layers=c.n_layer, vocab=c.vocab_size)
    diff, agree = 0.0, 1.0
    for t in range(steps):
        state["token"].copy_(tokens[t])
        logits = step(state, w, c.eps)
        counters.add_(1)
        ref = seen[t]
        diff = max(diff, (logits.float() - ref.float()).abs().max().item())
        agree = min(agree, (logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
    out["logit_diff"] = diff
    out["logit_scale"] = max(s.float().abs().max().item() for s in seen)
    out["argmax_agree"] = agree
    k_ref = cache.k[:, :, :, start_slot:start_slot + steps]
    v_ref = cache.v[:, :, :, start_slot:start_slot + steps]
    kd = (state["k"][:, :, :, start_slot:start_slot + steps].float() - k_ref.float()).abs()
    vd = (state["v"][:, :, :, start_slot:start_slot + steps].float() - v_ref.float()).abs()
    # Left-padded rows whose leftpad > their slot never exist; every row's new slots are real here.
    out["cache_diff"] = max(kd.max().item(), vd.max().item())

    # Timing: both graphs replayed from the lengths the steps above reached.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    saved = counters.clone()
    with torch.cuda.stream(side):
        for _ in range(2):
            logits = step(state, w, c.eps)
            sample(logits, out=state["token"])
            counters.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    counters.copy_(saved)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        logits = step(state, w, c.eps)
        sample(logits, out=state["token"])
        counters.add_(1)
    out["persistent_ms"] = time_replays(g, replays)
    counters.copy_(saved)
    cache.decode_graph = _DecodeGraph(m, cache)
    out["graph_fused_ms"] = time_replays(cache.decode_graph.graph, replays)
    out["speedup"] = out["graph_fused_ms"] / out["persistent_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="fp32:1,fp32:3,fp16:1,fp16:4,fp16:16,bf16:1,bf16:16",
                    help="comma list of dtype:batch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="n_layer of the random model (GPT-2 small's: 12)")
    ap.add_argument("--vocab", type=int, default=None, help="vocab_size of the random model (50257)")
    args = ap.parse_args(argv)
    if args.layers is None and args.vocab is None:
        hf = load_hf_model()
    else:  # the same shapes but for these: how the step's time splits between layers and the lm_head
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=args.layers or 12, vocab_size=args.vocab or 50257)
        hf = GPT2LMHeadModel(cfg).eval()
    print(torch.cuda.get_device_name(), torch.__version__)
    bad = False
    for case in args.cases.split(","):
        name, batch = case.split(":")
        try:
            r = run_case(hf, DTYPES[name], int(batch), args.steps, args.replays, args.prompt)
        except (ValueError, RuntimeError) as e:
            print(f"{case}: {type(e).__name__}: {e}")
            bad = True
            continue
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        finite = all(torch.isfinite(torch.tensor(r[k])) for k in ("logit_diff", "cache_diff"))
        bad |= not finite or (name == "fp32" and r["argmax_agree"] < 1.0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
