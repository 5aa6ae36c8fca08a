"""Tables and plots from saved pytest-benchmark runs.

    python -m bench.report RUN.json [RUN2.json ...] --out DIR [--bytes NCU.txt] [--profile PROFILE_DIR]

Writes into DIR: micro.txt (latency p5/p50/p95, bandwidth, % of the copy bandwidth and of a
same-size copy, speedups; a forward table, then a backward table when the run has backward
cases), memory.txt (bytes moved per provider: modeled, and measured by
`python -m bench.bytes` when --bytes is given), gpt2.txt (GPT-2 end to end from
bench/bench_gpt2.py: tokens/s, TTFT, TBT, speedup and token agreement vs hf-eager; with --profile, a
summary of `python -m bench.profile`'s tables), report.md (the same tables in Markdown) and PNG
plots of the first run with softmax cases: latency vs N per provider (with a device copy of
fused_v1's bytes, where measured), and % of the copy bandwidth vs N. Every table names the GPU,
torch/CUDA, commit, dtype and shapes.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections import defaultdict
from pathlib import Path

PROVIDER_ORDER = ("eager", "compiled", "compiled_iota", "fused_v0", "fused_v1")
BACKWARD_ORDER = ("eager", "compiled", "fused")
FORWARD_BENCH, BACKWARD_BENCH = "bench_scaled_masked_softmax[", "bench_scaled_masked_softmax_backward["
BACKEND_ORDER = ("hf-eager", "hf-sdpa", "hf-static", "hf-fused", "graph", "graph-eager")
GPT2_COLS = (("batch", ">5"), ("prompt", ">6"), ("dtype", "<9"), ("backend", "<9"), ("tokens/s", ">9"),
             ("TTFT ms", ">8"), ("TBT p50 ms", ">10"), ("TBT p95 ms", ">10"), ("x hf-eager", ">10"),
             ("same tokens as hf-eager", ">23"))


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "benchmarks" not in data:
            raise ValueError(f"{p} must be a pytest-benchmark JSON file (no 'benchmarks' key)")
        data["_path"] = str(p)
        runs.append(data)
    return runs


def run_header(run: dict) -> str:
    mi = run.get("machine_info", {}).get("fused_attn", {})
    commit = mi.get("commit") or run.get("commit_info", {}).get("id", "unknown")
    if run.get("commit_info", {}).get("dirty"):
        commit += " (with uncommitted changes)"
    ceil = next((b["extra_info"] for b in run["benchmarks"] if "copy_gbps" in b["extra_info"]), {})
    ceilings = ", ".join(f"{k} {ceil[f'{k}_gbps']:.0f}" for k in ("copy", "read", "write") if f"{k}_gbps" in ceil)
    floor = ceil.get("launch_floor_us")
    return (f"{mi.get('gpu_name', 'unknown GPU')} (driver {mi.get('driver', '?')}), torch {mi.get('torch', '?')}, "
            f"CUDA {mi.get('cuda', '?')}, commit {commit}, run {run.get('datetime', '?')}"
            + (f"; measured GB/s: {ceilings}" if ceilings else "")
            + (f"; empty kernel {floor:.2f} us" if floor is not None else ""))


def softmax_rows(run: dict, backward: bool = False) -> list[dict]:
    """The forward (or backward) softmax cases of a run, grouped by dtype, causal, shape, provider."""
    prefix = BACKWARD_BENCH if backward else FORWARD_BENCH
    rows = [b["extra_info"] | {"name": b["name"]} for b in run["benchmarks"] if b["name"].startswith(prefix)]
    order = {p: i for i, p in enumerate(BACKWARD_ORDER if backward else PROVIDER_ORDER)}
    rows.sort(key=lambda r: (r["dtype"], not r["causal"], r["shape"], order.get(r["provider"], 99)))
    return rows


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


MICRO_COLS = (("shape [B,H,N,N]", "<18"), ("dtype", "<9"), ("causal", "<6"), ("provider", "<13"), ("p5 us", ">9"),
              ("p50 us", ">9"), ("p95 us", ">9"), ("GB/s", ">7"), ("% copy", ">6"), ("% roofline", ">10"),
              ("% same-bytes copy", ">17"), ("x eager", ">7"), ("x compiled", ">10"), ("x compiled_iota", ">15"))
MEMORY_COLS = (("shape [B,H,N,N]", "<18"), ("dtype", "<9"), ("causal", "<6"), ("provider", "<13"), ("read MB", ">9"),
               ("write MB", ">9"), ("total MB", ">9"), ("x fused", ">7"))
FUSED_REFERENCE = {False: "fused_v1", True: "fused"}  # the provider memory tables compare with
BACKWARD_TITLE = "scaled_masked_softmax backward (dx from dy and y)"


def render(cols: tuple[tuple[str, str], ...], rows: list[list[str]], markdown: bool) -> list[str]:
    """A table as Markdown (pipes) or aligned text (one format spec per column)."""
    if markdown:
        return ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols),
                *("| " + " | ".join(cells) + " |" for cells in rows)]
    return [" ".join(format(c, align) for c, align in cols),
            *(" ".join(format(cell, align) for cell, (_, align) in zip(cells, cols)) for cells in rows)]


def micro_table(rows: list[dict], markdown: bool, backward: bool = False) -> list[str]:
    """Latency, bandwidth and speedups per case (backward: no compiled_iota, a forward-only provider)."""
    cols = MICRO_COLS[:-1] if backward else MICRO_COLS
    cells = [["x".join(map(str, r["shape"])), r["dtype"], "yes" if r["causal"] else "no", r["provider"],
              _fmt(r.get("p5_us"), ".1f"), _fmt(r.get("p50_us"), ".1f"), _fmt(r.get("p95_us"), ".1f"),
              _fmt(r.get("gbps"), ".0f"), _fmt(r.get("pct_of_copy_bw"), ".1f"), _fmt(r.get("pct_of_roofline"), ".1f"),
              _fmt(r.get("pct_of_same_bytes_copy"), ".1f"), _fmt(r.get("speedup_vs_eager"), ".2f"),
              _fmt(r.get("speedup_vs_compiled"), ".2f"), _fmt(r.get("speedup_vs_compiled_iota"), ".2f")][:len(cols)]
             for r in rows]
    return render(cols, cells, markdown)


def memory_table(rows: list[dict], markdown: bool, backward: bool = False) -> list[str]:
    groups = defaultdict(dict)
    for r in rows:
        groups[(tuple(r["shape"]), r["dtype"], r["causal"])][r["provider"]] = r
    cells = []
    for (shape, dtype, causal), provs in groups.items():
        fused = provs.get(FUSED_REFERENCE[backward], {}).get("modeled_bytes")
        for p in BACKWARD_ORDER if backward else PROVIDER_ORDER:
            if p not in provs or "modeled_bytes" not in provs[p]:
                continue
            r = provs[p]
            read, write = r.get("modeled_read_bytes"), r.get("modeled_write_bytes")
            cells.append(["x".join(map(str, shape)), dtype, "yes" if causal else "no", p,
                          _fmt(read and read / 1e6, ".1f"), _fmt(write and write / 1e6, ".1f"),
                          f"{r['modeled_bytes'] / 1e6:.1f}", _fmt(fused and r["modeled_bytes"] / fused, ".2f")])
    return render(MEMORY_COLS, cells, markdown)


def gpt2_rows(run: dict) -> list[dict]:
    rows = [b["extra_info"] | {"name": b["name"]} for b in run["benchmarks"] if b["name"].startswith("bench_gpt2")]
    order = {b: i for i, b in enumerate(BACKEND_ORDER)}
    rows.sort(key=lambda r: (r["dtype"], r["batch"], r["prompt"], order.get(r["backend"], 99), r["backend"]))
    return rows


def gpt2_table(rows: list[dict], markdown: bool) -> list[str]:
    cells = []
    for r in rows:
        same = r.get("tokens_match_hf_eager")
        cells.append([str(r["batch"]), str(r["prompt"]), r["dtype"], r["backend"], _fmt(r.get("tokens_per_s"), ".1f"),
                      _fmt(r.get("ttft_ms"), ".3f"), _fmt(r.get("tbt_p50_ms"), ".3f"), _fmt(r.get("tbt_p95_ms"), ".3f"),
                      _fmt(r.get("speedup_vs_hf_eager"), ".2f"), "-" if same is None else "yes" if same else "no"])
    return render(GPT2_COLS, cells, markdown)


def gpt2_lines(runs: list[dict], markdown: bool) -> list[str]:
    """One GPT-2 table per run that has GPT-2 cases, each under its run header and source."""
    lines = []
    for run in runs:
        rows = gpt2_rows(run)
        if not rows:
            continue
        header, source = run_header(run), Path(run["_path"]).name
        new_tokens = "/".join(sorted({str(r.get("new_tokens", "?")) for r in rows}))
        note = ([f"x hf-eager of {', '.join(sorted({r['backend'] for r in rows if 'interleaved_hf_eager' in r}))}: "
                 "against hf-eager rounds interleaved with its own (the two differ by less than the drift "
                 "between cases)"] if any("interleaved_hf_eager" in r for r in rows) else [])
        clocks = sorted({r["clock"] for r in rows if "clock" in r})
        if clocks:
            worst = max(r.get("max_clock_vs_wall_pct", 0.0) for r in rows)
            note += [f"clock: {'; '.join(clocks)} (largest difference {worst:.3f}%)"]
        if markdown:
            lines += [f"## GPT-2 end to end: {header}", "",
                      f"Source: `{source}`; {new_tokens} new tokens per sequence.", "", *gpt2_table(rows, True), "",
                      *note, *([""] if note else [])]
        else:
            lines += [f"# {header}", f"# source: {source}; {new_tokens} new tokens per sequence",
                      *gpt2_table(rows, False), *note, ""]
    if not lines:
        msg = "No GPT-2 end-to-end cases in these runs (bench/bench_gpt2.py saves them)."
        lines = (["## GPT-2 end to end", "", msg, ""] if markdown else [msg, ""])
    return lines


def profile_lines(d: Path) -> tuple[str, list[str]]:
    """Title and summary of `python -m bench.profile`'s output in d: per backend, the layer
    table and the all-kernels total."""
    if not (d / "profile.md").exists():
        return "GPT-2 profile", [f"no profile.md in {d} (python -m bench.profile writes it)"]
    title = (d / "profile.md").read_text().splitlines()[0].removeprefix("# ")
    lines = [f"full tables: {d}/profile.md, layers_<backend>.txt, kernels_<backend>.txt"]
    order = {b: i for i, b in enumerate(BACKEND_ORDER)}
    backends = sorted((p.stem.removeprefix("layers_") for p in d.glob("layers_*.txt")),
                      key=lambda b: (order.get(b, 99), b))
    for backend in backends:
        layers = [ln for ln in (d / f"layers_{backend}.txt").read_text().splitlines() if not ln.startswith("#")]
        lines += ["", backend, *layers]
        kernels = d / f"kernels_{backend}.txt"
        if kernels.exists():
            last = kernels.read_text().rstrip().splitlines()[-1]
            f = last.split()
            lines.append(f"all kernels: {f[-3]} device us, {f[-2]} launches, {f[-1]} per token"
                         if last.startswith("all kernels") and len(f) == 5 else last)
    return title, lines


def spread_lines(runs: list[dict]) -> list[str]:
    """p50 differences between runs of the same cases (e.g. two back-to-back runs)."""
    if len(runs) < 2:
        return []
    lines = [f"p50 spread between {len(runs)} runs (max |p50_i - p50_0| / p50_0 per case), fused providers:"]
    worst = {}
    base = {b["name"]: b["extra_info"] for b in runs[0]["benchmarks"]}
    for run in runs[1:]:
        for b in run["benchmarks"]:
            e0 = base.get(b["name"])
            if e0 is None or not b["extra_info"].get("provider", "").startswith("fused"):
                continue
            d = abs(b["extra_info"]["p50_us"] - e0["p50_us"]) / e0["p50_us"]
            worst[b["name"]] = max(worst.get(b["name"], 0.0), d)
    for name, d in sorted(worst.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {100 * d:5.2f}%  {name}")
    if not worst:
        return []
    vals = sorted(worst.values())
    lines.insert(1, f"  cases {len(vals)}, median {100 * vals[len(vals) // 2]:.2f}%, max {100 * vals[-1]:.2f}%")
    return lines


def plot(rows: list[dict], out: Path, header: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_key = defaultdict(list)
    for r in rows:
        b, h, n, _ = r["shape"]
        if h == 12:  # the GPT-2 sweep: one line per (batch, provider)
            by_key[(r["dtype"], r["causal"], b)].append(r)
    for (dtype, causal, batch), rs in sorted(by_key.items()):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for p in PROVIDER_ORDER:
            pts = sorted((r["shape"][2], r) for r in rs if r["provider"] == p)
            if not pts:
                continue
            ns = [n for n, _ in pts]
            ax1.plot(ns, [r["p50_us"] for _, r in pts], marker="o", label=p)
            if all("pct_of_copy_bw" in r for _, r in pts):
                ax2.plot(ns, [r["pct_of_copy_bw"] for _, r in pts], marker="o", label=p)
            if p == "fused_v1" and all("same_bytes_copy_us" in r for _, r in pts):
                ax1.plot(ns, [r["same_bytes_copy_us"] for _, r in pts], linestyle="--", color="gray",
                         label="device copy of fused_v1's bytes")
        for ax, ylabel in ((ax1, "p50 latency (us)"), (ax2, "% of copy bandwidth (modeled bytes)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (seqlen_q = seqlen_k)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        ax1.set_yscale("log")
        title = f"softmax [{batch},12,N,N] {dtype} {'causal' if causal else 'full'}\n" + "\n".join(textwrap.wrap(header, 160))
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        path = out / f"softmax_b{batch}_{dtype}_{'causal' if causal else 'full'}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="pytest-benchmark JSON files")
    ap.add_argument("--out", type=Path, required=True, help="directory to write into")
    ap.add_argument("--bytes", type=Path, help="output of `python -m bench.bytes` to include")
    ap.add_argument("--profile", type=Path, help="directory written by `python -m bench.profile` to summarize")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    runs = load_runs(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)

    micro, memory, md = [], [], ["# fused_attn benchmark report", ""]
    pngs = []
    for run in runs:
        header, source = run_header(run), Path(run["_path"]).name
        rows, bwd = softmax_rows(run), softmax_rows(run, backward=True)
        if not rows and not bwd:
            micro += [f"# {header}", f"# source: {source}", "No scaled_masked_softmax cases in this run.", ""]
            memory += [f"# {header}", f"# source: {source}", "No scaled_masked_softmax cases in this run.", ""]
            continue
        for backward, rs in ((False, rows), (True, bwd)):
            if not rs:
                continue
            title = BACKWARD_TITLE if backward else "scaled_masked_softmax"
            micro += [f"# {title}: {header}", f"# source: {source}", *micro_table(rs, False, backward), ""]
            memory += [f"# {title}: {header} (modeled bytes)", f"# source: {source}",
                       *memory_table(rs, False, backward), ""]
            md += [f"## {title}: {header}", "", f"Source: `{source}`", "", *micro_table(rs, True, backward), "",
                   "### Bytes moved (modeled)", "", *memory_table(rs, True, backward), ""]
        if rows and not args.no_plots and not pngs:  # plots of the first run with softmax cases
            pngs += plot(rows, args.out, header)
    if args.bytes:
        measured = args.bytes.read_text().rstrip().splitlines()
        memory += ["# measured with Nsight Compute (python -m bench.bytes)", *measured, ""]
        md += ["### Bytes moved (measured, Nsight Compute)", "", "```", *measured, "```", ""]
    spread = spread_lines(runs)
    if spread:
        micro += spread + [""]
        md += ["### Run-to-run spread", "", "```", *spread, "```", ""]
    gpt2 = gpt2_lines(runs, False)
    md += gpt2_lines(runs, True)
    if args.profile:
        title, prof = profile_lines(args.profile)
        gpt2 += [f"# {title}", *prof, ""]
        md += [f"## {title}", "", "```", *prof, "```", ""]
    if pngs:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    (args.out / "micro.txt").write_text("\n".join(micro) + "\n")
    (args.out / "memory.txt").write_text("\n".join(memory) + "\n")
    (args.out / "gpt2.txt").write_text("\n".join(gpt2))
    (args.out / "report.md").write_text("\n".join(md))
    print(f"report: {args.out} ({len(pngs)} plots)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
