"""Regression gate of the GPU workflow: a new benchmark run against the newest stored run of the same GPU.

    python -m bench.gate NEW.json [--baseline OLD.json | --storage bench/results] [--threshold 10]
                                  [--host-bound-threshold 50]

Fails (exit 1) when a case's median grew by more than --threshold percent over the baseline's,
listing every such case. Host-bound cases (GPT-2 through transformers' eager Python loop:
HOST_BOUND backends, ~6.5 ms of Python per token; the cases timed on the host clock) measure the host more
than our kernels: the
same case drifted by 15% between sequential runs on an H200 and by up to 38% between runs on an
H100 host (docs/lab-notes/gpt2-decode.md), so they have their own threshold, wide enough for that drift and
still failing on a 2x regression (e.g. a sync per layer). Cases new in this run (no baseline
case of the same name) are listed, not gated. Without --baseline, each case's baseline is the
newest run under --storage (by its datetime) on the same GPU model that holds that case, other
than NEW itself and its autosaved copy: stored runs may hold part of the suite (one op's cases,
the GPT-2 cases), and each case is held to the last run that measured it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import _file_error, load_run

HOST_BOUND = ("hf-eager", "hf-sdpa", "hf-fused")


def gpu_name(run: dict) -> str | None:
    return run.get("machine_info", {}).get("fused_attn", {}).get("gpu_name")


def stored_runs(new: dict, storage: Path) -> list[tuple[str, Path, dict]]:
    """(datetime, path, run) of every stored run on new's GPU model other than new itself, newest first."""
    runs = []
    for path in storage.rglob("*.json"):
        try:
            run = load_run(path)
        except (ValueError, json.JSONDecodeError):
            continue
        if gpu_name(run) != gpu_name(new) or run.get("datetime") == new.get("datetime"):
            continue
        runs.append((run.get("datetime", ""), path, run))
    return sorted(runs, key=lambda r: r[0], reverse=True)


def per_case_baseline(new: dict, storage: Path) -> tuple[dict, list[Path]]:
    """A baseline run whose every case is the newest stored measurement of it; and the files used."""
    cases, used = {}, []
    for _, path, run in stored_runs(new, storage):
        took = False
        for b in run["benchmarks"]:
            if b["fullname"] not in cases:
                cases[b["fullname"]] = b
                took = True
        if took:
            used.append(path)
    return {"benchmarks": list(cases.values())}, used


def is_host_bound(bench: dict) -> bool:
    """GPT-2 through transformers' Python loop, and the cases timed on the host clock (bench_host's calls,
    bench_hf_prefill's time to first token: the same case drifted 12% between two H200 runs of one day)."""
    e = bench.get("extra_info", {})
    return e.get("backend") in HOST_BOUND or str(e.get("clock", "")).startswith("host clock")


def compare(new: dict, base: dict, threshold: float, host_threshold: float) -> tuple[list[str], list[str]]:
    """(regressions, new case names): one line per case whose median grew past its threshold (%)."""
    old = {b["fullname"]: b for b in base["benchmarks"]}
    regressions, added = [], []
    for b in new["benchmarks"]:
        o = old.get(b["fullname"])
        if o is None:
            added.append(b["fullname"])
            continue
        limit = host_threshold if is_host_bound(b) else threshold
        growth = 100 * (b["stats"]["median"] / o["stats"]["median"] - 1)
        if growth > limit:
            regressions.append(f"{growth:+7.1f}% (limit {limit:g}%) {b['fullname']}: median "
                               f"{o['stats']['median'] * 1e6:.2f} -> {b['stats']['median'] * 1e6:.2f} us")
    return regressions, added


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("new", type=Path, help="pytest-benchmark JSON of this run")
    ap.add_argument("--baseline", type=Path, help="stored run to compare with (default: newest under --storage)")
    ap.add_argument("--storage", type=Path, default=Path(__file__).resolve().parent / "results",
                    help="stored runs, one folder per GPU model")
    ap.add_argument("--threshold", type=float, default=10.0, help="percent median growth that fails a case")
    ap.add_argument("--host-bound-threshold", type=float, default=50.0,
                    help=f"the same for host-bound cases (GPT-2 backends {', '.join(HOST_BOUND)})")
    args = ap.parse_args(argv)
    try:
        new = load_run(args.new)
        if args.baseline:
            base, used = load_run(args.baseline), [args.baseline]
        else:
            base, used = per_case_baseline(new, args.storage)
        if not used:
            print(f"no stored run on {gpu_name(new)} under {args.storage}: nothing to compare with")
            return 0
    except (OSError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: {_file_error(e)}\n")
    baseline = ", ".join(str(p) for p in used)
    regressions, added = compare(new, base, args.threshold, args.host_bound_threshold)
    print(f"{args.new} against {baseline}: {len(new['benchmarks']) - len(added)} cases compared, "
          f"{len(added)} new, {len(regressions)} regressed (limits {args.threshold:g}%, host-bound "
          f"{args.host_bound_threshold:g}%)")
    for line in regressions:
        print("  " + line)
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
