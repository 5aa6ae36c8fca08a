"""Tables and plots from saved pytest-benchmark runs, for every op's benchmarks; the headline charts
and the README's results table from the stored runs.

    python -m bench.report [--results bench/results] [--charts docs] [--readme README.md]
    python -m bench.report RUN.json [RUN2.json ...] [--out DIR] [--bytes NCU.txt] [--profile PROFILE_DIR]
                           [--no-plots]

Without RUN files: from the newest stored measurement of every headline case (bench/conftest.py
HEADLINE) of each GPU model under --results, two charts, gpt2_decode.png (GPT-2 decode tokens/s per
batch: ours, compile-graph, Hugging Face eager and the bandwidth floor) and ops_speedup.png (each op's
speedup over its peer, PEERS), written into --charts (default --out), and the results table (one row
per GPU and comparison), printed, and written between the README's results markers with --readme
(refused, writing nothing, when the markers are missing).

Cases are grouped by benchmark function (``bench_<name>`` in ``bench/bench_<op>.py``), each under
its own title. What a table shows comes from the saved cases: the columns are the case's
parameters (pytest-benchmark's ``params``: shape, dtype, flags, provider), then every figure of
``KERNEL_METRICS`` / ``MODEL_METRICS`` that some case of the table has in ``extra_info``, and a
``x <provider>`` column per ``speedup_vs_<provider>`` in it. Rows are sorted by dtype, then the
other parameters (a flag that is set first), then shape, then provider (in the order of the op
module's ``REPORT_LABELS`` entry, else of the run). A module's ``REPORT_LABELS`` may also name a
function's title and shape column; "ours" is the last provider whose name starts with ``fused``.

Writes into DIR (default: a folder under the system's temporary directory; a tool writes into
the checkout only when told to): micro.txt (kernel cases, those with a ``provider``: latency,
bandwidth, % of the copy bandwidth and of a same-size copy, speedups; one table per function),
memory.txt (modeled bytes per provider, and the ncu table of ``python -m bench.bytes`` when
--bytes is given), gpt2.txt (end-to-end model cases, those with a ``backend``: tokens/s, TTFT,
TBT, speedup and token agreement; with --profile, a summary of ``python -m bench.profile``'s
tables), report.md (the same tables in Markdown) and PNG plots of the first run with kernel cases:
per function and case family, latency vs the last shape dimension per provider (with a device copy
of ours' bytes, where measured) and % of the copy bandwidth. Every table names the GPU, torch/CUDA,
commit and source file; with two runs or more, the run-to-run spread of our providers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import tempfile
import textwrap
from collections import defaultdict
from pathlib import Path

from fused_attn.generate import BACKENDS

DEFAULT_OUT = Path(tempfile.gettempdir()) / "fused_attn_report"
# Figures shown when a case has them: extra_info key -> (header, format, least text width).
KERNEL_METRICS = {"p5_us": ("p5 us", ".1f", 9), "p50_us": ("p50 us", ".1f", 9), "p95_us": ("p95 us", ".1f", 9),
                  "gbps": ("GB/s", ".0f", 7), "tflops": ("TFLOP/s", ".1f", 7), "pct_of_copy_bw": ("% copy", ".1f", 6),
                  "pct_of_roofline": ("% roofline", ".1f", 10),
                  "pct_of_same_bytes_copy": ("% same-bytes copy", ".1f", 17)}
MODEL_METRICS = {"tokens_per_s": ("tokens/s", ".1f", 9), "ttft_ms": ("TTFT ms", ".3f", 8),
                 "tbt_p50_ms": ("TBT p50 ms", ".3f", 10), "tbt_p95_ms": ("TBT p95 ms", ".3f", 10),
                 "pct_of_weight_floor": ("% weight floor", ".1f", 14), "pct_of_step_floor": ("% step floor", ".1f", 12),
                 "launches_per_step": ("launches/step", "d", 13)}
# Least text widths of parameter columns (wider when a cell is).
PARAM_WIDTHS = {"shape": 18, "dtype": 9, "provider": 13}
OURS_PREFIX = "fused"


def load_run(path: Path) -> dict:
    """A saved pytest-benchmark run, with its path under ``_path``."""
    data = json.loads(Path(path).read_text())
    if "benchmarks" not in data:
        raise ValueError(f"{path} must be a pytest-benchmark JSON file (no 'benchmarks' key)")
    data["_path"] = str(path)
    return data


def load_runs(paths: list[Path]) -> list[dict]:
    return [load_run(p) for p in paths]


def _file_error(e: Exception) -> str:
    """One line for a run file that cannot be read: missing, unreadable, not JSON, not a run."""
    if isinstance(e, OSError):
        return f"{e.filename} must be a readable file, got {e.strerror.lower()}"
    if isinstance(e, json.JSONDecodeError):
        return f"each run must be a pytest-benchmark JSON file, got invalid JSON ({e.msg} at line {e.lineno})"
    return str(e)


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


def function_name(bench: dict) -> str:
    return bench["name"].split("[", 1)[0]


_LABELS: dict[str, dict] = {}


def labels(bench: dict) -> dict:
    """The REPORT_LABELS entry of a case's function in its bench module ({} when there is none)."""
    module = "bench." + Path(bench.get("fullname", "").split("::", 1)[0]).stem
    if module not in _LABELS:
        try:
            _LABELS[module] = getattr(importlib.import_module(module), "REPORT_LABELS", {})
        except ImportError:
            _LABELS[module] = {}
    return _LABELS[module].get(function_name(bench), {})


