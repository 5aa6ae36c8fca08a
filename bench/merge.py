"""Merge pytest-benchmark JSON files of one commit on one GPU into one stored run.

    python -m bench.merge OUT.json RUN1.json RUN2.json ...

bench/run_gpu.sh runs the suite as several pytest invocations (one per step), so one
`python -m bench.gate` or `python -m bench.report` call can read them as one run: benchmarks
concatenated in order, machine and commit info from the first part, and a
`merged_from` list naming each part with its own datetime. (Storing a run is
`python -m bench.history store`, which takes the parts as they are.) Refuses parts from different
commits or GPU models, and duplicate benchmark names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(parts: list[Path]) -> dict:
    runs = [json.loads(p.read_text()) for p in parts]
    first = runs[0]
    key = lambda r: (r["commit_info"].get("id"), r["machine_info"].get("fused_attn", {}).get("gpu_name"))  # noqa: E731
    for p, r in zip(parts, runs):
        if key(r) != key(first):
            raise ValueError(f"{p} must have commit and GPU {key(first)}, got {key(r)}")
    names: set[str] = set()
    benchmarks = []
    for p, r in zip(parts, runs):
        for b in r["benchmarks"]:
            if b["fullname"] in names:
                raise ValueError(f"{p}: benchmark {b['fullname']} is already in an earlier part")
            names.add(b["fullname"])
            benchmarks.append(b)
    out = dict(first)
    out["benchmarks"] = benchmarks
    out["merged_from"] = [dict(file=p.name, datetime=r.get("datetime"), benchmarks=len(r["benchmarks"]))
                          for p, r in zip(parts, runs)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the merged run to write (OUT.json)")
    ap.add_argument("parts", type=Path, nargs="+", help="pytest-benchmark JSON files of one commit on one GPU")
    args = ap.parse_args(argv)
    out, parts = args.out, args.parts
    out.write_text(json.dumps(merge(parts), separators=(",", ":")) + "\n")  # compact: stored in git
    print(f"{out}: {sum(len(json.loads(p.read_text())['benchmarks']) for p in parts)} benchmarks from {len(parts)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
