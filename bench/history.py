"""One aggregate table of every benchmark run: bench/results/history.csv.gz, one row per case.

    python -m bench.history add RUN.json [RUN.json ...] --csv bench/results/history.csv.gz [--note TEXT]
    python -m bench.history add-ab AB.txt --commit C --gpu "NVIDIA H200" --csv ... [--note TEXT]
    python -m bench.history add-generate GEN.txt --commit C --gpu "NVIDIA H200" --csv ... [--note TEXT]
    python -m bench.history store RUN.json [RUN.json ...] --results bench/results [--note TEXT]

``store`` is how a GPU run enters the repository: its rows go into RESULTS/history.csv.gz, and the run
is written as one file per suite part (bench file) under RESULTS/<GPU>/, named
``<date>T<hhmm>_<commit>_<part>.json`` (stats without the per-round samples, machine_info without what
changes from run to run); then every stored file of that GPU and part whose cases all have a newer
measurement in a newer file is deleted (its rows are in the table, its bytes in git history).

The newest run per GPU model stays a pytest-benchmark JSON under bench/results/<GPU>/ (what
``--benchmark-compare`` and ``bench.gate`` read); every run, that one included, also becomes rows
here, so that the older JSONs, A/B outputs and logs need not be kept. Columns: commit, gpu,
run (its datetime), source (file name), op (the benchmark function without ``bench_``, or
``generate``), case (the pytest-benchmark group, e.g. ``softmax 8x12x1024x1024 float16 causal``),
provider (or GPT-2 backend; an A/B variant as ``ab [variant]``, in the older softmax tables ``fused_v1 [variant]``), the figures of
bench.report's KERNEL_METRICS and MODEL_METRICS that the case has (p50_us and the other
percentiles for kernels: device time; tokens/s, TTFT and TBT for models), every
``speedup_vs_<provider>`` and ``tokens_match_<backend>``. A column that a new run brings is added
(the whole table is rewritten in one column order). Adding a file whose (source, run) is already in the
table adds nothing. A run's note (--note) is written once, not on every row: to the notes table beside
the table (source, run, note), named after the table without .gz: history.notes.csv beside history.csv.gz or
history.csv. The tables are written only where --csv says.

A table named *.csv.gz is the CSV text gzipped (an eighth of the bytes), written with no file name or time in
the gzip header, so that the same table is the same bytes; a *.csv table is plain text. Adding to X.csv.gz
moves the rows of a plain X.csv beside it into it and removes X.csv (a checkout from before the table was
gzipped); adding to X.csv while X.csv.gz exists is refused (the rows would go into a second table).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
import zlib
from datetime import datetime, timezone
from pathlib import Path

from bench.report import KERNEL_METRICS, MODEL_METRICS, _file_error, function_name, load_run, load_runs

KEYS = ["commit", "gpu", "run", "source", "op", "case", "provider"]
STABLE_MACHINE_KEYS = ("system", "machine", "python_implementation", "python_version")
FIGURES = list(KERNEL_METRICS) + list(MODEL_METRICS)
PATTERNS = ("speedup_vs_", "tokens_match_")
TABLE = "history.csv.gz"  # the table's name in a results folder (store)


def stable_machine_info(machine_info: dict) -> dict:
    """pytest-benchmark's machine_info without what changes between runs on the same kind of machine (host
    name, kernel release, CPU flags and clock, Python build date, our commit): `--benchmark-compare` warns,
    printing both dicts whole (3 KB), whenever the stored run's machine_info differs from this run's."""
    out = {k: machine_info[k] for k in STABLE_MACHINE_KEYS if k in machine_info}
    fa = dict(machine_info.get("fused_attn", {}))
    fa.pop("commit", None)
    return out | {"fused_attn": fa}


def host_info(machine_info: dict) -> dict:
    """The per-run facts stable_machine_info leaves out, kept in commit_info["host"]."""
    cpu = machine_info.get("cpu", {})
    return {"node": machine_info.get("node"), "release": machine_info.get("release"),
            "cpu": cpu.get("brand_raw"), "cpu_count": cpu.get("count"), "cpu_hz": cpu.get("hz_actual_friendly")}


def run_commit(run: dict) -> str:
    """The short commit a run measured (older runs name it in machine_info, newer ones in commit_info only)."""
    return run.get("machine_info", {}).get("fused_attn", {}).get("commit") or str(
        run.get("commit_info", {}).get("id", "unknown"))[:7]


def run_rows(run: dict, note: str = "") -> list[dict]:
    """One row per case of a pytest-benchmark run (and one for hf-eager rounds interleaved with a case's)."""
    mi = run.get("machine_info", {}).get("fused_attn", {})
    commit = run_commit(run)
    if run.get("commit_info", {}).get("dirty"):
        commit += "+dirty"
    base = dict(commit=commit, gpu=mi.get("gpu_name", "unknown"), run=run.get("datetime", ""),
                source=run.get("stored_from") or Path(run["_path"]).name, note=note)
    rows = []
    for b in run["benchmarks"]:
        e = b.get("extra_info", {})
        who = e.get("provider") or e.get("backend")
        if who is None:
            continue
        row = base | dict(op=function_name(b).removeprefix("bench_"), case=b.get("group") or b["name"], provider=who)
        row |= {k: v for k, v in e.items() if k in FIGURES or k.startswith(PATTERNS)}
        rows.append(row)
        peer, figures = interleaved(e)
        if figures is not None:
            rows.append(row | {k: None for k in row if k in FIGURES or k.startswith(PATTERNS)}
                        | dict(provider=f"{peer} (interleaved with {who})") | figures)
    return rows


def interleaved(extra_info: dict) -> tuple[str | None, dict | None]:
    """The peer a case was timed against in interleaved rounds and its figures (None, None if none):
    ``interleaved_peer`` + ``interleaved``, or the older runs' ``interleaved_hf_eager``."""
    if isinstance(extra_info.get("interleaved"), dict):
        return extra_info.get("interleaved_peer", "peer"), extra_info["interleaved"]
    if isinstance(extra_info.get("interleaved_hf_eager"), dict):
        return "hf-eager", extra_info["interleaved_hf_eager"]
    return None, None


AB_CELL = re.compile(r"([\d.]+) \(\s*([\d.]+)%?(?:/\s*([\d.]+)%)?\)(?: \[[^\]]*\])?")


def _file_time(path: Path) -> str:
    """When a text output was written (its modification time): the run of rows that carry no datetime."""
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()


def ab_rows(path: Path, commit: str, gpu: str, note: str = "") -> list[dict]:
    """Rows of a `python -m bench.ab` table, one per (case, variant). The table bench.ab prints: a "case" header
    (each variant's "<name> us", "(x default)" past the first), one line a case (a pytest case's name, or the case of
    a "<case>: <us> us" line), the medians in us (a variant's ratio to the default's after it, "-" where it did not
    run) and a last "exit status / last line" row; op is the benchmark function without ``bench_``, provider ``ab
    [variant]``. The older softmax-only table (a "shape" header, p50 (% of copy)) reads as ``fused_v1 [variant]``."""
    lines = path.read_text().splitlines()
    try:
        head = next(i for i, ln in enumerate(lines) if ln.startswith(("case ", "shape ")))
    except StopIteration:
        raise ValueError(f"{path} must hold a bench.ab table (a line starting 'case' or 'shape'), got none") from None
    if lines[head].startswith("case "):
        return _case_table_rows(path, lines, head, commit, gpu, note)
    variants = re.split(r"\s{2,}", lines[head].strip())[1:]
    variants = [v for v in variants if v != "same-bytes copy us"]
    dtype = "float16" if "float16" in lines[0] else "?"
    rows = []
    for ln in lines[head + 1:]:
        m = re.match(r"(\d+(?:x\d+)+)( c)?\s", ln)
        cells = AB_CELL.findall(ln)
        if not m or len(cells) != len(variants):
            continue
        case = f"softmax {m.group(1)} {dtype} {'causal' if m.group(2) else 'full'}"
        for variant, (p50, pct, roof) in zip(variants, cells):
            rows.append(dict(commit=commit, gpu=gpu, run=_file_time(path), source=path.name, op="scaled_masked_softmax", case=case,
                             provider=f"fused_v1 [{variant}]", p50_us=float(p50), pct_of_copy_bw=float(pct),
                             pct_of_roofline=float(roof) if roof else None, note=note))
    return rows


def _case_table_rows(path: Path, lines: list[str], head: int, commit: str, gpu: str, note: str) -> list[dict]:
    names = [re.sub(r" us(?: \(x default\))?$", "", c) for c in re.split(r"\s{2,}", lines[head].strip())[1:]]
    rows = []
    for ln in lines[head + 1:]:
        if ln.startswith("exit status / last line"):
            break
        cells = re.split(r"\s{2,}", ln.strip())
        if len(cells) != len(names) + 1:
            continue
        case = cells[0]
        m = re.match(r"bench_(\w+)\[", case)
        for name, cell in zip(names, cells[1:]):
            if cell == "-":
                continue
            rows.append(dict(commit=commit, gpu=gpu, run=_file_time(path), source=path.name,
                             op=m.group(1) if m else "bench.ab", case=case, provider=f"ab [{name}]",
                             p50_us=float(cell.split()[0]), note=note))
    if not rows:
        raise ValueError(f"{path} holds a bench.ab table with no case measured")
    return rows


GEN_LINE = re.compile(r"(\S+)\s+TTFT\s+([\d.]+) ms\s+TBT p50\s+([\d.]+) ms\s+p95\s+([\d.]+) ms\s+([\d.]+) tokens/s")


def generate_rows(path: Path, commit: str, gpu: str, note: str = "") -> list[dict]:
    """Rows of a `python -m fused_attn.generate --compare` printout: one per backend."""
    text = path.read_text()
    head = text.splitlines()[0] if text else ""
    rows = [dict(commit=commit, gpu=gpu, run=_file_time(path), source=path.name, op="generate", case=head, provider=m[0],
                 ttft_ms=float(m[1]), tbt_p50_ms=float(m[2]), tbt_p95_ms=float(m[3]), tokens_per_s=float(m[4]),
                 note=note) for m in GEN_LINE.findall(text)]
    if not rows:
        raise ValueError(f"{path} must hold `python -m fused_attn.generate` timing lines, got none")
    return rows


def columns(keys: set[str]) -> list[str]:
    """The table's columns in one order whatever the runs: keys, figures, speedups and token matches
    by name, other columns a run brought (not the note: notes_path)."""
    cols = KEYS + [k for k in FIGURES if k in keys]
    for prefix in PATTERNS:
        cols += sorted(k for k in keys if k.startswith(prefix))
    return cols + sorted(keys - set(cols) - {"note"})


NOTE_KEYS = ["source", "run", "note"]


def _check_name(csv_path: Path) -> None:
    if not csv_path.name.endswith((".csv", ".csv.gz")):
        raise ValueError(f"a history table's name must end in .csv or .csv.gz, got {csv_path.name}")


def plain_twin(csv_path: Path) -> Path:
    """The plain table a .csv.gz table replaces: history.csv.gz -> history.csv."""
    return csv_path.with_name(csv_path.name.removesuffix(".gz"))


def plain_to_move(csv_path: Path) -> Path | None:
    """The plain table that adding to csv_path moves into it: a .csv.gz table's plain twin, where one exists."""
    twin = plain_twin(csv_path)
    return twin if csv_path.name.endswith(".gz") and twin.exists() else None


def notes_path(csv_path: Path) -> Path:
    """The notes table of a history table: history.csv.gz or history.csv -> history.notes.csv (plain CSV, one
    name for both, so that gzipping the table leaves it where it was). One row per (source, run) with a note;
    the note on every row of its run was 30% of the table's bytes."""
    _check_name(csv_path)
    return plain_twin(csv_path).with_suffix(".notes.csv")


def read_table(csv_path: Path) -> tuple[list[str], list[dict]]:
    """(columns, rows) of a history table, through gzip for a .csv.gz one; ([], []) where there is none."""
    _check_name(csv_path)
    if not csv_path.exists():
        return [], []
    opener = gzip.open if csv_path.name.endswith(".gz") else open
    try:
        with opener(csv_path, "rt", encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            return list(reader.fieldnames or []), list(reader)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{csv_path} must be gzipped CSV text, got {type(e).__name__}: {e}") from None


def write_table(csv_path: Path, text: str) -> None:
    """Write a table's CSV text, gzipped for a .csv.gz one with no name and time 0 in the header: the same
    table, the same bytes (git then sees no change where no row changed)."""
    _check_name(csv_path)
    data = text.encode("utf-8")
    if csv_path.name.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as f:
            f.write(data)
        data = buf.getvalue()
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path.write_bytes(data)


def read_notes(csv_path: Path) -> dict[tuple[str, str], str]:
    """{(source, run): note} of a history table (empty without a notes table)."""
    path = notes_path(csv_path)
    if not path.exists():
        return {}
    with path.open(encoding="utf-8", newline="") as f:
        return {(r["source"], r["run"]): r["note"] for r in csv.DictReader(f)}


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def add(csv_path: Path, rows: list[dict]) -> int:
    """Append rows to the table (creating it), skipping (source, run) pairs already there, their runs' notes to
    its notes table; returns rows added. A table that still holds a note column has it moved out; a .csv.gz
    table takes in the rows of its plain twin, which is then removed."""
    existing, old = read_table(csv_path)
    gz, twin = csv_path.name.endswith(".gz"), csv_path.with_name(csv_path.name + ".gz")
    if not gz and twin.exists():
        raise ValueError(f"the table must be {twin}, the gzipped table already there, got {csv_path}")
    moved = plain_to_move(csv_path)
    if moved:
        cols, plain = read_table(moved)
        seen = {(r["source"], r["run"]) for r in old}
        existing += [c for c in cols if c not in existing]
        old += [r for r in plain if (r["source"], r["run"]) not in seen]
    notes = read_notes(csv_path)
    seen = {(r["source"], r["run"]) for r in old}
    new = [r for r in rows if (r["source"], r["run"]) not in seen]
    for r in old + new:
        note = r.pop("note", None)
        if note:
            notes.setdefault((r["source"], r["run"]), note)
    cols = columns(set(existing) | {k for r in new for k in r})
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(old)
    w.writerows({c: _cell(r.get(c)) for c in cols} for r in new)
    write_table(csv_path, text.getvalue())
    if moved:
        moved.unlink()
    if notes:
        with notes_path(csv_path).open("w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=NOTE_KEYS, lineterminator="\n")
            w.writeheader()
            w.writerows(dict(source=s, run=r, note=n) for (s, r), n in notes.items())
    return len(new)


def part_name(bench: dict) -> str:
    """The suite part of a case: its bench file without ``bench_`` ("bench/bench_gpt2.py::..." -> "gpt2")."""
    return Path(bench["fullname"].split("::")[0]).stem.removeprefix("bench_")


def gpu_folder(gpu_name: str) -> str:
    """The folder name of a GPU model: "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-")


def split_run(run: dict) -> dict[str, dict]:
    """{stored file name: run of one suite part}: the cases of each bench file, per-round samples dropped
    (nothing reads them back; they were half of every stored byte), machine_info made stable."""
    when = datetime.fromisoformat(run["datetime"]).strftime("%Y-%m-%dT%H%M")
    parts: dict[str, list] = {}
    for b in run["benchmarks"]:
        stats = {k: v for k, v in b["stats"].items() if k != "data"}
        parts.setdefault(part_name(b), []).append(b | {"stats": stats})
    mi = run.get("machine_info", {})
    commit_info = dict(run.get("commit_info", {}))
    commit_info.setdefault("host", host_info(mi))
    if not str(commit_info.get("id", "")).startswith(run_commit(run)):
        commit_info["id"] = run_commit(run)  # older runs: the tree measured was named in machine_info only
    named = re.match(r"\d{4}_([0-9a-f]{7})_", run.get("stored_from") or Path(run["_path"]).name)
    if named and commit_info.get("source") != "FUSED_ATTN_COMMIT":
        commit_info["id"] = named[1]  # runs saved before FUSED_ATTN_COMMIT: the file name carries the tree
    keep = {k: v for k, v in run.items() if k not in ("_path", "benchmarks", "machine_info", "commit_info")}
    source = run.get("stored_from") or Path(run["_path"]).name
    return {f"{when}_{commit_info['id'][:7]}_{part}.json": keep | dict(machine_info=stable_machine_info(mi),
                                                                  commit_info=commit_info, stored_from=source,
                                                                  benchmarks=benches)
            for part, benches in parts.items()}


def prune(folder: Path) -> list[Path]:
    """Delete each stored file whose every case a newer stored file holds; returns the deleted files. A file
    with a case no newer run measured stays whole (a run of some shapes of a suite part, the long-context
    decode cases say, leaves the part's other shapes where they were). The deleted files' rows are in
    the history table, their bytes in git history."""
    runs = sorted(((r.get("datetime", ""), p, r) for p in folder.glob("*.json") for r in [load_run(p)]),
                  key=lambda t: t[0], reverse=True)
    seen: set = set()
    gone = []
    for _, path, run in runs:
        cases = {b["fullname"] for b in run["benchmarks"]}
        if cases <= seen:
            path.unlink()
            gone.append(path)
        seen |= cases
    return gone


def store(files: list[Path], results: Path, note: str = "") -> tuple[int, list[Path], list[Path]]:
    """Rows of every run into results/history.csv.gz (a plain results/history.csv moved into it), then each
    run's parts into results/<GPU>/, then prune. Returns (rows added, files written, files deleted)."""
    runs = load_runs(files)
    added = add(results / TABLE, [r for run in runs for r in run_rows(run, note)])
    written, folders = [], set()
    for run in runs:
        folder = results / gpu_folder(run.get("machine_info", {}).get("fused_attn", {}).get("gpu_name", "unknown"))
        folder.mkdir(parents=True, exist_ok=True)
        folders.add(folder.resolve())
        for name, part in split_run(run).items():
            (folder / name).write_text(json.dumps(part, separators=(",", ":")) + "\n")
            written.append((folder / name).resolve())
    gone = []
    for old in files:  # a run stored from inside a results folder is replaced by its parts
        if old.resolve().parent in folders and old.resolve() not in written:
            old.unlink()
            gone.append(old)
    for folder in sorted(folders):
        gone += prune(folder)
    return added, written, gone


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    runs = sub.add_parser("add", help="pytest-benchmark JSON runs")
    runs.add_argument("files", nargs="+", type=Path)
    runs.add_argument("--commit", help="the commit of runs that name none ('unknown')")
    for name, what in (("add-ab", "`python -m bench.ab` tables"), ("add-generate", "`fused_attn.generate` printouts")):
        p = sub.add_parser(name, help=what)
        p.add_argument("files", nargs="+", type=Path)
        p.add_argument("--commit", required=True)
        p.add_argument("--gpu", required=True, help='GPU name as torch gives it, e.g. "NVIDIA H200"')
    for p in sub.choices.values():
        p.add_argument("--csv", type=Path, required=True,
                       help="the table to append to (bench/results/history.csv.gz; .csv: plain text)")
        p.add_argument("--note", default="", help="a short note on the run (the table's notes file)")
    st = sub.add_parser("store", help="pytest-benchmark JSON runs into the stored results")
    st.add_argument("files", nargs="+", type=Path)
    st.add_argument("--results", type=Path, required=True, help="the stored results folder (bench/results)")
    st.add_argument("--note", default="", help="a short note on the run (history.notes.csv)")
    args = ap.parse_args(argv)
    table = args.results / TABLE if args.cmd == "store" else args.csv
    plain = plain_to_move(table)  # looked at before add() moves it
    if args.cmd == "store":
        try:
            added, written, gone = store(args.files, args.results, args.note)
        except (OSError, ValueError) as e:
            ap.exit(2, f"{ap.prog} store: error: {_file_error(e)}\n")
        if plain:
            print(f"{plain}: its rows moved into {table.name}, the plain table removed")
        print(f"{table}: {added} rows added; wrote {len(written)} files, deleted {len(gone)}")
        for p in written:
            print(f"  + {p}")
        for p in gone:
            print(f"  - {p}")
        return 0
    try:
        if args.cmd == "add":
            rows = [r for run in load_runs(args.files) for r in run_rows(run, args.note)]
            if args.commit:
                rows = [r | dict(commit=args.commit) if r["commit"].startswith("unknown") else r for r in rows]
        else:
            parse = ab_rows if args.cmd == "add-ab" else generate_rows
            rows = [r for f in args.files for r in parse(f, args.commit, args.gpu, args.note)]
        added = add(args.csv, rows)
    except (OSError, ValueError) as e:
        ap.exit(2, f"{ap.prog} {args.cmd}: error: {_file_error(e)}\n")
    if plain:
        print(f"{plain}: its rows moved into {table.name}, the plain table removed")
    print(f"{args.csv}: {added} rows added ({len(rows) - added} already there)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