def case_params(bench: dict) -> dict:
    """The parameters of a case (one dict parameter is opened)."""
    params = bench.get("params") or {}
    if len(params) == 1 and isinstance(next(iter(params.values())), dict):
        params = next(iter(params.values()))
    return params


def case_keys(bench: dict) -> list[str]:
    """The parameters of a case, in the order of its parametrization: those its extra_info repeats, and its
    flags (bool parameters, e.g. bench_gpt2's ``sample``), which tell apart cases that are otherwise alike."""
    params = case_params(bench)
    return [k for k in params if k in bench["extra_info"] or isinstance(params[k], bool)]


def case_row(bench: dict) -> dict:
    """A case's table row: its flags, then its extra_info, then its name."""
    flags = {k: v for k, v in case_params(bench).items() if isinstance(v, bool)}
    return flags | bench["extra_info"] | {"name": bench["name"]}


def _param_order(v) -> tuple:
    """A parameter's sort key: a flag's True first (causal cases first), a case without the parameter last."""
    return (1, 0) if v is None else (0, not v) if isinstance(v, bool) else (0, v)


class Family:
    """The cases of one benchmark function in one run: rows (extra_info), parameters, who ran them."""

    def __init__(self, name: str, benches: list[dict]):
        self.name, self.labels = name, labels(benches[0])
        self.keys = list(dict.fromkeys(k for b in benches for k in case_keys(b)))  # a flag some cases lack too
        self.who = "provider" if "provider" in benches[0]["extra_info"] else "backend"
        if self.who not in self.keys:
            self.keys.append(self.who)
        self.title = self.labels.get("title", name.removeprefix("bench_"))
        seen = list(dict.fromkeys(b["extra_info"][self.who] for b in benches))
        order = list(self.labels.get("order", ())) + [w for w in seen if w not in self.labels.get("order", ())]
        self.order = [w for w in order if w in seen]
        rank = {w: i for i, w in enumerate(self.order)}
        flags = [k for k in self.keys if k not in ("shape", "dtype", self.who)]
        self.rows = sorted((case_row(b) for b in benches), key=lambda r: (
            str(r.get("dtype", "")), *[_param_order(r.get(k)) for k in flags],
            r.get("shape", []), rank[r[self.who]]))
        ours = [w for w in self.order if w.startswith(OURS_PREFIX)]
        self.ours = ours[-1] if ours else None


