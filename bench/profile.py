"""Where GPT-2's time goes: torch.profiler over prefill and decode, per layer part and per kernel.

    python -m bench.profile --backends hf-eager,graph --batch-size 1 --prompt-len 128 \\
        --new-tokens 32 --dtype float16 [--out DIR]

For each backend, profiles one warm generate() (prefill + decode) and writes into --out:
``layers_<backend>.txt`` (embeddings, ln_1, attention, residual adds, ln_2, mlp, ln_f, lm_head:
device time and share of the total; our GPT-2 adds the residuals in the output projections, so its
residual row is 0 and attention / mlp include them), ``kernels_<backend>.txt`` (top kernels by device time,
launches per generated token), ``critical_<backend>.txt`` (what each kernel adds to a decode step: see
critical_path), ``trace_<backend>.json`` (Chrome trace) and ``profile.md``
with the backends side by side. --out defaults to a folder under the system's temporary
directory (a tool writes into the checkout only when told to); the summary worth keeping goes
into bench/results/history.md, the traces are not committed. Labels come from torch.profiler.record_function scopes:
forward hooks on transformers' modules (residual adds are what is left of each block), the
model's own scopes for fused_attn.gpt2. A captured CUDA graph carries no labels, so the
layer table of ``graph`` profiles the same decode step run eagerly (``graph-eager``); its
kernel table profiles the graph replays.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fused_attn.generate import BACKENDS, DTYPES, GRAPH_BACKENDS, HF_IMPL, make_batch, run_backend

PARTS = ("embeddings", "ln_1", "attention", "residual", "ln_2", "mlp", "ln_f", "lm_head")
HF_PARTS = {"wte": "embeddings", "wpe": "embeddings", "ln_1": "ln_1", "attn": "attention", "ln_2": "ln_2",
            "mlp": "mlp", "ln_f": "ln_f", "lm_head": "lm_head"}


@contextlib.contextmanager
def hf_labels(model):
    """record_function scopes around the parts of a transformers GPT-2 (forward hooks)."""
    handles, open_scopes = [], defaultdict(list)
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        part = "block" if last.isdigit() and name.rsplit(".", 2)[-2] == "h" else HF_PARTS.get(last)
        if part is None:
            continue

        def pre(mod, args, part=part, key=name):
            scope = record_function(part)
            scope.__enter__()
            open_scopes[key].append(scope)

        def post(mod, args, out, key=name):
            open_scopes[key].pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


LABELS = set(PARTS) | {"block"}


def _device_time_us(evt) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def _is_cpu(evt) -> bool:
    return getattr(evt, "device_type", torch.autograd.DeviceType.CPU) == torch.autograd.DeviceType.CPU


def part_times(prof, on_gpu: bool) -> dict[str, float]:
    """Time per label (us). On a GPU: the device time of the kernels launched inside each
    CPU-side scope (children included). The profiler also records each scope as a GPU
    range (first kernel start to last kernel end); those ranges include the idle gaps of a
    launch-bound decode, so they are not used."""
    times: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.name in LABELS and _is_cpu(evt):
            times[evt.name] += _device_time_us(evt) if on_gpu else float(evt.cpu_time_total)
    if "block" in times:  # transformers: the residual adds are the block minus its labelled parts
        times["residual"] = max(0.0, times["block"] - sum(times[p] for p in ("ln_1", "attention", "ln_2", "mlp")))
    return times


def tables(prof, tokens: int, on_gpu: bool) -> tuple[list[str], list[str]]:
    times = part_times(prof, on_gpu)
    total_parts = sum(times.get(p, 0.0) for p in PARTS)
    unit = "device" if on_gpu else "CPU (no GPU)"
    layers = [f"{'part':<12} {unit + ' us':>16} {'share':>7}"]
    for part in PARTS:
        t = times.get(part, 0.0)
        layers.append(f"{part:<12} {t:>16.1f} {100 * t / total_parts if total_parts else 0:>6.1f}%")
    layers.append(f"{'total':<12} {total_parts:>16.1f}")
    kernels = [f"{'kernel':<80} {'device us':>11} {'launches':>9} {'per token':>9}"]
    if on_gpu:
        ks = [e for e in prof.key_averages() if not _is_cpu(e) and e.key not in LABELS]  # kernels and copies
        ks.sort(key=lambda e: -_device_time_us(e))
        for e in ks[:25]:
            kernels.append(f"{e.key[:80]:<80} {_device_time_us(e):>11.1f} {e.count:>9} {e.count / tokens:>9.1f}")
        kernels.append(f"{'all kernels':<80} {sum(_device_time_us(e) for e in ks):>11.1f} "
                       f"{sum(e.count for e in ks):>9} {sum(e.count for e in ks) / tokens:>9.1f}")
    else:
        kernels.append("(no GPU: no kernels)")
    return layers, kernels


def _family(name: str) -> str:
    """A kernel's name without `void`, namespaces and parameter list (template arguments kept: they say
    which instantiation ran), at most 90 characters."""
    name = re.sub(r"^void\s+", "", name).split("(")[0]
    return re.sub(r"\b(fused_attn|linear|decode|attention|sample|layer_norm|at|native)::", "", name)[:90]


def critical_path(prof, skip_steps: int = 2) -> list[str]:
    """What each kernel adds to a decode step: the device events of the steps after the first
    `skip_steps` (a step ends with the `sample` kernel; the prefill's is the first), sorted by their end,
    each credited with its end minus the latest end before it. Under programmatic dependent launch a
    kernel starts early and waits, so its own duration says little; this increment is what the step
    would lose without it (the gaps between replays go to the first kernel of a step). Per family:
    launches per step, us per step, us per launch, and the head start: the median over its launches of the
    latest end before it minus its start (> 0: it ran that long under the kernel before it, its pre-wait
    loads overlapping that kernel; <= 0: it started only after, e.g. its blocks found no room on the SMs)."""
    evts = [e for e in prof.events() if not _is_cpu(e) and e.name not in LABELS]
    evts.sort(key=lambda e: e.time_range.end)
    ends = [e.time_range.end for e in evts if "sample" in e.name]
    if len(ends) < skip_steps + 2:
        return [f"(fewer than {skip_steps + 2} sample kernels: no decode steps to measure)"]
    lo, hi = ends[skip_steps], ends[-1]
    steps = len(ends) - 1 - skip_steps
    inc: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    heads: dict[str, list[float]] = defaultdict(list)
    last = lo
    for e in evts:
        if e.time_range.end <= lo or e.time_range.end > hi:
            continue
        fam = _family(e.name)
        inc[fam] += max(0.0, e.time_range.end - last)
        count[fam] += 1
        heads[fam].append(last - e.time_range.start)
        last = max(last, e.time_range.end)
    total = hi - lo
    lines = [f"{'kernel (decode steps ' + str(steps) + ')':<90} {'per step':>8} {'us/step':>8} {'us/launch':>9} "
             f"{'share':>6} {'head us':>7}"]
    for fam in sorted(inc, key=lambda f: -inc[f]):
        lines.append(f"{fam:<90} {count[fam] / steps:>8.1f} {inc[fam] / steps:>8.2f} "
                     f"{inc[fam] / max(1, count[fam]):>9.2f} {100 * inc[fam] / total:>5.1f}% "
                     f"{statistics.median(heads[fam]):>7.2f}")
    lines.append(f"{'step (sample end to sample end)':<90} {sum(count.values()) / steps:>8.1f} {total / steps:>8.2f}")
    return lines


def profile_backend(backend: str, hf_model, ids, mask, new_tokens: int, dtype, device, cache: dict):
    """Profile one warm generate(); returns the profiler."""
    from fused_attn.gpt2 import GPT2

    run_backend(backend.removesuffix("-eager") if backend == "graph-eager" else backend, hf_model, ids, mask,
                new_tokens, dtype, device, cache=cache)  # warm-up, same lengths
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if backend in GRAPH_BACKENDS or backend == "graph-eager":
        model: GPT2 = cache[(backend.removesuffix("-eager"), dtype)]
        model.annotate = backend == "graph-eager"
        try:
            with profile(activities=activities) as prof:
                model.generate(ids.to(device), mask.to(device), max_new_tokens=new_tokens,
                               use_graph=backend != "graph-eager" and device.type == "cuda")
                if device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            model.annotate = False
        return prof
    impl = HF_IMPL[backend]
    model = cache[(impl, dtype)]
    with hf_labels(model), profile(activities=activities) as prof:
        run_backend(backend, hf_model, ids, mask, new_tokens, dtype, device, cache=cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="gpt2-random", help="gpt2-random or a name/path transformers loads")
    ap.add_argument("--backends", default="hf-eager,graph",
                    help=f"comma list of {', '.join(BACKENDS)} (graph also profiles graph-eager)")
    ap.add_argument("--batch-size", type=int, default=1, help="rows")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated tokens")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES), help="float32 without a GPU")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fused_attn_profile",
                    help="directory for the tables and traces (bench/profile for the committed tables)")
    args = ap.parse_args(argv)

    from bench.harness import settle_process
    from fused_attn.gpt2 import load_hf_model

    settle_process()  # the critical paths of a process in the state users run in (bench/harness.py)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    hf_model = load_hf_model(args.model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, hf_model.config.vocab_size, (args.prompt_len,), generator=g)
    ids, mask = make_batch(prompt, 1)
    ids, mask = ids.expand(args.batch_size, -1).contiguous(), mask.expand(args.batch_size, -1).contiguous()
    backends = []
    for b in args.backends.split(","):
        if b not in BACKENDS:
            raise SystemExit(f"--backends must name {', '.join(BACKENDS)}, got {b!r}")
        backends += [b, "graph-eager"] if b == "graph" else [b]
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    head = (f"{args.model} on {name}, {dtype}, batch {args.batch_size}, prompt {args.prompt_len}, "
            f"{args.new_tokens} new tokens (prefill + decode, one warm generate)")
    md = [f"# GPT-2 profile: {head}", ""]
    cache: dict = {}
    for backend in backends:
        prof = profile_backend(backend, hf_model, ids, mask, args.new_tokens, dtype, device, cache)
        layers, kernels = tables(prof, args.batch_size * args.new_tokens, device.type == "cuda")
        (args.out / f"layers_{backend}.txt").write_text(f"# {backend}: {head}\n" + "\n".join(layers) + "\n")
        (args.out / f"kernels_{backend}.txt").write_text(f"# {backend}: {head}\n" + "\n".join(kernels) + "\n")
        if device.type == "cuda" and backend != "graph-eager":
            critical = critical_path(prof)
            (args.out / f"critical_{backend}.txt").write_text(f"# {backend}: {head}\n" + "\n".join(critical) + "\n")
            md += [f"## {backend}: critical path per decode step", "", "```", *critical, "```", ""]
        prof.export_chrome_trace(str(args.out / f"trace_{backend}.json"))
        md += [f"## {backend}", "", "```", *layers, "```", "", "```", *kernels, "```", ""]
        print(f"{backend}: " + "; ".join(line.split()[0] + " " + line.split()[-1] for line in layers[1:-1]))
    (args.out / "profile.md").write_text("\n".join(md) + "\n")
    print(f"profile: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
