"""What the GPU's clocks did during a benchmark run, from nvidia-smi's one-second samples.

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
        --format=csv,noheader -lms 1000 > clocks.csv &        # beside the run (bench/run_gpu.sh does)
    python -m bench.clocks clocks.csv                          # one paragraph: busy samples, SM clock, throttling

At the read peak the ratio of two providers a few percent apart is decided by run conditions: a software power cap
holding the SM clock at 1860-1965 MHz for a second, landing on one provider's rounds, is the size of the gap (H200,
2026-11-30, docs/lab-notes/decode-attention.md). The summary says whether a run had such seconds. It reads and
prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# nvidia-smi's clocks_throttle_reasons.active bits (nvidia-smi --help-query-gpu).
REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
COLUMNS = 6  # timestamp, clocks.sm, clocks.mem, power.draw, temperature.gpu, clocks_throttle_reasons.active


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    power_w: float
    temperature_c: float
    reasons: int


def _number(field: str, unit: str, line: str) -> float:
    text = field.strip().removesuffix(unit).strip()
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"clocks line must hold numbers in {unit or 'plain'} units, got {field.strip()!r} in "
                         f"{line!r}") from None


def parse(text: str) -> list[Sample]:
    """The samples of nvidia-smi's ``--format=csv,noheader`` output with COLUMNS fields a line (blank lines and
    lines of unsupported fields, "[N/A]", are skipped)."""
    samples = []
    for line in text.splitlines():
        if not line.strip() or "N/A" in line:
            continue
        fields = line.split(",")
        if len(fields) != COLUMNS:
            raise ValueError(f"clocks line must have {COLUMNS} comma-separated fields (timestamp, clocks.sm, "
                             f"clocks.mem, power.draw, temperature.gpu, clocks_throttle_reasons.active), got "
                             f"{len(fields)} in {line!r}")
        try:
            reasons = int(fields[5].strip(), 16)
        except ValueError:
            raise ValueError(f"clocks line must end with a hexadecimal reason mask, got {fields[5].strip()!r} in "
                             f"{line!r}") from None
        samples.append(Sample(_number(fields[1], "MHz", line), _number(fields[3], "W", line),
                              _number(fields[4], "", line), reasons))
    return samples


def names(mask: int) -> str:
    found = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return ", ".join(found + ([hex(rest)] if rest else [])) or "none"


def summarize(samples: list[Sample]) -> str:
    """One paragraph: how many samples were busy (not idle), the SM clock over them, and each throttle reason
    seen while busy, with its samples' clock range."""
    if not samples:
        return "clocks: no samples (nvidia-smi printed none)"
    busy = [s for s in samples if not s.reasons & 0x1]
    if not busy:
        return f"clocks: {len(samples)} samples, none busy (every sample idle)"
    mhz = [s.sm_mhz for s in busy]
    parts = [f"clocks: {len(busy)} busy samples of {len(samples)}; SM clock {min(mhz):.0f}-{max(mhz):.0f} MHz "
             f"(median {statistics.median(mhz):.0f}), power up to {max(s.power_w for s in busy):.0f} W, "
             f"up to {max(s.temperature_c for s in busy):.0f} C"]
    throttled = {}
    for s in busy:
        if s.reasons:
            throttled.setdefault(names(s.reasons), []).append(s.sm_mhz)
    for reason, clocks in sorted(throttled.items()):
        parts.append(f"{len(clocks)} throttled by {reason} at {min(clocks):.0f}-{max(clocks):.0f} MHz")
    if not throttled:
        parts.append("none throttled")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="nvidia-smi's samples (the query above, csv,noheader)")
    args = ap.parse_args(argv)
    if not args.csv.is_file():
        ap.error(f"csv must be a file of nvidia-smi samples, got {str(args.csv)!r} (not found)")
    try:
        print(summarize(parse(args.csv.read_text())))
    except ValueError as e:
        print(f"bench.clocks: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