def families(run: dict, who: str) -> list[Family]:
    """The run's benchmark functions whose cases name a ``who`` (provider: kernels; backend: models)."""
    by_name: dict[str, list[dict]] = defaultdict(list)
    for b in run["benchmarks"]:
        if who in b.get("extra_info", {}):
            by_name[function_name(b)].append(b)
    return [Family(name, benches) for name, benches in by_name.items()]


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if key == "shape":
        return "x".join(map(str, v))
    return str(v)


def render(cols: list[tuple[str, str]], rows: list[list[str]], markdown: bool) -> list[str]:
    """A table as Markdown (pipes) or aligned text (one format spec per column)."""
    if markdown:
        return ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols),
                *("| " + " | ".join(cells) + " |" for cells in rows)]
    return [" ".join(format(c, align) for c, align in cols),
            *(" ".join(format(cell, align) for cell, (_, align) in zip(cells, cols)) for cells in rows)]


def table(fam: Family, rows: list[dict], figures: list[tuple[str, str, int, object]], markdown: bool) -> list[str]:
    """Parameter columns, then ``figures``: (header, format, least width, key or function of the row)."""
    headers = [fam.labels.get("shape", "shape") if k == "shape" else k for k in fam.keys]
    cells = [[_cell(k, r.get(k)) for k in fam.keys]
             + [_fmt(get(r) if callable(get) else r.get(get), spec) for _, spec, _, get in figures] for r in rows]
    cols = []
    for j, h in enumerate(headers + [f[0] for f in figures]):
        numeric = j >= len(fam.keys) or isinstance(rows[0].get(fam.keys[j]), (int, float)) and not isinstance(
            rows[0].get(fam.keys[j]), bool)
        least = figures[j - len(fam.keys)][2] if j >= len(fam.keys) else PARAM_WIDTHS.get(fam.keys[j], 0)
        width = max([least, len(h)] + [len(c[j]) for c in cells])
        cols.append((h, f"{'>' if numeric else '<'}{width}"))
    return render(cols, cells, markdown)


def named(fam: Family, rows: list[dict], prefix: str) -> list[tuple[str, str]]:
    """(provider, key) of every ``<prefix><provider>`` key in the rows (``-`` spelled ``_``), in provider order."""
    names = {w.replace("-", "_"): w for w in fam.order}
    keys = {k.removeprefix(prefix) for r in rows for k in r if k.startswith(prefix)}
    return [(names.get(k, k), prefix + k) for k in [k for k in names if k in keys] + sorted(keys - set(names))]


def speedups(fam: Family, rows: list[dict]) -> list[tuple[str, str, int, str]]:
    """One ``x <provider>`` column per ``speedup_vs_<provider>`` in the rows."""
    return [(f"x {name}", ".2f", 0, key) for name, key in named(fam, rows, "speedup_vs_")]


def present(metrics: dict, rows: list[dict]) -> list[tuple[str, str, int, str]]:
    return [(h, spec, w, k) for k, (h, spec, w) in metrics.items() if any(k in r for r in rows)]


def micro_table(fam: Family, markdown: bool) -> list[str]:
    """Latency, bandwidth and speedups per kernel case."""
    return table(fam, fam.rows, present(KERNEL_METRICS, fam.rows) + speedups(fam, fam.rows), markdown)


def summary_table(fam: Family, markdown: bool) -> list[str]:
    """The README's table: one row per case of our provider (the last ``fused*`` one), with every
    provider's p50 of the same case beside it, our speedups, % of copy and % of a same-bytes copy."""
    if fam.ours is None:
        return []

    def case(r: dict) -> tuple:
        return tuple(str(r.get(k)) for k in fam.keys if k != fam.who)

    p50 = {(case(r), r[fam.who]): r.get("p50_us") for r in fam.rows}
    ours = [r for r in fam.rows if r[fam.who] == fam.ours]
    figures = [(f"{w} us", ".1f", 0, (lambda r, w=w: p50.get((case(r), w)))) for w in fam.order]
    figures += speedups(fam, ours) + present({k: KERNEL_METRICS[k] for k in ("pct_of_copy_bw", "pct_of_same_bytes_copy")},
                                             ours)
    saved = fam.keys
    fam.keys = [k for k in fam.keys if k != fam.who]  # one row per case: the provider is in the headers
    try:
        return table(fam, ours, figures, markdown)
    finally:
        fam.keys = saved


