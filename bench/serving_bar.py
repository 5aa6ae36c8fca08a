"""decode_attention's serving bar, read from bench_decode_attention runs (pytest-benchmark JSON).

    python -m bench.serving_bar bench/results/NVIDIA-H200/*_decode_attention.json

For every long case (a cache of at least LONG_MIN_KEYS keys) of each mode (eager calls, or the *_graph providers
captured in a CUDA graph) and dtype: ours (`fused`) against the better of SDPA's flash and cuDNN backends measured
in the same run (at or above: ratio >= 1), and the paged cache against the contiguous one (within PAGED_WITHIN).
Prints, per mode, how many cases meet each bar and the cases that do not, worst first. Reads only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

LONG_MIN_KEYS = 8192
PAGED_WITHIN = 1.03  # paged / contiguous time at most this
SDPA_PEERS = ("sdpa_flash", "sdpa_cudnn")
GRAPH_SUFFIX = "_graph"


@dataclass(frozen=True)
class Case:
    mode: str  # "eager" or "graph"
    dtype: str
    shape: tuple[int, ...]  # [B, Hq, Hkv, D, L]

    def name(self) -> str:
        b, hq, hkv, d, n = self.shape
        return f"B{b} {hq}/{hkv} D{d} {n // 1024}k {self.dtype}"


def load(paths: list[Path]) -> dict[Case, dict[str, float]]:
    """p50 (us) by case and provider (the *_graph suffix dropped, the mode in the case), long cases only."""
    cases: dict[Case, dict[str, float]] = {}
    for path in paths:
        try:
            runs = json.loads(path.read_text())["benchmarks"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"runs must be pytest-benchmark JSON files, got {str(path)!r} ({e})") from None
        for bench in runs:
            info = bench.get("extra_info", {})
            if not {"provider", "shape", "dtype", "p50_us"} <= info.keys() or len(info["shape"]) != 5:
                continue  # not a bench_decode_attention case
            provider = info["provider"]
            mode = "graph" if provider.endswith(GRAPH_SUFFIX) else "eager"
            case = Case(mode, info["dtype"], tuple(info["shape"]))
            if case.shape[-1] >= LONG_MIN_KEYS:
                cases.setdefault(case, {})[provider.removesuffix(GRAPH_SUFFIX)] = float(info["p50_us"])
    if not cases:
        raise ValueError(f"runs must hold bench_decode_attention cases of at least {LONG_MIN_KEYS} keys, got none "
                         f"in {[str(p) for p in paths]}")
    return cases


def report(cases: dict[Case, dict[str, float]]) -> str:
    lines = []
    for mode in ("eager", "graph"):
        mine = {c: t for c, t in cases.items() if c.mode == mode}
        sdpa = {c: min(t[p] for p in SDPA_PEERS if p in t) / t["fused"] for c, t in mine.items()
                if "fused" in t and any(p in t for p in SDPA_PEERS)}
        paged = {c: t["paged"] / t["fused"] for c, t in mine.items() if "fused" in t and "paged" in t}
        if not sdpa and not paged:
            continue
        below = sorted((r, c.name()) for c, r in sdpa.items() if r < 1.0)
        outside = sorted(((r, c.name()) for c, r in paged.items() if r > PAGED_WITHIN), reverse=True)
        lines.append(f"{mode}: at or above the better SDPA backend in {len(sdpa) - len(below)} of {len(sdpa)}; "
                     f"paged within {PAGED_WITHIN - 1:.0%} of contiguous in {len(paged) - len(outside)} of "
                     f"{len(paged)}")
        lines += [f"  below SDPA   {r:.4f}x  {name}" for r, name in below]
        lines += [f"  paged        {r:.4f}x  {name}" for r, name in outside]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_decode_attention pytest-benchmark JSON files")
    args = ap.parse_args(argv)
    try:
        print(report(load(args.runs)))
    except ValueError as e:
        print(f"bench.serving_bar: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
