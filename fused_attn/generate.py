"""Generate with GPT-2 through one or several backends and time it.

    python -m fused_attn.generate --max-new-tokens 128
    python -m fused_attn.generate --compare --batch-size 3 --dtype float32

Backends (``BACKENDS``, one line each in ``--help``): graph-fused (the one to use on a GPU: fused_attn.gpt2
with every module on fused_attn's ops and a CUDA-graph decode step), graph (the same model, only the
decode attention ours), compile-graph (the peer: the same model's plain PyTorch decode step through
torch.compile, in one CUDA graph, gpt-fast's recipe), and transformers' GPT2LMHeadModel as hf-eager,
hf-sdpa, hf-fused (our attention) and hf-static (sdpa with a StaticCache, its decode step compiled).
``--backend auto`` (the default) runs graph-fused on a GPU and hf-eager without one, where our model runs
the reference PyTorch ops (3.2 tokens/s against hf-eager's 18.2, GPT-2 small, float32, batch 1). Without a
GPU the graph backends run the same model without the graph, reported as graph-eager..., and --compare
leaves out the GPU-only ones (compile-graph, hf-static), saying so. Prints the continuation, TTFT (prompt
in, first token out), TBT p50/p95 (each further token) and tokens/s; with --compare, whether the greedy
tokens of all backends are identical.

One clock for every backend: on a GPU, CUDA events on the current stream at the call's start,
at each token (transformers: when its logits are ready, from a logits processor; graph: after
each token is out) and after the call returns, with no host sync per token; TTFT, TBT and
tokens/s all come from these events, and ``Result.wall_s`` is the host clock around the whole
call (synchronized before and after) to check them against. On the CPU, the host clock.

Models: ``gpt2-random`` (default: GPT-2 small's configuration, seeded random weights, no
download) or any name/path transformers can load. Prompts: ``--prompt`` text when the
checkpoint has a tokenizer, ``--prompt-ids`` token ids, else ``--prompt-len`` seeded ids.
A batch > 1 repeats the prompt with left padding of 0, 1, 2, ... tokens so padding is exercised.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from dataclasses import dataclass

import torch

# Every backend, with what it is (the CLI's --help); --compare runs them in this order, checking the tokens
# against the first.
BACKENDS = {
    "hf-eager": "transformers' GPT2LMHeadModel, eager attention (the default without a GPU: the fastest there)",
    "hf-sdpa": "transformers' GPT2LMHeadModel, PyTorch SDPA attention",
    "hf-static": "transformers, SDPA with a StaticCache, its decode step compiled (GPU only)",
    "hf-fused": "transformers with fused_attn's attention (fused_attn.hf)",
    "compile-graph": "the peer: fused_attn.gpt2's PyTorch decode step (SDPA, addmm) through torch.compile, in a "
                     "CUDA graph (GPU only)",
    "graph": "fused_attn.gpt2 in a CUDA graph, decode attention on fused_attn.decode_attention, the rest PyTorch",
    "graph-fused": "fused_attn.gpt2 in a CUDA graph with every module on fused_attn's ops (the default on a GPU: "
                   "the fastest; use this one)",
}
# The transformers backends: attention implementation of each, and those with a StaticCache.
HF_IMPL = {"hf-eager": "eager", "hf-sdpa": "sdpa", "hf-static": "sdpa", "hf-fused": "fused_attn"}
STATIC = ("hf-static",)
# Our GPT-2's backends: the fused_attn.gpt2 module backends each one uses; COMPILED: those whose
# decode step goes through torch.compile before its CUDA graph is captured (GPU only, as STATIC).
# graph-fused: the embedding in one launch (embed "fused": H100 fp16, hot step, B16 452 -> 432 us, B1
# even) and every norm folded into the linear after it (layer_norm "folded": B1 246 -> 228-232 us, B2
# 291-304 against 292-293 and B16 even; docs/lab-notes/linear-mlp.md).
GRAPH_BACKENDS = {"graph-fused": {"attention": "fused", "layer_norm": "folded", "linear": "fused", "mlp": "fused",
                                  "embed": "fused"},
                  "graph": {"attention": "fused"},
                  "compile-graph": {"attention": "sdpa"}}
COMPILED = ("compile-graph",)
GPU_ONLY = STATIC + COMPILED
# --backend auto: graph-fused on a GPU; without one our model runs the reference PyTorch ops (GPT-2 small,
# float32, batch 1: 3.2 tokens/s against hf-eager's 18.2), so hf-eager.
AUTO = {"cuda": "graph-fused", "cpu": "hf-eager"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    backend: str
    tokens: torch.Tensor  # [batch, prompt + new]
    ttft_s: float
    step_s: list[float]  # the last one runs to the end of the call
    wall_s: float | None = None  # host clock around the whole call

    @property
    def total_s(self) -> float:
        return self.ttft_s + sum(self.step_s)

    @property
    def new_tokens(self) -> int:
        return 1 + len(self.step_s)

    def tokens_per_s(self, batch: int) -> float:
        return batch * self.new_tokens / self.total_s


def make_batch(prompt: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` copies of a 1-D prompt, copy i left-padded by i tokens (pad id 0)."""
    n = prompt.numel() + batch - 1
    ids = torch.zeros(batch, n, dtype=torch.long)
    mask = torch.zeros(batch, n, dtype=torch.long)
    for i in range(batch):
        length = prompt.numel() - i if batch > 1 else prompt.numel()
        ids[i, n - length:] = prompt[i:] if batch > 1 else prompt
        mask[i, n - length:] = 1
    return ids, mask