def memory_table(fam: Family, markdown: bool) -> list[str]:
    """Modeled bytes per case, and each provider's bytes over ours in the same group."""
    rows = [r for r in fam.rows if "modeled_bytes" in r]
    ours = {}
    for r in rows:
        if r[fam.who] == fam.ours:
            ours[tuple(str(r.get(k)) for k in fam.keys if k != fam.who)] = r["modeled_bytes"]

    def ratio(r):
        o = ours.get(tuple(str(r.get(k)) for k in fam.keys if k != fam.who))
        return o and r["modeled_bytes"] / o

    mb = lambda key: lambda r: r.get(key) and r[key] / 1e6  # noqa: E731
    return table(fam, rows, [("read MB", ".1f", 9, mb("modeled_read_bytes")), ("write MB", ".1f", 9,
                                                                              mb("modeled_write_bytes")),
                             ("total MB", ".1f", 9, mb("modeled_bytes")), ("x fused", ".2f", 7, ratio)], markdown)


def model_table(fam: Family, markdown: bool) -> list[str]:
    """tokens/s, TTFT, TBT, speedups and token agreement (``tokens_match_<backend>``) per end-to-end case."""
    same = [(f"same tokens as {name}", "", 0, lambda r, k=key: None if k not in r else "yes" if r[k] else "no")
            for name, key in named(fam, fam.rows, "tokens_match_")]
    return table(fam, fam.rows, present(MODEL_METRICS, fam.rows) + speedups(fam, fam.rows) + same, markdown)


def model_lines(runs: list[dict], markdown: bool) -> list[str]:
    """One table per run and end-to-end function, each under its run header and source."""
    lines = []
    for run in runs:
        for fam in families(run, "backend"):
            rows = fam.rows
            header, source = run_header(run), Path(run["_path"]).name
            tokens = sorted({str(r["new_tokens"]) for r in rows if "new_tokens" in r})
            per_seq = f"; {'/'.join(tokens)} new tokens per sequence" if tokens else ""
            paired = sorted({(r.get("interleaved_peer", "hf-eager"), r[fam.who]) for r in rows
                             if "interleaved" in r or "interleaved_hf_eager" in r})
            note = [f"x {peer} of {who}: against {peer} rounds interleaved with its own (the two differ by less "
                    "than the drift between cases)" for peer, who in paired]
            clocks = sorted({r["clock"] for r in rows if "clock" in r})
            if clocks:
                worst = max(r.get("max_clock_vs_wall_pct", 0.0) for r in rows)
                note += [f"clock: {'; '.join(clocks)} (largest difference {worst:.3f}%)"]
            if markdown:
                lines += [f"## {fam.title}: {header}", "", f"Source: `{source}`{per_seq}.", "",
                          *model_table(fam, True), "", *note, *([""] if note else [])]
            else:
                lines += [f"# {header}", f"# source: {source}{per_seq}", *model_table(fam, False), *note, ""]
    if not lines:
        msg = "No end-to-end model cases (with a backend) in these runs (bench/bench_gpt2.py saves them)."
        lines = (["## End to end", "", msg, ""] if markdown else [msg, ""])
    return lines


def profile_lines(d: Path) -> tuple[str, list[str]]:
    """Title and summary of `python -m bench.profile`'s output in d: per backend, the layer
    table and the all-kernels total."""
    if not (d / "profile.md").exists():
        return "GPT-2 profile", [f"no profile.md in {d} (python -m bench.profile writes it)"]
    title = (d / "profile.md").read_text().splitlines()[0].removeprefix("# ")
    lines = [f"full tables: {d}/profile.md, layers_<backend>.txt, kernels_<backend>.txt"]
    order = {b: i for i, b in enumerate(BACKENDS)}
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
            if e0 is None or not b["extra_info"].get("provider", "").startswith(OURS_PREFIX):
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


def plot_groups(fam: Family) -> dict[tuple, list[dict]]:
    """Rows per plot: the cases that differ only in provider and the last shape dimension (the x
    axis; a second-to-last dimension equal to it moves with it), at least two x values each."""
    if "shape" not in fam.keys:
        return {}
    groups = defaultdict(list)
    for r in fam.rows:
        s = r["shape"]
        lead = tuple(s[:-2]) + (() if s[-2] == s[-1] else (s[-2],))
        groups[(lead, *[(k, r[k]) for k in fam.keys if k not in ("shape", fam.who)])].append(r)
    return {k: rs for k, rs in groups.items() if len({r["shape"][-1] for r in rs}) > 1}


def plot(fam: Family, out: Path, header: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for (lead, *params), rs in plot_groups(fam).items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for p in fam.order:
            pts = sorted((r["shape"][-1], i, r) for i, r in enumerate(rs) if r[fam.who] == p)
            if not pts:
                continue
            ns = [n for n, _, _ in pts]
            ax1.plot(ns, [r["p50_us"] for *_, r in pts], marker="o", label=p)
            if all("pct_of_copy_bw" in r for *_, r in pts):
                ax2.plot(ns, [r["pct_of_copy_bw"] for *_, r in pts], marker="o", label=p)
            if p == fam.ours and all("same_bytes_copy_us" in r for *_, r in pts):
                ax1.plot(ns, [r["same_bytes_copy_us"] for *_, r in pts], linestyle="--", color="gray",
                         label=f"device copy of {p}'s bytes")
        for ax, ylabel in ((ax1, "p50 latency (us)"), (ax2, "% of copy bandwidth (modeled bytes)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("last shape dimension")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        ax1.set_yscale("log")
        what = " ".join(str(v) if not isinstance(v, bool) else k if v else f"not {k}" for k, v in params)
        shape = ",".join(map(str, lead))
        fig.suptitle(f"{fam.title} [{shape},...] {what}\n" + "\n".join(textwrap.wrap(header, 160)), fontsize=8)
        fig.tight_layout()
        stem = "_".join([fam.name.removeprefix("bench_"), "x".join(map(str, lead)),
                         *(str(v) if not isinstance(v, bool) else k if v else f"not-{k}" for k, v in params)])
        path = out / (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem) + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# The README's comparisons, one per op at its headline case (bench/conftest.py HEADLINE): our provider and
# the peer a user would otherwise call.
# Each op's headline row: ours against the fastest of its peers in the same stored run (PyTorch eager,
# torch.compile, every SDPA backend): the peer a user would otherwise pick.
PEERS = {"bench_scaled_masked_softmax": ("softmax", "fused_v1", ("eager", "compiled", "compiled_iota")),
         "bench_attention": ("attention", "fused_flash", ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")),
         "bench_decode_attention": ("decode_attention", "fused",
                                    ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "compiled")),
         "bench_qkv_decode_attention": ("qkv_decode_attention", "fused", ("eager", "compiled")),
         "bench_layer_norm": ("layer_norm", "fused", ("eager", "compiled")),
         "bench_linear": ("linear", "fused", ("eager", "compiled")),
         "bench_mlp": ("mlp", "fused", ("eager", "compiled")),
         "bench_sample": ("sample", "fused", ("eager", "compiled"))}
GPT2_OURS, GPT2_PEERS = "graph-fused", ("compile-graph", "hf-eager")


def gpu_folder_name(gpu_name: str) -> str:
    """The stored results' folder of a GPU model: "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-")


def newest_cases(folder: Path) -> dict[str, tuple[dict, dict]]:
    """{case: (its benchmark, its run)} from the newest stored run (by datetime) of folder that measured it."""
    cases: dict[str, tuple[dict, dict]] = {}
    for run in sorted(load_runs(sorted(folder.glob("*.json"))), key=lambda r: r.get("datetime", "")):
        for b in run["benchmarks"]:
            cases[b["fullname"]] = (b, run)
    return cases


def _case_id(bench: dict) -> str:
    return bench["name"][len(function_name(bench)) + 1:-1]


def _provider(bench: dict) -> str | None:
    return bench["extra_info"].get("provider") or bench["extra_info"].get("backend")


def _sort_key(function: str, shape: str) -> tuple:
    """GPT-2 first, then the ops in PEERS' order; shapes by their numbers."""
    return (function != "bench_gpt2", list(PEERS).index(function) if function in PEERS else -1,
            [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", shape)])


def headline_rows(results: Path) -> list[dict]:
    """The README table's rows, per stored GPU model: GPT-2 decode at each stored batch of the headline
    cases (ours against compile-graph), then each op's headline case (ours against its peer). Every figure
    is the stored JSON's; ratio is the peer's time over ours (tokens/s: ours over the peer's)."""
    from bench.conftest import is_headline

    rows = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        found: dict[tuple, tuple[dict, dict]] = {}  # (function, provider, case id after the provider)
        for b, run in newest_cases(folder).values():
            if is_headline(function_name(b), _case_id(b)):
                who = _provider(b)
                found[(function_name(b), who, _case_id(b).removeprefix(f"{who}-"))] = (b, run)
        for f, shape in sorted({(f, shape) for f, _, shape in found}, key=lambda t: _sort_key(*t)):
            if f == "bench_gpt2":
                op, ours, peers, metric = "GPT-2 decode", GPT2_OURS, GPT2_PEERS[:1], "tokens_per_s"
            elif f in PEERS:
                (op, ours, peers), metric = PEERS[f], "p50_us"
            else:
                continue
            present = [p for p in peers if (f, p, shape) in found]
            if (f, ours, shape) not in found or not present:
                continue
            peer = min(present, key=lambda p: found[(f, p, shape)][0]["extra_info"][metric])
            (b, run), (pb, _) = found[(f, ours, shape)], found[(f, peer, shape)]
            e, pe = b["extra_info"], pb["extra_info"]
            ratio = e[metric] / pe[metric] if metric == "tokens_per_s" else pe[metric] / e[metric]
            floor = next((e[k] for k in ("pct_of_step_floor", "pct_of_roofline", "pct_of_matmul_peak") if k in e), None)
            rows.append(dict(gpu=run["machine_info"]["fused_attn"]["gpu_name"],
                             commit=str(run.get("commit_info", {}).get("id", "unknown"))[:7],
                             dtype=e.get("dtype", "float16"), op=op, shape=re.sub(r"-b?float\d+", "", shape),
                             metric=metric, ours=ours, ours_value=e[metric], peer=peer, peer_value=pe[metric],
                             ratio=ratio, pct_of_floor=floor, source=Path(run["_path"]).name))
    return rows


def current_rows(rows: list[dict]) -> list[dict]:
    """The README's rows: those of the GPU with the newest stored run (file names start with the run's date),
    so that one table states one GPU's current figures; older GPUs' runs stay in bench/results."""
    if not rows:
        return rows
    newest = max(rows, key=lambda r: r["source"])["gpu"]
    return [r for r in rows if r["gpu"] == newest]


def results_table(rows: list[dict]) -> list[str]:
    """The README's one results table (Markdown)."""
    unit = {"p50_us": "us", "tokens_per_s": "tokens/s"}
    out = ["| GPU | commit | dtype | op | shape | ours | peer | ratio | % of floor |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        floor = "-" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.1f}"
        out.append(f"| {r['gpu']} | {r['commit']} | {r['dtype']} | {r['op']} | {r['shape']} | "
                   f"{r['ours']} {r['ours_value']:g} {unit[r['metric']]} | {r['peer']} {r['peer_value']:g} "
                   f"{unit[r['metric']]} | {r['ratio']:.2f}x | {floor} |")
    out += ["", "ratio: the peer's time over ours (GPT-2: our tokens/s over the peer's); % of floor: GPT-2's share "
            "of the step's bandwidth floor, a kernel's share of its roofline (its bytes at the measured copy "
            "bandwidth; attention: of the measured matmul peak). Written by "
            "`python -m bench.report --readme README.md` from bench/results."]
    return out


def write_readme(path: Path, table: list[str]) -> None:
    """Replace what sits between the results markers of path with the table; refuse when they are missing."""
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path} must hold the markers {BEGIN} and {END} once each, in that order, "
                         f"got {text.count(BEGIN)} and {text.count(END)}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    path.write_text(head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_gpt2(results: Path, out: Path) -> Path:
    """GPT-2 decode tokens/s per batch and GPU: ours (graph-fused), compile-graph, Hugging Face eager and
    the bandwidth floor (ours over its % of the step floor)."""
    from bench.conftest import is_headline

    plt = _pyplot()
    folders = sorted(p for p in results.iterdir() if p.is_dir())
    fig, axes = plt.subplots(1, len(folders), figsize=(5.5 * len(folders), 4.2), squeeze=False)
    for ax, folder in zip(axes[0], folders):
        by = defaultdict(dict)
        gpu = folder.name
        for b, run in newest_cases(folder).values():
            if function_name(b) == "bench_gpt2" and is_headline("bench_gpt2", _case_id(b)):
                e = b["extra_info"]
                by[e["batch"]][e["backend"]] = e
                gpu = run["machine_info"]["fused_attn"]["gpu_name"]
        batches = sorted(by)
        names = [GPT2_OURS, *GPT2_PEERS, "bandwidth floor"]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = []
            for batch in batches:
                e = by[batch].get(GPT2_OURS if name == "bandwidth floor" else name, {})
                if name == "bandwidth floor":
                    vals.append(e["tokens_per_s"] * 100 / e["pct_of_step_floor"] if e.get("pct_of_step_floor") else 0)
                else:
                    vals.append(e.get("tokens_per_s", 0))
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(batches))]
            bars = ax.bar(xs, vals, width, label=name, hatch="//" if name == "bandwidth floor" else None,
                          fill=name != "bandwidth floor")
            ax.bar_label(bars, labels=[f"{v:,.0f}" if v else "" for v in vals], fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (prompt 128, float16)")
        ax.set_title(gpu, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("GPT-2 small decode: fused_attn's captured step (graph-fused) against its peers", fontsize=10)
    fig.tight_layout()
    path = out / "gpt2_decode.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chart_ops(rows: list[dict], out: Path) -> Path:
    """Each op's speedup over its peer at its headline case, per GPU."""
    plt = _pyplot()
    ops = [r for r in rows if r["metric"] == "p50_us"]
    order = [op for op, _, _ in PEERS.values()]
    labels_ = sorted(dict.fromkeys(f"{r['op']}\nvs {r['peer']}" for r in ops),
                     key=lambda lab: order.index(lab.split("\n")[0]))
    gpus = list(dict.fromkeys(r["gpu"] for r in ops))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(labels_)), 4.5))
    width = 0.8 / max(1, len(gpus))
    for i, gpu in enumerate(gpus):
        got = {f"{r['op']}\nvs {r['peer']}": r["ratio"] for r in ops if r["gpu"] == gpu}
        xs = [j + (i - (len(gpus) - 1) / 2) * width for j, lab in enumerate(labels_) if lab in got]
        vals = [got[lab] for lab in labels_ if lab in got]
        bars = ax.bar(xs, vals, width, label=gpu)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in vals], fontsize=7, padding=2)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(labels_)), labels_, fontsize=7)
    ax.set_ylabel("speedup over the peer (p50 device time)")
    ax.set_title("fused_attn ops at their headline case (float16, GPT-2 shapes, batch 16 where there is one; "
                 "shapes in the README's table)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "ops_speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def headline(results: Path, charts: Path, readme: Path | None) -> tuple[list[Path], list[str]]:
    """The charts (into charts) and, when readme is given, its results table; returns the files written
    and the table."""
    rows = current_rows(headline_rows(results))
    if not rows:
        raise ValueError(f"{results} must hold stored runs with headline cases (bench/results/<GPU>/*.json), got none")
    table = results_table(rows)
    if readme is not None:
        write_readme(readme, table)  # first: a README without markers writes nothing at all
    charts.mkdir(parents=True, exist_ok=True)
    written = [chart_gpt2(results, charts), chart_ops(rows, charts)]
    return written + ([readme] if readme is not None else []), table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path,
                    help="pytest-benchmark JSON files (tables and plots of each); none: the headline charts and "
                         "table from the newest stored runs (--results)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write into")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the stored runs, one folder per GPU model")
    ap.add_argument("--charts", type=Path, help="where the headline charts go (gpt2_decode.png, ops_speedup.png; "
                                                "default --out)")
    ap.add_argument("--readme", type=Path, help=f"write the results table between {BEGIN} and {END} of this file")
    ap.add_argument("--bytes", type=Path, help="output of `python -m bench.bytes` to include")
    ap.add_argument("--profile", type=Path, help="directory written by `python -m bench.profile` to summarize")
    ap.add_argument("--no-plots", action="store_true", help="skip the plots (matplotlib)")
    args = ap.parse_args(argv)
    if not args.runs:
        try:
            written, table = headline(args.results, args.charts or args.out, args.readme)
        except (OSError, ValueError) as e:
            ap.exit(2, f"{ap.prog}: error: {_file_error(e)}\n")
        print("\n".join([*table, "", *(f"report: wrote {p}" for p in written)]))
        return 0
    try:
        runs = load_runs(args.runs)
        if args.bytes:
            args.bytes.read_text()
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        ap.exit(2, f"{ap.prog}: error: {_file_error(e)}\n")
    args.out.mkdir(parents=True, exist_ok=True)

    micro, memory, md = [], [], ["# fused_attn benchmark report", ""]
    readme = ["<!-- python -m bench.report: one table per benchmark function, our provider's cases -->", ""]
    pngs = []
    for run in runs:
        header, source = run_header(run), Path(run["_path"]).name
        fams = families(run, "provider")
        if not fams:
            none = [f"# {header}", f"# source: {source}", "No kernel cases (with a provider) in this run.", ""]
            micro, memory = micro + none, memory + none
            continue
        for fam in fams:
            micro += [f"# {fam.title}: {header}", f"# source: {source}", *micro_table(fam, False), ""]
            md += [f"## {fam.title}: {header}", "", f"Source: `{source}`", "", *micro_table(fam, True), ""]
            if fam.ours is not None:
                readme += [f"**{fam.title}** (`{fam.ours}`; {header}; source `{source}`)", "",
                           *summary_table(fam, True), ""]
            if any("modeled_bytes" in r for r in fam.rows):
                memory += [f"# {fam.title}: {header} (modeled bytes)", f"# source: {source}",
                           *memory_table(fam, False), ""]
                md += ["### Bytes moved (modeled)", "", *memory_table(fam, True), ""]
        if not args.no_plots and not pngs:  # plots of the first run with kernel cases
            for fam in fams:
                pngs += plot(fam, args.out, header)
    if args.bytes:
        measured = args.bytes.read_text().rstrip().splitlines()
        memory += ["# measured with Nsight Compute (python -m bench.bytes)", *measured, ""]
        md += ["### Bytes moved (measured, Nsight Compute)", "", "```", *measured, "```", ""]
    spread = spread_lines(runs)
    if spread:
        micro += spread + [""]
        md += ["### Run-to-run spread", "", "```", *spread, "```", ""]
    models = model_lines(runs, False)
    md += model_lines(runs, True)
    if args.profile:
        title, prof = profile_lines(args.profile)
        models += [f"# {title}", *prof, ""]
        md += [f"## {title}", "", "```", *prof, "```", ""]
    if pngs:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    (args.out / "micro.txt").write_text("\n".join(micro) + "\n")
    (args.out / "memory.txt").write_text("\n".join(memory) + "\n")
    (args.out / "gpt2.txt").write_text("\n".join(models))
    (args.out / "report.md").write_text("\n".join(md))
    (args.out / "readme.md").write_text("\n".join(readme))
    print(f"report: {args.out} ({len(pngs)} plots)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