class _StepTimes:
    """Marks every token: a CUDA event on the stream (no sync), or the host clock on the CPU. A
    transformers logits processor (called when a token's logits are ready) and, as ``mark``, the
    ``on_token`` callback of fused_attn.gpt2's generate (called when the token is enqueued)."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, []

    def mark(self) -> None:
        self.stamps.append(_mark(self.device))

    def __call__(self, input_ids, scores):
        self.mark()
        return scores


def _mark(device: torch.device):
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timed(device: torch.device, call) -> tuple[object, float, object, object]:
    """(call's result, host wall seconds around it, start mark, end mark), synchronized before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = _mark(device)
    out = call()
    end = _mark(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, start, end


def _result(backend: str, tokens: torch.Tensor, marks: list, wall_s: float) -> Result:
    """TTFT and per-token gaps from [start, token 0, token 1, ..., end] marks (events or host clock);
    the end mark closes the last token's gap."""
    if isinstance(marks[0], float):
        gaps = [b - a for a, b in zip(marks, marks[1:])]
    else:
        gaps = [a.elapsed_time(b) * 1e-3 for a, b in zip(marks, marks[1:])]
    steps = gaps[1:-1]
    if steps:
        steps[-1] += gaps[-1]
    return Result(backend, tokens.cpu(), gaps[0] + (0.0 if steps else gaps[-1]), steps, wall_s)


def run_backend(backend: str, hf_model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                dtype: torch.dtype, device: torch.device, temperature: float = 0.0, top_k: int = 0,
                seed: int = 0, cache: dict | None = None) -> Result:
    """Generate ``max_new_tokens`` with one backend. ``cache`` keeps converted models between calls."""
    cache = {} if cache is None else cache
    ids, mask = ids.to(device), mask.to(device)
    if backend in GRAPH_BACKENDS:
        from fused_attn.gpt2 import GPT2

        model = cache.get((backend, dtype))
        if model is None:
            model = cache[(backend, dtype)] = GPT2.from_hf(hf_model, dtype=dtype, device=device,
                                                          backends=GRAPH_BACKENDS[backend])
            if backend in COMPILED:
                model.compile_decode_step(dynamic=False)
        stamps = _StepTimes(device)
        out, wall, start, end = _timed(device, lambda: model.generate(
            ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
            use_graph=device.type == "cuda", on_token=stamps.mark))
        # Without a GPU the decode loop runs eagerly: say so in every printout and table.
        label = backend if device.type == "cuda" else backend.replace("graph", "graph-eager", 1)
        return _result(label, out, [start, *stamps.stamps, end], wall)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    impl = HF_IMPL[backend]
    model = cache.get((impl, dtype))
    if model is None:
        if impl == "fused_attn":
            import fused_attn.hf

            fused_attn.hf.register()
        model = copy.deepcopy(hf_model).to(device, dtype).eval()
        model.set_attn_implementation(impl)
        cache[(impl, dtype)] = model
    stamps = _StepTimes(device)
    kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
              pad_token_id=0, eos_token_id=None, logits_processor=[stamps])
    if backend in STATIC:
        kw["cache_implementation"] = "static"
    kw.update(do_sample=True, temperature=temperature, top_k=top_k or None) if temperature > 0 else kw.update(
        do_sample=False)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out, wall, start, end = _timed(device, lambda: model.generate(ids, **kw))
    # stamps[i] = logits of token i ready; the token is sampled right after.
    return _result(backend, out, [start, *stamps.stamps, end], wall)


def nearest_rank(values, q: float) -> float:
    """The q-quantile (0 < q < 1) of ``values`` by the nearest-rank rule, the smallest value with at least
    a fraction q of the values at or below it (1-based rank ceil(q n)): the TBT p95 of the CLI, the GPT-2
    benchmark and its report (one definition). NaN for no values. (q n is rounded to 9 digits first: the
    float product 0.07 x 100 is 7.000000000000001, rank 7.)"""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)]


def summary(r: Result, batch: int) -> str:
    tbt = sorted(r.step_s) or [float("nan")]
    p95 = nearest_rank(tbt, 0.95)
    return (f"{r.backend:<9} TTFT {1e3 * r.ttft_s:8.2f} ms  TBT p50 {1e3 * statistics.median(tbt):7.3f} ms  "
            f"p95 {1e3 * p95:7.3f} ms  {r.tokens_per_s(batch):9.1f} tokens/s")


PROG = "python -m fused_attn.generate"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default shown, and the backends' list (the epilog) one line each as written."""


def backends_help() -> str:
    """--help's list of backends: one line each, saying what it is and which to use."""
    rows = {"auto": "graph-fused with a GPU, hf-eager without (says which it chose and why)", **BACKENDS}
    width = max(map(len, rows))
    return "backends (--backend):\n" + "\n".join(f"  {name:<{width}}  {what}" for name, what in rows.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=backends_help(),
                                 formatter_class=_HelpFormatter)
    ap.add_argument("--model", default="gpt2-random",
                    help="gpt2-random (seeded random weights, no download, no tokenizer) or a name/path transformers loads")
    ap.add_argument("--prompt", help="text (needs a tokenizer with the checkpoint; gpt2-random has none)")
    ap.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 464,2068,7586")
    ap.add_argument("--prompt-len", type=int, default=32, help="seeded random prompt of this length")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per row")
    ap.add_argument("--batch-size", type=int, default=1, help="rows; row i is left-padded by i tokens")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES), help="float32 without a GPU")
    ap.add_argument("--backend", default="auto", choices=("auto", *BACKENDS), metavar="BACKEND",
                    help="the backend to run (the list below)")
    ap.add_argument("--compare", action="store_true", help="run every backend, check greedy tokens agree")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt and of sampling")
    args = ap.parse_args(argv)

    def fail(message: str):
        ap.exit(2, f"{ap.prog}: error: {message}\n")

    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--prompt-len", args.prompt_len, 1), ("--top-k", args.top_k, 0),
                               ("--temperature", args.temperature, 0)):
        if value < least:
            fail(f"{flag} must be >= {least}, got {value}")
    prompt_ids = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            fail(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    if args.prompt is not None and args.model == "gpt2-random":
        fail("--prompt needs a tokenizer and gpt2-random has none: give token ids with --prompt-ids "
             "(e.g. --prompt-ids 464,2068,7586) or a --model with a tokenizer (e.g. gpt2)")

    from fused_attn.gpt2 import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    if device.type == "cpu" and dtype != torch.float32:
        print(f"no GPU: running in float32 instead of {args.dtype}")
        dtype = torch.float32
    try:
        hf_model = load_hf_model(args.model)
    except OSError as e:
        fail(f"--model must be gpt2-random or a GPT-2 checkpoint transformers can load, got {args.model!r} ({e})")
    tokenizer = None
    if args.prompt is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            fail(f"--prompt needs a tokenizer with {args.model!r}, found none ({e}); give --prompt-ids instead")
        prompt = torch.tensor(tokenizer(args.prompt)["input_ids"])
    elif prompt_ids is not None:
        prompt = torch.tensor(prompt_ids)
    else:
        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(1, hf_model.config.vocab_size, (args.prompt_len,), generator=g)
    vocab = hf_model.config.vocab_size
    if prompt.numel() == 0:
        fail("the prompt must hold at least one token, got none")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        fail(f"--prompt-ids must be token ids in [0, {vocab}), got {prompt.tolist()}")
    positions = hf_model.config.n_positions
    length = prompt.numel() + args.batch_size - 1 + args.max_new_tokens
    if length > positions:
        fail(f"prompt + left padding + --max-new-tokens must fit in {args.model}'s {positions} positions, got "
             f"{prompt.numel()} + {args.batch_size - 1} + {args.max_new_tokens} = {length}")
    ids, mask = make_batch(prompt, args.batch_size)
    if args.compare:
        backends = tuple(b for b in BACKENDS if device.type == "cuda" or b not in GPU_ONLY)
        for b in BACKENDS:
            if b not in backends:
                print(f"--compare: {b} left out, it needs a GPU and there is none ({BACKENDS[b]})")
    elif args.backend == "auto":
        backends = (AUTO[device.type],)
        why = ("a GPU: the fastest there" if device.type == "cuda" else
               "no GPU: our model runs the reference PyTorch ops there, 3.2 tokens/s against hf-eager's 18.2")
        print(f"--backend auto: {backends[0]} ({why})")
    else:
        backends = (args.backend,)
    cache: dict = {}
    results = []
    for backend in backends:
        if backend in STATIC + COMPILED:  # a clean compile per compiled backend: one must not hit another's
            torch._dynamo.reset()  # recompile limit and run uncompiled (the warm-up below compiles it)
        # Warm-up with the timed lengths: graph capture, transformers' static-cache compilation.
        run_backend(backend, hf_model, ids, mask, args.max_new_tokens, dtype, device, args.temperature,
                    args.top_k, args.seed, cache)
        results.append(run_backend(backend, hf_model, ids, mask, args.max_new_tokens, dtype, device,
                                   args.temperature, args.top_k, args.seed, cache))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{args.model} on {name}, {dtype}, batch {args.batch_size}, prompt {prompt.numel()} tokens, "
          f"{args.max_new_tokens} new")
    new = results[0].tokens[0, ids.shape[1]:]
    print("continuation of row 0:", tokenizer.decode(new) if tokenizer else new.tolist())
    for r in results:
        print(summary(r, args.batch_size))
    if len(results) > 1:
        same = all(torch.equal(r.tokens, results[0].tokens) for r in results[1:])
        detail = ", ".join(f"{r.backend}={'same' if torch.equal(r.tokens, results[0].tokens) else 'DIFFERENT'}"
                           for r in results[1:])
        print(f"tokens identical across backends: {same} ({detail} vs {results[0].backend})")
        return 0 if same or args.temperature > 0 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
